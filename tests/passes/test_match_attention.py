"""The attention sub-matchers alone (cann_llm/passes/match_attention.py, cann_llm/passes/match_rotary.py), each on small
graphs of the spellings exporters write, one negative case per refusal; every spelling a matcher accepts
is also run in onnxruntime and compared with what the matcher claims it computes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.infer_shapes import InferShapes
from cann_llm.passes.match_attention import (
    dtype_kind,
    match_gqa_repeat,
    match_head_merge,
    match_head_split,
    match_kv_concat,
    match_mask_source,
    match_probabilities,
    match_scale,
    split_mask,
)
from cann_llm.passes.match_rotary import match_rotary
from cann_llm.runtime.lowering import Builder, rotary_embedding

pytestmark = pytest.mark.unit

B, KV, T, D = 2, 2, 5, 4
RNG = np.random.default_rng(0)


def _graph(nodes, inputs, outputs, initializers=()) -> gs.Graph:
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(initializers)),
                              opset_imports=[helper.make_opsetid("", 17)])
    graph = gs.import_onnx(model)
    InferShapes().run(graph)
    return graph


def _run(graph: gs.Graph, feeds: dict) -> dict[str, np.ndarray]:
    model = gs.export_onnx(graph.copy(), do_type_check=False)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def _value(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def _const(name, values, dtype=np.int64):
    return numpy_helper.from_array(np.asarray(values, dtype=dtype), name)


def _tensor(graph: gs.Graph, name: str) -> gs.Tensor:
    return graph.tensors()[name]


# ---- scale ------------------------------------------------------------------------------------------

def test_scale_multiplies_every_scalar_factor_in_the_chain():
    nodes = [helper.make_node("Mul", ["x", "half"], ["a"]), helper.make_node("Div", ["a", "two"], ["b"]),
             helper.make_node("Mul", ["three", "b"], ["y"])]
    graph = _graph(nodes, [_value("x", [2, 3])], [_value("y", [2, 3])],
                   [_const("half", 0.5, np.float32), _const("two", 2.0, np.float32), _const("three", 3.0, np.float32)])
    inner, factor = match_scale(_tensor(graph, "y"))
    assert inner.name == "x" and factor == pytest.approx(0.75)
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_allclose(_run(graph, {"x": x})["y"], x * factor, rtol=1e-6)


def test_scale_stops_at_a_factor_that_is_not_a_scalar():
    graph = _graph([helper.make_node("Mul", ["x", "w"], ["y"])], [_value("x", [2, 3])], [_value("y", [2, 3])],
                   [_const("w", [1.0, 2.0, 3.0], np.float32)])
    inner, factor = match_scale(_tensor(graph, "y"))
    assert inner.name == "y" and factor == 1.0


# ---- the softmax's input and output ------------------------------------------------------------------

def _scores_nodes():
    return [helper.make_node("MatMul", ["q", "k"], ["scores"]), helper.make_node("Mul", ["scores", "scale"], ["scaled"])]


SCORE_INPUTS = [_value("q", [B, 2, T, D]), _value("k", [B, 2, D, T])]


@pytest.mark.parametrize("order", ["scores_first", "mask_first"])
def test_an_additive_mask_is_split_from_the_scores_in_either_order(order):
    operands = ["scaled", "mask"] if order == "scores_first" else ["mask", "scaled"]
    nodes = _scores_nodes() + [helper.make_node("Add", operands, ["logits"])]
    graph = _graph(nodes, SCORE_INPUTS + [_value("mask", [B, 1, T, T])], [_value("logits", [B, 2, T, T])],
                   [_const("scale", 0.5, np.float32)])
    scored, masks, _ = split_mask(_tensor(graph, "logits"))
    assert (scored.name, [m.name for m in masks]) == ("scaled", ["mask"])


def test_masked_fill_is_a_boolean_mask():
    nodes = _scores_nodes() + [helper.make_node("Where", ["allowed", "scaled", "fill"], ["logits"])]
    graph = _graph(nodes, SCORE_INPUTS + [_value("allowed", [B, 1, T, T], TensorProto.BOOL)],
                   [_value("logits", [B, 2, T, T])], [_const("scale", 0.5, np.float32),
                                                      _const("fill", np.finfo(np.float32).min, np.float32)])
    scored, masks, _ = split_mask(_tensor(graph, "logits"))
    assert (scored.name, [m.name for m in masks]) == ("scaled", ["allowed"])


@pytest.mark.parametrize("outer", ["padding", "causal"])
def test_two_stacked_masks_are_both_split_from_the_scores(outer):
    # GPT-2 before transformers 4.41: Where(causal, scores, min) + padding; the other nesting as well
    if outer == "padding":
        nodes = [helper.make_node("Where", ["allowed", "scaled", "fill"], ["filled"]),
                 helper.make_node("Add", ["filled", "mask"], ["logits"])]
    else:
        nodes = [helper.make_node("Add", ["mask", "scaled"], ["added"]),
                 helper.make_node("Where", ["allowed", "added", "fill"], ["logits"])]
    graph = _graph(_scores_nodes() + nodes, SCORE_INPUTS + [_value("allowed", [B, 1, T, T], TensorProto.BOOL),
                                                            _value("mask", [B, 1, T, T])],
                   [_value("logits", [B, 2, T, T])], [_const("scale", 0.5, np.float32),
                                                      _const("fill", np.finfo(np.float32).min, np.float32)])
    scored, masks, _ = split_mask(_tensor(graph, "logits"))
    expected = ["mask", "allowed"] if outer == "padding" else ["allowed", "mask"]
    assert (scored.name, [m.name for m in masks]) == ("scaled", expected)


@pytest.mark.parametrize("fill", [-1.0, 0.0])
def test_a_where_that_fills_with_an_ordinary_value_is_not_a_mask(fill):
    nodes = _scores_nodes() + [helper.make_node("Where", ["allowed", "scaled", "fill"], ["logits"])]
    graph = _graph(nodes, SCORE_INPUTS + [_value("allowed", [B, 1, T, T], TensorProto.BOOL)],
                   [_value("logits", [B, 2, T, T])], [_const("scale", 0.5, np.float32), _const("fill", fill, np.float32)])
    scored, masks, _ = split_mask(_tensor(graph, "logits"))
    assert scored.name == "logits" and masks == ()


def _softmax_graph(guard_value: float, cast: bool = False):
    nodes = [helper.make_node("Softmax", ["logits"], ["p"], axis=-1)]
    probabilities = "p"
    if cast:
        nodes.append(helper.make_node("Cast", ["p"], ["p16"], to=TensorProto.FLOAT16))
        probabilities = "p16"
    zero_type = TensorProto.FLOAT16 if cast else TensorProto.FLOAT
    nodes += [helper.make_node("IsNaN", [probabilities], ["nan"]),
              helper.make_node("Where", ["nan", "zero", probabilities], ["guarded"])]
    zero = numpy_helper.from_array(np.array(guard_value, helper.tensor_dtype_to_np_dtype(zero_type)), "zero")
    graph = _graph(nodes, [_value("logits", [B, 2, T, T])], [_value("guarded", [B, 2, T, T], zero_type)], [zero])
    softmax = next(n for n in graph.nodes if n.op == "Softmax")
    return graph, softmax


@pytest.mark.parametrize("cast", [False, True], ids=["float32", "cast_to_float16"])
def test_the_nan_guard_after_a_softmax_is_part_of_the_probabilities(cast):
    graph, softmax = _softmax_graph(0.0, cast)
    assert match_probabilities(graph, softmax).name == "guarded"


def test_a_guard_that_replaces_nan_by_something_else_is_not_passed():
    graph, softmax = _softmax_graph(1.0)
    assert match_probabilities(graph, softmax).name == "p"


# ---- heads ------------------------------------------------------------------------------------------

def _split_merge_graph(perm):
    nodes = [helper.make_node("Reshape", ["proj", "heads_shape"], ["split"]),
             helper.make_node("Transpose", ["split"], ["heads"], perm=perm),
             helper.make_node("Transpose", ["heads"], ["back"], perm=perm),
             helper.make_node("Reshape", ["back", "merged_shape"], ["merged"])]
    return _graph(nodes, [_value("proj", [B, T, 8])], [_value("merged", [B, T, 8])],
                  [_const("heads_shape", [0, 0, 2, D]), _const("merged_shape", [0, 0, 8])])


def test_heads_split_from_and_merged_into_a_projection():
    graph = _split_merge_graph([0, 2, 1, 3])
    projection = match_head_split(_tensor(graph, "heads"))
    assert projection.tensor.name == "proj" and projection.heads == 2 and not projection.per_head
    assert match_head_merge(graph, _tensor(graph, "heads")).name == "merged"


def test_heads_moved_by_another_transpose_are_refused():
    graph = _split_merge_graph([0, 1, 3, 2])
    assert match_head_split(_tensor(graph, "heads")) == "the heads are not a (0, 2, 1, 3) transpose"
    assert isinstance(match_head_merge(graph, _tensor(graph, "heads")), str)


# ---- the KV cache -----------------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [2, -2])
def test_a_cache_concatenated_on_the_sequence_axis(axis):
    graph = _graph([helper.make_node("Concat", ["past", "new"], ["present"], axis=axis)],
                   [_value("past", [B, KV, 3, D]), _value("new", [B, KV, T, D])], [_value("present", [B, KV, 3 + T, D])])
    cache = match_kv_concat(graph, _tensor(graph, "present"))
    assert (cache.past.name, cache.new.name, cache.present.name, cache.window) == ("past", "new", "present", 0)


def test_a_concatenation_on_another_axis_or_of_a_computed_past_is_not_a_cache():
    graph = _graph([helper.make_node("Concat", ["past", "new"], ["wide"], axis=3),
                    helper.make_node("Neg", ["past"], ["computed"]),
                    helper.make_node("Concat", ["computed", "new"], ["present"], axis=2)],
                   [_value("past", [B, KV, T, D]), _value("new", [B, KV, T, D])],
                   [_value("wide", [B, KV, T, 2 * D]), _value("present", [B, KV, 2 * T, D])])
    for name in ("wide", "present"):
        cache = match_kv_concat(graph, _tensor(graph, name))
        assert cache.past is None and cache.present is None and cache.new.name == name


# ---- GQA head repetition ----------------------------------------------------------------------------

REPEATS = 3


def _repeat(kind: str) -> gs.Graph:
    grouped = [B, KV, REPEATS, T, D]
    insert = helper.make_node("Unsqueeze", ["kv", "axis2"], ["one"])
    if kind == "reshape_insert":
        insert = helper.make_node("Reshape", ["kv", "grouped_one"], ["one"])
    copies = {
        "expand": helper.make_node("Expand", ["one", "grouped"], ["copies"]),
        "tile": helper.make_node("Tile", ["one", "multiples"], ["copies"]),
        "concat": helper.make_node("Concat", ["one"] * REPEATS, ["copies"], axis=2),
        "reshape_insert": helper.make_node("Expand", ["one", "grouped"], ["copies"]),
        "wrong_axis": helper.make_node("Expand", ["one", "grouped"], ["copies"]),
    }[kind]
    if kind == "wrong_axis":  # each head repeated in order (h % KV), not in place (h // KV)
        insert = helper.make_node("Unsqueeze", ["kv", "axis1"], ["one"])
        copies = helper.make_node("Expand", ["one", "outer"], ["copies"])
    nodes = [insert, copies, helper.make_node("Reshape", ["copies", "merged"], ["repeated"])]
    initializers = [_const("axis2", [2]), _const("axis1", [1]), _const("grouped", grouped),
                    _const("grouped_one", [B, KV, 1, T, D]), _const("multiples", [1, 1, REPEATS, 1, 1]),
                    _const("outer", [B, REPEATS, KV, T, D]), _const("merged", [B, KV * REPEATS, T, D])]
    return _graph(nodes, [_value("kv", [B, KV, T, D])], [_value("repeated", [B, KV * REPEATS, T, D])], initializers)


@pytest.mark.parametrize("kind", ["expand", "tile", "concat", "reshape_insert"])
def test_gqa_repetition_is_undone_in_each_spelling(kind):
    graph = _repeat(kind)
    source, repeats = match_gqa_repeat(_tensor(graph, "repeated"))
    assert source.name == "kv" and repeats == REPEATS
    kv = RNG.standard_normal((B, KV, T, D)).astype(np.float32)
    np.testing.assert_array_equal(_run(graph, {"kv": kv})["repeated"], np.repeat(kv, REPEATS, axis=1))


def test_repetition_in_the_other_head_order_is_not_gqa():
    graph = _repeat("wrong_axis")
    assert match_gqa_repeat(_tensor(graph, "repeated")) is None
    kv = RNG.standard_normal((B, KV, T, D)).astype(np.float32)
    assert not np.array_equal(_run(graph, {"kv": kv})["repeated"], np.repeat(kv, REPEATS, axis=1))


@pytest.mark.parametrize("indices,expected", [([0, 0, 0, 1, 1, 1], REPEATS), ([0, 1, 0, 1, 0, 1], None)])
def test_gqa_repetition_by_gather(indices, expected):
    graph = _graph([helper.make_node("Gather", ["kv", "heads"], ["repeated"], axis=1)], [_value("kv", [B, KV, T, D])],
                   [_value("repeated", [B, len(indices), T, D])], [_const("heads", indices)])
    found = match_gqa_repeat(_tensor(graph, "repeated"))
    assert (found[1] if found else None) == expected


# ---- the mask's source ------------------------------------------------------------------------------

def _mask_graph(extra_input: bool = False, compare: bool = True) -> gs.Graph:
    nodes = [helper.make_node("Cast", ["attention_mask"], ["keep"], to=TensorProto.BOOL),
             helper.make_node("Unsqueeze", ["keep", "axes"], ["keep4"])]
    if compare:
        nodes += [helper.make_node("LessOrEqual", ["cols", "rows"], ["causal"]),
                  helper.make_node("And", ["causal", "keep4"], ["allowed"])]
    else:
        nodes.append(helper.make_node("Identity", ["keep4"], ["allowed"]))
    if extra_input:
        nodes += [helper.make_node("Cast", ["segments"], ["segment_keep"], to=TensorProto.BOOL),
                  helper.make_node("Unsqueeze", ["segment_keep", "axes"], ["segment4"]),
                  helper.make_node("And", ["allowed", "segment4"], ["both"])]
    nodes.append(helper.make_node("Where", ["both" if extra_input else "allowed", "zero", "minimum"], ["mask"]))
    inputs = [_value("attention_mask", ["batch", "total"], TensorProto.INT64)]
    if extra_input:
        inputs.append(_value("segments", ["batch", "total"], TensorProto.INT64))
    return _graph(nodes, inputs, [_value("mask", None)],
                  [_const("axes", [1, 2]), _const("cols", np.arange(T)[None, None, None, :]),
                   _const("rows", np.arange(T)[None, None, :, None]), _const("zero", 0.0, np.float32),
                   _const("minimum", -np.inf, np.float32)])


def test_the_mask_reads_the_attention_mask_and_compares_positions():
    graph = _mask_graph()
    source = match_mask_source(graph, _tensor(graph, "mask"))
    assert (source.attention_mask.name, source.causal, source.window) == ("attention_mask", 1, 0)


def test_a_padding_only_mask_is_not_causal():
    graph = _mask_graph(compare=False)
    source = match_mask_source(graph, _tensor(graph, "mask"))
    assert (source.attention_mask.name, source.causal) == ("attention_mask", 0)


def test_a_mask_that_reads_two_inputs_is_refused():
    graph = _mask_graph(extra_input=True)
    assert match_mask_source(graph, _tensor(graph, "mask")).startswith("the mask reads the input segments")


def _mask_plus(extra: str) -> gs.Graph:
    """`_mask_graph`'s mask plus a term: ALiBi's per-head slopes times key positions (its slopes folded
    into a constant, or left as `Pow(base, Range)`), or what masks are also built from: a float 0/1 causal
    buffer compared with 0, a buffer of 0 and a fill rounded to bfloat16 (-9984)."""
    graph = _mask_graph()
    model = gs.export_onnx(graph)
    nodes, inits = list(model.graph.node), list(model.graph.initializer)
    tril = np.tril(np.ones((T, T), np.float32))[None, None]
    if extra in ("slopes", "pow"):
        nodes.append(helper.make_node("Cast", ["cols"], ["positions"], to=TensorProto.FLOAT))
        if extra == "pow":
            nodes += [helper.make_node("Range", ["one", "five", "one"], ["powers"]),
                      helper.make_node("Cast", ["powers"], ["float_powers"], to=TensorProto.FLOAT),
                      helper.make_node("Pow", ["base", "float_powers"], ["slopes"])]
            inits += [_const("one", 1), _const("five", 5), _const("base", 0.5, np.float32)]
        else:
            inits.append(_const("slopes", [0.5, 0.25, 0.125, 0.0625], np.float32))
        nodes += [helper.make_node("Reshape", ["slopes", "heads"], ["slopes4"]),
                  helper.make_node("Mul", ["slopes4", "positions"], ["extra"])]
        inits.append(_const("heads", [1, -1, 1, 1]))
    elif extra == "tril":
        nodes += [helper.make_node("Equal", ["tril", "zero"], ["hidden"]),
                  helper.make_node("Where", ["hidden", "minimum", "zero"], ["extra"])]
        inits.append(_const("tril", tril, np.float32))
    else:
        inits.append(_const("extra", np.where(tril > 0, 0.0, -9984.0), np.float32))
    nodes.append(helper.make_node("Add", ["mask", "extra"], ["mask2"]))
    return _graph(nodes, list(model.graph.input), [_value("mask2", None)], inits)


@pytest.mark.parametrize("heads_inferred", [True, False])
@pytest.mark.parametrize("extra", ["slopes", "pow"])
def test_a_mask_carrying_per_head_slopes_is_refused(extra, heads_inferred):
    """By the mask's head axis where shape inference knows it, else by what the mask is computed from."""
    graph = _mask_plus(extra)
    if not heads_inferred:
        _tensor(graph, "mask2").shape = None
    assert "per head" in match_mask_source(graph, _tensor(graph, "mask2"))


