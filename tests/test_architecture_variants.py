"""Configurations of the supported families that real checkpoints use and the tiny fixtures do not:
Phi-2's biased lm_head (TorchScript writes `Add(bias, MatMul)`), Granite's `logits_scaling` after it, and
Phi-3.5's long-context rotary scaling (longrope), whose factors switch on the sequence's length. Each is a
tiny randomly initialised transformers model exported by PyTorch, compiled paged, and generated through the
engine against onnxruntime's greedy loop on the export itself."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import numpy as np
import onnx
import pytest
from conftest import compile_to, ort_reference
from generation_utils import engine_greedy, ort_greedy

from cann_llm.compiler.om_info import display_model_info
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.feeds import causal_lm_inputs

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)


# the same sizes under GPT-2's names (GPT-J, CodeGen, GPTBigCode)
GPT_SIZES = dict(n_embd=64, n_inner=128, n_layer=2, n_head=4, vocab_size=256, n_positions=256)


def _build(config_class: str, model_class: str, *, qkv_gain: float = 1.0, sizes: dict = SIZES, **config):
    import torch
    import transformers

    torch.manual_seed(0)
    settings = getattr(transformers, config_class)(**{**sizes, **config})
    model = getattr(transformers, model_class)(settings)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("batched_mm")  # the grouped default cannot be exported
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # biases drawn, so one that a pass dropped would show
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif any(f"{part}_proj" in name for part in ("qkv", "q", "k")) or "query_key_value" in name \
                    or "Wqkv" in name:  # attention sharp enough for the rotary's angles, a softcap or ALiBi's
                param.mul_(qkv_gain)  # slopes to change the tokens
    return model.eval()


def _export(config_class: str, model_class: str, path, *, dynamo: bool, with_past: bool, opset: int | None = None,
            **settings):
    from cann_llm.models.export import export_causal_lm

    return export_causal_lm(_build(config_class, model_class, **settings), path / "model.onnx", dynamo=dynamo,
                            with_past=with_past, opset=opset)


def _contiguous_equals_onnxruntime(source, output):
    """The contiguous compile of `source`, whose logits on both backends are onnxruntime's on the export."""
    loaded = load_artifact(compile_to(source, output))
    feeds = causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"], np.arange(3, 20)[None])
    want = ort_reference(source, feeds)["logits"]
    for backend in ("onnxruntime", "reference"):
        np.testing.assert_allclose(Executor(loaded, backend).run(feeds)["logits"], want, atol=1e-4, rtol=0)
    return loaded


def _paged_equals_onnxruntime(source, om, prompts, new_tokens: int) -> None:
    got = engine_greedy(om, prompts, new_tokens, max_context_len=160, kv_cache_pages=48)
    assert got == [ort_greedy(source, prompt, new_tokens) for prompt in prompts]


@pytest.mark.parametrize("family", ["phi", "granite"])
def test_a_head_behind_its_bias_or_scale_is_found(family, tmp_path):
    """Pruned to the wanted rows in a paged compile, and kept float by --enable_compress_weight."""
    if family == "phi":  # LayerNorm, partial rotary, a parallel block, biases everywhere
        source = _export("PhiConfig", "PhiForCausalLM", tmp_path, dynamo=False, with_past=False,
                         num_key_value_heads=4, partial_rotary_factor=0.5)
    else:
        source = _export("GraniteConfig", "GraniteForCausalLM", tmp_path, dynamo=False, with_past=True,
                         embedding_multiplier=12.0, attention_multiplier=0.1, residual_multiplier=0.22,
                         logits_scaling=8.0)
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    _paged_equals_onnxruntime(source, om, [[5, 6, 7], list(range(3, 40))], 16)
    ops = Counter(n.op_type for n in load_artifact(compile_to(source, tmp_path / "int4", enable_compress_weight=True))
                  .model.graph.node)
    # every linear layer but the head: q, k and v packed, the output projection, and the MLP's two (gate and up
    # packed in Granite), a layer
    layers = SIZES["num_hidden_layers"]
    assert ops["MatMulInt4"] == 4 * layers and ops["MatMul"] == 1, ops
    paged = load_artifact(om)  # the head found: its rows gathered before it
    assert len([n for n in paged.model.graph.node if n.op_type == "Gather" and "logits_indices" in n.input]) == 1
    assert paged.output_names == ["logits"]


SWITCH = 32  # original_max_position_embeddings: past it a sequence's rotary takes the long factors


def _longrope_export(folder, opset: int | None = None):
    """Phi-3.5's longrope, its long factors far from the short ones, so a sequence rotated with the wrong
    set generates other tokens. The dynamo export (TorchScript cannot export longrope's in-place copy)."""
    half = SIZES["hidden_size"] // SIZES["num_attention_heads"] // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": SWITCH,
            "short_factor": [1.0 + 0.05 * i for i in range(half)], "long_factor": [2.0 + 0.5 * i for i in range(half)]}
    return _export("Phi3Config", "Phi3ForCausalLM", folder, dynamo=True, with_past=False, opset=opset, pad_token_id=0,
                   original_max_position_embeddings=SWITCH, rope_parameters=rope, qkv_gain=20.0)


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    folder = tmp_path_factory.mktemp("longrope")
    source = _longrope_export(folder)
    return source, compile_to(source, folder / "paged", enable_paged_attention=True)


def test_longrope_factors_follow_each_sequence_not_its_batch(longrope):
    """Batched with longer prompts, a short one keeps the short factors; a sequence whose generation crosses
    the switch is recomputed with the long ones, as transformers' Phi-3 recomputes its cache; the export
    run one sequence at a time from scratch is the reference."""
    source, om = longrope
    assert load_artifact(om).metadata["model"]["rotary_switch_length"] == SWITCH
    prompts = [[5, 6, 7], list(range(3, 3 + SWITCH - 4)), list(range(10, 10 + SWITCH + 8)), [100] * (SWITCH - 4)]
    expected = [ort_greedy(source, prompt, 12) for prompt in prompts]
    # prompt lookup drafts (the repeated prompt), never past the switch: tokens as without them
    for drafts in (0, 4):
        got = engine_greedy(om, prompts, 12, max_context_len=160, kv_cache_pages=48, num_speculative_tokens=drafts)
        assert got == expected, drafts


