"""What a `.om`'s metadata partition must hold before anything reads it, as a table of typed fields.

`check_metadata` walks the schema and raises `SchemaViolation` naming the first field that is missing, of
the wrong type or out of range (`metadata.kv_cache.page_size: -16 is outside [16, 512]`). Fields the
runtime never reads (the pass report, the command line) are only required to be of their JSON type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cann_llm.runtime.ops import MAX_DIM, MAX_HEAD_DIM, MAX_HEADS, PAGE_SIZE_RANGE


class SchemaViolation(ValueError):
    """Metadata that breaks the schema; the message starts with the field's path."""


@dataclass(frozen=True)
class Int:
    low: int = 0
    high: int = MAX_DIM

    def check(self, value, where: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaViolation(f"{where}: {value!r} is not an integer")
        if not self.low <= value <= self.high:
            raise SchemaViolation(f"{where}: {value} is outside [{self.low}, {self.high}]")


@dataclass(frozen=True)
class Of:
    """A value of one JSON type (str, bool, dict, list), or one of `choices`."""

    kind: type | tuple
    choices: tuple = ()

    def check(self, value, where: str) -> None:
        if not isinstance(value, self.kind) or (self.kind is not bool and isinstance(value, bool)):
            names = " or ".join(k.__name__ for k in (self.kind if isinstance(self.kind, tuple) else (self.kind,)))
            raise SchemaViolation(f"{where}: {value!r} is not a {names}")
        if self.choices and value not in self.choices:
            raise SchemaViolation(f"{where}: {value!r} is not one of {', '.join(map(repr, self.choices))}")


@dataclass(frozen=True)
class DType:
    """A numpy dtype name as the signature spells it (`float32`)."""

    def check(self, value, where: str) -> None:
        Of(str).check(value, where)
        try:
            dtype = np.dtype(value)
        except (TypeError, ValueError):  # lone surrogates make a UnicodeEncodeError, a ValueError
            raise SchemaViolation(f"{where}: {value!r} is not a dtype") from None
        if dtype.kind not in "biuf":
            raise SchemaViolation(f"{where}: {value!r} is not a tensor dtype")


@dataclass(frozen=True)
class Dim:
    """A dim of a signature shape: an int (-1: unknown and unnamed) or a symbolic name."""

    def check(self, value, where: str) -> None:
        if isinstance(value, str):
            return
        Int(-1).check(value, where)


@dataclass(frozen=True)
class ListOf:
    item: Any
    most: int = 1 << 20

    def check(self, value, where: str) -> None:
        Of(list).check(value, where)
        if len(value) > self.most:
            raise SchemaViolation(f"{where}: {len(value)} items, more than {self.most}")
        for index, item in enumerate(value):
            self.item.check(item, f"{where}[{index}]")


@dataclass(frozen=True)
class MapOf:
    """A JSON object of any keys, each value held to `value`."""

    value: Any

    def check(self, value, where: str) -> None:
        Of(dict).check(value, where)
        for name, item in value.items():
            self.value.check(item, f"{where}.{name}")


@dataclass(frozen=True)
class Obj:
    """A JSON object: `required` and `optional` fields by name; others are allowed (metadata grows)."""

    required: dict = field(default_factory=dict)
    optional: dict = field(default_factory=dict)

    def check(self, value, where: str) -> None:
        Of(dict).check(value, where)
        for name, spec in self.required.items():
            if name not in value:
                raise SchemaViolation(f"{where}.{name}: missing")
            spec.check(value[name], f"{where}.{name}")
        for name, spec in self.optional.items():
            if name in value:
                spec.check(value[name], f"{where}.{name}")


_VALUE = Obj(required={"name": Of(str), "dtype": DType(), "shape": ListOf(Dim(), most=64)})
_HEADS = Int(1, MAX_HEADS)
_WEIGHT_FORMAT = {"format": Of(str)}, {"block_size": Int(1), "int8_activations": Of(bool)}
# per CPU architecture, groups of features one of which must (required) or should (preferred) be present
_FEATURE_GROUPS = MapOf(ListOf(ListOf(Of(str))))

METADATA = Obj(
    required={
        "signature": Obj(required={"inputs": ListOf(_VALUE), "outputs": ListOf(_VALUE)}),
    },
    optional={
        # absent: contiguous (cann_llm/runtime/loader.py's LoadedModel.kv_cache)
        "kv_cache": Obj(required={"layout": Of(str, ("contiguous", "paged"))},
                        optional={"page_size": Int(*PAGE_SIZE_RANGE)}),
        "name": Of(str), "atc_version": Of(str), "soc_version": Of(str), "framework_type": Int(0, 255),
        "cmdline": Of(str), "config": Of(dict), "is_dynamic": Of(bool), "source": Of(dict), "pass_report": Of(dict),
        "requires": Obj(optional={"runtime": Of(str), "soc_family": Of(str), "onnxruntime": Of(str),
                                  "isa": Obj(optional={"required": _FEATURE_GROUPS, "preferred": _FEATURE_GROUPS})}),
        "weights": Obj(required={"matmuls": ListOf(Obj(required={**_WEIGHT_FORMAT[0], "count": Int(0)},
                                                        optional=_WEIGHT_FORMAT[1]))},
                       optional={"embedding": Obj(required=_WEIGHT_FORMAT[0], optional=_WEIGHT_FORMAT[1])}),
        "model": Obj(optional={
            "vocab_size": Int(1), "kv_cache_io": Of(bool), "num_layers": Int(1, MAX_HEADS), "num_heads": _HEADS,
            "num_kv_heads": _HEADS, "head_dim": Int(1, MAX_HEAD_DIM), "family": Of((str, type(None))),
            "detected_family": Of((str, type(None))), "max_positions": Int(1), "rotary_switch_length": Int(1),
            "layer_kv": ListOf(ListOf(Int(1, MAX_HEAD_DIM), most=2), most=MAX_HEADS),
            "recurrent_layers": Int(1, MAX_HEADS),
        }),
    },
)


def check_metadata(metadata: Any) -> None:
    """Hold the parsed metadata partition to METADATA and to its own consistency; raises SchemaViolation."""
    METADATA.check(metadata, "metadata")
    kv_cache = metadata.get("kv_cache", {"layout": "contiguous"})
    if kv_cache["layout"] == "paged":
        if "page_size" not in kv_cache:
            raise SchemaViolation("metadata.kv_cache.page_size: missing for the paged layout")
        if kv_cache["page_size"] % 16:
            raise SchemaViolation(f"metadata.kv_cache.page_size: {kv_cache['page_size']} is not a multiple of 16")
        for name in ("num_layers", "num_kv_heads", "head_dim", "vocab_size"):
            if name not in metadata.get("model", {}):
                raise SchemaViolation(f"metadata.model.{name}: missing for the paged layout")
    model = metadata.get("model", {})
    if "num_heads" in model and "num_kv_heads" in model and model["num_heads"] % model["num_kv_heads"]:
        raise SchemaViolation(f"metadata.model.num_kv_heads: {model['num_kv_heads']} does not divide "
                              f"num_heads {model['num_heads']}")
    for index, sizes in enumerate(model.get("layer_kv", [])):
        if len(sizes) != 2 or ("num_heads" in model and model["num_heads"] % sizes[0]):
            raise SchemaViolation(f"metadata.model.layer_kv[{index}]: {sizes} is not [KV heads dividing num_heads, "
                                  f"head size]")
    for side in ("inputs", "outputs"):
        names = [value["name"] for value in metadata["signature"][side]]
        if len(set(names)) != len(names):
            raise SchemaViolation(f"metadata.signature.{side}: a name appears twice")
