"""`SamplingParams` refuses what would break a step: numbers that are not finite, and settings that scale
float32 logits past their range (the sampler then refuses a distribution that is not finite)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine.sampler import sample_token
from runtime.engine.sampling import SamplingParams

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
