"""MoeFusionPass and the cann::MoE op: both exporters' spellings of batched_mm experts and the unrolled
per-expert loop of transformers 4.57, renormalised routing, refusals, the kernel
against every expert run on every token, the onnxruntime lowering against the kernel, the switch, and
weight quantization of a fused MoE model."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnxruntime as ort
import pytest
from conftest import compile_to, ort_reference
from fusion_utils import apply_pass, assert_parity, op_counts
from onnx import TensorProto, helper, numpy_helper

from cann_llm.models.tiny import TINY_FAMILIES
from cann_llm.passes.fuse_moe import FuseMoe
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.feeds import causal_lm_inputs
from cann_llm.runtime.kernels.moe import MoE, swiglu_expert
from cann_llm.runtime.lowering import lower_for_onnxruntime
from cann_llm.runtime.ops import MoEInput

E, H, I, K = 6, 16, 8, 2
RNG = np.random.default_rng(3)
WEIGHTS = {"router": 0.5 * RNG.standard_normal((H, E)).astype(np.float32),
           "gate_up": 0.3 * RNG.standard_normal((E, 2 * I, H)).astype(np.float32),
           "down": 0.3 * RNG.standard_normal((E, H, I)).astype(np.float32)}
FEEDS = {"x": RNG.standard_normal((5, H)).astype(np.float32)}


def _ints(name, values):
    return numpy_helper.from_array(np.asarray(values, np.int64), name)


def _expert_block(spelling="dynamo", normalize=False, change=None):
    """transformers' batched_mm experts as the two exporters write them (see cann_llm/passes/fuse_moe.py); `change`
    names one structural difference the pass must refuse."""
    n = helper.make_node
    nodes = [n("MatMul", ["x", "router"], ["logits"]), n("Softmax", ["logits"], ["probs"], axis=-1),
             n("TopK", ["probs", "k"], ["values", "indices"], axis=-1, largest=0 if change == "smallest" else 1)]
    weights = "values"
    if normalize:
        axes = "axis0" if change == "renormalised-over-tokens" else "last"
        nodes += [n("ReduceSum", ["values", axes], ["total"], keepdims=1), n("Div", ["values", "total"], ["normed"])]
        weights = "normed"
    nodes += [n("Reshape", [weights, "flat"], ["slot_weights"]), n("Unsqueeze", ["slot_weights", "last"], ["scale"]),
              n("Reshape", ["indices", "flat"], ["slots"])]
    if spelling == "dynamo":
        nodes += [n("Unsqueeze", ["slots", "last"], ["slot_index"]),
                  n("GatherND", ["gate_up", "slot_index"], ["gate_up_w"]), n("GatherND", ["down", "slot_index"], ["down_w"])]
    else:
        nodes += [n("Gather", ["gate_up", "slots"], ["gate_up_w"], axis=0), n("Gather", ["down", "slots"], ["down_w"], axis=0)]
    if change == "slot-major-tokens":  # every token once per slot, but slot after slot: not TopK's order
        nodes += [n("Unsqueeze", ["x", "axis0"], ["x3"]), n("Expand", ["x3", "slot_major"], ["rep3"])]
    else:
        nodes += [n("Unsqueeze", ["x", "axis1"], ["x3"]),
                  n("Expand" if spelling == "dynamo" else "Tile", ["x3", "repeat"], ["rep3"])]
    nodes += [n("Reshape", ["rep3", "rows"], ["rep"]) if spelling == "dynamo" else n("Flatten", ["rep3"], ["rep"], axis=2),
              n("Unsqueeze", ["rep", "last"], ["rep_col"]), n("MatMul", ["gate_up_w", "rep_col"], ["h_col"]),
              n("Squeeze", ["h_col", "last"], ["h"])]
    if spelling == "dynamo":
        nodes.append(n("Split", ["h"], ["gate", "up"], axis=1, num_outputs=2))
    else:
        nodes += [n("Slice", ["h", "zero", "mid", "last"], ["gate"]), n("Slice", ["h", "mid", "end", "last"], ["up"])]
    nodes += [n("Sigmoid", ["gate"], ["sig"]), n("Mul", ["gate", "sig"], ["silu"]), n("Mul", ["silu", "up"], ["act"]),
              n("Unsqueeze", ["act", "last"], ["act_col"]), n("MatMul", ["down_w", "act_col"], ["y_col"]),
              n("Squeeze", ["y_col", "last"], ["y_slot"]), n("Mul", ["y_slot", "scale"], ["weighted"]),
              n("Reshape", ["weighted", "per_token"], ["grouped"]),
              n("ReduceSum", ["grouped", "axis0" if change == "summed-over-tokens" else "axis1"], ["y"], keepdims=0)]
    initializers = [numpy_helper.from_array(v, k) for k, v in WEIGHTS.items()] + [
        _ints("k", [K]), _ints("last", [-1]), _ints("axis0", [0]), _ints("axis1", [1]), _ints("flat", [-1]),
        _ints("repeat", [1, K, 1]), _ints("slot_major", [K, 1, 1]), _ints("rows", [-1, H]),
        _ints("per_token", [-1, K, H]), _ints("zero", [0]), _ints("mid", [I]), _ints("end", [2 * I])]
    graph = helper.make_graph(nodes, "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("normalize", [False, True], ids=["softmax", "renormalised"])
@pytest.mark.parametrize("spelling", ["dynamo", "ts"])
def test_expert_block_becomes_one_moe(spelling, normalize, tmp_path):
    model = _expert_block(spelling, normalize)
    fused, (result,) = apply_pass(model, FuseMoe())
    assert (result.match_times, result.effect_times) == (1, 1)
    assert op_counts(fused) == Counter({"MatMul": 1, "MoE": 1})  # the router's projection stays outside
    node = next(n for n in fused.graph.node if n.op_type == "MoE")
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attributes == {"num_experts": E, "top_k": K, "normalize_routing_weights": int(normalize)}
    assert_parity(model, fused, FEEDS, tmp_path)


@pytest.mark.parametrize("change, reason", [
    ("smallest", "not the k largest of a Softmax"),
    ("renormalised-over-tokens", "summed but not renormalised"),
    ("slot-major-tokens", "do not read each token once per routing slot"),
    ("summed-over-tokens", "not summed over each token's k slots"),
])
def test_other_structures_are_refused(change, reason):
    model = _expert_block(normalize=change.startswith("renormalised"), change=change)
    fused, (result,) = apply_pass(model, FuseMoe())
    assert result.effect_times == 0 and op_counts(fused) == op_counts(model)
    assert len(result.rejections) == 1 and reason in result.rejections[0]


def _expert_loop(normalize=False, change=None):
    """transformers 4.57's loop over every expert, unrolled as its TorchScript export writes it (see
    cann_llm/passes/fuse_moe.py), on the same weights as `_expert_block`; `change` names a difference to refuse."""
    n = helper.make_node
    nodes = [n("MatMul", ["x", "router"], ["logits"]), n("Softmax", ["logits"], ["probs"], axis=1),
             n("TopK", ["probs", "k"], ["values", "indices"], axis=-1, largest=1)]
    weights = "values"
    if normalize:
        nodes += [n("ReduceSum", ["values", "last"], ["total"], keepdims=1), n("Div", ["values", "total"], ["normed"])]
        weights = "normed"
    perm = [2, 0, 1] if change == "token-major-mask" else [2, 1, 0]
    nodes += [n("OneHot", ["indices", "depth", "off_on"], ["onehot"], axis=-1),
              n("Transpose", ["onehot"], ["mask"], perm=perm), n("Unsqueeze", [weights, "axis2"], ["w3"]),
              n("Unsqueeze", ["x", "axis0"], ["x3"]), n("Shape", ["x"], ["x_shape"]),
              n("ConstantOfShape", ["x_shape"], ["acc_start"])]
    initializers, total = [], "acc_start"
    for e in range(E - 1 if change == "missing-expert" else E):
        p = f"e{e}_"
        strided, offset = ("slot", "token") if change == "slot-major-weights" else ("token", "slot")
        nodes += [n("Gather", ["mask", p + "index"], [p + "mask"], axis=0), n("Cast", [p + "mask"], [p + "bool"], to=9),
                  n("NonZero", [p + "bool"], [p + "nz"]), n("Transpose", [p + "nz"], [p + "pairs"], perm=[1, 0]),
                  n("Split", [p + "pairs", "ones"], [p + "s0", p + "s1"], axis=1),
                  n("Squeeze", [p + "s0", "axis1"], [p + "slot"]), n("Squeeze", [p + "s1", "axis1"], [p + "token"]),
                  n("Gather", ["x3", p + "token"], [p + "picked"], axis=1),
                  n("Reshape", [p + "picked", "rows"], [p + "rows"]),
                  n("MatMul", [p + "rows", p + "gate"], [p + "g"]), n("MatMul", [p + "rows", p + "up"], [p + "u"]),
                  n("Sigmoid", [p + "g"], [p + "sig"]), n("Mul", [p + "g", p + "sig"], [p + "silu"]),
                  n("Mul", [p + "silu", p + "u"], [p + "act"]), n("MatMul", [p + "act", p + "down"], [p + "o"]),
                  n("Mul", [p + strided, "k"], [p + "stride"]), n("Add", [p + offset, p + "stride"], [p + "flat"]),
                  n("Flatten", ["w3"], [p + "w_flat"], axis=2), n("Gather", [p + "w_flat", p + "flat"], [p + "w"], axis=0),
                  n("Reshape", [p + "w", "column"], [p + "w_col"]), n("Mul", [p + "o", p + "w_col"], [p + "upd"]),
                  n("Unsqueeze", [p + "token", "axis1"], [p + "tok_col"]), n("Shape", [p + "upd"], [p + "upd_shape"]),
                  n("Expand", [p + "tok_col", p + "upd_shape"], [p + "ind"]),
                  n("ConstantOfShape", ["x_shape"], [p + "zeros"]),
                  n("ScatterElements", [p + "zeros", p + "ind", p + "upd"], [p + "scattered"], axis=0),
                  n("Add", [total, p + "scattered"], [p + "acc"])]
        total = p + "acc"
        initializers += [numpy_helper.from_array(np.asarray(e, np.int64), p + "index"),
                         numpy_helper.from_array(np.ascontiguousarray(WEIGHTS["gate_up"][e, :I].T), p + "gate"),
                         numpy_helper.from_array(np.ascontiguousarray(WEIGHTS["gate_up"][e, I:].T), p + "up"),
                         numpy_helper.from_array(np.ascontiguousarray(WEIGHTS["down"][e].T), p + "down")]
    nodes.append(n("Identity", [total], ["y"]))
    initializers += [numpy_helper.from_array(WEIGHTS["router"], "router"), _ints("k", [K]), _ints("last", [-1]),
                     _ints("depth", [E]), _ints("off_on", [0, 1]), _ints("axis0", [0]), _ints("axis1", [1]),
                     _ints("axis2", [2]), _ints("ones", [1, 1]), _ints("rows", [-1, H]), _ints("column", [-1, 1])]
    graph = helper.make_graph(nodes, "moe_loop", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _moe_weights(model):
    node = next(n for n in model.graph.node if n.op_type == "MoE")
    initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return attributes, initializers[node.input[MoEInput.GATE_UP]], initializers[node.input[MoEInput.DOWN]]


@pytest.mark.parametrize("normalize", [False, True], ids=["softmax", "renormalised"])
def test_expert_loop_becomes_the_same_moe(normalize, tmp_path):
    model = _expert_loop(normalize)
    fused, (result,) = apply_pass(model, FuseMoe())
    assert (result.match_times, result.effect_times) == (1, 1)
    assert op_counts(fused) == Counter({"MatMul": 1, "MoE": 1, "Identity": 1})
    attributes, gate_up, down = _moe_weights(fused)
    batched = apply_pass(_expert_block("ts", normalize), FuseMoe())[0]
    batched_attributes, batched_gate_up, batched_down = _moe_weights(batched)
    assert attributes == batched_attributes == {"num_experts": E, "top_k": K, "normalize_routing_weights": int(normalize)}
    np.testing.assert_array_equal(gate_up, batched_gate_up)  # the per-expert weights stacked as the batched rule's
    np.testing.assert_array_equal(down, batched_down)
    assert_parity(model, fused, FEEDS, tmp_path)


@pytest.mark.parametrize("change, reason", [
    ("missing-expert", f"experts [{E - 1}] of {E} have no block"),
    ("token-major-mask", "not permuted to [experts, slots, tokens]"),
    ("slot-major-weights", "not a down projection scaled by their routing weights"),
])
def test_other_expert_loops_are_refused(change, reason):
    model = _expert_loop(change=change)
    fused, (result,) = apply_pass(model, FuseMoe())
    assert result.effect_times == 0 and op_counts(fused) == op_counts(model)
    assert len(result.rejections) == 1 and reason in result.rejections[0]


def _every_expert_on_every_token(x, logits, gate_up, down, top_k, normalize):
    """All E experts on all tokens, mixed by a dense [T, E] gate that is zero off each token's top k."""
    probabilities = np.exp(logits - logits.max(-1, keepdims=True))
    probabilities /= probabilities.sum(-1, keepdims=True)
    kth = -np.sort(-probabilities, axis=-1)[:, top_k - 1:top_k]
    gates = np.where(probabilities >= kth, probabilities, 0.0)
    if normalize:
        gates /= gates.sum(-1, keepdims=True)
    projected = np.einsum("th,efh->tef", x, gate_up)
    gate, up = projected[..., 0::2], projected[..., 1::2]
    outputs = np.einsum("tei,ehi->teh", gate / (1 + np.exp(-gate)) * up, down)
    return np.einsum("te,teh->th", gates, outputs).astype(np.float32)


