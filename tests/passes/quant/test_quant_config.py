"""`--compress_weight_conf`'s JSON read into QuantConfig: every bad value, unknown key or wrong type is E10001
naming its key (and the range or type it must have), never coerced and never an internal error."""

from __future__ import annotations

import json

import pytest

from cann_llm.passes.quant.config import MAX_CALIBRATION_TOKENS, MAX_SEQ_LEN, QuantConfig
from cann_llm.runtime.errors import AtcError

pytestmark = pytest.mark.unit


def _read(tmp_path, conf: dict) -> QuantConfig:
    path = tmp_path / "quant.json"
    path.write_text(json.dumps(conf))
    return QuantConfig.from_json(str(path))


@pytest.mark.parametrize("conf, parameter, words", [
    ({"algorithms": [{"name": "gptq", "params": {"damp": -1}}]}, "params.damp", "(0, 1]"),
    ({"algorithms": [{"name": "gptq", "params": {"damp": 0}}]}, "params.damp", "(0, 1]"),
    ({"algorithms": [{"name": "gptq", "params": {"damp": "x"}}]}, "params.damp", "must be a number"),
    ({"algorithms": [{"name": "gptq", "params": {"act_order": "yes"}}]}, "params.act_order", "true or false"),
    ({"calibration": {"num_samples": "abc"}}, "calibration.num_samples", "whole number"),
    ({"calibration": {"num_samples": 2.7}}, "calibration.num_samples", "whole number"),
    ({"calibration": {"num_samples": 0}}, "calibration.num_samples", "at least 1"),
    ({"calibration": {"seq_len": 64.0}}, "calibration.seq_len", "whole number"),
    ({"calibration": {"text_file": 5}}, "calibration.text_file", "a file name"),
    ({"symmetric": "false"}, "symmetric", "true or false"),
    ({"group_size": "128"}, "group_size", "whole number"),
    ({"lm_head_bits": 4.0}, "lm_head_bits", "whole number"),
    ({"zero_points": 1}, "zero_points", "a string"),
    ({"quant_mode": ["INT4"]}, "quant_mode", "[INT4] [INT8] [W8A8]"),
    ({"algorithms": []}, "algorithms", "List one algorithm"),
    ({"algorithms": [{"name": 4}]}, "algorithms[0].name", "[rtn] [awq]"),
], ids=lambda value: json.dumps(value) if isinstance(value, dict) else None)
def test_a_bad_value_or_type_is_refused_naming_its_key_and_what_it_must_be(tmp_path, conf, parameter, words):
    with pytest.raises(AtcError) as caught:
        _read(tmp_path, conf)
    assert caught.value.code == "E10001"
    assert f"for parameter --compress_weight_conf {parameter} is invalid" in caught.value.message
    assert words in caught.value.message


@pytest.mark.parametrize("conf, parameter, unknown, meant", [
    ({"quant_mode": "W8A8", "algorithms": [{"name": "smooth_quant", "params": {"alhpa": 0.9}}]},
     "algorithms[0].params", "alhpa", "Did you mean 'alpha' for 'alhpa'?"),
    ({"calibration": {"num_sample": 4, "seqlen": 64}}, "calibration", "num_sample, seqlen",
     "Did you mean 'num_samples' for 'num_sample', 'seq_len' for 'seqlen'?"),
    ({"algorithms": [{"name": "gptq", "params": {"foo": 1}}]}, "algorithms[0].params", "foo", "known: act_order, damp."),
    ({"algorithms": [{"name": "rtn", "params": {"damp": 0.1}}]}, "algorithms[0].params", "damp", "it takes none"),
    ({"algorithms": [{"name": "awq"}, {"name": "gptq", "params": {"alpha": 0.5}}]}, "algorithms[1].params", "alpha",
     "known: act_order, damp."),
    ({"algorithms": [{"name": "gptq", "damp": 0.1}]}, "algorithms[0]", "damp", "known: name, params."),
    ({"quant_mod": "INT8"}, "", "quant_mod", "Did you mean 'quant_mode' for 'quant_mod'?"),
], ids=["params", "calibration", "gptq-params", "rtn-params", "chain-params", "algorithm", "top-level"])
def test_an_unknown_key_anywhere_is_refused_with_the_key_it_likely_meant(tmp_path, conf, parameter, unknown, meant):
    with pytest.raises(AtcError) as caught:
        _read(tmp_path, conf)
    assert caught.value.code == "E10001"
    assert f"Value {unknown} for parameter --compress_weight_conf{' ' * bool(parameter)}{parameter} is" \
           in caught.value.message
    assert meant in caught.value.message


