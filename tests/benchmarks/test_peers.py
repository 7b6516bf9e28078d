"""benchmarks/peers.py's report: medians over rounds, the bandwidth ceiling's share, ratios of our rows to
each peer, greedy agreement, and rows whose runner is missing or failed."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from peers import BURST, COLD, NOT_INSTALLED, Engine, ceiling_share, share_of_ceiling, summarize, table  # noqa: E402

pytestmark = pytest.mark.unit

OURS = Engine("cann-llm int4", "cann", "int4", ours=True)
GENAI = Engine("onnxruntime-genai int4", "genai", "int4")
LLAMA = Engine("llama.cpp Q4_1", "llama.cpp", "int4")
PLAIN = Engine("onnxruntime fp32", "onnxruntime", "fp32")


def _run(decode, prefill, rss, output=(1, 2, 3, 4), prompt=(7, 8), share=None):
    run = {"prompt_tokens": len(prompt), "prefill_tokens": 512, "ttft_s": prefill / 16, "decode_tok_s": decode,
           "prefill_s": prefill, "peak_rss_bytes": rss, "load_s": 1.0, "prompt_ids": list(prompt),
           "output_ids": list(output)}
    if share is not None:
        run.update({"of_ceiling": share, "bandwidth_bytes_per_s": share * 1e10, "bursts": 8, "read_probe": "C"})
    return run


def _report(llama_samples):
    samples = {
        OURS.name: [_run(100.0, 1.0, 300, share=0.9), _run(120.0, 2.0, 500, share=0.5), _run(90.0, 1.5, 400, share=0.7)],
        GENAI.name: [_run(80.0, 3.0, 200, output=(1, 2, 9, 4)), _run(40.0, 3.0, 200), _run(60.0, 3.0, 200)],
        LLAMA.name: llama_samples,
    }
    weights = {OURS.name: 100, GENAI.name: 80, LLAMA.name: 90}
    return summarize([OURS, GENAI, LLAMA], samples, weights)


def test_rows_are_medians_with_the_ceiling_share():
    row = _report([])["rows"][OURS.name]
    assert (row["decode_tok_s"], row["prefill_s"], row["peak_rss_bytes"], row["rounds"]) == (100.0, 1.5, 400, 3)
    assert row["of_ceiling"] == pytest.approx(0.7)
    assert row["bandwidth_bytes_per_s"] == pytest.approx(7e9)


def test_the_ceiling_share_pairs_each_burst_with_the_read_after_it_leaving_out_its_cold_tokens():
    assert (BURST, COLD) == (8, 2)
    # two bursts of 8 tokens: the first two of each slow (the prefill, or the first after a read), then
    # 4 and 6 ms (median 5) and 2 and 3 ms (median 2.5); the reads after them 3 ms and 1 ms; 8 tokens more
    # without their read are left out
    tokens = [0.1, 0.05, *[0.004] * 3, *[0.006] * 3, 0.05, 0.05, *[0.002] * 3, *[0.003] * 3, *[0.001] * 8]
    share = share_of_ceiling(tokens, [0.003, 0.001], 1_000_000)
    assert share["bursts"] == 2
    assert share["of_ceiling"] == pytest.approx((0.003 / 0.005 + 0.001 / 0.0025) / 2)
    assert share["bandwidth_bytes_per_s"] == pytest.approx(1_000_000 / 0.002)


class _Counting:
    """A runner whose tokens are 2 ms of sleep each, calling `after` after every one as the engines' runners do."""

    def each_token(self, ids, new_tokens, after):
        for _ in range(new_tokens):
            time.sleep(0.002)
            after()


def test_every_burst_gets_its_read():
    share = ceiling_share(_Counting(), [1, 2], 2, 1 << 20)
    assert share["bursts"] == 2
    assert share["of_ceiling"] > 0


