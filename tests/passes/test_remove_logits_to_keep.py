"""LogitsToKeepRemovalPass on small graphs: the position pick before the lm_head goes, and stays where the
picked position feeds more than the logits."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.remove_logits_to_keep import RemoveLogitsToKeep

HIDDEN, VOCAB = 8, 16


def _graph(picked_also_out: bool = False) -> gs.Graph:
    nodes = [helper.make_node("Gather", ["hidden", "logits_to_keep"], ["picked"], axis=1),
             helper.make_node("MatMul", ["picked", "head"], ["projected"]),
             helper.make_node("Add", ["projected", "bias"], ["logits"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", VOCAB])]
    if picked_also_out:
        outputs.append(helper.make_tensor_value_info("picked", TensorProto.FLOAT, ["b", HIDDEN]))
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["b", "s", HIDDEN]),
                     helper.make_tensor_value_info("logits_to_keep", TensorProto.INT64, [])], outputs,
        [numpy_helper.from_array(np.zeros((HIDDEN, VOCAB), np.float32), "head"),
         numpy_helper.from_array(np.zeros(VOCAB, np.float32), "bias")]), opset_imports=[helper.make_opsetid("", 17)])
    return gs.import_onnx(model)


def test_the_pick_before_the_lm_head_goes_with_its_input():
    graph = _graph()
    result = RemoveLogitsToKeep().run(graph)
    assert (result.match_times, result.effect_times) == (1, 1)
    assert [t.name for t in graph.inputs] == ["hidden"] and "Gather" not in [n.op for n in graph.nodes]
    matmul = next(n for n in graph.nodes if n.op == "MatMul")
    assert matmul.inputs[0].name == "hidden" and graph.outputs[0].shape is None  # [b, s, vocab] now


def test_a_pick_that_feeds_more_than_the_logits_stays():
    graph = _graph(picked_also_out=True)
    result = RemoveLogitsToKeep().run(graph)
    assert (result.match_times, result.effect_times) == (1, 0) and "feeds more than the lm_head" in result.rejections[0]
    assert [t.name for t in graph.inputs] == ["hidden", "logits_to_keep"]
