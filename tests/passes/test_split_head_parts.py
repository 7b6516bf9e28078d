"""HeadPartsSplitPass on scripted graphs: a projection whose heads carry their query and gate side by side
(Qwen3.5's [query | gate]) becomes one projection a half, the same numbers, its halves given by an input, an
attribute (opset 11) or by their count; other cuts are left alone."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest

from cann_llm.passes.split_head_parts import SplitHeadParts

pytestmark = pytest.mark.unit

K, HEADS = 12, 3
RNG = np.random.default_rng(5)
X = RNG.standard_normal((2, 4, K)).astype(np.float32)


def _graph(sizes: list[int], bias: bool, axis: int = -1, opset: int = 18) -> gs.Graph:
    """x·W (+ b) reshaped to [B, S, H, sum(sizes)], then split on `axis` into `sizes` (an input from opset 13,
    the `split` attribute before)."""
    width = sum(sizes)
    x = gs.Variable("x", np.float32, list(X.shape))
    projected = gs.Variable("projected", np.float32, [2, 4, HEADS * width])
    nodes = [gs.Node("MatMul", "proj", inputs=[x, gs.Constant("w", RNG.standard_normal((K, HEADS * width)).astype(np.float32))],
                     outputs=[projected])]
    if bias:
        biased = gs.Variable("biased", np.float32, projected.shape)
        nodes.append(gs.Node("Add", inputs=[projected, gs.Constant("b", RNG.standard_normal(HEADS * width).astype(np.float32))],
                             outputs=[biased]))
        projected = biased
    heads = gs.Variable("heads", np.float32, [2, 4, HEADS, width])
    nodes.append(gs.Node("Reshape", inputs=[projected, gs.Constant("shape", np.array([0, 0, -1, width]))], outputs=[heads]))
    parts = [gs.Variable(f"part{i}", np.float32, [2, 4, HEADS, size]) for i, size in enumerate(sizes)]
    if opset >= 13:
        nodes.append(gs.Node("Split", inputs=[heads, gs.Constant("sizes", np.array(sizes))], outputs=parts,
                             attrs={"axis": axis}))
    else:
        nodes.append(gs.Node("Split", inputs=[heads], outputs=parts, attrs={"axis": axis, "split": sizes}))
    read = [gs.Variable(f"read{i}", np.float32, part.shape) for i, part in enumerate(parts)]
    nodes += [gs.Node("Identity", inputs=[part], outputs=[out]) for part, out in zip(parts, read)]
    return gs.Graph(nodes=nodes, inputs=[x], outputs=read, opset=opset)


def _run(graph: gs.Graph) -> list[np.ndarray]:
    model = gs.export_onnx(graph.cleanup().toposort())
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": X})


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "biased"])
@pytest.mark.parametrize("opset", [18, 11])
def test_each_half_gets_a_projection_of_its_own_with_the_same_numbers(bias, opset):
    graph = _graph([4, 4], bias, opset=opset)
    want = _run(graph)
    result = SplitHeadParts().run(graph)
    assert (result.match_times, result.effect_times) == (1, 1)
    ops = Counter(n.op for n in graph.nodes)
    assert ops["Split"] == 0 and ops["MatMul"] == 2 and ops["Add"] == (2 if bias else 0)
    for got, expected in zip(_run(graph), want):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("sizes,opset,axis,why", [
    ([2, 2], 18, 2, "not a split of each head's features"),  # the heads, not each head's features
    ([2, 6], 18, -1, "not cut into two constant halves"),
    ([2, 6], 11, -1, "not cut into two constant halves"),  # the attribute's unequal parts, not halves
    ([2, 5, 3], 18, -1, "not cut into two constant halves"),  # CodeGen's shards are another pass's
])
def test_other_cuts_are_left_alone(sizes, opset, axis, why):
    graph = _graph(sizes, False, axis=axis, opset=opset)
    result = SplitHeadParts().run(graph)
    assert result.effect_times == 0 and why in result.rejections[0]
