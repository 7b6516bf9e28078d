"""The rotary-embedding pattern: `x·cos + turn(x)·sin` on a [B, H, S, D] head tensor.

    rope(x)  = x·cos + turn(x)·sin                         (either Mul order, either Add order)
    turn(x)  = Concat(-x[R/2:R], x[:R/2])                  half rotation (Llama / NeoX)
             | Reshape(Concat(Unsqueeze(-x[1::2]), Unsqueeze(x[0::2])))   pairs (GPT-J / GLM)
    partial  = Concat(rope(x[:R]), x[R:])                  only the first R dims of a head rotate
             | Concat(rope(x), x[D:])                      all D of them, and nothing after (Phi-3, dynamo)

It is the spelling `cann_llm/runtime/lowering.py: rotary_embedding` writes when it lowers a FusedAttention, and a
test holds the two together: what the lowering builds, this pattern reads back.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from cann_llm.passes.pattern import const_ints, producer
from cann_llm.passes.shape_values import static_ints


@dataclass
class Rotary:
    """What a matched rotation uses: its tables (broadcastable to [B, 1, S, R]), R, and the pairing."""

    cos: gs.Tensor
    sin: gs.Tensor
    rotary_dim: int
    interleaved: int = 0


def slice_bounds(node: gs.Node | None, source: gs.Tensor, step: int = 1) -> tuple[int, int] | None:
    """(start, end) of a Slice of `source` along its last axis with the given step; None otherwise. The
    bounds may be computed from static dims (`Shape(cos)[-1]`)."""
    if node is None or node.op != "Slice" or node.inputs[0] is not source:
        return None
    last = len(source.shape or []) - 1
    starts, ends = static_ints(node.inputs[1]), static_ints(node.inputs[2])
    axes = const_ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3].name else [last]
    steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4].name else [1]
    if None in (starts, ends, axes, steps) or len(starts) != 1 or steps != [step] or axes[0] not in (-1, last):
        return None
    return starts[0], ends[0]


def halves(x1: gs.Tensor, x2: gs.Tensor) -> gs.Tensor | None:
    """x when x1 and x2 are its first and second halves along the last axis (a Split, or two Slices)."""
    split = producer(x1, "Split")
    if split is not None:
        x = split.inputs[0]
        rank = len(x.shape or [])
        sizes = const_ints(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1].name else None
        if split.attrs.get("axis", 0) not in (-1, rank - 1) or len(split.outputs) != 2 \
                or split.outputs[0] is not x1 or split.outputs[1] is not x2 \
                or (sizes is not None and len(set(sizes)) != 1):
            return None
        return x
    first, second = producer(x1, "Slice"), producer(x2, "Slice")
    if first is None or second is None or first.inputs[0] is not second.inputs[0]:
        return None
    x = first.inputs[0]
    width = (x.shape or [None])[-1]
    if not isinstance(width, int) or slice_bounds(first, x) != (0, width // 2):
        return None
    bounds = slice_bounds(second, x)
    return x if bounds is not None and bounds[0] == width // 2 and bounds[1] >= width else None


def half_rotation(turned: gs.Tensor) -> gs.Tensor | None:
    """x when `turned` = Concat(-x[R/2:], x[:R/2]) (NeoX / Llama style)."""
    rotation = producer(turned, "Concat")
    if rotation is None or len(rotation.inputs) != 2 or producer(rotation.inputs[0], "Neg") is None:
        return None
    first_node = producer(rotation.inputs[1], "Slice")
    second_node = producer(producer(rotation.inputs[0], "Neg").inputs[0], "Slice")
    if first_node is None or second_node is None or first_node.inputs[0] is not second_node.inputs[0]:
        return None
    x = first_node.inputs[0]
    if x.shape is None or not isinstance(x.shape[-1], int):
        return None
    width = x.shape[-1]
    bounds = slice_bounds(second_node, x)
    if slice_bounds(first_node, x) != (0, width // 2) or bounds is None or bounds[0] != width // 2 or bounds[1] < width:
        return None
    return x


def pair_rotation(turned: gs.Tensor) -> gs.Tensor | None:
    """x when `turned` interleaves (-x[1::2], x[0::2]) pairwise (GPT-J / GLM style)."""
    reshape = producer(turned, "Reshape")
    stack = producer(reshape.inputs[0], "Concat") if reshape is not None else None
    if stack is None or len(stack.inputs) != 2:
        return None
    negated, kept = (producer(t, "Unsqueeze") for t in stack.inputs)
    if negated is None or kept is None or producer(negated.inputs[0], "Neg") is None:
        return None
    odd_node = producer(producer(negated.inputs[0], "Neg").inputs[0], "Slice")
    even_node = producer(kept.inputs[0], "Slice")
    if odd_node is None or even_node is None or odd_node.inputs[0] is not even_node.inputs[0]:
        return None
    x = odd_node.inputs[0]
    odd, even = slice_bounds(odd_node, x, step=2), slice_bounds(even_node, x, step=2)
    if odd is None or even is None or odd[0] != 1 or even[0] != 0:
        return None
    return x


def match_rotary(tensor: gs.Tensor) -> tuple[gs.Tensor, Rotary] | None:
    """(the un-rotated input, its rotary parameters) if `tensor` is a RoPE output (half or pairwise)."""
    passed_through = None
    concat = producer(tensor, "Concat")
    rank = len(tensor.shape or [])
    if concat is not None and len(concat.inputs) == 2 and producer(concat.inputs[1], "Slice") is not None \
            and concat.attrs.get("axis") in (-1, rank - 1):
        tensor, passed_through = concat.inputs  # partial rotary: [rope(x[:R]), x[R:]]
    add = producer(tensor, "Add")
    if add is None:
        return None
    muls = [producer(t, "Mul") for t in add.inputs]
    if any(m is None for m in muls):
        return None
    for cos_mul, sin_mul in (muls, muls[::-1]):
        for turned_index in (0, 1):
            turned, sin = sin_mul.inputs[turned_index], sin_mul.inputs[1 - turned_index]
            interleaved = 0
            rotated = half_rotation(turned)
            if rotated is None:
                rotated, interleaved = pair_rotation(turned), 1
            if rotated is None or not any(t is rotated for t in cos_mul.inputs):
                continue
            width = rotated.shape[-1] if rotated.shape else None
            if not isinstance(width, int):
                continue
            cos = cos_mul.inputs[1] if cos_mul.inputs[0] is rotated else cos_mul.inputs[0]
            source = rotated
            if passed_through is not None:
                head, tail = producer(rotated, "Slice"), producer(passed_through, "Slice")
                if head is None and tail.inputs[0] is rotated:
                    # the whole head rotated and nothing passed through, `cat([rope(x), x[..., D:]])`: Phi-3
                    # through dynamo's optimize=False (TorchScript slices `x[..., :D]` first, read below)
                    if (slice_bounds(tail, rotated) or (None,))[0] != width:
                        return None
                    return rotated, Rotary(cos, sin, width, interleaved)
                if head is None or head.inputs[0] is not tail.inputs[0]:
                    return None
                source = head.inputs[0]
                tail_bounds, head_dim = slice_bounds(tail, source), (source.shape or [None])[-1]
                if slice_bounds(head, source) != (0, width) or tail_bounds is None or tail_bounds[0] != width \
                        or not isinstance(head_dim, int) or tail_bounds[1] < head_dim:
                    return None
            return source, Rotary(cos, sin, width, interleaved)
    return None
