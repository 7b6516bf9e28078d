"""SplitRotaryCanonicalizationPass on scripted graphs: gpt-oss's rotation of each head's two halves becomes
rotate_half's spelling, the same numbers, which match_rotary reads; tables of another width are left alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest

from cann_llm.passes.canonicalize_split_rotary import CanonicalizeSplitRotary
from cann_llm.passes.match_rotary import match_rotary

pytestmark = pytest.mark.unit

D = 8
RNG = np.random.default_rng(3)
X = RNG.standard_normal((1, 2, 3, D)).astype(np.float32)
ANGLES = RNG.uniform(0, 6.3, (1, 1, 3, D // 2)).astype(np.float32)


def _graph(split: bool, table_width: int = D // 2) -> gs.Graph:
    """out = cat([x1·c − x2·s, x2·c + x1·s], -1) with x1, x2 the halves of x (a Split, or two Slices)."""
    x = gs.Variable("x", np.float32, list(X.shape))
    c = gs.Variable("c", np.float32, [1, 1, 3, table_width])
    s = gs.Variable("s", np.float32, [1, 1, 3, table_width])
    half = [1, 2, 3, D // 2]
    x1, x2 = gs.Variable("x1", np.float32, half), gs.Variable("x2", np.float32, half)
    nodes = []
    if split:
        nodes.append(gs.Node("Split", inputs=[x, gs.Constant("sizes", np.array([D // 2, D // 2]))], outputs=[x1, x2],
                             attrs={"axis": -1}))
    else:
        for out, (start, end) in ((x1, (0, D // 2)), (x2, (D // 2, D))):
            nodes.append(gs.Node("Slice", inputs=[x, gs.Constant(f"{out.name}_s", np.array([start])),
                                                  gs.Constant(f"{out.name}_e", np.array([end])),
                                                  gs.Constant(f"{out.name}_a", np.array([-1]))], outputs=[out]))
    products = {}
    for a, b in ((x1, c), (x2, s), (x2, c), (x1, s)):
        products[a.name, b.name] = gs.Variable(f"{a.name}{b.name}", np.float32, half)
        nodes.append(gs.Node("Mul", inputs=[a, b], outputs=[products[a.name, b.name]]))
    first, second = gs.Variable("first", np.float32, half), gs.Variable("second", np.float32, half)
    nodes.append(gs.Node("Sub", inputs=[products["x1", "c"], products["x2", "s"]], outputs=[first]))
    nodes.append(gs.Node("Add", inputs=[products["x1", "s"], products["x2", "c"]], outputs=[second]))
    out = gs.Variable("out", np.float32, list(X.shape))
    nodes.append(gs.Node("Concat", inputs=[first, second], outputs=[out], attrs={"axis": -1}))
    return gs.Graph(nodes=nodes, inputs=[x, c, s], outputs=[out], opset=18)


def _run(graph: gs.Graph, feeds: dict) -> np.ndarray:
    model = gs.export_onnx(graph.cleanup().toposort())
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("split", [True, False], ids=["split", "slices"])
def test_a_rotation_of_the_halves_becomes_rotate_half_with_the_same_numbers(split):
    feeds = {"x": X, "c": np.cos(ANGLES), "s": np.sin(ANGLES)}
    graph = _graph(split)
    want = _run(_graph(split), feeds)
    result = CanonicalizeSplitRotary().run(graph)
    assert (result.match_times, result.effect_times) == (1, 1)
    found = match_rotary(graph.outputs[0])
    assert found is not None and found[0].name == "x" and (found[1].rotary_dim, found[1].interleaved) == (D, 0)
    np.testing.assert_allclose(_run(graph, feeds), want, atol=1e-6, rtol=0)


def test_tables_not_half_the_heads_width_are_left_alone():
    graph = _graph(split=True, table_width=1)  # broadcast along the halves: not a rotation's tables
    assert CanonicalizeSplitRotary().run(graph).match_times == 0
    assert not [n for n in graph.nodes if n.name.endswith("/Doubled")]
    assert isinstance(onnx.shape_inference.infer_shapes(gs.export_onnx(graph)), onnx.ModelProto)
