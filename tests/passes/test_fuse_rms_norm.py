"""RmsNormFusionPass and AddRmsNormFusionPass on scripted graphs: one test per spelling, one per refusal."""

from __future__ import annotations

import numpy as np
import pytest
from fusion_utils import apply_pass, assert_parity, op_counts
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.fuse_add_rms_norm import FuseAddRmsNorm
from cann_llm.passes.fuse_rms_norm import FuseRmsNorm

pytestmark = pytest.mark.unit

H = 16
RNG = np.random.default_rng(0)
WEIGHT = (1 + 0.3 * RNG.standard_normal(H)).astype(np.float32)
FEEDS = {"x": RNG.standard_normal((2, 3, H)).astype(np.float32), "r": RNG.standard_normal((2, 3, H)).astype(np.float32)}


def _rms_nodes(x: str, out: str, *, square="pow", inverse="div1", weight_first=True, eps="eps", axes_input=False,
               weight="w", last_axis=-1, keepdims=1):
    nodes = [helper.make_node("Pow", [x, "two"], ["sq"]) if square == "pow" else helper.make_node("Mul", [x, x], ["sq"])]
    if axes_input:
        nodes.append(helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=keepdims))
    else:
        nodes.append(helper.make_node("ReduceMean", ["sq"], ["mean"], axes=[last_axis], keepdims=keepdims))
    nodes.append(helper.make_node("Add", ["mean", eps], ["var"]))
    if inverse != "pow":
        nodes.append(helper.make_node("Sqrt", ["var"], ["rms"]))
    if inverse == "pow":  # Gemma 3n: (mean + eps) ** -0.5
        nodes += [helper.make_node("Pow", ["var", "minus_half"], ["inv"]), helper.make_node("Mul", [x, "inv"], ["normed"])]
    elif inverse == "div1":
        nodes += [helper.make_node("Div", ["one", "rms"], ["inv"]), helper.make_node("Mul", [x, "inv"], ["normed"])]
    elif inverse == "reciprocal":
        nodes += [helper.make_node("Reciprocal", ["rms"], ["inv"]), helper.make_node("Mul", ["inv", x], ["normed"])]
    else:
        nodes += [helper.make_node("Div", [x, "rms"], ["normed"])]
    if weight is None:
        nodes.append(helper.make_node("Identity", ["normed"], [out]))
    else:
        nodes.append(helper.make_node("Mul", [weight, "normed"] if weight_first else ["normed", weight], [out]))
    return nodes


def _model(nodes, opset=17, weight=WEIGHT, eps=np.float32(1e-6), extra_outputs=(), inputs=("x", "r")):
    initializers = [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
                    numpy_helper.from_array(np.array(1.0, np.float32), "one"),
                    numpy_helper.from_array(np.asarray(eps, np.float32), "eps"),
                    numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    if weight is not None:
        initializers.append(numpy_helper.from_array(weight, "w"))
    initializers.append(numpy_helper.from_array(np.array(-0.5, np.float32), "minus_half"))
    graph_inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 3, H]) for name in inputs]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y", *extra_outputs)]
    return helper.make_model(helper.make_graph(nodes, "g", graph_inputs, outputs, initializers),
                             opset_imports=[helper.make_opsetid("", opset)])


SPELLINGS = {
    "ts": dict(square="pow", inverse="div1", weight_first=True),
    "dynamo": dict(square="pow", inverse="reciprocal", weight_first=True, axes_input=True),
    "mul-square": dict(square="mul", inverse="reciprocal", weight_first=False),
    "div-x": dict(square="pow", inverse="divx", weight_first=False),
    "no-weight": dict(weight=None),
    "pow-minus-half": dict(square="pow", inverse="pow", weight_first=False),
}


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_spelling_fuses_into_one_rms_norm(spelling, tmp_path):
    options = SPELLINGS[spelling]
    model = _model(_rms_nodes("x", "y", **options), opset=18 if options.get("axes_input") else 17)
    fused, (result,) = apply_pass(model, FuseRmsNorm())
    counts = op_counts(fused)
    assert (result.match_times, result.effect_times) == (1, 1)
    assert counts["RmsNorm"] == 1
    assert not {"ReduceMean", "Pow", "Sqrt", "Reciprocal", "Div"} & set(counts)
    assert_parity(model, fused, {"x": FEEDS["x"]} if "r" not in [i.name for i in fused.graph.input] else FEEDS, tmp_path)


