"""ALiBi's term matcher (cann_llm/passes/match_alibi.py) on small graphs of the spellings BLOOM, Falcon-RW and MPT
export, one negative case per refusal. Every term it accepts is run in onnxruntime: the values minus the
claimed m_h·(key position) must be one constant per query row (what leaves the softmax unchanged)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.infer_shapes import InferShapes
from cann_llm.passes.match_alibi import match_alibi, peel_alibi

pytestmark = pytest.mark.unit

H, T = 4, 6
SLOPES = np.array([0.25, 0.0625, 0.015625, 0.00390625], np.float32)


def _model(nodes, inputs, output, initializers) -> onnx.ModelProto:
    return helper.make_model(helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(
        output, TensorProto.FLOAT, None)], initializers), opset_imports=[helper.make_opsetid("", 17)])


def _matched(model: onnx.ModelProto, output: str) -> np.ndarray | None:
    """The slopes match_alibi reads from `output` (None: no term); a term counted over an input names it."""
    graph = gs.import_onnx(model)
    InferShapes().run(graph)
    alibi = match_alibi(graph.tensors()[output])
    if alibi is not None and alibi.mask is not None:
        assert alibi.mask is graph.tensors()["attention_mask"]
    return None if alibi is None else alibi.slopes


def _positions_term(cumsum_axis: int = -1, scale: float | None = None, positions_input: bool = False,
                    reverse: int = 0):
    """BLOOM's build_alibi_tensor: slopes[H, 1] · ((cumsum(mask) - 1) · mask)[:, None, :], viewed [B·H, 1, T]
    (then divided by `scale`, as Falcon-RW divides by sqrt(head_dim))."""
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", T])
    inits = [numpy_helper.from_array(SLOPES.reshape(H, 1), "slopes"),
             numpy_helper.from_array(np.array(cumsum_axis, np.int64), "axis"),
             numpy_helper.from_array(np.array(1, np.int64), "one"),
             numpy_helper.from_array(np.array([1], np.int64), "axes1"),
             numpy_helper.from_array(np.array([-1, 1, T], np.int64), "view"),
             numpy_helper.from_array(np.array(scale or 1.0, np.float32), "scale")]
    source = "positions_in" if positions_input else "kept"
    nodes = [helper.make_node("CumSum", ["attention_mask", "axis"], ["summed"], reverse=reverse),
             helper.make_node("Sub", ["summed", "one"], ["moved"]),
             helper.make_node("Mul", ["moved", "attention_mask"], ["kept"]),
             helper.make_node("Unsqueeze", [source, "axes1"], ["unsqueezed"]),
             helper.make_node("Cast", ["unsqueezed"], ["positions"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["slopes", "positions"], ["biased"]),
             helper.make_node("Reshape", ["biased", "view"], ["term"]),
             helper.make_node("Div", ["term", "scale"], ["scaled"])]
    inputs = [mask] + ([helper.make_tensor_value_info("positions_in", TensorProto.INT64, ["B", T])]
                       if positions_input else [])
    return _model(nodes, inputs, "scaled", inits)


def _claim_holds(model: onnx.ModelProto, slopes: np.ndarray, mask: np.ndarray) -> None:
    """The term minus slopes·(key index) is one constant per row over the keys the mask keeps."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (term,) = session.run(None, {"attention_mask": mask})
    term = term.reshape(mask.shape[0], H, -1, T)
    rest = term - slopes.reshape(1, H, 1, 1) * np.arange(T)
    for b in range(mask.shape[0]):
        kept = rest[b][..., mask[b] == 1]
        np.testing.assert_allclose(kept, kept[..., :1] * np.ones_like(kept), atol=1e-5)


def test_bloom_positions_times_slopes_give_the_slopes():
    model = _positions_term()
    slopes = _matched(model, "scaled")
    np.testing.assert_allclose(slopes, SLOPES, rtol=1e-7)
    _claim_holds(model, slopes, np.array([[1] * T, [0, 0] + [1] * (T - 2)], np.int64))


def test_a_factor_on_the_term_multiplies_the_slopes():
    """Falcon-RW divides the term by sqrt(head_dim)."""
    model = _positions_term(scale=4.0)
    slopes = _matched(model, "scaled")
    np.testing.assert_allclose(slopes, SLOPES / 4, rtol=1e-7)
    _claim_holds(model, slopes, np.array([[0] + [1] * (T - 1)], np.int64))


def test_a_sum_across_the_batch_is_no_position():
    assert _matched(_positions_term(cumsum_axis=0), "scaled") is None


def test_slopes_times_another_input_are_no_term():
    assert _matched(_positions_term(positions_input=True), "scaled") is None


def test_a_count_from_the_end_is_no_position():
    """CumSum(reverse=1) counts down the keys: slopes of the other sign, which the term does not claim."""
    assert _matched(_positions_term(reverse=1), "scaled") is None


