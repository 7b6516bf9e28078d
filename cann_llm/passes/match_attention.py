"""The parts of an attention block, each a small matcher on the canonicalised graph.

AttentionFusionPass (cann_llm/passes/fuse_attention.py) composes them from the Softmax outwards. Each returns what
it found, or None (or a reason string) when the tensor is not that part; each has its own tests.

    scale      x · a, x / b, a · x (scalar constants), nested: the product of the factors
    mask       scores + mask (either order), Where(allowed, scores, -big) or Where(hidden, -big, scores),
               or two of them stacked (GPT-2's causal buffer filled in, then its padding added)
    softmax    Softmax(Cast?(logits)) → Cast? → NaN guard Where(IsNaN(p), 0, p)?
    heads      Transpose(0, 2, 1, 3)(Reshape([B, S, H, D])(projection)), an optional per-head RmsNorm
    merge      Transpose(0, 2, 1, 3) → Reshape([B, S, H·D]) (or [B·S, H·D] rows)
    kv cache   Concat(past, new) on the sequence axis (2 or -2), past a graph input; a sliding-window
               cache slices past and present to their last W - 1 rows
    repeat     GQA/MQA head repetition: Unsqueeze(2) or Reshape([B, KV, 1, T, D]), then Expand, Tile or a
               Concat of copies on axis 2, then Reshape([B, KV·n, T, D]); or Gather(axis 1) of heads
               [0, 0, 1, 1, ...]
    mask source the attention_mask input the mask reads (values behind Shape do not count; any other
               input refuses), whether it compares key with query positions the causal way (or takes their
               causal triangle), and a sliding window (`kv > q - W`, or a triangle's `tril(diagonal=-W)`);
               any other comparison of positions refuses
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper

from cann_llm.passes.match_alibi import Alibi, match_alibi, peel_alibi
from cann_llm.passes.match_rotary import match_rotary
from cann_llm.passes.pattern import axes_of, const_ints, producer, scalar, sole_consumer
from cann_llm.runtime.ops import CUSTOM_DOMAIN, RMS_NORM, RmsNormInput

CAUSAL_OPS = ("LessOrEqual", "GreaterOrEqual", "Less", "Greater", "Trilu")
MASKED_BELOW = -1e4  # a masked_fill value at most this is a mask (float16's minimum is -65504)


def dtype_kind(dtype, default=np.float32) -> str:
    """numpy's kind letter of a graphsurgeon dtype; graphsurgeon keeps the ONNX enum (an int) for types numpy
    lacks (bfloat16, the float8s), which `np.dtype` cannot read."""
    if dtype is None:
        dtype = default
    return np.dtype(helper.tensor_dtype_to_np_dtype(dtype) if isinstance(dtype, int) else dtype).kind


def in_float32(*tensors: gs.Tensor | None) -> bool:
    """Whether none of `tensors` is known to hold another type than float32 (the fused attention's kernels and
    lowering compute in float32: a float16 FusedAttention makes an artifact onnxruntime refuses at load)."""
    for tensor in tensors:
        dtype = None if tensor is None else tensor.dtype
        if dtype is None:
            continue
        if isinstance(dtype, int) and dtype != onnx.TensorProto.FLOAT:  # an ONNX enum numpy lacks: bfloat16
            return False
        if not isinstance(dtype, int) and np.dtype(dtype) != np.float32:
            return False
    return True


def is_transpose(node: gs.Node | None, perm: list[int]) -> bool:
    return node is not None and node.op == "Transpose" and list(node.attrs.get("perm", [])) == perm


# ---- scale ------------------------------------------------------------------------------------------

def match_scale(tensor: gs.Tensor) -> tuple[gs.Tensor, float]:
    """Strip Mul/Div by scalar constants; the inner tensor and the product of the factors (1.0: none)."""
    factor = 1.0
    while True:
        node = producer(tensor, "Mul", "Div")
        if node is None:
            return tensor, factor
        value = scalar(node.inputs[1])
        if value is not None and value != 0.0:
            factor *= value if node.op == "Mul" else 1.0 / value
            tensor = node.inputs[0]
        elif node.op == "Mul" and scalar(node.inputs[0]) is not None:
            factor *= scalar(node.inputs[0])
            tensor = node.inputs[1]
        else:
            return tensor, factor


def match_softcap(tensor: gs.Tensor) -> tuple[gs.Tensor, float]:
    """`c·tanh(x / c)` (Gemma 2's attention logit softcap) → (x, c); (tensor, 0.0) when it is not one."""
    outer = producer(tensor, "Mul")
    if outer is None:
        return tensor, 0.0
    for capped, constant in (outer.inputs, outer.inputs[::-1]):
        cap, tanh = scalar(constant), producer(capped, "Tanh")
        if cap is None or cap <= 0 or tanh is None:
            continue
        divide = producer(tanh.inputs[0], "Div", "Mul")
        by = scalar(divide.inputs[1]) if divide is not None else None
        if by is not None and np.isclose(by if divide.op == "Div" else 1.0 / by if by else 0.0, cap, rtol=1e-6):
            return divide.inputs[0], float(cap)
    return tensor, 0.0


# ---- softmax and the mask ---------------------------------------------------------------------------

def _peel_cast(tensor: gs.Tensor) -> gs.Tensor:
    node = producer(tensor, "Cast")
    return node.inputs[0] if node is not None and dtype_kind(node.inputs[0].dtype) == "f" else tensor


# float16's lowest value: a floor at or below it only keeps -inf out of the softmax
_LOWEST_FLOOR = -65504.0


def _peel_floor(tensor: gs.Tensor) -> gs.Tensor:
    """The scores under `Max(scores, lowest)`: the older Llama lineage (Baichuan, InternLM) floors its masked
    scores at the dtype's lowest value, which keeps -inf out of the softmax and changes no weight it gives
    a key that is not masked."""
    node = producer(tensor, "Max")
    if node is None or len(node.inputs) != 2:
        return tensor
    for kept, floor in (node.inputs, node.inputs[::-1]):
        value = scalar(floor)
        if value is not None and value <= _LOWEST_FLOOR:
            return kept
    return tensor


def split_mask(logits: gs.Tensor) -> tuple[gs.Tensor, tuple[gs.Tensor, ...], float]:
    """(scaled scores, the masks on them, a factor outside them) of a softmax input; no masks when there are
    none, the factor 1.0.

    A mask is additive, or boolean (True attends) from masked_fill, `Where(allowed, scores, -big)`. Two are
    stacked where a model fills its causal buffer in and then adds the padding mask, as GPT-2's eager
    attention does (`Where(causal, scores, min) + attention_mask`; its only one before transformers 4.42),
    outermost first. A positive scalar outside the masked scores, `(scores + mask)·c` (transformers 4.57's
    CodeGen adds its mask before it divides), scales the scores: a mask of zeros and large negative values
    hides the same keys times c. A floor at the dtype's lowest value over it all is looked through.
    """
    logits = _peel_cast(_peel_floor(_peel_cast(logits)))
    scores, masks = _split_masks(logits)
    if not masks:
        inner, factor = match_scale(logits)
        if inner is not logits and factor > 0:
            scores, masks = _split_masks(_peel_cast(inner))
            if masks:
                return scores, masks, factor
    return scores, masks, 1.0


def _scored(tensor: gs.Tensor) -> bool:
    """Scores of a MatMul, scaled, capped, with an ALiBi term added (each optional)."""
    return producer(match_scale(match_softcap(peel_alibi(tensor)[0])[0])[0], "MatMul") is not None


def _masked_scores(tensor: gs.Tensor) -> bool:
    """Scores (`_scored`) under one mask."""
    return _split_mask(tensor, _scored)[1] is not None


def _split_masks(logits: gs.Tensor) -> tuple[gs.Tensor, tuple[gs.Tensor, ...]]:
    """(scores, their masks outermost first): one, two stacked, or none (then the scores are `logits`)."""
    scores, mask = _split_mask(logits, _scored)
    if mask is not None:
        return scores, (mask,)
    masked, outer = _split_mask(logits, _masked_scores)
    if outer is None:
        return logits, ()
    scores, inner = _split_mask(masked, _scored)
    return scores, (outer, inner)


def _split_mask(logits: gs.Tensor, scored: Callable[[gs.Tensor], bool]) -> tuple[gs.Tensor, gs.Tensor | None]:
    """(the operand `scored` accepts, the mask on it) of an Add or a masked_fill's Where; (logits, None)."""
    add = producer(logits, "Add")
    if add is not None:
        for operand, candidate in (add.inputs, add.inputs[::-1]):
            if scored(operand) and not isinstance(candidate, gs.Constant) and match_alibi(candidate) is None:
                return operand, candidate
    where = producer(logits, "Where")
    if where is not None:  # Where(allowed, scores, fill), or masked_fill's Where(hidden, fill, scores) (MPT)
        for operand, fill in ((where.inputs[1], where.inputs[2]), (where.inputs[2], where.inputs[1])):
            value = scalar(fill)
            if value is not None and value <= MASKED_BELOW and scored(operand):
                return operand, where.inputs[0]
    return logits, None


def _first_keys(tensor: gs.Tensor) -> gs.Tensor:
    """x of `Slice(x)` keeping the first keys (from 0 on the last of 4 axes, step 1), as transformers 4.57 cuts
    each layer's mask to its keys (`mask[:, :, :, :kv_len]`): the keys kept keep their positions."""
    node = producer(tensor, "Slice")
    if node is None or len(node.inputs) < 4:
        return tensor
    starts, axes = const_ints(node.inputs[1]), const_ints(node.inputs[3])
    steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4].name else [1]
    return node.inputs[0] if starts == [0] and axes in ([3], [-1]) and steps == [1] else tensor


