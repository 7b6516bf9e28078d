"""Batch-1 decode and a long prefill with the native library's matmuls against onnxruntime's, in one process.

    python benchmarks/native_matmul_ab.py --om .cache/peers/smollm2-fp32.om [--rounds 9] [--steps 128]
                                          [--prefill 512] [--threads 2]

Two engines on the same artifact, one with `native_matmul` on (float32 weights laid out in panels at load for
MatMulF32, 4- and 8-bit ones on MatMulInt4: docs/runtime.md#paged-kv-cache), one with it off (onnxruntime's
MatMul on its pre-packed weights, and MatMulNBits), both on onnxruntime's process-wide pool as `cann-run`
runs them. Each round every engine decodes --steps tokens greedily after the same 32-token prompt, then
prefills a --prefill-token prompt of its own (a new one every round, so the prefix cache never serves it), in
turn, so the machine's noise falls on both alike; it prints each engine's milliseconds a token and a prefill
round by round, the ratios (off over on: above 1 is faster with the native matmuls) with their medians, and
whether the two decoded the same tokens.
"""

from __future__ import annotations

import statistics
import time

import click

from cann_llm.runtime.engine.engine import LLMEngine

PROMPT = [7 + i % 190 for i in range(32)]


def _prompt(length: int, seed: int) -> list[int]:
    return [7 + (i * 37 + seed * 101) % 9000 for i in range(length)]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", "om_path", required=True, help="a paged artifact")
@click.option("--rounds", default=9, show_default=True)
@click.option("--steps", default=128, show_default=True, help="tokens decoded a round (EOS held off)")
@click.option("--prefill", default=512, show_default=True, help="tokens of the prompt prefilled a round (0: none)")
@click.option("--threads", default=2, show_default=True)
def main(om_path: str, rounds: int, steps: int, prefill: int, threads: int) -> None:
    """Time decode steps and prefills with native_matmul on and off, alternating."""
    engines = {}
    for native in (True, False):
        start = time.perf_counter()
        engines[native] = LLMEngine(om_path, max_batch_size=1, max_context_len=max(len(PROMPT) + steps, prefill) + 8,
                                    kv_cache_pages=64, threads=threads, process_thread_pool=True, native_matmul=native)
        click.echo(f"native_matmul {'on ' if native else 'off'}: loaded in {time.perf_counter() - start:.2f} s")
    decode: dict[bool, list[float]] = {True: [], False: []}
    prefills: dict[bool, list[float]] = {True: [], False: []}
    tokens = {}
    try:
        for engine in engines.values():  # warm-up
            engine.generate(PROMPT, max_new_tokens=4, temperature=0.0, ignore_eos=True)
        for round_ in range(rounds):
            for native, engine in engines.items():
                start = time.perf_counter()
                tokens[native] = engine.generate(PROMPT, max_new_tokens=steps, temperature=0.0, ignore_eos=True)
                decode[native].append((time.perf_counter() - start) / steps * 1e3)
                if prefill:
                    start = time.perf_counter()
                    engine.generate(_prompt(prefill, 2 * round_ + native), max_new_tokens=1, temperature=0.0,
                                    ignore_eos=True)
                    prefills[native].append((time.perf_counter() - start) * 1e3)
    finally:
        for engine in engines.values():
            engine.close()
    for name, times, unit in (("decode", decode, "ms a token"), ("prefill", prefills, "ms")):
        if not times[True]:
            continue
        for native in (True, False):
            click.echo(f"{name} native_matmul {'on ' if native else 'off'}: {statistics.median(times[native]):8.2f} {unit}"
                       "   " + " ".join(f"{v:.2f}" for v in times[native]))
        ratios = [off / on for on, off in zip(times[True], times[False])]
        click.echo(f"{name} off / on: {statistics.median(ratios):.3f}x   by round " + " ".join(f"{r:.2f}" for r in ratios))
    click.echo(f"the same tokens: {tokens[True] == tokens[False]}")


if __name__ == "__main__":
    main()
