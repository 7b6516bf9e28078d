"""ATC's flags that have no counterpart on this target, and those refused because honouring them is not
possible here. Every flag of ATC's reference is either a `CompileConfig` field (implemented), a key of
`NOT_APPLICABLE` (accepted, its value checked as ATC checks it, and named in warning W10003 with the
reason), or a key of `REFUSED` (E10055 with the reason).

ATC's value checks are kept for the accepted ones, so a script with a typo in a value fails here as it
would on the real tool.
"""

from __future__ import annotations

from dataclasses import dataclass

from cann_llm.runtime.errors import AtcError, not_in_range

_BOOL = ("1", "t", "true", "y", "yes", "0", "f", "false", "n", "no")
_NPU = "an Ascend NPU setting; execution is on the host CPU"
_KERNELS = "it configures the NPU's operator (TBE) compiler; CPU kernels are onnxruntime's and this project's, chosen per op"


@dataclass(frozen=True)
class Inapplicable:
    """One accepted flag: why it does nothing here, and the values ATC accepts for it (None: any)."""

    why: str
    values: tuple[str, ...] | None = None
    kind: str = "set"  # "set" (E10001 with ATC's range), "01" (E10006), "bool" (E10005), "int" (digits)


NOT_APPLICABLE: dict[str, Inapplicable] = {
    "weight": Inapplicable("an ONNX model carries its own weights (ATC ignores --weight for ONNX too)"),
    "op_select_implmode": Inapplicable(_KERNELS, ("high_precision", "high_performance", "high_precision_for_all",
                                                  "high_performance_for_all")),
    "optypelist_for_implmode": Inapplicable(_KERNELS),
    "op_precision_mode": Inapplicable(_KERNELS),
    "allow_hf32": Inapplicable("HF32 is an NPU cube format; CPU matmuls are float32", kind="bool"),
    "enable_small_channel": Inapplicable(_NPU, ("0", "1"), kind="01"),
    "sparsity": Inapplicable("structured sparsity runs on the NPU's sparse cube", kind="01"),
    "buffer_optimize": Inapplicable(_NPU, ("l2_optimize", "off_optimize", "l1_optimize")),
    "disable_reuse_memory": Inapplicable("device memory reuse is an NPU setting; onnxruntime plans host memory itself",
                                         kind="01"),
    "enable_single_stream": Inapplicable(_NPU, kind="bool"),
    "jit_compile": Inapplicable(_KERNELS, ("0", "1", "2")),
    "dump_mode": Inapplicable("--mode=1 on an ONNX model always writes its shapes", kind="01"),
    "op_debug_level": Inapplicable(_KERNELS, ("0", "1", "2", "3", "4")),
    "debug_dir": Inapplicable(_KERNELS),
    "op_debug_config": Inapplicable(_KERNELS),
    "status_check": Inapplicable("overflow checks are inserted into NPU kernels", kind="01"),
    "op_compiler_cache_mode": Inapplicable(_KERNELS, ("disable", "enable", "force")),
    "op_compiler_cache_dir": Inapplicable(_KERNELS),
    "host_env_os": Inapplicable("the .om is the same file on every host OS", ("linux",)),
    "host_env_cpu": Inapplicable("the .om is the same file on every host CPU; what its kernels need is checked when "
                                 "it is loaded", ("x86_64", "aarch64")),
    "deterministic": Inapplicable("CPU execution is already deterministic for a given thread count", kind="01"),
    "deterministic_level": Inapplicable("CPU execution is already deterministic for a given thread count",
                                        ("0", "1", "2", "3")),
    "virtual_type": Inapplicable(_NPU, kind="01"),
    "core_type": Inapplicable(_NPU, ("AiCore", "VectorCore")),
    "aicore_num": Inapplicable(_NPU, kind="int"),
    "op_name_map": Inapplicable("it maps Caffe/TensorFlow custom operators; ONNX ops are matched by type"),
    "enable_scope_fusion_passes": Inapplicable("scope fusion applies to TensorFlow graphs"),
    "mdl_bank_path": Inapplicable("AOE tuning banks apply to NPU kernels"),
    "op_bank_path": Inapplicable("AOE tuning banks apply to NPU kernels"),
    "customize_dtypes": Inapplicable(_KERNELS),
    "quant_dumpable": Inapplicable("it keeps NPU quantization nodes dumpable", kind="01"),
    "is_weight_clip": Inapplicable("weight clipping for NPU float16 storage; weights are stored as --precision_mode "
                                   "says", kind="01"),
    "atomic_clean_policy": Inapplicable(_NPU, kind="01"),
    "shape_generalized_build_mode": Inapplicable(_KERNELS, ("shape_generalized", "shape_precise")),
    "ac_parallel_enable": Inapplicable(_NPU, kind="01"),
    "tiling_schedule_optimize": Inapplicable(_NPU, kind="01"),
    "h2d_overlapped_with_compute": Inapplicable(_NPU),
    "static_model_ops_lower_limit": Inapplicable(_NPU),
    "cluster_config": Inapplicable("multi-device clusters; a model is served from one host"),
    "hccl_sub_comm_config": Inapplicable("HCCL collectives run between NPUs"),
    "save_original_model": Inapplicable("the .om keeps the optimised graph; the original ONNX is the user's file"),
    "enable_attr_compression": Inapplicable("the .om's graph is ONNX, whose attributes are stored as they are",
                                            kind="bool"),
    "raw_ge_options": Inapplicable("it passes options to the NPU graph engine"),
    "build_config": Inapplicable("it passes options to the NPU graph engine"),
    "input_hint_shape": Inapplicable("onnxruntime sizes dynamic inputs at run time without hints"),
    "cal_conf": Inapplicable("AMCT calibration on the NPU; calibration here is set in --compress_weight_conf"),
    "target": Inapplicable("--soc_version names the target profile"),
    "external_weight": Inapplicable("the weights stay in the .om's weight partition, which is memory-mapped at load "
                                    "and so never copied whole", ("0", "1", "2")),
    "compression_optimize_conf": Inapplicable("ATC's AMCT post-training quantization; calibration is set in "
                                              "--compress_weight_conf's \"calibration\" object"),
}