@pytest.mark.parametrize("extra", ["tril", "fill"])
def test_a_causal_buffer_or_a_rounded_fill_is_still_a_mask(extra):
    graph = _mask_plus(extra)
    source = match_mask_source(graph, _tensor(graph, "mask2"))
    assert (source.attention_mask.name, source.causal) == ("attention_mask", 1)


def _folded_mask_graph(pattern: np.ndarray, hidden: bool) -> gs.Graph:
    """The padding mask And a constant of positions, as a fixed-shape export folds its comparison: the keys
    each query sees (`hidden`: the keys it does not, Or-ed with the padding's holes instead)."""
    nodes = [helper.make_node("Cast", ["attention_mask"], ["keep"], to=TensorProto.BOOL),
             helper.make_node("Unsqueeze", ["keep", "axes"], ["keep4"])]
    if hidden:
        nodes += [helper.make_node("Not", ["keep4"], ["holes"]), helper.make_node("Or", ["positions", "holes"], ["off"]),
                  helper.make_node("Where", ["off", "minimum", "zero"], ["mask"])]
    else:
        nodes += [helper.make_node("And", ["positions", "keep4"], ["allowed"]),
                  helper.make_node("Where", ["allowed", "zero", "minimum"], ["mask"])]
    return _graph(nodes, [_value("attention_mask", [1, T], TensorProto.INT64)], [_value("mask", None)],
                  [_const("axes", [1, 2]), _const("positions", pattern[None, None], np.bool_),
                   _const("zero", 0.0, np.float32), _const("minimum", -np.inf, np.float32)])


