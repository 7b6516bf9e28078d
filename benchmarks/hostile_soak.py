"""A soak of `cann-run serve` under hostile traffic: 64 concurrent clients for 60 s, 10% of the requests
malformed, 10% oversized, 10% hostile, the rest good, against a real server of the tiny Llama.

    python benchmarks/hostile_soak.py [--clients 64 --seconds 60 --seed 0] [--json out.json]

malformed: bad JSON, wrong types, missing fields. oversized: a body past --max-body-bytes (declared or
chunked: 413), a prompt past the context (400). hostile: token ids outside the vocabulary or negative, NaN
or infinite numbers, an overflowing repetition_penalty, a lone surrogate, stop lists past their bounds
(all 400). good: greedy completions of a few fixed prompts, streamed or not, 5% of the streams left after
their first pieces; each answer must be exactly the text the prompt gets alone, before the soak.

Checks, exit 1 if one fails: no 5xx at all (every bad request here is the client's fault), no good request
failed or changed, /health answered throughout (its slowest answer is reported), the KV pool back to empty
at the end, and the server's `requests_total` (completed + rejected + cancelled + failed) grown by exactly
the requests that reached admission (all but the 413s and the bodies refused by validation).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import click
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_server import ServeProcess, compile_tiny  # noqa: E402

GOOD_PROMPTS = [f"prompt {i}: " + "abcdefgh"[i:] * (1 + i) for i in range(8)]
GOOD_TOKENS = 24
MAX_BODY = 65536
OUTCOMES = ("completed", "rejected", "cancelled", "failed")


def _bad_request(kind: str, rng: random.Random) -> tuple[str, dict]:
    """(a name for the case, httpx keyword arguments) for one bad request of `kind`."""
    raw = {"headers": {"content-type": "application/json"}}
    cases = {
        "malformed": [
            ("bad json", {"content": '{"model": "tiny", "prompt": ', **raw}),
            ("wrong type", {"json": {"model": "tiny", "prompt": "x", "max_tokens": "lots"}}),
            ("no prompt", {"json": {"model": "tiny", "max_tokens": 4}}),
            ("prompt of objects", {"json": {"model": "tiny", "prompt": [{"a": 1}]}}),
        ],
        "oversized": [
            ("declared body", {"content": json.dumps({"model": "tiny", "prompt": "y" * (2 * MAX_BODY)}), **raw}),
            ("chunked body", {"content": _chunks(json.dumps({"model": "tiny", "prompt": "y" * (2 * MAX_BODY)})),
                              **raw}),
            ("past the context", {"json": {"model": "tiny", "prompt": "z" * 3000, "max_tokens": 4}}),
        ],
        "hostile": [
            ("id past the vocabulary", {"json": {"model": "tiny", "prompt": [5, 10 ** rng.randint(3, 30)]}}),
            ("negative id", {"json": {"model": "tiny", "prompt": [5, -rng.randint(1, 10 ** 6)]}}),
            ("NaN temperature", {"content": '{"model": "tiny", "prompt": "x", "temperature": NaN}', **raw}),
            ("infinite top_p", {"content": '{"model": "tiny", "prompt": "x", "top_p": -Infinity}', **raw}),
            ("overflowing penalty", {"json": {"model": "tiny", "prompt": "x", "repetition_penalty": 1e-308}}),
            ("lone surrogate", {"content": '{"model": "tiny", "prompt": "a\\ud800b"}', **raw}),
            ("huge stop list", {"json": {"model": "tiny", "prompt": "x", "stop": ["s" * 8] * 5000}}),
            ("huge stop string", {"json": {"model": "tiny", "prompt": "x", "stop": "s" * 20000}}),
        ],
    }
    return rng.choice(cases[kind])


async def _chunks(text: str):
    data = text.encode()
    for start in range(0, len(data), 8192):
        yield data[start:start + 8192]


async def _good(client: httpx.AsyncClient, url: str, rng: random.Random, expected: dict, tally: dict) -> None:
    index = rng.randrange(len(GOOD_PROMPTS))
    body = {"model": "tiny", "prompt": GOOD_PROMPTS[index], "max_tokens": GOOD_TOKENS, "temperature": 0,
            "ignore_eos": True}
    if rng.random() < 0.5:
        response = await client.post(f"{url}/v1/completions", json=body)
        tally["statuses"][f"good:{response.status_code}"] += 1
        if response.status_code != 200 or response.json()["choices"][0]["text"] != expected[index]:
            tally["good_failed"].append(f"prompt {index}: {response.status_code} {response.text[:200]}")
        return
    leave = rng.random() < 0.05
    text, events = "", 0
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
        tally["statuses"][f"good stream:{response.status_code}"] += 1
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                tally["good_failed"].append(f"prompt {index}: stream error {chunk}")
                return
            text += chunk["choices"][0]["text"]
            events += 1
            if leave and events >= 3:
                tally["left"] += 1
                return
    if text != expected[index]:
        tally["good_failed"].append(f"prompt {index} streamed: {text!r} != {expected[index]!r}")


async def _client(client: httpx.AsyncClient, url: str, rng: random.Random, deadline: float, expected: dict,
                  tally: dict) -> None:
    while time.monotonic() < deadline:
        draw = rng.random()
        kind = "malformed" if draw < 0.1 else "oversized" if draw < 0.2 else "hostile" if draw < 0.3 else "good"
        name = ""
        try:
            if kind == "good":
                await _good(client, url, rng, expected, tally)
                tally["admitted"] += 1
                continue
            name, request = _bad_request(kind, rng)
            response = await client.post(f"{url}/v1/completions", **request)
            tally["statuses"][f"{kind} {name}:{response.status_code}"] += 1
            message = response.json().get("error", {}).get("message", "") if response.content else ""
            if response.status_code != 413 and not message.startswith("invalid request:"):
                tally["admitted"] += 1  # reached the engine's checks: the server counts it
        except httpx.HTTPError as error:
            tally["statuses"][f"{kind} {name}:transport {type(error).__name__}: {error}"] += 1


async def _health(url: str, deadline: float, tally: dict) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        while time.monotonic() < deadline:
            began = time.monotonic()
            response = await client.get(f"{url}/health")
            tally["health_max_s"] = max(tally["health_max_s"], time.monotonic() - began)
            if response.status_code != 200:
                tally["statuses"][f"health:{response.status_code}"] += 1
            await asyncio.sleep(0.25)


async def _soak(server: ServeProcess, clients: int, seconds: float, seed: int) -> dict:
    url = server.url
    # idle connections are dropped before uvicorn's 5 s keep-alive timeout (httpx's default is 5 s too: a
    # request sent on a connection the server is closing that moment fails in transport, not in the server)
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8, keepalive_expiry=1.0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        expected = {}
        for index, prompt in enumerate(GOOD_PROMPTS):  # each alone first: what every later answer must be
            body = {"model": "tiny", "prompt": prompt, "max_tokens": GOOD_TOKENS, "temperature": 0, "ignore_eos": True}
            expected[index] = (await client.post(f"{url}/v1/completions", json=body)).json()["choices"][0]["text"]
        before = server.metrics()
        tally = {"statuses": Counter(), "good_failed": [], "left": 0, "admitted": 0, "health_max_s": 0.0}
        began = time.monotonic()
        deadline = began + seconds
        await asyncio.gather(_health(url, deadline, tally), *(
            _client(client, url, random.Random(seed * 1000 + i), deadline, expected, tally) for i in range(clients)))
        elapsed = time.monotonic() - began
        settle = time.monotonic() + 60
        while True:  # the streams left mid-way are cancelled at the engine's next step
            after = server.metrics()
            counted = sum(after[f"requests_total:{o}"] - before[f"requests_total:{o}"] for o in OUTCOMES)
            if (counted >= tally["admitted"] and after["kv_cache_usage_perc"] == 0) or time.monotonic() > settle:
                break
            await asyncio.sleep(0.2)
    outcomes = {o: int(after[f"requests_total:{o}"] - before[f"requests_total:{o}"]) for o in OUTCOMES}
    statuses = tally["statuses"]
    report = {
        "clients": clients, "seconds": round(elapsed, 1), "requests": sum(statuses.values()),
        "by_kind": dict(sum((Counter({key.split(" ")[0].split(":")[0]: n}) for key, n in statuses.items()), Counter())),
        "statuses": dict(sorted(statuses.items())),
        "server_errors": sum(n for key, n in statuses.items() if key.rsplit(":", 1)[-1].startswith("5")),
        "transport_errors": sum(n for key, n in statuses.items() if "transport" in key),
        "good_failed": tally["good_failed"][:20], "good_failed_count": len(tally["good_failed"]),
        "left_mid_stream": tally["left"], "health_max_ms": round(tally["health_max_s"] * 1000, 1),
        "kv_cache_usage_after": after["kv_cache_usage_perc"], "server_outcomes": outcomes,
        "admitted_sent": tally["admitted"], "accounting_adds_up": sum(outcomes.values()) == tally["admitted"],
    }
    report["ok"] = (not report["server_errors"] and not report["transport_errors"] and not report["good_failed_count"]
                    and report["kv_cache_usage_after"] == 0 and report["accounting_adds_up"]
                    and outcomes["failed"] == 0)
    return report


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--clients", default=64, show_default=True)
@click.option("--seconds", default=60.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "json_path", default=None)
def main(clients: int, seconds: float, seed: int, json_path: str | None) -> None:
    """Run the soak and print what the server did."""
    with tempfile.TemporaryDirectory() as folder:
        om = compile_tiny(Path(folder))
        server = ServeProcess(om, "--kv_cache_pages", "256", "--max_batch_size", "16", "--max_context_len", "1024",
                              "--max-body-bytes", str(MAX_BODY), "--stats-interval", "0")
        try:
            report = asyncio.run(_soak(server, clients, seconds, seed))
        finally:
            server.stop()
        report["traceback_in_log"] = "Traceback" in server.stderr
        report["ok"] = report["ok"] and not report["traceback_in_log"]
    print(json.dumps(report, indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
