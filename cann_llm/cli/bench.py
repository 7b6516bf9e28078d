"""`cann-run bench`: what the engine serves, measured, beside onnxruntime on the original export.

    cann-run bench --model smollm2-paged.om --onnx model.onnx --json bench.json

Batch-1 prefill and decode tokens/s; a closed loop of C clients (C = 1, 8, 32) over the same mixed-length
requests (prompts are windows of real text), with aggregate tokens/s, TTFT and TPOT p50/p99, KV page
utilisation and the sequences held for the KV memory used; the process's resident memory after loading
and at its peak over those runs; resident memory added by long prefills.
There are 128 requests by default, four per client at concurrency 32, so the batch holds C sequences for
most of a run; with as many requests as clients, each sends one, and the run measures a burst draining
(its first step has C prompts, its last one sequence), not C requests served concurrently.
With --onnx, onnxruntime runs the original model (KV-cache I/O) in a greedy loop on the same prompts,
in the same process, alternating with the engine so machine noise hits both alike. With
--num_speculative_tokens K, batch-1 decode is measured with prompt lookup as well as without it, and the
lowest concurrency is served once more without it.
"""

from __future__ import annotations

import statistics
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from functools import partial
from pathlib import Path

import click
import numpy as np

from cann_llm.cli.bench_settings import BenchSettings
from cann_llm.cli.common_options import shows_progress
from cann_llm.cli.json_output import write_json
from cann_llm.cli.llm_commands import engine_options, open_engine, refused
from cann_llm.models.data_files import EVAL_TEXT
from cann_llm.runtime.engine.setting_error import SettingError
from cann_llm.runtime.errors import invalid_value
from cann_llm.runtime.ort_session import session_options
from cann_llm.runtime.progress import Progress, progress
from cann_llm.runtime.signature import PAST_NAME, is_carried, present_name

DECODE_PROMPT_TOKENS = 128  # the prompt of each batch-1 decode measurement


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _windows(ids: list[int], lengths: list[int], rng: np.random.Generator) -> list[list[int]]:
    """Token windows of the given lengths at random places in the text."""
    out = []
    for length in lengths:
        start = int(rng.integers(0, max(1, len(ids) - length)))
        out.append(ids[start:start + length])
    return out