def mask_alibi(mask: gs.Tensor) -> tuple[gs.Tensor, Alibi | None]:
    """A mask that carries ALiBi's term → (the mask without it, the term): `Where(hidden, fill, term)`
    (Falcon-RW fills the term where keys are hidden) gives `hidden`, `mask + term` gives `mask`; (mask,
    None) when it carries none."""
    where = producer(_peel_cast(_first_keys(_peel_cast(mask))), "Where")
    if where is not None:
        fill, alibi = scalar(where.inputs[1]), match_alibi(where.inputs[2])
        if fill is not None and fill <= MASKED_BELOW and alibi is not None:
            return where.inputs[0], alibi
    return peel_alibi(mask)


def match_probabilities(graph: gs.Graph, softmax: gs.Node) -> gs.Tensor:
    """The tensor that carries the softmax's probabilities to the values: past a Cast back to the model's
    dtype and sdpa's NaN guard `Where(IsNaN(p), 0, p)`.

    The guard only acts on rows whose every score is -inf; FusedAttention masks with the dtype's minimum,
    so it has no NaN to guard against, and such rows (left padding) are implementation-defined anyway.
    """
    probabilities = softmax.outputs[0]
    cast = sole_consumer(graph, probabilities, "Cast")
    if cast is not None:
        probabilities = cast.outputs[0]
    readers = probabilities.outputs
    if any(t is probabilities for t in graph.outputs):
        return probabilities  # read as a model output too: not only the values' weights
    isnan = next((n for n in readers if n.op == "IsNaN"), None)
    where = next((n for n in readers if n.op == "Where"), None)
    if len(readers) != 2 or isnan is None or where is None or where.inputs[0] is not isnan.outputs[0] \
            or where.inputs[2] is not probabilities or scalar(where.inputs[1]) != 0.0 or len(isnan.outputs[0].outputs) != 1:
        return probabilities
    return where.outputs[0]


