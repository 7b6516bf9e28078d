"""Load test of `cann-run serve`: concurrent streaming clients, some leaving mid-stream, plus malformed and
oversized requests; then checks the server's own accounting.

    python benchmarks/load_test.py --url http://127.0.0.1:8000 --model smollm2 [--clients 64 --seconds 60]

Each client loops: a streamed /v1/completions request of a random prompt length (windows of
cann_llm/models/data/eval.txt, measured in characters) and random max_tokens; 10% of them close the stream after
the first pieces. A share of requests (--abuse-share) is instead malformed JSON, a wrong type, or a
prompt longer than the context. Reports TTFT p50/p99 and aggregate tokens/s of the completed streams, counts every status, and
checks: no 5xx, the KV pool back to empty, and the server's requests_total (completed + rejected +
cancelled + failed) grown by exactly the number of admitted-or-refused generation requests sent.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import click
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cann_llm.models.data_files import EVAL_TEXT  # noqa: E402

_METRIC = re.compile(r'^cann_llm:(\w+)\{([^}]*)\} ([0-9.e+-]+)$')


async def _metrics(client: httpx.AsyncClient, url: str, model: str) -> dict:
    text = (await client.get(f"{url}/metrics")).text
    values: dict = {}
    for line in text.splitlines():
        match = _METRIC.match(line)
        if match and f'model_name="{model}"' in match.group(2):
            outcome = re.search(r'outcome="(\w+)"', match.group(2))
            name = match.group(1) + (f":{outcome.group(1)}" if outcome else "")
            values[name] = float(match.group(3))
    return values


async def _client(client, url, model, text, deadline, rng, results, statuses, abuse_share):
    sent = 0
    while time.monotonic() < deadline:
        sent += 1
        if rng.random() < abuse_share:
            kind = rng.choice(["malformed", "wrong_type", "oversized"])
            if kind == "malformed":
                response = await client.post(f"{url}/v1/completions", content="{oops",
                                             headers={"content-type": "application/json"})
            elif kind == "wrong_type":
                response = await client.post(f"{url}/v1/completions", json={"model": model, "prompt": "x",
                                                                             "max_tokens": "lots"})
            else:
                response = await client.post(f"{url}/v1/completions", json={"model": model, "prompt": text[:60000],
                                                                            "max_tokens": 8})
                results["generation_requests"] += 1
            statuses[f"{kind}:{response.status_code}"] += 1
            continue
        start_char = rng.randrange(0, len(text) - 4000)
        prompt = text[start_char:start_char + rng.randrange(100, 2500)]
        body = {"model": model, "prompt": prompt, "max_tokens": rng.randrange(16, 128), "temperature": 0.7,
                "stream": True}
        leave = rng.random() < 0.10
        results["generation_requests"] += 1
        begin = time.monotonic()
        first, pieces = None, 0
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                statuses[f"stream:{response.status_code}"] += 1
                if response.status_code != 200:
                    await response.aread()
                    continue
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"][0]["text"]:
                        pieces += 1
                        first = first or time.monotonic() - begin
                    if leave and pieces >= 3:
                        break
        except httpx.HTTPError as error:
            statuses[f"transport:{type(error).__name__}"] += 1
            continue
        if leave:
            results["left"] += 1
        elif first is not None:
            results["ttft"].append(first)
            results["tokens"] += pieces


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--url", default="http://127.0.0.1:8000", show_default=True)
@click.option("--model", required=True)
@click.option("--clients", default=64, show_default=True)
@click.option("--seconds", default=60.0, show_default=True)
@click.option("--abuse-share", default=0.1, show_default=True, help="share of requests that are bad ones")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "json_path", default=None)
def main(url, model, clients, seconds, abuse_share, seed, json_path) -> None:
    """Run the load and print what the server did."""
    asyncio.run(_run(url, model, clients, seconds, abuse_share, seed, json_path))


async def _run(url, model, clients, seconds, abuse_share, seed, json_path):
    text = EVAL_TEXT.read_text(encoding="utf-8")
    results = {"ttft": [], "tokens": 0, "left": 0, "generation_requests": 0}
    statuses: Counter = Counter()
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        before = await _metrics(client, url, model)
        start = time.monotonic()
        deadline = start + seconds
        await asyncio.gather(*(_client(client, url, model, text, deadline, random.Random(seed + i), results, statuses,
                                       abuse_share) for i in range(clients)))
        elapsed = time.monotonic() - start
        settle_deadline = time.monotonic() + 30
        while True:
            after = await _metrics(client, url, model)
            settled = sum(after.get(f"requests_total:{o}", 0) - before.get(f"requests_total:{o}", 0)
                          for o in ("completed", "rejected", "cancelled", "failed"))
            if after.get("kv_cache_usage_perc", 1) == 0 and settled >= results["generation_requests"]:
                break
            if time.monotonic() > settle_deadline:
                break
            await asyncio.sleep(0.2)
    outcomes = {o: after.get(f"requests_total:{o}", 0) - before.get(f"requests_total:{o}", 0)
                for o in ("completed", "rejected", "cancelled", "failed")}
    ttft = sorted(results["ttft"])
    report = {
        "clients": clients, "seconds": round(elapsed, 1), "statuses": dict(statuses),
        "server_errors": sum(n for k, n in statuses.items() if k.split(":")[-1].startswith("5")),
        "completed_streams": len(ttft), "left_mid_stream": results["left"],
        "ttft_ms_p50": round(statistics.median(ttft) * 1000, 1) if ttft else None,
        "ttft_ms_p99": round(ttft[int(0.99 * (len(ttft) - 1))] * 1000, 1) if ttft else None,
        "aggregate_tokens_per_s": round(results["tokens"] / elapsed, 1),
        "kv_cache_usage_after": after.get("kv_cache_usage_perc"),
        "server_outcomes": outcomes, "generation_requests_sent": results["generation_requests"],
        "accounting_adds_up": sum(outcomes.values()) == results["generation_requests"],
    }
    print(json.dumps(report, indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