class OnnxRuntimeLoop:
    """onnxruntime on the original export with past/present I/O, driven by a greedy loop."""

    def __init__(self, path: str):
        import onnxruntime as ort

        # the same thread setup as the engine's sessions (cann_llm/runtime/ort_session.py)
        self.session = ort.InferenceSession(path, session_options(), providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.carried = {present_name(name): name for name in self.inputs if is_carried(name)}

    def generate(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        """Greedy generation; returns (time to first token, total time) in seconds."""
        start = time.perf_counter()
        ids = np.asarray([prompt], np.int64)
        # an empty cache, and a hybrid's recurrent states at zero (their sizes past the batch are fixed)
        past = {name: np.zeros((1, v.shape[1], 0, v.shape[3]) if PAST_NAME.match(name) else (1, *v.shape[1:]),
                               np.float32) for name, v in self.inputs.items() if is_carried(name)}
        length, first = 0, None
        for _ in range(new_tokens):
            feeds = {"input_ids": ids, **past}
            if "attention_mask" in self.inputs:
                feeds["attention_mask"] = np.ones((1, length + ids.shape[1]), np.int64)
            if "position_ids" in self.inputs:
                feeds["position_ids"] = np.arange(length, length + ids.shape[1], dtype=np.int64)[None]
            outputs = self.session.run(["logits", *self.carried], feeds)
            length += ids.shape[1]
            ids = np.asarray([[int(np.argmax(outputs[0][0, -1]))]], np.int64)
            past = {self.carried[name]: value for name, value in zip(self.carried, outputs[1:])}
            first = first or time.perf_counter() - start
        return first, time.perf_counter() - start


def _onnxruntime_loop(path: str) -> OnnxRuntimeLoop:
    """The loop on `path`; E10001 naming --onnx when onnxruntime cannot load it (not ONNX, external data
    missing, an operator it lacks)."""
    try:
        return OnnxRuntimeLoop(path)
    except Exception as error:  # onnxruntime's own exception types, by what it found wrong
        raise invalid_value(path, "onnx", f"onnxruntime cannot load it: {error}") from None


def _engine_generate(engine, prompt: list[int], new_tokens: int, cold: bool = True):
    """One greedy request; `cold` first empties the prefix cache, so no run reuses another's prompt pages."""
    if cold:
        engine.reset_prefix_cache()
    request = engine.submit(prompt, max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    request.result()
    return request.stats


@contextmanager
def _lookup(engine, num_tokens: int):
    """The engine drafts `num_tokens` tokens a step inside the block (0: none), its own setting after."""
    configured, engine.proposer.num_tokens = engine.proposer.num_tokens, num_tokens
    try:
        yield
    finally:
        engine.proposer.num_tokens = configured


def _batch1(engine, ort_loop, prompts_prefill, prompts_decode, decode_tokens) -> dict:
    """Prefill tokens/s (TTFT of a prompt) and decode tokens/s, alternating engine and onnxruntime.

    With speculation configured, the engine's decode is measured both without it ("engine") and with it
    ("engine+lookup", with the share of draft tokens accepted), on the same prompts.
    """
    lookup = engine.proposer.num_tokens
    rows = {"engine": {"prefill": [], "decode": []}, "engine+lookup": {"decode": []},
            "onnxruntime": {"prefill": [], "decode": []}}
    drafted = accepted = 0
    rounds = progress(list(zip(prompts_prefill, prompts_decode)), "batch-1", unit="round", enabled=shows_progress())
    for prefill_prompt, decode_prompt in rounds:
        with _lookup(engine, 0):
            stats = _engine_generate(engine, prefill_prompt, 1)
            rows["engine"]["prefill"].append(len(prefill_prompt) / stats.ttft_s)
            stats = _engine_generate(engine, decode_prompt, decode_tokens + 1)
            rows["engine"]["decode"].append(decode_tokens / (stats.total_s - stats.ttft_s))
        if lookup:
            before = engine.stats.draft_tokens, engine.stats.accepted_tokens
            stats = _engine_generate(engine, decode_prompt, decode_tokens + 1)
            rows["engine+lookup"]["decode"].append(decode_tokens / (stats.total_s - stats.ttft_s))
            drafted += engine.stats.draft_tokens - before[0]
            accepted += engine.stats.accepted_tokens - before[1]
        if ort_loop is not None:
            first, _ = ort_loop.generate(prefill_prompt, 1)
            rows["onnxruntime"]["prefill"].append(len(prefill_prompt) / first)
            first, total = ort_loop.generate(decode_prompt, decode_tokens + 1)
            rows["onnxruntime"]["decode"].append(decode_tokens / (total - first))
    report = {side: {k: statistics.median(v) for k, v in parts.items()} for side, parts in rows.items() if parts["decode"]}
    if lookup:
        report["engine+lookup"].update(num_speculative_tokens=lookup, draft_tokens=drafted,
                                       accepted_share=accepted / drafted if drafted else 0.0)
    return report


def _closed_loop(engine, requests: list[tuple[list[int], int]], concurrency: int) -> dict:
    """`concurrency` clients, each sending its next request when the previous one finishes."""
    queue = list(reversed(requests))
    lock = threading.Lock()
    done = []
    engine.stats.page_utilisation.clear()
    engine.stats.token_utilisation.clear()
    engine.stats.peak_running = 0

    def client():
        while True:
            with lock:
                if not queue:
                    return
                prompt, new_tokens = queue.pop()
            stats = _engine_generate(engine, prompt, new_tokens, cold=False)
            with lock:
                done.append(stats)
                bar.update()

    engine.blocks.peak_used = 0
    engine.reset_prefix_cache()  # each level starts cold, not with the pages of the one before
    start = time.perf_counter()
    with Progress(f"concurrency {concurrency}", len(requests), unit="request", enabled=shows_progress()) as bar:
        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    seconds = time.perf_counter() - start
    ttft = [s.ttft_s * 1e3 for s in done]
    tpot = [s.tpot_s * 1e3 for s in done if s.tpot_s is not None]
    generated = sum(s.output_tokens for s in done)
    return {"concurrency": concurrency, "lookup": engine.proposer.num_tokens, "requests": len(done), "seconds": seconds,
            "prompt_tokens": sum(s.prompt_tokens for s in done), "output_tokens": generated,
            "tokens_per_s": generated / seconds,
            "ttft_ms_p50": _percentile(ttft, 50), "ttft_ms_p99": _percentile(ttft, 99),
            "tpot_ms_p50": _percentile(tpot, 50), "tpot_ms_p99": _percentile(tpot, 99),
            "kv_page_utilisation": statistics.fmean(engine.stats.page_utilisation) if engine.stats.page_utilisation else None,
            "kv_token_utilisation": statistics.fmean(engine.stats.token_utilisation) if engine.stats.token_utilisation else None,
            "peak_sequences": engine.stats.peak_running, "peak_pages": engine.blocks.peak_used,
            "preemptions": sum(s.preemptions for s in done)}


def _resident_kib(field: str) -> int:
    return next(int(line.split()[1]) for line in Path("/proc/self/status").open() if line.startswith(field))


def _long_prefills(engine, ids: list[int], lengths: list[int], num_heads: int) -> list[dict]:
    """Peak resident memory added while prefilling `lengths` tokens (Linux's high-water mark, reset first:
    onnxruntime's allocations count too), the size of the prompt's KV pages (resident already where the
    pool reuses pages), and what one [H, S, S] score matrix would need."""
    rows = []
    for length in progress(lengths, "long prefills", unit="prefill", enabled=shows_progress()):
        prompt = (ids * (length // max(1, len(ids)) + 1))[:length]
        engine.reset_prefix_cache()
        before = _resident_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
        stats = _engine_generate(engine, prompt, 1)
        added = (_resident_kib("VmHWM") - before) * 1024
        kv = None
        if engine.paged:
            pool = engine.runner.pool
            kv = -(-length // engine.page_size) * pool.nbytes / pool.num_pages / 2**20
        rows.append({"tokens": length, "seconds": stats.ttft_s, "peak_rss_added_mb": added / 2**20,
                     "kv_pages_mb": kv, "full_scores_mb_per_layer": num_heads * length * length * 4 / 2**20})
    return rows


def _print_table(report: dict, err: bool) -> None:
    """The report as tables, on stderr when `err` (stdout then carries the JSON)."""
    echo = partial(click.echo, err=err)
    batch1 = report["batch1"]
    echo("batch 1            prefill tok/s   decode tok/s")
    for side, row in batch1.items():
        prefill = f"{row['prefill']:>13.1f}" if "prefill" in row else f"{'-':>13}"
        echo(f"{side:<18} {prefill} {row['decode']:>14.1f}")
    if "onnxruntime" in batch1:
        eng, ref = batch1["engine"], batch1["onnxruntime"]
        echo(f"{'ratio':<18} {eng['prefill'] / ref['prefill']:>12.2f}x {eng['decode'] / ref['decode']:>13.2f}x")
        if "engine+lookup" in batch1:
            echo(f"{'ratio with lookup':<18} {'-':>13} {batch1['engine+lookup']['decode'] / ref['decode']:>13.2f}x")
    if "engine+lookup" in batch1:
        row = batch1["engine+lookup"]
        echo(f"prompt lookup: {row['num_speculative_tokens']} draft tokens a step, "
                   f"{row['accepted_share']:.0%} of {row['draft_tokens']} accepted")
    echo("")
    echo("concurrency lookup requests  tok/s    TTFT p50/p99 ms   TPOT p50/p99 ms  KV pages live  peak seqs")
    for row in report["serving"]:
        # a contiguous artifact has no pages to report
        util = "-" if row["kv_page_utilisation"] is None else f"{row['kv_page_utilisation']:.3f}"
        echo(f"{row['concurrency']:>11} {row['lookup']:>6} {row['requests']:>8} {row['tokens_per_s']:>6.1f} "
                   f"{row['ttft_ms_p50']:>9.0f}/{row['ttft_ms_p99']:<7.0f} {row['tpot_ms_p50'] or 0:>8.1f}/"
                   f"{row['tpot_ms_p99'] or 0:<7.1f} {util:>13} "
                   f"{row['peak_sequences']:>10}")
    memory = report["kv_memory"]
    if memory["ratio"]:
        echo(f"\nKV memory: {memory['peak_sequences']} sequences in {memory['peak_pages']} pages; a contiguous "
                   f"{memory['max_context_len']}-token allocation per sequence fits {memory['contiguous_sequences']:.2f} "
                   f"in that memory ({memory['ratio']:.1f}x)")
    serving = report["serving"]
    busiest = max(serving, key=lambda row: row["concurrency"], default=None)
    for base in serving:
        if base["concurrency"] < busiest["concurrency"]:
            echo(f"aggregate tok/s at concurrency {busiest['concurrency']} / concurrency {base['concurrency']} "
                       f"(lookup {base['lookup']}): {busiest['tokens_per_s'] / base['tokens_per_s']:.2f}x")
    resident = report["resident_memory"]
    echo(f"resident memory: {resident['after_load_mb']:.0f} MB once loaded, peak {resident['peak_mb']:.0f} MB"
         + (" (the onnxruntime loop's session included)" if resident["includes_onnxruntime_loop"] else ""))
    for row in report["long_prefill"]:
        echo(f"prefill {row['tokens']:>5} tokens: {row['seconds']:.2f} s, peak resident memory added "
                   f"{row['peak_rss_added_mb']:.0f} MB (the prompt's KV pages: {row['kv_pages_mb'] or 0:.0f} MB, less "
                   f"where reused pages were resident; one full [H, S, S] score matrix: "
                   f"{row['full_scores_mb_per_layer']:.0f} MB)")


@click.command("bench")
@engine_options
@click.option("--onnx", "onnx_path", default=None, help="the original export with KV cache, run by onnxruntime beside")
@click.option("--text", "text_file", default=str(EVAL_TEXT), show_default=True, help="where prompts come from")
@click.option("--requests", "num_requests", type=click.IntRange(min=1), default=128, show_default=True,
              help="requests per concurrency level, the same ones at every level")
@click.option("--concurrency", default="1,8,32", show_default=True)
@click.option("--prompt_lengths", default="32,512", show_default=True, help="min,max prompt tokens")
@click.option("--output_lengths", default="32,128", show_default=True, help="min,max new tokens")
@click.option("--prefill_tokens", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--decode_tokens", type=click.IntRange(min=2), default=128, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--long_prefill", default="1024,2048,4096", show_default=True, help="prefill lengths to measure; '' skips")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", default="bench.json", show_default=True,
              help="where the report goes; - is stdout (the table then goes to stderr)")
def bench_command(onnx_path, text_file, num_requests, concurrency, prompt_lengths, output_lengths, prefill_tokens,
                  decode_tokens, repeats, long_prefill, seed, json_path, **engine_kwargs) -> None:
    """Measure batch-1 latency, serving throughput and KV memory; print a table and write JSON."""
    bench = BenchSettings.from_flags(onnx=onnx_path, text_file=text_file, requests=num_requests,
                                     concurrency=concurrency, prompt_lengths=prompt_lengths,
                                     output_lengths=output_lengths, prefill_tokens=prefill_tokens,
                                     decode_tokens=decode_tokens, repeats=repeats, long_prefill=long_prefill, seed=seed)
    levels = bench.concurrency
    # raised past what was given (or the default) to what the bench sends: every client runs at once, and a
    # prompt of N tokens has room for N + 1
    prompts = [DECODE_PROMPT_TOKENS, *bench.prompt_sizes().values()]
    forced = {"max_batch_size": max([engine_kwargs["max_batch_size"], *levels]),
              "max_context_len": max([engine_kwargs["max_context_len"], *(n + 1 for n in prompts)])}
    rng = np.random.default_rng(seed)
    with open_engine(forced=forced, **engine_kwargs) as engine:
        # a model that reads its positions from a table holds fewer than asked: say so before measuring
        bench.check_fits(engine.max_context_len)
        loaded_kib = _resident_kib("VmRSS")
        try:  # the bench's prompts are text: a model compiled without a tokenizer is the one to change
            ids = engine._require_tokenizer().encode(bench.text)
        except SettingError as error:
            raise refused(error, "--model", engine_kwargs["model"]) from None
        ort_loop = _onnxruntime_loop(onnx_path) if onnx_path else None
        # load the kernels and warm the sessions (a prefill as long as the measured ones, then decodes)
        _engine_generate(engine, ids[:prefill_tokens], 4)
        if ort_loop is not None:
            ort_loop.generate(ids[:prefill_tokens], 4)
        batch1 = _batch1(engine, ort_loop, _windows(ids, [prefill_tokens] * repeats, rng),
                         _windows(ids, [DECODE_PROMPT_TOKENS] * repeats, rng), decode_tokens)
        low, high = bench.prompt_lengths
        out_low, out_high = bench.output_lengths
        requests = list(zip(_windows(ids, rng.integers(low, high + 1, num_requests).tolist(), rng),
                            rng.integers(out_low, out_high + 1, num_requests).tolist()))
        serving = [_closed_loop(engine, requests, level) for level in levels]
        if engine.proposer.num_tokens:  # the lowest concurrency again, one token a step
            with _lookup(engine, 0):
                serving.append(_closed_loop(engine, requests, min(levels)))
        # before the long prefills, which restart the high-water mark
        resident = {"after_load_mb": loaded_kib / 1024, "peak_mb": _resident_kib("VmHWM") / 1024,
                    "includes_onnxruntime_loop": ort_loop is not None}
        busiest = max(serving, key=lambda row: row["peak_sequences"])
        fits = busiest["peak_pages"] * engine.page_size / engine.max_context_len
        report = {
            "model": engine_kwargs["model"], "onnx": onnx_path, "paged": engine.paged, "page_size": engine.page_size,
            # the engine's own settings: what it ran with, the artifact's tuned ones included
            "settings": {**engine_kwargs, **asdict(engine.config), "requests": num_requests, "prompt_lengths": [low, high],
                         "output_lengths": [out_low, out_high], "prefill_tokens": prefill_tokens,
                         "decode_tokens": decode_tokens, "repeats": repeats, "seed": seed},
            "batch1": batch1, "serving": serving, "resident_memory": resident,
            "kv_memory": {"peak_sequences": busiest["peak_sequences"], "peak_pages": busiest["peak_pages"],
                          "max_context_len": engine.max_context_len, "contiguous_sequences": fits,
                          "ratio": busiest["peak_sequences"] / fits if fits else None},
            "long_prefill": _long_prefills(engine, ids, list(bench.long_prefill), engine.dims.get("num_heads", 0)),
        }
    to_stdout = json_path == "-"
    _print_table(report, err=to_stdout)
    write_json(json_path, report)
    if not to_stdout:
        click.echo(f"[INFO] wrote {json_path}")
