"""SIGTERM during 32 requests in flight, streaming and not, round after round, with another process keeping
one core busy: every client must get its full answer or OpenAI's 503 error, nothing may be logged as a
traceback, and the audit log must account for every request with the status its client got.

    python benchmarks/sigterm_soak.py --rounds 20 [--requests 32] [--grace 1.0] [--json out.json]

Each round starts `cann-run serve` of the tiny Llama (benchmarks/tiny_server.py), sends the requests (half
streamed; `max_tokens` from 8 to 2000, eos ignored, so some finish within the grace period and some
cannot), sends SIGTERM once all of them are admitted and checks what everyone got. Prints (and with --json
writes) the outcomes per round; exits 1 if any round broke a rule.
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import click
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_server import BusyCore, ServeProcess, compile_tiny  # noqa: E402

SHUTDOWN_ERROR = {"message": "the server shut down before the request finished", "type": "unavailable",
                  "param": None, "code": 503}


def _client(url: str, index: int, max_tokens: int, stream: bool, got: dict) -> None:
    """One request; `got[index]` = (status it got, what is wrong with the answer or None)."""
    body = {"model": "tiny", "prompt": f"request {index}: " + "x" * 40, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    try:
        if not stream:
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
            answer = response.json()
            if response.status_code == 200:
                tokens = answer["usage"]["completion_tokens"]
                got[index] = (200, None if tokens == max_tokens else f"{tokens} of {max_tokens} tokens")
            else:
                got[index] = (response.status_code, None if answer.get("error") == SHUTDOWN_ERROR else str(answer))
            return
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
        if response.status_code != 200 or events[-1:] != ["[DONE]"] or len(events) < 2:
            got[index] = (response.status_code, f"stream ended {events[-2:]}")
            return
        last = json.loads(events[-2])
        if "error" in last:
            got[index] = (last["error"]["code"], None if last["error"] == SHUTDOWN_ERROR else str(last))
        else:
            reason = last["choices"][0]["finish_reason"]
            got[index] = (200, None if reason == "length" else f"finish_reason {reason}")
    except (httpx.HTTPError, ValueError, KeyError) as error:
        got[index] = (None, f"{type(error).__name__}: {error}")


def sigterm_round(om: Path, audit: Path, requests: int, grace_s: float) -> dict:
    """One server, `requests` clients, one SIGTERM; what happened and every rule it broke."""
    audit.unlink(missing_ok=True)
    server = ServeProcess(om, "--kv_cache_pages", "512", "--max_batch_size", "8", "--shutdown-grace", str(grace_s),
                          "--audit-log", str(audit), "--stats-interval", "0")
    got: dict[int, tuple] = {}
    lengths = [8 + (1992 * i) // max(1, requests - 1) for i in range(requests)]
    clients = [threading.Thread(target=_client, args=(server.url, i, lengths[i], i % 2 == 1, got))
               for i in range(requests)]
    for client in clients:
        client.start()
    deadline = time.monotonic() + 120
    while True:  # every request admitted (running, waiting or done) before the signal
        values = server.metrics()
        admitted = values["num_requests_running"] + values["num_requests_waiting"] + sum(
            values[f"requests_total:{o}"] for o in ("completed", "cancelled", "failed"))
        if admitted >= requests or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    server.process.send_signal(signal.SIGTERM)
    status = server.wait(timeout_s=120)
    for client in clients:
        client.join(timeout=120)
    problems = [f"request {i}: {why}" for i, (_, why) in sorted(got.items()) if why]
    problems += [f"request {i}: no answer" for i in range(requests) if i not in got]
    if status not in (0, -signal.SIGTERM):
        problems.append(f"exit status {status}")
    if "Traceback" in server.stderr or "Cancel" in server.stderr:
        problems.append("the log has a traceback:\n" + server.stderr)
    audited = sorted(json.loads(line)["status"] for line in audit.read_text().splitlines()) if audit.exists() else []
    statuses = sorted(code for code, _ in got.values() if code is not None)
    if audited != statuses:
        problems.append(f"audited {Counter(audited)} but the clients got {Counter(statuses)}")
    return {"statuses": dict(Counter(statuses)), "admitted_before_signal": int(admitted), "problems": problems}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rounds", default=20, show_default=True)
@click.option("--requests", default=32, show_default=True)
@click.option("--grace", default=1.0, show_default=True, help="the server's --shutdown-grace")
@click.option("--json", "json_path", default=None)
def main(rounds: int, requests: int, grace: float, json_path: str | None) -> None:
    """Run the rounds and print what each one did."""
    with tempfile.TemporaryDirectory() as folder, BusyCore():
        om = compile_tiny(Path(folder))
        results = []
        for number in range(rounds):
            result = sigterm_round(om, Path(folder) / "audit.jsonl", requests, grace)
            results.append(result)
            print(f"round {number + 1}: {result['statuses']}" + (f" PROBLEMS {result['problems']}"
                                                                   if result["problems"] else ""), flush=True)
    report = {"rounds": rounds, "requests": requests, "grace_s": grace,
              "failed_rounds": sum(bool(r["problems"]) for r in results),
              "statuses": dict(sum((Counter(r["statuses"]) for r in results), Counter())), "results": results}
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    sys.exit(1 if report["failed_rounds"] else 0)


if __name__ == "__main__":
    main()
