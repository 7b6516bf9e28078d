"""The reference kernels of GatedDeltaNet and the causal convolutions with state against onnxruntime's own
ops, which run a hybrid's recurrent layers."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from cann_llm.runtime.kernels.recurrent import CausalConvWithState, GatedDeltaNet, VarlenCausalConvWithState

pytestmark = pytest.mark.unit
HEADS_Q, HEADS_V, SIZE_K, SIZE_V = 2, 4, 16, 8


GDN = ["query", "key", "value", "cu_seqlens", "decay", "beta", "initial_state"]


def _onnxruntime(feeds: dict[str, np.ndarray], op: str = "GatedDeltaNet", names: list[str] = GDN,
                 **attributes) -> list[np.ndarray]:
    node = helper.make_node(op, [n if n in feeds else "" for n in names], ["output", "final_state"],
                            domain="com.microsoft", **attributes)
    values = [helper.make_tensor_value_info(n, TensorProto.INT32 if n.startswith("cu") else TensorProto.FLOAT, None)
              for n in names if n in feeds]
    graph = helper.make_graph([node], "g", values, [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                                    for n in ("output", "final_state")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _inputs(rng, lead: tuple[int, ...], batch: int) -> dict[str, np.ndarray]:
    def unit(shape):  # the delta rule needs L2-normalised keys
        x = rng.standard_normal(shape).astype(np.float32)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    return {"query": unit((*lead, HEADS_Q, SIZE_K)), "key": unit((*lead, HEADS_Q, SIZE_K)),
            "value": rng.standard_normal((*lead, HEADS_V, SIZE_V)).astype(np.float32),
            "decay": -np.abs(rng.standard_normal((*lead, HEADS_V))).astype(np.float32),
            "beta": rng.uniform(0, 1, (*lead, HEADS_V)).astype(np.float32),
            "initial_state": rng.standard_normal((batch, HEADS_V, SIZE_V, SIZE_K)).astype(np.float32)}


def test_reference_equals_onnxruntime_row_by_row():
    feeds = _inputs(np.random.default_rng(0), (2, 70), batch=2)
    expected = _onnxruntime(feeds)
    got = GatedDeltaNet(feeds["query"], feeds["key"], feeds["value"], None, feeds["decay"], feeds["beta"],
                        feeds["initial_state"])
    for actual, wanted in zip(got, expected):
        np.testing.assert_allclose(actual, wanted, rtol=0, atol=2e-5)


def test_reference_equals_onnxruntime_on_sequences_packed_by_cu_seqlens():
    feeds = _inputs(np.random.default_rng(1), (9,), batch=2)
    feeds["cu_seqlens"] = np.array([0, 6, 9], np.int32)  # sequences of 6 and 3 tokens, each from its own state
    expected = _onnxruntime(feeds)
    got = GatedDeltaNet(feeds["query"], feeds["key"], feeds["value"], feeds["cu_seqlens"], feeds["decay"],
                        feeds["beta"], feeds["initial_state"])
    for actual, wanted in zip(got, expected):
        np.testing.assert_allclose(actual, wanted, rtol=0, atol=2e-5)


def test_gated_rule_of_mamba2_equals_onnxruntime_and_the_exports_op():
    """update_rule "gated" at scale 1, no beta (Mamba-2's scan): the reference on sequences packed by cu_seqlens,
    and the torch op an export writes as this node (cann_llm/models/recurrent_export.py) row by row."""
    import torch

    from cann_llm.models.recurrent_export import gated_linear_rule

    rng = np.random.default_rng(4)
    feeds = _inputs(rng, (9,), batch=2)
    del feeds["beta"]
    feeds["value"] *= 3  # an input times its time step, unnormalised
    feeds["cu_seqlens"] = np.array([0, 6, 9], np.int32)
    expected = _onnxruntime(feeds, update_rule="gated", scale=1.0)
    got = GatedDeltaNet(feeds["query"], feeds["key"], feeds["value"], feeds["cu_seqlens"], feeds["decay"], None,
                        feeds["initial_state"], update_rule="gated", scale=1.0)
    for actual, wanted in zip(got, expected):
        np.testing.assert_allclose(actual, wanted, rtol=0, atol=2e-5)
    rows = {k: v for k, v in _inputs(rng, (2, 11), batch=2).items() if k != "beta"}
    expected = _onnxruntime(rows, update_rule="gated", scale=1.0)
    got = gated_linear_rule(*(torch.from_numpy(rows[k]) for k in ("query", "key", "value", "decay", "initial_state")))
    for actual, wanted in zip(got, expected):
        np.testing.assert_allclose(actual.numpy(), wanted, rtol=0, atol=2e-5)


CHANNELS, KERNEL = 6, 4


@pytest.mark.parametrize("activation", ["none", "silu"])
def test_causal_convolution_with_state_equals_onnxruntime(activation):
    rng = np.random.default_rng(2)
    feeds = {"input": rng.standard_normal((2, CHANNELS, 9)).astype(np.float32),
             "weight": rng.standard_normal((CHANNELS, 1, KERNEL)).astype(np.float32),
             "bias": rng.standard_normal(CHANNELS).astype(np.float32),
             "past_state": rng.standard_normal((2, CHANNELS, KERNEL - 1)).astype(np.float32)}
    expected = _onnxruntime(feeds, "CausalConvWithState", ["input", "weight", "bias", "past_state"], activation=activation)
    got = CausalConvWithState(*feeds.values(), activation=activation)
    for actual, wanted in zip(got, expected):
        np.testing.assert_allclose(actual, wanted, rtol=0, atol=1e-5)


def test_causal_convolution_over_packed_sequences_equals_onnxruntime():
    rng = np.random.default_rng(3)
    feeds = {"input": rng.standard_normal((9, CHANNELS)).astype(np.float32),
             "weight": rng.standard_normal((CHANNELS, 1, KERNEL)).astype(np.float32),
             "cu_seqlens": np.array([0, 1, 9], np.int32),  # a decoding sequence's one token, a prompt's eight
             "bias": rng.standard_normal(CHANNELS).astype(np.float32),
             "initial_state": rng.standard_normal((2, CHANNELS, KERNEL - 1)).astype(np.float32)}
    expected = _onnxruntime(feeds, "VarlenCausalConvWithState", list(feeds), activation="silu")
    got = VarlenCausalConvWithState(*feeds.values(), activation="silu")
    for actual, wanted in zip(got, expected):
        np.testing.assert_allclose(actual, wanted, rtol=0, atol=1e-5)
