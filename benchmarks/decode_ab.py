"""Batch-1 decode on this checkout's native library against another git revision's, in one process.

    python benchmarks/decode_ab.py --om .cache/peers/smollm2-int4-awq-head4.om --baseline HEAD~1 [--rounds 9]
                                   [--steps 128] [--threads 2] [--avx2]

Two engines on the same artifact, one registering the native library built from this checkout, one the
library of --baseline (benchmarks/native_ab.py builds it from that revision's files with this machine's
compiler), both on onnxruntime's process-wide pool as `cann-run` runs them. Each round every engine decodes
--steps tokens greedily after the same 32-token prompt, in turn, so the machine's noise falls on both alike;
it prints the milliseconds a token of each round, the ratio round by round (baseline over this checkout:
above 1 is faster here), their median, and whether the two generated the same tokens. --avx2 builds both
libraries with `-mno-avx512f` (the AVX2 kernels, on an AVX-512 machine).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))  # native_ab and engine_rounds, beside this file

import cann_llm.runtime.kernels.native as native  # noqa: E402
from engine_rounds import decode_rounds, report  # noqa: E402
from native_ab import HERE, libraries  # noqa: E402
from cann_llm.runtime.engine.engine import LLMEngine  # noqa: E402

PROMPT = [7 + i % 190 for i in range(32)]


def engine_on(library: Path, om_path: str, steps: int, threads: int) -> LLMEngine:
    """An engine whose sessions register `library` (the executor asks `native.library_path` as it loads)."""
    chosen = native.library_path
    native.library_path = lambda: library
    try:
        engine = LLMEngine(om_path, max_batch_size=1, max_context_len=len(PROMPT) + steps + 8, kv_cache_pages=64,
                           threads=threads, process_thread_pool=True)
    finally:
        native.library_path = chosen
    engine.generate(PROMPT, max_new_tokens=4, temperature=0.0, ignore_eos=True)  # warm-up
    return engine


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", "om_path", required=True, help="a paged artifact")
@click.option("--baseline", required=True, help="the git revision whose native library is the baseline")
@click.option("--rounds", default=9, show_default=True)
@click.option("--steps", default=128, show_default=True, help="tokens decoded a round (EOS held off)")
@click.option("--threads", default=2, show_default=True)
@click.option("--avx2", is_flag=True, help="both libraries built with -mno-avx512f")
def main(om_path: str, baseline: str, rounds: int, steps: int, threads: int, avx2: bool) -> None:
    """Time batch-1 decode steps on two native libraries, alternating."""
    flags = ("-mno-avx512f",) if avx2 else ()
    with tempfile.TemporaryDirectory() as scratch:
        engines = {name: engine_on(library, om_path, steps, threads)
                   for name, library in libraries(baseline, Path(scratch), flags).items()}
        times, tokens = decode_rounds(engines, PROMPT, steps, rounds)
    click.echo(report(times, tokens, {name: name for name in times}, faster=HERE, slower=baseline))


if __name__ == "__main__":
    main()
