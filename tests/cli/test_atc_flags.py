"""Every flag of ATC's reference (shared/reference/ATC.md §1.3) has one documented behaviour here: implemented
(a CompileConfig field, with its own tests), accepted with warning W10003 naming why it does nothing on this
target (values still checked as ATC checks them), or refused with E10055; and an unknown flag close to a real
one is answered with "did you mean"."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from cann_llm.cli.atc import FLAGS, parse_flags, run, usage
from cann_llm.compiler.config import CompileConfig
from cann_llm.compiler.inapplicable_flags import NOT_APPLICABLE, REFUSED
from cann_llm.runtime.artifact import OmFile
from cann_llm.runtime.errors import AtcError

# ATC.md §1.3's flags (its table and its "rarely used" row), and the two §1.2 / §1.7 name
ATC_FLAGS = """
model weight framework output soc_version input_shape input_format dynamic_batch_size dynamic_image_size
dynamic_dims input_shape_range out_nodes output_type input_fp16_nodes insert_op_conf precision_mode
precision_mode_v2 modify_mixlist keep_dtype op_precision_mode op_select_implmode optypelist_for_implmode
allow_hf32 fusion_switch_file optimization_switch oo_level enable_small_channel compression_optimize_conf
enable_compress_weight compress_weight_conf sparsity external_weight buffer_optimize disable_reuse_memory
enable_single_stream jit_compile log dump_mode om json check_report display_model_info op_debug_level
debug_dir op_debug_config status_check op_compiler_cache_mode op_compiler_cache_dir auto_tune_mode
host_env_os host_env_cpu deterministic deterministic_level virtual_type core_type aicore_num singleop
is_input_adjust_hw_layout is_output_adjust_hw_layout op_name_map enable_scope_fusion_passes mdl_bank_path
op_bank_path customize_dtypes quant_dumpable is_weight_clip atomic_clean_policy shape_generalized_build_mode
ac_parallel_enable tiling_schedule_optimize h2d_overlapped_with_compute static_model_ops_lower_limit
cluster_config hccl_sub_comm_config save_original_model enable_attr_compression export_compile_stat
raw_ge_options build_config input_hint_shape cal_conf target mode
""".split()
IMPLEMENTED = {f.name for f in fields(CompileConfig) if f.init} - {"cmdline", "quantization", "inapplicable"}
BASE = dict(model="m.onnx", framework="5", output="o", soc_version="Ascend910B")
# a value ATC accepts for each accepted flag
GOOD = {"op_select_implmode": "high_precision", "buffer_optimize": "l2_optimize", "jit_compile": "1",
        "op_debug_level": "0", "op_compiler_cache_mode": "enable", "host_env_os": "linux", "host_env_cpu": "x86_64",
        "deterministic_level": "1", "core_type": "AiCore", "aicore_num": "8",
        "shape_generalized_build_mode": "shape_precise", "external_weight": "1"}


def _good(name: str) -> str:
    spec = NOT_APPLICABLE[name]
    return GOOD.get(name) or {"01": "1", "bool": "true"}.get(spec.kind, "anything")


def test_every_atc_flag_has_one_behaviour_and_help():
    for name in ATC_FLAGS:
        kinds = [name in IMPLEMENTED, name in NOT_APPLICABLE, name in REFUSED]
        assert sum(kinds) == 1, name
    helped = {name for name, _, _ in FLAGS}
    assert set(ATC_FLAGS) <= helped | {"mode"}
    # each flag's line in `atc -h` keeps its name apart from its text (the longest ran into it)
    flag_lines = [line for line in usage().splitlines() if line.startswith("  --")]
    assert len(flag_lines) == len(FLAGS)
    assert all(line[4:].split(" ", 1)[0] in helped and "  " in line[4:] for line in flag_lines)


@pytest.mark.parametrize("name", sorted(NOT_APPLICABLE))
def test_an_inapplicable_flag_warns_and_names_why(name):
    cfg = CompileConfig.from_flags(**BASE, **{name: _good(name)})
    warned = [w for w in cfg.warnings if w.startswith(f"W10003: --{name}=")]
    assert len(warned) == 1 and NOT_APPLICABLE[name].why in warned[0]


@pytest.mark.parametrize("name", sorted(n for n, spec in NOT_APPLICABLE.items() if spec.kind != "set" or spec.values))
def test_an_inapplicable_flags_value_is_checked_as_atc_does(name):
    code = {"01": "E10006", "bool": "E10005"}.get(NOT_APPLICABLE[name].kind, "E10001")
    with pytest.raises(AtcError) as caught:
        CompileConfig.from_flags(**BASE, **{name: "bogus"})
    assert caught.value.code == code


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_flag_says_why_with_e10055(name):
    with pytest.raises(AtcError, match=f"E10055.*--{name} is not supported on this target"):
        CompileConfig.from_flags(**BASE, **{name: "x"})


def test_external_weight_zero_asks_for_nothing():
    assert not CompileConfig.from_flags(**BASE, external_weight="0").warnings


@pytest.mark.parametrize("typed, meant", [("soc_verison", "soc_version"), ("enable-paged-atention", "enable_paged_attention"),
                                          ("dynamic_batch", "dynamic_batch_size"), ("presicion_mode", "precision_mode")])
def test_a_near_miss_is_answered_with_did_you_mean(typed, meant, capsys):
    assert run([f"--{typed}=1"]) == 255
    assert f"unknown command line flag '{typed}'. Did you mean '--{meant}'?" in capsys.readouterr().err


def test_a_flag_like_no_other_gets_no_guess(capsys):
    assert run(["--frobnicate=1"]) == 255
    err = capsys.readouterr().err
    assert "unknown command line flag 'frobnicate'" in err and "Did you mean" not in err


def test_precision_mode_v2_is_precision_mode_by_atcs_newer_names():
    for v2, v1 in (("fp16", "force_fp16"), ("origin", "must_keep_origin_dtype"), ("mixed_float16", "allow_mix_precision_fp16"),
                   ("mixed_bfloat16", "allow_mix_precision_bf16"), ("cube_fp16in_fp32out", "cube_fp16in_fp32out")):
        assert CompileConfig.from_flags(**BASE, precision_mode_v2=v2).precision == CompileConfig.from_flags(
            **BASE, precision_mode=v1).precision
    for flags, code in ((dict(precision_mode_v2="mixed_hif8"), "E10055"), (dict(precision_mode_v2="fp8"), "E10001"),
                        (dict(precision_mode="force_fp16", precision_mode_v2="fp16"), "E10047")):
        with pytest.raises(AtcError) as caught:
            CompileConfig.from_flags(**BASE, **flags)
        assert caught.value.code == code


def test_modify_mixlist_keeps_its_black_list_in_a_mixed_mode(tmp_path):
    mixlist = tmp_path / "mix.json"
    mixlist.write_text(json.dumps({"black-list": {"to-add": ["MatMul"]}}))
    cfg = CompileConfig.from_flags(**BASE, precision_mode="allow_mix_precision", modify_mixlist=str(mixlist))
    assert cfg.precision.keep_op_types == ("MatMul",)
    with pytest.raises(AtcError, match="E10001.*mixed"):
        CompileConfig.from_flags(**BASE, precision_mode="force_fp16", modify_mixlist=str(mixlist))
    mixlist.write_text('{"black-list": {"to-add": "MatMul"}}')
    with pytest.raises(AtcError, match="E10032"):
        CompileConfig.from_flags(**BASE, precision_mode="allow_mix_precision", modify_mixlist=str(mixlist))


def test_oo_level_and_optimization_switch_set_the_pass_switches():
    assert CompileConfig.from_flags(**BASE).fusion_switches == {}
    assert CompileConfig.from_flags(**BASE, oo_level="O1").fusion_switches == {"ALL": False}
    cfg = CompileConfig.from_flags(**BASE, oo_level="O1", optimization_switch="RmsNormFusionPass:on;SwiGluFusionPass:off")
    assert cfg.fusion_switches == {"ALL": False, "RmsNormFusionPass": True, "SwiGluFusionPass": False}
    for flags in (dict(oo_level="O2"), dict(optimization_switch="RmsNormFusionPass=on")):
        with pytest.raises(AtcError, match="E10001"):
            CompileConfig.from_flags(**BASE, **flags)


def test_oo_level_o1_and_output_type_and_export_compile_stat_in_a_compile(tmp_path, monkeypatch, tiny_llama_path):
    monkeypatch.chdir(tmp_path)
    argv = [f"--model={tiny_llama_path}", "--framework=5", "--soc_version=Ascend910B"]
    assert run([*argv, "--output=o3"]) == 0 and (tmp_path / "fusion_result.json").exists()
    (tmp_path / "fusion_result.json").unlink()
    assert run([*argv, "--output=o1", "--oo_level=O1", "--output_type=FP32", "--export_compile_stat=0"]) == 0
    assert not (tmp_path / "fusion_result.json").exists()
    fused = {p["name"]: p["effect_times"] for p in OmFile(tmp_path / "o3.om").metadata["pass_report"]["passes"]}
    basic = {p["name"]: p["effect_times"] for p in OmFile(tmp_path / "o1.om").metadata["pass_report"]["passes"]}
    assert fused["AttentionFusionPass"] > 0 and basic["AttentionFusionPass"] == 0 and basic["RmsNormFusionPass"] == 0
    assert run([*argv, "--output=p", "--output_type=FP16", "--enable_paged_attention=1"]) == 255
    assert run([*argv, "--output=q", "--output_type=INT8"]) == 255


def test_output_type_fp16_casts_float_outputs(tmp_path):
    from cann_llm.models.tiny import tiny_onnx

    import numpy as np

    from cann_llm.runtime.executor import Executor
    from cann_llm.runtime.feeds import causal_lm_inputs
    from cann_llm.runtime.loader import load_artifact

    source = tiny_onnx("llama", dynamo=True, with_past=False)
    flags = dict(framework="5", soc_version="Ascend910B", model=str(source))
    for name, extra in (("fp32", {}), ("fp16", {"output_type": "FP16"})):
        from cann_llm.compiler.compile import compile_model

        compile_model(CompileConfig.from_flags(**flags, output=str(tmp_path / name), **extra))
    runs = {}
    for name in ("fp32", "fp16"):
        loaded = load_artifact(tmp_path / f"{name}.om")
        ids = np.array([[5, 17, 99, 3]])
        runs[name] = Executor(loaded).run(causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"], ids, 0))
    assert runs["fp16"]["logits"].dtype == np.float16
    np.testing.assert_allclose(runs["fp16"]["logits"], runs["fp32"]["logits"], rtol=1e-3, atol=1e-3)
    assert parse_flags(["--output_type=FP16"])["output_type"] == "FP16"


def test_output_type_per_output_in_atcs_form(tmp_path):
    """ATC's `"node:index:type;..."`: the output a node's index names (or the output of that name) is cast,
    the rest keep their type; a type ATC does not know is E10001 in its words, an output not there E10016."""
    import numpy as np
    import onnx

    from cann_llm.compiler.compile import compile_model
    from cann_llm.compiler.config import parse_output_type
    from cann_llm.models.tiny import tiny_onnx
    from cann_llm.runtime.artifact import OmFile

    assert parse_output_type("node_a:1:FP16;logits:0:FP32") == {("node_a", 1): "FP16", ("logits", 0): "FP32"}
    assert parse_output_type("FP16") == {None: "FP16"}
    assert parse_output_type("a:0:FP16; b:1:FP32") == {("a", 0): "FP16", ("b", 1): "FP32"}
    for bad, words in (("FP64", "Only support FP32, FP16, UINT8, INT8."), ("FP16;FP32", "per output"),
                       ("logits:x:FP16", "per output"), ("a:0:FP16;a:0:FP32", "a:0 is given more than once")):
        with pytest.raises(AtcError, match="E10001") as caught:
            CompileConfig.from_flags(**BASE, output_type=bad)
        assert words in caught.value.message
    source = tiny_onnx("llama", dynamo=True, with_past=False)
    producer = next(n.name for n in onnx.load(str(source), load_external_data=False).graph.node if "logits" in n.output)
    flags = dict(framework="5", soc_version="Ascend910B", model=str(source))
    for name, spec in (("by_node", f"{producer}:0:FP16"), ("by_name", "logits:0:FP16")):
        compile_model(CompileConfig.from_flags(**flags, output=str(tmp_path / name), output_type=spec))
        outputs = OmFile(tmp_path / f"{name}.om").metadata["signature"]["outputs"]
        assert [(o["name"], np.dtype(o["dtype"])) for o in outputs] == [("logits", np.float16)]
    with pytest.raises(AtcError) as caught:
        compile_model(CompileConfig.from_flags(**flags, output=str(tmp_path / "absent"), output_type="nope:0:FP16"))
    assert caught.value.code == "E10016"
    with pytest.raises(AtcError, match="logits is named more than once") as caught:
        compile_model(CompileConfig.from_flags(**flags, output=str(tmp_path / "twice"),
                                               output_type=f"{producer}:0:FP16;logits:0:FP32"))
    assert caught.value.code == "E10001"


def test_docs_atc_names_every_flags_behaviour():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "atc.md").read_text()
    for name in ATC_FLAGS:
        assert f"`--{name}`" in text, name