@pytest.mark.parametrize("hidden", [False, True])
def test_a_folded_causal_constant_is_read_as_causal(hidden):
    seen = np.tril(np.ones((T, T), bool))
    graph = _folded_mask_graph(~seen if hidden else seen, hidden)
    source = match_mask_source(graph, _tensor(graph, "mask"))
    assert (source.attention_mask.name, source.causal) == ("attention_mask", 1)


@pytest.mark.parametrize("pattern", ["band", "anti-causal"])
def test_a_folded_constant_of_other_positions_is_refused_not_dropped(pattern):
    seen = np.tril(np.ones((T, T), bool))
    graph = _folded_mask_graph(seen & ~np.tril(seen, -2) if pattern == "band" else seen.T, hidden=False)
    assert "a constant pattern of positions" in match_mask_source(graph, _tensor(graph, "mask"))


def _compared_mask(kind: str) -> gs.Graph:
    """The padding mask And a comparison of key positions `cols` [1, 1, 1, T] with query positions `rows`
    [1, 1, T, 1], written as `kind`."""
    compare = {
        "causal": [helper.make_node("LessOrEqual", ["cols", "rows"], ["positions"])],
        "flipped": [helper.make_node("GreaterOrEqual", ["rows", "cols"], ["positions"])],
        "window on the keys": [helper.make_node("LessOrEqual", ["cols", "rows"], ["causal"]),
                               helper.make_node("Add", ["cols", "three"], ["moved"]),
                               helper.make_node("Greater", ["moved", "rows"], ["window"]),
                               helper.make_node("And", ["causal", "window"], ["positions"])],
        "hidden window": [helper.make_node("LessOrEqual", ["cols", "rows"], ["causal"]),
                          helper.make_node("Sub", ["rows", "three"], ["back"]),
                          helper.make_node("LessOrEqual", ["cols", "back"], ["too_old"]),
                          helper.make_node("Not", ["too_old"], ["recent"]),
                          helper.make_node("And", ["causal", "recent"], ["positions"])],
        "strictly before": [helper.make_node("Less", ["cols", "rows"], ["positions"])],
        "bidirectional": [helper.make_node("GreaterOrEqual", ["rows", "zero_int"], ["positions"])],
        "distance": [helper.make_node("Sub", ["rows", "cols"], ["distance"]),
                     helper.make_node("Less", ["distance", "three"], ["positions"])],
        "chunked": [helper.make_node("LessOrEqual", ["cols", "rows"], ["causal"]),
                    helper.make_node("Div", ["cols", "three"], ["key_chunk"]),
                    helper.make_node("Div", ["rows", "three"], ["query_chunk"]),
                    helper.make_node("Equal", ["key_chunk", "query_chunk"], ["same_chunk"]),
                    helper.make_node("And", ["causal", "same_chunk"], ["positions"])],
        "position_ids": [helper.make_node("Unsqueeze", ["position_ids", "axes"], ["rows_from_input"]),
                         helper.make_node("Unsqueeze", ["rows_from_input", "last"], ["rows4"]),
                         helper.make_node("LessOrEqual", ["cols", "rows4"], ["positions"])],
    }[kind]
    nodes = [helper.make_node("Cast", ["attention_mask"], ["keep"], to=TensorProto.BOOL),
             helper.make_node("Unsqueeze", ["keep", "axes"], ["keep4"]), *compare,
             helper.make_node("And", ["positions", "keep4"], ["allowed"]),
             helper.make_node("Where", ["allowed", "zero", "minimum"], ["mask"])]
    inputs = [_value("attention_mask", [1, T], TensorProto.INT64), _value("position_ids", [1, T], TensorProto.INT64)]
    return _graph(nodes, inputs, [_value("mask", None)],
                  [_const("axes", [1]), _const("last", [3]), _const("cols", np.arange(T)[None, None, None, :]),
                   _const("rows", np.arange(T)[None, None, :, None]), _const("three", 3), _const("zero_int", 0),
                   _const("zero", 0.0, np.float32), _const("minimum", -np.inf, np.float32)])


