"""CacheLayoutCheckPass: refuse a KV cache still kept sequence-first once attention fusion has run.

ChatGLM2's and ChatGLM3's remote code keeps each layer's cache as `[past, batch, kv heads, head dim]`.
AttentionFusionPass takes such a cache over in the fused op's layout, `[batch, kv heads, past, head dim]`,
which is the one the runtime feeds every cache in. A cache whose attention did not fuse keeps the export's
layout: read as the runtime reads a cache, its batch axis would be taken for the KV heads (and the compile
would end asking for their count). Refused by name instead: E10055. A tensor is told sequence-first by its
symbolic dims: its second axis carries the name `input_ids` gives its batch, its first another.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.runtime.errors import AtcError


def sequence_first_cache(graph: gs.Graph) -> gs.Tensor | None:
    """The first cache input laid out `[past, batch, ...]`, or None."""
    tokens = next((t for t in graph.inputs if t.name == "input_ids"), None)
    batch = tokens.shape[0] if tokens is not None and tokens.shape else None
    if not isinstance(batch, str):
        return None  # a fixed batch does not tell its axis from a count of heads
    return next((t for t in graph.inputs if t.name.startswith("past_key_values") and t.shape is not None
                 and len(t.shape) == 4 and t.shape[1] == batch and t.shape[0] != batch), None)


class CheckCacheLayout:
    """E10055 for a sequence-first KV cache."""

    name = "CacheLayoutCheckPass"
    switchable = False

    def run(self, graph: gs.Graph) -> PassResult:
        found = sequence_first_cache(graph)
        if found is not None:
            raise AtcError("E10055", f"{found.name} is laid out {list(found.shape)}, sequence-first (past, batch, kv "
                                     "heads, head dim), as ChatGLM2's and ChatGLM3's remote code keeps its cache, and "
                                     "its attention did not fuse (see fusion_result.json); a cache is read as "
                                     "[batch, kv heads, past, head dim]")
        return PassResult()