@dataclass
class MaskSource:
    """What a mask is made of: the 2-D padding mask it reads (None: none), whether it compares positions,
    and a sliding window W (0: none) when it also hides keys W or more positions back; `window_from_first_key`
    when that window is a triangle of the mask itself (`Trilu`), whose rows count from the first key;
    `queries_from_first_key` when it compares keys with query positions counted from 0 (`arange(S)`), not
    from the past's length."""

    attention_mask: gs.Tensor | None
    causal: int
    window: int = 0
    window_from_first_key: bool = False
    queries_from_first_key: bool = False

    def refusal_over_a_past(self) -> str | None:
        """Why this mask cannot be read where a past precedes the new keys, else None: over a past, a row
        counted from the first key is not the query's position, where the fused op counts from the query's
        position. Transformers' Gemma 2 before 4.53, exported with a cache, does both: its window is a
        triangle of the mask's own rows, and its queries are `arange(S)` whatever the past."""
        if self.window_from_first_key:
            return "the mask's window is a triangle counted from the first key, which over a past is not the query's position"
        if self.queries_from_first_key:
            return "the mask compares keys with query positions counted from 0, which over a past are not the queries' positions"
        return None


_BIAS_SCAN = 1 << 20  # elements a chunk: Baichuan-13B's ALiBi buffer is [40, 4096, 4096]


def _varies_by_head_or_position(tensor: gs.Tensor) -> bool:
    """A float constant of several values beyond 0, 1 and a masking fill, or an op computing slopes: what a
    mask is built from is scalars, 0/1 buffers and comparisons; a bias such as ALiBi's multiplies positions
    by per-head slopes (a folded constant, or `Pow(base, Range)` when folding left it)."""
    if producer(tensor, "Pow") is not None:
        return True
    # Falcon's slopes are bfloat16: an ONNX enum in graphsurgeon, or ml_dtypes' type (kind "V") once read
    floating = isinstance(tensor, gs.Constant) and (isinstance(tensor.dtype, int) or dtype_kind(tensor.dtype) in "fV")
    if not floating or int(np.prod(tensor.shape)) < 2:
        return False
    values = np.asarray(tensor.values).reshape(-1)
    for start in range(0, values.size, _BIAS_SCAN):  # in the stored dtype, a chunk at a time
        chunk = values[start:start + _BIAS_SCAN]
        # a fill rounded to bfloat16 (-1e4 → -9984) still masks: anything at most -1e3 does
        if np.any((chunk != 0) & (chunk != 1) & (chunk > -1e3)):
            return True
    return False


_IN_PLACE = ("And", "Or", "Not", "Add", "Sub", "Mul", "Where", "Equal", "Cast", "Expand", "Slice")


def _constant_positions(tensor: gs.Tensor) -> str | None:
    """What a boolean or float constant of a mask (integers are positions, axes and shapes) says about
    positions: None when it says nothing (fewer than 2 axes, or one value throughout), "causal" for the
    causal pattern over its last two axes (queries the last Q of K keys: key k seen by query q when
    k <= q + K - Q), marking the seen keys or the hidden ones, the same for every leading index, else
    "other": a fixed-shape export's comparison of positions folded into a pattern the fusion cannot read,
    and must not drop."""
    if not isinstance(tensor, gs.Constant) or len(tensor.shape) < 2 or dtype_kind(tensor.dtype) not in "bfV":
        return None
    values = np.asarray(tensor.values)
    if values.size == 0 or np.all(values == values.reshape(-1)[0]):
        return None
    queries, keys = values.shape[-2:]
    stacked = values.reshape(-1, queries, keys)
    # read where it stands: combined element by element (or its rows sliced, as a causal buffer is), never
    # moved between axes, so its last two axes stay the queries' and the keys'
    marked = stacked[0] == stacked[0].max()
    seen = np.tril(np.ones((queries, keys), bool), keys - queries)
    in_place = all(reader.op in _IN_PLACE for reader in tensor.outputs)
    if in_place and np.all(stacked == stacked[0]) and (np.array_equal(marked, seen) or np.array_equal(marked, ~seen)):
        return "causal"
    return "other"