@pytest.mark.parametrize("kind, window", [("causal", 0), ("flipped", 0), ("window on the keys", 3),
                                          ("hidden window", 3)])
def test_key_and_query_positions_compared_the_causal_way(kind, window):
    graph = _compared_mask(kind)
    source = match_mask_source(graph, _tensor(graph, "mask"))
    assert (source.attention_mask.name, source.causal, source.window) == ("attention_mask", 1, window)


@pytest.mark.parametrize("kind, reason", [
    ("strictly before", "with an offset of 0, neither causal nor a window"),
    ("bidirectional", "compares positions with a constant"),
    ("distance", "compares positions with a constant"),
    ("chunked", "compares chunks of positions"),
    ("position_ids", "reads the input position_ids")])
def test_other_comparisons_of_positions_are_refused_not_dropped(kind, reason):
    graph = _compared_mask(kind)
    assert reason in match_mask_source(graph, _tensor(graph, "mask"))


def _ranged_mask(queries: str) -> gs.Graph:
    """The padding mask And `kv <= q`, with key positions `arange(T)` (T the attention_mask's length) and the
    query positions written as `queries` says, as exports compute them from shapes."""
    length = lambda source, axis, out: [  # noqa: E731
        helper.make_node("Shape", [source], [f"{out}_shape"]),
        helper.make_node("Gather", [f"{out}_shape", f"axis{axis}"], [out])]
    nodes = [*length("attention_mask", 1, "total"), *length("input_ids", 1, "new"), *length("past", 2, "past_length"),
             helper.make_node("Range", ["zero_int", "total", "one_int"], ["keys"]),
             helper.make_node("Unsqueeze", ["keys", "key_axes"], ["cols"])]
    nodes += {
        "from zero": [helper.make_node("Range", ["zero_int", "new", "one_int"], ["rows1"])],
        "after the past": [helper.make_node("Range", ["zero_int", "new", "one_int"], ["counted"]),
                           helper.make_node("Add", ["counted", "past_length"], ["rows1"])],
        "from the past": [helper.make_node("Range", ["past_length", "total", "one_int"], ["rows1"])],
        "one range": [helper.make_node("Identity", ["keys"], ["rows1"])],
        "traced twice": [*length("attention_mask", 1, "again"),
                         helper.make_node("Range", ["zero_int", "again", "one_int"], ["rows1"])],
    }[queries]
    nodes += [helper.make_node("Unsqueeze", ["rows1", "query_axes"], ["rows"]),
              helper.make_node("LessOrEqual", ["cols", "rows"], ["positions"]),
              helper.make_node("Cast", ["attention_mask"], ["keep"], to=TensorProto.BOOL),
              helper.make_node("Unsqueeze", ["keep", "axes"], ["keep4"]),
              helper.make_node("And", ["positions", "keep4"], ["allowed"]),
              helper.make_node("Where", ["allowed", "zero", "minimum"], ["mask"])]
    inputs = [_value("attention_mask", [1, "total"], TensorProto.INT64), _value("input_ids", [1, "new"], TensorProto.INT64),
              _value("past", [1, 2, "past_length", 16])]
    return _graph(nodes, inputs, [_value("mask", None)],
                  [_const("axis1", 1), _const("axis2", 2), _const("zero_int", 0), _const("one_int", 1),
                   _const("key_axes", [0, 1, 2]), _const("query_axes", [0, 1, 3]), _const("axes", [1, 2]),
                   _const("zero", 0.0, np.float32), _const("minimum", -np.inf, np.float32)])


