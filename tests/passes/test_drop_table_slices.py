"""TableSliceRemovalPass: `cos_cached[:seq_len][position_ids]` (transformers before 4.38) reads the whole
table, so its rows no longer depend on a length: same values as the export for every valid position, and a
position past the slice's length (what a paged step of one token at position 2 asks) now reads its row."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.drop_table_slices import DropTableSlices

ROWS, WIDTH = 16, 4
TABLE = np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH)


def _model(start: int = 0, extra_reader: bool = False, gather: str = "Gather", batch_dims: int = 0):
    # the slice's length is the tokens' count, read from their shape; the rows picked as TorchScript writes
    # `rows[positions]` (Gather) or as dynamo does (GatherND of the positions with an axis of one index added)
    nodes = [helper.make_node("Shape", ["tokens"], ["shape"]),
             helper.make_node("Gather", ["shape", "one"], ["length"], axis=0),
             helper.make_node("Unsqueeze", ["length", "zero_axis"], ["end"]),
             helper.make_node("Slice", ["table", "start", "end", "zero_axis"], ["rows"]),
             helper.make_node("Cast", ["rows"], ["rows32"], to=TensorProto.FLOAT)]
    if gather == "Gather":
        nodes.append(helper.make_node("Gather", ["rows32", "positions"], ["out"], axis=0))
    else:
        nodes += [helper.make_node("Unsqueeze", ["positions", "last_axis"], ["indices"]),
                  helper.make_node("GatherND", ["rows32", "indices"], ["out"], batch_dims=batch_dims)]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)]
    if extra_reader:
        nodes.append(helper.make_node("ReduceSum", ["rows"], ["total"]))
        outputs.append(helper.make_tensor_value_info("total", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, "s"]),
                                           helper.make_tensor_value_info("positions", TensorProto.INT64, [1, "s"])],
                              outputs, [numpy_helper.from_array(TABLE, "table"),
                                        numpy_helper.from_array(np.array(1), "one"),
                                        numpy_helper.from_array(np.array([0]), "zero_axis"),
                                        numpy_helper.from_array(np.array([-1]), "last_axis"),
                                        numpy_helper.from_array(np.array([start]), "start")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model, tokens: int, positions: list[int]):
    feeds = {"tokens": np.zeros((1, tokens), np.int64), "positions": np.array([positions])}
    return ort.InferenceSession(model.SerializeToString()).run(["out"], feeds)[0]


@pytest.mark.parametrize("gather", ["Gather", "GatherND"])
def test_the_gather_reads_the_whole_table(gather):
    model = _model(gather=gather)
    graph = gs.import_onnx(model)
    assert DropTableSlices().run(graph).effect_times == 1
    rewritten = gs.export_onnx(graph)
    assert "Slice" not in [n.op_type for n in rewritten.graph.node]
    np.testing.assert_array_equal(_run(rewritten, 3, [0, 1, 2]), _run(model, 3, [0, 1, 2]))
    np.testing.assert_array_equal(_run(rewritten, 1, [2]), TABLE[[2]][None])  # the export fails here


@pytest.mark.parametrize("options", [dict(start=1), dict(extra_reader=True),
                                     dict(gather="GatherND", batch_dims=1)])
def test_a_slice_not_of_the_first_rows_or_read_otherwise_stays(options):
    graph = gs.import_onnx(_model(**options))
    assert DropTableSlices().run(graph).effect_times == 0 and "Slice" in [n.op for n in graph.nodes]


def _buffer_model(squeezes: list[list[int] | None]):
    """A `[1, 1, rows, width]` buffer sliced on its third axis to the tokens' count, then Squeezed (each
    with its axes, or None: every unit axis) and its rows gathered: Baichuan-7B's and InternLM's
    `cos_cached[:, :, :seq_len].squeeze(1).squeeze(0)[position_ids]`."""
    nodes = [helper.make_node("Shape", ["tokens"], ["shape"]),
             helper.make_node("Gather", ["shape", "one"], ["length"], axis=0),
             helper.make_node("Unsqueeze", ["length", "zero_axis"], ["end"]),
             helper.make_node("Slice", ["table", "start", "end", "third_axis"], ["rows0"])]
    initializers = [numpy_helper.from_array(TABLE[None, None], "table"), numpy_helper.from_array(np.array(1), "one"),
                    numpy_helper.from_array(np.array([0]), "zero_axis"), numpy_helper.from_array(np.array([2]), "third_axis"),
                    numpy_helper.from_array(np.array([0]), "start")]
    for i, axes in enumerate(squeezes):
        inputs = [f"rows{i}"]
        if axes is not None:
            initializers.append(numpy_helper.from_array(np.array(axes), f"axes{i}"))
            inputs.append(f"axes{i}")
        nodes.append(helper.make_node("Squeeze", inputs, [f"rows{i + 1}"]))
    nodes.append(helper.make_node("Gather", [f"rows{len(squeezes)}", "positions"], ["out"], axis=0))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, "s"]),
                                           helper.make_tensor_value_info("positions", TensorProto.INT64, [1, "s"])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_buffer_sliced_on_its_third_axis_is_read_whole():
    model = _buffer_model([[1], [0]])
    graph = gs.import_onnx(model)
    assert DropTableSlices().run(graph).effect_times == 1
    rewritten = gs.export_onnx(graph)
    np.testing.assert_array_equal(_run(rewritten, 3, [0, 1, 2]), _run(model, 3, [0, 1, 2]))
    np.testing.assert_array_equal(_run(rewritten, 1, [2]), TABLE[[2]][None])


@pytest.mark.parametrize("squeezes", [[None], [[1], [1]], [[-3], [0]]])
def test_a_squeeze_that_could_take_the_rows_axis_keeps_the_slice(squeezes):
    """Every unit axis (one row is one too), the rows' own axis, or axes it cannot tell from their sign."""
    assert DropTableSlices().run(gs.import_onnx(_buffer_model(squeezes))).effect_times == 0
