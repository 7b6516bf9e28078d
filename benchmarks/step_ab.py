"""Paged batch-1 decode steps on this checkout's native library against another revision's, alternating step
by step in one process.

    python benchmarks/step_ab.py --om .cache/peers/smollm2-fp32.om --baseline HEAD~1 [--steps 100] [--context 128]

`decode_ab.py` alternates whole rounds of 128 tokens; this host's read bandwidth moves between regimes for
seconds at a time (a two-thread read of 542 MB took 9 ms in some minutes and 15 ms in others), so a round can
fall in one regime and the next in another. Here the two executors (same artifact, one KV pool each, the
same 128 cached tokens) take turns every step, the order reversed every other step, and the ratio is the
median of the per-step ratios (baseline over this checkout: above 1 is faster here), beside each side's
median step. It prints the logits' largest difference too: two libraries computing alike give the same
numbers to rounding. The artifact's ops are chosen by what this checkout's library registers: a baseline from
before MatMulF32 or MatMulF28 existed cannot run them.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # native_ab, beside this file

from native_ab import HERE, libraries  # noqa: E402
from cann_llm.runtime import Executor, load_artifact  # noqa: E402
from cann_llm.runtime.engine.kv_cache import PagePool  # noqa: E402
from cann_llm.runtime.kernels import native  # noqa: E402
from cann_llm.runtime.ort_session import enable_process_thread_pool  # noqa: E402


def executor_on(library: Path, om_path: str, context: int, steps: int) -> tuple[Executor, PagePool, np.ndarray]:
    """An executor whose sessions register `library`, its page pool and block table, `context` tokens cached."""
    loaded = load_artifact(om_path)
    chosen = native.library_path
    native.library_path = lambda: library
    try:
        executor = Executor(loaded)
    finally:
        native.library_path = chosen
    page_size, dims = loaded.metadata["kv_cache"]["page_size"], loaded.metadata["model"]
    pages = -(-(context + steps + 2) // page_size)
    pool = PagePool.of(dims, pages, page_size)
    table = np.arange(pages, dtype=np.int32)[None]
    ids, positions = (np.arange(context) % 1000 + 5).astype(np.int64), np.arange(context, dtype=np.int64)
    executor.run({"input_ids": ids[None], "position_ids": positions[None],
                  "query_start_loc": np.array([0, context], np.int32), "seq_lens": np.array([context], np.int32),
                  "block_tables": table, "slot_mapping": positions, "logits_indices": np.array([context - 1])},
                 kv_cache=pool)
    return executor, pool, table


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", "om_path", required=True, help="a paged artifact")
@click.option("--baseline", required=True, help="the git revision whose native library is the baseline")
@click.option("--steps", default=100, show_default=True, type=click.IntRange(min=3),
              help="decode steps each (the first two are not counted)")
@click.option("--context", default=128, show_default=True, help="tokens cached before the measured steps")
@click.option("--threads", default=2, show_default=True)
def main(om_path: str, baseline: str, steps: int, context: int, threads: int) -> None:
    """Time decode steps on two native libraries, alternating every step."""
    enable_process_thread_pool(threads)
    with tempfile.TemporaryDirectory() as scratch:
        runs = {name: executor_on(library, om_path, context, steps)
                for name, library in libraries(baseline, Path(scratch)).items()}
    names = [HERE, baseline]
    times: dict[str, list[float]] = {name: [] for name in names}
    largest = 0.0
    for step in range(steps):
        position = context + step
        logits = {}
        for name in names if step % 2 == 0 else names[::-1]:
            executor, pool, table = runs[name]
            feeds = {"input_ids": np.array([[5]]), "position_ids": np.array([[position]]),
                     "query_start_loc": np.array([0, 1], np.int32), "seq_lens": np.array([position + 1], np.int32),
                     "block_tables": table, "slot_mapping": np.array([position]), "logits_indices": np.array([0])}
            start = time.perf_counter()
            logits[name] = executor.run(feeds, ["logits"], kv_cache=pool)["logits"]
            times[name].append(time.perf_counter() - start)
        largest = max(largest, float(np.max(np.abs(logits[HERE] - logits[baseline]))))
    kept = {name: values[2:] for name, values in times.items()}  # the first steps warm the new positions' pages
    ratios = [b / h for h, b in zip(kept[HERE], kept[baseline])]
    for name in names:
        click.echo(f"{name}: {statistics.median(kept[name]) * 1000:.2f} ms a step")
    click.echo(f"{baseline} / {HERE}: {statistics.median(ratios):.3f}x (median of {len(ratios)} per-step ratios; "
               f"quartiles {np.percentile(ratios, 25):.3f}-{np.percentile(ratios, 75):.3f})")
    click.echo(f"largest logit difference: {largest:.2e}")


if __name__ == "__main__":
    main()
