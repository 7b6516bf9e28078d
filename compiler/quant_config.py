"""`QuantConfig`: what weight quantization to do, checked once with ATC error codes.

Built from `cann-llm-quant`'s flags today; the JSON form of `--compress_weight_conf` fills the same object.
"""

from __future__ import annotations

from dataclasses import dataclass

from compiler.errors import AtcError, not_in_range
from passes.quant_math import SUPPORTED_BLOCKS

METHODS = ("rtn", "awq", "gptq", "smooth_quant")
IMPLEMENTED_METHODS = ("rtn",)
BITS = (4, 8)


@dataclass(frozen=True)
class QuantConfig:
    """Weight-only quantization settings."""

    method: str = "rtn"
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    skip_layers: tuple[str, ...] = ("lm_head",)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise not_in_range(self.method, "quant-method", METHODS)
        if self.method not in IMPLEMENTED_METHODS:
            raise AtcError("E10055", f"quantization method {self.method} is not implemented yet; "
                                     f"available: {', '.join(IMPLEMENTED_METHODS)}")
        if self.bits not in BITS:
            raise not_in_range(self.bits, "bits", BITS)
        if self.bits == 4 and self.group_size not in SUPPORTED_BLOCKS:
            raise not_in_range(self.group_size, "group-size", SUPPORTED_BLOCKS)
