"""What the paged kernels' bounds checks cost a batch-1 decode step: the step with the checks and with them
stubbed out, alternating step by step (so machine noise hits both alike), and the checks alone.

    python -m benchmarks.paged_checks --om paged.om [--context 128] [--steps 100]
"""

from __future__ import annotations

import statistics
import time

import click
import numpy as np

from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.engine.kv_cache import PagePool
from cann_llm.runtime.kernels import paged_attention
from cann_llm.runtime.ops import paged_metadata_feeds


def _decode_feeds(position: int, page_size: int) -> dict[str, np.ndarray]:
    pages = list(range(position // page_size + 1))
    return {"input_ids": np.array([[1]], np.int64), "position_ids": np.array([[position]], np.int64),
            **paged_metadata_feeds([0, 1], [position + 1], [pages], [position]),
            "logits_indices": np.array([0], np.int64)}


def _per_call_us(fn, calls: int = 2000) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", required=True, help="a paged artifact")
@click.option("--context", type=click.IntRange(min=1), default=128, show_default=True,
              help="the position of the decoded token")
@click.option("--steps", type=click.IntRange(min=2), default=100, show_default=True)
def main(om: str, context: int, steps: int) -> None:
    """Print the medians of a decode step with and without the checks, and the checks' own cost."""
    loaded = load_artifact(om)
    dims, page_size = loaded.metadata["model"], loaded.kv_cache["page_size"]
    executor = Executor(loaded)
    pool = PagePool.of(dims, context // page_size + 1, page_size)
    feeds = _decode_feeds(context, page_size)
    checks = (paged_attention._check_operands, paged_attention.check_paged_metadata)
    stubs = (lambda *args, **kwargs: None,) * 2
    for _ in range(5):
        executor.run(feeds, ["logits"], kv_cache=pool)
    times: dict[str, list[float]] = {"with checks": [], "without": []}
    try:
        for step in range(steps):
            order = [("with checks", checks), ("without", stubs)]
            for label, (operands, metadata) in order if step % 2 else order[::-1]:
                paged_attention._check_operands, paged_attention.check_paged_metadata = operands, metadata
                start = time.perf_counter()
                executor.run(feeds, ["logits"], kv_cache=pool)
                times[label].append(time.perf_counter() - start)
    finally:
        paged_attention._check_operands, paged_attention.check_paged_metadata = checks
    for label, values in times.items():
        click.echo(f"step {label}: median {statistics.median(values) * 1000:.2f} ms over {len(values)}")
    query = np.zeros((1, 1, (dims["num_heads"] + 2 * dims["num_kv_heads"]) * dims["head_dim"]), np.float32)
    metadata_us = _per_call_us(lambda: paged_attention.check_paged_metadata(
        feeds["query_start_loc"], feeds["seq_lens"], feeds["block_tables"], feeds["slot_mapping"], pool.num_pages,
        page_size, 1))
    operands_us = _per_call_us(lambda: paged_attention._check_operands(
        query, None, None, None, None, pool, 0, dims["num_heads"], dims["num_kv_heads"], dims["head_dim"]))
    click.echo(f"checks alone: metadata {metadata_us:.1f} us once a step, operands {operands_us:.1f} us x "
               f"{dims['num_layers']} layers = {metadata_us + operands_us * dims['num_layers']:.0f} us a step")


if __name__ == "__main__":
    main()
