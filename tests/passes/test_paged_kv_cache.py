"""`atc --enable_paged_attention=1`: the graph's new I/O, its parity with onnxruntime on flattened batches,
and the models and settings it refuses."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import EXPORTS, compile_to, export_id, ort_reference

from cann_llm.cli.atc import run
from cann_llm.compiler.config import CompileConfig
from cann_llm.models.recipes import RECIPES
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.engine.kv_cache import PagePool
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.feeds import causal_lm_inputs
from cann_llm.runtime.ops import FUSED_ATTENTION, PAGED_ATTENTION, PAGED_METADATA, PagedAttentionInput

# sdpa exports (what users have); eager ones generate through the paged engine in test_engine_greedy
PAGED_EXPORTS = [case for case in EXPORTS if RECIPES[case[0]].attention and case[3] == "sdpa"]
PAGE = 16


def _compile_paged(case, compiled, tmp_path, page_size=PAGE):
    """(the export, its paged artifact from `compiled`: conftest's compile shared by the tests that read it)."""
    from cann_llm.models.tiny import tiny_onnx

    family, dynamo, with_past, attention = case
    source = tiny_onnx(family, dynamo=dynamo, with_past=with_past, attention=attention)
    config = tmp_path / "paged.json"
    config.write_text(json.dumps({"page_size": page_size}))
    return source, load_artifact(compiled(source, enable_paged_attention=True, paged_config=str(config)))


def test_the_cache_leaves_the_graph_and_metadata_comes_in(compiled, tmp_path):
    _, loaded = _compile_paged(("llama", False, True, "sdpa"), compiled, tmp_path)
    assert loaded.input_names == ["input_ids", "position_ids", "query_start_loc", "seq_lens", "block_tables",
                                  "slot_mapping", "logits_indices"]
    assert loaded.output_names == ["logits"]
    ops = [n.op_type for n in loaded.model.graph.node]
    assert FUSED_ATTENTION.name not in ops
    attentions = [n for n in loaded.model.graph.node if n.op_type == PAGED_ATTENTION.name]
    layers = sorted(next(a.i for a in n.attribute if a.name == "layer") for n in attentions)
    assert layers == [0, 1] and all(len(n.input) == len(PagedAttentionInput) and len(n.output) == 1 for n in attentions)
    metadata = [n.input[m.slot] for n in attentions for m in PAGED_METADATA]
    assert metadata == [m.name for m in PAGED_METADATA] * 2
    assert {a.name for a in attentions[0].attribute} == {"num_heads", "kv_num_heads", "head_dim", "scale",
                                                         "rotary_interleaved", "sliding_window", "layer", "page_size",
                                                         "flash"}
    assert loaded.metadata["kv_cache"] == {"layout": "paged", "page_size": PAGE} and loaded.paged
    # attention between sessions: one session per segment; the native op: the whole step in one session
    assert Executor(loaded, host_attention=True).num_segments == len(attentions) + 1
    assert Executor(loaded).num_segments == 1


def _reference_logits(source, ids: list[int]) -> np.ndarray:
    """onnxruntime on the original export, the whole sequence at once: the last token's logits."""
    signature = {"inputs": [{"name": n, "dtype": "int64"} for n in ("input_ids", "attention_mask", "position_ids")]}
    model = onnx.load(str(source), load_external_data=False)
    names = {i.name for i in model.graph.input}
    feeds = causal_lm_inputs(signature, {}, np.asarray([ids], np.int64))
    for value in model.graph.input:
        if value.name.startswith("past_key_values"):
            dims = value.type.tensor_type.shape.dim
            feeds[value.name] = np.zeros((1, dims[1].dim_value, 0, dims[3].dim_value), np.float32)
    return ort_reference(source, {k: v for k, v in feeds.items() if k in names})["logits"][0, -1]


# the native op inside one session, the host kernels between sessions (its fallback), the numpy references
PLANS = {"onnxruntime": ("onnxruntime", False), "host-kernels": ("onnxruntime", True), "reference": ("reference", False)}


@pytest.mark.parametrize("case", PAGED_EXPORTS, ids=export_id)
@pytest.mark.parametrize("plan", PLANS)
def test_paged_logits_match_onnxruntime_on_the_original(case, plan, compiled, tmp_path):
    source, loaded = _compile_paged(case, compiled, tmp_path)
    dims = loaded.metadata["model"]
    backend, host_attention = PLANS[plan]
    executor = Executor(loaded, backend, host_attention=host_attention)
    pool = PagePool.of(dims, 8, PAGE)
    rng = np.random.default_rng(0)
    first, second = rng.integers(0, 256, 21).tolist(), rng.integers(0, 256, 9).tolist()
    tables = np.array([[5, 2], [7, 0]], np.int32)
    slots = [tables[b, p // PAGE] * PAGE + p % PAGE for b, n in enumerate((21, 9)) for p in range(n)]
    step = {"input_ids": np.asarray([first + second]), "position_ids": np.asarray([list(range(21)) + list(range(9))]),
            "query_start_loc": np.array([0, 21, 30], np.int32), "seq_lens": np.array([21, 9], np.int32),
            "block_tables": tables, "slot_mapping": np.asarray(slots), "logits_indices": np.array([20, 29])}
    logits = executor.run(step, kv_cache=pool)["logits"]
    assert logits.shape == (2, dims["vocab_size"])
    for row, ids in enumerate((first, second)):
        np.testing.assert_allclose(logits[row], _reference_logits(source, ids), atol=1e-5, rtol=0)
    decode = {"input_ids": np.array([[11, 12]]), "position_ids": np.array([[21, 9]]),
              "query_start_loc": np.array([0, 1, 2], np.int32), "seq_lens": np.array([22, 10], np.int32),
              "block_tables": tables, "slot_mapping": np.array([tables[0, 1] * PAGE + 5, tables[1, 0] * PAGE + 9]),
              "logits_indices": np.array([0, 1])}
    logits = executor.run(decode, kv_cache=pool)["logits"]
    for row, ids in enumerate((first + [11], second + [12])):
        np.testing.assert_allclose(logits[row], _reference_logits(source, ids), atol=1e-5, rtol=0)


def test_unfused_attention_is_refused_with_no_output(capsys, tmp_path):
    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx("llama", dynamo=False, with_past=True)
    switches = tmp_path / "switches.cfg"
    switches.write_text("AttentionFusionPass:off\n")
    status = run([f"--model={source}", "--framework=5", f"--output={tmp_path / 'g'}", "--soc_version=Ascend910B",
                  "--enable_paged_attention=1", f"--fusion_switch_file={switches}"])
    err = capsys.readouterr().out
    assert status == 255 and "E10055" in err and "FusedAttention" in err
    assert not list(tmp_path.glob("*.om"))


@pytest.mark.parametrize("content,code", [({"page_size": 100}, "E10001"), ({"page_size": 1024}, "E10001"),
                                          ({"page_size": 8}, "E10001"), ({"block": 16}, "E10001"),
                                          ("not json", "E10032")])
def test_bad_paged_configs_are_refused(tmp_path, content, code):
    path = tmp_path / "paged.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(AtcError) as refused:
        CompileConfig(model="m.onnx", framework=5, output="o", soc_version="Ascend910B", enable_paged_attention=True,
                      paged_config=str(path))
    assert refused.value.code == code


def test_flash_attention_is_recorded_on_paged_nodes_and_ignored_with_a_warning_otherwise(tmp_path):
    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx("llama", dynamo=True, with_past=True)
    loaded = load_artifact(compile_to(source, tmp_path / "f", enable_paged_attention=True, enable_flash_attention=True))
    flags = [next(a.i for a in n.attribute if a.name == "flash") for n in loaded.model.graph.node
             if n.op_type == PAGED_ATTENTION.name]
    assert flags == [1, 1]
    cfg = CompileConfig(model="m.onnx", framework=5, output="o", soc_version="Ascend910B", enable_flash_attention=True)
    assert any(w.startswith("W10002") for w in cfg.warnings)


def test_page_size_comes_from_the_soc_profile():
    for soc, size in (("Ascend910B", 128), ("Ascend310B1", 64)):
        cfg = CompileConfig(model="m.onnx", framework=5, output="o", soc_version=soc, kv_cache_layout="paged")
        assert cfg.paging.page_size == size
    assert CompileConfig(model="m.onnx", framework=5, output="o", soc_version="Ascend910B").paging is None


def test_an_attention_without_a_causal_mask_is_refused():
    import onnx_graphsurgeon as gs

    from cann_llm.passes.paged_kv_cache import PagedKvCache
    from cann_llm.passes.pattern import fused_node

    ids, positions = (gs.Variable(name, dtype=np.int64, shape=[1, "s"]) for name in ("input_ids", "position_ids"))
    qkv, out = gs.Variable("qkv", dtype=np.float32, shape=[1, "s", 96]), gs.Variable("out", dtype=np.float32)
    attention = fused_node(FUSED_ATTENTION.name, [qkv], [out], "layer/FusedAttention", num_heads=2, kv_num_heads=1,
                           head_dim=24, scale=0.2, causal=0)
    graph = gs.Graph(nodes=[attention], inputs=[ids, positions, qkv], outputs=[out])
    with pytest.raises(AtcError) as refused:
        PagedKvCache(PAGE).run(graph)
    assert refused.value.code == "E10055" and "causal" in str(refused.value)
