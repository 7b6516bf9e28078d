"""CacheLayoutCheckPass: refuse a KV cache kept sequence-first, which neither the fusions nor the runtime read.

ChatGLM2's and ChatGLM3's remote code computes sequence-first (`[S, B, hidden]`) and keeps each layer's cache
as `[past, batch, kv heads, head dim]`. Every cache this compiler serves is `[batch, kv heads, past, head
dim]`: read the other way, the batch axis would be taken for the KV heads (and the compile would end
asking for the heads' count), or a runner would feed the cache transposed. Refused by name before any of
that, in every compile: E10055. A tensor is told sequence-first by its symbolic dims: its second axis
carries the name `input_ids` gives its batch, its first another.
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
                                     "heads, head dim), as ChatGLM2's and ChatGLM3's remote code keeps its cache; "
                                     "a cache is read as [batch, kv heads, past, head dim]")
        return PassResult()
