"""CacheBranchInliningPass on small merged graphs: an `If` on a boolean input whose branches compute the
outputs with and without the past; the branch reading the past becomes the graph (onnxruntime's result
with the condition true), and an `If` whose branches both read it is left alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.inline_cache_branch import InlineCacheBranch

PAST = [1, 1, "p", 4]  # the past: the graph's rank-4 float input
NEW = [1, "t", 4]


def _branch(name: str, reads_past: bool, compares: bool = False) -> onnx.GraphProto:
    # present = Concat(past, new as heads) or the new alone; out = present·2 + bias (an outer initializer);
    # `compares`: out gets a comparison's result added, as a causal mask adds
    nodes = [helper.make_node("Unsqueeze", ["new", "axis"], [f"{name}_heads"]),
             helper.make_node("Concat", ["past", f"{name}_heads"], [f"{name}_present"], axis=2) if reads_past
             else helper.make_node("Identity", [f"{name}_heads"], [f"{name}_present"]),
             helper.make_node("Mul", [f"{name}_present", "two"], [f"{name}_doubled"]),
             helper.make_node("Add", [f"{name}_doubled", "bias"], [f"{name}_out" if not compares else f"{name}_sum"])]
    if compares:
        nodes += [helper.make_node("Less", [f"{name}_sum", "two"], [f"{name}_below"]),
                  helper.make_node("Cast", [f"{name}_below"], [f"{name}_step"], to=TensorProto.FLOAT),
                  helper.make_node("Add", [f"{name}_sum", f"{name}_step"], [f"{name}_out"])]
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None),
                                               helper.make_tensor_value_info(f"{name}_present", TensorProto.FLOAT, None)])


def _merged(both_read_past: bool = False, traced_for_one_token: bool = False) -> onnx.ModelProto:
    """`traced_for_one_token`: only the branch without a cache compares (masks) positions."""
    node = helper.make_node("If", ["use_cache_branch"], ["out", "present"], name="optimum::if",
                            then_branch=_branch("with_past", True),
                            else_branch=_branch("no_past", both_read_past, compares=traced_for_one_token))
    graph = helper.make_graph(
        [node], "merged",
        [helper.make_tensor_value_info("new", TensorProto.FLOAT, NEW),
         helper.make_tensor_value_info("past", TensorProto.FLOAT, PAST),
         helper.make_tensor_value_info("use_cache_branch", TensorProto.BOOL, [1])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("present", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(2.0, np.float32), "two"), numpy_helper.from_array(np.array([1]), "axis"),
         numpy_helper.from_array(np.arange(4, dtype=np.float32), "bias")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_branch_that_reads_the_past_becomes_the_graph():
    model = _merged()
    graph = gs.import_onnx(model)
    result = InlineCacheBranch().run(graph)
    assert (result.match_times, result.effect_times) == (1, 1)
    inlined = gs.export_onnx(graph)
    assert [n.op_type for n in inlined.graph.node] == ["Unsqueeze", "Concat", "Mul", "Add"]
    assert [i.name for i in inlined.graph.input] == ["new", "past"]
    assert [o.name for o in inlined.graph.output] == ["out", "present"]
    rng = np.random.default_rng(0)
    feeds = {"new": rng.standard_normal((1, 3, 4)).astype(np.float32),
             "past": rng.standard_normal((1, 1, 5, 4)).astype(np.float32)}
    want = ort.InferenceSession(model.SerializeToString()).run(None, {**feeds, "use_cache_branch": np.array([True])})
    got = ort.InferenceSession(inlined.SerializeToString()).run(None, feeds)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_an_if_whose_branches_both_read_the_past_stays():
    graph = gs.import_onnx(_merged(both_read_past=True))
    result = InlineCacheBranch().run(graph)
    assert (result.match_times, result.effect_times) == (1, 0)
    assert "2 branches read the past" in result.rejections[0] and [n.op for n in graph.nodes] == ["If"]


def test_a_branch_with_a_cache_that_masks_nothing_gives_way_to_the_one_without():
    # Optimum traced the decoder with a cache for one new token: no causal mask; the other branch has one
    model = _merged(traced_for_one_token=True)
    graph = gs.import_onnx(model)
    assert InlineCacheBranch().run(graph).effect_times == 1
    inlined = gs.export_onnx(graph)
    assert [i.name for i in inlined.graph.input] == ["new"]  # the past and the condition go
    assert "Less" in [n.op_type for n in inlined.graph.node] and "Concat" not in [n.op_type for n in inlined.graph.node]
    feeds = {"new": np.random.default_rng(1).standard_normal((1, 3, 4)).astype(np.float32)}
    want = ort.InferenceSession(model.SerializeToString()).run(None, {
        **feeds, "past": np.zeros((1, 1, 0, 4), np.float32), "use_cache_branch": np.array([False])})
    for a, b in zip(ort.InferenceSession(inlined.SerializeToString()).run(None, feeds), want):
        np.testing.assert_array_equal(a, b)