_FLIPPED = {"LessOrEqual": "GreaterOrEqual", "GreaterOrEqual": "LessOrEqual", "Less": "Greater", "Greater": "Less"}


def _role(tensor: gs.Tensor) -> str | None:
    """"key" for positions laid along the last axis ([..., 1, T] or [T]), "query" along the one before it
    ([..., S, 1]); None where the shape does not tell."""
    if tensor.shape is None or not tensor.shape:
        return None
    last, before = tensor.shape[-1], tensor.shape[-2] if len(tensor.shape) > 1 else 1
    if before == 1 and last != 1:
        return "key"
    if last == 1 and before != 1:
        return "query"
    return None


def _moved_by(tensor: gs.Tensor) -> int:
    """c when `tensor` is positions plus a scalar integer constant c (through Unsqueezes, Reshapes and Casts:
    transformers before 4.38 wrote `(arange + 1).view(S, 1)`), else 0."""
    steps = ("Add", "Sub", "Unsqueeze", "Reshape", "Cast")
    node = producer(tensor, *steps)
    while node is not None and node.op in steps[2:]:
        node = producer(node.inputs[0], *steps)
    if node is None or len(node.inputs) != 2:
        return 0
    for index, constant in enumerate(node.inputs):
        value = scalar(constant) if isinstance(constant, gs.Constant) and dtype_kind(constant.dtype) in "iu" else None
        if value is not None and not (node.op == "Sub" and index == 0):
            return int(value) if node.op == "Add" else -int(value)
    return 0


def _counted_from(tensor: gs.Tensor) -> gs.Node | None:
    """The Range `tensor`'s positions are taken from, through Unsqueezes, Reshapes, Casts and scalar integer
    constants added or subtracted, when that Range starts at a constant; None otherwise (a start read from
    shapes, as `arange(past, past + S)` is, or positions added to a computed length)."""
    while (node := producer(tensor, "Unsqueeze", "Reshape", "Cast", "Add", "Sub", "Range")) is not None:
        if node.op == "Range":
            return node if isinstance(node.inputs[0], gs.Constant) else None
        if node.op in ("Add", "Sub"):
            constant = [isinstance(t, gs.Constant) and int(np.prod(t.shape)) == 1 for t in node.inputs]
            if constant != [False, True] and not (node.op == "Add" and constant == [True, False]):
                return None
            tensor = node.inputs[constant.index(False)]
        else:
            tensor = node.inputs[0]
    return None


def _same_values(a: gs.Tensor, b: gs.Tensor, depth: int = 8) -> bool:
    """Whether two tensors are computed alike from the same tensors (TorchScript traces `arange(n)` twice
    where the model wrote it once)."""
    if a is b:
        return True
    if isinstance(a, gs.Constant) and isinstance(b, gs.Constant):
        return a.shape == b.shape and np.array_equal(np.asarray(a.values), np.asarray(b.values))
    first, second = producer(a), producer(b)
    if depth == 0 or first is None or second is None or first.op != second.op or first.attrs != second.attrs \
            or len(first.inputs) != len(second.inputs) or first.outputs.index(a) != second.outputs.index(b):
        return False
    return all(_same_values(x, y, depth - 1) for x, y in zip(first.inputs, second.inputs))


def _queries_from_first_key(keys: gs.Tensor, queries: gs.Tensor) -> bool:
    """Whether the query positions are `arange(S)` from a constant while the keys are other positions: the
    queries then count from the first key, not from the past's length (transformers 4.44's Gemma 2, which
    ignores the cache it is given). Keys and queries from one Range are a square block, placed among the
    past's keys by whatever joins it (transformers 4.37's `cat([zeros(S, P), causal(S)])`)."""
    query_range, key_range = _counted_from(queries), _counted_from(keys)
    if query_range is None:
        return False
    return key_range is None or not _same_values(query_range.outputs[0], key_range.outputs[0])


def computed_from(tensor: gs.Tensor):
    """The nodes `tensor`'s values are computed by, back to the graph's inputs (not through a Shape)."""
    seen, queue = set(), [tensor]
    while queue:
        node = producer(queue.pop())
        if node is None or node.op == "Shape" or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        queue.extend(node.inputs)


def _reads(tensor: gs.Tensor, source: gs.Tensor) -> bool:
    """Whether `tensor`'s values are computed from `source` (not through a Shape)."""
    return tensor is source or any(any(t is source for t in node.inputs) for node in computed_from(tensor))


def _divides(tensor: gs.Tensor) -> bool:
    """Whether `tensor` is computed by dividing integers (not through a Shape)."""
    return any(node.op in ("Div", "Mod") and dtype_kind(node.outputs[0].dtype) in "iu"
               for node in computed_from(tensor))


