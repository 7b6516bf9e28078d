"""The hybrid part of paging on scripted graphs: a state no packable op reads, a recurrence with no state the
engine carries and a convolution over the tokens are refused by name, and a product by the tokens' padding
flags becomes its other operand."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest

from cann_llm.passes.paged_recurrent import drop_padding_products, refuse_unpackable
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.engine.trial_step import check_generator

pytestmark = pytest.mark.unit


def test_a_state_read_by_plain_ops_is_refused_by_name():
    """A convolution written as Concat, Conv and Slice (an export not made by cann-run export) cannot run per
    sequence over a flattened batch."""
    state, x = gs.Variable("past.0.conv", np.float32, ["batch", 8, 3]), gs.Variable("x", np.float32, ["batch", 8, 5])
    joined = gs.Variable("joined", np.float32, ["batch", 8, 8])
    graph = gs.Graph(nodes=[gs.Node("Concat", inputs=[state, x], outputs=[joined], attrs={"axis": -1})],
                     inputs=[state, x], outputs=[joined])
    with pytest.raises(AtcError) as refused:
        refuse_unpackable(graph)
    assert refused.value.code == "E10055" and "past.0.conv" in str(refused.value)


@pytest.mark.parametrize("stateless", ["conv", "constant state"])
def test_a_recurrence_without_a_carried_state_is_refused_by_name(stateless):
    """A hybrid exported without its cache: its convolution (a plain Conv), or onnxruntime's op fed a state
    that is no graph input, would mix the sequences of a flattened batch."""
    x = gs.Variable("x", np.float32, ["batch", 8, "seq"])
    out = gs.Variable("out", np.float32, ["batch", 8, "seq"])
    weight = gs.Constant("weight", np.ones((8, 1, 4), np.float32))
    if stateless == "conv":
        node = gs.Node("Conv", "the_conv", {"group": 8, "pads": [3, 0]}, inputs=[x, weight], outputs=[out])
    else:
        zeros = gs.Constant("zeros", np.zeros((1, 8, 3), np.float32))
        node = gs.Node("CausalConvWithState", "the_conv", domain="com.microsoft", inputs=[x, weight, gs.Variable.empty(),
                       zeros], outputs=[out, gs.Variable("state_out", np.float32, [1, 8, 3])])
    graph = gs.Graph(nodes=[node], inputs=[x], outputs=[out])
    with pytest.raises(AtcError) as refused:
        refuse_unpackable(graph)
    assert refused.value.code == "E10055" and "the_conv" in str(refused.value)


def test_a_state_of_sizes_left_open_is_refused_at_load():
    """The engine makes each sequence's first state from the state input's sizes past the batch."""
    signature = {"inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]},
                            {"name": "past.0.conv", "dtype": "float32", "shape": ["batch", "channels", 3]}],
                 "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", "seq", 16]},
                             {"name": "present.0.conv", "dtype": "float32", "shape": ["batch", "channels", 3]}]}
    with pytest.raises(AtcError) as refused:
        check_generator({"signature": signature}, "m.om")
    assert refused.value.code == "E10055" and "past.0.conv" in str(refused.value)


def test_the_product_by_the_tokens_padding_flags_becomes_the_activation():
    mask = gs.Variable("attention_mask", np.int64, ["batch", "total"])
    hidden = gs.Variable("hidden", np.float32, ["batch", "seq", 4])
    flags = gs.Variable("flags", np.int64, ["batch", "seq"])
    column = gs.Variable("column", np.int64, ["batch", "seq", 1])
    typed = gs.Variable("typed", np.float32, ["batch", "seq", 1])
    masked, out = gs.Variable("masked", np.float32, ["batch", "seq", 4]), gs.Variable("out", np.float32, ["batch", "seq", 4])
    graph = gs.Graph(nodes=[
        gs.Node("Slice", inputs=[mask, gs.Constant("start", np.array([-5])), gs.Constant("end", np.array([2**62])),
                                 gs.Constant("axis", np.array([1]))], outputs=[flags]),
        gs.Node("Unsqueeze", inputs=[flags, gs.Constant("axes", np.array([-1]))], outputs=[column]),
        gs.Node("Cast", inputs=[column], outputs=[typed], attrs={"to": 1}),
        gs.Node("Mul", inputs=[hidden, typed], outputs=[masked]),
        gs.Node("Relu", inputs=[masked], outputs=[out])], inputs=[mask, hidden], outputs=[out])
    assert drop_padding_products(graph) == 1
    assert [n.op for n in graph.nodes] == ["Relu"] and graph.nodes[0].inputs[0] is hidden
