"""LogitsPruningPass: compute the lm_head only for the tokens whose next-token distribution is wanted.

In a flattened batch only each sequence's last scheduled token needs logits; the vocabulary projection
is the largest matmul of a small model (49,152 × 576 in SmolLM2), so a prefill of T tokens would spend
most of its time on T - B rows nobody reads. A `Gather` on the lm_head's input, driven by the new input
`logits_indices [B]`, turns `logits [1, T, V]` into `logits [B, V]`.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import lm_head, toposort
from cann_llm.passes.pattern import const_ints
from cann_llm.runtime.errors import AtcError

LOGITS_INDICES = "logits_indices"
_PROJECTIONS = ("MatMul", "MatMulInt4", "MatMulInt8")


class PruneLogits:
    """Gather the wanted rows before the lm_head; `logits` becomes `[num_seqs, vocab]`."""

    name = "LogitsPruningPass"
    switchable = False

    def run(self, graph: gs.Graph) -> PassResult:
        logits = next((t for t in graph.outputs if t.name == "logits"), None)
        head = lm_head(graph, ops=_PROJECTIONS)
        last = logits.inputs[0] if logits is not None and logits.inputs else None
        tokens_first = head is not None and _tokens_first_logits(logits)
        if last is not None and last.op == "Transpose" and not tokens_first:
            head = None  # logits moved otherwise than from sequence-first: rows the Gather could not pick
        if head is not None:
            _drop_last_row_pick(head, 0 if tokens_first else 1)
        if tokens_first:
            # the head runs on the hidden states moved to [B, S, hidden], whose rows are then the tokens'
            hidden = gs.Variable(f"{head.inputs[0].name}_batch_first", dtype=head.inputs[0].dtype)
            graph.nodes.append(gs.Node("Transpose", name=f"{head.name}_batch_first", attrs={"perm": [1, 0, 2]},
                                       inputs=[head.inputs[0]], outputs=[hidden]))
            head.inputs[0] = hidden
        if head is None or (head.inputs[0].shape is not None and len(head.inputs[0].shape) != 3):
            raise AtcError("E10055", "no lm_head MatMul on [batch, seq, hidden] computes the output 'logits', so logits cannot "
                                     "be pruned; "
                                     "compile with --enable_paged_attention=0")
        indices = gs.Variable(LOGITS_INDICES, dtype=np.int64, shape=["num_seqs"])
        hidden = head.inputs[0]
        picked = gs.Variable(f"{hidden.name}_picked", dtype=hidden.dtype)
        graph.nodes.append(gs.Node("Gather", name=f"{head.name}_prune", attrs={"axis": 1},
                                   inputs=[hidden, indices], outputs=[picked]))
        head.inputs[0] = picked
        vocab = logits.shape[-1] if logits.shape else "vocab"
        rows = gs.Variable("logits", dtype=logits.dtype, shape=["num_seqs", vocab])
        logits.name = f"{logits.name}_batched"
        axes = gs.Constant("logits_squeeze_axes", np.array([0], dtype=np.int64))
        graph.nodes.append(gs.Node("Squeeze", name="logits_squeeze", inputs=[logits, axes], outputs=[rows]))
        graph.outputs = [rows if t is logits else t for t in graph.outputs]
        graph.inputs.append(indices)
        toposort(graph)
        return PassResult(match_times=1, effect_times=1)


def _tokens_first_logits(logits: gs.Tensor) -> bool:
    """Whether sequence-first logits [S, B, V] are moved to [B, S, V] last (ChatGLM's head runs sequence-first);
    if so, that Transpose becomes an Identity, and the caller moves the hidden states before the head instead."""
    node = logits.inputs[0] if logits.inputs else None
    if node is None or node.op != "Transpose" or list(node.attrs.get("perm", [])) != [1, 0, 2]:
        return False
    node.op = "Identity"
    node.attrs.clear()
    return True


def _drop_last_row_pick(head: gs.Node, axis: int) -> None:
    """The head reads every token where the export picked the last one first (ChatGLM's `return_last_logit`:
    `hidden_states[-1:]`, a Slice from -1 to the end of the tokens' axis): in a flattened batch the last token
    is only the last sequence's, and `logits_indices` picks each sequence's own."""
    pick = head.inputs[0].inputs[0] if head.inputs[0].inputs else None
    if pick is None or pick.op != "Slice" or len(pick.inputs) < 4:
        return
    starts, ends, axes = (const_ints(t) for t in pick.inputs[1:4])
    steps = const_ints(pick.inputs[4]) if len(pick.inputs) > 4 else [1]
    rank = len(pick.inputs[0].shape or [0, 0, 0])
    if starts == [-1] and ends is not None and ends[0] >= 2**31 - 1 and axes is not None \
            and [a % rank for a in axes] == [axis] and steps == [1]:
        head.inputs[0] = pick.inputs[0]