def test_longrope_perplexity_and_a_made_up_run_feed_the_last_positions(longrope, tmp_path):
    """`cann-run eval-ppl` and `cann-run run` build the paged feeds themselves."""
    from cann_llm.runtime.perplexity import perplexity

    source, om = longrope
    ids = list(range(3, 3 + 2 * SWITCH))
    contiguous = compile_to(source, tmp_path / "contiguous")
    want = perplexity(Executor(load_artifact(contiguous)), ids, window=SWITCH + 8, stride=SWITCH // 2).perplexity
    got = perplexity(Executor(load_artifact(om)), ids, window=SWITCH + 8, stride=SWITCH // 2).perplexity
    assert got == pytest.approx(want, rel=1e-4)
    done = subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "run", "--model", str(om), "--dymShape",
                           "input_ids:2,4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_longrope_exported_at_opset_23_is_served_paged(tmp_path):
    """At opset 23 dynamo writes ONNX's Attention op but leaves longrope's rotation in standard ops (its
    rewriter writes RotaryEmbedding for fixed tables only): the rotation is taken into the attention, its
    tables switched per sequence; the export's greedy tokens on both sides of the switch."""
    source = _longrope_export(tmp_path, opset=23)
    exported = Counter(n.op_type for n in onnx.load(source).graph.node)
    assert exported["Attention"] == SIZES["num_hidden_layers"] and exported["RotaryEmbedding"] == 0
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    assert load_artifact(om).metadata["model"]["rotary_switch_length"] == SWITCH
    prompts = [[5, 6, 7], list(range(10, 10 + SWITCH + 8))]
    got = engine_greedy(om, prompts, 12, max_context_len=160, kv_cache_pages=48)
    assert got == [ort_greedy(source, prompt, 12) for prompt in prompts]


def test_longrope_pages_are_not_shared_across_the_switch(longrope):
    """A prompt past the switch that starts with an earlier, shorter one's tokens recomputes them rotated
    its own way, not from the prefix cache, but is served from a prompt of its own side; in chunks."""
    from cann_llm import LLMEngine

    source, om = longrope
    short, long = list(range(40, 40 + SWITCH - 12)), list(range(40, 40 + SWITCH + 10))  # 20 + 8 stays short
    with LLMEngine(om, max_context_len=160, kv_cache_pages=48, max_num_batched_tokens=16) as engine:
        requests = []
        for prompt in (short, long, long):
            requests.append(engine.submit(prompt, max_new_tokens=8, temperature=0, ignore_eos=True))
            requests[-1].result()
    assert [r.stats.cached_tokens > 0 for r in requests] == [False, False, True]
    expected = [ort_greedy(source, prompt, 8) for prompt in (short, long)]
    assert [r.output_ids for r in requests] == [expected[0], expected[1], expected[1]]


@pytest.mark.parametrize("dynamo", [False, True])
def test_gpt_neox_heads_packed_one_by_one_fuse_and_generate(dynamo, tmp_path, capsys):
    """GPT-NeoX (Pythia) packs each head's q, k and v side by side in one projection: reordered into three
    blocks, its attention fuses and generates onnxruntime's tokens paged. With that pass switched off the
    attention stays as exported, and the compile says so (W10005) after its success line."""
    from cann_llm.cli.atc import run

    source = _export("GPTNeoXConfig", "GPTNeoXForCausalLM", tmp_path, dynamo=dynamo, with_past=False,
                     num_key_value_heads=4, rotary_pct=0.25)
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    ops = Counter(n.op_type for n in load_artifact(om).model.graph.node)
    assert ops["PagedAttention"] == SIZES["num_hidden_layers"] and ops["Softmax"] == 0
    _paged_equals_onnxruntime(source, om, [[5, 6, 7], list(range(3, 40))], 12)
    switch = tmp_path / "switch.cfg"
    switch.write_text("InterleavedQkvSplitPass:off\n")
    capsys.readouterr()
    status = run([f"--model={source}", "--framework=5", f"--output={tmp_path / 'unfused'}",
                  "--soc_version=Ascend910B", f"--fusion_switch_file={switch}"])
    lines = capsys.readouterr().out.splitlines()
    # W10009 too: the export made here has no tokenizer beside it
    assert status == 0 and [line.split(":")[0] for line in lines if line.startswith("W1")] == ["W10005", "W10009"]
    unfused = next(line for line in lines if line.startswith("W10005"))
    assert unfused.startswith("W10005: 2 attention block(s)") and "--log=debug" in unfused


@pytest.mark.parametrize("packing, dynamo", [("grouped", False), ("grouped", True), ("multi_query", False),
                                             ("per_head", True)])
def test_falcon_heads_packed_by_kv_group_fuse_and_generate(packing, dynamo, tmp_path):
    """Falcon-40B/180B pack q, k and v group by group (each KV group's queries, then its key and value: as
    InternLM2's wqkv), cut by a 5-D Reshape, a Slice and two Gathers; Falcon-7B's one key and value head
    follow the queries, cut by a Split of the head axis; without multi-query (Falcon-RW's layout) each head's
    q, k and v sit side by side, unbound from a 5-D Reshape. Reordered into blocks, the projection (and its
    bias) feeds the attention whole, paged and quantized, and generates onnxruntime's tokens."""
    falcon = {"grouped": dict(new_decoder_architecture=True, num_kv_heads=2, bias=True), "multi_query": {},
              "per_head": dict(multi_query=False)}[packing]
    source = _export("FalconConfig", "FalconForCausalLM", tmp_path, dynamo=dynamo, with_past=False,
                     ffn_hidden_size=128, **falcon)
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    ops = Counter(n.op_type for n in load_artifact(om).model.graph.node)
    layers = SIZES["num_hidden_layers"]
    # a layer's q/k/v projection (one, packed whole), its output projection and its MLP's two; the head
    assert ops["PagedAttention"] == layers and ops["MatMul"] == 4 * layers + 1 and ops["Softmax"] == 0, ops
    assert ops["Slice"] == ops["Split"] == 0, ops
    _paged_equals_onnxruntime(source, om, [[5, 6, 7], list(range(3, 40))], 12)
    quantized = load_artifact(compile_to(source, tmp_path / "int4", enable_compress_weight=True))
    ops = Counter(n.op_type for n in quantized.model.graph.node)
    assert ops["FusedAttention"] == layers and ops["MatMulInt4"] == 4 * layers, ops


@pytest.mark.parametrize("family, dynamo", [("gptj", False), ("gptj", True), ("codegen", False), ("codegen", True),
                                            ("gpt_bigcode", False), ("gpt_bigcode", True)])
def test_heads_rotated_before_their_transpose_or_cut_with_a_unit_head_axis_fuse_and_generate(family, dynamo, tmp_path):
    """GPT-J and CodeGen rotate q and k (pairwise, the first 8 of 16 dims) on [B, S, H, D], before the heads
    move forward; CodeGen packs q, v and k in one projection over 4 shards. GPTBigCode's multi-query
    attention (StarCoder) cuts its one key and value head from a view of the projection with a head axis of
    one. Each fuses (no Softmax left), with onnxruntime's logits on the export (contiguous, both backends),
    and generates onnxruntime's tokens paged."""
    config_class, model_class, config = {
        "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(rotary_dim=8)),
        "codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(rotary_dim=8, n_ctx=256)),
        "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(multi_query=True)),
    }[family]
    source = _export(config_class, model_class, tmp_path, dynamo=dynamo, with_past=False, qkv_gain=4.0,
                     sizes=GPT_SIZES, **config)
    contiguous = _contiguous_equals_onnxruntime(source, tmp_path / "contiguous")
    ops = Counter(n.op_type for n in contiguous.model.graph.node)
    assert ops["FusedAttention"] == GPT_SIZES["n_layer"] and ops["Softmax"] == 0, ops
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    assert Counter(n.op_type for n in load_artifact(om).model.graph.node)["PagedAttention"] == GPT_SIZES["n_layer"]
    _paged_equals_onnxruntime(source, om, [[5, 6, 7], list(range(3, 40))], 12)


def test_a_per_head_norm_after_the_rotary_fuses_and_is_served_paged(tmp_path):
    """HunYuan normalises q and k after their rotary. The rotation stays in the graph, per token, and the op
    takes the heads rotated and normalised (no rotary of its own), so paged serving rotates each flattened
    token at its own position. The rotary's last Add feeding that RmsNorm is no residual: fused into an
    AddRmsNorm it became onnxruntime's SkipSimplifiedLayerNormalization on 4-D heads, which onnxruntime refuses
    at run time. Both backends reproduce onnxruntime on the export."""
    source = _export("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", tmp_path, dynamo=False, with_past=True,
                     head_dim=16)
    loaded = _contiguous_equals_onnxruntime(source, tmp_path / "contiguous")
    norms = [n for n in loaded.model.graph.node if n.op_type in ("RmsNorm", "AddRmsNorm")]
    assert len(norms) == 2 * SIZES["num_hidden_layers"] + 1 + 2 * SIZES["num_hidden_layers"]  # and q's, k's
    attentions = [n for n in loaded.model.graph.node if n.op_type == "FusedAttention"]
    assert len(attentions) == SIZES["num_hidden_layers"]
    assert all(onnx.helper.get_attribute_value(a) == 0 for n in attentions for a in n.attribute if a.name == "rotary_dim")
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    assert Counter(n.op_type for n in load_artifact(om).model.graph.node)["PagedAttention"] == SIZES["num_hidden_layers"]
    _paged_equals_onnxruntime(source, om, [[5, 6, 7], list(range(3, 40))], 12)


def test_queries_scaled_by_position_once_rotated_fuse_and_are_served_paged(tmp_path):
    """Ministral 3 multiplies each token's rotated queries by 1 + β·log(1 + ⌊position / L⌋) (L brought down to 4
    from the released 16,384, so the factor moves within these prompts): the factor goes on the queries before
    the fused op rotates them, and paged serving gives the export's greedy tokens."""
    source = _export("Ministral3Config", "Ministral3ForCausalLM", tmp_path, dynamo=False, with_past=True,
                     head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "original_max_position_embeddings": 4, "llama_4_scaling_beta": 0.5})
    loaded = _contiguous_equals_onnxruntime(source, tmp_path / "contiguous")
    assert Counter(n.op_type for n in loaded.model.graph.node)["FusedAttention"] == SIZES["num_hidden_layers"]
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    assert Counter(n.op_type for n in load_artifact(om).model.graph.node)["PagedAttention"] == SIZES["num_hidden_layers"]
    _paged_equals_onnxruntime(source, om, [[5, 6, 7], list(range(3, 40))], 12)


def test_a_rotation_turned_the_other_way_fuses_and_is_served_paged(tmp_path):
    """nanochat's rotate_half is cat(x2, -x1), Llama's negated: read as Llama's with the sine negated
    (FlippedRotaryCanonicalizationPass), its attention fuses (q and k normalised without weights once rotated)
    and paged serving gives the export's greedy tokens."""
    source = _export("NanoChatConfig", "NanoChatForCausalLM", tmp_path, dynamo=False, with_past=True, head_dim=16)
    loaded = _contiguous_equals_onnxruntime(source, tmp_path / "contiguous")
    assert Counter(n.op_type for n in loaded.model.graph.node)["FusedAttention"] == SIZES["num_hidden_layers"]
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    assert Counter(n.op_type for n in load_artifact(om).model.graph.node)["PagedAttention"] == SIZES["num_hidden_layers"]
    _paged_equals_onnxruntime(source, om, [[5, 6, 7], list(range(3, 40))], 12)


@pytest.mark.parametrize("dynamo", [False, True])
def test_a_router_that_softmaxes_its_top_k_fuses(dynamo, tmp_path):
    """GraniteMoe routes by TopK of the logits, then a Softmax of those k: the renormalised top-k
    probabilities, which the MoE op computes from the logits. Fused, paged, onnxruntime's tokens."""
    source = _export("GraniteMoeConfig", "GraniteMoeForCausalLM", tmp_path, dynamo=dynamo, with_past=False,
                     num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    ops = Counter(n.op_type for n in load_artifact(om).model.graph.node)
    layers = SIZES["num_hidden_layers"]
    assert ops["MoE"] == ops["PagedAttention"] == layers and ops["Softmax"] == ops["TopK"] == 0, ops
    _paged_equals_onnxruntime(source, om, [[5, 6, 7], list(range(3, 40))], 12)


# ALiBi's families at the suite's sizes (each with attention sharp enough, and its init wide enough, for
# the slopes to decide tokens)
ALIBI = {
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(initializer_range=0.3)),
    "mpt": ("MptConfig", "MptForCausalLM", dict(max_seq_len=256, expansion_ratio=2, initializer_range=0.6)),
}


def _alibi_slopes(family: str, model) -> np.ndarray:
    """The slopes transformers' own modeling code builds for `model`."""
    import torch
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    heads = model.config.num_attention_heads
    if family == "mpt":
        return np.diff(build_mpt_alibi_tensor(heads, 2, model.config.attn_config.alibi_bias_max).numpy()[:, 0])[:, 0]
    return build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.float32).numpy()[:, 0, 1]


