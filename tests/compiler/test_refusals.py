"""Models atc cannot run are refused at load with E10041 naming the reason, never compiled to fail later:
what onnx's checker (strict shape inference) refuses, opsets outside the supported range, dtypes no
kernel takes, absurd dims, a bad Gather axis."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cann_llm.cli.atc import run as atc
from cann_llm.compiler.loader import import_graph
from cann_llm.compiler.model_checks import MAX_DIM, MAX_RANK, MAX_SUBGRAPHS, supported_opsets
from cann_llm.models.nested_conditionals import nested_conditionals
from cann_llm.passes.fold_constants import FoldConstants

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
    assert status == 255, captured.out
    assert "E10041: [PID:" in captured.out and "Traceback" not in captured.out + captured.err
    assert not list(tmp_path.glob("*.om")) and not (tmp_path / "fusion_result.json").exists()
    return captured.out


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


def _concat(axis: int) -> onnx.ModelProto:
    return _model([helper.make_node("Concat", ["a", "b"], ["y"], name="join", axis=axis)],
                  [vi("a", TensorProto.FLOAT, [2]), vi("b", TensorProto.FLOAT, [2])], [vi("y", TensorProto.FLOAT, [4])])


def _with_opset(model: onnx.ModelProto, domain: str, version: int) -> onnx.ModelProto:
    model.opset_import.append(helper.make_opsetid(domain, version))
    return model


def _input_type(elem_type: int) -> onnx.ModelProto:
    model = _relu([3, 4])
    model.graph.input[0].type.tensor_type.elem_type = elem_type
    return model


def _truncated_weight() -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.ones((1, 4), np.float32), "w")
    weight.raw_data = weight.raw_data[:-1]
    return _model([helper.make_node("Add", ["x", "w"], ["y"])], [vi("x", TensorProto.FLOAT, [3, 4])],
                  [vi("y", TensorProto.FLOAT, [3, 4])], [weight])


def _constant_of_type(elem_type: int) -> onnx.ModelProto:
    value = numpy_helper.from_array(np.ones(2, np.float32))
    value.data_type = elem_type
    return _model([helper.make_node("Constant", [], ["c"], value=value), helper.make_node("Add", ["x", "c"], ["y"])],
                  [vi("x", TensorProto.FLOAT, [2])], [vi("y", TensorProto.FLOAT, [2])])


@pytest.mark.parametrize("make, words", [
    # onnx's inference reads the axis as a 32-bit int, so 2^32 passed as 0 and constant folding then retried it
    (lambda: _concat(2**32), "node join (Concat) has axis 4294967296; its input a has rank 1, so the axis must be in "
                             "[-1, 0]"),
    (lambda: _embedding(axis=2**32), "(Gather) has axis 4294967296; its input embed has rank 2"),
    (lambda: _with_opset(_relu([3, 4]), "com.microsoft", 24), "the model imports com.microsoft opset 24; supported "
                                                             "are opsets 1 to 1"),
    (lambda: _with_opset(_relu([3, 4]), "cann", 7), "the model imports cann opset 7; supported are opsets 1 to 1"),
    (lambda: _with_opset(_relu([3, 4]), "", 17), "the model imports ai.onnx twice"),
    (lambda: _input_type(99), "tensor x has element type 99, which ONNX does not define"),
    (lambda: _constant_of_type(0), "tensor (a constant) has element type 0, which ONNX does not define"),
    (lambda: _constant_of_type(99), "tensor (a constant) has element type 99, which ONNX does not define"),
    # a float32 constant's 8 bytes relabelled bfloat16 read as 4 values, not its 2
    (lambda: _constant_of_type(TensorProto.BFLOAT16), "tensor (a constant) holds 8 bytes; its dims [2] of bfloat16 "
                                                      "need 4"),
    (lambda: _truncated_weight(), "tensor w holds 15 bytes; its dims [1, 4] of float need 16"),
], ids=["concat-axis-2^32", "gather-axis-2^32", "com.microsoft-opset-24", "cann-opset-7", "default-domain-twice",
        "input-type-99", "constant-type-0", "constant-type-99", "constant-relabelled", "weight-truncated"])
def test_what_the_fuzzer_found_compiling_is_refused_with_the_reason(capsys, tmp_path, make, words):
    assert words in _refused(capsys, tmp_path, make())


def test_an_omitted_trailing_optional_input_is_dropped_at_import_so_onnxruntime_runs_the_node(tmp_path):
    # LayerNormalization(x, scale, "") is valid ONNX, and onnxruntime 1.32 segfaults creating its session
    scale = numpy_helper.from_array(np.full(4, 2.0, np.float32), "scale")
    model = _model([helper.make_node("LayerNormalization", ["x", "scale", ""], ["y"], name="norm", axis=-1)],
                   [vi("x", TensorProto.FLOAT, [3, 4])], [vi("y", TensorProto.FLOAT, [3, 4])], [scale])
    onnx.save(model, str(tmp_path / "norm.onnx"))
    _, graph = import_graph(tmp_path / "norm.onnx")
    (node,) = graph.nodes
    assert [t.name for t in node.inputs] == ["x", "scale"]
    session = ort.InferenceSession(gs.export_onnx(graph).SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    centred = x - x.mean(-1, keepdims=True)
    expected = 2.0 * centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], expected, rtol=1e-5, atol=1e-5)


def test_a_constant_subgraph_onnxruntime_cannot_evaluate_is_left_unfolded_and_reported():
    # built past the import checks: a Concat that onnxruntime refuses, over constants only; graphsurgeon's
    # partitioned fallback once retried it unchanged to the recursion limit
    a = gs.Constant("a", np.ones(2, np.float32))
    b = gs.Constant("b", np.ones(2, np.float32))
    joined = gs.Variable("joined", np.float32, [4])
    x = gs.Variable("x", np.float32, [4])
    y = gs.Variable("y", np.float32, [4])
    graph = gs.Graph(nodes=[gs.Node("Concat", "join", {"axis": 2**32}, [a, b], [joined]),
                            gs.Node("Add", "add", inputs=[x, joined], outputs=[y])],
                     inputs=[x], outputs=[y], opset=17)
    result = FoldConstants().run(graph)
    assert [node.op for node in graph.nodes] == ["Concat", "Add"]
    assert result.effect_times == 0
    assert len(result.rejections) == 1
    assert result.rejections[0].startswith("the constant subgraph: onnxruntime cannot evaluate it: ")


def test_shapes_that_contradict_each_other_once_followed_are_refused_naming_the_node(capsys, tmp_path):
    """x [B, 3] plus z reshaped to [B, 4] by a target computed from x's shape: only following that computation
    shows the contradiction, which onnxruntime meets at load; atc refuses at compile and writes nothing."""
    height = helper.make_node("Gather", ["shape", "zero"], ["rows"], axis=0)
    nodes = [helper.make_node("Shape", ["x"], ["shape"]), height,
             helper.make_node("Concat", ["rows", "four"], ["target"], axis=0),
             helper.make_node("Reshape", ["z", "target"], ["wide"]),
             helper.make_node("Add", ["x", "wide"], ["y"], name="the_add")]
    model = _model(nodes, [vi("x", TensorProto.FLOAT, ["b", 3]), vi("z", TensorProto.FLOAT, ["b", 4])],
                   [vi("y", TensorProto.FLOAT, ["b", 3])],
                   [numpy_helper.from_array(np.array([0], np.int64), "zero"),
                    numpy_helper.from_array(np.array([4], np.int64), "four")])
    onnx.save(model, tmp_path / "model.onnx")
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail):
        ort.InferenceSession(str(tmp_path / "model.onnx"))
    out = _refused(capsys, tmp_path, model)
    assert "node name: the_add" in out and "Incompatible dimensions" in out
