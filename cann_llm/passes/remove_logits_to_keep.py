"""LogitsToKeepRemovalPass: every position's logits back where a TorchScript trace of transformers'
`logits_to_keep` picked one.

`torch.onnx.export(model, (input_ids, attention_mask), dynamo=False, ...)` on a transformers 5 model itself
(no wrapper) turns the forward's `logits_to_keep=0` into a scalar graph input, and its
`hidden_states[:, slice(-logits_to_keep, None)]` into `Gather(hidden, logits_to_keep, axis=1)` before the
lm_head: the graph's logits are [batch, vocab] at the one position the input names, where transformers'
default (0) means every position. With nothing but Casts and the lm_head's MatMul (and an Add of its bias)
between that Gather and a graph output, the Gather is dropped, the logits are [batch, seq, vocab] as
transformers computes them, the input goes, and the output is named `logits` if the export numbered it
(no `output_names`); anything else is left as it is.
"""

from __future__ import annotations

import logging

import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import replace_all_uses
from cann_llm.passes.match_attention import dtype_kind

log = logging.getLogger(__name__)

_TO_LOGITS = ("MatMul", "Add", "Cast")


def _output_reached(graph: gs.Graph, tensor: gs.Tensor) -> gs.Tensor | None:
    """The graph output `tensor` flows into through one chain of the lm_head's ops (MatMul by a weight, Add,
    Cast), feeding nothing else on the way; None if it does not."""
    outputs = {id(t) for t in graph.outputs}
    while id(tensor) not in outputs:
        if len(tensor.outputs) != 1 or tensor.outputs[0].op not in _TO_LOGITS:
            return None
        node = tensor.outputs[0]
        if node.op == "MatMul" and node.inputs[0] is not tensor:
            return None
        tensor = node.outputs[0]
    return tensor if not tensor.outputs else None


class RemoveLogitsToKeep:
    """Drops a traced `logits_to_keep` position pick before the lm_head."""

    name = "LogitsToKeepRemovalPass"
    switchable = True

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        for tensor in list(graph.inputs):
            if tensor.shape is None or len(tensor.shape) != 0 or dtype_kind(tensor.dtype) not in "iu":
                continue
            readers = list(tensor.outputs)
            if len(readers) != 1 or readers[0].op != "Gather" or readers[0].inputs[1] is not tensor:
                continue
            gather = readers[0]
            hidden = gather.inputs[0]
            if gather.attrs.get("axis", 0) not in (1, -2) or hidden.shape is None or len(hidden.shape) != 3:
                continue
            result.match_times += 1
            logits = _output_reached(graph, gather.outputs[0])
            if logits is None:
                result.rejections.append(f"{tensor.name}: the position it picks feeds more than the lm_head")
                continue
            reader = gather.outputs[0].outputs[0]
            replace_all_uses(graph, gather.outputs[0], hidden)
            gather.outputs.clear()
            graph.inputs.remove(tensor)
            value = reader.outputs[0]
            while True:  # [batch, seq, ...] now, no longer [batch, ...]: shape inference says what
                value.shape = None
                if value is logits:
                    break
                value = value.outputs[0].outputs[0]
            if logits.name != "logits" and "logits" not in graph.tensors():
                logits.name = "logits"  # TorchScript without output_names numbers it ("701")
            result.effect_times += 1
            log.info("%s: %s picked the one position whose logits the graph gave; every position's now",
                     self.name, tensor.name)
        graph.cleanup(remove_unused_graph_inputs=False)
        return result
