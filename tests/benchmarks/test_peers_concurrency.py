"""benchmarks/peers_concurrency.py's pure parts: the request mix, the static batches' accounting, and the
report's best batch and ratio."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from peers_concurrency import median_row, request_mix, round_ratios, static_batches, summarize, table  # noqa: E402

pytestmark = pytest.mark.unit

TEXT = list(range(1000, 3000))


def test_the_mix_is_the_same_for_a_seed_and_differs_for_another():
    first, again, other = request_mix(TEXT, 40, seed=3), request_mix(TEXT, 40, seed=3), request_mix(TEXT, 40, seed=4)
    assert first == again
    assert first != other
    assert len(first) == 40


def test_prompts_are_windows_of_the_text_and_lengths_are_in_range():
    mix = request_mix(TEXT, 200, seed=0, prompt_lengths=(32, 512), output_lengths=(32, 128))
    for prompt, new_tokens in mix:
        assert 32 <= len(prompt) <= 512 and 32 <= new_tokens <= 128
        # TEXT counts up by one, so a window is consecutive ids
        assert prompt == list(range(prompt[0], prompt[0] + len(prompt)))
    # uniform draws over 200 requests reach near both ends of each range
    assert min(len(p) for p, _ in mix) < 60 and max(len(p) for p, _ in mix) > 480
    assert min(n for _, n in mix) < 40 and max(n for _, n in mix) > 120


def test_a_static_batch_runs_its_longest_output_and_counts_each_rows_own():
    batches = static_batches([40, 100, 60, 32, 128], batch=2)
    assert [b["indices"] for b in batches] == [[0, 1], [2, 3], [4]]
    assert [b["steps"] for b in batches] == [100, 60, 128]
    assert [b["useful_tokens"] for b in batches] == [140, 92, 128]
    assert [b["generated_tokens"] for b in batches] == [200, 120, 128]
    assert sum(b["useful_tokens"] for b in batches) == 40 + 100 + 60 + 32 + 128


def test_batch_one_generates_only_useful_tokens():
    batches = static_batches([40, 100, 60], batch=1)
    assert sum(b["generated_tokens"] for b in batches) == sum(b["useful_tokens"] for b in batches) == 200


def _row(batch, tokens_per_s, **extra):
    return {"batch": batch, "tokens_per_s": tokens_per_s, "seconds": 10.0, "useful_tokens": 100,
            "generated_tokens": 150, "ttft_ms_p50": 5.0, "ttft_ms_p99": 9.0, "peak_rss_bytes": 2**20, **extra}


def test_the_best_batch_is_the_fastest_that_ran_and_the_ratio_is_over_it():
    ours = {"concurrency": 32, **_row(None, 300.0)}
    genai = [_row(1, 60.0), _row(8, 120.0), {"batch": 16, "error": "out of memory"}, _row(32, 80.0)]
    report = summarize(ours, genai)
    assert report["best_batch"] == 8
    assert report["ratio"] == pytest.approx(2.5)
    lines = table(report)
    assert any("batch 8 (best)" in line for line in lines)
    assert any("out of memory" in line for line in lines)
    assert lines[-1].endswith("2.50x aggregate tok/s")


def test_no_ratio_without_a_measured_peer_or_our_row():
    assert summarize({"tokens_per_s": 300.0}, [{"batch": 1, "error": "not installed"}])["ratio"] is None
    assert summarize({"error": "failed"}, [_row(1, 60.0)])["ratio"] is None


def test_rounds_give_the_median_row_and_a_ratio_each_round_over_that_rounds_best_batch():
    ours = [_row(None, 300.0), _row(None, 240.0), _row(None, 330.0)]
    genai = [[_row(1, 100.0), _row(4, 90.0)], [_row(1, 70.0), _row(4, 80.0)], [_row(1, 110.0), {"batch": 4, "error": "x"}]]
    assert median_row(ours)["tokens_per_s"] == 300.0
    assert median_row([{"error": "failed"}, _row(1, 50.0), _row(1, 70.0)])["tokens_per_s"] == 50.0
    assert median_row([{"batch": 4, "error": "x"}]) == {"batch": 4, "error": "x"}
    assert round_ratios(ours, genai) == pytest.approx([3.0, 3.0, 3.0])
    report = {**summarize(ours[0], [_row(1, 100.0)]), "round_ratios": [3.0, 2.5, None]}
    assert table(report)[-1].endswith("3.00x aggregate tok/s (by round: 3.00 2.50 -)")
