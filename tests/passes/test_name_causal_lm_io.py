"""CausalLmIoNamingPass on small graphs: which input is input_ids, which output is the logits, the
TorchScript suffix, and the cases it must leave alone (no unique choice, a name already taken)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.name_causal_lm_io import NameCausalLmIo

VOCAB, HIDDEN = 32, 8


def _graph(inputs: list[tuple[str, int]], outputs: list[tuple[str, list]], lookups: list[str],
           reshape_first: bool = False) -> gs.Graph:
    """`lookups` index the embedding table (the first through a Reshape when `reshape_first`); each output
    is a float value of the given shape computed from the sum of the lookups."""
    nodes, inits = [], [numpy_helper.from_array(np.zeros((VOCAB, HIDDEN), np.float32), "table"),
                        numpy_helper.from_array(np.array([1, -1], np.int64), "rows")]
    looked = []
    for index, name in enumerate(lookups):
        indices = name
        if reshape_first and index == 0:
            nodes.append(helper.make_node("Reshape", [name, "rows"], [f"{name}_rows"]))
            indices = f"{name}_rows"
        nodes.append(helper.make_node("Gather", ["table", indices], [f"looked{index}"]))
        looked.append(f"looked{index}")
    nodes.append(helper.make_node("Sum", looked, ["hidden"]))
    for name, shape in outputs:
        inits.append(numpy_helper.from_array(np.zeros((HIDDEN, shape[-1]), np.float32), f"w_{name}"))
        nodes.append(helper.make_node("MatMul", ["hidden", f"w_{name}"], [name]))
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, t, ["b", "s"]) for n, t in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs], inits),
        opset_imports=[helper.make_opsetid("", 17)])
    return gs.import_onnx(model)


def _names(graph: gs.Graph) -> tuple[list[str], list[str]]:
    return [t.name for t in graph.inputs], [t.name for t in graph.outputs]


def test_the_input_that_indexes_the_table_and_the_float_output_are_named():
    # the plain dynamo export of a transformers model: its logits named after their node
    graph = _graph([("tokens", TensorProto.INT64), ("mask", TensorProto.INT64)], [("linear_14", ["b", "s", VOCAB])],
                   ["tokens"], reshape_first=True)
    result = NameCausalLmIo().run(graph)
    assert _names(graph) == (["input_ids", "mask"], ["logits"]) and result.effect_times == 2


def test_torchscripts_suffix_is_dropped_from_a_token_input():
    graph = _graph([("input.1", TensorProto.INT64), ("attention_mask.1", TensorProto.INT64),
                    ("position_ids.3", TensorProto.INT64), ("other.1", TensorProto.INT64)],
                   [("584", ["b", "s", VOCAB])], ["input.1"])
    NameCausalLmIo().run(graph)
    assert _names(graph) == (["input_ids", "attention_mask", "position_ids", "other.1"], ["logits"])


def test_of_several_float_outputs_the_one_as_wide_as_the_vocabulary_is_the_logits():
    graph = _graph([("input_ids", TensorProto.INT64)], [("hidden_out", ["b", "s", HIDDEN]), ("scores", ["b", "s", VOCAB])],
                   ["input_ids"])
    NameCausalLmIo().run(graph)
    assert _names(graph) == (["input_ids"], ["hidden_out", "logits"])


def test_no_unique_choice_and_taken_names_are_left_alone():
    # two inputs index the table, and a float input is not a token input
    two = _graph([("a", TensorProto.INT64), ("b", TensorProto.INT64), ("c", TensorProto.FLOAT)],
                 [("x", ["b", "s", VOCAB]), ("y", ["b", "s", VOCAB])], ["a", "b"])
    assert NameCausalLmIo().run(two).effect_times == 0 and _names(two) == (["a", "b", "c"], ["x", "y"])
    # an intermediate value already named logits keeps the name; the output is not renamed onto it
    taken = _graph([("input_ids", TensorProto.INT64)], [("out", ["b", "s", VOCAB])], ["input_ids"])
    next(t for t in taken.tensors().values() if t.name == "hidden").name = "logits"
    assert NameCausalLmIo().run(taken).effect_times == 0 and _names(taken)[1] == ["out"]


def test_a_base_models_hidden_states_are_not_logits():
    # a float rank-3 output narrower than the vocabulary: the export of a model without its head
    graph = _graph([("tokens", TensorProto.INT64)], [("mul_660", ["b", "s", HIDDEN])], ["tokens"])
    NameCausalLmIo().run(graph)
    assert _names(graph) == (["input_ids"], ["mul_660"])
