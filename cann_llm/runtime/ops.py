"""The `cann` operator set's contract in one place: each op's name, input and output slots, attribute
defaults, and the attention metadata a paged step feeds (docs/ops.md is the prose of the same contract).

The compiler's passes write these ops and the runtime's lowerings and kernels read them; both name an
input by its slot here (`FusedAttentionInput.PAST_KEY`), never by a number of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence, TypeVar

import numpy as np
import onnx
from onnx import helper

CUSTOM_DOMAIN = "cann"
MICROSOFT_DOMAIN = "com.microsoft"  # onnxruntime's contrib ops


class RmsNormInput(IntEnum):
    X = 0
    WEIGHT = 1


class AddRmsNormInput(IntEnum):
    X1 = 0
    X2 = 1
    WEIGHT = 2


class AddRmsNormOutput(IntEnum):
    Y = 0
    SUM = 1


class SwiGluInput(IntEnum):
    X = 0


class MoEInput(IntEnum):
    X = 0
    ROUTER_LOGITS = 1
    GATE_UP = 2
    DOWN = 3


class FusedAttentionInput(IntEnum):
    QUERY = 0  # or the packed [q | k | v] projection, KEY and VALUE then empty
    KEY = 1
    VALUE = 2
    PAST_KEY = 3
    PAST_VALUE = 4
    ATTENTION_MASK = 5
    COS = 6
    SIN = 7
    ATTENTION_BIAS = 8


class FusedAttentionOutput(IntEnum):
    OUTPUT = 0
    PRESENT_KEY = 1
    PRESENT_VALUE = 2


class PagedAttentionInput(IntEnum):
    QUERY = 0  # or the packed [q | k | v] projection, KEY and VALUE then empty
    KEY = 1
    VALUE = 2
    COS = 3
    SIN = 4
    QUERY_START_LOC = 5
    SEQ_LENS = 6
    BLOCK_TABLES = 7
    SLOT_MAPPING = 8


class MatMulQuantInput(IntEnum):
    A = 0
    B = 1
    SCALES = 2
    ZERO_POINTS = 3
    # MatMulInt4 only, and only in the sessions the runtime builds (cann_llm/runtime/lowering.py: with_input_scales):
    # [K] float32 multiplying A's columns, a constant Mul moved into the node
    INPUT_SCALE = 4


class MatMulF28Input(IntEnum):
    A = 0
    PACKED = 1  # uint8 [ceil(N/16), K, 56] (cann_llm/runtime/kernels/float28.py)
    OFFSETS = 2  # int32 [ceil(N/16) + 1]: each panel's exceptions
    POSITIONS = 3  # int32 [exceptions]: k · 16 + column within the panel
    VALUES = 4  # float32 [exceptions]


class GatherF28Input(IntEnum):
    PACKED = 0  # a tied lm_head's MatMulF28 weight: the table's transpose [K = hidden, N = vocabulary]
    OFFSETS = 1
    POSITIONS = 2
    VALUES = 3
    INDICES = 4


class MatMulF32Input(IntEnum):
    A = 0
    PANELS = 1  # float32 [ceil(N/16), K, 16] (cann_llm/runtime/kernels/float32_panels.py): laid out at load, never stored


class GatherInt4Input(IntEnum):
    TABLE = 0
    INDICES = 1
    SCALES = 2


class SingleOutput(IntEnum):
    Y = 0


class GatedDeltaNetInput(IntEnum):
    """onnxruntime's com.microsoft.GatedDeltaNet, which a hybrid's export carries
    (cann_llm/models/recurrent_export.py): its slots, of which exports fill all but CU_SEQLENS."""

    QUERY = 0
    KEY = 1
    VALUE = 2
    CU_SEQLENS = 3
    DECAY = 4
    BETA = 5
    INITIAL_STATE = 6


class CausalConvInput(IntEnum):
    """onnxruntime's com.microsoft.CausalConvWithState, a hybrid's short convolution with its state."""

    INPUT = 0
    WEIGHT = 1
    BIAS = 2
    PAST_STATE = 3


class VarlenCausalConvInput(IntEnum):
    """onnxruntime's com.microsoft.VarlenCausalConvWithState: the same over sequences packed token-major."""

    INPUT = 0
    WEIGHT = 1
    CU_SEQLENS = 2
    BIAS = 3
    INITIAL_STATE = 4


