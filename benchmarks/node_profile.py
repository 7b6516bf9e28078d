"""Where a paged artifact's node time goes, by op type, from onnxruntime's own profiler on the engine's session.

    python benchmarks/node_profile.py --om .cache/peers/smollm2-int4-awq-head4.om --work decode   # 100 tokens, batch 1
    python benchmarks/node_profile.py --om ... --work prefill [--tokens 512]                  # three prefills
    python benchmarks/node_profile.py --om ... --work mix [--requests 64]                     # peers_concurrency's mix

The engine runs as `cann-run bench` runs it (onnxruntime's process-wide pool, --threads), with profiling on
for its session. It prints each op type's node time per run (decode: the 100 steps after the prompt's;
prefill: the three prompts) or in all (mix), its share and its count per run. For the mix
(benchmarks/peers_concurrency.py's requests, seed 0, 32 closed-loop clients) it also times the engine's
steps: those that carry prompt tokens and those that only decode. The profiler adds a few microseconds to
every node, so shares are more telling than absolute times.
"""

from __future__ import annotations

import bisect
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers_concurrency, beside this file

import cann_llm.runtime.executor as executor_module  # noqa: E402
from cann_llm.runtime.engine.engine import LLMEngine  # noqa: E402


def profiled(folder: str) -> None:
    """Session options with onnxruntime's profiler on, writing into `folder`, for every session from now."""
    plain = executor_module.session_options

    def with_profiling(threads=None):
        options = plain(threads)
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(folder) / "session")
        return options
    executor_module.session_options = with_profiling


def node_times(path: str, work: str) -> tuple[dict[str, float], collections.Counter, list[float]]:
    """Microseconds and node counts per op type over the runs that are the work, and each run's wall
    microseconds: for a decode the runs after its prompt's, for prefills the long runs (at least half the
    longest: not the engine's warm-up), for the mix every run."""
    events = json.loads(Path(path).read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
    if work == "decode":
        runs = runs[-100:]
    elif work == "prefill":
        longest = max(end - start for start, end in runs)
        runs = [(start, end) for start, end in runs if end - start >= longest / 2]
    starts = [start for start, _ in runs]
    times: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            at = bisect.bisect_right(starts, event["ts"]) - 1
            if at >= 0 and event["ts"] <= runs[at][1]:
                times[event["args"]["op_name"]] += event["dur"]
                counts[event["args"]["op_name"]] += 1
    return times, counts, [end - start for start, end in runs]


def run_mix(engine: LLMEngine, requests: int) -> list[str]:
    """peers_concurrency's mix on 32 clients; the step times it split into prompt-carrying and decode-only."""
    from peers_concurrency import request_mix

    from cann_llm.cli.bench import _closed_loop
    from cann_llm.models.data_files import EVAL_TEXT

    mix = request_mix(engine.tokenizer.encode(EVAL_TEXT.read_text()), requests, 0)
    steps = {"with prompt tokens": [0, 0, 0.0], "decode only": [0, 0, 0.0]}
    run = engine.runner.run

    def timed(batch):
        start = time.perf_counter()
        try:
            return run(batch)
        finally:
            part = steps["decode only" if batch.total_tokens <= len(batch.seqs) else "with prompt tokens"]
            part[0] += 1
            part[1] += batch.total_tokens
            part[2] += time.perf_counter() - start
    engine.runner.run = timed
    row = _closed_loop(engine, mix, 32)
    lines = [f"{requests} requests: {row['tokens_per_s']:.1f} output tok/s, {row['seconds']:.1f} s"]
    lines += [f"  steps {name}: {count}, {tokens} tokens, {seconds:.2f} s ({1000 * seconds / max(count, 1):.1f} ms each)"
              for name, (count, tokens, seconds) in steps.items()]
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", "om_path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--work", type=click.Choice(["decode", "prefill", "mix"]), default="decode", show_default=True)
@click.option("--tokens", default=512, show_default=True, help="prefill: the prompt's tokens")
@click.option("--requests", default=64, show_default=True, help="mix: how many requests")
@click.option("--threads", default=2, show_default=True)
def main(om_path: str, work: str, tokens: int, requests: int, threads: int) -> None:
    """Print node time by op type for one kind of work."""
    with tempfile.TemporaryDirectory() as folder:
        profiled(folder)
        batch, context = (32, 1100) if work == "mix" else (1, tokens + 200)
        engine = LLMEngine(om_path, max_batch_size=batch, max_context_len=context,
                           kv_cache_pages=batch * -(-context // 128) + 8, threads=threads, process_thread_pool=True)
        try:
            lines = []
            if work == "decode":
                engine.generate([5 + i for i in range(32)], max_new_tokens=101, temperature=0.0, ignore_eos=True)
            elif work == "prefill":
                for i in range(3):
                    engine.generate([5 + (i * 7 + j) % 3000 for j in range(tokens)], max_new_tokens=1,
                                    temperature=0.0, ignore_eos=True)
            else:
                lines = run_mix(engine, requests)
            path = engine.runner.executor._steps[0]._session.end_profiling()
        finally:
            engine.close()
        times, counts, walls = node_times(path, work)
    runs, total = len(walls), sum(times.values())
    per = 1 if work == "mix" else max(runs, 1)
    unit = "in all" if work == "mix" else "a run"
    for line in lines:
        click.echo(line)
    click.echo(f"{runs} session runs; node time {total / per / 1000:.2f} ms {unit}; a run's wall time "
               f"{statistics.median(walls) / 1000:.2f} ms (median: the rest is onnxruntime between nodes)")
    for op, microseconds in sorted(times.items(), key=lambda item: -item[1])[:10]:
        click.echo(f"  {op:36s} {microseconds / per / 1000:9.2f} ms {unit}  {100 * microseconds / total:5.1f}%  "
                   f"{counts[op] / max(runs, 1):6.1f} a run")


if __name__ == "__main__":
    main()