REFUSED: dict[str, str] = {
    "dynamic_image_size": "image-size gears are for vision models; use --dynamic_dims for the dims of an LLM's inputs",
    "insert_op_conf": "AIPP image preprocessing is an NPU feature and would change the model's inputs",
    "singleop": "single-operator compilation is not provided; compile a whole ONNX model",
    "is_input_adjust_hw_layout": "NC1HWC0 input layouts are an NPU format",
    "is_output_adjust_hw_layout": "NC1HWC0 output layouts are an NPU format",
    "input_fp16_nodes": "inputs keep the dtypes they were exported with (an LLM's are integer ids and positions; a "
                        "float16 or bfloat16 model's float inputs become float32)",
}


def check_inapplicable(name: str, raw: str) -> None:
    """ATC's value check for an accepted flag; refused flags raise E10055."""
    if name in REFUSED:
        raise AtcError("E10055", f"--{name} is not supported on this target: {REFUSED[name]}")
    if name not in NOT_APPLICABLE:
        raise AtcError("E10055", f"--{name} is not one of ATC's flags")
    spec = NOT_APPLICABLE[name]
    if spec.kind == "01" and raw not in ("0", "1"):
        raise AtcError("E10006", raw, name)
    if spec.kind == "bool" and raw.lower() not in _BOOL:
        raise AtcError("E10005", raw, name)
    if spec.kind == "int" and not raw.isdigit():
        raise not_in_range(raw, name, ["a whole number"])
    if spec.kind == "set" and spec.values is not None and raw not in spec.values:
        raise not_in_range(raw, name, sorted(spec.values))


def warning(name: str, raw: str) -> str | None:
    """W10003 naming an accepted flag that has no effect here (None for a value that asks for nothing)."""
    if name == "external_weight" and raw == "0":
        return None
    return f"W10003: --{name}={raw} has no effect on this target: {NOT_APPLICABLE[name].why}."
