"""`QuantConfig`: what weight quantization to do, checked once with ATC error codes.

Built from `--compress_weight_conf`'s JSON (`from_json`), from `cann-llm-quant`'s flags, or given whole
through the Python API. A refusal names the setting as its source spells it: `PARAMETERS` holds the conf's
keys, and cann-llm-quant's subclass its flags.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from typing import ClassVar

from cann_llm.models.data_files import CALIBRATION_TEXT
from cann_llm.passes.quant.math import SUPPORTED_BLOCKS
from cann_llm.runtime.errors import AtcError, invalid_value, not_in_range

METHODS = ("rtn", "awq", "gptq", "awq+gptq", "smooth_quant")
IMPLEMENTED_METHODS = METHODS
HESSIAN_METHODS = ("awq", "gptq", "awq+gptq")  # INT4 only; they see the activations through H = XᵀX
CALIBRATED_METHODS = (*HESSIAN_METHODS, "smooth_quant")
# algorithms listed together in the JSON form run as one method: AWQ's input scaling, then GPTQ
CHAINS = {("awq", "gptq"): "awq+gptq"}
# the "params" each algorithm takes (each the QuantConfig field of that name)
ALGORITHM_PARAMS = {"rtn": (), "awq": (), "gptq": ("act_order", "damp"), "awq+gptq": ("act_order", "damp"),
                    "smooth_quant": ("alpha",)}
DEFAULT_CALIBRATION_TEXT = str(CALIBRATION_TEXT)
BITS = (4, 8)
QUANT_MODES = {"INT4": 4, "INT8": 8, "W8A8": 8}
ACCURACY_LEVELS = ("auto", "0", "4")
_JSON_KEYS = ("quant_mode", "group_size", "symmetric", "zero_points", "algorithms", "skip_layers", "calibration",
              "accuracy_level", "lm_head_bits", "lm_head_group_size")
# the "calibration" object's keys and the fields they set
_CALIBRATION_FIELDS = {"text_file": "calibration_text", "num_samples": "num_samples", "seq_len": "seq_len"}
ZERO_POINTS = ("integer", "float")
LM_HEAD_BITS = (4, 8)
DEFAULT_SEQ_LEN = 512
MIN_SEQ_LEN = 16
# a window's activations include every layer's attention scores, [heads, seq, seq] float32 where onnxruntime
# computes them unfused: quadratic in its length (atc peaks at 0.95 GB for one window of 4096 tokens of the
# tiny 4-head test Llama, and was killed at 22.7 GB for windows of 20000). 4096 is twice the longest window
# of the published recipes (GPTQ's 2048; AWQ's 512)
MAX_SEQ_LEN = 4096
# every calibration token costs a forward pass of the float model, and the staged calibration holds each
# window's hidden states between layers (tokens × hidden size × 4 bytes: 4 GiB at a 7B model's 4096 for
# this many): GPTQ's recipe, 128 windows of 2048 tokens, is the most calibration the published methods use
MAX_CALIBRATION_TOKENS = 128 * 2048
# the conf's keys, as atc's refusals (and the Python API's) name each field
_CONF_KEYS = {"method": "algorithms", "bits": "quant_mode", "activations": "quant_mode", "group_size": "group_size",
              "symmetric": "symmetric", "zero_points": "zero_points", "skip_layers": "skip_layers",
              "lm_head_bits": "lm_head_bits", "lm_head_group_size": "lm_head_group_size",
              "act_order": "params.act_order", "damp": "params.damp", "alpha": "params.alpha",
              "calibration_text": "calibration.text_file", "num_samples": "calibration.num_samples",
              "seq_len": "calibration.seq_len", "accuracy_level": "accuracy_level"}


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text(value: object) -> bool:
    return isinstance(value, str)


def _switch(value: object) -> bool:
    return isinstance(value, bool)


# what each field's value must be, checked before its range: JSON's "false" and 2.7 are not coerced
_KINDS = {"method": (_text, "a string"), "bits": (_whole, "a whole number"), "group_size": (_whole, "a whole number"),
          "symmetric": (_switch, "true or false"), "zero_points": (_text, "a string"),
          "skip_layers": (lambda v: isinstance(v, (tuple, list)) and all(map(_text, v)), "a list of names"),
          "lm_head_bits": (_whole, "a whole number"),
          "lm_head_group_size": (lambda v: v is None or _whole(v), "a whole number"),
          "act_order": (_switch, "true or false"), "damp": (_number, "a number"),
          "calibration_text": (_text, "a file name"), "num_samples": (_whole, "a whole number"),
          "seq_len": (lambda v: v is None or _whole(v), "a whole number"),
          "accuracy_level": (lambda v: _text(v) or _whole(v), '"auto", 0 or 4'), "activations": (_text, "a string"),
          "alpha": (_number, "a number")}


def _shown(value: object) -> object:
    """A value as the refusal quotes it: a string in quotes, so that "false" is not read as false."""
    return json.dumps(value) if isinstance(value, str) else value


@dataclass(frozen=True)
class QuantConfig:
    """Weight-only quantization settings."""

    PARAMETERS: ClassVar[dict[str, str]] = {name: f"compress_weight_conf {key}" for name, key in _CONF_KEYS.items()}

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
    # tokens per calibration window; None: DEFAULT_SEQ_LEN, or fewer where the model reads fewer positions
    seq_len: int | None = None
    # MatMulNBits' activation precision: "auto" (per layer, measured), "0", "4"; W8A8's is always "4"
    accuracy_level: str = "auto"
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

    def parameter(self, name: str) -> str:
        """How a refusal names field `name`: the conf key or the flag that sets it, without the leading --."""
        return self.PARAMETERS[name]

    def __post_init__(self) -> None:
        for field_name, (fits, kind) in _KINDS.items():
            value = getattr(self, field_name)
            if not fits(value):
                raise invalid_value(_shown(value), self.parameter(field_name), f"The value must be {kind}.")
        name = self.parameter
        if self.method not in METHODS:
            raise not_in_range(self.method, name("method"), METHODS)
        if self.method not in IMPLEMENTED_METHODS:
            raise AtcError("E10055", f"quantization method {self.method} is not implemented yet; "
                                     f"available: {', '.join(IMPLEMENTED_METHODS)}")
        if self.bits not in BITS:
            raise not_in_range(self.bits, name("bits"), BITS)
        if self.bits == 4 and self.group_size not in SUPPORTED_BLOCKS:
            raise not_in_range(self.group_size, name("group_size"), SUPPORTED_BLOCKS)
        if (self.method == "smooth_quant") != (self.activations == "int8"):
            raise invalid_value(self.method, name("method"), "smooth_quant goes with quant_mode W8A8, and W8A8 with it.")
        if self.method in HESSIAN_METHODS and self.bits != 4:
            raise invalid_value(self.method, name("method"), f"{self.method} quantizes INT4 weights only.")
        if not 0.0 <= self.alpha <= 1.0:
            raise invalid_value(self.alpha, name("alpha"), "SmoothQuant's alpha must lie in [0, 1].")
        if not 0.0 < self.damp <= 1.0:
            raise invalid_value(self.damp, name("damp"), "GPTQ's damp, the fraction of the Hessian's mean diagonal "
                                                         "added to it, must lie in (0, 1].")
        if not os.path.isfile(self.calibration_text):
            raise invalid_value(self.calibration_text, name("calibration_text"), "The file is not found.")
        if self.lm_head_bits not in LM_HEAD_BITS:
            raise not_in_range(self.lm_head_bits, name("lm_head_bits"), LM_HEAD_BITS)
        if self.lm_head_group_size is not None and self.lm_head_group_size not in SUPPORTED_BLOCKS:
            raise not_in_range(self.lm_head_group_size, name("lm_head_group_size"), SUPPORTED_BLOCKS)
        self._resolve_accuracy_level()
        if self.zero_points not in ZERO_POINTS:
            raise not_in_range(self.zero_points, name("zero_points"), ZERO_POINTS)
        if self.float_zeros and (self.bits != 4 or self.symmetric):
            raise invalid_value(self.zero_points, name("zero_points"),
                                "Float zero points apply to asymmetric INT4 only (\"symmetric\": false).")
        self._check_calibration_size()

    def _resolve_accuracy_level(self) -> None:
        """The level as a string ("0" for 0); W8A8's "auto" as the "4" every one of its MatMuls runs at, so
        that the artifact's metadata records it, and any other level refused."""
        level = str(self.accuracy_level)
        if level not in ACCURACY_LEVELS:
            raise not_in_range(_shown(self.accuracy_level), self.parameter("accuracy_level"), ACCURACY_LEVELS)
        if self.activations == "int8":
            if level == "0":
                raise invalid_value(self.accuracy_level, self.parameter("accuracy_level"),
                                    "W8A8 quantizes the activations to int8, which is accuracy_level 4 (or auto).")
            level = "4"
        object.__setattr__(self, "accuracy_level", level)

    def _check_calibration_size(self) -> None:
        if self.num_samples < 1:
            raise invalid_value(self.num_samples, self.parameter("num_samples"), "The value must be at least 1.")
        if self.seq_len is not None and not MIN_SEQ_LEN <= self.seq_len <= MAX_SEQ_LEN:
            raise invalid_value(self.seq_len, self.parameter("seq_len"),
                                f"A calibration window holds {MIN_SEQ_LEN} to {MAX_SEQ_LEN} tokens: its attention's "
                                f"memory grows with the square of its length.")
        window = self.seq_len or DEFAULT_SEQ_LEN
        if self.num_samples * window > MAX_CALIBRATION_TOKENS:
            raise invalid_value(self.num_samples, self.parameter("num_samples"),
                                f"{self.num_samples} windows of {window} tokens are {self.num_samples * window} "
                                f"tokens; calibration takes at most {MAX_CALIBRATION_TOKENS} (GPTQ's 128 windows "
                                f"of 2048), each a forward pass of the float model.")

    @classmethod
    def from_json(cls, path: str, default_group_size: int = 128) -> "QuantConfig":
        """`--compress_weight_conf`'s JSON (docs/quantization.md#in-atc): E10032 for a file that does not parse
        or has the wrong shape, E10001 for an unknown key (with the one it likely meant) or a bad value."""
        document = _read_object(path)
        _refuse_unknown(document, _JSON_KEYS, "compress_weight_conf")
        mode = document.get("quant_mode", "INT4")
        if not isinstance(mode, str) or mode not in QUANT_MODES:
            raise not_in_range(_shown(mode), "compress_weight_conf quant_mode", list(QUANT_MODES))
        names, params = _algorithms(path, document.get("algorithms", [{"name": "smooth_quant" if mode == "W8A8"
                                                                       else "rtn"}]))
        calibration = document.get("calibration", {})
        if not isinstance(calibration, dict):
            raise AtcError("E10032", path, "calibration must be an object")
        _refuse_unknown(calibration, tuple(_CALIBRATION_FIELDS), "compress_weight_conf calibration")
        skip = document.get("skip_layers", ["lm_head"])
        if not isinstance(skip, list) or not all(isinstance(p, str) for p in skip):
            raise AtcError("E10032", path, "skip_layers must be a list of names or glob patterns")
        return cls(method=CHAINS.get(names, names[0]), bits=QUANT_MODES[mode],
                   activations="int8" if mode == "W8A8" else "float",
                   group_size=document.get("group_size", default_group_size),
                   symmetric=document.get("symmetric", True), zero_points=document.get("zero_points", "integer"),
                   skip_layers=tuple(skip), accuracy_level=document.get("accuracy_level", "auto"),
                   lm_head_bits=document.get("lm_head_bits", 8), lm_head_group_size=document.get("lm_head_group_size"),
                   **params, **{_CALIBRATION_FIELDS[key]: value for key, value in calibration.items()})