def _comparison(node: gs.Node, padding: gs.Tensor | None) -> tuple[int, int, bool] | str:
    """What a comparison in a mask says, read as `_triangle` reads a triangle: (causal, window W or 0,
    whether the queries count from the first key, `_queries_from_first_key`) for key positions compared
    with query positions the causal way (`kv <= q`, `kv < q + 1`, `kv > q` for the hidden ones) or a
    window's way (`kv > q - W`, `kv <= q - W` for the hidden ones); (0, 0, False) for the padding mask
    compared with a constant; otherwise a refusal. Where the shapes do not tell keys from queries, the
    comparison is taken as causal."""
    left, right = node.inputs
    if all(t.shape is not None and len(t.shape) <= 1 for t in (left, right)):
        return 0, 0, False  # arithmetic on shapes
    constants = [isinstance(t, gs.Constant) and int(np.prod(t.shape)) == 1 for t in (left, right)]
    if any(constants):
        computed = right if constants[0] else left
        if padding is not None and _reads(computed, padding):
            return 0, 0, False
        return f"{node.name} compares positions with a constant, which the fusion does not read"
    roles = (_role(left), _role(right))
    if None in roles:
        return 1, 0, False
    op = node.op
    if roles == ("query", "key"):
        left, right, op = right, left, _FLIPPED[op]
    elif roles != ("key", "query"):
        return f"{node.name} compares positions along one axis, which the fusion does not read"
    offset = _moved_by(right) - _moved_by(left)  # the keys compared with the queries moved by this much
    from_first_key = _queries_from_first_key(left, right)
    if (op, offset) in (("LessOrEqual", 0), ("Less", 1), ("Greater", 0), ("GreaterOrEqual", 1)):
        return 1, 0, from_first_key
    # a window W: the keys seen (`kv > q - W`, `kv >= q - W + 1`) or the ones hidden (`kv <= q - W`, as
    # transformers 4.43's Mistral ors into its causal mask, or `kv < q - W + 1`)
    window = {"Greater": -offset, "LessOrEqual": -offset, "GreaterOrEqual": 1 - offset, "Less": 1 - offset}[op]
    if offset < 1 and window > 1:
        return 1, window, from_first_key
    return f"{node.name} compares key and query positions {op} with an offset of {offset}, neither causal nor a window"


def _triangle(node: gs.Node) -> tuple[int, int, bool] | str:
    """What a Trilu over [queries, keys] marks, read as `_comparison` reads a comparison, and whether it counts
    from the first key: key j of row i where j - i >= k (upper) or j - i <= k (lower). Causal: the upper part
    from k = 1 (the keys after the query, transformers' `triu(diagonal=1)`) or the lower one from k = 0; a
    window W: the lower part from k = -W, the keys W or more back that Gemma 2's `tril(diagonal=-W)` hides
    before transformers 4.53, counted from the first key. A diagonal computed from shapes plus a constant,
    the past's length P + c as transformers before 4.43 wrote Mistral's and Qwen2's window
    (`triu(diagonal=P - W + 1)`, the keys seen), counts from the query's position: the upper part from
    P + 1 is causal, from P + 1 - W a window W. Any other triangle is refused: read as causal, it would be
    dropped."""
    upper = int(node.attrs.get("upper", 1))
    given = len(node.inputs) > 1 and node.inputs[1].name
    k = scalar(node.inputs[1]) if given else 0
    if k is None:
        k = _offset_on_shapes(node.inputs[1])
        if k is None:
            return f"{node.name} takes the triangle of a computed diagonal, which the fusion does not read"
        if upper == 1 and k == 1:
            return 1, 0, False
        if upper == 1 and k < 0:
            return 1, 1 - k, False
        side = "upper" if upper else "lower"
        return f"{node.name} takes the {side} triangle from a length plus {k}, neither causal nor a window"
    k = int(k)
    if (upper, k) in ((0, 0), (1, 1)):
        return 1, 0, False
    if upper == 0 and k < -1:
        return 1, -k, True
    return f"{node.name} takes the {'upper' if upper else 'lower'} triangle from diagonal {k}, neither causal nor a window"


def _offset_on_shapes(tensor: gs.Tensor) -> int | None:
    """c for `tensor` = x + c, c the scalar integer constants added and subtracted on top and x computed from
    shapes alone (no input's values); None otherwise."""
    offset = 0
    while (node := producer(tensor, "Add", "Sub")) is not None and len(node.inputs) == 2:
        constants = [scalar(t) if isinstance(t, gs.Constant) and dtype_kind(t.dtype) in "iu" else None
                     for t in node.inputs]
        if constants[1] is not None:
            offset += int(constants[1]) if node.op == "Add" else -int(constants[1])
            tensor = node.inputs[0]
        elif constants[0] is not None and node.op == "Add":
            offset += int(constants[0])
            tensor = node.inputs[1]
        else:
            break
    if producer(tensor) is None:
        return None
    reads_values = any(not isinstance(t, gs.Constant) and producer(t) is None
                       for node in computed_from(tensor) for t in node.inputs)
    return None if reads_values else offset