@pytest.mark.parametrize("family, dynamo", [("bloom", False), ("bloom", True), ("mpt", False), ("mpt", True)])
def test_alibi_fuses_and_generates(family, dynamo, tmp_path):
    """ALiBi adds per-head slopes times key positions to the scores: BLOOM through `baddbmm` on heads folded
    into the batch (BatchedHeadsPass unfolds them), its positions counted over the attention mask, MPT as a
    sliced constant ramp. Each fuses with the slopes transformers builds; its contiguous logits match the
    export's on both backends, also on a batch whose mask has left padding and a hole (BLOOM's keys after
    the hole move back); the paged engine generates the export's greedy tokens with the native kernel and
    the numba one."""
    config, model_class, settings = ALIBI[family]
    model = _build(config, model_class, qkv_gain=3.0, **settings)
    source = _export(config, model_class, tmp_path, dynamo=dynamo, with_past=False, qkv_gain=3.0, **settings)
    loaded = load_artifact(compile_to(source, tmp_path / "contiguous"))
    nodes = [n for n in loaded.model.graph.node if n.op_type == "FusedAttention"]
    assert len(nodes) == SIZES["num_hidden_layers"]
    for node in nodes:
        attributes = {a.name: a for a in node.attribute}
        np.testing.assert_allclose(attributes["alibi_slopes"].floats, _alibi_slopes(family, model), rtol=1e-6)
        assert attributes["alibi_from_mask"].i == 1 if family == "bloom" else "alibi_from_mask" not in attributes
    ids = np.arange(3, 43)[None]
    holes = np.ones((2, 40), np.int64)
    holes[0, :3] = holes[1, 17:20] = 0  # left padding; a hole in the middle
    for mask in (None, holes):
        tokens = ids if mask is None else np.concatenate([ids, ids + 1])
        feeds = causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"], tokens)
        if mask is not None:
            feeds["attention_mask"] = mask
        want = ort_reference(source, feeds)["logits"]
        rows = np.ones(tokens.shape, bool) if mask is None else mask.astype(bool)
        for backend in ("onnxruntime", "reference"):
            got = Executor(loaded, backend).run(feeds)["logits"]  # logits of a few units, a wide init's
            np.testing.assert_allclose(got[rows], want[rows], atol=5e-4, rtol=0)  # float32 rounding: ~3e-4
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True, enable_flash_attention=True)
    attrs = [{a.name: a for a in n.attribute} for n in load_artifact(om).model.graph.node if n.op_type == "PagedAttention"]
    assert [a["flash"].i for a in attrs] == [0, 0]  # flash_prefill attends without a bias
    prompts = [[5, 6, 7], list(range(3, 40))]
    expected = [ort_greedy(source, p, 12) for p in prompts]
    for host_attention in (False, True):
        got = engine_greedy(om, prompts, 12, max_context_len=160, kv_cache_pages=48, host_attention=host_attention)
        assert got == expected, host_attention