@pytest.mark.parametrize("queries, from_first_key", [
    ("from zero", True),  # transformers 4.44's Gemma 2: arange(S) whatever the past
    ("after the past", False), ("from the past", False),  # arange(S) + P, arange(P, P + S)
    # one square block of positions, placed after the past's keys by what joins it (transformers 4.37)
    ("one range", False), ("traced twice", False)])
def test_queries_counted_from_zero_are_refused_over_a_past(queries, from_first_key):
    graph = _ranged_mask(queries)
    source = match_mask_source(graph, _tensor(graph, "mask"))
    assert (source.attention_mask.name, source.causal, source.window) == ("attention_mask", 1, 0)
    assert source.queries_from_first_key == from_first_key
    assert (source.refusal_over_a_past() is not None) == from_first_key


def _triangle_mask(triangles: list[tuple[int, int | tuple[str, int]]]) -> gs.Graph:
    """Where(any of the Trilus of ones, min, 0) with the padding mask added: each triangle (upper, diagonal), the
    diagonal a constant, or computed ("length", c): the padding mask's length plus c, as transformers before 4.43
    wrote the past's length, or ("values", c): the count of its kept keys plus c."""
    nodes, marked, constants = [], [], [_const("ones", np.ones((T, T), bool)), _const("zero", 0.0, np.float32),
                                        _const("minimum", np.finfo(np.float32).min, np.float32), _const("axes", [1, 2]),
                                        _const("one", 1.0, np.float32)]
    for index, (upper, diagonal) in enumerate(triangles):
        if isinstance(diagonal, tuple):
            kind, offset = diagonal
            if kind == "length":
                nodes += [helper.make_node("Shape", ["attention_mask"], [f"shape{index}"]),
                          helper.make_node("Gather", [f"shape{index}", "last_axis"], [f"length{index}"])]
                constants.append(_const("last_axis", np.array(1)))
            else:
                nodes.append(helper.make_node("ReduceSum", ["attention_mask"], [f"length{index}"], keepdims=0))
            nodes.append(helper.make_node("Add", [f"length{index}", f"offset{index}"], [f"k{index}"]))
            constants.append(_const(f"offset{index}", np.array(offset)))
        else:
            constants.append(_const(f"k{index}", np.array(int(diagonal))))
        nodes.append(helper.make_node("Trilu", ["ones", f"k{index}"], [f"triangle{index}"], upper=upper))
        marked.append(f"triangle{index}")
    hidden = marked[0]
    for index, other in enumerate(marked[1:]):
        nodes.append(helper.make_node("Or", [hidden, other], [f"hidden{index}"]))
        hidden = f"hidden{index}"
    nodes += [helper.make_node("Where", [hidden, "minimum", "zero"], ["positions"]),
              helper.make_node("Cast", ["attention_mask"], ["keep"], to=TensorProto.FLOAT),
              helper.make_node("Unsqueeze", ["keep", "axes"], ["keep4"]),
              helper.make_node("Sub", ["one", "keep4"], ["dropped"]),
              helper.make_node("Mul", ["dropped", "minimum"], ["padding"]),
              helper.make_node("Add", ["positions", "padding"], ["mask"])]
    return _graph(nodes, [_value("attention_mask", [1, T], TensorProto.INT64)], [_value("mask", None)], constants)