def test_ratios_put_each_of_our_rows_over_each_peer():
    report = _report([_run(50.0, 6.0, 100, prompt=(7, 9))])
    ratios = {r["peer"]: r for r in report["ratios"]}
    assert set(ratios) == {GENAI.name, LLAMA.name}
    assert ratios[GENAI.name]["decode"] == pytest.approx(100.0 / 60.0)
    # round by round: ours 100, 120, 90 against its 80, 40, 60
    assert ratios[GENAI.name]["decode_by_round"] == pytest.approx([1.25, 3.0, 1.5])
    assert ratios[GENAI.name]["prefill_speed"] == pytest.approx(3.0 / 1.5)
    assert ratios[LLAMA.name]["peak_rss"] == pytest.approx(4.0)


def test_ratios_only_within_a_precision():
    samples = {OURS.name: [_run(100.0, 1.0, 300)], PLAIN.name: [_run(30.0, 1.0, 100)], GENAI.name: [_run(80.0, 3.0, 200)]}
    report = summarize([OURS, PLAIN, GENAI], samples, {OURS.name: 100, PLAIN.name: 540, GENAI.name: 80})
    assert [(r["ours"], r["peer"]) for r in report["ratios"]] == [(OURS.name, GENAI.name)]


def test_the_decode_ratio_at_equal_bandwidth_is_the_shares_per_weight_byte():
    samples = {OURS.name: [_run(100.0, 1.0, 300, share=0.6)], GENAI.name: [_run(80.0, 3.0, 200, share=0.5)]}
    report = summarize([OURS, GENAI], samples, {OURS.name: 100, GENAI.name: 80})
    # ours reads 100 bytes a token at 60% of the ceiling, the peer 80 at 50%: (0.6 / 100) / (0.5 / 80)
    assert report["ratios"][0]["decode_equal_bandwidth"] == pytest.approx(0.96)
    assert any(line.startswith(f"{OURS.name} / {GENAI.name}") and " 0.96x " in line for line in table(report))
    assert "decode_equal_bandwidth" not in _report([])["ratios"][0]  # the peer's rounds had no share


def test_greedy_agreement_only_between_rows_that_saw_the_same_prompt():
    report = _report([_run(50.0, 6.0, 100, prompt=(7, 9))])
    # the peer's first round diverges at the third token; llama.cpp's prompt ids differ, so it is not compared
    assert report["agreement"] == [{"ours": OURS.name, "peer": GENAI.name, "leading_tokens_equal": 2, "of": 4}]


def test_a_runner_not_installed_or_failing_is_a_row_saying_so():
    missing = _report([])
    assert missing["rows"][LLAMA.name]["error"] == NOT_INSTALLED
    assert [r["peer"] for r in missing["ratios"]] == [GENAI.name]
    failed = _report([{"error": "RuntimeError: no model"}])
    lines = table(failed)
    assert f"{LLAMA.name:<24} RuntimeError: no model" in lines
    assert any(line.startswith(f"{OURS.name:<24}    0.0 MB") for line in lines)


def test_a_row_without_a_share_of_the_ceiling_has_none():
    samples = {PLAIN.name: [_run(30.0, 1.0, 100)]}
    row = summarize([PLAIN], samples, {PLAIN.name: 540})["rows"][PLAIN.name]
    assert "of_ceiling" not in row
    assert " - " in table({"rows": {PLAIN.name: row}, "ratios": [], "agreement": []})[1]


def test_a_failed_round_is_left_out_of_the_medians_and_reported():
    samples = {OURS.name: [_run(100.0, 1.0, 300), {"error": "Segmentation fault"}, _run(80.0, 2.0, 500)],
               GENAI.name: [_run(80.0, 3.0, 200)] * 3}
    report = summarize([OURS, GENAI], samples, {OURS.name: 100, GENAI.name: 80})
    row = report["rows"][OURS.name]
    assert (row["rounds"], row["decode_tok_s"], row["failed"]) == (2, 90.0, ["Segmentation fault"])
    assert "a round of cann-llm int4 failed (left out of its medians): Segmentation fault" in table(report)