def match_mask_source(graph: gs.Graph, *masks: gs.Tensor) -> MaskSource | str:
    """The attention_mask input whose values the masks read (values behind a Shape do not count), causality,
    and a sliding window: positions moved by a constant W and compared as transformers' sliding-window
    overlay writes `kv_idx > q_idx - W`. A mask that reads another input, compares positions another way
    (`_comparison`) or holds a constant pattern of positions other than the causal one is refused: the
    fusion would drop what it does not read."""
    for mask in masks:
        if mask.shape is not None and len(mask.shape) == 4 and isinstance(mask.shape[1], int) and mask.shape[1] > 1:
            return f"the mask differs per head ({mask.shape}: ALiBi's slopes?), which the fusion would drop"
    readers: dict[int, gs.Tensor] = {}
    causal, windows, seen, queue = 0, set(), set(), deque(masks)
    triangle_window = queries_from_first_key = False
    inputs = {id(t): t for t in graph.inputs}
    padding = next((t for t in graph.inputs if t.name == "attention_mask"), None)
    while queue:
        tensor = queue.popleft()
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if id(tensor) in inputs:
            if tensor is not padding or tensor.shape is None or len(tensor.shape) != 2 or \
                    dtype_kind(tensor.dtype) not in "iub":
                return f"the mask reads the input {tensor.name}, where the fusion reads a 2-D integer attention_mask"
            readers[id(tensor)] = tensor
            continue
        if _varies_by_head_or_position(tensor):
            return "the mask adds values per head or position (ALiBi's slopes), which the fusion would drop"
        pattern = _constant_positions(tensor)
        if pattern == "other":
            return f"the mask holds a constant pattern of positions ({tensor.name}) that is not the causal one"
        causal |= pattern == "causal"
        node = producer(tensor)
        if node is None or node.op == "Shape":
            continue
        if node.op in CAUSAL_OPS:
            read = _triangle(node) if node.op == "Trilu" else _comparison(node, padding)
            if isinstance(read, str):
                return read
            causal |= read[0]
            if read[1]:
                windows.add(read[1])
                triangle_window |= node.op == "Trilu" and read[2]
            queries_from_first_key |= node.op != "Trilu" and read[2]
        elif node.op == "Equal" and {_role(node.inputs[0]), _role(node.inputs[1])} == {"key", "query"} and \
                any(_divides(t) for t in node.inputs):
            # keys and queries in one chunk (Llama 4's `kv // C == q // C`); transformers' test for packed
            # sequences (`seq[kv] == seq[q]`, from breaks in the positions it counted itself) is always true
            return f"{node.name} compares chunks of positions, which the fusion does not read"
        queue.extend(node.inputs)
    if not readers and not causal:
        return "the mask reads no attention_mask input and compares no positions"
    if len(windows) > 1:
        return f"the mask compares positions moved back by several constants ({sorted(windows)})"
    return MaskSource(padding if readers else None, causal, windows.pop() if windows else 0, triangle_window,
                      queries_from_first_key)


# ---- heads ------------------------------------------------------------------------------------------

@dataclass
class Projection:
    """A [B, S, H·D] input of the fused op; `per_head` is a [B, S, H, D] value to flatten first (the
    output of a per-head q/k RmsNorm, as in Qwen3), [B, H, S, D] when `heads_first` (Gemma 3 normalises
    after the transpose)."""

    tensor: gs.Tensor
    heads: int
    per_head: bool = False
    heads_first: bool = False


def match_head_split(heads4: gs.Tensor, tokens_first: bool = False) -> Projection | str:
    """From [B, H, S, D] back to the [B, S, H·D] projection it was split from; with `tokens_first`, from
    [S, B, H, D] (sequence-first, as ChatGLM computes, before its heads move to the front) back to [S, B, H·D]."""
    if tokens_first:
        return _projection(heads4, heads4, None)
    after = producer(heads4, RMS_NORM.name)
    if after is not None and after.domain == CUSTOM_DOMAIN:
        # a per-head norm after the transpose: over D, so the transpose is the same before or after it
        normed = after.inputs[RmsNormInput.X]
        # a rotation before it (HunYuan normalises q and k once rotated) stays in the graph, which then gives
        # the op its heads rotated and normalised: per token, so a flattened batch rotates them alike
        rotated = match_rotary(normed)
        found = match_head_split(rotated[0] if rotated is not None else normed)
        if isinstance(found, Projection) and not found.per_head:
            return Projection(heads4, found.heads, per_head=True, heads_first=True)
        return found if isinstance(found, str) else "two per-head norms"
    transpose = producer(heads4, "Transpose")
    if not is_transpose(transpose, [0, 2, 1, 3]):
        return "the heads are not a (0, 2, 1, 3) transpose"
    split = transpose.inputs[0]
    norm = producer(split, RMS_NORM.name)
    if norm is not None and norm.domain == CUSTOM_DOMAIN:
        split = norm.inputs[RmsNormInput.X]
    else:
        norm = None
    return _projection(heads4, split, norm)


