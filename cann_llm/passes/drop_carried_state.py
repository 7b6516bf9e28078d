"""CarriedStateRemovalPass: a cache input the graph only hands back as an output is dropped with that output.

transformers' own exporter passes each sliding-window layer's `_sliding_window_tensor` from input to output
through an Identity: state of its cache object that the model never reads, which no runner has anything to
feed. Dropped in every compile, paged or contiguous, and not switchable: an artifact that kept it could not
be run by the engine. An input that anything else reads, or whose Identity output a node also reads, stays.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult


def _carried(graph: gs.Graph, tensor: gs.Tensor) -> bool:
    outputs = {id(t) for t in graph.outputs}
    return tensor.name.startswith("past_key_values") and bool(tensor.outputs) and all(
        node.op == "Identity" and id(node.outputs[0]) in outputs and not node.outputs[0].outputs
        for node in tensor.outputs)


class DropCarriedState:
    """Drop cache inputs passed straight to outputs."""

    name = "CarriedStateRemovalPass"
    switchable = False

    def run(self, graph: gs.Graph) -> PassResult:
        carried = [tensor for tensor in graph.inputs if _carried(graph, tensor)]
        if not carried:
            return PassResult()
        handed_back = {id(node.outputs[0]) for tensor in carried for node in tensor.outputs}
        graph.outputs = [t for t in graph.outputs if id(t) not in handed_back]
        graph.inputs = [t for t in graph.inputs if all(t is not c for c in carried)]
        graph.cleanup(remove_unused_graph_inputs=False)
        return PassResult(match_times=len(carried), effect_times=len(carried))