@pytest.mark.parametrize("triangles, window", [
    ([(1, 1)], 0),  # the keys after the query hidden: transformers' triu(diagonal=1)
    ([(0, 0)], 0),
    ([(1, 1), (0, -3)], 3),  # Gemma 2 before transformers 4.53: tril(diagonal=-W) hides the keys W back
    # Mistral and Qwen2 before transformers 4.43: triu(diagonal=P - W + 1), the keys seen, P the past's length
    ([(1, 1), (1, ("length", -2))], 3),
    ([(1, ("length", 1))], 0)])
def test_triangles_of_positions_read_as_causal_or_a_window(triangles, window):
    graph = _triangle_mask(triangles)
    source = match_mask_source(graph, _tensor(graph, "mask"))
    assert (source.attention_mask.name, source.causal, source.window) == ("attention_mask", 1, window)
    # a constant diagonal counts rows from the first key, over a past not the queries' positions; one moved
    # by the past's length counts from the query's position
    from_first_key = bool(window) and not isinstance(triangles[-1][1], tuple)
    assert source.window_from_first_key == from_first_key
    assert (source.refusal_over_a_past() is not None) == from_first_key


def test_a_window_of_compared_positions_counts_from_the_query():
    graph = _compared_mask("window on the keys")
    source = match_mask_source(graph, _tensor(graph, "mask"))
    assert (source.window, source.window_from_first_key, source.refusal_over_a_past()) == (3, False, None)


