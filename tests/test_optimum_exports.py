"""Optimum's exports (optimum-onnx `text-generation-with-past`, transformers 4.57, in a venv of its own) of
the tiny families: they fuse completely, reproduce onnxruntime on the original and generate through the
paged engine what onnxruntime generates on the original. So do its exports without a cache (the
`text-generation` task) and the legacy merged decoders (`decoder_model_merged.onnx`: an `If` on
`use_cache_branch` over the decoders without and with a cache), as Optimum wrote them before its
single-graph exports. And so do the files optimum 1.17 with transformers 4.37 wrote, as most ONNX LLMs
on the Hugging Face Hub were made (rotary tables sliced to the sequence's length; a merged decoder whose
branch with a cache has no causal mask; GPT-2's eager attention filling its causal buffer in, then adding
the padding mask). Exports are cached (cann_llm/models/optimum_export.py)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from conftest import compile_to, ort_reference
from generation_utils import assert_paged_greedy_equals_onnxruntime

from cann_llm.models.optimum_export import (FORM_FAMILIES, LEGACY_FAMILIES, OPTIMUM_FAMILIES, OptimumUnavailable,
                                   ensure_optimum_venv, export_families)
from cann_llm.models.recipes import RECIPES
from cann_llm.models.tiny import TINY_FAMILIES
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.feeds import causal_lm_inputs

TOLERANCE = 1e-4
NEW_TOKENS = 32

def _exports(families, form: str = "with-past"):
    """The families' exports in `form`; the tests skip only if the venv cannot be created (no registry)."""
    legacy = form.startswith("legacy")
    try:
        ensure_optimum_venv(legacy=legacy)
    except OptimumUnavailable as error:
        pytest.skip(f"the {'legacy ' if legacy else ''}optimum venv cannot be created: {error}")
    return export_families(families, form=form)


@pytest.fixture(scope="module")
def optimum_exports():
    return _exports(OPTIMUM_FAMILIES)


@pytest.fixture(scope="module")
def merged_exports():
    return _exports(FORM_FAMILIES["merged"], "merged")


@pytest.fixture(scope="module")
def no_past_exports():
    return _exports(FORM_FAMILIES["no-past"], "no-past")


@pytest.fixture(scope="module")
def legacy_exports():
    return {form: _exports(LEGACY_FAMILIES, form) for form in ("legacy", "legacy-merged")}


def _rows_with_a_visible_key(mask: np.ndarray, seq: int) -> np.ndarray:
    """[B, S] query rows that attend to at least one key (a row with none is implementation-defined)."""
    return np.cumsum(mask, axis=1)[:, mask.shape[1] - seq:] > 0


@pytest.mark.parametrize("family", OPTIMUM_FAMILIES)
def test_optimum_export_fuses_and_matches_onnxruntime(optimum_exports, family, tmp_path):
    source = optimum_exports[family]
    loaded = load_artifact(compile_to(source, tmp_path / "m"))
    counts = Counter(node.op_type for node in loaded.model.graph.node)
    sizes = TINY_FAMILIES[family].sizes
    layers = sizes.get("num_hidden_layers", sizes.get("n_layer"))  # GPT2Config names it n_layer
    expected = RECIPES[family].expected_counts(layers)
    assert counts["FusedAttention"] == expected["FusedAttention"]
    assert counts["RmsNorm"] + counts["AddRmsNorm"] == expected["norms"]
    assert counts["MoE"] == expected["MoE"]  # one per layer for RECIPES[family].moe
    assert counts["Softmax"] == 0  # an MoE router's Softmax is inside the op
    dims = loaded.metadata["model"]
    for backend in ("onnxruntime", "reference"):
        executor = Executor(loaded, backend)
        for batch, seq, past, seed in ((2, 6, 3, 0), (1, 1, 7, 1), (3, 4, 0, 2)):
            rng = np.random.default_rng(seed)
            ids = rng.integers(0, dims["vocab_size"], (batch, seq), dtype=np.int64)
            feeds = causal_lm_inputs(loaded.metadata["signature"], dims, ids, past, rng)
            feeds["attention_mask"][-1, -1] = 0  # a padded position, so the mask path is exercised
            want, got = ort_reference(source, feeds), executor.run(feeds)
            rows = _rows_with_a_visible_key(feeds["attention_mask"], seq)
            for name in want:
                a, b = (got[name], want[name]) if name != "logits" else (got[name][rows], want[name][rows])
                np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE, err_msg=f"{backend} {name} {batch}x{seq}+{past}")


@pytest.mark.parametrize("family", OPTIMUM_FAMILIES)
def test_optimum_export_generates_through_the_paged_engine(optimum_exports, family, tmp_path):
    source = optimum_exports[family]
    om = compile_to(source, tmp_path / "m", enable_paged_attention=True)
    assert load_artifact(om).metadata["kv_cache"]["layout"] == "paged"
    assert_paged_greedy_equals_onnxruntime(source, om, NEW_TOKENS)


