"""IdentityEliminationPass: drop nodes that pass their input through unchanged.

Identity, Dropout (inference), single-input Concat/Sum/Max/Min/Mean (TorchScript's DynamicCache leaves a
one-input Concat on each past KV input), and Cast to the type the value already has (TorchScript exports
put float32→float32 Casts around every RMSNorm). Removing them lets later fusions see the real structure.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from compiler.pass_manager import PassResult
from passes.graph_utils import bypass_node


def _is_noop(node: gs.Node) -> bool:
    if node.op == "Identity" or node.op in ("Concat", "Sum", "Max", "Min", "Mean") and len(node.inputs) == 1:
        return True
    if node.op == "Dropout":
        return len(node.outputs) == 1 or not node.outputs[1].outputs
    if node.op == "Cast":
        source = node.inputs[0]
        target = node.attrs.get("to")
        return source.dtype is not None and target is not None and _onnx_type(source.dtype) == int(target)
    return False


def _onnx_type(dtype) -> int:
    from onnx.helper import np_dtype_to_tensor_dtype
    import numpy as np

    try:
        return np_dtype_to_tensor_dtype(np.dtype(dtype))
    except (TypeError, KeyError):
        return -1


class EliminateIdentity:
    """Remove pass-through nodes."""

    name = "IdentityEliminationPass"
    switchable = False

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        for node in list(graph.nodes):
            if (node.domain or "") not in ("", "ai.onnx") or not _is_noop(node):
                continue
            result.match_times += 1
            if bypass_node(graph, node):
                result.effect_times += 1
            else:
                result.rejections.append(f"{node.name}: input and output are both graph I/O")
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
        return result
