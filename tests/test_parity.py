"""Compiled tiny models reproduce onnxruntime on the original export, on both backends."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import EXPORTS, compile_to, export_id, ort_reference

from cann_llm.models.recipes import RECIPES
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.feeds import causal_lm_inputs

TOLERANCE = 1e-5


def _feeds(loaded, batch: int, seq: int, past: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    dims = loaded.metadata["model"]
    ids = rng.integers(0, dims["vocab_size"], (batch, seq), dtype=np.int64)
    feeds = causal_lm_inputs(loaded.metadata["signature"], dims, ids, past if dims["kv_cache_io"] else 0, rng)
    feeds["attention_mask"][-1, -1] = 0  # a padded position, so the mask path is exercised
    return feeds


def _rows_with_a_visible_key(mask: np.ndarray, seq: int) -> np.ndarray:
    """[B, S] query rows that attend to at least one key. A row with every key masked is
    implementation-defined (sdpa's NaN guard gives 0, a softmax over the dtype's minimum is uniform)."""
    past = mask.shape[1] - seq
    visible = np.cumsum(mask, axis=1)[:, past:] > 0
    return visible


@pytest.fixture(scope="module")
def all_off(tmp_path_factory):
    path = tmp_path_factory.mktemp("switch") / "fusion_switch.cfg"
    path.write_text("ALL:off\n")
    return str(path)


# compiled without fusion, an export checks the rest of the compiler; once per export (its sdpa spelling)
RUNS = [(case, backend, fusion) for case in EXPORTS for backend in ("onnxruntime", "reference")
        for fusion in ("fused", "unfused") if fusion == "fused" or case[3] == "sdpa"]


@pytest.mark.parametrize("case,backend,fusion", RUNS, ids=[f"{export_id(c)}-{b}-{f}" for c, b, f in RUNS])
def test_compiled_tiny_model_matches_onnxruntime(case, backend, fusion, all_off, compiled):
    from cann_llm.models.tiny import tiny_onnx

    family, dynamo, with_past, attention = case
    source = tiny_onnx(family, dynamo=dynamo, with_past=with_past, attention=attention)
    switches = {"fusion_switch_file": all_off} if fusion == "unfused" else {}
    loaded = load_artifact(compiled(source, **switches))
    domains = {node.domain for node in loaded.model.graph.node}
    recipe = RECIPES[family]
    assert ("cann" in domains) == (fusion == "fused" and bool(recipe.attention or recipe.norms_per_layer))
    executor = Executor(loaded, backend)
    for batch, seq, past, seed in ((2, 6, 3, 0), (1, 1, 7, 1), (3, 4, 0, 2)):
        feeds = _feeds(loaded, batch, seq, past, seed)
        expected = ort_reference(source, feeds)
        got = executor.run(feeds)
        assert list(got) == list(expected)
        rows = _rows_with_a_visible_key(feeds["attention_mask"], seq)
        for name in expected:
            assert got[name].shape == expected[name].shape, name
            a, b = (got[name], expected[name]) if name != "logits" else (got[name][rows], expected[name][rows])
            np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE, err_msg=name)


@pytest.mark.parametrize("dynamo", [False, True], ids=["ts", "dynamo"])
def test_two_compiles_give_identical_bytes(dynamo, tmp_path):
    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx("qwen2", dynamo=dynamo, with_past=True)
    first = compile_to(source, tmp_path / "model").read_bytes()
    second = compile_to(source, tmp_path / "model").read_bytes()
    assert first == second


def test_compiles_in_processes_of_different_string_hash_seeds_give_identical_bytes(tmp_path):
    """onnxruntime's symbolic shape inference keeps the name of a merged dim in set order, which the hash
    seed decides: without a cache, a TorchScript export's `seq` and `total` are one dim (seeds 1 and 3 kept
    different names before the names were chosen by the graph's inputs)."""
    import os
    import subprocess
    import sys

    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx("llama", dynamo=False, with_past=False)
    artifacts = []
    output = tmp_path / "model"
    for seed in ("1", "3"):
        proc = subprocess.run([sys.executable, "-m", "cann_llm.cli.atc", f"--model={source}", "--framework=5",
                               f"--output={output}", "--soc_version=Ascend910B", "--log=error"],
                              env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        artifacts.append(output.with_suffix(".om").read_bytes())
    assert artifacts[0] == artifacts[1]