class StateOutput(IntEnum):
    OUTPUT = 0
    STATE = 1


@dataclass(frozen=True)
class Op:
    """One `cann` op: its slots and the defaults of its optional attributes (the others are required)."""

    name: str
    inputs: type[IntEnum]
    outputs: type[IntEnum] = SingleOutput
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))


RMS_NORM = Op("RmsNorm", RmsNormInput, defaults={"epsilon": 1e-6})
ADD_RMS_NORM = Op("AddRmsNorm", AddRmsNormInput, AddRmsNormOutput, defaults={"epsilon": 1e-6})
SWIGLU = Op("SwiGlu", SwiGluInput)
MOE = Op("MoE", MoEInput, defaults={"normalize_routing_weights": 0})
# `softcap` c > 0: scores become c·tanh(scores / c) before the mask (Gemma 2); `alibi_slopes` m_h (one a
# query head, ALiBi: BLOOM, MPT): m_h·(key position - query position) added after it, positions counted over
# the keys attention_mask keeps with `alibi_from_mask` (BLOOM), the keys' index otherwise; `sinks` s_h (one a
# query head, gpt-oss): a logit each head's softmax counts beside the masked scores, with no value to it
FUSED_ATTENTION = Op("FusedAttention", FusedAttentionInput, FusedAttentionOutput, defaults={
    "causal": 1, "rotary_dim": 0, "rotary_interleaved": 0, "bias_per_head": 0, "bias_is_bool": 0,
    "sliding_window": 0, "softcap": 0.0, "alibi_slopes": (), "alibi_from_mask": 0, "sinks": ()})
# always causal; `layer` picks the pool's layer, `flash` sends long prompt chunks through flash_prefill
PAGED_ATTENTION = Op("PagedAttention", PagedAttentionInput, defaults={
    "rotary_interleaved": 0, "sliding_window": 0, "softcap": 0.0, "alibi_slopes": (), "sinks": (), "flash": 0})
MATMUL_INT4 = Op("MatMulInt4", MatMulQuantInput, defaults={"bits": 4, "accuracy_level": 0})
MATMUL_INT8 = Op("MatMulInt8", MatMulQuantInput)
GATHER_INT4 = Op("GatherInt4", GatherInt4Input, defaults={"bits": 4})
MATMUL_F28 = Op("MatMulF28", MatMulF28Input)
GATHER_F28 = Op("GatherF28", GatherF28Input)
# laid out by the runtime at load for the native library (cann_llm/runtime/executor.py), never in an artifact
MATMUL_F32 = Op("MatMulF32", MatMulF32Input)
# onnxruntime's own recurrent ops (domain com.microsoft), not `cann` ones: registered for their reference
# kernels, with the attributes an export leaves at their defaults (GatedDeltaNet's scale 0 is 1/sqrt(key size))
GATED_DELTA_NET = Op("GatedDeltaNet", GatedDeltaNetInput, StateOutput, defaults={
    "scale": 0.0, "qk_l2_norm": 0, "update_rule": "gated_delta", "gate_activation": "none", "beta_activation": "none"})
CAUSAL_CONV_WITH_STATE = Op("CausalConvWithState", CausalConvInput, StateOutput, defaults={
    "activation": "none", "dilation": 1, "channels_last": 0, "ndim": 1})
VARLEN_CAUSAL_CONV_WITH_STATE = Op("VarlenCausalConvWithState", VarlenCausalConvInput, StateOutput, defaults={
    "activation": "none", "dilation": 1})
RECURRENT_CONTRIB_OPS = (GATED_DELTA_NET.name, CAUSAL_CONV_WITH_STATE.name, VARLEN_CAUSAL_CONV_WITH_STATE.name)
# the oldest onnxruntime these were tested with: their CPU kernels are recent, newer than the package's floor
RECURRENT_ONNXRUNTIME = "1.32"

