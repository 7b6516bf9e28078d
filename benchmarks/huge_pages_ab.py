"""Batch-1 decode with the native matmuls' weights read from huge pages against without, in one process.

    python benchmarks/huge_pages_ab.py --om .cache/peers/smollm2-int4-awq-head4.om [--rounds 11] [--steps 128]
                                       [--threads 2]      # or an FP32 or F28 artifact

Two engines on the same artifact, one with `huge_pages` on (each native MatMulInt4's weight copied at load into
memory mapped in 2 MB pages: cann_llm/runtime/huge_pages.py; MatMulF32's panels laid out in such memory; MatMulF28's
panels read from the artifact's own mapping, whose page cache `atc` leaves in huge folios), one with it off
(onnxruntime maps each weight of the artifact on its own: only the huge folios wholly inside a weight map as
one; numpy's panels in huge pages only where 4 MB or more), both on onnxruntime's process-wide pool as
`cann-run` runs them. Each round every engine decodes --steps tokens greedily after the same 32-token prompt,
in turn, so the machine's noise falls on both alike; it prints each engine's milliseconds a token round by
round, the ratio (off over on: above 1 is faster with huge pages) with its median, the huge pages this process
holds (anonymous, and of files mapped), and whether the two decoded the same tokens.
"""

from __future__ import annotations


import click

from engine_rounds import decode_rounds, report

from cann_llm.runtime.engine.engine import LLMEngine
from cann_llm.runtime.huge_pages import huge_pages_given

PROMPT = [7 + i % 190 for i in range(32)]


def _huge_mib(kind: str) -> float:
    """MiB this process maps in huge pages: `AnonHugePages` (its own memory) or `FilePmdMapped` (files')."""
    with open("/proc/self/smaps_rollup") as rollup:
        return next(int(line.split()[1]) / 1024 for line in rollup if line.startswith(f"{kind}:"))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", "om_path", required=True, help="a paged artifact with 4- or 8-bit, FP32 or F28 weights")
@click.option("--rounds", default=11, show_default=True)
@click.option("--steps", default=128, show_default=True, help="tokens decoded a round (EOS held off)")
@click.option("--threads", default=2, show_default=True)
def main(om_path: str, rounds: int, steps: int, threads: int) -> None:
    """Time decode steps with the streamed weights read from huge pages and without, alternating."""
    if not huge_pages_given():
        raise click.ClickException("this kernel gives no transparent huge pages (/sys/kernel/mm/transparent_hugepage)")
    engines = {huge: LLMEngine(om_path, max_batch_size=1, max_context_len=len(PROMPT) + steps + 8, kv_cache_pages=64,
                               threads=threads, process_thread_pool=True, huge_pages=huge) for huge in (True, False)}
    for engine in engines.values():  # warm-up
        engine.generate(PROMPT, max_new_tokens=4, temperature=0.0, ignore_eos=True)
    click.echo(f"huge pages held: {_huge_mib('AnonHugePages'):.0f} MiB anonymous, "
               f"{_huge_mib('FilePmdMapped'):.0f} MiB of files")
    times, tokens = decode_rounds(engines, PROMPT, steps, rounds)
    click.echo(report(times, tokens, {True: "huge_pages on", False: "huge_pages off"}, faster=True, slower=False))


if __name__ == "__main__":
    main()