def _projection(heads4: gs.Tensor, split: gs.Tensor, norm: gs.Node | None) -> Projection | str:
    """The projection `split` (heads4's values, heads on its third axis) is a Reshape of, through `norm`."""
    reshape = producer(split, "Reshape")
    if reshape is None:
        return "the heads are not reshaped from a projection"
    projection = reshape.inputs[0]
    dims = heads4.shape
    if projection.shape is None or len(projection.shape) != 3 or dims is None or not isinstance(dims[-1], int) \
            or not isinstance(projection.shape[-1], int) or projection.shape[-1] % dims[-1]:
        return "the projection's width is not a static multiple of the head size"
    heads = projection.shape[-1] // dims[-1]
    return Projection(norm.outputs[0], heads, True) if norm is not None else Projection(projection, heads)


def peel_empty_row_guard(graph: gs.Graph, context: gs.Tensor, masks: tuple[gs.Tensor, ...]) -> gs.Tensor:
    """What `context` [B, H, S, D] is merged from: the output of the Where that zeroes its rows seeing no key,
    `Where(ReduceSum(Cast(m), -1, keepdims) < 1, 0, context)` with m the boolean of the keys seen, that the
    scores' mask hides where it is False (transformers 5's own ONNX exporter writes it), where that Where is
    its sole reader; else
    `context`. The rows it zeroes attend to nothing, whose output is the fused op's own, as a left-padded
    row's is; every other row it passes on unchanged."""
    where = sole_consumer(graph, context, "Where")
    if where is None or where.inputs[2] is not context or scalar(where.inputs[1]) != 0.0:
        return context
    less = producer(where.inputs[0], "Less")
    total = producer(less.inputs[0], "ReduceSum") if less is not None and scalar(less.inputs[1]) == 1.0 else None
    if total is None or int(total.attrs.get("keepdims", 1)) != 1:
        return context
    seen = producer(total.inputs[0], "Cast")
    seen = seen.inputs[0] if seen is not None else total.inputs[0]
    rank = len(seen.shape or [])
    axes = const_ints(total.inputs[1]) if len(total.inputs) > 1 else total.attrs.get("axes")
    if dtype_kind(seen.dtype) != "b" or rank < 2 or axes is None or [a % rank for a in axes] != [rank - 1]:
        return context
    return where.outputs[0] if any(_hides_where_false(mask, seen) for mask in masks) else context


def _hides_where_false(mask: gs.Tensor, seen: gs.Tensor) -> bool:
    """Whether the scores' `mask` hides the keys where boolean `seen` is False: computed from `Not(seen)`
    (`Cast(Not(seen)) · min`, transformers 5's exporter) or from `Where(seen, 0, min)`."""
    for node in computed_from(mask):
        if node.inputs and node.inputs[0] is seen and (
                node.op == "Not" or node.op == "Where" and scalar(node.inputs[1]) == 0.0
                and (scalar(node.inputs[2]) or 0.0) <= MASKED_BELOW):
            return True
    return False


def match_head_merge(graph: gs.Graph, context: gs.Tensor, tokens_first: bool = False) -> gs.Tensor | str:
    """The output that `context` [B, H, S, D] is merged into: [B, S, H·D], or [B·S, H·D] rows for a 2-D
    projection (GPT-2's Conv1D, a MatMul on 2-D rows); with `tokens_first`, [S, B, H·D]."""
    merge = sole_consumer(graph, context, "Transpose")
    reshape = None
    if is_transpose(merge, [2, 0, 1, 3] if tokens_first else [0, 2, 1, 3]) \
            and not any(t is merge.outputs[0] for t in graph.outputs):
        # Shapes that read the merged heads only compute the Reshape's target, which goes with it
        readers = [n for n in merge.outputs[0].outputs if n.op != "Shape"]
        reshape = readers[0] if len(readers) == 1 and readers[0].op == "Reshape" else None
    merged = reshape.outputs[0] if reshape is not None else None
    width = context.shape[1] * context.shape[3] if context.shape is not None and len(context.shape) == 4 \
        and all(isinstance(d, int) for d in (context.shape[1], context.shape[3])) else None
    if merged is None or merged.shape is None or len(merged.shape) not in ((3,) if tokens_first else (2, 3)) \
            or merged.shape[-1] != width:
        return "the context is not merged back to [B, S, H·D]"
    return merged


# ---- the KV cache and its repetition ------------------------------------------------------------------

@dataclass
class KvCache:
    """Keys (or values) as a cache holds them: `past` (a graph input) + `new`; `present` is the graph output
    the fused op's present takes over. A sliding-window layer's cache (transformers'
    DynamicSlidingWindowLayer) keeps only the last W - 1 tokens: its past and present are sliced so, and
    `window` is W; the fused op keeps the whole cache and hides the old keys by the window instead."""

    past: gs.Tensor | None
    new: gs.Tensor
    present: gs.Tensor | None
    window: int = 0


