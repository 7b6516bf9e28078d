"""`cann-run serve --ray` measured on this machine: how to spend its cores, and what routing by prefix buys.

    python benchmarks/scale_out.py --om .cache/peers/smollm2-int4-awq-head4.om [--rounds 2]

Throughput: 2 replicas x 1 core against 1 replica x 2 cores (each a fresh `cann-run serve --ray` with its own
local Ray head), the same 32 concurrent streamed completions (prompts cut from cann_llm/models/data/eval.txt, 50-600
characters, `--max_tokens` each with EOS held off), alternating configurations round by round: aggregate
generated tokens/s, TTFT p50/p99.

Routing: 2 replicas x 1 core, `--router prefix` against `--router round_robin` (and Ray Serve's default
`pow2`), on a multi-turn chat: `--conversations` chats run at once, each `--turns` turns in sequence, every
turn's prompt the whole conversation so far (a system prompt of its own, the questions and the answers):
the share of prompt tokens served from the replicas' prefix caches (their own counters) and the TTFT of
the turns after the first (`--system_chars` sets the passage's length). Medians over rounds.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from cann_llm.models.data_files import EVAL_TEXT  # noqa: E402


class Deployment:
    """`cann-run serve --ray` in its own process, with a local Ray head of its own."""

    def __init__(self, om: str, *argv: str):
        with __import__("socket").socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cann_llm.cli.cann_run", "serve", "--ray", "--port", str(self.port), "--model", f"m={om}",
             "--kv_cache_pages", "256", "--max_batch_size", "32", *argv],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines = []
        while not any(line.startswith("ready in") for line in lines):
            line = self.process.stderr.readline()
            if not line:
                raise RuntimeError("".join(lines[-20:]))
            lines.append(line)

    def counters(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        found = {}
        for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "generation_tokens_total"):
            match = re.search(rf'^cann_llm:{name}\{{model_name="m"\}} (\S+)$', text, re.M)
            found[name] = float(match.group(1)) if match else 0.0
        return found

    def settled(self) -> dict[str, float]:
        """The counters once the replicas' reports (every second) have stopped changing."""
        seen = self.counters()
        while True:
            time.sleep(1.3)
            now = self.counters()
            if now == seen:
                return now
            seen = now

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=120)