def test_a_model_exported_at_opset_14_compiles_to_an_artifact_that_runs(tmp_path):
    """TorchScript at opset 14 (an opset users still pick): the attention's lowering reads lengths without
    Shape's start and end (opset 15), so the contiguous artifact loads and matches onnxruntime on the export,
    and the paged one generates its greedy tokens."""
    from cann_llm.models.export import export_causal_lm

    source = export_causal_lm(_build("LlamaConfig", "LlamaForCausalLM"), tmp_path / "model.onnx", dynamo=False,
                              with_past=True, opset=14)
    loaded = _contiguous_equals_onnxruntime(source, tmp_path / "contiguous")
    assert Counter(n.op_type for n in loaded.model.graph.node)["FusedAttention"] == SIZES["num_hidden_layers"]
    _paged_equals_onnxruntime(source, compile_to(source, tmp_path / "paged", enable_paged_attention=True),
                              [[5, 6, 7], list(range(3, 40))], 8)


def test_a_model_exported_at_opset_12_compiles_to_an_artifact_that_runs(tmp_path):
    """TorchScript at opset 12 (eager attention): the compile raises the graph to opset 13, the forms the cann
    ops' lowerings write (the artifact was refused at load), and reads the converter's flattened Softmax as
    the softmax over the last axis it is: the attention fuses, contiguous and paged, with onnxruntime's
    numbers and tokens on the export."""
    from cann_llm.models.export import export_causal_lm

    source = export_causal_lm(_build("LlamaConfig", "LlamaForCausalLM", attn_implementation="eager"),
                              tmp_path / "model.onnx", dynamo=False, with_past=True, opset=12)
    loaded = _contiguous_equals_onnxruntime(source, tmp_path / "contiguous")
    assert next(o.version for o in loaded.model.opset_import if o.domain == "") >= 13
    assert Counter(n.op_type for n in loaded.model.graph.node)["FusedAttention"] == SIZES["num_hidden_layers"]
    _paged_equals_onnxruntime(source, compile_to(source, tmp_path / "paged", enable_paged_attention=True),
                              [[5, 6, 7], list(range(3, 40))], 8)


@pytest.mark.parametrize("config_class,model_class,config", [
    ("LlamaConfig", "LlamaForCausalLM", {}),
    # the whole head rotated, then its empty rest concatenated: cat([rope(q), q[..., head_dim:]])
    ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0})])
def test_a_dynamo_export_without_its_optimizer_fuses_and_generates(config_class, model_class, config, tmp_path):
    """`torch.onnx.export(dynamo=True, optimize=False)` keeps what the optimizer would fold: CastLike (a
    function op onnxruntime expands, read as Cast), Constants given as value_float (float32, not the float64
    graphsurgeon's folding made of them), whole-axis Slices (`x[:, :]`, dropped) and empty ones (Phi-3's)."""
    from cann_llm.models.export import export_causal_lm

    source = export_causal_lm(_build(config_class, model_class, **config), tmp_path / "model.onnx", dynamo=True,
                              with_past=True, optimize=False)
    assert {"CastLike", "Slice"} <= {n.op_type for n in onnx.load(source).graph.node}
    loaded = _contiguous_equals_onnxruntime(source, tmp_path / "contiguous")
    assert Counter(n.op_type for n in loaded.model.graph.node)["FusedAttention"] == SIZES["num_hidden_layers"]
    _paged_equals_onnxruntime(source, compile_to(source, tmp_path / "paged", enable_paged_attention=True),
                              [[5, 6, 7], list(range(3, 40))], 8)


@pytest.mark.parametrize("config_class,model_class,dynamo,mask", [
    ("LlamaConfig", "LlamaForCausalLM", True, False),  # Range(0, Shape(input_ids)[1])
    ("LlamaConfig", "LlamaForCausalLM", False, True),  # TorchScript reads the length off the embedding lookup
    ("GPT2Config", "GPT2LMHeadModel", True, False),  # learned positions: no rotary tables to search from
])
def test_an_export_of_the_tokens_alone_compiles_paged(config_class, model_class, dynamo, mask, tmp_path):
    """The export tutorials show: the logits of `input_ids` (and its mask), no positions or cache. The graph
    counts its positions itself (`Range(0, S)`, S read from input_ids' shape); a paged compile takes them as
    the `position_ids` input every paged artifact has, and generates the export's greedy tokens. (TorchScript
    cannot export input_ids alone: transformers' mask code calls `aten::diff`.)"""
    import torch

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask=None):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    names = ["input_ids", "attention_mask"] if mask else ["input_ids"]
    # GPT-2 drawn wider than its 0.02 default, so its greedy tokens do not settle on one at once
    sizes, settings = (GPT_SIZES, {"initializer_range": 0.3}) if model_class.startswith("GPT2") else (SIZES, {})
    model = Logits(_build(config_class, model_class, sizes=sizes, **settings))
    sample = tuple(torch.ones(1, 5, dtype=torch.int64) * (5 if name == "input_ids" else 1) for name in names)
    source = tmp_path / "model.onnx"
    if dynamo:
        torch.onnx.export(model, sample, str(source), input_names=names, output_names=["logits"], dynamo=True,
                          dynamic_shapes={name: {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}
                                          for name in names})
    else:
        torch.onnx.export(model, sample, str(source), input_names=names, output_names=["logits"], opset_version=17,
                          dynamo=False, dynamic_axes={name: {0: "batch", 1: "seq"} for name in names + ["logits"]})
    assert [i.name for i in onnx.load(source).graph.input] == names
    _paged_equals_onnxruntime(source, compile_to(source, tmp_path / "paged", enable_paged_attention=True),
                              [[5, 6, 7], list(range(3, 40))], 8)