def _kept_tail(node: gs.Node | None, rank: int, tokens_first: bool = False) -> int | None:
    """n when `node` is Slice(x, [-n], [to the end]) on the sequence axis: x's last n rows."""
    if node is None or node.op != "Slice" or len(node.inputs) < 4:
        return None
    starts, ends, axes = (const_ints(t) for t in node.inputs[1:4])
    steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 else [1]
    sequence = (0, -rank) if tokens_first else (rank - 2, -2)
    if None in (starts, ends, axes, steps) or len(starts) != 1 or axes[0] not in sequence or steps != [1]:
        return None
    return -starts[0] if starts[0] < 0 and ends[0] >= 2 ** 31 - 1 else None


def match_kv_concat(graph: gs.Graph, keys: gs.Tensor, tokens_first: bool = False) -> KvCache:
    """The cache that `keys` [B, KV, T, D] ([T, B, KV, D] with `tokens_first`) is, or `KvCache(None, keys,
    None)` when it is only the new keys."""
    concat = producer(keys, "Concat")
    rank = len(keys.shape) if keys.shape is not None else 4
    outputs = {id(t) for t in graph.outputs}
    inputs = {id(t) for t in graph.inputs}
    sequence = (0, -rank) if tokens_first else (rank - 2, -2)
    if concat is None or len(concat.inputs) != 2 or concat.attrs.get("axis") not in sequence:
        return KvCache(None, keys, None)
    past, new = concat.inputs
    kept = _kept_tail(producer(past, "Slice"), rank, tokens_first)
    if kept is not None:
        past = producer(past, "Slice").inputs[0]
    if id(past) not in inputs:
        return KvCache(None, keys, None)
    if kept is None:
        return KvCache(past, new, keys)
    # a reader an earlier layer's fusion detached has no outputs left
    present = next((reader.outputs[0] for reader in keys.outputs if reader.outputs
                    and _kept_tail(reader, rank, tokens_first) == kept and id(reader.outputs[0]) in outputs), None)
    return KvCache(past, new, present, kept + 1)


def _inserted_group_axis(tensor: gs.Tensor, heads: int = 1) -> gs.Tensor | None:
    """x when `tensor` is x [B, KV, T, D] (the KV heads on axis `heads`) with a unit axis inserted after the
    heads (Unsqueeze or Reshape)."""
    node = producer(tensor, "Unsqueeze", "Reshape")
    if node is None:
        return None
    source = node.inputs[0]
    inserted = heads + 1
    if node.op == "Unsqueeze":
        return source if axes_of(node) in ([inserted], [inserted - 5]) else None
    shape, inner = tensor.shape, source.shape
    if shape is None or inner is None or len(shape) != 5 or len(inner) != 4 or shape[inserted] != 1:
        return None
    return source if list(shape[:inserted]) + list(shape[inserted + 1:]) == list(inner) else None


def match_gqa_repeat(tensor: gs.Tensor, tokens_first: bool = False) -> tuple[gs.Tensor, int | None] | None:
    """(the KV heads, the repetition factor) when `tensor` repeats each KV head n times in place
    (head h reads KV head h // n); the factor is None when only run-time shapes tell it (an Expand
    whose shape was not inferred). None when `tensor` is not such a repetition. The heads are on axis 1
    of [B, H, T, D], or on axis 2 of [T, B, H, D] with `tokens_first` (ChatGLM's groups)."""
    heads = 2 if tokens_first else 1
    gather = producer(tensor, "Gather")
    if gather is not None and gather.attrs.get("axis", 0) == heads:
        indices = const_ints(gather.inputs[1])
        source = gather.inputs[0]
        kv = source.shape[heads] if source.shape is not None and len(source.shape) == 4 else None
        if indices and isinstance(kv, int) and len(indices) % kv == 0:
            repeats = len(indices) // kv
            if indices == [h // repeats for h in range(len(indices))]:
                return source, repeats
        return None
    reshape = producer(tensor, "Reshape")
    if reshape is None or tensor.shape is None or len(tensor.shape) != 4:
        return None
    copies = producer(reshape.inputs[0], "Expand", "Tile", "Concat")
    if copies is None:
        return None
    inserted = heads + 1
    if copies.op == "Concat":
        if copies.attrs.get("axis") not in (inserted, inserted - 5) or any(t is not copies.inputs[0] for t in copies.inputs):
            return None
        source, repeats = _inserted_group_axis(copies.inputs[0], heads), len(copies.inputs)
    else:
        source = _inserted_group_axis(copies.inputs[0], heads)
        grouped = copies.outputs[0].shape
        repeats = grouped[inserted] if grouped is not None and len(grouped) == 5 else None
        if copies.op == "Tile":
            multiples = const_ints(copies.inputs[1])
            repeats = multiples[inserted] if multiples is not None and len(multiples) == 5 and \
                multiples[:inserted] + multiples[inserted + 1:] == [1, 1, 1, 1] else None
    if source is None or (copies.op != "Expand" and not isinstance(repeats, int)):
        return None
    return source, repeats if isinstance(repeats, int) else None


def unrepeat(tensor: gs.Tensor) -> gs.Tensor:
    """The KV heads behind a GQA repetition, or `tensor` itself."""
    found = match_gqa_repeat(tensor)
    return found[0] if found is not None else tensor
