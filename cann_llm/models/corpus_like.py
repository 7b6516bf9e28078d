"""Exports in ../shared/corpus's layout for the families it holds back (Mistral, GLM, Phi-3, Gemma, Qwen2-MoE,
Qwen3-MoE, GPT-2), made the way its README says its exports were made, so tests/test_corpus.py can be run
over them before anyone else does:

    python -m cann_llm.models.corpus_like --out .cache/corpus-like
    CANN_LLM_CORPUS=.cache/corpus-like python -m pytest -n 2 tests/test_corpus.py

`--families` also takes the architectures users bring beyond them (`ARCHITECTURES`: Llama 3.2's rope
scaling, Phi-3.5's longrope, Gemma 2 and 3, GLM-4, Granite, GraniteMoe, OLMo, OLMo-2, OLMo 3, SmolLM3, EXAONE 4,
Nemotron, Ministral 3, nanochat, HunYuan (dense and MoE), Mixtral, Phi-2, StableLM, GPT-NeoX, Falcon, BLOOM, MPT, OPT,
GPT-J, CodeGen, GPTBigCode, DeepSeek-V2, DeepSeek-V3, MiniCPM3 and GLM-4.7-Flash (multi-head latent attention),
and the hybrids Qwen3.5, Qwen3-Next, LFM2, Granite 4.0-H, Bamba, Nemotron-H, Falcon-H1 and Zamba2), in the same
sizes and layout.

Each folder holds `model.onnx`, `reference.npz` (the torch model's outputs on the corpus's two cases, a
left-padded batch and a second shape) and a `meta.json` with the fields the tests read. An export the
exporter refuses leaves a folder with only its `meta.json` (status `failed`), as in the corpus.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import click
import numpy as np

from cann_llm.models.export import cache_entries, cache_layers, export_causal_lm, io_names
from cann_llm.models.recurrent_export import (NO_CACHE_TYPES, RECURRENT_TYPES, routed_through_onnxruntime,
                                              state_shapes)
from cann_llm.models.tiny import TINY_FAMILIES, TinySpec

HELD_BACK = ("mistral", "glm", "phi3", "gemma", "qwen2_moe", "qwen3_moe", "gpt2")
EXPORTS = {"ts": (False, False), "ts-kv": (False, True), "dynamo": (True, False), "dynamo-kv": (True, True)}
# the corpus's sizes: hidden 64, 4 heads, 2 KV heads, head_dim 16, 2 layers, intermediate 128, vocab 512
_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=512)
_GPT2_SIZES = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=512)
LAYERS = 2

# GPT-2-named configurations (GPT-J, CodeGen, GPTBigCode) at the corpus's sizes; build() drops the Nones
_GPT_NAMES = dict(hidden_size=None, intermediate_size=None, num_hidden_layers=None, num_attention_heads=None,
                  num_key_value_heads=None, head_dim=None, max_position_embeddings=None, n_embd=64, n_head=4,
                  n_layer=2, n_positions=512, n_inner=128)
_HALF = _SIZES["head_dim"] // 2
_ROPE = {"rope_theta": 10000.0}
_MLA = dict(pad_token_id=0, num_key_value_heads=4, head_dim=None, kv_lora_rank=32, q_lora_rank=48,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
_MLA_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)
# what users bring beyond the corpus's families, the corpus's sizes otherwise (`--families` takes these
# names too): rope scalings, Gemma 2 and 3, GPT-NeoX and the rest of tests/test_architecture_variants.py
ARCHITECTURES: dict[str, TinySpec] = {
    "llama32": TinySpec("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "phi35_longrope": TinySpec("Phi3Config", "Phi3ForCausalLM", dict(
        pad_token_id=0, original_max_position_embeddings=64, rope_parameters={
            **_ROPE, "rope_type": "longrope", "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.03 * i for i in range(_HALF)], "long_factor": [1.0 + 0.3 * i for i in range(_HALF)]})),
    "gemma2": TinySpec("Gemma2Config", "Gemma2ForCausalLM", dict(
        sliding_window=16, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gemma3": TinySpec("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=16, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16)),
    "glm4": TinySpec("Glm4Config", "Glm4ForCausalLM", dict(pad_token_id=0, partial_rotary_factor=0.5)),
    "granite": TinySpec("GraniteConfig", "GraniteForCausalLM", dict(
        embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22, logits_scaling=8.0)),
    "olmo2": TinySpec("Olmo2Config", "Olmo2ForCausalLM", dict(pad_token_id=0)),
    "mixtral": TinySpec("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                                    intermediate_size=32)),
    "granitemoe": TinySpec("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                                             intermediate_size=32)),
    "phi": TinySpec("PhiConfig", "PhiForCausalLM", dict(num_key_value_heads=4, partial_rotary_factor=0.5)),
    "stablelm": TinySpec("StableLmConfig", "StableLmForCausalLM", dict(partial_rotary_factor=0.25,
                                                                       use_qkv_bias=True)),
    "gpt_neox": TinySpec("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(num_key_value_heads=None, head_dim=None,
                                                                     rotary_pct=0.25)),
    # Falcon-7B: one key and value head packed after the queries; Falcon-40B/180B: q/k/v packed by KV group
    "falcon": TinySpec("FalconConfig", "FalconForCausalLM", dict(num_key_value_heads=None, head_dim=None,
                                                                 intermediate_size=None, ffn_hidden_size=128)),
    "falcon_grouped": TinySpec("FalconConfig", "FalconForCausalLM", dict(
        num_key_value_heads=None, head_dim=None, intermediate_size=None, ffn_hidden_size=128,
        new_decoder_architecture=True, num_kv_heads=2)),
    # ALiBi: BLOOM's added on heads folded into the batch, MPT's a sliced ramp (Falcon-RW's exports do not run in
    # onnxruntime, the tests' reference here: tests/test_architecture_variants.py checks it against torch)
    "bloom": TinySpec("BloomConfig", "BloomForCausalLM", dict(num_key_value_heads=None, head_dim=None,
                                                              intermediate_size=None)),
    "mpt": TinySpec("MptConfig", "MptForCausalLM", dict(num_key_value_heads=None, head_dim=None, intermediate_size=None,
                                                        max_position_embeddings=None, max_seq_len=512,
                                                        expansion_ratio=2)),
    # OPT: a learned position table, the query scaled before its product
    "opt": TinySpec("OPTConfig", "OPTForCausalLM", dict(num_key_value_heads=None, head_dim=None,
                                                       intermediate_size=None, ffn_dim=128, word_embed_proj_dim=64)),
    # GPT-J: pairwise rotary on the first 8 of 16 dims, applied before the heads move forward
    "gptj": TinySpec("GPTJConfig", "GPTJForCausalLM", dict(_GPT_NAMES, rotary_dim=8)),
    # CodeGen: GPT-J's rotary, q, v and k packed in one projection across 4 model-parallel shards
    "codegen": TinySpec("CodeGenConfig", "CodeGenForCausalLM", dict(_GPT_NAMES, rotary_dim=8, n_ctx=512)),
    # StarCoder: one key and value head cut from a view of the projection with a head axis of one (the
    # config has no num_key_value_heads; the exporter reads it for the past's shape)
    "gpt_bigcode": TinySpec("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(_GPT_NAMES, multi_query=True,
                                                                              num_key_value_heads=1)),
    # hybrids: gated delta nets (Qwen3.5, Qwen3-Next) or short convolutions (LFM2) between attention layers
    "qwen3_5": TinySpec("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        pad_token_id=0, layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)),
    "qwen3_next": TinySpec("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        pad_token_id=0, layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    # SmolLM3: every fourth layer without rotary; OLMo 3 and EXAONE 4: sliding-window layers between full ones
    # (EXAONE 4 normalises q and k per head); OLMo and Nemotron: LayerNorms of their own (weightless, 1 + w)
    "smollm3": TinySpec("SmolLM3Config", "SmolLM3ForCausalLM", dict(pad_token_id=0, no_rope_layers=[1, 0])),
    "olmo3": TinySpec("Olmo3Config", "Olmo3ForCausalLM", dict(
        pad_token_id=0, sliding_window=16, layer_types=["sliding_attention", "full_attention"])),
    "exaone4": TinySpec("Exaone4Config", "Exaone4ForCausalLM", dict(
        pad_token_id=0, sliding_window=16, layer_types=["sliding_attention", "full_attention"])),
    "olmo": TinySpec("OlmoConfig", "OlmoForCausalLM", dict(pad_token_id=0)),
    "nemotron": TinySpec("NemotronConfig", "NemotronForCausalLM", dict(pad_token_id=0, partial_rotary_factor=0.5)),
    # Ministral 3: yarn, and each token's queries scaled once rotated by 1 + β·log(1 + ⌊position / 4⌋) (the
    # released models' 16,384 brought down to where the corpus's positions reach)
    "ministral3": TinySpec("Ministral3Config", "Ministral3ForCausalLM", dict(pad_token_id=0, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 4,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1})),
    # nanochat: its rotate_half turned the other way, q and k normalised (without weights) once rotated
    "nanochat": TinySpec("NanoChatConfig", "NanoChatForCausalLM", dict(pad_token_id=0)),
    # HunYuan: q and k normalised per head once rotated
    "hunyuan": TinySpec("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(pad_token_id=0)),
    "hunyuan_moe": TinySpec("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(
        pad_token_id=0, num_experts=4, moe_topk=2, intermediate_size=32)),
    # Mamba-2 hybrids: Granite 4.0-H (no positions in its attention, MoE beside a shared MLP) and Bamba; two
    # groups of B and C for four heads, 16-token chunks in transformers' scan
    "granitemoehybrid": TinySpec("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16, mamba_d_head=32,
        mamba_chunk_size=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
        shared_intermediate_size=64, embedding_multiplier=12.0, attention_multiplier=0.0078125,
        residual_multiplier=0.22, logits_scaling=8.0)),
    "bamba": TinySpec("BambaConfig", "BambaForCausalLM", dict(
        attn_layer_indices=[1], mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16, mamba_d_head=32,
        mamba_chunk_size=16)),
    # Nemotron-H: a Mamba-2 layer, then attention without positions, each followed by a block of its own for the
    # MLP (squared ReLU) that caches nothing
    "nemotron_h": TinySpec("NemotronHConfig", "NemotronHForCausalLM", dict(
        num_hidden_layers=4, layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
        mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16, n_groups=2, chunk_size=16)),
    # Falcon-H1: Mamba-2 heads beside the attention in every layer, each layer caching keys, values and states
    "falcon_h1": TinySpec("FalconH1Config", "FalconH1ForCausalLM", dict(
        mamba_n_heads=4, mamba_d_head=32, mamba_d_ssm=128, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=16)),
    # Zamba2: Mamba-2 layers, and hybrid ones where one shared attention block (with a LoRA of its own) runs
    # before the Mamba-2 heads
    "zamba2": TinySpec("Zamba2Config", "Zamba2ForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=4, head_dim=None, attention_head_dim=16, mamba_headdim=32,
        mamba_d_state=16, mamba_ngroups=2, chunk_size=16, n_mamba_heads=4, num_mem_blocks=1, use_mem_rope=True,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"])),
    # multi-head latent attention: a 32-wide latent and an 8-wide rotated key cached, expanded to 4 heads of
    # 16 + 8 dims for the keys and 16 for the values; DeepSeek-V2 and V3 (and Moonlight) rotate pairs,
    # MiniCPM3 halves; DeepSeek-V2, V3 and GLM-4.7-Flash route to 4 experts after one dense layer
    "deepseek_v3": TinySpec("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_MLA, **_MLA_MOE, n_group=1, topk_group=1)),
    "minicpm3": TinySpec("MiniCPM3Config", "MiniCPM3ForCausalLM", dict(_MLA)),
    # DeepSeek-V2 (and -Lite, Coder-V2): no query LoRA, its rotary in complex numbers (exported in real ones:
    # cann_llm/models/real_rotary.py)
    "deepseek_v2": TinySpec("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(_MLA, **_MLA_MOE, q_lora_rank=None)),
    "glm4_moe_lite": TinySpec("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(_MLA, **_MLA_MOE)),
    # at transformers' initializer range (0.02) the tiny LFM2 repeats one token whatever it is fed
    "lfm2": TinySpec("Lfm2Config", "Lfm2ForCausalLM", dict(pad_token_id=0, layer_types=["conv", "full_attention"],
                                                           initializer_range=0.1)),
}


def build(family: str):
    """The corpus's initialisation: transformers' under seed 0, then norm weights 1+N(0, 0.1) (Gemma's,
    used as 1+w, N(0, 0.1)), biases and MoE router weights N(0, 0.1), drawn in parameter-name order."""
    import torch
    import transformers

    if family in ARCHITECTURES:  # the corpus's sizes with the architecture's own settings (None: left out)
        spec = ARCHITECTURES[family]
        sizes = {k: v for k, v in {**_SIZES, **spec.sizes}.items() if v is not None}
    else:
        spec = TINY_FAMILIES[family]
        sizes = {**spec.sizes, **(_GPT2_SIZES if family == "gpt2" else _SIZES)}
    config = getattr(transformers, spec.config_class)(**sizes)
    # transformers' default: sdpa where the model has it (Gemma 2's cannot softcap; BLOOM and MPT have none)
    if family != "gemma2" and getattr(transformers, spec.model_class)._supports_sdpa:
        config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, spec.model_class)(config)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("batched_mm")  # the grouped default cannot be exported
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            norm = "norm" in name or ".ln_" in name
            if norm and name.endswith("weight"):
                draw = 0.1 * torch.randn(param.shape, generator=gen)
                param.copy_(draw if family.startswith("gemma") else 1.0 + draw)
            elif name.endswith("bias") or name.endswith("mlp.gate.weight") or "shared_expert_gate" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    return model.eval()


def _cases(config, with_past: bool, states: dict | None = None) -> list[dict[str, np.ndarray]]:
    """The corpus's two cases: batch 2 by 7 with row 1 left-padded by 2 (after a past of 5, so a 12-long
    mask, with past inputs); then batch 3 by 4 with its last row left-padded by 2 (without past inputs) or one
    decode step after a past of 11 (with them). A hybrid's recurrent layers (`states`) take random states."""
    rng = np.random.default_rng(0)
    shapes = [(2, 7, 5), (1, 1, 11)] if with_past else [(2, 7, 0), (3, 4, 0)]
    cases = []
    for batch, seq, past in shapes:
        mask = np.ones((batch, past + seq), np.int64)
        if batch > 1:
            mask[-1, :2] = 0
        positions = np.cumsum(mask, axis=1) - 1
        positions[mask == 0] = 1
        feeds = {"input_ids": rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int64),
                 "attention_mask": mask, "position_ids": positions[:, past:].astype(np.int64)}
        feeds["input_ids"][mask[:, past:] == 0] = 0
        if with_past:
            for name, _, shape in cache_entries(config, states):
                sizes = [past if size is None else size for size in shape]
                feeds[name] = rng.standard_normal((batch, *sizes)).astype(np.float32)
        cases.append(feeds)
    return cases