def test_alibi_computed_in_bfloat16_compiles_to_float32_arithmetic(tmp_path, capsys):
    """Falcon-RW under transformers 5 computes its ALiBi term in bfloat16 (onnxruntime's CPU kernels cannot run
    the export): compiled to float32 arithmetic (W10006), its attention fuses with the slopes bfloat16 holds
    (transformers' own, scaled as the scores are), and its logits are the torch model's but for that term's
    rounding, with the same argmax at every position."""
    import torch
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    from cann_llm.cli.atc import run
    from cann_llm.models.export import export_causal_lm

    model = _build("FalconConfig", "FalconForCausalLM", ffn_hidden_size=128, alibi=True, multi_query=False)
    source = export_causal_lm(model, tmp_path / "model.onnx", dynamo=True, with_past=False)
    capsys.readouterr()
    assert run([f"--model={source}", "--framework=5", f"--output={tmp_path / 'contiguous'}",
                "--soc_version=Ascend910B"]) == 0
    said = capsys.readouterr().out
    assert "W10006: the model computes in bfloat16" in said and "its weights are stored as float32" in said
    loaded = load_artifact(tmp_path / "contiguous.om")
    assert {t.data_type for t in loaded.model.graph.initializer if len(t.dims) == 2} == {onnx.TensorProto.FLOAT}
    fused = [n for n in loaded.model.graph.node if n.op_type == "FusedAttention"]
    assert len(fused) == SIZES["num_hidden_layers"]
    heads, head_dim = SIZES["num_attention_heads"], SIZES["hidden_size"] // SIZES["num_attention_heads"]
    slopes = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.float32).numpy()[:, 0, 1]
    settings = {a.name: a for a in fused[0].attribute}
    np.testing.assert_allclose(settings["alibi_slopes"].floats, slopes / head_dim**0.5, rtol=1e-6)
    ids = np.arange(3, 60)[None]
    feeds = causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"], ids)
    got = Executor(loaded, "onnxruntime").run(feeds)["logits"]
    with torch.no_grad():
        want = model(torch.from_numpy(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-2, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("dynamo", [False, True])
def test_gemma3_norms_after_the_head_transpose_fuse(dynamo, tmp_path):
    """Gemma 3 normalises each q and k head after the (0, 2, 1, 3) transpose, where Qwen3 does before it;
    with its sliding-window layers between the full ones, past the window."""
    source = _export("Gemma3TextConfig", "Gemma3ForCausalLM", tmp_path, dynamo=dynamo, with_past=False,
                     head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                     query_pre_attn_scalar=16)
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    ops = Counter(n.op_type for n in load_artifact(om).model.graph.node)
    assert ops["PagedAttention"] == SIZES["num_hidden_layers"] and ops["Softmax"] == 0
    _paged_equals_onnxruntime(source, om, [[5, 6, 7], list(range(3, 40))], 12)


@pytest.fixture(scope="module")
def gemma3n(tmp_path_factory):
    """`gemma3n(dynamo)`: Gemma 3n's export (4 layers, sliding and full alternating, the last 2 reusing earlier
    caches, with a cache), made once a module; its first layer keeps the top 5% of the MLP's activations where
    the exporter can write that (TorchScript: dynamo cannot convert the sparsity's icdf)."""
    made = {}

    def export(dynamo: bool):
        if dynamo not in made:
            sparsity = [0.0] * 4 if dynamo else [0.95, 0.0, 0.0, 0.0]
            made[dynamo] = _export("Gemma3nTextConfig", "Gemma3nForCausalLM", tmp_path_factory.mktemp("gemma3n"),
                                   dynamo=dynamo, with_past=True, head_dim=16, num_hidden_layers=4, sliding_window=16,
                                   layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                                   vocab_size_per_layer_input=256, hidden_size_per_layer_input=8, laurel_rank=8,
                                   activation_sparsity_pattern=sparsity, qkv_gain=4.0)
        return made[dynamo]
    return export


@pytest.mark.parametrize("dynamo", [False, True])
def test_gemma3n_fuses_and_generates_with_its_last_layers_reusing_earlier_caches(dynamo, gemma3n, tmp_path):
    """Gemma 3n: every RMSNorm written x · (mean(x²) + eps) ** -0.5 (q, k and v per head, AltUp's router norm
    twice a layer, the per-layer inputs'); sliding and full layers alternating; its last layers attend to the
    keys and values of the last earlier layer of their kind and export no cache of their own; its first layer
    keeps the top 5% of the MLP's activations (TorchScript alone exports that)."""
    layers, shared = 4, 2
    source = gemma3n(dynamo)
    assert sum(i.name.startswith("past_key_values") for i in onnx.load(source).graph.input) == 2 * (layers - shared)
    loaded = load_artifact(compile_to(source, tmp_path / "contiguous"))
    fused = [n for n in loaded.model.graph.node if n.op_type == "FusedAttention"]
    # the reusing layers read their owners' projections and past, and write no present
    assert [n.input[3] for n in fused] == [f"past_key_values.{i}.key" for i in (0, 1, 0, 1)]
    assert [len([o for o in n.output if o]) for n in fused] == [3, 3, 1, 1]
    feeds = causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"], np.arange(3, 43)[None])
    want = ort_reference(source, feeds)["logits"]
    for backend in ("onnxruntime", "reference"):
        np.testing.assert_allclose(Executor(loaded, backend).run(feeds)["logits"], want, atol=1e-4, rtol=0)
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    ops = Counter(n.op_type for n in load_artifact(om).model.graph.node)
    assert ops["PagedAttention"] == layers and ops["Softmax"] == 0
    # 11 a layer (input, q, k, v, post-attention, pre- and post-MLP, LAuReL's, the router's twice, the per-layer
    # input's), less k's and v's in the reusing layers, then the per-layer projection's and the final one
    assert ops["RmsNorm"] + ops["AddRmsNorm"] == 11 * layers - 2 * shared + 2
    _paged_equals_onnxruntime(source, om, [[5, 6, 7], list(range(3, 40))], 12)
    with pytest.raises(AtcError, match="E10055.*earlier layer's keys"):  # a stage would read another's projections
        compile_to(source, tmp_path / "stages", enable_paged_attention=True, pipeline_stages=2)


@pytest.mark.parametrize("dynamo", [False, True])
def test_gemma4_layers_of_two_sizes_fuse_and_generate(dynamo, tmp_path):
    """Gemma 4's text model: its full-attention layers have twice the head size and half the KV heads of its
    sliding ones and reuse their keys as values (attention_k_eq_v; its optimiser then merges the k and v
    norms), its last layers attend to earlier layers' caches; the page pool holds each layer's sizes."""
    layers, shared = 4, 2
    source = _export("Gemma4TextConfig", "Gemma4ForCausalLM", tmp_path, dynamo=dynamo, with_past=True, head_dim=16,
                     global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, num_hidden_layers=layers,
                     sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2,
                     num_kv_shared_layers=shared, vocab_size_per_layer_input=256, hidden_size_per_layer_input=8,
                     qkv_gain=4.0)
    loaded = load_artifact(compile_to(source, tmp_path / "contiguous"))
    assert sum(n.op_type == "FusedAttention" for n in loaded.model.graph.node) == layers
    feeds = causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"], np.arange(3, 43)[None])
    want = ort_reference(source, feeds)["logits"]
    for backend in ("onnxruntime", "reference"):
        np.testing.assert_allclose(Executor(loaded, backend).run(feeds)["logits"], want, atol=1e-4, rtol=0)
    assert loaded.metadata["model"]["layer_kv"] == [[2, 16], [1, 32]]  # its two caches, as the past inputs have them
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    paged = load_artifact(om)
    assert paged.metadata["model"]["layer_kv"] == [[2, 16], [1, 32], [2, 16], [1, 32]]
    assert "kv_sizes[2x16, 1x32, 2x16, 1x32]" in display_model_info(paged.om)  # atc --mode=6
    ops = Counter(n.op_type for n in paged.model.graph.node)
    assert ops["PagedAttention"] == layers and ops["Softmax"] == 0
    _paged_equals_onnxruntime(source, om, [[5, 6, 7], list(range(3, 40))], 12)
    with pytest.raises(AtcError, match="E10055.*differ in size"):  # each stage sizes and reads its own layers
        compile_to(source, tmp_path / "stages", enable_paged_attention=True, pipeline_stages=2)


def test_a_layer_reusing_the_cache_of_a_layer_that_did_not_fuse_runs_as_exported(gemma3n, tmp_path, monkeypatch):
    """Where the first full layer's attention stays unfused, the layer reusing its cache stays so too (taking
    that cache over would leave the earlier layer reading the later one's op), and the rest fuse."""
    from cann_llm.passes.fuse_attention import FuseAttention

    source = gemma3n(dynamo=True)
    first_full = [n.name for n in onnx.load(source).graph.node if n.op_type == "Softmax"][1]
    match = FuseAttention.match
    monkeypatch.setattr(FuseAttention, "match", lambda self, graph, softmax: "refused here" if softmax.name == first_full
                        else match(self, graph, softmax))
    loaded = load_artifact(compile_to(source, tmp_path / "contiguous"))
    fused = [n for n in loaded.model.graph.node if n.op_type == "FusedAttention"]
    assert [n.input[3] for n in fused] == ["past_key_values.0.key", "past_key_values.0.key"]  # layers 0 and 2
    feeds = causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"], np.arange(3, 43)[None])
    want = ort_reference(source, feeds)["logits"]
    np.testing.assert_allclose(Executor(loaded, "onnxruntime").run(feeds)["logits"], want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dynamo", [False, True])
def test_gpt_oss_sinks_join_the_fused_softmax_and_generate(dynamo, tmp_path):
    """gpt-oss (eager attention, transformers' only one for it): a learned sink logit a head joins each row's
    softmax and is dropped after it; its rotation is written on each head's two halves; sliding-window
    layers between full ones. Its experts' clamped SwiGLU stays as exported."""
    import torch

    from cann_llm.models.export import export_causal_lm

    model = _build("GptOssConfig", "GptOssForCausalLM", qkv_gain=4.0, head_dim=16, num_local_experts=4,
                   num_experts_per_tok=2, intermediate_size=32, sliding_window=16,
                   layer_types=["sliding_attention", "full_attention"])
    with torch.no_grad():
        for layer in model.model.layers:  # sinks large enough to take a real share of each softmax
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 3.0, layer.self_attn.sinks.numel()))
    source = export_causal_lm(model, tmp_path / "model.onnx", dynamo=dynamo, with_past=True)
    loaded = load_artifact(compile_to(source, tmp_path / "contiguous"))
    fused = [n for n in loaded.model.graph.node if n.op_type == "FusedAttention"]
    assert len(fused) == SIZES["num_hidden_layers"]
    for node in fused:
        sinks = next(a.floats for a in node.attribute if a.name == "sinks")
        np.testing.assert_allclose(sinks, np.linspace(-1.0, 3.0, SIZES["num_attention_heads"]), rtol=1e-6)
    feeds = causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"], np.arange(3, 43)[None])
    want = ort_reference(source, feeds)["logits"]
    for backend in ("onnxruntime", "reference"):
        np.testing.assert_allclose(Executor(loaded, backend).run(feeds)["logits"], want, atol=1e-4, rtol=0)
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True, enable_flash_attention=True)
    nodes = [n for n in load_artifact(om).model.graph.node if n.op_type == "PagedAttention"]
    assert len(nodes) == SIZES["num_hidden_layers"]
    assert [next(a.i for a in n.attribute if a.name == "flash") for n in nodes] == [0, 0]  # flash has no sinks
    _paged_equals_onnxruntime(source, om, [[5, 6, 7], list(range(3, 40))], 12)


