"""CompileConfig: flag strings to typed values, with ATC's codes for every refusal."""

from __future__ import annotations

import os

import pytest

from cann_llm.compiler.config import CompileConfig, parse_input_shape
from cann_llm.compiler.fusion_switch import is_enabled, parse_fusion_switch_file
from cann_llm.runtime.errors import AtcError

pytestmark = pytest.mark.unit

BASE = dict(model="m.onnx", framework="5", output="out", soc_version="Ascend910B")


def _code(**flags) -> str:
    with pytest.raises(AtcError) as caught:
        CompileConfig.from_flags(**{**BASE, **flags})
    return caught.value.code


def test_defaults_are_atcs():
    cfg = CompileConfig.from_flags(**BASE)
    assert (cfg.mode, cfg.precision.mode, cfg.log) == (0, "must_keep_origin_dtype", "null")
    assert cfg.check_report_path == os.path.join(os.environ.get("ASCEND_WORK_PATH", ""), "check_result.json")
    assert cfg.framework == 5 and cfg.paging is None


@pytest.mark.parametrize("flags, code", [
    (dict(soc_version="Ascend999"), "E10001"),
    (dict(log="verbose"), "E10010"),
    (dict(framework="3"), "E10055"),
    (dict(framework="7"), "E10007"),
    (dict(framework="onnx"), "E10007"),
    (dict(mode="2"), "E10001"),
    (dict(mode="5"), "E10055"),
    (dict(precision_mode="fp8"), "E10001"),
    (dict(input_format="NHWC"), "E10001"),
    (dict(enable_paged_attention="maybe"), "E10005"),
    (dict(display_model_info="2"), "E10006"),
    (dict(kv_cache_layout="ring"), "E10001"),
    (dict(enable_paged_attention="0", kv_cache_layout="paged"), "E10001"),
    (dict(keep_dtype="/nonexistent/keep.cfg"), "E10001"),
    (dict(output=""), "E10054"),
    (dict(model_type="bert"), "E10001"),
])
def test_bad_values_get_atc_codes(flags, code):
    assert _code(**flags) == code


def test_framework_is_required_for_compiling():
    with pytest.raises(AtcError) as caught:
        CompileConfig.from_flags(model="m.onnx", output="o", soc_version="Ascend910B")
    assert caught.value.code == "E10007"


@pytest.mark.parametrize("text", ["true", "1", "T", "yes", "Y"])
def test_booleans_take_atcs_spellings(text):
    cfg = CompileConfig.from_flags(**BASE, enable_paged_attention=text, enable_flash_attention=text)
    assert cfg.paging is not None and cfg.enable_flash_attention and not cfg.warnings


def test_input_shape_grammar():
    assert parse_input_shape("input_ids:1,-1;position_ids:1,1~128") == {
        "input_ids": (1, -1), "position_ids": (1, (1, 128))}
    with pytest.raises(AtcError) as caught:
        parse_input_shape("input_ids:1,x")
    assert caught.value.code == "E10011"
    with pytest.raises(AtcError) as caught:
        parse_input_shape("1,16")
    assert caught.value.code == "E10002"
    with pytest.raises(AtcError, match="input input_ids is given more than once") as caught:
        parse_input_shape("input_ids:1,8;input_ids:2,8")
    assert caught.value.code == "E10002"


def test_input_shape_values_up_to_int32_are_taken():
    assert parse_input_shape("input_ids:1,2147483647") == {"input_ids": (1, 2**31 - 1)}


@pytest.mark.parametrize("dims", ["1,2147483648", "1,1~2147483648", "1,99999999999"])
def test_input_shape_values_past_int32_are_refused(dims):
    with pytest.raises(AtcError) as caught:
        parse_input_shape(f"input_ids:{dims}")
    assert caught.value.code == "E10011"