def _lowered_session(num_experts, top_k, normalize, gate_up, down):
    node = helper.make_node("MoE", ["x", "logits", "gate_up", "down"], ["y"], domain="cann", num_experts=num_experts,
                            top_k=top_k, normalize_routing_weights=normalize)
    graph = helper.make_graph([node], "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, H]),
                                              helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, num_experts])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(gate_up, "gate_up"), numpy_helper.from_array(down, "down")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("cann", 1)])
    return ort.InferenceSession(lower_for_onnxruntime(model).SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("top_k, normalize", [(1, 0), (2, 0), (2, 1), (4, 1)])
def test_kernel_and_lowering_match_every_expert_on_every_token(top_k, normalize, tokens):
    rng = np.random.default_rng(top_k * 10 + normalize + tokens)
    experts = 8
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    gate_up = (0.3 * rng.standard_normal((experts, 2 * I, H))).astype(np.float32)
    down = (0.3 * rng.standard_normal((experts, H, I))).astype(np.float32)
    expected = _every_expert_on_every_token(x, logits, gate_up, down, top_k, normalize)
    got = MoE(x, logits, gate_up, down, num_experts=experts, top_k=top_k, normalize_routing_weights=normalize)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    fast = _lowered_session(experts, top_k, normalize, gate_up, down).run(None, {"x": x, "logits": logits})[0]
    np.testing.assert_allclose(fast, got, atol=1e-5, rtol=0)


def test_kernel_keeps_leading_dims_and_breaks_ties_to_the_lower_index():
    x = RNG.standard_normal((2, 3, H)).astype(np.float32)
    logits = np.zeros((2, 3, E), np.float32)  # every expert equally likely: experts 0 and 1, as ONNX TopK picks
    got = MoE(x, logits, WEIGHTS["gate_up"], WEIGHTS["down"], num_experts=E, top_k=2)
    rows = x.reshape(6, H)
    expected = sum(swiglu_expert(rows, WEIGHTS["gate_up"][e], WEIGHTS["down"][e]) for e in (0, 1)) / E
    assert got.shape == x.shape
    np.testing.assert_allclose(got.reshape(6, H), expected, atol=1e-6, rtol=0)


def _moe_counts(path):
    loaded = load_artifact(path)
    return loaded, Counter(n.op_type for n in loaded.model.graph.node)


@pytest.mark.parametrize("dynamo", [False, True], ids=["ts", "dynamo"])
def test_renormalised_qwen3_moe_matches_onnxruntime(dynamo, tmp_path):
    """Qwen3-MoE checkpoints route with norm_topk_prob=True (transformers' default is False)."""
    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx("qwen3_moe", dynamo=dynamo, with_past=True, overrides={"norm_topk_prob": True})
    loaded, counts = _moe_counts(compile_to(source, tmp_path / "m"))
    moe = [n for n in loaded.model.graph.node if n.op_type == "MoE"]
    assert len(moe) == 2 and counts["TopK"] == counts["Div"] == 0
    assert all(helper.get_attribute_value(a) == 1 for n in moe for a in n.attribute
               if a.name == "normalize_routing_weights")
    rng = np.random.default_rng(0)
    dims = loaded.metadata["model"]
    ids = rng.integers(0, dims["vocab_size"], (2, 5), dtype=np.int64)
    feeds = causal_lm_inputs(loaded.metadata["signature"], dims, ids, 3, rng)
    expected = ort_reference(source, feeds)
    for backend in ("onnxruntime", "reference"):
        got = Executor(loaded, backend).run(feeds)
        for name in expected:
            np.testing.assert_allclose(got[name], expected[name], atol=1e-5, rtol=0, err_msg=f"{backend} {name}")


def test_switched_off_the_experts_stay_as_exported(tmp_path):
    from cann_llm.models.tiny import tiny_onnx

    switch = tmp_path / "switch.cfg"
    switch.write_text("MoeFusionPass:off\n")
    _, counts = _moe_counts(compile_to(tiny_onnx("qwen2_moe", dynamo=True, with_past=True), tmp_path / "m",
                                       fusion_switch_file=str(switch)))
    assert counts["MoE"] == 0 and counts["TopK"] == counts["Softmax"] == 2 and counts["GatherND"] == 4


@pytest.mark.parametrize("dynamo", [False, True], ids=["ts", "dynamo"])
def test_weight_compression_quantizes_the_2d_matmuls_and_keeps_the_experts_float(dynamo, tmp_path):
    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx("qwen2_moe", dynamo=dynamo, with_past=True)
    loaded, counts = _moe_counts(compile_to(source, tmp_path / "m", enable_compress_weight=True))
    # every 2-D weight but the lm_head's and the routing ones is quantized, however the exporter spelled its
    # layer (dynamo's Gemms): per layer q/k/v, o, the shared expert's gate/up and down; the router and the
    # shared expert's one-column gate stay float MatMuls
    assert counts["MoE"] == 2 and counts["SwiGlu"] == 2 and counts["MatMulInt4"] == 8 and counts["MatMul"] == 1 + 4
    experts = TINY_FAMILIES["qwen2_moe"].sizes["num_experts"]
    routing = {t.name for t in loaded.model.graph.initializer if len(t.dims) == 2 and t.dims[1] in (1, experts)}
    assert len([n for n in loaded.model.graph.node if n.op_type == "MatMul" and n.input[1] in routing]) == 4
    experts = [t for t in loaded.model.graph.initializer if len(t.dims) == 3 and t.data_type == TensorProto.FLOAT]
    assert len(experts) == 4  # gate_up and down of each layer's experts
    rng = np.random.default_rng(1)
    dims = loaded.metadata["model"]
    feeds = causal_lm_inputs(loaded.metadata["signature"], dims, rng.integers(0, 256, (1, 4), dtype=np.int64), 2, rng)
    expected = ort_reference(source, feeds)["logits"]
    for backend in ("onnxruntime", "reference"):
        logits = Executor(loaded, backend).run(feeds)["logits"]
        assert np.isfinite(logits).all()
        # 4-bit weights move the logits, but they still follow the float model's
        assert np.corrcoef(logits.reshape(-1), expected.reshape(-1))[0, 1] > 0.95


def test_fp16_storage_converts_the_2d_weights_and_keeps_the_experts_float32(tmp_path):
    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx("qwen3_moe", dynamo=True, with_past=True)
    loaded, counts = _moe_counts(compile_to(source, tmp_path / "m", precision_mode="force_fp16"))
    types = Counter((len(t.dims), t.data_type) for t in loaded.model.graph.initializer if len(t.dims) >= 2)
    assert counts["MoE"] == 2 and types[(3, TensorProto.FLOAT)] == 4 and types[(3, TensorProto.FLOAT16)] == 0
    assert types[(2, TensorProto.FLOAT16)] > 0
    rng = np.random.default_rng(1)
    dims = loaded.metadata["model"]
    feeds = causal_lm_inputs(loaded.metadata["signature"], dims, rng.integers(0, 256, (1, 4), dtype=np.int64), 2, rng)
    expected = ort_reference(source, feeds)["logits"]
    for backend in ("onnxruntime", "reference"):
        np.testing.assert_allclose(Executor(loaded, backend).run(feeds)["logits"], expected, atol=2e-3, rtol=0)
