"""The `cann` operator set's contract in one place: each op's name, input and output slots, attribute
defaults, and the attention metadata a paged step feeds (docs/ops.md is the prose of the same contract).

The compiler's passes write these ops and the runtime's lowerings and kernels read them; both name an
input by its slot here (`FusedAttentionInput.PAST_KEY`), never by a number of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from types import MappingProxyType
from typing import Any, Mapping, Sequence, TypeVar

import numpy as np
import onnx
from onnx import helper

CUSTOM_DOMAIN = "cann"


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


class GatherInt4Input(IntEnum):
    TABLE = 0
    INDICES = 1
    SCALES = 2


class SingleOutput(IntEnum):
    Y = 0


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
FUSED_ATTENTION = Op("FusedAttention", FusedAttentionInput, FusedAttentionOutput, defaults={
    "causal": 1, "rotary_dim": 0, "rotary_interleaved": 0, "bias_per_head": 0, "bias_is_bool": 0,
    "sliding_window": 0})
# always causal; `layer` picks the pool's layer, `flash` sends long prompt chunks through flash_prefill
PAGED_ATTENTION = Op("PagedAttention", PagedAttentionInput, defaults={
    "rotary_interleaved": 0, "sliding_window": 0, "flash": 0})
MATMUL_INT4 = Op("MatMulInt4", MatMulQuantInput, defaults={"bits": 4, "accuracy_level": 0})
MATMUL_INT8 = Op("MatMulInt8", MatMulQuantInput)
GATHER_INT4 = Op("GatherInt4", GatherInt4Input, defaults={"bits": 4})

OPS: dict[str, Op] = {op.name: op for op in (RMS_NORM, ADD_RMS_NORM, SWIGLU, MOE, FUSED_ATTENTION, PAGED_ATTENTION,
                                             MATMUL_INT4, MATMUL_INT8, GATHER_INT4)}
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



def paged_metadata_feeds(query_start_loc, seq_lens, block_tables, slot_mapping) -> dict[str, np.ndarray]:
    """A paged step's metadata as the graph's feeds, by name and in the contract's dtypes."""
    values = dict(zip((m.slot for m in PAGED_METADATA), (query_start_loc, seq_lens, block_tables, slot_mapping)))
    return {m.name: np.asarray(values[m.slot], m.dtype) for m in PAGED_METADATA}


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
