"""Folding a per-channel input scale (AWQ's 1/s, SmoothQuant's) into the graph before a MatMul."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.pattern import producer


def scale_input(graph: gs.Graph, x: gs.Tensor, scale: np.ndarray, name: str) -> gs.Tensor:
    """x · scale per channel: folded into the weight of the RmsNorm/AddRmsNorm that produces x when x has
    no other reader, otherwise computed by a Mul."""
    norm = producer(x, "RmsNorm", "AddRmsNorm")
    if norm is not None and norm.outputs[0] is x and len(x.outputs) == 1 and not any(t is x for t in graph.outputs):
        index = 1 if norm.op == "RmsNorm" else 2
        gamma = norm.inputs[index]
        if isinstance(gamma, gs.Constant):
            norm.inputs[index] = gs.Constant(f"{name}_norm_weight", (np.asarray(gamma.values) * scale).astype(np.float32))
            return x
    scaled = gs.Variable(f"{name}_scaled", dtype=x.dtype, shape=x.shape)
    graph.nodes.append(gs.Node("Mul", name=f"{name}/Mul", inputs=[x, gs.Constant(f"{name}_scale", scale)],
                               outputs=[scaled]))
    return scaled