async def _stream(client: httpx.AsyncClient, url: str, path: str, body: dict) -> tuple[float, int]:
    """(seconds to the first piece, pieces) of one streamed request."""
    began, first, pieces = time.perf_counter(), None, 0
    async with client.stream("POST", f"{url}{path}", json={**body, "stream": True}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                first = first or time.perf_counter() - began
                pieces += 1
    return first, pieces


async def _throughput(url: str, requests: int, max_tokens: int, seed: int) -> dict:
    text = EVAL_TEXT.read_text()
    rng = random.Random(seed)
    prompts = []
    for _ in range(requests):
        start, length = rng.randrange(0, len(text) - 700), rng.randrange(50, 600)
        prompts.append(text[start:start + length])
    async with httpx.AsyncClient(timeout=600) as client:
        began = time.perf_counter()
        results = await asyncio.gather(*(_stream(client, url, "/v1/completions", {
            "model": "m", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            for p in prompts))
        wall = time.perf_counter() - began
    ttfts = sorted(r[0] for r in results)
    return {"tokens_per_s": requests * max_tokens / wall, "ttft_p50": statistics.median(ttfts),
            "ttft_p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]}


QUESTIONS = ["What is this about?", "Can you say more?", "Why does that matter?", "Give an example.",
             "What would change it?", "Summarise it in one line."]


async def _conversation(client, url, system: str, turns: int, max_tokens: int, ttfts: list) -> None:
    messages = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        began, first, answer = time.perf_counter(), None, []
        async with client.stream("POST", f"{url}/v1/chat/completions", json={
                "model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                piece = re.search(r'"content": ?"((?:[^"\\]|\\.)+)"', line) if line.startswith("data: ") else None
                if piece:  # the first piece of text, not the role-only chunk a chat stream opens with
                    first = first or time.perf_counter() - began
                    answer.append(piece.group(1))
        if turn:
            ttfts.append(first)
        messages.append({"role": "assistant", "content": "".join(answer)})


async def _chats(url: str, conversations: int, turns: int, max_tokens: int, seed: int,
                 system_chars: int = 1200) -> list[float]:
    text = EVAL_TEXT.read_text()
    rng = random.Random(seed)
    systems = []
    for _ in range(conversations):
        start = rng.randrange(0, len(text) - system_chars - 300)
        systems.append("Answer questions about this passage.\n\n" + text[start:start + system_chars])
    ttfts: list[float] = []
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(_conversation(client, url, s, turns, max_tokens, ttfts) for s in systems))
    return ttfts


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--requests", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--max_tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--conversations", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--turns", type=click.IntRange(min=2), default=4, show_default=True)
@click.option("--routers", default="prefix,round_robin,pow2", show_default=True)
@click.option("--system_chars", type=click.IntRange(min=100), default=1200, show_default=True,
              help="characters of each chat's passage (its system prompt)")
@click.option("--skip", type=click.Choice(["none", "throughput", "routing"]), default="none", show_default=True)
def main(om, rounds, requests, max_tokens, conversations, turns, routers, system_chars, skip):
    """Throughput of 2x1 against 1x2 cores, and prefix routing against the baselines, on this machine."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if skip != "throughput":
        shapes = {"2 replicas x 1 core": ["--replicas", "2", "--replica-cpus", "1"],
                  "1 replica x 2 cores": ["--replicas", "1", "--replica-cpus", "2"]}
        seen = {name: [] for name in shapes}
        for round_ in range(rounds):
            for name, argv in (shapes.items() if round_ % 2 == 0 else reversed(shapes.items())):
                deployment = Deployment(om, *argv)
                try:
                    asyncio.run(_throughput(deployment.url, 4, 8, seed=99))  # warm both paths
                    result = asyncio.run(_throughput(deployment.url, requests, max_tokens, seed=round_))
                finally:
                    deployment.stop()
                seen[name].append(result)
                print(f"round {round_ + 1} {name}: {result['tokens_per_s']:.1f} tok/s, TTFT p50 "
                      f"{result['ttft_p50'] * 1000:.0f} ms p99 {result['ttft_p99'] * 1000:.0f} ms", flush=True)
        print(f"\n{requests} concurrent requests x {max_tokens} tokens, medians of {rounds} rounds")
        print("| replicas x cores | tokens/s | TTFT p50 | TTFT p99 |\n|---|---|---|---|")
        for name, results in seen.items():
            med = {k: statistics.median(r[k] for r in results) for k in results[0]}
            print(f"| {name} | {med['tokens_per_s']:.1f} | {med['ttft_p50'] * 1000:.0f} ms | "
                  f"{med['ttft_p99'] * 1000:.0f} ms |")
    if skip != "routing":
        names = routers.split(",")
        seen = {name: [] for name in names}
        for round_ in range(rounds):
            for name in (names if round_ % 2 == 0 else names[::-1]):
                deployment = Deployment(om, "--replicas", "2", "--replica-cpus", "1", "--router", name)
                try:
                    before = deployment.settled()
                    ttfts = asyncio.run(_chats(deployment.url, conversations, turns, 16, round_, system_chars))
                    after = deployment.settled()
                finally:
                    deployment.stop()
                hits = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
                queries = after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]
                ttfts.sort()
                result = {"hit_rate": hits / queries, "ttft_p50": statistics.median(ttfts),
                          "ttft_p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]}
                seen[name].append(result)
                print(f"round {round_ + 1} router {name}: prefix cache hit rate {result['hit_rate']:.1%}, "
                      f"TTFT after turn 1 p50 {result['ttft_p50'] * 1000:.0f} ms p99 {result['ttft_p99'] * 1000:.0f} ms",
                      flush=True)
        print(f"\n{conversations} chats x {turns} turns at once ({system_chars}-character passages), 2 replicas x 1 "
              f"core, medians of {rounds} rounds")
        print("| router | prompt tokens from cache | TTFT p50 (turns 2+) | TTFT p99 (turns 2+) |\n|---|---|---|---|")
        for name, results in seen.items():
            med = {k: statistics.median(r[k] for r in results) for k in results[0]}
            print(f"| {name} | {med['hit_rate']:.1%} | {med['ttft_p50'] * 1000:.0f} ms | {med['ttft_p99'] * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
