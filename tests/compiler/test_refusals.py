"""Models atc cannot run are refused at load with E10041 naming the reason, never compiled to fail later:
what onnx's checker (strict shape inference) refuses, opsets outside the supported range, dtypes no
kernel takes, absurd dims, a bad Gather axis."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cli.atc import run as atc
from compiler.loader import import_graph
from compiler.model_checks import MAX_DIM, MAX_RANK, MAX_SUBGRAPHS, supported_opsets
from models.nested_conditionals import nested_conditionals

pytestmark = pytest.mark.unit

vi = helper.make_tensor_value_info


def _model(nodes, inputs, outputs, initializers=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _relu(shape, opset=17) -> onnx.ModelProto:
    return _model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", TensorProto.FLOAT, shape)],
                  [vi("y", TensorProto.FLOAT, shape)], opset=opset)


def _embedding(ids_type=TensorProto.INT64, axis=0) -> onnx.ModelProto:
    table = numpy_helper.from_array(np.ones((8, 4), np.float32), "embed")
    return _model([helper.make_node("Gather", ["embed", "input_ids"], ["y"], axis=axis)],
                  [vi("input_ids", ids_type, [1, 3])], [vi("y", TensorProto.FLOAT, [1, 3, 4])], [table])


def _string_weight() -> onnx.ModelProto:
    words = helper.make_tensor("vocab", TensorProto.STRING, [2], [b"a", b"b"])
    return _model([helper.make_node("Identity", ["vocab"], ["y"])], [], [vi("y", TensorProto.STRING, [2])], [words])


def _negative_weight_dim() -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.ones((1, 4), np.float32), "w")
    weight.dims[0] = -1
    return _model([helper.make_node("Add", ["x", "w"], ["y"])], [vi("x", TensorProto.FLOAT, [3, 4])],
                  [vi("y", TensorProto.FLOAT, [3, 4])], [weight])


def _refused(capsys, tmp_path, model: onnx.ModelProto) -> str:
    path = tmp_path / "bad.onnx"
    onnx.save(model, str(path))
    status = atc([f"--model={path}", "--framework=5", f"--output={tmp_path / 'out'}", "--soc_version=Ascend910B"])
    captured = capsys.readouterr()
    assert status == 255, captured.err
    assert "E10041: [PID:" in captured.err and "Traceback" not in captured.out + captured.err
    assert not list(tmp_path.glob("*.om")) and not (tmp_path / "fusion_result.json").exists()
    return captured.err


@pytest.mark.parametrize("make, words", [
    (lambda: _relu([-3, 4]), "tensor x has dimension -3"),
    (lambda: _relu([MAX_DIM + 1, 4]), f"tensor x has dimension {MAX_DIM + 1}"),
    (lambda: _relu([1] * (MAX_RANK + 1)), f"tensor x has rank {MAX_RANK + 1}"),
    (_negative_weight_dim, "weight w has dimension -1"),
    (_string_weight, "weight vocab is a string tensor, which no kernel takes"),
    (lambda: _embedding(TensorProto.FLOAT), "input input_ids is float; token ids must be int32 or int64"),
    (lambda: _embedding(axis=5), "axis must be in [-r, r-1]"),
    (lambda: _relu([3, 4], opset=99), "the model imports ai.onnx opset 99; supported are opsets 7 to"),
    (lambda: _relu([3, 4], opset=5), "the model imports ai.onnx opset 5; supported are opsets 7 to"),
], ids=["negative-dim", "huge-dim", "rank-65", "negative-weight-dim", "string-weight", "float-input-ids",
        "gather-axis", "opset-99", "opset-5"])
def test_a_model_we_cannot_run_is_refused_with_the_reason(capsys, tmp_path, make, words):
    assert words in _refused(capsys, tmp_path, make())


def test_a_type_mismatch_only_strict_shape_inference_sees_is_refused(capsys, tmp_path):
    # Add of float and int64: the plain checker passes it, full_check's type inference does not
    model = _model([helper.make_node("Add", ["x", "n"], ["y"])],
                   [vi("x", TensorProto.FLOAT, [2]), vi("n", TensorProto.INT64, [2])], [vi("y", TensorProto.FLOAT, [2])])
    onnx.checker.check_model(model)
    assert "the ONNX checker refused the model" in _refused(capsys, tmp_path, model)


def test_the_supported_range_reaches_the_opsets_exporters_write():
    low, high = supported_opsets()["ai.onnx"]
    assert low == 7 and 23 <= high <= onnx.defs.onnx_opset_version()


def test_a_model_of_too_many_subgraphs_is_refused_and_one_within_the_limit_loads(capsys, tmp_path):
    # 2^depth - 2 branches: depth 7 has 126, past the limit of 64; depth 6 has 62
    model = onnx.load(str(nested_conditionals(tmp_path / "deep.onnx", depth=7, size=4, run_time=True)))
    assert ("the model has 126 subgraphs (If branches, Loop and Scan bodies) on run-time conditions; "
            f"at most {MAX_SUBGRAPHS} are supported") in _refused(capsys, tmp_path, model)
    _, graph = import_graph(nested_conditionals(tmp_path / "ok.onnx", depth=6, size=4, run_time=True))
    assert len(list(graph.subgraphs(recursive=True))) == 62
    _, graph = import_graph(nested_conditionals(tmp_path / "constant.onnx", depth=7, size=4))  # all taken at import
    assert not list(graph.subgraphs(recursive=True))
