"""Loops that a TorchScript trace unrolled over what the traced input happened to hold.

`torch.onnx.export(..., dynamo=False)` traces one run: a Python loop over data the model computed, such as
transformers 4.53-4.56's Qwen2-MoE looping over `(expert_mask.sum(...) > 0).nonzero()` (the experts its
tokens were routed to), is written as many times as it ran then. Each pass reads its item off NonZero's
result with a Split along the axis that counts what NonZero found, into as many parts as the trace found; any
input that finds another number of items fails in onnxruntime (`Invalid value in 'split'`), the export
itself as much as the compiled artifact. A generating step routes one token to a few experts, so such an
export cannot generate; this finds those Splits so that `atc` can say so at compile time.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs


def _count_axis(tensor: gs.Tensor) -> int | None:
    """The axis of `tensor` that counts the items a NonZero found: 1 of NonZero's [rank, found] result, 0 of
    its transpose; None when `tensor` is neither."""
    producer = tensor.inputs[0] if tensor.inputs else None
    if producer is None:
        return None
    if producer.op == "NonZero":
        return 1
    source = producer.inputs[0] if producer.op == "Transpose" and producer.inputs else None
    if source is not None and source.inputs and source.inputs[0].op == "NonZero":
        perm = list(producer.attrs.get("perm", [1, 0]))  # no perm reverses the axes: [1, 0] at rank 2
        return 0 if perm == [1, 0] else None
    return None


def unrolled_loops(graph: gs.Graph) -> list[tuple[str, int]]:
    """(Split node's name, how many items the trace found) for each Split of NonZero's found items into a
    fixed number of parts, in graph order."""
    found = []
    for node in graph.nodes:
        if node.op != "Split" or not node.inputs:
            continue
        axis = _count_axis(node.inputs[0])
        if axis is not None and int(node.attrs.get("axis", 0)) in (axis, axis - 2):
            found.append((node.name, len(node.outputs)))
    return found


def describe(unrolled: list[tuple[str, int]]) -> str:
    """What the found Splits mean for the export, and what to do about it."""
    name, count = unrolled[0]
    more = f" (and {len(unrolled) - 1} more like it)" if len(unrolled) > 1 else ""
    return (f"the export unrolled a loop over what a NonZero finds: {name} splits what it found into {count} "
            f"parts{more}, as many as the traced input gave (TorchScript traces one run: a MoE's loop over the "
            f"experts its tokens were routed to is written as often as it ran), so the model runs only on "
            f"inputs that find exactly {count}, and onnxruntime fails on the export itself for others; export "
            f"the experts without that loop: with transformers 5, model.set_experts_implementation('batched_mm') "
            f"before exporting (as cann-run export does) (docs/exporting.md#loops-a-trace-unrolled)")
