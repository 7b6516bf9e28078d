"""LayerTruncationPass: keep the first N decoder layers, the final norm and the head (`atc --keep_layers=N`).

The result is a draft model for speculative decoding made from the target's own ONNX: the same embedding,
vocabulary and tokenizer, a fraction of the layers. The final norm is moved to read the residual stream
where layer N would have started (the "logit lens" of that depth), the later layers and their KV cache
inputs and outputs are removed.

Layers are counted by their fused attention, so the pass runs after attention fusion; each starts at the
norm its attention's input comes from (cann_llm/passes/decoder_layers.py).
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.decoder_layers import norm_above, residual_entering
from cann_llm.passes.graph_utils import lm_head, replace_all_uses, toposort
from cann_llm.passes.paged_recurrent import has_recurrent_states
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.ops import FUSED_ATTENTION, FusedAttentionInput

_HEAD_OPS = ("MatMul", "MatMulInt4", "MatMulInt8")


class TruncateLayers:
    """Cut the decoder after its first `keep` layers."""

    name = "LayerTruncationPass"
    switchable = False

    def __init__(self, keep: int):
        self.keep = keep

    def run(self, graph: gs.Graph) -> PassResult:
        toposort(graph)
        attentions = [n for n in graph.nodes if n.op == FUSED_ATTENTION.name]
        if not attentions:
            raise _refused("no attention fused, so the decoder's layers cannot be found")
        if has_recurrent_states(graph):
            raise _refused("its layers are found by their attention, and a hybrid's recurrent layers have none")
        if self.keep >= len(attentions):
            raise AtcError("E10001", self.keep, "--keep_layers",
                           f"The model has {len(attentions)} layers; keep fewer than that.")
        head = lm_head(graph, ops=_HEAD_OPS)
        if head is None:
            raise _refused("no lm_head MatMul computes the output 'logits'")
        hidden = _input_size(head)
        first_cut = norm_above(attentions[self.keep].inputs[FusedAttentionInput.QUERY], hidden)
        final = norm_above(head.inputs[0], hidden)
        if first_cut is None or final is None or first_cut is final:
            raise _refused("the layer's input norm or the final norm was not found")
        _read_from(graph, final, residual_entering(first_cut))
        removed = attentions[self.keep:]
        doomed = {t.name for node in removed for t in node.outputs}
        graph.outputs = [t for t in graph.outputs if t.name not in doomed]
        caches = [(t, attentions[0].inputs[slot]) for node in removed
                  for slot, t in enumerate(node.inputs)
                  if t in graph.inputs and t is not attentions[0].inputs[slot]]
        graph.cleanup(remove_unused_graph_inputs=False)
        for cache, kept in caches:
            # an exporter may read the past length off any layer's cache: a kept layer's has the same shape
            replace_all_uses(graph, cache, kept)
        dropped = {cache.name for cache, _ in caches}
        graph.inputs = [t for t in graph.inputs if t.name not in dropped]
        toposort(graph)
        return PassResult(match_times=len(attentions), effect_times=len(removed))


def _refused(why: str) -> AtcError:
    return AtcError("E10055", f"--keep_layers cannot truncate this model: {why}")


def _read_from(graph: gs.Graph, final: gs.Node, residual: gs.Tensor) -> None:
    """Make the final norm normalise `residual` alone; an AddRmsNorm becomes a plain RmsNorm."""
    if final.op != "AddRmsNorm":
        final.inputs[0] = residual
        return
    if len(final.outputs) > 1 and (final.outputs[1].outputs or final.outputs[1] in graph.outputs):
        raise _refused("the final norm's residual sum is read after it")
    weight, normed = final.inputs[2], final.outputs[0]
    final.inputs.clear()
    final.outputs.clear()
    graph.nodes.append(gs.Node("RmsNorm", name=f"{final.name}_truncated", domain=final.domain,
                               attrs=dict(final.attrs), inputs=[residual, weight], outputs=[normed]))


def _input_size(head: gs.Node) -> int | None:
    """The hidden size the lm_head reads: a MatMulInt4's K (its packed weight is [N, blocks, bytes]), else its
    constant weight's rows."""
    if head.op == "MatMulInt4":
        return int(head.attrs["K"])
    return head.inputs[1].shape[0] if isinstance(head.inputs[1], gs.Constant) else None
