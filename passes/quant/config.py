"""`QuantConfig`: what weight quantization to do, checked once with ATC error codes.

Built from `cann-llm-quant`'s flags today; the JSON form of `--compress_weight_conf` fills the same object.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from models.data_files import CALIBRATION_TEXT
from passes.quant.math import SUPPORTED_BLOCKS
from runtime.errors import AtcError, invalid_value, not_in_range

METHODS = ("rtn", "awq", "gptq", "awq+gptq", "smooth_quant")
IMPLEMENTED_METHODS = METHODS
HESSIAN_METHODS = ("awq", "gptq", "awq+gptq")  # INT4 only; they see the activations through H = XᵀX
CALIBRATED_METHODS = (*HESSIAN_METHODS, "smooth_quant")
# algorithms listed together in the JSON form run as one method: AWQ's input scaling, then GPTQ
CHAINS = {("awq", "gptq"): "awq+gptq"}
DEFAULT_CALIBRATION_TEXT = str(CALIBRATION_TEXT)
BITS = (4, 8)
QUANT_MODES = {"INT4": 4, "INT8": 8, "W8A8": 8}
ACCURACY_LEVELS = ("auto", "0", "4")
_JSON_KEYS = ("quant_mode", "group_size", "symmetric", "zero_points", "algorithms", "skip_layers", "calibration",
              "accuracy_level", "lm_head_bits", "lm_head_group_size")
ZERO_POINTS = ("integer", "float")
LM_HEAD_BITS = (4, 8)


@dataclass(frozen=True)
class QuantConfig:
    """Weight-only quantization settings."""

    method: str = "rtn"
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    # asymmetric INT4's zero points: "integer" (4-bit, the range widened to hold 0) or "float" (each group
    # spans exactly [min, max], GGUF Q4_1's form; run as integer zero points plus a per-group offset term)
    zero_points: str = "integer"
    skip_layers: tuple[str, ...] = ("lm_head",)
    # lm_head (and the embedding table tied to it), when not skipped: 8-bit blocks by default, because at
    # INT4 SmolLM2's 49k-row head alone cost more perplexity than all its INT4 layers
    # (docs/performance.md#quantization-on-smollm2)
    lm_head_bits: int = 8
    # a 4-bit lm_head's block along the hidden size (None: group_size)
    lm_head_group_size: int | None = None
    act_order: bool = True  # GPTQ in descending Hessian order: far lower perplexity (docs/performance.md#quantization-choices)
    damp: float = 0.01
    calibration_text: str = DEFAULT_CALIBRATION_TEXT
    num_samples: int = 32
    seq_len: int = 512
    accuracy_level: str = "auto"  # MatMulNBits' activation precision: "auto" (per layer, measured), "0", "4"
    activations: str = "float"  # "int8": W8A8, activations quantized per token at run time (SmoothQuant)
    alpha: float = 0.5  # SmoothQuant's migration strength

    @property
    def needs_calibration(self) -> bool:
        return self.method in CALIBRATED_METHODS

    @property
    def head_group_size(self) -> int:
        """A 4-bit lm_head's block along the hidden size."""
        return self.lm_head_group_size or self.group_size

    @property
    def float_zeros(self) -> bool:
        return self.zero_points == "float"

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
        if (self.method == "smooth_quant") != (self.activations == "int8"):
            raise invalid_value(self.method, "quant-method", "smooth_quant goes with quant_mode W8A8, and W8A8 with it.")
        if self.method in HESSIAN_METHODS and self.bits != 4:
            raise invalid_value(self.method, "quant-method", f"{self.method} quantizes INT4 weights only.")
        if not 0.0 <= self.alpha <= 1.0:
            raise invalid_value(self.alpha, "smooth_quant alpha", "alpha must lie in [0, 1].")
        if self.needs_calibration and not os.path.isfile(self.calibration_text):
            raise invalid_value(self.calibration_text, "calibration text_file", "The file is not found.")
        if self.lm_head_bits not in LM_HEAD_BITS:
            raise not_in_range(self.lm_head_bits, "compress_weight_conf lm_head_bits", LM_HEAD_BITS)
        if self.lm_head_group_size is not None and (isinstance(self.lm_head_group_size, bool)
                                                    or self.lm_head_group_size not in SUPPORTED_BLOCKS):
            raise not_in_range(self.lm_head_group_size, "compress_weight_conf lm_head_group_size", SUPPORTED_BLOCKS)
        if str(self.accuracy_level) not in ACCURACY_LEVELS:
            raise not_in_range(self.accuracy_level, "compress_weight_conf accuracy_level", ACCURACY_LEVELS)
        if self.zero_points not in ZERO_POINTS:
            raise not_in_range(self.zero_points, "compress_weight_conf zero_points", ZERO_POINTS)
        if self.float_zeros and (self.bits != 4 or self.symmetric):
            raise invalid_value(self.zero_points, "compress_weight_conf zero_points",
                                "Float zero points apply to asymmetric INT4 only (\"symmetric\": false).")
        if self.num_samples < 1 or self.seq_len < 16:
            raise invalid_value(f"{self.num_samples}x{self.seq_len}", "calibration",
                                "num_samples must be >= 1 and seq_len >= 16.")

    @classmethod
    def from_json(cls, path: str, default_group_size: int = 128) -> "QuantConfig":
        """The seeds' `--compress_weight_conf` JSON: quant_mode, group_size, symmetric, algorithms, skip_layers."""
        try:
            with open(path, encoding="utf-8") as handle:
                document = json.load(handle)
        except ValueError as error:
            raise AtcError("E10032", path, str(error)) from None
        if not isinstance(document, dict):
            raise AtcError("E10032", path, "the top level must be an object")
        unknown = sorted(set(document) - set(_JSON_KEYS))
        if unknown:
            raise invalid_value(", ".join(unknown), "compress_weight_conf", f"Unknown keys; known: {', '.join(_JSON_KEYS)}.")
        mode = document.get("quant_mode", "INT4")
        if mode not in QUANT_MODES:
            raise not_in_range(mode, "compress_weight_conf quant_mode", list(QUANT_MODES))
        algorithms = document.get("algorithms") or [{"name": "smooth_quant" if mode == "W8A8" else "rtn"}]
        if not isinstance(algorithms, list) or not all(isinstance(a, dict) and "name" in a for a in algorithms):
            raise AtcError("E10032", path, "algorithms must be a list of {\"name\": ..., \"params\": {...}}")
        skip = document.get("skip_layers", ["lm_head"])
        if not isinstance(skip, list) or not all(isinstance(p, str) for p in skip):
            raise AtcError("E10032", path, "skip_layers must be a list of names or glob patterns")
        group = document.get("group_size", default_group_size)
        if not isinstance(group, int) or isinstance(group, bool):
            raise not_in_range(group, "compress_weight_conf group_size", SUPPORTED_BLOCKS)
        names = tuple(a["name"] for a in algorithms)
        if len(names) > 1 and names not in CHAINS:
            raise invalid_value(" + ".join(map(str, names)), "compress_weight_conf algorithms",
                                f"Algorithms run alone, or chained as {', '.join(' + '.join(c) for c in CHAINS)}.")
        params = {}
        for algorithm in algorithms:
            if not isinstance(algorithm.get("params") or {}, dict):
                raise AtcError("E10032", path, "params and calibration must be objects")
            params.update(algorithm.get("params") or {})
        calibration = document.get("calibration") or {}
        if not isinstance(calibration, dict):
            raise AtcError("E10032", path, "params and calibration must be objects")
        extra = {"act_order": bool(params.get("act_order", True)), "damp": float(params.get("damp", 0.01)),
                 "accuracy_level": str(document.get("accuracy_level", "auto")),
                 "activations": "int8" if mode == "W8A8" else "float", "alpha": float(params.get("alpha", 0.5)),
                 "num_samples": int(calibration.get("num_samples", 32)), "seq_len": int(calibration.get("seq_len", 512)),
                 "lm_head_bits": document.get("lm_head_bits", 8),
                 "lm_head_group_size": document.get("lm_head_group_size")}
        if "text_file" in calibration:
            extra["calibration_text"] = str(calibration["text_file"])
        return cls(method=CHAINS.get(names, names[0]), bits=QUANT_MODES[mode], group_size=group,
                   symmetric=bool(document.get("symmetric", True)), zero_points=str(document.get("zero_points", "integer")),
                   skip_layers=tuple(skip), **extra)
