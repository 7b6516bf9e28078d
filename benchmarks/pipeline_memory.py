"""Resident memory and speed of a model split into pipeline stages (`atc --pipeline_stages=K`) against the
same model in one process, each in a fresh process, alternating rounds:

    python benchmarks/pipeline_memory.py --whole .cache/peers/smollm2-fp32.om \\
        --first .cache/pipeline/smollm2-fp32_stage0.om [--rounds 3]

One request (a 32-token chat prompt, 128 new tokens with EOS held off, greedy) through a 64-page KV pool.
Reports each process's peak resident memory (VmHWM: the single process; the engine's own process and every
stage actor for the pipeline), the ratio of the largest pipeline process to the single process, decode
tokens/s, and whether the tokens are identical.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent

_RUN = r"""
import json, sys, time
from cann_llm.runtime.engine.engine import LLMEngine
path = sys.argv[1]
with LLMEngine(path, kv_cache_pages=64, max_context_len=1024) as engine:
    prompt = engine.chat_prompt([{"role": "user", "content": "Tell me about the history of the printing press."}])
    began = time.perf_counter()
    request = engine.submit(prompt, max_tokens=128, temperature=0, ignore_eos=True)
    request.result()
    ids = list(request.output_ids)
    stats = request.stats
    decode = (stats.output_tokens - 1) / (stats.total_s - stats.ttft_s)
    stages = [engine.runner._ray.get(s.process.remote()) for s in getattr(engine.runner, "stages", [])]
with open("/proc/self/status") as status:
    peak = int(next(l for l in status if l.startswith("VmHWM")).split()[1]) * 1024
print(json.dumps({"tokens": ids, "decode": decode, "peak": peak, "stages": [s["peak_resident_bytes"] for s in stages]}))
"""


def _measure(path: str) -> dict:
    result = subprocess.run([sys.executable, "-c", _RUN, path], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--whole", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--first", required=True, type=click.Path(exists=True, dir_okay=False), help="the first stage's artifact")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
def main(whole, first, rounds):
    """Peak resident memory per process and decode speed: pipeline stages against one process."""
    runs = {"whole": [], "pipeline": []}
    for round_ in range(rounds):
        for name, path in ((("whole", whole), ("pipeline", first)) if round_ % 2 == 0
                           else (("pipeline", first), ("whole", whole))):
            runs[name].append(_measure(path))
            run = runs[name][-1]
            stages = ", ".join(f"{b / 2**20:.0f}" for b in run["stages"])
            print(f"round {round_ + 1} {name}: peak {run['peak'] / 2**20:.0f} MiB"
                  f"{f' (stages {stages} MiB)' if stages else ''}, decode {run['decode']:.1f} tok/s", flush=True)
    single = statistics.median(r["peak"] for r in runs["whole"])
    driver = statistics.median(r["peak"] for r in runs["pipeline"])
    stages = [statistics.median(r["stages"][i] for r in runs["pipeline"]) for i in range(len(runs["pipeline"][0]["stages"]))]
    equal = all(r["tokens"] == runs["whole"][0]["tokens"] for r in runs["whole"] + runs["pipeline"])
    print(f"\nmedians of {rounds} rounds; tokens identical: {equal}")
    print("| process | peak resident | vs one process |\n|---|---|---|")
    print(f"| one process | {single / 2**20:.0f} MiB | 1.00x |")
    print(f"| pipeline: the engine's process | {driver / 2**20:.0f} MiB | {driver / single:.2f}x |")
    for index, peak in enumerate(stages):
        print(f"| pipeline: stage {index} | {peak / 2**20:.0f} MiB | {peak / single:.2f}x |")
    for name in runs:
        print(f"decode {name}: {statistics.median(r['decode'] for r in runs[name]):.1f} tok/s")


if __name__ == "__main__":
    main()