@pytest.mark.parametrize("dynamo", [False, True])
def test_gemma2_softcapped_attention_fuses_and_generates(dynamo, tmp_path):
    """Gemma 2 (transformers' default attention for it is eager): scores capped by c·tanh(s / c), a final
    logit softcap after the head, sliding-window layers between full ones; the native kernel, the numba one
    (`host_attention`) and a flash compile (which leaves capped layers to the native kernel) all generate
    onnxruntime's tokens, past the window."""
    source = _export("Gemma2Config", "Gemma2ForCausalLM", tmp_path, dynamo=dynamo, with_past=False, head_dim=16,
                     sliding_window=16, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                     attn_logit_softcapping=5.0, final_logit_softcapping=3.0, qkv_gain=20.0)
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True, enable_flash_attention=True)
    nodes = [n for n in load_artifact(om).model.graph.node if n.op_type == "PagedAttention"]
    attributes = [{a.name: a for a in n.attribute} for n in nodes]
    assert len(nodes) == SIZES["num_hidden_layers"] and [a["softcap"].f for a in attributes] == [5.0, 5.0]
    assert [a["flash"].i for a in attributes] == [0, 0]
    # the fused op's own reference and its onnxruntime lowering, contiguous, on a prompt past the window
    loaded = load_artifact(compile_to(source, tmp_path / "contiguous"))
    feeds = causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"], np.arange(3, 43)[None])
    want = ort_reference(source, feeds)["logits"]
    for backend in ("onnxruntime", "reference"):
        np.testing.assert_allclose(Executor(loaded, backend).run(feeds)["logits"], want, atol=1e-4, rtol=0)
    prompts = [[5, 6, 7], list(range(3, 40))]
    expected = [ort_greedy(source, prompt, 12) for prompt in prompts]
    for host_attention in (False, True):
        got = engine_greedy(om, prompts, 12, max_context_len=160, kv_cache_pages=48, host_attention=host_attention)
        assert got == expected, host_attention


def test_an_export_with_a_cache_and_no_position_ids_is_served_paged(tmp_path):
    """An export of `input_ids`, the mask and the cache alone: transformers 5 counts its positions as
    `Range(0, S)` plus the past's length, which a paged compile reads from a position_ids input instead."""
    from cann_llm.models.export import export_causal_lm

    source = export_causal_lm(_build("LlamaConfig", "LlamaForCausalLM"), tmp_path / "model.onnx", dynamo=True,
                              with_past=True, positions=False)
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    paged = load_artifact(om)
    assert Counter(n.op_type for n in paged.model.graph.node)["PagedAttention"] == SIZES["num_hidden_layers"]
    assert "position_ids" in [i.name for i in paged.model.graph.input]
    _paged_equals_onnxruntime(source, om, [[5, 6, 7], list(range(3, 40))], 12)