def _reference(model, with_past: bool) -> dict[str, np.ndarray]:
    import torch

    from cann_llm.models.export import _CausalLMWithFlatCache

    states = state_shapes(model)
    wrapper = _CausalLMWithFlatCache(model, with_past, states).eval()
    inputs, outputs = io_names(cache_layers(model.config, states), with_past)
    arrays = {}
    for prefix, feeds in zip(("", "alt_"), _cases(model.config, with_past, states)):
        # the recurrent states in the export's value-major layout, which only the exported rule reads
        with torch.no_grad(), routed_through_onnxruntime(model):
            got = wrapper(*(torch.from_numpy(feeds[name]) for name in inputs))
        got = got if isinstance(got, tuple) else (got,)
        for name in inputs:
            arrays[f"{prefix}input.{name}"] = feeds[name]
        for name, value in zip(outputs, got):
            arrays[f"{prefix}output.{name}"] = value.numpy()
        seq = feeds["input_ids"].shape[1]
        arrays[f"{prefix}valid_query_rows"] = feeds["attention_mask"][:, -seq:].astype(bool)
    return arrays


def expected_counts(model) -> dict[str, int]:
    """What the corpus's meta.json says a compiler should find, counted on the torch model (not read from
    this project's recipes): an attention block a layer but a hybrid's recurrent ones and the layers without
    attention (Nemotron-H's MLP blocks), those of them a contiguous compile fuses, and the calls of its RMSNorm
    modules (or LayerNorm ones) in a forward pass (nanochat's final norm also normalises the embeddings)."""
    import torch

    calls: dict[str, int] = {"rms": 0, "layer": 0}

    def kind(module) -> str | None:
        name = type(module).__name__
        if name.endswith(("RMSNorm", "RMSNormGated")):  # Qwen3.5's gated norm normalises too
            return "rms"
        # OLMo's LayerNorm and Nemotron's LayerNorm1P, classes of their own, export as LayerNormalization too
        return "layer" if "LayerNorm" in name else None

    hooks = [module.register_forward_hook(lambda m, args, out, k=kind(module): calls.__setitem__(k, calls[k] + 1))
             for module in model.modules() if kind(module)]
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 2, dtype=torch.long), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    norms = {"rmsnorm": calls["rms"]} if calls["rms"] else {"layernorm": calls["layer"]}
    config = model.config
    types = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
    attending = sum(kind not in NO_CACHE_TYPES + RECURRENT_TYPES for kind in types)
    # multi-head latent attention fuses where the cache leaves the I/O (a paged compile); a contiguous one keeps
    # the export's latent cache and runs it as exported
    contiguous = {"contiguous_attention_blocks": 0} if getattr(config, "kv_lora_rank", None) else {}
    return {"attention_blocks": attending, **contiguous, **norms}


