"""What a second process serving the same artifact costs, with onnxruntime's pre-packed weights private to each
process (the default) and shared through the on-disk cache (`share_weights`, cann_llm/runtime/prepacked_cache.py).

    python benchmarks/shared_weights.py --om .cache/peers/smollm2-fp32.om [--rounds 3] [--tokens 96]

Each round, per setting: process A loads the artifact and decodes (greedy, batch 1, EOS held off), then
process B does the same while A stays loaded; the memory B adds is the sum of both processes' PSS minus A's
PSS alone (/proc/<pid>/smaps_rollup), and the decode rate is each process's own, measured while the other
idles. The settings alternate within a round; medians over rounds. The cache is written in a temporary
folder before the first round, so every measured load maps it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
PROMPT = list(range(1, 33))


def _rollup(pid: int) -> dict[str, float]:
    """smaps_rollup's fields in MiB."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            parts = line.split()
            if len(parts) >= 3 and parts[0].endswith(":"):
                fields[parts[0][:-1]] = int(parts[1]) / 1024
    return fields


def child(om: str, share: bool, tokens: int) -> None:
    """Load, decode, report the rate on stdout, then hold the engine until stdin closes."""
    sys.path.insert(0, str(ROOT))
    from cann_llm.runtime.engine.engine import LLMEngine
    from cann_llm.runtime.engine.sampling import SamplingParams

    engine = LLMEngine(om, process_thread_pool=True, max_batch_size=1, kv_cache_pages=16, share_weights=share)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.generate([PROMPT], params)
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        engine.generate([PROMPT], params)
        rates.append(tokens / (time.perf_counter() - start))
    print(json.dumps({"tok_s": statistics.median(rates)}), flush=True)
    sys.stdin.readline()


def _start(om: str, share: bool, tokens: int, env: dict) -> tuple[subprocess.Popen, float]:
    process = subprocess.Popen([sys.executable, __file__, "--child", "--om", om, "--tokens", str(tokens),
                                *(["--share"] if share else [])], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env=env)
    return process, json.loads(process.stdout.readline())["tok_s"]


def _pair(om: str, share: bool, tokens: int, env: dict) -> dict:
    a, rate_a = _start(om, share, tokens, env)
    alone = _rollup(a.pid)["Pss"]
    b, rate_b = _start(om, share, tokens, env)
    both = _rollup(a.pid)["Pss"] + _rollup(b.pid)["Pss"]
    for process in (a, b):
        process.stdin.close()
        process.wait()
    return {"alone": alone, "added": both - alone, "rate": statistics.mean([rate_a, rate_b])}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", required=True, help="the artifact two processes serve")
@click.option("--rounds", default=3, show_default=True)
@click.option("--tokens", default=96, show_default=True, help="new tokens per timed generation")
@click.option("--child", "is_child", is_flag=True, hidden=True)
@click.option("--share", is_flag=True, hidden=True)
def main(om: str, rounds: int, tokens: int, is_child: bool, share: bool) -> None:
    """Print each round's figures, then the medians and the ratios."""
    if is_child:
        child(om, share, tokens)
        return
    size = Path(om).stat().st_size / 2**20
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "CANN_LLM_CACHE": cache}
        _pair(om, True, 8, env)  # writes the cache: the rounds measure loads that map it
        results: dict[str, list[dict]] = {"private": [], "shared": []}
        for number in range(1, rounds + 1):
            for name in results:
                results[name].append(_pair(om, name == "shared", tokens, env))
            click.echo(f"round {number}: " + ", ".join(
                f"{name} +{r[-1]['added']:.0f} MiB {r[-1]['rate']:.1f} tok/s" for name, r in results.items()))
    click.echo(f"artifact {Path(om).name}: {size:.0f} MiB")
    medians = {name: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for name, rows in results.items()}
    for name, m in medians.items():
        click.echo(f"{name:>7}: one process {m['alone']:.0f} MiB PSS; a second adds {m['added']:.0f} MiB "
                   f"({m['added'] / size:.2f}x the artifact); decode {m['rate']:.1f} tok/s")
    click.echo(f"shared/private decode: {medians['shared']['rate'] / medians['private']['rate']:.2f}x")


if __name__ == "__main__":
    main()
