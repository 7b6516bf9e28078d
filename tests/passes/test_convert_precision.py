"""PrecisionConversionPass: which weights each `--precision_mode` stores narrower, and that the results still
compute what the float32 artifact computes (to the stored dtype's rounding)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import compile_to

from cann_llm.cli.atc import run as atc
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.feeds import causal_lm_inputs

FLOAT16, BFLOAT16, FLOAT = onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT


def _stored(loaded) -> dict[str, int]:
    """Initializer name → ONNX dtype, for the 2-D weights."""
    return {t.name: t.data_type for t in loaded.model.graph.initializer if len(t.dims) == 2}


def _run(loaded, backend="onnxruntime"):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, loaded.metadata["model"]["vocab_size"], (2, 6), dtype=np.int64)
    feeds = causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"], ids, 4, rng)
    return Executor(loaded, backend).run(feeds)


@pytest.mark.parametrize("family, mode, dtype, narrowed", [
    ("llama", "force_fp16", FLOAT16, 10),  # 2 layers × (QKV, O, gate-up, down) + embedding + lm_head
    ("llama", "allow_mix_precision", FLOAT16, 8),  # the embedding table and lm_head stay float32
    ("llama", "allow_mix_precision_bf16", BFLOAT16, 8),
])
@pytest.mark.parametrize("dynamo", [False, True], ids=["ts", "dynamo"])
def test_modes_narrow_exactly_their_weights_and_keep_the_outputs(tmp_path, family, mode, dtype, narrowed, dynamo):
    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx(family, dynamo=dynamo, with_past=True)
    wide = load_artifact(compile_to(source, tmp_path / "fp32"))
    narrow = load_artifact(compile_to(source, tmp_path / "narrow", precision_mode=mode))
    stored = _stored(narrow)
    assert list(stored.values()).count(dtype) == narrowed
    assert set(_stored(wide).values()) == {FLOAT}
    casts = [n for n in narrow.model.graph.node if n.op_type == "Cast" and stored.get(n.input[0]) == dtype]
    assert len(casts) == narrowed
    expected, fast, reference = _run(wide), _run(narrow), _run(narrow, "reference")
    tolerance = 3e-2 if dtype == BFLOAT16 else 4e-3
    for name in expected:
        np.testing.assert_allclose(fast[name], reference[name], atol=1e-5, rtol=0, err_msg=name)
        scale = np.abs(expected[name]).max()
        assert np.abs(fast[name] - expected[name]).max() <= tolerance * scale, name
        assert not np.array_equal(fast[name], expected[name]) or "present" in name


def test_keep_dtype_keeps_named_weights_and_op_types(tmp_path, tiny_llama_path):
    keep = tmp_path / "keep.cfg"
    keep.write_text("# the projections of layer 0, and every lookup table\n*layers.0*\nOpType::Gather\n")
    everything = _stored(load_artifact(compile_to(tiny_llama_path, tmp_path / "all", precision_mode="force_fp16")))
    kept = _stored(load_artifact(compile_to(tiny_llama_path, tmp_path / "kept", precision_mode="force_fp16",
                                            keep_dtype=str(keep))))
    assert list(kept.values()).count(FLOAT16) == list(everything.values()).count(FLOAT16) - 5  # 4 of layer 0, table
    assert all(dtype == FLOAT for name, dtype in kept.items() if "layers.0" in name)


def test_must_keep_origin_dtype_is_the_default_and_leaves_int4_and_float_weights_alone(tmp_path, tiny_llama_path):
    conf = tmp_path / "quant.json"
    conf.write_text(json.dumps({"quant_mode": "INT4", "group_size": 32, "accuracy_level": "0"}))
    flags = dict(enable_compress_weight=True, compress_weight_conf=str(conf))
    default = load_artifact(compile_to(tiny_llama_path, tmp_path / "default", **flags))
    assert default.metadata["config"]["precision"]["mode"] == "must_keep_origin_dtype"
    assert not any(n.op_type == "Cast" and n.input[0] in _stored(default) for n in default.model.graph.node)
    fp16 = load_artifact(compile_to(tiny_llama_path, tmp_path / "fp16", precision_mode="force_fp16", **flags))
    int4 = {n.input[1] for n in fp16.model.graph.node if n.op_type == "MatMulInt4"}
    dtypes = {t.name: t.data_type for t in fp16.model.graph.initializer}
    assert len(int4) == 8 and {dtypes[name] for name in int4} == {onnx.TensorProto.UINT8}
    assert list(_stored(fp16).values()).count(FLOAT16) == 2  # the float embedding table and lm_head


@pytest.mark.parametrize("content, code", [("no_such_layer*\n", "E10016"), ("OpType::\n", "E10001"),
                                           ("OpType::Conv\n", "E10016")])
def test_bad_keep_dtype_entries_are_refused_without_output(capsys, tmp_path, tiny_llama_path, content, code):
    keep = tmp_path / "keep.cfg"
    keep.write_text(content)
    status = atc([f"--model={tiny_llama_path}", "--framework=5", f"--output={tmp_path / 'out'}",
                  "--soc_version=Ascend910B", "--precision_mode=force_fp16", f"--keep_dtype={keep}"])
    err = capsys.readouterr().out
    assert status == 255 and f"{code}: [PID:" in err and "Traceback" not in err, err
    assert not list(tmp_path.glob("**/*.om"))


def test_a_raised_models_weights_are_stored_back_only_where_their_dtype_holds_them_exactly():
    """must_keep_origin_dtype for a model raised from bfloat16 (PrecisionPolicy.storing): a weight whose values
    bfloat16 holds (the model's own) goes back to bfloat16; one beside it that bfloat16 would round (float32 in
    the export, as Falcon-RW's beside its bfloat16 term) keeps every bit in float32."""
    import ml_dtypes
    import onnx_graphsurgeon as gs
    from onnx import TensorProto, helper

    from cann_llm.passes.convert_precision import ConvertPrecision
    from cann_llm.passes.precision_config import PrecisionPolicy

    rng = np.random.default_rng(0)
    own = rng.standard_normal((8, 8)).astype(ml_dtypes.bfloat16).astype(np.float32)
    other = rng.standard_normal((8, 8)).astype(np.float32)
    weights = [onnx.numpy_helper.from_array(own, "own"), onnx.numpy_helper.from_array(other, "other")]
    nodes = [helper.make_node("MatMul", ["x", "own"], ["h"]), helper.make_node("MatMul", ["h", "other"], ["y"])]
    graph = gs.import_onnx(helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], weights)))
    result = ConvertPrecision(PrecisionPolicy.of("must_keep_origin_dtype").storing("bfloat16")).run(graph)
    stored = {t.name: t.data_type for t in gs.export_onnx(graph).graph.initializer}
    assert stored == {"own_bfloat16": TensorProto.BFLOAT16, "other": TensorProto.FLOAT}
    assert result.effect_times == 1 and "bfloat16 does not hold exactly" in result.rejections[0]