OPS: dict[str, Op] = {op.name: op for op in (RMS_NORM, ADD_RMS_NORM, SWIGLU, MOE, FUSED_ATTENTION, PAGED_ATTENTION,
                                             MATMUL_INT4, MATMUL_INT8, GATHER_INT4, MATMUL_F28,
                                             GATHER_F28)}
ATTENTION_OPS = (FUSED_ATTENTION.name, PAGED_ATTENTION.name)


@dataclass(frozen=True)
class MetadataInput:
    """A graph input of a paged artifact describing the step's batch, read by every PagedAttention."""

    slot: PagedAttentionInput
    dtype: type
    shape: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.slot.name.lower()


PAGED_METADATA = (
    MetadataInput(PagedAttentionInput.QUERY_START_LOC, np.int32, ("num_seqs_plus_1",)),
    MetadataInput(PagedAttentionInput.SEQ_LENS, np.int32, ("num_seqs",)),
    MetadataInput(PagedAttentionInput.BLOCK_TABLES, np.int32, ("num_seqs", "max_blocks")),
    MetadataInput(PagedAttentionInput.SLOT_MAPPING, np.int64, ("num_tokens",)),
)
# int64 [1, T]: each token's sequence's last position, where a rotary scaling switches on the sequence's length
# (cann_llm/passes/per_sequence_rotary.py)
LAST_POSITIONS = "last_position_ids"



def paged_metadata_feeds(query_start_loc, seq_lens, block_tables, slot_mapping) -> dict[str, np.ndarray]:
    """A paged step's metadata as the graph's feeds, by name and in the contract's dtypes (in
    PAGED_METADATA's order, as the arguments are)."""
    values = (query_start_loc, seq_lens, block_tables, slot_mapping)
    return {name: np.asarray(value, dtype) for (name, dtype), value in zip(_METADATA_FEEDS, values)}


_METADATA_FEEDS = tuple((m.name, m.dtype) for m in PAGED_METADATA)


T = TypeVar("T")


def positional(slots: type[IntEnum], values: Mapping[IntEnum, T | None], empty: T) -> list[T]:
    """A node's input list from {slot: value}: `empty` in the slots without a value (None), trailing
    empty slots left off."""
    present = [slot for slot, value in values.items() if value is not None]
    if not present:
        return []
    width = max(present) + 1
    return [values[slot] if values.get(slot) is not None else empty for slot in slots if slot < width]


def input_at(inputs: Sequence, slot: IntEnum):
    """The input in `slot` of a node's inputs (names or graphsurgeon tensors), or None when it is empty."""
    if slot >= len(inputs):
        return None
    value = inputs[slot]
    name = value if isinstance(value, str) else value.name
    return value if name else None


def attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """A `cann` node's attributes, the op's defaults filled in."""
    return {**OPS[node.op_type].defaults, **{a.name: helper.get_attribute_value(a) for a in node.attribute}}


# ---- the contract's checks: what the loader holds every `cann` node of an artifact to -----------------

PAGE_SIZE_RANGE = (16, 512)  # tokens per page: a multiple of 16 in this range
BLOCK_SIZES = (16, 32, 64, 128, 256)  # MatMulInt4 / GatherInt4 quantization blocks (MatMulNBits' set)
MAX_HEADS = 4096
MAX_HEAD_DIM = 1024
MAX_DIM = 2**31 - 1


class ContractViolation(ValueError):
    """A `cann` node that breaks its op's contract; the message names the node and the field."""


@dataclass(frozen=True)
class Attr:
    """One attribute's rule: an int in [low, high] (or one of `choices`), or a finite float."""

    kind: type = int
    low: float = 0
    high: float = MAX_DIM
    choices: tuple = ()

    def check(self, value) -> str | None:
        """Why `value` breaks the rule, or None."""
        if self.kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
                return f"{value!r} is not a finite number"
            return None if self.low <= value <= self.high else f"{value} is outside [{self.low}, {self.high}]"
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{value!r} is not an integer"
        if self.choices:
            return None if value in self.choices else f"{value} is not one of {', '.join(map(str, self.choices))}"
        return None if self.low <= value <= self.high else f"{value} is outside [{self.low}, {self.high}]"


