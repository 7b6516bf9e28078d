"""`CompileConfig`: atc's flags as given, and the settings the compiler resolves from them.

`CompileConfig.from_flags(**strings)` turns command-line strings into typed flags with ATC's error codes;
constructing `CompileConfig(...)` directly (the Python API) takes the same flags. `__post_init__` checks them
and resolves the settings the compiler reads (`paging`, `quantization`, `precision`, `fusion_switches`); the
flags themselves are kept as given and nothing past this module reads the ones a setting was resolved from.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from cann_llm.compiler.dynamic_shapes import Dim, gears, parse_batch_sizes, parse_dims, parse_shape_ranges
from cann_llm.compiler.fusion_switch import parse_fusion_switch_file, parse_switch_list, read_mixlist
from cann_llm.compiler.inapplicable_flags import NOT_APPLICABLE, REFUSED, check_inapplicable, warning
from cann_llm.compiler.model_checks import MAX_DIM
from cann_llm.compiler.paged_config import PagedConfig
from cann_llm.compiler.soc import SOC_VERSIONS, SocProfile
from cann_llm.passes.precision_config import PrecisionPolicy
from cann_llm.passes.quant.config import QuantConfig
from cann_llm.runtime.errors import AtcError, invalid_value, not_in_range

# every flag that takes a path; checked for what the system takes (PATH_MAX, NAME_MAX; --output's name gets `.om`)
_PATH_FLAGS = ("model", "output", "om", "json", "check_report", "tokenizer", "keep_dtype", "fusion_switch_file",
               "paged_config", "compress_weight_conf", "modify_mixlist")
_PATH_MAX, _NAME_MAX = 4096, 255
MODES = {0: "model to framework model", 1: "framework model to json", 3: "only pre-check",
         5: "pbtxt to json", 6: "display model info", 7: "convert a model to the OM2 format",
         30: "execute-om for nano"}
IMPLEMENTED_MODES = (0, 1, 3, 6)
FRAMEWORKS = {0: "Caffe", 1: "MindSpore", 3: "TensorFlow", 5: "Onnx"}
LOG_LEVELS = ("debug", "info", "warning", "error", "null")
PRECISION_MODES = ("force_fp16", "force_fp32", "cube_fp16in_fp32out", "allow_mix_precision", "allow_fp32_to_fp16",
                   "must_keep_origin_dtype", "allow_mix_precision_fp16", "allow_mix_precision_bf16",
                   "allow_fp32_to_bf16")
INPUT_FORMATS = ("NCHW", "ND", "NCDHW")
KV_CACHE_LAYOUTS = ("contiguous", "paged")
# --precision_mode_v2's names for the --precision_mode it means here; the HiFloat8 modes have no CPU form
PRECISION_MODES_V2 = {"fp16": "force_fp16", "origin": "must_keep_origin_dtype",
                      "cube_fp16in_fp32out": "cube_fp16in_fp32out", "mixed_float16": "allow_mix_precision_fp16",
                      "mixed_bfloat16": "allow_mix_precision_bf16", "cube_hif8": None, "mixed_hif8": None}
MIXED_MODES = ("allow_mix_precision", "allow_mix_precision_fp16", "allow_mix_precision_bf16")
OO_LEVELS = ("O1", "O3")
AUTO_TUNE_MODES = ("RL", "GA", "RL,GA", "GA,RL")  # ATC's values; any of them runs the measured search here
OUTPUT_TYPES = ("FP32", "FP16", "UINT8", "INT8")
MODEL_TYPES = ("llama", "glm", "qwen", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "baichuan", "internlm", "mistral", "phi3",
               "gemma", "gpt2")
_TRUE = ("1", "t", "true", "y", "yes")
_FALSE = ("0", "f", "false", "n", "no")



@dataclass(frozen=True)
class CompileConfig:
    """atc's flags (ATC's names, as given) and the settings resolved from them, checked with ATC's codes."""

    # ---- the flags, as given ------------------------------------------------------------------------
    mode: int = 0
    model: str = ""
    framework: int | None = None
    output: str = ""
    soc_version: str = ""
    input_shape: dict[str, tuple[Dim, ...]] = field(default_factory=dict)
    input_shape_range: dict[str, tuple[Dim, ...]] = field(default_factory=dict)  # deprecated in ATC: "~" in input_shape
    dynamic_batch_size: tuple[int, ...] = ()
    dynamic_dims: tuple[tuple[int, ...], ...] = ()
    input_format: str = "NCHW"
    precision_mode: str = ""  # "": not given (must_keep_origin_dtype, unless --precision_mode_v2 says otherwise)
    precision_mode_v2: str = ""
    modify_mixlist: str = ""
    keep_dtype: str = ""
    fusion_switch_file: str = ""
    optimization_switch: str = ""
    oo_level: str = "O3"
    output_type: str = ""
    export_compile_stat: int = 1
    out_nodes: tuple[str, ...] = ()
    log: str = "null"
    om: str = ""
    json: str = ""
    check_report: str = ""  # "": check_result.json in $ASCEND_WORK_PATH if set, else here (ATC's default)
    display_model_info: bool = False
    enable_flash_attention: bool = False
    enable_paged_attention: bool | None = None  # None: not given, paged only if --kv_cache_layout=paged
    kv_cache_layout: str = ""
    paged_config: str = ""
    large_model_compilation: bool = False
    enable_compress_weight: bool | None = None  # None: not given (--compress_weight_conf alone turns it on, as in ATC)
    compress_weight_conf: str = ""
    compress_fp32_weight: bool = False  # float32 MatMul weights in 28 bits each, losslessly (MatMulF28)
    auto_tune_mode: str = ""
    tokenizer: str = ""
    model_type: str = ""
    keep_layers: int = 0  # 0: every layer; N: the first N and the head (a draft model)
    # 0 or 1: one artifact; K: K artifacts of contiguous layer ranges (cann_llm/runtime/engine/pipeline.py)
    pipeline_stages: int = 0
    cmdline: str = ""
    # ATC's flags that do nothing on this target (cann_llm/compiler/inapplicable_flags.py), as given: each warns W10003
    inapplicable: dict[str, str] = field(default_factory=dict)
    # the Python API may give the quantization settings themselves instead of --compress_weight_conf
    quantization: QuantConfig | None = field(default=None, compare=False)

    # ---- resolved from the flags; the compiler reads these ------------------------------------------
    paging: PagedConfig | None = field(init=False, compare=False)  # THE paging decision: None is contiguous
    input_shapes: dict[str, tuple[Dim, ...]] = field(init=False, compare=False)  # --input_shape or its old range form
    gears: tuple[dict[str, tuple[int, ...]], ...] = field(init=False, compare=False)  # one shape per named input each
    precision: PrecisionPolicy = field(init=False, compare=False)
    fusion_switches: dict[str, bool] = field(init=False, compare=False)
    warnings: tuple[str, ...] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        self._type_flags()
        for name, raw in self.inapplicable.items():
            check_inapplicable(name, raw)
        self._check_choices()
        self._check_required()
        self._check_paths()
        self._check_files()
        object.__setattr__(self, "paging", self._resolve_paging())
        object.__setattr__(self, "input_shapes", self._resolve_input_shapes())
        object.__setattr__(self, "gears", gears(self.input_shapes, self.dynamic_batch_size, self.dynamic_dims))
        if self.pipeline_stages > 1 and self.paging is None:
            raise AtcError("E10055", "--pipeline_stages splits a paged model (each stage keeps its layers' pages); "
                                     "add --enable_paged_attention=1")
        if self.pipeline_stages > 1 and self.auto_tune_mode:
            raise AtcError("E10047", "pipeline_stages", "auto_tune_mode")
        if self.gears and self.paging is not None:
            raise AtcError("E10055", "gears with a paged KV cache: a paged model's batch is its flattened tokens, sized "
                                     "at run time by the engine; compile gears without --enable_paged_attention")
        if self.dynamic_dims and self.input_format != "ND":
            raise invalid_value(self.input_format, "input_format", "--dynamic_dims needs --input_format=ND.")
        object.__setattr__(self, "precision", self._resolve_precision())
        object.__setattr__(self, "fusion_switches", self._resolve_switches())
        object.__setattr__(self, "quantization", self._resolve_quantization())
        object.__setattr__(self, "warnings", self._warnings())

    @classmethod
    def from_flags(cls, **flags: str | None) -> "CompileConfig":
        """Build from the command line's strings; missing flags keep their defaults."""
        known = {f.name for f in fields(cls) if f.init}
        values: dict[str, object] = {}
        inapplicable: dict[str, str] = {}
        for name, raw in flags.items():
            if raw is None:
                continue
            if name in NOT_APPLICABLE or name in REFUSED:
                inapplicable[name] = raw
            elif name in known:
                values[name] = _convert(name, raw)
        return cls(**values, inapplicable=inapplicable)

    @property
    def soc(self) -> SocProfile:
        """The target profile `--soc_version` names."""
        return SOC_VERSIONS[self.soc_version]

    @property
    def check_report_path(self) -> str:
        """`--check_report`, or ATC's default: check_result.json in $ASCEND_WORK_PATH if set, else here (read
        where it is used, so that the environment never reaches an artifact's recorded flags)."""
        return self.check_report or os.path.join(os.environ.get("ASCEND_WORK_PATH", ""), "check_result.json")

    @property
    def output_path(self) -> Path:
        """`--output` with ATC's `.om` suffix appended."""
        return Path(self.output + ".om")

    def effective(self) -> dict:
        """The flags and resolved settings as the compiler used them, for the artifact's metadata.

        Paging is left out: the metadata's `kv_cache` section (cann_llm/compiler/graph_metadata.py) is its one record."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_IN_METADATA}
        out["quantization"] = asdict(self.quantization) if self.quantization else None
        out["precision"] = asdict(self.precision)
        for name in ("input_shape", "input_shape_range"):
            out[name] = {k: [list(d) if isinstance(d, tuple) else d for d in v] for k, v in getattr(self, name).items()}
        return out

    def _resolve_input_shapes(self) -> dict[str, tuple[Dim, ...]]:
        if self.input_shape_range and (self.dynamic_batch_size or self.dynamic_dims):
            raise AtcError("E10009")
        if self.input_shape_range and self.input_shape:
            raise AtcError("E10047", "input_shape", "input_shape_range")
        return dict(self.input_shape_range or self.input_shape)

    def _resolve_precision(self) -> PrecisionPolicy:
        if self.precision_mode and self.precision_mode_v2:
            raise AtcError("E10047", "precision_mode", "precision_mode_v2")
        mode = PRECISION_MODES_V2[self.precision_mode_v2] if self.precision_mode_v2 else self.precision_mode
        if self.precision_mode_v2 and mode is None:
            raise AtcError("E10055", f"--precision_mode_v2={self.precision_mode_v2}: HiFloat8 is an Ascend 950 format "
                                     "with no CPU counterpart")
        mode = mode or "must_keep_origin_dtype"
        policy = PrecisionPolicy.of(mode, self.keep_dtype)
        if self.modify_mixlist:
            if mode not in MIXED_MODES:
                raise invalid_value(self.modify_mixlist, "modify_mixlist", "--modify_mixlist applies only to the mixed "
                                    "precision modes (allow_mix_precision*, mixed_float16, mixed_bfloat16).")
            policy = replace(policy, keep_op_types=policy.keep_op_types + read_mixlist(self.modify_mixlist))
        return policy

    def _resolve_switches(self) -> dict[str, bool]:
        # O1 is ATC's basic optimisation level: the switchable fusions off, the passes a layout needs still run
        switches: dict[str, bool] = {"ALL": False} if self.oo_level == "O1" else {}
        if self.fusion_switch_file:
            switches.update(parse_fusion_switch_file(self.fusion_switch_file))
        if self.optimization_switch:
            switches.update(parse_switch_list(self.optimization_switch))
        return switches

    def _resolve_paging(self) -> PagedConfig | None:
        paged, layout = self.enable_paged_attention, self.kv_cache_layout
        if paged is False and layout == "paged":
            raise invalid_value(layout, "kv_cache_layout", "A paged KV cache needs --enable_paged_attention=1.")
        if paged and layout == "contiguous":
            raise invalid_value(layout, "kv_cache_layout", "--enable_paged_attention=1 needs --kv_cache_layout=paged.")
        if not (paged or layout == "paged"):
            return None
        page_size = self.soc.page_size if self.soc_version else PagedConfig.page_size
        return PagedConfig.from_json(self.paged_config, page_size) if self.paged_config else PagedConfig(page_size)

    def _resolve_quantization(self) -> QuantConfig | None:
        if self.quantization is not None or not (self.enable_compress_weight or self.compress_weight_conf):
            return self.quantization
        group = self.soc.quant_group_size if self.soc_version else 128
        if self.compress_weight_conf:
            return QuantConfig.from_json(self.compress_weight_conf, group)
        return QuantConfig(group_size=group)

    def _warnings(self) -> tuple[str, ...]:
        warnings = []
        if self.enable_flash_attention and self.paging is None:
            warnings.append("W10002: --enable_flash_attention applies to paged attention (--enable_paged_attention=1); "
                            "a contiguous cache is lowered to onnxruntime's standard ops. Ignored.")
        if self.input_shape_range:
            warnings.append("W10004: --input_shape_range is deprecated in ATC; write the ranges in --input_shape "
                            "(\"input_ids:1~8,-1\"). Applied as given.")
        if self.enable_compress_weight is False and self.compress_weight_conf:
            warnings.append("W10010: --enable_compress_weight=false does not turn off --compress_weight_conf, which "
                            "turns weight compression on by itself as in ATC: the weights are quantized as it says.")
        warnings += filter(None, (warning(name, raw) for name, raw in self.inapplicable.items()))
        return tuple(warnings)

    def _type_flags(self) -> None:
        """The integer and switch flags as their types when given from Python: a string as atc's command line
        reads it ("0", "1", "true"), 0 or 1 for a switch; ATC's codes for anything else."""
        for name in (*_INT_FLAGS, *_BOOL_FLAGS, *_BOOL_FLAGS_01):
            value = getattr(self, name)
            if isinstance(value, str):
                value = _convert(name, value)
            elif name in _INT_FLAGS and value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                value = _convert(name, repr(value))  # refused with the flag's code
            elif name not in _INT_FLAGS and value is not None and not isinstance(value, bool):
                if value not in (0, 1) or isinstance(value, float):
                    raise AtcError("E10005" if name in _BOOL_FLAGS else "E10006", repr(value), name)
                value = bool(value)
            object.__setattr__(self, name, value)

    def _check_choices(self) -> None:
        if self.mode not in MODES:
            raise not_in_range(self.mode, "mode", sorted(MODES))
        if self.mode not in IMPLEMENTED_MODES:
            raise AtcError("E10055", f"--mode={self.mode} ({MODES[self.mode]}) is not implemented; "
                           f"supported modes are {', '.join(map(str, IMPLEMENTED_MODES))}")
        if self.framework is not None and self.framework not in FRAMEWORKS:
            raise AtcError("E10007", "framework", "0(Caffe) or 1(MindSpore) or 3(TensorFlow) or 5(Onnx)")
        if self.framework is not None and self.framework != 5:
            raise AtcError("E10055", f"--framework={self.framework} ({FRAMEWORKS[self.framework]}) is not supported; "
                           "only ONNX models (--framework=5) can be compiled")
        if self.log not in LOG_LEVELS:
            raise AtcError("E10010", self.log)
        for flag, value, allowed in (("precision_mode", self.precision_mode, ("", *PRECISION_MODES)),
                                     ("precision_mode_v2", self.precision_mode_v2, ("", *PRECISION_MODES_V2)),
                                     ("input_format", self.input_format, INPUT_FORMATS),
                                     ("oo_level", self.oo_level, OO_LEVELS),
                                     ("export_compile_stat", self.export_compile_stat, (0, 1, 2))):
            if value not in allowed:
                allowed = [choice for choice in allowed if choice != ""]
                raise not_in_range(value, flag, allowed)
        parse_output_type(self.output_type)  # its errors, before any work
        if self.kv_cache_layout and self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise not_in_range(self.kv_cache_layout, "kv_cache_layout", KV_CACHE_LAYOUTS)
        if self.model_type and self.model_type not in MODEL_TYPES:
            raise not_in_range(self.model_type, "model_type", MODEL_TYPES)
        if self.auto_tune_mode and self.auto_tune_mode.replace(" ", "") not in AUTO_TUNE_MODES:
            raise not_in_range(self.auto_tune_mode, "auto_tune_mode", AUTO_TUNE_MODES)
        if self.keep_layers < 0:
            raise invalid_value(self.keep_layers, "keep_layers", "The number of layers to keep must be at least 1.")
        if self.pipeline_stages < 0:
            raise invalid_value(self.pipeline_stages, "pipeline_stages",
                                "The number of stages must be 0 (one artifact) or at least 2.")
        if self.soc_version and self.soc_version not in SOC_VERSIONS:
            raise not_in_range(self.soc_version, "soc_version", sorted(SOC_VERSIONS))

    def _check_required(self) -> None:
        required = {0: ("model", "output", "soc_version"), 1: ("om", "json"), 3: ("model", "soc_version"),
                    6: ("om",)}[self.mode]
        if self.mode in (0, 3) and self.framework is None:
            raise AtcError("E10007", "framework", "0(Caffe) or 1(MindSpore) or 3(TensorFlow) or 5(Onnx)")
        for name in required:
            if not getattr(self, name):
                raise AtcError("E10054", f"--{name}")

    def _check_paths(self) -> None:
        """ATC's E10021 for a path the system could not take (before any work, where it would have been an OS
        error at the end), and E10022 for an --output that names a folder and no file (`--output=$DIR/`
        with an empty name would have written a hidden `.om`)."""
        written = {"output": str(self.output_path) if self.output else "", "check_report": self.check_report_path}
        for flag in _PATH_FLAGS:
            path = written.get(flag, getattr(self, flag))
            if path and (len(os.fsencode(path)) >= _PATH_MAX or
                         any(len(os.fsencode(part)) > _NAME_MAX for part in Path(path).parts)):
                raise AtcError("E10021", flag, f"{_PATH_MAX - 1} bytes, and {_NAME_MAX} for each name in it"
                                               + (" (the file's with .om)" if flag == "output" else ""))
        if self.output and os.path.basename(self.output) in ("", ".", ".."):
            raise AtcError("E10022", self.output, "output")

    def _check_files(self) -> None:
        for flag in ("keep_dtype", "fusion_switch_file", "paged_config", "compress_weight_conf", "modify_mixlist"):
            path = getattr(self, flag)
            if path and not os.path.isfile(path):
                raise invalid_value(path, flag, f"File defined by {flag} is not found.")
        if self.tokenizer and os.path.isfile(self.tokenizer):
            raise invalid_value(self.tokenizer, "tokenizer", f"It is a file; give the folder that holds the tokenizer "
                                                             f"files: --tokenizer={os.path.dirname(self.tokenizer) or '.'}")
        if self.tokenizer and not os.path.isdir(self.tokenizer):
            raise invalid_value(self.tokenizer, "tokenizer", "The tokenizer directory is not found.")


