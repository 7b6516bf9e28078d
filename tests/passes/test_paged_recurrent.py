"""The hybrid part of paging on scripted graphs: a state no packable op reads is refused by name, and a
product by the tokens' padding flags becomes its other operand."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest

from cann_llm.passes.paged_recurrent import drop_padding_products, refuse_unpackable
from cann_llm.runtime.errors import AtcError

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