@dataclass(frozen=True)
class FloatsAttr:
    """A list of finite floats, at most `longest` (how many an op wants is cross-checked with its other
    attributes)."""

    longest: int = MAX_HEADS

    def check(self, value) -> str | None:
        """Why `value` breaks the rule, or None."""
        if not isinstance(value, (list, tuple)) or len(value) > self.longest:
            return f"is not a list of at most {self.longest} numbers"
        if not all(isinstance(v, float) and np.isfinite(v) for v in value):
            return "holds a value that is not a finite number"
        return None


_FLAG = Attr(choices=(0, 1))
_HEADS = Attr(low=1, high=MAX_HEADS)
_ATTENTION_ATTRS = {"num_heads": _HEADS, "kv_num_heads": _HEADS, "head_dim": Attr(low=1, high=MAX_HEAD_DIM),
                    "scale": Attr(float, low=0, high=1e6), "rotary_interleaved": _FLAG,
                    "sliding_window": Attr(low=0), "softcap": Attr(float, low=0, high=1e6),
                    "alibi_slopes": FloatsAttr(), "sinks": FloatsAttr()}
_QUANT_ATTRS = {"K": Attr(low=1), "bits": Attr(choices=(4, 8)), "block_size": Attr(choices=BLOCK_SIZES)}
ATTRIBUTE_RULES: dict[str, dict[str, Attr]] = {
    RMS_NORM.name: {"epsilon": Attr(float, low=0, high=1)},
    ADD_RMS_NORM.name: {"epsilon": Attr(float, low=0, high=1)},
    SWIGLU.name: {},
    MOE.name: {"num_experts": Attr(low=1, high=MAX_HEADS), "top_k": Attr(low=1, high=MAX_HEADS),
               "normalize_routing_weights": _FLAG},
    FUSED_ATTENTION.name: {**_ATTENTION_ATTRS, "causal": _FLAG, "rotary_dim": Attr(low=0, high=MAX_HEAD_DIM),
                           "bias_per_head": _FLAG, "bias_is_bool": _FLAG, "alibi_from_mask": _FLAG},
    PAGED_ATTENTION.name: {**_ATTENTION_ATTRS, "layer": Attr(low=0, high=MAX_HEADS),
                           "page_size": Attr(low=PAGE_SIZE_RANGE[0], high=PAGE_SIZE_RANGE[1]), "flash": _FLAG},
    MATMUL_INT4.name: {**_QUANT_ATTRS, "N": Attr(low=1), "accuracy_level": Attr(choices=(0, 1, 2, 3, 4))},
    MATMUL_INT8.name: {},
    GATHER_INT4.name: _QUANT_ATTRS,
    # a window's lowest exponent is 1 .. 240: normal, and its 15th below 255 (infinities and NaN)
    MATMUL_F28.name: {"K": Attr(low=1), "N": Attr(low=1), "bias": Attr(low=0, high=239)},
    GATHER_F28.name: {"K": Attr(low=1), "N": Attr(low=1), "bias": Attr(low=0, high=239)},
}

Shape = tuple  # a tensor's dims as the loader knows them: ints, or None where a dim is not known