def _ramp_term(ramp: np.ndarray, axis: int = -1, step: int = 1):
    """MPT: its [H, 1, L] buffer m_h·(j - L + 1) sliced to the last T positions."""
    length = ramp.shape[-1]
    inits = [numpy_helper.from_array(ramp.astype(np.float32), "ramp"),
             numpy_helper.from_array(np.array([length - T * step], np.int64), "start"),
             numpy_helper.from_array(np.array([length], np.int64), "end"),
             numpy_helper.from_array(np.array([axis], np.int64), "axes"),
             numpy_helper.from_array(np.array([step], np.int64), "steps")]
    node = helper.make_node("Slice", ["ramp", "start", "end", "axes", "steps"], ["term"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", T])  # unread, fed alike
    return _model([node], [mask], "term", inits)


def _ramp(length: int = 16) -> np.ndarray:
    return SLOPES.reshape(H, 1, 1) * (np.arange(length) - length + 1).reshape(1, 1, -1)


def test_mpt_ramp_sliced_on_its_last_axis_gives_the_slopes():
    model = _ramp_term(_ramp())
    slopes = _matched(model, "term")
    np.testing.assert_allclose(slopes, SLOPES, rtol=1e-6)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (term,) = session.run(None, {"attention_mask": np.ones((1, T), np.int64)})
    rest = term - slopes.reshape(H, 1, 1) * np.arange(T)
    np.testing.assert_allclose(rest, rest[..., :1] * np.ones_like(rest), atol=1e-5)


def test_mpt_7bs_full_ramp_gives_its_slopes():
    """MPT-7B: 32 heads, 2,048 positions. Its float32 ramp reaches 1,700, where the rounded products' steps
    vary by more than 1e-4 of a slope; read as the line they are to that rounding."""
    import torch
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    ramp = build_mpt_alibi_tensor(32, 2048, 8).numpy()
    slopes = np.diff(build_mpt_alibi_tensor(32, 2, 8).to(torch.float64).numpy()[:, 0])[:, 0]
    np.testing.assert_allclose(_matched(_ramp_term(ramp), "term"), slopes, rtol=1e-6)


@pytest.mark.parametrize("case", ["not linear", "sliced on the heads", "every second key"])
def test_ramps_that_are_no_alibi_are_refused(case):
    ramp = _ramp()
    if case == "not linear":
        ramp = ramp * np.abs(np.arange(16) - 15)
    model = _ramp_term(ramp, axis=0) if case == "sliced on the heads" else \
        _ramp_term(ramp, step=2) if case == "every second key" else _ramp_term(ramp)
    assert _matched(model, "term") is None


def test_peel_takes_the_term_off_either_side_of_an_add():
    graph = gs.import_onnx(_positions_term())
    term = graph.tensors()["term"]
    scores = gs.Variable("scores", dtype=np.float32, shape=["BH", 1, T])
    for operands in ([scores, term], [term, scores]):
        summed = gs.Variable(f"sum{id(operands)}", dtype=np.float32)
        graph.nodes.append(gs.Node("Add", inputs=operands, outputs=[summed]))
        rest, alibi = peel_alibi(summed)
        assert rest is scores and np.allclose(alibi.slopes, SLOPES)
    plain = gs.Variable("plain", dtype=np.float32)
    graph.nodes.append(gs.Node("Add", inputs=[scores, graph.tensors()["attention_mask"]], outputs=[plain]))
    assert peel_alibi(plain) == (plain, None)


def test_a_mask_filled_with_the_term_and_cut_to_the_keys_gives_its_condition_and_the_term():
    """Falcon-RW fills the term where keys are hidden, `Where(hidden, min, term)`; transformers 4.57 (Optimum)
    then cuts each layer's mask to its keys, `mask[:, :, :, :kv_len]`, which keeps the keys' positions. A cut
    starting past the first key is no longer that mask."""
    from cann_llm.passes.match_attention import mask_alibi

    for start, found in ((0, True), (1, False)):
        model = _positions_term()
        graph = gs.import_onnx(model)
        term = graph.tensors()["scaled"]
        hidden = gs.Variable("hidden", dtype=bool, shape=["B", 1, 1, T])
        filled = gs.Variable("filled", dtype=np.float32)
        cut = gs.Variable("cut", dtype=np.float32)
        viewed = gs.Variable("viewed", dtype=np.float32)
        graph.nodes += [
            gs.Node("Reshape", inputs=[term, gs.Constant("four", np.array([-1, H, 1, T], np.int64))], outputs=[viewed]),
            gs.Node("Where", inputs=[hidden, gs.Constant("fill", np.array(-3.4e38, np.float32)), viewed],
                    outputs=[filled]),
            gs.Node("Slice", inputs=[filled, gs.Constant(f"s{start}", np.array([start], np.int64)),
                                     gs.Constant("e", np.array([T], np.int64)), gs.Constant("a", np.array([3], np.int64))],
                    outputs=[cut])]
        rest, alibi = mask_alibi(cut)
        assert (rest is hidden and np.allclose(alibi.slopes, SLOPES)) if found else (rest is cut and alibi is None)
