"""Batch-1 decode with the native matmuls' weights in huge pages against the artifact's own pages, in one process.

    python benchmarks/huge_pages_ab.py --om .cache/peers/smollm2-int4-awq-head4.om [--rounds 11] [--steps 128]
                                       [--threads 2]

Two engines on the same artifact, one with `huge_pages` on (each native MatMulInt4's weight copied at load into
memory mapped in 2 MB pages: runtime/huge_pages.py), one with it off (the weights read in place from the
artifact's mapping, 4 KB pages), both on
onnxruntime's process-wide pool as `cann-run` runs them. Each round every engine decodes --steps tokens
greedily after the same 32-token prompt, in turn, so the machine's noise falls on both alike; it prints each
engine's milliseconds a token round by round, the ratio (4 KB over 2 MB pages: above 1 is faster with huge
pages) with its median, the huge pages this process holds, and whether the two decoded the same tokens.
"""

from __future__ import annotations

import statistics

import click

from engine_rounds import decode_rounds

from runtime.engine.engine import LLMEngine
from runtime.huge_pages import huge_pages_given

PROMPT = [7 + i % 190 for i in range(32)]


def _anonymous_huge_mib() -> float:
    with open("/proc/self/smaps_rollup") as rollup:
        return next(int(line.split()[1]) / 1024 for line in rollup if line.startswith("AnonHugePages:"))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", "om_path", required=True, help="a paged artifact with 4- or 8-bit weights")
@click.option("--rounds", default=11, show_default=True)
@click.option("--steps", default=128, show_default=True, help="tokens decoded a round (EOS held off)")
@click.option("--threads", default=2, show_default=True)
def main(om_path: str, rounds: int, steps: int, threads: int) -> None:
    """Time decode steps with the weights in huge pages and in the artifact's pages, alternating."""
    if not huge_pages_given():
        raise click.ClickException("this kernel gives no transparent huge pages (/sys/kernel/mm/transparent_hugepage)")
    engines = {huge: LLMEngine(om_path, max_batch_size=1, max_context_len=len(PROMPT) + steps + 8, kv_cache_pages=64,
                               threads=threads, process_thread_pool=True, huge_pages=huge) for huge in (True, False)}
    click.echo(f"huge pages held: {_anonymous_huge_mib():.0f} MiB")
    for engine in engines.values():  # warm-up
        engine.generate(PROMPT, max_new_tokens=4, temperature=0.0, ignore_eos=True)
    times, tokens = decode_rounds(engines, PROMPT, steps, rounds)
    for huge, values in times.items():
        click.echo(f"{'2 MB pages' if huge else '4 KB pages'}: {statistics.median(values):.3f} ms a token   "
                   + " ".join(f"{v:.2f}" for v in values))
    ratios = [small / large for large, small in zip(times[True], times[False])]
    click.echo(f"4 KB / 2 MB pages: {statistics.median(ratios):.3f}x   by round " + " ".join(f"{r:.2f}" for r in ratios))
    click.echo(f"the same tokens: {tokens[True] == tokens[False]}")


if __name__ == "__main__":
    main()
