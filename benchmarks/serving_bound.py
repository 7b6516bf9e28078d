"""The most that concurrency could give on `cann-run bench`'s request mix on this machine, beside what it gave.

    cann-run bench --model .cache/smollm2.om --json .cache/bench-smollm2.json
    python benchmarks/serving_bound.py --om .cache/smollm2.om --bench .cache/bench-smollm2.json

Two floors are measured here, in one process (medians): the model's matmuls on 512 rows at once, where
they are compute-bound (seconds per token through the layers, and per logits row through the lm_head),
and one bare read of the weights on every core (benchmarks/decode_floor.py, the faster of two forms), the least a one-token step
costs. For the bench's requests (P prompt tokens, G generated, R requests; P + G - R tokens pass through
the layers, G rows through the head):
- serving one request at a time, one token a step, takes at least: P tokens of compute and R head rows
  (the prefills), then G - R steps of at least one weight read or one token's compute, whichever is more;
- serving them at any concurrency takes at least the compute of all of them.
The quotient bounds the ratio a concurrency level can show against one-at-a-time serving; attention,
norms and every overhead are left out of both sides, as if both engines were perfect. Each measured level
is also given as the share of its time the compute floor would take.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
from decode_floor import matmul_session, matmul_weights, weight_read

from cann_llm.runtime import load_artifact
from cann_llm.runtime.ort_session import enable_process_thread_pool

ROWS = 512


def _median_s(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", "om_path", required=True, help="the artifact the bench ran")
@click.option("--bench", "bench_path", required=True, help="the JSON `cann-run bench` wrote")
@click.option("--repeat", default=15, show_default=True)
def main(om_path: str, bench_path: str, repeat: int) -> None:
    """Print the floors, the bound on the concurrency ratio, and each level's measured ratio."""
    enable_process_thread_pool()
    loaded = load_artifact(om_path)
    vocab = loaded.metadata["model"]["vocab_size"]
    weights = matmul_weights(loaded)
    head = {name: w for name, w in weights.items() if w.shape[1] == vocab}
    body = {name: w for name, w in weights.items() if name not in head}
    if len(head) != 1:
        raise click.ClickException(f"expected one lm_head MatMul of width {vocab}, found {len(head)}")
    layers, layer_feeds = matmul_session(body, ROWS)
    logits, logits_feeds = matmul_session(head, ROWS)
    read = weight_read(weights)
    per_token = _median_s(lambda: layers.run(None, layer_feeds), repeat) / ROWS
    per_row = _median_s(lambda: logits.run(None, logits_feeds), repeat) / ROWS
    read()
    read_s = statistics.median(read() for _ in range(repeat))
    flops = 2 * sum(w.size for w in body.values())
    click.echo(f"compute floor: {per_token * 1e3:.3f} ms a token through the layers ({flops / per_token / 1e9:.0f} GFLOP/s), "
               f"{per_row * 1e3:.3f} ms a logits row; one bare weight read: {read_s * 1e3:.2f} ms")

    serving = json.loads(Path(bench_path).read_text())["serving"]
    baseline = min((row for row in serving if not row["lookup"]), key=lambda row: row["concurrency"])
    prompt, generated, requests = baseline["prompt_tokens"], baseline["output_tokens"], baseline["requests"]
    all_compute = (prompt + generated - requests) * per_token + generated * per_row
    one_at_a_time = prompt * per_token + requests * per_row + (generated - requests) * max(read_s, per_token + per_row)
    click.echo(f"mix: {requests} requests, {prompt} prompt tokens, {generated} generated")
    click.echo(f"floors: one at a time {one_at_a_time:.2f} s, all tokens' compute {all_compute:.2f} s; "
               f"bound on the concurrency ratio {one_at_a_time / all_compute:.2f}x")
    click.echo(f"measured: one at a time (concurrency {baseline['concurrency']}, one token a step) {baseline['seconds']:.2f} s")
    for row in serving:
        if row["concurrency"] > baseline["concurrency"]:
            click.echo(f"  concurrency {row['concurrency']}: {row['seconds']:.2f} s, "
                       f"{baseline['seconds'] / row['seconds']:.2f}x one at a time, "
                       f"compute floor / time {all_compute / row['seconds']:.2f}")


if __name__ == "__main__":
    main()