def _export_legacy(model, path, dynamo: bool, with_past: bool = True):
    """`model` (cann_llm/models/legacy_llama.py) exported with its flat cache, Optimum's names, dynamic shapes.
    The ALiBi styles take no positions, and their remote code runs a past only under one new token: traced so."""
    import torch

    from cann_llm.models.export import io_names
    from cann_llm.models.legacy_llama import ALIBI_STYLES

    alibi = model.style in ALIBI_STYLES
    inputs, outputs = io_names(len(model.layers), with_past=with_past)
    inputs = [name for name in inputs if not (alibi and name == "position_ids")]
    head_dim = model.layers[0].self_attn.head_dim
    held, new = (3 if with_past else 0), (1 if alibi and with_past else 5)
    past = [torch.randn(2, model.kv_heads, held, head_dim) for name in inputs if name.startswith("past_key_values")]
    positions = () if alibi else (torch.arange(held, held + new)[None].repeat(2, 1),)
    args = (torch.randint(0, 256, (2, new)), torch.ones(2, held + new, dtype=torch.long), *positions, *past)
    with torch.no_grad():
        if dynamo:
            dynamic = torch.export.Dim.DYNAMIC
            rest = ({0: dynamic, 1: dynamic},) * len(positions) + tuple({0: dynamic, 2: dynamic} for _ in past)
            shapes = ({0: dynamic, 1: dynamic}, {0: dynamic, 1: dynamic}, *([rest] if rest else []))  # (ids, mask, *rest)
            torch.onnx.export(model, args, input_names=inputs, output_names=outputs, dynamic_shapes=shapes,
                              dynamo=True).save(str(path))
        else:
            axes = {"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "t"}, "position_ids": {0: "b", 1: "s"},
                    **{name: {0: "b", 2: "p"} for name in inputs if name.startswith("past_key_values")}}
            torch.onnx.export(model, args, str(path), input_names=inputs, output_names=outputs, dynamic_axes=axes,
                              dynamo=False, opset_version=17)
    return path


@pytest.mark.parametrize("style, dynamo", [("baichuan", False), ("internlm", False), ("internlm", True),
                                          ("internlm2", True)])
def test_the_older_llama_lineages_remote_code_is_served_paged(style, dynamo, tmp_path):
    """Baichuan-7B's, InternLM-7B's (biased projections) and InternLM2's remote code: masked scores floored at the
    lowest float before the softmax, and rotary tables of `[1, 1, max_positions, dim]` sliced on their third
    axis to the length the past's shape gives. Fused and read whole, each layer's attention is paged; the
    model's own greedy tokens."""
    from cann_llm.models.legacy_llama import build_legacy_model, greedy

    model = build_legacy_model(style)
    source = _export_legacy(model, tmp_path / "model.onnx", dynamo)
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    assert Counter(n.op_type for n in load_artifact(om).model.graph.node)["PagedAttention"] == len(model.layers)
    prompts = [[5, 6, 7], list(range(3, 40))]
    got = engine_greedy(om, prompts, 12, max_context_len=160, kv_cache_pages=48)
    assert got == [greedy(model, prompt, 12) for prompt in prompts]


@pytest.mark.parametrize("style, dynamo, with_past", [("baichuan13b", False, True), ("baichuan2_13b", False, True),
                                                     ("baichuan2_13b", True, False)])
def test_alibi_kept_with_the_causal_mask_in_one_buffer_is_served_paged(style, dynamo, with_past, tmp_path):
    """Baichuan-13B's and Baichuan2-13B's remote code: ALiBi and the causal mask in one [H, L, L] buffer,
    sliced to the keys and added to the scores (its last row under one new token; Baichuan2 adds its own
    spelling of the padding mask first). Exported as the remote code runs: with a cache, traced under one new
    token; or without one. Each attention fuses with the remote code's slopes and no per-head mask; a
    contiguous compile of the cache-less export gives its logits on a batch with left padding and a hole;
    the paged engine gives the model's own greedy tokens, which the slopes decide."""
    import torch

    from cann_llm.models.legacy_llama import _alibi_slopes, build_legacy_model, greedy

    model = build_legacy_model(style)
    source = _export_legacy(model, tmp_path / "model.onnx", dynamo, with_past)
    loaded = load_artifact(compile_to(source, tmp_path / "contiguous"))
    nodes = [n for n in loaded.model.graph.node if n.op_type == "FusedAttention"]
    assert len(nodes) == len(model.layers)
    for node in nodes:
        np.testing.assert_allclose({a.name: a for a in node.attribute}["alibi_slopes"].floats, _alibi_slopes(4), rtol=1e-6)
    if not with_past:
        ids = np.arange(3, 43)[None]
        holes = np.ones((2, 40), np.int64)
        holes[0, :3] = holes[1, 17:20] = 0  # left padding; a hole in the middle
        feeds = {"input_ids": np.concatenate([ids, ids + 1]), "attention_mask": holes}
        want = ort_reference(source, feeds)["logits"]
        got = Executor(loaded, "onnxruntime").run(feeds)["logits"]
        np.testing.assert_allclose(got[holes.astype(bool)], want[holes.astype(bool)], atol=5e-4, rtol=0)
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    assert Counter(n.op_type for n in load_artifact(om).model.graph.node)["PagedAttention"] == len(model.layers)
    prompts = [[5, 6, 7], list(range(3, 40))]
    expected = [greedy(model, prompt, 12) for prompt in prompts]
    assert engine_greedy(om, prompts, 12, max_context_len=160, kv_cache_pages=48) == expected
    with torch.no_grad():  # the slopes decide tokens: the causal mask alone gives others
        model.future_mask.copy_(torch.where(torch.isinf(model.future_mask), model.future_mask, 0))
    assert [greedy(model, prompt, 12) for prompt in prompts] != expected


@pytest.fixture(scope="module")
def chatglm(tmp_path_factory):
    """ChatGLM2/3's remote code (cann_llm/models/chatglm.py) and its TorchScript exports with and without a cache."""
    from cann_llm.models.chatglm import build_chatglm, export

    folder = tmp_path_factory.mktemp("chatglm")
    model = build_chatglm()
    return model, export(model, folder / "past.onnx", with_past=True), export(model, folder / "cacheless.onnx",
                                                                               with_past=False)


@pytest.mark.parametrize("with_past", [True, False], ids=["cache", "cacheless"])
def test_a_sequence_first_model_fuses_and_generates_contiguous_and_paged(chatglm, with_past, tmp_path):
    """ChatGLM2's and ChatGLM3's remote code computes sequence-first ([S, B, hidden]), keeps its cache [past,
    batch, groups, head dim], rotates pairs of a [..., R/2, 2] view and repeats its two groups by Expand:
    every attention fuses, the artifact's cache is [batch, groups, past, head dim] as every cache it runs,
    and the contiguous and the paged engine generate the model's own greedy tokens (INT4 too, paged)."""
    from cann_llm.models.chatglm import LAYERS, SEQ_LENGTH, greedy

    model, past, cacheless = chatglm
    source = past if with_past else cacheless
    prompts = [[5, 6, 7], list(range(3, 40))]
    expected = [greedy(model, prompt, 12) for prompt in prompts]
    for flags in ({}, {"enable_paged_attention": True}):
        om = compile_to(source, tmp_path / f"m{len(flags)}", **flags)
        loaded = load_artifact(om)
        ops = Counter(n.op_type for n in loaded.model.graph.node)
        assert ops["PagedAttention" if flags else "FusedAttention"] == LAYERS and ops["Softmax"] == 0, ops
        # its rotary cache has SEQ_LENGTH rows of (cos, sin) pairs: the positions it can read
        assert loaded.metadata["model"]["max_positions"] == SEQ_LENGTH
        if with_past and not flags:
            shapes = {v["name"]: v["shape"] for v in loaded.metadata["signature"]["inputs"]}
            assert shapes["past_key_values.0.key"] == ["b", 2, "p", 16]
        if with_past or flags:  # a contiguous artifact without a cache generates by recomputing: not an engine's
            assert engine_greedy(om, prompts, 12, max_context_len=160, kv_cache_pages=48) == expected
    int4 = compile_to(source, tmp_path / "int4", enable_paged_attention=True, enable_compress_weight=True)
    assert Counter(n.op_type for n in load_artifact(int4).model.graph.node)["MatMulInt4"] == 4 * LAYERS