@pytest.mark.parametrize("calibration, parameter, words", [
    ({"seq_len": 100000, "num_samples": 2}, "calibration.seq_len", f"16 to {MAX_SEQ_LEN} tokens"),
    ({"seq_len": 20000, "num_samples": 2}, "calibration.seq_len", f"16 to {MAX_SEQ_LEN} tokens"),
    ({"seq_len": 8}, "calibration.seq_len", f"16 to {MAX_SEQ_LEN} tokens"),
    ({"seq_len": 2048, "num_samples": 129}, "calibration.num_samples", f"at most {MAX_CALIBRATION_TOKENS}"),
    ({"num_samples": 100000}, "calibration.num_samples", "windows of 512 tokens"),
])
def test_calibration_larger_than_its_bounds_is_refused_before_anything_runs(tmp_path, calibration, parameter, words):
    with pytest.raises(AtcError) as caught:
        _read(tmp_path, {"algorithms": [{"name": "awq"}], "calibration": calibration})
    assert caught.value.code == "E10001" and f"--compress_weight_conf {parameter} is invalid" in caught.value.message
    assert words in caught.value.message


def test_the_largest_calibration_allowed_is_accepted(tmp_path):
    config = _read(tmp_path, {"algorithms": [{"name": "gptq"}],
                              "calibration": {"seq_len": 2048, "num_samples": MAX_CALIBRATION_TOKENS // 2048}})
    assert (config.seq_len, config.num_samples) == (2048, 128)


def test_params_and_calibration_keys_set_the_settings_they_name(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("some text")
    config = _read(tmp_path, {"algorithms": [{"name": "awq"}, {"name": "gptq", "params": {"damp": 0.1, "act_order": False}}],
                              "calibration": {"text_file": str(text), "num_samples": 4, "seq_len": 64},
                              "symmetric": False, "accuracy_level": 4})
    assert (config.method, config.damp, config.act_order, config.symmetric) == ("awq+gptq", 0.1, False, False)
    assert (config.calibration_text, config.num_samples, config.seq_len) == (str(text), 4, 64)
    assert config.accuracy_level == "4"


@pytest.mark.parametrize("level", ["auto", "4", 4, None])
def test_w8a8_records_the_accuracy_level_its_matmuls_run_at(tmp_path, level):
    conf = {"quant_mode": "W8A8", **({} if level is None else {"accuracy_level": level})}
    assert _read(tmp_path, conf).accuracy_level == "4"


@pytest.mark.parametrize("level", [0, "0"])
def test_w8a8_refuses_float_activations(tmp_path, level):
    with pytest.raises(AtcError) as caught:
        _read(tmp_path, {"quant_mode": "W8A8", "accuracy_level": level})
    assert caught.value.code == "E10001" and "--compress_weight_conf accuracy_level" in caught.value.message
    assert "W8A8 quantizes the activations to int8" in caught.value.message


def test_an_unknown_algorithm_is_named_as_the_conf_names_it(tmp_path):
    with pytest.raises(AtcError) as caught:
        _read(tmp_path, {"algorithms": [{"name": "foo"}]})
    assert "parameter --compress_weight_conf algorithms[0].name is invalid" in caught.value.message
    assert "--quant-method" not in caught.value.message