@pytest.mark.parametrize("family", FORM_FAMILIES["merged"])
def test_a_legacy_merged_decoder_compiles_as_its_branch_with_a_cache(merged_exports, family, tmp_path):
    source = merged_exports[family]
    loaded = load_artifact(compile_to(source, tmp_path / "m"))
    counts = Counter(node.op_type for node in loaded.model.graph.node)
    expected = RECIPES[family].expected_counts(2)
    assert (counts["FusedAttention"], counts["RmsNorm"] + counts["AddRmsNorm"]) == (2, expected["norms"])
    assert counts["If"] == counts["Softmax"] == 0
    assert "use_cache_branch" not in [value["name"] for value in loaded.metadata["signature"]["inputs"]]
    dims = loaded.metadata["model"]
    for batch, seq, past, seed in ((2, 6, 3, 0), (3, 4, 0, 2)):
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, dims["vocab_size"], (batch, seq), dtype=np.int64)
        feeds = causal_lm_inputs(loaded.metadata["signature"], dims, ids, past, rng)
        feeds["attention_mask"][-1, -1] = 0
        # onnxruntime takes the merged model's branch for the case: with a past, the decoder with a cache
        want = ort_reference(source, {**feeds, "use_cache_branch": np.array([past > 0])})
        got = Executor(loaded).run(feeds)
        rows = _rows_with_a_visible_key(feeds["attention_mask"], seq)
        for name in want:
            a, b = (got[name], want[name]) if name != "logits" else (got[name][rows], want[name][rows])
            np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE, err_msg=f"{name} {batch}x{seq}+{past}")
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    assert_paged_greedy_equals_onnxruntime(source, om, NEW_TOKENS)


@pytest.mark.parametrize("family", FORM_FAMILIES["no-past"])
def test_an_export_without_a_cache_compiles_paged(no_past_exports, family, tmp_path):
    """Optimum's `text-generation` task: no cache inputs or outputs; the paged compile gives it a cache."""
    source = no_past_exports[family]
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    counts = Counter(node.op_type for node in load_artifact(om).model.graph.node)
    assert counts["PagedAttention"] == 2 and counts["Softmax"] == 0
    assert_paged_greedy_equals_onnxruntime(source, om, NEW_TOKENS)


@pytest.mark.parametrize("form", ["legacy", "legacy-merged"])
@pytest.mark.parametrize("family", LEGACY_FAMILIES)
def test_optimum_1_17s_exports_fuse_and_generate(legacy_exports, form, family, tmp_path):
    source = legacy_exports[form][family]
    loaded = load_artifact(compile_to(source, tmp_path / "m"))
    counts = Counter(node.op_type for node in loaded.model.graph.node)
    assert (counts["FusedAttention"], counts["RmsNorm"] + counts["AddRmsNorm"], counts["Softmax"]) == (2, 5, 0)
    inputs = [value["name"] for value in loaded.metadata["signature"]["inputs"]]
    cached = any(name.startswith("past_key_values") for name in inputs)
    # the merged decoder's branch with a cache was traced for one token: sdpa's without a causal mask, so the
    # branch without a cache is the one compiled; GPT-2's (eager) slices its causal buffer, and compiles
    assert cached == (form == "legacy" or family == "gpt2")
    dims = loaded.metadata["model"]
    for batch, seq, past, seed in ((2, 6, 3 if cached else 0, 0), (3, 4, 0, 2)):
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, dims["vocab_size"], (batch, seq), dtype=np.int64)
        feeds = causal_lm_inputs(loaded.metadata["signature"], dims, ids, past, rng)
        feeds["attention_mask"][-1, -1] = 0
        original = dict(feeds)
        if form == "legacy-merged" and cached:
            original["use_cache_branch"] = np.array([True])
        elif form == "legacy-merged":  # its branch without a cache, as Optimum ran a prompt
            original.update({"use_cache_branch": np.array([False])}, **{
                f"past_key_values.{i}.{kind}": np.zeros((batch, dims["num_kv_heads"], 0, dims["head_dim"]), np.float32)
                for i in range(2) for kind in ("key", "value")})
        want, got = ort_reference(source, original)["logits"], Executor(loaded).run(feeds)["logits"]
        rows = _rows_with_a_visible_key(feeds["attention_mask"], seq)
        np.testing.assert_allclose(got[rows], want[rows], rtol=0, atol=TOLERANCE, err_msg=f"{batch}x{seq}+{past}")
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    assert_paged_greedy_equals_onnxruntime(source, om, NEW_TOKENS)