def test_auto_tune_mode_takes_atcs_values():
    assert CompileConfig.from_flags(**BASE, auto_tune_mode="RL,GA").auto_tune_mode == "RL,GA"
    with pytest.raises(AtcError, match="E10001.*auto_tune_mode"):
        CompileConfig.from_flags(**BASE, auto_tune_mode="fast")


def test_fusion_switch_text_and_json_forms(tmp_path):
    text = tmp_path / "switch.cfg"
    text.write_text("# comment\nALL:off\nShapeInferencePass:on\n")
    switches = parse_fusion_switch_file(str(text))
    assert not is_enabled(switches, "AnyFusionPass") and is_enabled(switches, "ShapeInferencePass")
    as_json = tmp_path / "switch.json"
    as_json.write_text('{"Switch": {"GraphFusion": {"ALL": "off", "X": "on"}, "UBFusion": {"Y": "off"}}}')
    assert parse_fusion_switch_file(str(as_json)) == {"ALL": False, "X": True, "Y": False}
    assert CompileConfig.from_flags(**BASE, fusion_switch_file=str(as_json)).fusion_switches["X"] is True


@pytest.mark.parametrize("content, code", [("{not json", "E10032"), ('{"Switch": {"GraphFusion": {"A": "maybe"}}}', "E10032"),
                                           ("RmsNormFusionPass=off", "E10001")])
def test_bad_fusion_switch_files(tmp_path, content, code):
    path = tmp_path / "switch"
    path.write_text(content)
    assert _code(fusion_switch_file=str(path)) == code


def test_flags_stay_as_given_and_paging_is_resolved_once():
    cfg = CompileConfig.from_flags(**BASE, kv_cache_layout="paged")
    assert cfg.enable_paged_attention is None and cfg.kv_cache_layout == "paged"  # the flags, untouched
    assert cfg.paging.page_size == cfg.soc.page_size
    recorded = cfg.effective()
    assert not {"enable_paged_attention", "kv_cache_layout", "paged_config", "paging"} & set(recorded)
    assert recorded["soc_version"] == "Ascend910B" and recorded["precision"]["mode"] == "must_keep_origin_dtype"


def test_resolved_settings_are_not_flags():
    with pytest.raises(TypeError):
        CompileConfig(**{**BASE, "framework": 5}, paging=None)


def test_flags_given_from_python_are_typed_as_the_command_line_types_them():
    assert CompileConfig(**{**BASE, "framework": "5", "enable_paged_attention": "0"}).paging is None
    made = CompileConfig(**{**BASE, "framework": 5, "enable_paged_attention": 1, "kv_cache_layout": "paged"})
    assert made.enable_paged_attention is True and made.paging is not None
    for flags, code in ((dict(framework=5.0), "E10007"), (dict(enable_paged_attention=2), "E10005"),
                        (dict(enable_paged_attention=0.0), "E10005"), (dict(display_model_info="yes"), "E10006")):
        with pytest.raises(AtcError) as caught:
            CompileConfig(**{**BASE, **flags})
        assert caught.value.code == code


def test_a_compress_weight_conf_quantizes_and_a_switch_set_false_beside_it_is_warned(tmp_path):
    conf = tmp_path / "int8.json"
    conf.write_text('{"quant_mode": "INT8"}')
    alone = CompileConfig.from_flags(**BASE, compress_weight_conf=str(conf))
    switched_off = CompileConfig.from_flags(**BASE, compress_weight_conf=str(conf), enable_compress_weight="false")
    assert alone.quantization.bits == switched_off.quantization.bits == 8
    assert not alone.warnings and [w[:6] for w in switched_off.warnings] == ["W10010"]


def test_a_tokenizer_file_for_its_folder_is_refused_naming_the_folder(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(AtcError) as caught:
        CompileConfig.from_flags(**BASE, tokenizer=str(tmp_path / "tokenizer.json"))
    assert caught.value.code == "E10001" and f"--tokenizer={tmp_path}" in caught.value.message