@pytest.mark.parametrize("triangles, reason", [
    ([(0, 1)], "lower triangle from diagonal 1, neither causal nor a window"),
    ([(1, 0)], "upper triangle from diagonal 0, neither causal nor a window"),
    # the keys from 2 back on, hidden with those after the query: read as a window it would be its opposite
    ([(1, 1), (1, -2)], "upper triangle from diagonal -2, neither causal nor a window"),
    ([(1, 1), (0, ("length", -3))], "lower triangle from a length plus -3"),
    ([(1, 1), (1, ("values", -2))], "triangle of a computed diagonal")])
def test_other_triangles_are_refused_not_dropped(triangles, reason):
    graph = _triangle_mask(triangles)
    assert reason in match_mask_source(graph, _tensor(graph, "mask"))


# ---- rotary embedding: what the lowering writes, the pattern reads back -----------------------------

def _lowered_rotary(rotary_dim: int, interleaved: int) -> onnx.ModelProto:
    b = Builder("rope")
    rotary_embedding(b, "x", "cos", "sin", rotary_dim, D * 2, interleaved)
    b.nodes[-1].output[0] = "y"
    inputs = [_value("x", [B, 2, T, D * 2]), _value("cos", [B, 1, T, rotary_dim]), _value("sin", [B, 1, T, rotary_dim])]
    model = helper.make_model(helper.make_graph(b.nodes, "g", inputs, [_value("y", [B, 2, T, D * 2])]),
                              opset_imports=[helper.make_opsetid("", 17)])
    return model