def test_glm4s_remote_code_fuses_and_generates_contiguous_and_paged(tmp_path):
    """GLM-4-9B-Chat's remote code: ChatGLM3's model batch-first, the heads moved to the front before its
    rotation of pairs, whose table `[B, S, R/2, 2]` q and k each view `[B, 1, S, R/2, 2]`: one table for
    both, every attention fused, and the model's own greedy tokens, contiguous and paged."""
    from cann_llm.models.chatglm import LAYERS, build_chatglm, export, greedy

    model = build_chatglm(style="glm4")
    source = export(model, tmp_path / "glm4.onnx", with_past=True)
    prompts = [[5, 6, 7], list(range(3, 40))]
    expected = [greedy(model, prompt, 12) for prompt in prompts]
    for flags in ({}, {"enable_paged_attention": True}):
        om = compile_to(source, tmp_path / f"m{len(flags)}", **flags)
        ops = Counter(n.op_type for n in load_artifact(om).model.graph.node)
        assert ops["PagedAttention" if flags else "FusedAttention"] == LAYERS and ops["Softmax"] == 0, ops
        assert engine_greedy(om, prompts, 12, max_context_len=160, kv_cache_pages=48) == expected


def test_a_sequence_first_cache_step_gives_the_exports_logits_and_cache(chatglm, tmp_path):
    """One step over a past with left padding: the contiguous artifact's logits are the export's, and its
    present keys and values the export's moved to [batch, groups, length, head dim]."""
    from cann_llm.models.chatglm import GROUPS, HEAD_DIM, LAYERS

    _, source, _ = chatglm
    loaded = load_artifact(compile_to(source, tmp_path / "contiguous"))
    rng = np.random.default_rng(0)
    mask = np.ones((2, 9), np.int64)
    mask[0, :2] = 0
    feeds = {"input_ids": np.array([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]]), "position_ids": np.array([[1, 2, 3, 4, 5],
             [4, 5, 6, 7, 8]]), "attention_mask": mask}
    past = {f"past_key_values.{i}.{kind}": rng.standard_normal((4, 2, GROUPS, HEAD_DIM)).astype(np.float32)
            for i in range(LAYERS) for kind in ("key", "value")}
    want = ort_reference(source, {**feeds, **past})
    got = Executor(loaded, "onnxruntime").run({**feeds, **{k: v.transpose(1, 2, 0, 3) for k, v in past.items()}})
    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-5, rtol=0)
    for name in (n.replace("past_key_values", "present") for n in past):
        np.testing.assert_allclose(got[name], want[name].transpose(1, 2, 0, 3), atol=1e-6, rtol=0)


def test_a_sequence_first_cache_whose_attention_does_not_fuse_is_refused_by_name(chatglm, tmp_path):
    """With the attention fusion switched off, the cache would be read with its batch axis taken for the
    groups: E10055 names the layout (it asked for --input_shape)."""
    from cann_llm.runtime.errors import AtcError

    switch = tmp_path / "switch.cfg"
    switch.write_text("AttentionFusionPass:off\n")
    with pytest.raises(AtcError) as refused:
        compile_to(chatglm[1], tmp_path / "refused", fusion_switch_file=str(switch))
    assert refused.value.code == "E10055"
    assert "past_key_values.0.key is laid out ['p', 'b', 2, 16], sequence-first" in str(refused.value)


def test_logits_of_the_last_position_alone_are_served_paged(chatglm, tmp_path):
    """`return_last_logit=True` (what the remote code's generate asks for) cuts the hidden states to the last
    position before the head: a paged step wants each sequence's last token, which logits_indices picks, so
    the cut goes (its rows were picked twice, out of bounds at the first step)."""
    from cann_llm.models.chatglm import export, greedy

    model = chatglm[0]
    om = compile_to(export(model, tmp_path / "last.onnx", last_logit=True), tmp_path / "paged",
                    enable_paged_attention=True)
    prompts = [[5, 6, 7], list(range(3, 40))]
    assert engine_greedy(om, prompts, 12, max_context_len=160, kv_cache_pages=48) == \
        [greedy(model, prompt, 12) for prompt in prompts]


def test_a_cache_export_traced_with_one_new_token_is_refused_paged_saying_how_to_export_it(chatglm, tmp_path,
                                                                                           capsys):
    """ChatGLM's remote code builds no mask for one new token over a cache, so a trace of one leaves none:
    its attention fuses without a causal mask, which a paged compile refuses, saying to trace several."""
    from cann_llm.cli.atc import run
    from cann_llm.models.chatglm import export
    from cann_llm.runtime.errors import AtcError

    source = export(chatglm[0], tmp_path / "one.onnx", with_past=True, new_tokens=1)
    with pytest.raises(AtcError) as refused:
        compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    assert refused.value.code == "E10055"
    assert "(an export traced with one new token over its cache has none: trace it with several)" in str(refused.value)
    # a contiguous compile runs it as exported, prompts attending every key, and says so
    status = run([f"--model={source}", "--framework=5", f"--output={tmp_path / 'contiguous'}",
                  "--soc_version=Ascend910B"])
    out = capsys.readouterr().out
    assert status == 0 and "W10012: 2 attention block(s) read a KV cache and hide no key" in out


@pytest.mark.parametrize("dynamo", [False, True])
def test_an_mlp_with_biases_fuses_its_swiglu(dynamo, tmp_path):
    """A Llama with `mlp_bias` (and `attention_bias`): gate and up are each x·W + b; one SwiGlu a layer over
    one merged projection and one merged bias, q, k and v packed with theirs, and the export's greedy tokens
    paged; INT4 keeps the biases outside its matmuls."""
    source = _export("LlamaConfig", "LlamaForCausalLM", tmp_path, dynamo=dynamo, with_past=True, mlp_bias=True,
                     attention_bias=True)
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    layers = SIZES["num_hidden_layers"]
    ops = Counter(n.op_type for n in load_artifact(om).model.graph.node)
    assert ops["SwiGlu"] == layers and ops["PagedAttention"] == layers, ops
    _paged_equals_onnxruntime(source, om, [[5, 6, 7], list(range(3, 40))], 16)
    int4 = Counter(n.op_type for n in load_artifact(compile_to(source, tmp_path / "int4", enable_compress_weight=True,
                                                                enable_paged_attention=True)).model.graph.node)
    # q, k and v packed, the output projection, gate and up packed, down: four a layer
    assert int4["SwiGlu"] == layers and int4["MatMulInt4"] == 4 * layers, int4
