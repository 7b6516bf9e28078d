"""AlibiBufferSplitPass: ALiBi and the causal mask in one constant (Baichuan-13B's `future_mask`), sliced to the
keys and added to the scores, becomes the causal mask and ALiBi's term on the scores: the same probabilities
on onnxruntime, in the spellings attention fusion reads. A buffer anything else reads, or that is not ALiBi's
(rows that differ below the diagonal, or no slope), is left as it was."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.match_attention import split_mask
from cann_llm.passes.match_alibi import peel_alibi
from cann_llm.passes.split_alibi_buffer import SplitAlibiBuffer

HEADS, LENGTH, HEAD_DIM = 4, 16, 8
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)


def _buffer() -> np.ndarray:
    """Baichuan-13B's `_gen_alibi_mask`: m_h·j, -inf after the query."""
    alibi = SLOPES[:, None, None] * np.arange(LENGTH, dtype=np.float32)[None, None]
    return (np.triu(np.full((LENGTH, LENGTH), -np.inf, np.float32), 1)[None] + alibi).astype(np.float32)


def _model(buffer: np.ndarray, extra_reader: str = "", key_step: int = 1):
    """Scores of q and k over S keys, plus `buffer[..., :S, :S]` (its keys every `key_step`-th), through a
    softmax; the mask also read by a node (`extra_reader="node"`), its shape ("shape") or a graph output
    ("output")."""
    rows_axis, keys_axis = ("one", "two") if buffer.ndim == 3 else ("two", "three")
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["qk"]),
             helper.make_node("Div", ["qk", "root"], ["scores"]),
             helper.make_node("Shape", ["q"], ["shape"]),
             helper.make_node("Gather", ["shape", "two"], ["end"], axis=0),
             helper.make_node("Mul", ["end", "step"], ["key_end"]),
             helper.make_node("Slice", ["buffer", "zero", "end", rows_axis], ["rows"]),
             helper.make_node("Slice", ["rows", "zero", "key_end", keys_axis, "step"], ["mask"]),
             helper.make_node("Add", ["scores", "mask"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["probabilities"], axis=-1)]
    outputs = [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, None)]
    if extra_reader == "node":
        nodes.append(helper.make_node("ReduceSum", ["mask"], ["total"], name="Total"))
        outputs.append(helper.make_tensor_value_info("total", TensorProto.FLOAT, None))
    elif extra_reader == "output":
        outputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, None))
    elif extra_reader == "shape":
        nodes.append(helper.make_node("Shape", ["mask"], ["mask_shape"], name="MaskShape"))
        outputs.append(helper.make_tensor_value_info("mask_shape", TensorProto.INT64, None))
    elif extra_reader == "lengths":  # the remote code's `src_len, tgt_len = alibi_mask.size()[-2:]`
        nodes += [helper.make_node("Shape", ["mask"], ["mask_shape"]),
                  helper.make_node("Gather", ["mask_shape", "last"], ["keys"], axis=0)]
        outputs.append(helper.make_tensor_value_info("keys", TensorProto.INT64, None))
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, HEADS, "s", HEAD_DIM]) for name in ("q", "k")]
    graph = helper.make_graph(nodes, "g", inputs, outputs, [
        numpy_helper.from_array(buffer, "buffer"), numpy_helper.from_array(np.float32(HEAD_DIM ** 0.5), "root"),
        numpy_helper.from_array(np.array([0]), "zero"), numpy_helper.from_array(np.array([1]), "one"),
        numpy_helper.from_array(np.array([2]), "two"), numpy_helper.from_array(np.array([3]), "three"),
        numpy_helper.from_array(np.array([key_step]), "step"), numpy_helper.from_array(np.array(-1), "last")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _probabilities(model, length: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal((1, HEADS, length, HEAD_DIM)).astype(np.float32) for name in ("q", "k")}
    return ort.InferenceSession(model.SerializeToString()).run(["probabilities"], feeds)[0]


@pytest.mark.parametrize("rank", [3, 4])
def test_the_buffer_becomes_the_causal_mask_and_alibis_term_with_the_same_probabilities(rank):
    # its keys' length read from its shape too, which the split keeps
    model = _model(_buffer().reshape((1,) * (rank - 3) + _buffer().shape), extra_reader="lengths")
    graph = gs.import_onnx(model)
    result = SplitAlibiBuffer().run(graph)
    assert (result.match_times, result.effect_times) == (1, 1)
    softmax = next(n for n in graph.nodes if n.op == "Softmax")
    scores, (mask,), _ = split_mask(softmax.inputs[0])
    _, alibi = peel_alibi(scores)
    np.testing.assert_allclose(alibi.slopes, SLOPES, rtol=1e-6)
    causal = next(t for t in graph.tensors().values() if isinstance(t, gs.Constant) and t.name == "buffer_causal")
    assert tuple(causal.shape) == (1,) * (rank - 2) + (LENGTH, LENGTH)  # its readers' axes unchanged
    assert np.array_equal(np.isinf(causal.values.reshape(LENGTH, LENGTH)), np.triu(np.ones((LENGTH, LENGTH), bool), 1))
    rewritten = gs.export_onnx(graph)
    for length in (1, 5, LENGTH):
        np.testing.assert_allclose(_probabilities(rewritten, length), _probabilities(model, length), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reader, why", [("node", "Total reads it and is no attention's mask"),
                                         ("output", "a graph output is computed from it"),
                                         ("shape", "MaskShape reads its shape, whose heads the split changes"),
                                         ("every second key", "slices its keys with a step")])
def test_a_buffer_something_else_reads_is_left_alone(reader, why):
    step = 2 if reader == "every second key" else 1
    graph = gs.import_onnx(_model(_buffer(), extra_reader="" if step == 2 else reader, key_step=step))
    result = SplitAlibiBuffer().run(graph)
    assert (result.match_times, result.effect_times) == (1, 0)
    assert len(result.rejections) == 1 and result.rejections[0].startswith("buffer: ")
    assert result.rejections[0].endswith(why)
    assert "buffer" in graph.tensors()


@pytest.mark.parametrize("change", ["a row that differs below the diagonal", "no slope", "nothing hidden"])
def test_a_buffer_that_is_not_alibi_with_the_causal_mask_is_not_matched(change):
    buffer = _buffer()
    if change == "a row that differs below the diagonal":
        buffer[:, 5, 2] += 1.0
    elif change == "no slope":
        buffer = np.where(np.isinf(buffer), buffer, 0).astype(np.float32)
    else:
        buffer = np.where(np.isinf(buffer), 0, buffer).astype(np.float32)
    result = SplitAlibiBuffer().run(gs.import_onnx(_model(buffer)))
    assert (result.match_times, result.effect_times) == (0, 0)