def check_node(node: onnx.NodeProto, shape_of: Callable[[str], Shape | None]) -> None:
    """Hold `node` (a `cann` node) to its op's contract: every attribute present, of its type and in its
    range, none unknown; the attributes consistent with each other and with the shapes of its operands that
    `shape_of(name)` knows (None: unknown). Raises ContractViolation naming the node and the field."""
    op, rules = OPS.get(node.op_type), ATTRIBUTE_RULES.get(node.op_type)
    if op is None or rules is None:
        raise ContractViolation(f"node {node.name}: {node.op_type} is not a cann op")
    if len(node.input) > len(op.inputs) or len(node.output) > len(op.outputs):
        raise ContractViolation(f"node {node.name}: {len(node.input)} inputs and {len(node.output)} outputs, "
                                f"the op has {len(op.inputs)} and {len(op.outputs)}")
    try:
        attrs = attributes(node)
    except Exception as error:  # an attribute proto onnx itself cannot read
        raise ContractViolation(f"node {node.name}: unreadable attribute ({error})") from None
    unknown = sorted(set(attrs) - set(rules))
    if unknown:
        raise ContractViolation(f"node {node.name}: unknown attribute {unknown[0]}")
    for name, rule in rules.items():
        if name not in attrs:
            raise ContractViolation(f"node {node.name}: attribute {name} is missing")
        problem = rule.check(attrs[name])
        if problem:
            raise ContractViolation(f"node {node.name}: {name} {problem}")
    check = _CROSS_CHECKS.get(node.op_type)
    if check:
        problem = check(node, attrs, shape_of)
        if problem:
            raise ContractViolation(f"node {node.name}: {problem}")


def _dim(shape: Shape | None, axis: int) -> int | None:
    """One known dim of a shape (None when the shape, the axis or the dim is unknown)."""
    if shape is None or not -len(shape) <= axis < len(shape):
        return None
    value = shape[axis]
    return value if isinstance(value, int) else None


def _operand(node: onnx.NodeProto, slot: IntEnum, shape_of) -> Shape | None:
    name = input_at(list(node.input), slot)
    return shape_of(name) if name else None


def _attention_checks(node, attrs, shape_of, slots) -> str | None:
    heads, kv_heads, head_dim = attrs["num_heads"], attrs["kv_num_heads"], attrs["head_dim"]
    if heads % kv_heads:
        return f"kv_num_heads {kv_heads} does not divide num_heads {heads}"
    if attrs.get("rotary_dim", 0) > head_dim or attrs.get("rotary_dim", 0) % 2:
        return f"rotary_dim {attrs['rotary_dim']} is odd or larger than head_dim {head_dim}"
    if head_dim % 2 and attrs["rotary_interleaved"]:
        return f"head_dim {head_dim} is odd, rotary_interleaved needs pairs"
    for name in ("alibi_slopes", "sinks"):
        if attrs[name] and len(attrs[name]) != heads:
            return f"{name} has {len(attrs[name])} values for num_heads {heads}"
    packed = input_at(list(node.input), slots.KEY) is None
    if packed != (input_at(list(node.input), slots.VALUE) is None):
        return "key and value are given one without the other"
    query_width = (heads + 2 * kv_heads) * head_dim if packed else heads * head_dim
    widths = [(slots.QUERY, "query", query_width)]
    if not packed:
        widths += [(slots.KEY, "key", kv_heads * head_dim), (slots.VALUE, "value", kv_heads * head_dim)]
    for slot, label, width in widths:
        actual = _dim(_operand(node, slot, shape_of), -1)
        if actual is not None and actual != width:
            return (f"{label} has {actual} columns, num_heads {heads}, kv_num_heads {kv_heads} and head_dim "
                    f"{head_dim} make {width}")
    for slot in (slots.COS, slots.SIN):
        rotary = _dim(_operand(node, slot, shape_of), -1)
        if rotary is not None and rotary > head_dim:
            return f"{slot.name.lower()} has {rotary} columns, more than head_dim {head_dim} takes"
    return None


def _fused_attention_checks(node, attrs, shape_of) -> str | None:
    problem = _attention_checks(node, attrs, shape_of, FusedAttentionInput)
    if problem:
        return problem
    if attrs["alibi_from_mask"] and not (attrs["alibi_slopes"] and input_at(list(node.input),
                                                                           FusedAttentionInput.ATTENTION_MASK)):
        return "alibi_from_mask is set without alibi_slopes and an attention_mask to count positions by"
    for slot in (FusedAttentionInput.PAST_KEY, FusedAttentionInput.PAST_VALUE):
        shape = _operand(node, slot, shape_of)
        for axis, expected, label in ((1, attrs["kv_num_heads"], "kv_num_heads"), (3, attrs["head_dim"], "head_dim")):
            actual = _dim(shape, axis)
            if actual is not None and actual != expected:
                return f"{slot.name.lower()} has {actual} in dim {axis}, {label} is {expected}"
    return None