def _numpy_rotary(x, cos, sin, rotary_dim, interleaved):
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        turned = np.stack([-rotated[..., 1::2], rotated[..., 0::2]], axis=-1).reshape(rotated.shape)
    else:
        half = rotary_dim // 2
        turned = np.concatenate([-rotated[..., half:], rotated[..., :half]], axis=-1)
    return np.concatenate([rotated * cos + turned * sin, passed], axis=-1)


@pytest.mark.parametrize("rotary_dim,interleaved", [(8, 0), (8, 1), (4, 0), (4, 1)],
                         ids=["half", "pairs", "partial_half", "partial_pairs"])
def test_the_lowerings_rotation_is_read_back_by_the_pattern(rotary_dim, interleaved):
    graph = gs.import_onnx(_lowered_rotary(rotary_dim, interleaved))
    graph.fold_constants()
    graph.cleanup()
    InferShapes().run(graph)
    source, rotary = match_rotary(_tensor(graph, "y"))
    assert source.name == "x" and (rotary.cos.name, rotary.sin.name) == ("cos", "sin")
    assert (rotary.rotary_dim, rotary.interleaved) == (rotary_dim, interleaved)
    feeds = {"x": RNG.standard_normal((B, 2, T, D * 2)).astype(np.float32),
             "cos": RNG.standard_normal((B, 1, T, rotary_dim)).astype(np.float32),
             "sin": RNG.standard_normal((B, 1, T, rotary_dim)).astype(np.float32)}
    np.testing.assert_allclose(_run(graph, feeds)["y"], _numpy_rotary(*feeds.values(), rotary_dim, interleaved), atol=1e-6)


def test_a_rotation_that_turns_the_wrong_way_is_not_rope():
    graph = gs.import_onnx(_lowered_rotary(8, 0))
    graph.fold_constants()
    graph.cleanup()
    InferShapes().run(graph)
    concat = next(n for n in graph.nodes if n.op == "Concat")
    concat.inputs[0], concat.inputs[1] = concat.inputs[1], concat.inputs[0]  # Concat(x1, -x2): the inverse turn
    assert match_rotary(_tensor(graph, "y")) is None


@pytest.mark.parametrize("change", ["short_tail", "other_axis"])
def test_a_partial_rotation_must_pass_the_rest_of_the_head_through_whole(change):
    """[rope(x[:R]), x[R:]] is a partial rotation only when the tail runs to the head's end and the two are
    joined on the last axis: a tail cut short, or a Concat on another axis, is no rotation of x."""
    graph = gs.import_onnx(_lowered_rotary(4, 0))
    graph.fold_constants()
    graph.cleanup()
    InferShapes().run(graph)
    output = _tensor(graph, "y").inputs[0]
    if change == "short_tail":
        tail = output.inputs[1].inputs[0]
        tail.inputs[2] = gs.Constant("short_end", np.array([D * 2 - 2], np.int64))
    else:
        output.attrs["axis"] = 2
    assert match_rotary(_tensor(graph, "y")) is None


def test_dtype_kind_reads_the_onnx_enums_graphsurgeon_keeps_for_types_numpy_lacks():
    assert dtype_kind(TensorProto.BFLOAT16) == "V" and dtype_kind(TensorProto.FLOAT8E4M3FN) == "V"
    assert dtype_kind(np.int64) == "i" and dtype_kind(np.bool_) == "b" and dtype_kind(None) == "f"


@pytest.mark.parametrize("floor, masked", [(float(np.finfo(np.float32).min), True), (-65504.0, True), (0.0, False),
                                           (-1e4, False)])
def test_a_floor_at_the_lowest_float_is_looked_through_and_no_other(floor, masked):
    """`max(scores + mask, finfo.min)` (Baichuan's and InternLM's remote code) keeps -inf out of the softmax
    and nothing else; a higher floor changes weights, and the scores under it are not read as masked."""
    scores = gs.Variable("scores", np.float32, [1, 2, 3, 3])
    gs.Node("MatMul", inputs=[gs.Variable("q", np.float32, [1, 2, 3, 4]), gs.Variable("k", np.float32, [1, 2, 4, 3])],
            outputs=[scores])
    mask = gs.Variable("mask", np.float32, [1, 1, 3, 3])
    summed, floored = gs.Variable("summed", np.float32), gs.Variable("floored", np.float32)
    gs.Node("Add", inputs=[scores, mask], outputs=[summed])
    gs.Node("Max", inputs=[summed, gs.Constant("floor", np.array(floor, np.float32))], outputs=[floored])
    found, masks, _ = split_mask(floored)
    assert (found is scores and masks == (mask,)) if masked else masks == ()