# the paging flags are recorded as the kv_cache section; warnings are printed, not stored
_NOT_IN_METADATA = ("enable_paged_attention", "kv_cache_layout", "paged_config", "paging", "warnings", "input_shapes",
                    "gears")
_BOOL_FLAGS_01 = ("display_model_info",)
_BOOL_FLAGS = ("enable_flash_attention", "enable_paged_attention", "large_model_compilation", "enable_compress_weight",
               "compress_fp32_weight")
_INT_FLAGS = ("mode", "framework", "keep_layers", "pipeline_stages", "export_compile_stat")


def _convert(name: str, raw: str) -> object:
    """One flag's string to its typed value, refusing bad values with ATC's codes."""
    if name in _INT_FLAGS:
        if not raw.strip().lstrip("-").isdigit():
            if name == "framework":
                raise AtcError("E10007", "framework", "0(Caffe) or 1(MindSpore) or 3(TensorFlow) or 5(Onnx)")
            if name in ("keep_layers", "pipeline_stages"):
                raise invalid_value(raw, name, "The value must be a whole number.")
            raise not_in_range(raw, name, sorted(MODES) if name == "mode" else (0, 1, 2))
        return int(raw)
    if name in _BOOL_FLAGS_01:
        if raw not in ("0", "1"):
            raise AtcError("E10006", raw, name)
        return raw == "1"
    if name in _BOOL_FLAGS:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise AtcError("E10005", raw, name)
    if name == "input_shape":
        return parse_input_shape(raw)
    if name == "input_shape_range":
        return parse_input_shape(parse_shape_ranges(raw))
    if name == "dynamic_batch_size":
        return parse_batch_sizes(raw)
    if name == "dynamic_dims":
        return parse_dims(raw)
    if name == "out_nodes":
        return tuple(part for part in raw.split(";") if part)
    return raw


