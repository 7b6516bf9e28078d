"""`SamplingParams` refuses what would break a step: numbers that are not finite, and settings that scale
float32 logits past their range (the sampler then refuses a distribution that is not finite)."""

from __future__ import annotations

import numpy as np
import pytest

from cann_llm.runtime.engine.sampler import sample_token
from cann_llm.runtime.engine.sampling import SamplingParams

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("settings,message", [
    ({"temperature": float("nan")}, "temperature must be a finite number, not nan"),
    ({"temperature": float("inf")}, "temperature must be a finite number, not inf"),
    ({"top_p": float("nan")}, "top_p must be a finite number"),
    ({"repetition_penalty": float("-inf")}, "repetition_penalty must be a finite number"),
    ({"repetition_penalty": 1e-308}, r"repetition_penalty must be in \[0.01, 100\]"),
    ({"repetition_penalty": 1e308}, r"repetition_penalty must be in \[0.01, 100\]"),
    ({"temperature": 1e-300}, r"temperature must be 0 \(greedy\) or at least 0.001"),
    ({"seed": -1}, r"seed must be in \[0, 2\*\*64\)"),
    ({"seed": 2 ** 64}, r"seed must be in \[0, 2\*\*64\)"),
])
def test_settings_that_would_break_a_step_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**settings)


def test_the_range_limits_themselves_are_accepted():
    SamplingParams(temperature=0.001, repetition_penalty=0.01, seed=2 ** 64 - 1)
    SamplingParams(temperature=0, repetition_penalty=100)


def test_a_distribution_that_overflowed_is_refused_not_drawn_from():
    logits = np.array([3e38, 1.0, -3e38], np.float32)
    params = SamplingParams(temperature=1.0)
    object.__setattr__(params, "repetition_penalty", 1e-3)  # past the check: 3e38 / 1e-3 is inf in float32
    with pytest.raises(ValueError, match="the sampling distribution is not finite"):
        sample_token(logits, params, [0], np.random.default_rng(0))


@pytest.mark.parametrize("settings,message", [
    ({"top_k": 2.5}, r"top_k must be an integer, not float \(2.5\)"),
    ({"priority": "high"}, r"priority must be an integer, not str"),
    ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"n": True}, "n must be an integer, not bool"),
    ({"temperature": "0.5"}, "temperature must be a number, not str"),
    ({"stop": [1]}, "stop must be a string or a sequence of strings"),
    ({"stop_token_ids": [2.0]}, "a stop token id must be an integer"),
    ({"logit_bias": {"5": 1.0}}, "a logit_bias token id must be an integer"),
    ({"ignore_eos": 1}, "ignore_eos must be True or False"),
    ({"structured_output": "json"}, "structured_output must be a StructuredOutput"),
])
def test_a_setting_of_the_wrong_type_is_refused_when_made(settings, message):
    with pytest.raises(TypeError, match=message):
        SamplingParams(**settings)


def test_numpy_numbers_are_taken_as_python_numbers():
    params = SamplingParams(top_k=np.int32(3), seed=np.uint64(7), temperature=np.float32(0.5),
                            logit_bias={np.int64(4): np.float64(1)}, stop_token_ids=np.array([9]))
    assert (type(params.top_k), type(params.seed), type(params.temperature)) == (int, int, float)
    assert params.logit_bias == ((4, 1.0),) and params.stop_token_ids == (9,)


def test_params_with_a_schema_given_as_a_dict_are_hashable_and_equal_schemas_hash_alike():
    from cann_llm.runtime.engine.structured import StructuredOutput

    def params(schema):
        return SamplingParams(structured_output=StructuredOutput(json=schema))

    one = params({"type": "object", "properties": {"a": {"type": "integer"}}})
    same = params({"properties": {"a": {"type": "integer"}}, "type": "object"})
    other = params({"type": "object", "properties": {"b": {"type": "string"}}})
    assert one == same and hash(one) == hash(same)
    assert len({one, same, other}) == 2
    # equal dicts whose values print apart, and keys of mixed types
    assert hash(params({"maximum": 1})) == hash(params({"maximum": 1.0}))
    assert hash(params({"type": "object", 1: "x"})) == hash(params({1: "x", "type": "object"}))