def _paged_attention_checks(node, attrs, shape_of) -> str | None:
    if attrs["page_size"] % 16:
        return f"page_size {attrs['page_size']} is not a multiple of 16"
    if attrs["flash"] and (attrs["sliding_window"] or attrs["softcap"] or attrs["alibi_slopes"] or attrs["sinks"]):
        return ("flash is set with a sliding_window, a softcap, alibi_slopes or sinks (flash_prefill attends causally, "
                "uncapped, unbiased, sinkless)")
    for slot in (PagedAttentionInput.QUERY_START_LOC, PagedAttentionInput.SEQ_LENS, PagedAttentionInput.BLOCK_TABLES,
                 PagedAttentionInput.SLOT_MAPPING):
        if input_at(list(node.input), slot) != slot.name.lower():
            return f"input {slot.name.lower()} is not the graph's {slot.name.lower()}"
    return _attention_checks(node, attrs, shape_of, PagedAttentionInput)


def _quantized_table_checks(node, attrs, shape_of, columns: int | None, table: IntEnum, scale_slot: IntEnum) -> str | None:
    """The packed weight `[N, ceil(K / block), block·bits/8]` and its scales (MatMulNBits' layout)."""
    blocks = -(-attrs["K"] // attrs["block_size"])
    blob = attrs["block_size"] * attrs["bits"] // 8
    weight = _operand(node, table, shape_of)
    if weight is not None:
        expected = (columns, blocks, blob)
        if len(weight) != 3 or any(isinstance(a, int) and e is not None and a != e for a, e in zip(weight, expected)):
            return (f"the packed weight has shape {list(weight)}, K {attrs['K']}, block_size {attrs['block_size']} "
                    f"and bits {attrs['bits']} make [{columns if columns is not None else 'N'}, {blocks}, {blob}]")
        columns = columns if columns is not None else _dim(weight, 0)
    scales = _operand(node, scale_slot, shape_of)
    if scales is not None and columns is not None and all(isinstance(d, int) for d in scales):
        if int(np.prod(scales)) != columns * blocks:
            return f"the scales hold {int(np.prod(scales))} values, N·ceil(K/block_size) is {columns * blocks}"
    return None


def _float28_checks(node, attrs, shape_of, slots=MatMulF28Input) -> str | None:
    """The packed weight `[ceil(N/16), K, 56]` and its exceptions' panel offsets `[ceil(N/16) + 1]`."""
    panels = -(-attrs["N"] // 16)
    for slot, expected in ((slots.PACKED, (panels, attrs["K"], 56)), (slots.OFFSETS, (panels + 1,))):
        shape = _operand(node, slot, shape_of)
        if shape is not None and (len(shape) != len(expected)
                                  or any(isinstance(a, int) and a != e for a, e in zip(shape, expected))):
            return (f"{slot.name.lower()} has shape {list(shape)}, K {attrs['K']} and N {attrs['N']} make "
                    f"{list(expected)}")
    return None


_CROSS_CHECKS: dict[str, Callable[[onnx.NodeProto, dict, Callable], str | None]] = {
    FUSED_ATTENTION.name: _fused_attention_checks,
    PAGED_ATTENTION.name: _paged_attention_checks,
    MATMUL_INT4.name: lambda node, attrs, shape_of: _quantized_table_checks(
        node, attrs, shape_of, attrs["N"], MatMulQuantInput.B, MatMulQuantInput.SCALES),
    GATHER_INT4.name: lambda node, attrs, shape_of: _quantized_table_checks(
        node, attrs, shape_of, None, GatherInt4Input.TABLE, GatherInt4Input.SCALES),
    MATMUL_F28.name: _float28_checks,
    GATHER_F28.name: lambda node, attrs, shape_of: _float28_checks(node, attrs, shape_of, GatherF28Input),
}
