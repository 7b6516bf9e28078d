"""The sampler's processors and draws."""

from __future__ import annotations

import numpy as np
import pytest

from cann_llm.runtime.engine.sampler import apply_repetition_penalty, probabilities, sample_token
from cann_llm.runtime.engine.sampling import SamplingParams
from cann_llm.runtime.engine.setting_error import SettingError

pytestmark = pytest.mark.unit

LOGITS = np.array([2.0, 1.0, 0.5, -1.0, 3.0, -0.5], np.float32)


def test_greedy_is_the_argmax_and_top_k_1_equals_it():
    rng = np.random.default_rng(0)
    assert sample_token(LOGITS, SamplingParams(temperature=0), np.array([], int), rng) == 4
    assert {sample_token(LOGITS, SamplingParams(temperature=1.5, top_k=1), np.array([], int), rng)
            for _ in range(50)} == {4}


def test_draws_follow_the_softmax():
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=0.8)
    draws = np.bincount([sample_token(LOGITS, params, np.array([], int), rng) for _ in range(20000)], minlength=6)
    expected = np.exp(LOGITS / 0.8) / np.exp(LOGITS / 0.8).sum()
    np.testing.assert_allclose(draws / draws.sum(), expected, atol=0.015)


def test_top_k_and_top_p_keep_the_right_tokens():
    top3 = probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=3))
    assert set(np.flatnonzero(top3)) == {0, 1, 4}
    softmax = np.exp(LOGITS - LOGITS.max()) / np.exp(LOGITS - LOGITS.max()).sum()
    # the two most likely tokens hold ~0.86 of the mass: top_p 0.8 keeps both, top_p 0.5 only the first
    assert set(np.flatnonzero(probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.8)))) == {0, 4}
    assert set(np.flatnonzero(probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.5)))) == {4}
    assert softmax[[0, 4]].sum() > 0.8


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    out = apply_repetition_penalty(LOGITS, np.array([0, 3]), 2.0)
    assert out[0] == pytest.approx(1.0) and out[3] == pytest.approx(-2.0)
    assert np.array_equal(np.delete(out, [0, 3]), np.delete(LOGITS, [0, 3]))


def test_a_seed_makes_a_request_reproducible():
    params = SamplingParams(temperature=1.0, seed=7)
    first = [sample_token(LOGITS, params, np.array([], int), np.random.default_rng(7)) for _ in range(3)]
    second = [sample_token(LOGITS, params, np.array([], int), np.random.default_rng(7)) for _ in range(3)]
    assert first == second


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(max_new_tokens=0), dict(repetition_penalty=0), dict(stop=[""]),
                                 dict(min_tokens=9, max_new_tokens=2), dict(logit_bias={3: 101}),
                                 dict(temperature=float("nan"))])
def test_bad_settings_are_refused_naming_the_setting(bad):
    with pytest.raises(SettingError) as refused:
        SamplingParams(**bad)
    assert refused.value.setting == next(iter(bad))