def _read_object(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
    except ValueError as error:  # not JSON, or not UTF-8
        raise AtcError("E10032", path, str(error)) from None
    except OSError as error:
        raise AtcError("E13001", path, error.strerror or str(error)) from None
    if not isinstance(document, dict):
        raise AtcError("E10032", path, "the top level must be an object")
    return document


def _algorithms(path: str, algorithms: object) -> tuple[tuple[str, ...], dict]:
    """The conf's algorithm names and their params (one dict: a chain's algorithms take different ones)."""
    if not isinstance(algorithms, list) or not all(isinstance(a, dict) and "name" in a for a in algorithms):
        raise AtcError("E10032", path, "algorithms must be a list of {\"name\": ..., \"params\": {...}}")
    if not algorithms:
        raise invalid_value("[]", "compress_weight_conf algorithms",
                            "List one algorithm, or awq then gptq; leave the key out for the default.")
    params: dict = {}
    for at, algorithm in enumerate(algorithms):
        where = f"compress_weight_conf algorithms[{at}]"
        _refuse_unknown(algorithm, ("name", "params"), where)
        name = algorithm["name"]
        if not isinstance(name, str) or name not in METHODS:
            raise not_in_range(_shown(name), f"{where}.name", METHODS)
        given = algorithm.get("params", {})
        if not isinstance(given, dict):
            raise AtcError("E10032", path, "params must be an object")
        _refuse_unknown(given, ALGORITHM_PARAMS[name], f"{where}.params")
        params.update(given)
    names = tuple(a["name"] for a in algorithms)
    if len(names) > 1 and names not in CHAINS:
        raise invalid_value(" + ".join(names), "compress_weight_conf algorithms",
                            f"Algorithms run alone, or chained as {', '.join(' + '.join(c) for c in CHAINS)}.")
    return names, params


def _refuse_unknown(mapping: dict, known: tuple[str, ...], parameter: str) -> None:
    """E10001 naming the keys of `mapping` not in `known`, and the known key each most likely meant."""
    unknown = [key for key in mapping if key not in known]
    if not unknown:
        return
    reason = f"Unknown key{'s' * (len(unknown) > 1)}; " + (f"known: {', '.join(known)}." if known else
                                                          "it takes none.")
    meant = [f"'{close[0]}' for '{key}'" for key in unknown
             for close in [difflib.get_close_matches(key, known, n=1)] if close]
    if meant:
        reason += f" Did you mean {', '.join(meant)}?"
    raise invalid_value(", ".join(unknown), parameter, reason)
