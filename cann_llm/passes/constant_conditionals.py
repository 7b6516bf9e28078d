"""`If` nodes whose condition is a constant, replaced by the branch they take.

Done once at import, before any pass: every pass after it, shape inference first, then sees one graph
instead of a tree of subgraphs. A 3.3 MB model of `If`s nested eight deep on constant conditions held
onnxruntime's symbolic shape inference for 77 s (it copies the model's weights into each of the 2^8
subgraphs it visits); flattened, it compiles in seconds. The branch not taken is dropped unvisited.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs


def _constant_condition(node: gs.Node) -> bool | None:
    """The value of an `If`'s condition when it is a constant scalar (a Constant tensor or node), else None."""
    cond = node.inputs[0] if node.op == "If" and node.inputs else None
    if cond is not None and not isinstance(cond, gs.Constant) and len(cond.inputs) == 1:
        producer = cond.inputs[0]
        cond = producer.attrs.get("value") if producer.op == "Constant" else None
    if not isinstance(cond, gs.Constant):
        return None
    values = np.asarray(cond.values)
    return bool(values.reshape(-1)[0]) if values.size == 1 else None


def flatten_constant_conditionals(graph: gs.Graph) -> int:
    """Replace each `If` with a constant condition by its taken branch, in place, outermost first, so a
    branch not taken is never visited (graphsurgeon's own flattening comes after folding both branches,
    and walks every nested subgraph once per level). Returns how many were replaced."""
    index, flattened = 0, 0
    while index < len(graph.nodes):
        node = graph.nodes[index]
        cond = _constant_condition(node)
        if cond is None:
            index += 1
            continue
        branch = node.attrs["then_branch" if cond else "else_branch"]
        for tensor in branch._local_tensors().values():  # branch names may repeat the outer graph's
            tensor.name += f"_{index}_{branch.name}"
        inlined = list(branch.nodes)
        local = {id(n) for n in inlined}
        for output, branch_output in zip(list(node.outputs), list(branch.outputs)):
            output.inputs.clear()
            producers = [p for p in branch_output.inputs if id(p) in local]
            if not producers:  # the branch returns an outer tensor or a constant as it is
                inlined.append(gs.Node("Identity", inputs=[branch_output], outputs=[output]))
                continue
            for consumer in list(branch_output.outputs):  # the branch may read its own output too
                _replace_input(consumer, branch_output, output)
            for producer in producers:
                producer.outputs[next(i for i, t in enumerate(producer.outputs) if t is branch_output)] = output
        node.inputs.clear()
        node.outputs.clear()
        del graph.nodes[index]
        graph.nodes[index:index] = inlined  # revisited: the branch may hold a constant If itself
        flattened += 1
    return flattened


def _replace_input(node: gs.Node, old: gs.Tensor, new: gs.Tensor) -> None:
    for index, tensor in enumerate(node.inputs):
        if tensor is old:
            node.inputs[index] = new