def test_casts_to_float32_around_a_float16_norm_are_absorbed(tmp_path):
    nodes = [helper.make_node("Cast", ["x16"], ["x"], to=TensorProto.FLOAT)]
    nodes += _rms_nodes("x", "n32", weight=None)[:-1]
    nodes += [helper.make_node("Cast", ["normed"], ["n16"], to=TensorProto.FLOAT16),
              helper.make_node("Mul", ["w", "n16"], ["y"])]
    model = _model(nodes, weight=WEIGHT.astype(np.float16), inputs=())
    model.graph.input.append(helper.make_tensor_value_info("x16", TensorProto.FLOAT16, [2, 3, H]))
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    fused, (result,) = apply_pass(model, FuseRmsNorm())
    assert result.effect_times == 1 and op_counts(fused)["RmsNorm"] == 1 and "Cast" not in op_counts(fused)
    assert_parity(model, fused, {"x16": FEEDS["x"].astype(np.float16)}, tmp_path, atol=2e-3)


def _retype_input(model, name, dims):
    for value in model.graph.input:
        if value.name == name:
            value.CopyFrom(helper.make_tensor_value_info(name, TensorProto.FLOAT, dims))


@pytest.mark.parametrize("change, reason", [
    (lambda m: m.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array(3.0, np.float32), "two")), "exponent"),
    (lambda m: m.graph.initializer[2].CopyFrom(numpy_helper.from_array(np.full(H, 1e-6, np.float32), "eps")), "epsilon"),
    (lambda m: m.graph.node[1].attribute[0].CopyFrom(helper.make_attribute("axes", [1])), "last axis"),
    (lambda m: m.graph.node[1].attribute[1].CopyFrom(helper.make_attribute("keepdims", 0)), "drops"),
    (lambda m: m.graph.output.append(helper.make_tensor_value_info("rms", TensorProto.FLOAT, None)), "Sqrt"),
    (lambda m: m.graph.output.append(helper.make_tensor_value_info("sq", TensorProto.FLOAT, None)), "square used only"),
    (lambda m: _retype_input(m, "x", [2, 3, "hidden"]), "not static"),
    (lambda m: setattr(m.graph.node[3], "op_type", "Abs"), "not followed by Sqrt or Pow"),
    (lambda m: m.graph.node[4].input.__setitem__(0, "two"), "neither x / rms nor 1 / rms"),
    (lambda m: m.graph.node[5].input.__setitem__(0, "r"), "does not multiply the normalised input"),
    (lambda m: m.graph.initializer[4].CopyFrom(numpy_helper.from_array(WEIGHT.astype(np.float16), "w")), "float16"),
])
def test_refusals(change, reason):
    model = _model(_rms_nodes("x", "y"))
    change(model)
    fused, (result,) = apply_pass(model, FuseRmsNorm())
    assert result.effect_times == 0 and "RmsNorm" not in op_counts(fused)
    assert any(reason in r for r in result.rejections), result.rejections


def test_a_power_of_the_mean_other_than_minus_a_half_is_refused():
    model = _model(_rms_nodes("x", "y", inverse="pow"))
    model.graph.initializer[-1].CopyFrom(numpy_helper.from_array(np.array(0.5, np.float32), "minus_half"))
    fused, (result,) = apply_pass(model, FuseRmsNorm())
    assert result.effect_times == 0 and any("Pow(·, -0.5)" in r for r in result.rejections), result.rejections


def test_a_weight_that_is_not_constant_is_refused():
    model = _model(_rms_nodes("x", "y", weight="r"))
    fused, (result,) = apply_pass(model, FuseRmsNorm())
    assert result.effect_times == 0 and any("not a constant" in r for r in result.rejections)


@pytest.mark.parametrize("shape", [(), (1, 1, H)])
def test_a_weight_of_another_shape_stays_a_mul_after_the_norm(shape, tmp_path):
    nodes = _rms_nodes("x", "y", weight="w2")
    model = _model(nodes, inputs=("x",))
    model.graph.initializer.append(numpy_helper.from_array(np.full(shape, 1.5, np.float32), "w2"))
    fused, (result,) = apply_pass(model, FuseRmsNorm())
    assert result.effect_times == 1 and op_counts(fused)["RmsNorm"] == 1 and op_counts(fused)["Mul"] == 1
    assert_parity(model, fused, {"x": FEEDS["x"]}, tmp_path)


def test_a_mean_without_its_epsilon_fuses_with_an_epsilon_of_zero(tmp_path):
    """torch.onnx's dynamo optimiser drops Helium's epsilon of 1e-8: Sqrt reads the mean itself."""
    nodes = [n for n in _rms_nodes("x", "y") if n.op_type != "Add"]
    next(n for n in nodes if n.op_type == "Sqrt").input[0] = "mean"
    model = _model(nodes, inputs=("x",))
    fused, (result,) = apply_pass(model, FuseRmsNorm())
    (norm,) = [n for n in fused.graph.node if n.op_type == "RmsNorm"]
    assert result.effect_times == 1 and norm.attribute[0].f == 0.0
    assert_parity(model, fused, {"x": FEEDS["x"]}, tmp_path)