def parse_output_type(text: str) -> dict[tuple[str, int] | None, str]:
    """`--output_type`: one type for every float output (`"FP16"` → {None: "FP16"}), or per output in ATC's
    form `"node:0:FP16;node2:1:FP32"` → {("node", 0): "FP16", ...} (a node's output by index; an output's own
    name with index 0 also names it); E10001 in ATC's words for a type it does not know."""
    types: dict[tuple[str, int] | None, str] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        parts = item.rsplit(":", 2)
        if len(parts) == 3 and parts[0] and parts[1].isdigit():
            key, kind = (parts[0], int(parts[1])), parts[2]
        elif len(parts) == 1 and ";" not in text.strip(";"):
            key, kind = None, parts[0]
        else:
            raise invalid_value(text, "output_type", 'the value must be a type, or "node:index:type;..." per output')
        if kind not in OUTPUT_TYPES:
            raise invalid_value(text, "output_type", f"Only support {', '.join(OUTPUT_TYPES)}.")
        if key in types:
            raise invalid_value(text, "output_type", f"{key[0]}:{key[1]} is given more than once")
        types[key] = kind
    return types


def parse_input_shape(text: str) -> dict[str, tuple[Dim, ...]]:
    """`"input_ids:1,-1;position_ids:1,1~128"` → {name: dims}; ATC's E10002/E10011 on bad text."""
    fmt = '"input_name1:n1,c1,h1,w1;input_name2:n2,c2,h2,w2"'
    shapes: dict[str, tuple[Dim, ...]] = {}
    for item in filter(None, text.split(";")):
        name, sep, dims_text = item.rpartition(":")
        if not sep or not name:
            raise AtcError("E10002", item, "the input name and its shape must be separated by ':'", fmt)
        if name in shapes:
            raise AtcError("E10002", text, f"input {name} is given more than once", fmt)
        dims: list[Dim] = []
        for dim in filter(None, dims_text.split(",")):
            if "~" in dim:
                low, _, high = dim.partition("~")
                if not (low.isdigit() and high.isdigit()) or int(low) > int(high) or int(low) < 1 or int(high) > MAX_DIM:
                    raise AtcError("E10011", item, dim)
                dims.append((int(low), int(high)))
            elif dim == "-1" or dim.isdigit() and 0 < int(dim) <= MAX_DIM:
                dims.append(int(dim))
            else:
                raise AtcError("E10011", item, dim)
        shapes[name] = tuple(dims)
    return shapes
