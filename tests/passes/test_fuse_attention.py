"""AttentionFusionPass and QkvFusionPass on real exports: counts, ops left, parity, and each refusal.

Positive cases run on every tiny export (test_fusion_counts, test_parity); here each check that can
refuse a match is triggered by one targeted change to a real exported graph.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from conftest import compile_to
from fusion_utils import assert_parity, op_counts, run_fused, run_original

from cann_llm.compiler.loader import load_onnx
from cann_llm.compiler.pass_manager import run_passes
from cann_llm.compiler.pipeline import build_pipeline
from cann_llm.passes.fuse_attention import FuseAttention
from cann_llm.passes.fuse_qkv import FuseQkv
from cann_llm.passes.match_attention import match_gqa_repeat, match_probabilities
from cann_llm.passes.pattern import producer
from cann_llm.runtime.feeds import causal_lm_inputs
from cann_llm.runtime.ops import FusedAttentionInput
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.executor import Executor
from cann_llm.runtime.loader import load_artifact
from cann_llm.runtime.signature import io_signature, llm_dimensions


def _before_attention(dynamo: bool, with_past: bool = True, family: str = "llama") -> gs.Graph:
    """A tiny export (Llama's by default) taken through every pass that runs before the attention fusion."""
    from cann_llm.models.tiny import tiny_onnx

    graph = gs.import_onnx(load_onnx(tiny_onnx(family, dynamo=dynamo, with_past=with_past)))
    passes = build_pipeline(None)
    run_passes(graph, passes[:[p.name for p in passes].index("AttentionFusionPass")], {})
    return graph


def _first_fused_attributes(model: onnx.ModelProto) -> dict:
    """The attributes of the first FusedAttention node of `model`."""
    node = next(n for n in model.graph.node if n.op_type == "FusedAttention")
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    signature = io_signature(model)
    rng = np.random.default_rng(3)
    dims = llm_dimensions(signature)
    feeds = causal_lm_inputs(signature, dims, rng.integers(0, dims["vocab_size"], (2, 4)),
                             2 if dims["kv_cache_io"] else 0, rng)
    feeds["attention_mask"][0, 0] = 0
    return feeds


@pytest.mark.parametrize("dynamo", [False, True], ids=["ts", "dynamo"])
def test_attention_then_qkv_fuse_each_layer_and_keep_the_numbers(dynamo, tmp_path):
    graph = _before_attention(dynamo)
    original = gs.export_onnx(graph.copy(), do_type_check=False)
    attention, qkv = FuseAttention().run(graph), FuseQkv().run(graph)
    fused = gs.export_onnx(graph, do_type_check=False)
    counts = op_counts(fused)
    assert (attention.match_times, attention.effect_times, qkv.effect_times) == (2, 2, 2)
    assert counts["FusedAttention"] == 2 and counts["MatMul"] == 2 * 5 + 1  # qkv, o, gate, up, down; lm_head
    assert not {"Softmax", "Where", "Expand", "Neg", "Transpose"} & set(counts)
    attrs = _first_fused_attributes(fused)
    assert (attrs["num_heads"], attrs["kv_num_heads"], attrs["head_dim"], attrs["causal"]) == (4, 2, 16, 1)
    assert attrs["rotary_dim"] == 16 and abs(attrs["scale"] - 0.25) < 1e-7
    assert_parity(original, fused, _feeds(original), tmp_path)


def _with_a_triangle_window(graph: gs.Graph, window: int, layers: int = 2) -> None:
    """The first `layers` layers' masks also hide the keys `window` or more back as Gemma 2 did before
    transformers 4.53: `Where(tril(ones_like(mask), diagonal=-window), min, mask)`."""
    for index, softmax in enumerate([n for n in graph.nodes if n.op == "Softmax"][:layers]):
        add = producer(softmax.inputs[0], "Add")
        mask = add.inputs[1]
        shape, ones = gs.Variable(f"w{index}/shape", np.int64), gs.Variable(f"w{index}/ones", np.bool_)
        hidden, windowed = gs.Variable(f"w{index}/hidden", np.bool_), gs.Variable(f"w{index}/mask", np.float32)
        graph.nodes += [
            gs.Node("Shape", inputs=[mask], outputs=[shape]),
            gs.Node("ConstantOfShape", inputs=[shape], outputs=[ones],
                    attrs={"value": onnx.numpy_helper.from_array(np.array([True]))}),
            gs.Node("Trilu", inputs=[ones, gs.Constant(f"w{index}/k", np.array(-window, np.int64))], outputs=[hidden],
                    attrs={"upper": 0}),
            gs.Node("Where", inputs=[hidden, gs.Constant(f"w{index}/min", np.array(np.finfo(np.float32).min,
                                                                                  np.float32)), mask],
                    outputs=[windowed])]
        add.inputs[1] = windowed
    graph.cleanup().toposort()


def test_a_triangle_window_fuses_without_a_past_and_is_refused_over_one(tmp_path):
    """Gemma 2's window before transformers 4.53 is a triangle of the mask's own rows and keys: without a past
    its rows are the queries, and it fuses as the window; over a past its rows count from the first key, not
    from the queries' positions, and the attention stays as exported rather than fused with another window."""
    graph = _before_attention(False, with_past=False)
    _with_a_triangle_window(graph, 3)
    original = gs.export_onnx(graph.copy(), do_type_check=False)
    assert FuseAttention().run(graph).effect_times == 2
    fused = gs.export_onnx(graph, do_type_check=False)
    attrs = _first_fused_attributes(fused)
    assert (attrs["causal"], attrs["sliding_window"]) == (1, 3)
    signature = io_signature(original)
    dims, rng = llm_dimensions(signature), np.random.default_rng(3)
    feeds = causal_lm_inputs(signature, dims, rng.integers(0, dims["vocab_size"], (2, 6)), 0, rng)
    feeds["attention_mask"][0, 2] = 0  # a hole, not left padding: a query row that sees no key is undefined
    assert_parity(original, fused, feeds, tmp_path)

    graph = _before_attention(False, with_past=True)
    _with_a_triangle_window(graph, 3)
    result = FuseAttention().run(graph)
    assert result.effect_times == 0
    assert len(result.rejections) == 2
    assert all("triangle counted from the first key" in reason for reason in result.rejections)


def _with_queries_from_zero(graph: gs.Graph) -> None:
    """The masks compare keys with query positions `arange(S)`, not `past + arange(S)`, as transformers 4.44's
    Gemma 2 does whatever cache it is given: each query then sees the keys from the first on, as if no past."""
    moved = [n for n in graph.nodes if n.op == "Add" and producer(n.inputs[0], "Range") is not None
             and not isinstance(n.inputs[1], gs.Constant)]
    assert moved, "the tiny export's query positions are arange(S) plus the past's length"
    for add in moved:
        for reader in list(add.outputs[0].outputs):
            reader.inputs[reader.inputs.index(add.outputs[0])] = add.inputs[0]
    graph.cleanup().toposort()


@pytest.mark.parametrize("dynamo", [False, True], ids=["ts", "dynamo"])
def test_queries_counted_from_zero_over_a_past_are_left_as_exported(dynamo, tmp_path):
    """Fused, such a mask would count each query from its position after the past: over a past the
    attention stays as exported, and the compiled model keeps the export's numbers there."""
    from cann_llm.models.tiny import tiny_onnx

    graph = _before_attention(dynamo)
    _with_queries_from_zero(graph)
    result = FuseAttention().run(graph)
    assert result.effect_times == 0 and len(result.rejections) == 2
    assert all("query positions counted from 0" in reason for reason in result.rejections)

    export = gs.import_onnx(load_onnx(tiny_onnx("llama", dynamo=dynamo, with_past=True)))
    _with_queries_from_zero(export)
    edited = gs.export_onnx(export, do_type_check=False)
    onnx.save(edited, tmp_path / "from_zero.onnx")
    feeds = _feeds(edited)
    expected = ort.InferenceSession(edited.SerializeToString()).run(["logits"], feeds)[0]
    executor = Executor(load_artifact(compile_to(tmp_path / "from_zero.onnx", tmp_path / "from_zero")))
    np.testing.assert_allclose(executor.run(feeds)["logits"][1], expected[1], atol=1e-4)  # row 0 is left-padded


def _with_empty_row_guard(graph: gs.Graph, seen_by: str) -> None:
    """`Where(ReduceSum(Cast(seen), -1, keepdims) < 1, 0, context)` after each attention's context, as
    transformers 5's own ONNX exporter writes, `seen_by`: "scores", the boolean of the keys seen that the
    scores' mask is made from; "hidden", the boolean of the hidden keys, the scores' mask made again from
    it (`Where(hidden, min, 0)`); "other", one made from the scores' mask, which that mask does not read."""
    for index, softmax in enumerate([n for n in graph.nodes if n.op == "Softmax"]):
        add = producer(softmax.inputs[0], "Add")
        mask = add.inputs[1]
        where = producer(mask, "Where")
        if seen_by == "scores":
            seen = where.inputs[0]
        elif seen_by == "hidden":
            seen, remade = gs.Variable(f"g{index}/hidden", np.bool_, mask.shape), gs.Variable(f"g{index}/mask", np.float32)
            graph.nodes += [gs.Node("Not", inputs=[where.inputs[0]], outputs=[seen]),
                            gs.Node("Where", inputs=[seen, where.inputs[2], where.inputs[1]], outputs=[remade])]
            add.inputs[1] = remade
        else:
            seen = gs.Variable(f"g{index}/seen", np.bool_, mask.shape)
            graph.nodes.append(gs.Node("Equal", inputs=[mask, gs.Constant(f"g{index}/zero", np.array(0, np.float32))],
                                       outputs=[seen]))
        context = next(n for n in match_probabilities(graph, softmax).outputs if n.op == "MatMul").outputs[0]
        readers = list(context.outputs)
        count, total, few = (gs.Variable(f"g{index}/{name}", dtype) for name, dtype in
                             (("count", np.float32), ("total", np.float32), ("few", np.bool_)))
        guarded = gs.Variable(f"g{index}/guarded", np.float32, context.shape)
        graph.nodes += [
            gs.Node("Cast", inputs=[seen], outputs=[count], attrs={"to": onnx.TensorProto.FLOAT}),
            gs.Node("ReduceSum", inputs=[count, gs.Constant(f"g{index}/axes", np.array([-1], np.int64))],
                    outputs=[total], attrs={"keepdims": 1}),
            gs.Node("Less", inputs=[total, gs.Constant(f"g{index}/one", np.array(1.0, np.float32))], outputs=[few]),
            gs.Node("Where", inputs=[few, gs.Constant(f"g{index}/nothing", np.array(0.0, np.float32)), context],
                    outputs=[guarded])]
        for reader in readers:
            reader.inputs[reader.inputs.index(context)] = guarded
    graph.cleanup().toposort()


@pytest.mark.parametrize("seen_by", ["scores", "hidden", "other"])
def test_rows_zeroed_where_they_see_no_key_fuse_only_from_the_scores_mask(seen_by, tmp_path):
    """Zeroing the rows whose mask sees no key changes only rows that attend to nothing, when that mask is
    the keys the scores' mask lets through; zeroing rows by another mask (or by the hidden keys, which zeroes
    the rows that see every key) is the export's own computation."""
    graph = _before_attention(False, with_past=False)
    assert all(producer(producer(n.inputs[0], "Add").inputs[1], "Where") is not None
               for n in graph.nodes if n.op == "Softmax"), "the tiny export masks with Where(seen, 0, min)"
    _with_empty_row_guard(graph, seen_by)
    original = gs.export_onnx(graph.copy(), do_type_check=False)
    result = FuseAttention().run(graph)
    if seen_by != "scores":
        assert result.effect_times == 0
        assert all("not merged back" in reason for reason in result.rejections)
        return
    assert result.effect_times == 2
    feeds = _feeds(original)  # row 0's first position is padding: it sees no key
    expected = run_original(original, feeds)[0]
    got = run_fused(gs.export_onnx(graph, do_type_check=False), feeds, "onnxruntime", tmp_path)[0]
    np.testing.assert_allclose(got[:, 1:], expected[:, 1:], atol=1e-5)


def test_a_paged_compile_with_one_block_unfused_says_so(tmp_path):
    """One layer's attention refused (a triangle window over a past), the other fused: the paged compile
    names the unfused block, not what the unfused block happens to read (its mask's Shape)."""
    graph = _before_attention(False, with_past=True)
    _with_a_triangle_window(graph, 3, layers=1)
    onnx.save(gs.export_onnx(graph, do_type_check=False), tmp_path / "windowed.onnx")
    with pytest.raises(AtcError) as refused:
        compile_to(tmp_path / "windowed.onnx", tmp_path / "paged", enable_paged_attention=True)
    assert refused.value.code == "E10055" and "1 did not (W10005" in str(refused.value)


def test_one_key_head_broadcast_by_the_matmuls_fuses(tmp_path):
    """Multi-query attention whose one key and value head reach the MatMuls unrepeated, which broadcast it
    over the query heads (Falcon-7B as Optimum exports it): the tiny Mistral's single KV head with its
    repeat_kv taken out, fused and equal to onnxruntime on the edited graph."""
    graph = _before_attention(False, family="mistral")
    for softmax in [n for n in graph.nodes if n.op == "Softmax"]:
        add = producer(softmax.inputs[0], "Add")
        transpose = producer(_unscaled(producer(_unscaled(add.inputs[0]), "MatMul").inputs[1]), "Transpose")
        context = next(n for n in softmax.outputs[0].outputs + [r for w in softmax.outputs[0].outputs
                                                                  if w.op == "Where" for r in w.outputs[0].outputs]
                       if n.op == "MatMul")
        transpose.inputs[0] = match_gqa_repeat(transpose.inputs[0])[0]
        context.inputs[1] = match_gqa_repeat(context.inputs[1])[0]
    graph.cleanup().toposort()
    original = gs.export_onnx(graph.copy(), do_type_check=False)
    assert FuseAttention().run(graph).effect_times == 2
    fused = gs.export_onnx(graph, do_type_check=False)
    attrs = _first_fused_attributes(fused)
    assert (attrs["num_heads"], attrs["kv_num_heads"]) == (4, 1)
    assert_parity(original, fused, _feeds(original), tmp_path)


@pytest.mark.parametrize("outside, fuses", [(4.0, True), (-4.0, False)])
def test_a_mask_added_before_the_scale_fuses_when_the_scale_is_positive(outside, fuses, tmp_path):
    """transformers 4.57's CodeGen adds its mask to the scores and then divides them: the tiny Llama's
    `Add(scores·s, mask)` respelled `(scores·s/c + mask)·c`, fused with the scale s and equal to onnxruntime
    on the edited graph; a negative c (which would turn the mask into a bonus) is refused."""
    graph = _before_attention(False)
    for softmax in [n for n in graph.nodes if n.op == "Softmax"]:
        add = producer(softmax.inputs[0], "Add")
        scaled, mask = add.inputs
        inner = gs.Variable(f"{add.name}/inner", dtype=np.float32, shape=scaled.shape)
        graph.nodes.append(gs.Node("Mul", inputs=[scaled, gs.Constant(f"{add.name}/in", np.array(1 / outside, np.float32))],
                                   outputs=[inner]))
        add.inputs[0] = inner
        outer = gs.Variable(f"{add.name}/outer", dtype=np.float32, shape=add.outputs[0].shape)
        graph.nodes.append(gs.Node("Mul", inputs=[add.outputs[0], gs.Constant(f"{add.name}/out", np.array(outside, np.float32))],
                                   outputs=[outer]))
        softmax.inputs[0] = outer
    graph.cleanup().toposort()
    original = gs.export_onnx(graph.copy(), do_type_check=False)
    result = FuseAttention().run(graph)
    if not fuses:
        assert result.effect_times == 0
        assert all("not a (scaled, masked) MatMul" in reason for reason in result.rejections)
        return
    assert result.effect_times == 2
    fused = gs.export_onnx(graph, do_type_check=False)
    attrs = _first_fused_attributes(fused)
    assert abs(attrs["scale"] - 0.25) < 1e-7
    assert_parity(original, fused, _feeds(original), tmp_path)


def _softmax(graph):
    return next(n for n in graph.nodes if n.op == "Softmax")


def _unscaled(tensor):
    """The tensor behind Muls by a constant (a scale on q, on kᵀ or on the scores)."""
    while (mul := producer(tensor, "Mul")) is not None and isinstance(mul.inputs[1], gs.Constant):
        tensor = mul.inputs[0]
    return tensor


def _scores(graph):
    add = producer(_softmax(graph).inputs[0], "Add")
    return producer(_unscaled(add.inputs[0]), "MatMul")


def _context(graph):
    """The MatMul of the probabilities (past sdpa's NaN guard) with the values."""
    readers = _softmax(graph).outputs[0].outputs
    guard = next((n for n in readers if n.op == "Where"), None)
    return next(c for c in (guard.outputs[0].outputs if guard else readers) if c.op == "MatMul")


def _set_axis(graph):
    _softmax(graph).attrs["axis"] = 1


def _untranspose_keys(graph):
    producer(_unscaled(_scores(graph).inputs[1]), "Transpose").attrs["perm"] = [1, 0, 3, 2]


def _unrotate_query(graph):
    scores = _scores(graph)
    cos_mul = producer(producer(_unscaled(scores.inputs[0]), "Add").inputs[0], "Mul")
    scores.inputs[0] = cos_mul.inputs[0]  # q·cos + rot(q)·sin → q


def _swap_key_tables(graph):
    concat = next(n for n in graph.nodes if n.op == "Concat" and n.outputs[0].name == "present.0.key")
    cos_mul, sin_mul = (producer(t, "Mul") for t in producer(concat.inputs[1], "Add").inputs)
    sin_mul.inputs[1] = cos_mul.inputs[1]


def _extra_mask_input(graph):
    segment = gs.Variable("segment_ids", dtype=np.int64, shape=["batch", "total"])
    graph.inputs.append(segment)
    add = _softmax(graph).inputs[0].inputs[0]
    mask = add.inputs[1]
    as_float = gs.Variable("segment_float", dtype=np.float32)
    mixed = gs.Variable("mixed_mask", dtype=np.float32)
    graph.nodes += [gs.Node("Cast", inputs=[segment], outputs=[as_float], attrs={"to": 1}),
                    gs.Node("Add", inputs=[mask, as_float], outputs=[mixed])]
    add.inputs[1] = mixed


def _float_mask(graph):
    bias = gs.Variable("attention_bias", dtype=np.float32, shape=["batch", 1, "seq", "total"])
    graph.inputs.append(bias)
    _softmax(graph).inputs[0].inputs[0].inputs[1] = bias


def _probabilities_read_twice(graph):
    graph.outputs.append(_softmax(graph).outputs[0])


def test_qkv_refuses_projections_of_different_inputs():
    graph = _before_attention(dynamo=True)
    FuseAttention().run(graph)
    attention = next(n for n in graph.nodes if n.op == "FusedAttention")
    key_matmul = attention.inputs[FusedAttentionInput.KEY].inputs[0]
    shifted = gs.Variable("shifted", dtype=np.float32, shape=key_matmul.inputs[0].shape)
    graph.nodes.append(gs.Node("Neg", inputs=[key_matmul.inputs[0]], outputs=[shifted]))
    key_matmul.inputs[0] = shifted
    result = FuseQkv().run(graph)
    assert result.effect_times == 1 and any("different inputs" in r for r in result.rejections)


def _head_split(graph, index=0):
    """The (0, 2, 1, 3) Transposes that split projections into heads, in graph order."""
    return [n for n in graph.nodes if n.op == "Transpose" and list(n.attrs.get("perm", [])) == [0, 2, 1, 3]
            and producer(n.inputs[0], "Reshape") is not None][index]


def _scores_not_matmul(graph):
    _scores(graph).op = "Sub"


def _context_not_merged(graph):
    _context(graph).outputs[0].outputs[0].attrs["perm"] = [0, 1, 2, 3]


def _value_cache_missing(graph):
    next(n for n in graph.nodes if n.op == "Concat" and n.outputs[0].name == "present.0.value").op = "Max"


def _query_heads_not_transposed(graph):
    _head_split(graph, 0).attrs["perm"] = [0, 2, 3, 1]


def _query_heads_not_reshaped(graph):
    producer(_head_split(graph, 0).inputs[0], "Reshape").op = "Flatten"


def _ragged_projection(graph):
    projection = producer(_head_split(graph, 0).inputs[0], "Reshape").inputs[0]
    projection.shape = list(projection.shape[:-1]) + [63]


def _unshareable_heads(graph):
    key = producer(_head_split(graph, 1).inputs[0], "Reshape").inputs[0]
    key.shape = list(key.shape[:-1]) + [48]


@pytest.mark.parametrize("change, reason", [
    (_scores_not_matmul, "not a (scaled, masked) MatMul"),
    (_context_not_merged, "not merged back"),
    (_value_cache_missing, "a cache for only one"),
    (_query_heads_not_transposed, "not a (0, 2, 1, 3) transpose"),
    (_query_heads_not_reshaped, "not reshaped from a projection"),
    (_ragged_projection, "static multiple of the head size"),
    (_unshareable_heads, "cannot share"),
    (_set_axis, "last axis"),
    (_untranspose_keys, "(0, 1, 3, 2)"),
    (_unrotate_query, "only one of q and k"),
    (_swap_key_tables, "different tables"),
    (_extra_mask_input, "reads the input segment_ids"),
    (_float_mask, "reads the input attention_bias"),
    (_probabilities_read_twice, "do not multiply the values"),
])
def test_attention_refusals(change, reason):
    graph = _before_attention(dynamo=True)
    change(graph)
    result = FuseAttention().run(graph)
    assert result.effect_times == 1
    assert any(reason in r for r in result.rejections), result.rejections


def test_qkv_refusals():
    graph = _before_attention(dynamo=True)
    FuseAttention().run(graph)
    attentions = [n for n in graph.nodes if n.op == "FusedAttention"]
    value_matmul = producer(attentions[0].inputs[FusedAttentionInput.VALUE], "MatMul")
    value_matmul.inputs[1] = gs.Variable("value_weight", dtype=np.float32, shape=list(value_matmul.inputs[1].shape))
    graph.inputs.append(value_matmul.inputs[1])
    key_matmul = producer(attentions[1].inputs[FusedAttentionInput.KEY], "MatMul")
    key_matmul.inputs[1] = gs.Constant("key_weight_fp16", np.asarray(key_matmul.inputs[1].values, np.float16))
    first = FuseQkv().run(graph)
    assert first.effect_times == 0
    assert any("not all constant-weight" in r for r in first.rejections)
    assert any("differ in kind, dtype" in r for r in first.rejections)


def test_qkv_leaves_a_packed_projection_alone():
    graph = _before_attention(dynamo=True)
    FuseAttention().run(graph)
    assert FuseQkv().run(graph).effect_times == 2
    again = FuseQkv().run(graph)
    assert again.effect_times == 0 and all("packed already" in r for r in again.rejections)