def write(family: str, exporter: str, out: Path) -> str:
    """One folder; its status."""
    dynamo, with_past = EXPORTS[exporter]
    folder = out / f"{family}-{exporter}"
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"family": family, "exporter": exporter, "num_layers": LAYERS, "with_past": with_past, "status": "ok"}
    try:
        model = build(family)
        meta["num_layers"] = model.config.num_hidden_layers
        meta["expected"] = expected_counts(model)
        export_causal_lm(model, folder / "model.onnx", dynamo=dynamo, with_past=with_past)
        np.savez(folder / "reference.npz", **_reference(model, with_past))
    except Exception:
        meta["status"] = "failed"
        meta["error"] = traceback.format_exc(limit=3)
        (folder / "model.onnx").unlink(missing_ok=True)
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta["status"]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--out", type=click.Path(path_type=Path), required=True, help="the folder to fill")
@click.option("--families", default=",".join(HELD_BACK), show_default=True,
              help=f"also any of: {', '.join(ARCHITECTURES)}")
def main(out: Path, families: str) -> None:
    """Write the held-back families' exports (or other architectures') in the corpus's layout."""
    for family in families.split(","):
        for exporter in EXPORTS:
            print(f"{family}-{exporter}: {write(family, exporter, out)}", flush=True)


if __name__ == "__main__":
    main()