def test_one_normalisation_read_weighted_and_unweighted_becomes_two_norms(tmp_path):
    """An optimiser that merged two norms of one input (Gemma 4's k norm and its unweighted v norm) leaves one
    normalisation read by a weight Mul and by something else: each reader gets its own norm."""
    nodes = _rms_nodes("x", "y")
    nodes.append(helper.make_node("Neg", ["normed"], ["z"]))
    model = _model(nodes, extra_outputs=("z",), inputs=("x",))
    fused, (result,) = apply_pass(model, FuseRmsNorm())
    norms = [n for n in fused.graph.node if n.op_type == "RmsNorm"]
    assert (result.match_times, result.effect_times, len(norms)) == (1, 1, 2)
    weights = {numpy_helper.to_array(t).tobytes() for t in fused.graph.initializer if t.name in {n.input[1] for n in norms}}
    assert weights == {WEIGHT.tobytes(), np.ones(H, np.float32).tobytes()}
    assert not {"ReduceMean", "Pow", "Sqrt", "Reciprocal", "Div"} & set(op_counts(fused))
    assert_parity(model, fused, {"x": FEEDS["x"]}, tmp_path)


def test_residual_add_joins_the_norm_and_keeps_its_sum(tmp_path):
    nodes = [helper.make_node("Add", ["x", "r"], ["s"])] + _rms_nodes("s", "y")
    nodes.append(helper.make_node("Neg", ["s"], ["next_residual"]))
    model = _model(nodes, extra_outputs=("next_residual",))
    fused, (norm, add_norm) = apply_pass(model, FuseRmsNorm(), FuseAddRmsNorm())
    counts = op_counts(fused)
    assert (norm.effect_times, add_norm.effect_times) == (1, 1)
    assert counts["AddRmsNorm"] == 1 and "RmsNorm" not in counts and "Add" not in counts
    assert_parity(model, fused, FEEDS, tmp_path)


@pytest.mark.parametrize("second, reason", [("bias", "constant operand"), ("row", "broadcasts")])
def test_bias_and_broadcast_adds_are_not_residuals(second, reason):
    nodes = [helper.make_node("Add", ["x", second], ["s"])] + _rms_nodes("s", "y")
    model = _model(nodes)
    if second == "bias":
        model.graph.initializer.append(numpy_helper.from_array(np.ones(H, np.float32), "bias"))
    else:
        model.graph.input.append(helper.make_tensor_value_info("row", TensorProto.FLOAT, [1, 1, H]))
    fused, (norm, add_norm) = apply_pass(model, FuseRmsNorm(), FuseAddRmsNorm())
    assert norm.effect_times == 1 and add_norm.effect_times == 0
    assert any(reason in r for r in add_norm.rejections), add_norm.rejections


def test_square_as_mul_of_two_different_values_is_refused():
    nodes = _rms_nodes("x", "y", square="mul")
    nodes[0] = helper.make_node("Mul", ["x", "r"], ["sq"])
    fused, (result,) = apply_pass(_model(nodes), FuseRmsNorm())
    assert result.effect_times == 0 and any("not x·x" in r for r in result.rejections)


def test_a_norm_of_a_graph_input_is_no_residual():
    fused, (norm, add_norm) = apply_pass(_model(_rms_nodes("x", "y")), FuseRmsNorm(), FuseAddRmsNorm())
    assert norm.effect_times == 1 and add_norm.effect_times == 0
    assert any("not produced by an Add" in r for r in add_norm.rejections)


def _standard_rms(axis=-1, stash=1, scale_shape=(H,)):
    node = helper.make_node("RMSNormalization", ["x", "w"], ["y"], axis=axis, epsilon=1e-5, stash_type=stash)
    weight = numpy_helper.from_array(np.resize(WEIGHT, scale_shape).astype(np.float32), "w")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, H])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def test_the_standard_rms_normalization_op_becomes_rms_norm(tmp_path):
    from cann_llm.passes.convert_rms_normalization import ConvertRmsNormalization

    model = _standard_rms()
    fused, (result,) = apply_pass(model, ConvertRmsNormalization())
    assert (result.match_times, result.effect_times) == (1, 1)
    assert op_counts(fused) == {"RmsNorm": 1}
    assert_parity(model, fused, {"x": FEEDS["x"]}, tmp_path)


@pytest.mark.parametrize("kwargs, reason", [(dict(axis=1), "last axis"), (dict(stash=10), "float32"),
                                            (dict(scale_shape=(3, H)), "one value per")])
def test_standard_rms_normalization_refusals(kwargs, reason):
    from cann_llm.passes.convert_rms_normalization import ConvertRmsNormalization

    fused, (result,) = apply_pass(_standard_rms(**kwargs), ConvertRmsNormalization())
    assert result.effect_times == 0 and any(reason in r for r in result.rejections), result.rejections
