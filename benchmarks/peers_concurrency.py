"""Many requests at once: this project's continuous batching beside onnxruntime-genai's static batches.

\b
    python benchmarks/peers_concurrency.py [--precision int4] [--requests 64] [--concurrency 32]
                                           [--batches 1,4,8,16,32] [--threads 2] [--seed 0] [--rounds 1]
                                           [--json out.json]

One fixed mix of --requests requests, drawn with --seed as `cann-run bench` draws its serving mix: prompts
are windows of eval.txt of random lengths in [32, 512] tokens, outputs random lengths in [32, 128] tokens,
greedy, EOS held off. The text is tokenized once by the artifact's own tokenizer and both engines get the
same token ids (SmolLM2's tokenizer is the same in both). The models are benchmarks/peers.py's (the same
weights; int4: ours AWQ g128 with the 4-bit head in blocks of 32, genai's builder blocks of 32), each run in a
fresh process.

\b
- cann-llm: `LLMEngine` with room for --concurrency sequences and their pages, served by that many
  clients in a closed loop (each sends its next request when the last one finished: `cann-run bench`'s
  loop); aggregate tok/s = output tokens / wall time; TTFT from a request's submission.
- onnxruntime-genai: the same requests in order, in static batches of B for each B of --batches (one
  process per B). A batch is one Generator with batch_size B, its prompts right-padded with the model's
  pad token id (genai 0.18's GroupQueryAttention model gives each row its batch-1 greedy tokens only when
  padded on the right; left-padded rows diverge), run until the batch's longest output is done. Only each
  request's own output length counts as useful tokens; aggregate tok/s = useful tokens / wall time over
  all batches. TTFT is from the start of the request's batch (requests queued behind earlier batches
  would wait longer still). The best B is the one with the highest aggregate tok/s.

With --rounds R, each round runs our engine and then every batch size, so noise on a shared machine falls
on both alike; each row is the round of median tok/s, and the ratio (median over median) is printed with
the ratio of each round. The ratio is our aggregate tok/s over genai's best. Genai takes about 1.6 s a request at every batch size
on two busy cores, so each B costs about as much as batch 1: the default of 64 requests (two per client at
32) keeps a run near ten minutes; issue 19's 128-request mix (--requests 128) takes about twice that. With
as many requests as clients, our run measures a burst draining rather than a full batch held.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers, beside this file

from peers import Engine, GenaiRunner, model_of, peak_rss_bytes, print_report, spawn  # noqa: E402

from cann_llm.models.data_files import EVAL_TEXT  # noqa: E402

SCRIPT = Path(__file__)  # what spawn runs as each worker

PROMPT_LENGTHS = (32, 512)
OUTPUT_LENGTHS = (32, 128)


# ---- the pure parts --------------------------------------------------------------------------------------

def request_mix(ids: list[int], count: int, seed: int, prompt_lengths: tuple[int, int] = PROMPT_LENGTHS,
                output_lengths: tuple[int, int] = OUTPUT_LENGTHS) -> list[tuple[list[int], int]]:
    """`count` (prompt ids, new tokens) pairs: windows of `ids` and output lengths, both uniform in their
    inclusive ranges, drawn in `cann-run bench`'s order so a seed gives its mix."""
    from cann_llm.cli.bench import _windows

    rng = np.random.default_rng(seed)
    prompts = _windows(ids, rng.integers(prompt_lengths[0], prompt_lengths[1] + 1, count).tolist(), rng)
    outputs = rng.integers(output_lengths[0], output_lengths[1] + 1, count).tolist()
    return [(list(map(int, prompt)), int(new)) for prompt, new in zip(prompts, outputs)]


def static_batches(output_lengths: list[int], batch: int) -> list[dict]:
    """The requests in order, `batch` at a time (the last batch may be short): each batch's indices, the
    steps it runs (its longest output), the tokens it generates and the useful ones (each row's own)."""
    out = []
    for start in range(0, len(output_lengths), batch):
        lengths = output_lengths[start:start + batch]
        out.append({"indices": list(range(start, start + len(lengths))), "steps": max(lengths),
                    "generated_tokens": max(lengths) * len(lengths), "useful_tokens": sum(lengths)})
    return out


def median_row(rows: list[dict]) -> dict:
    """Of one engine's rounds, the one of median tok/s (the lower middle of an even count); an error row
    when no round ran."""
    measured = sorted((row for row in rows if "error" not in row), key=lambda row: row["tokens_per_s"])
    return measured[(len(measured) - 1) // 2] if measured else rows[0]


def round_ratios(ours: list[dict], genai: list[list[dict]]) -> list[float | None]:
    """Round by round, our tok/s over genai's best batch of that round (`genai[r]`: round r's batches)."""
    ratios = []
    for mine, theirs in zip(ours, genai):
        best = max((row["tokens_per_s"] for row in theirs if "error" not in row), default=None)
        ratios.append(mine["tokens_per_s"] / best if best and "error" not in mine else None)
    return ratios


def summarize(ours: dict, genai: list[dict]) -> dict:
    """Genai's best batch (highest aggregate tok/s among the rows that ran) and our tok/s over it."""
    measured = [row for row in genai if "error" not in row]
    best = max(measured, key=lambda row: row["tokens_per_s"], default=None)
    ratio = ours["tokens_per_s"] / best["tokens_per_s"] if best is not None and "error" not in ours else None
    return {"ours": ours, "genai": genai, "best_batch": best["batch"] if best else None, "ratio": ratio}


def table(report: dict) -> list[str]:
    """The report as text lines: our row, a row per genai batch size (the best marked), the ratio."""
    lines = [f"{'engine':<34} {'tok/s':>7} {'seconds':>8} {'useful/generated':>17} {'TTFT p50/p99 ms':>16} "
             f"{'peak RSS':>9}"]

    def row_line(name: str, row: dict) -> str:
        if "error" in row:
            return f"{name:<34} {row['error']}"
        tokens = f"{row['useful_tokens']}/{row['generated_tokens']}"
        ttft = f"{row['ttft_ms_p50']:.0f}/{row['ttft_ms_p99']:.0f}"
        return (f"{name:<34} {row['tokens_per_s']:>7.1f} {row['seconds']:>8.1f} {tokens:>17} {ttft:>16} "
                f"{row['peak_rss_bytes'] / 2**20:>6.0f} MB")

    ours = report["ours"]
    lines.append(row_line(f"cann-llm, {ours.get('concurrency', '?')} clients", ours))
    for row in report["genai"]:
        mark = " (best)" if row.get("batch") == report["best_batch"] else ""
        lines.append(row_line(f"onnxruntime-genai, batch {row['batch']}{mark}", row))
    if report["ratio"] is not None:
        by_round = [f"{r:.2f}" if r is not None else "-" for r in report.get("round_ratios", [])]
        rounds = f" (by round: {' '.join(by_round)})" if len(by_round) > 1 else ""
        lines.append(f"cann-llm / onnxruntime-genai batch {report['best_batch']}: {report['ratio']:.2f}x aggregate "
                     f"tok/s{rounds}")
    return lines


# ---- the workers, one process each ---------------------------------------------------------------------

def _percentiles_ms(seconds: list[float]) -> dict:
    return {"ttft_ms_p50": float(np.percentile(seconds, 50)) * 1e3, "ttft_ms_p99": float(np.percentile(seconds, 99)) * 1e3}


def run_cann(job: dict) -> dict:
    """The mix served by `job["concurrency"]` closed-loop clients of one LLMEngine."""
    from cann_llm.cli.bench import _closed_loop, _engine_generate
    from cann_llm.runtime.artifact import OmFile
    from cann_llm.runtime.engine.engine import LLMEngine

    requests = job["requests"]
    concurrency = job["concurrency"]
    context = max(len(p) + n for p, n in requests) + 1
    page_size = OmFile(job["model"], verify_weights=False).metadata["kv_cache"]["page_size"]
    # every client's longest sequence at once, so no request waits for pages or is preempted
    pages = concurrency * -(-context // page_size)
    engine = LLMEngine(job["model"], max_batch_size=concurrency, max_context_len=context, kv_cache_pages=pages,
                       threads=job["threads"], process_thread_pool=True)
    try:
        longest = max(requests, key=lambda request: len(request[0]))[0]
        _engine_generate(engine, longest, 4)
        row = _closed_loop(engine, requests, concurrency)
    finally:
        engine.close()
    return {"concurrency": concurrency, "seconds": row["seconds"], "tokens_per_s": row["tokens_per_s"],
            "useful_tokens": row["output_tokens"], "generated_tokens": row["output_tokens"],
            "ttft_ms_p50": row["ttft_ms_p50"], "ttft_ms_p99": row["ttft_ms_p99"], "kv_cache_pages": pages,
            "peak_sequences": row["peak_sequences"], "preemptions": row["preemptions"]}


def run_genai(job: dict) -> dict:
    """The mix in static batches of `job["batch"]` on onnxruntime-genai's Generator."""
    runner = GenaiRunner(job["model"], job["threads"])
    og, model = runner.og, runner.model
    pad = json.loads((Path(job["model"]) / "genai_config.json").read_text())["model"]["pad_token_id"]
    requests = job["requests"]
    batches = static_batches([new for _, new in requests], job["batch"])
    runner.generate(max((p for p, _ in requests), key=len), 4)
    ttft, seconds = [], 0.0
    for batch in batches:
        prompts = [requests[i][0] for i in batch["indices"]]
        width = max(map(len, prompts))
        matrix = np.full((len(prompts), width), pad, np.int32)
        for row, prompt in enumerate(prompts):
            matrix[row, :len(prompt)] = prompt
        start = time.perf_counter()
        params = og.GeneratorParams(model)
        total = width + batch["steps"]
        # min_length = max_length holds EOS off in every row until the batch's last step
        params.set_search_options(do_sample=False, batch_size=len(prompts), max_length=total, min_length=total)
        generator = og.Generator(model, params)
        generator.append_tokens(matrix)
        for step in range(batch["steps"]):
            generator.generate_next_token()
            if step == 0:
                ttft += [time.perf_counter() - start] * len(prompts)
        seconds += time.perf_counter() - start
        # its KV cache (max_length a row) goes before the next batch allocates its own
        del generator
    useful = sum(b["useful_tokens"] for b in batches)
    return {"batch": job["batch"], "seconds": seconds, "tokens_per_s": useful / seconds, "useful_tokens": useful,
            "generated_tokens": sum(b["generated_tokens"] for b in batches), "batches": len(batches),
            **_percentiles_ms(ttft)}


def run_worker(job: dict) -> dict:
    """What one worker process measures for `job`, with its peak resident memory."""
    # _closed_loop's progress bar would only clutter the captured stderr
    logging.getLogger().setLevel(logging.ERROR)
    result = run_cann(job) if job["kind"] == "cann" else run_genai(job)
    return {**result, "peak_rss_bytes": peak_rss_bytes()}


# ---- the command -----------------------------------------------------------------------------------------

def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
@click.option("--precision", type=click.Choice(["fp32", "int4"]), default="int4", show_default=True)
@click.option("--requests", "num_requests", type=click.IntRange(min=1), default=64, show_default=True,
              help="requests in the mix, the same ones for every engine and batch size")
@click.option("--concurrency", type=click.IntRange(min=1), default=32, show_default=True,
              help="closed-loop clients of our engine")
@click.option("--batches", default="1,4,8,16,32", show_default=True, help="onnxruntime-genai's static batch sizes")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True, help="threads of every engine")
@click.option("--seed", type=int, default=0, show_default=True, help="the mix's seed")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="rounds, each running our engine then every batch size: medians, and the ratio round by round")
@click.option("--json", "json_path", default=None, help="write the report here as JSON")
@click.option("--worker", is_flag=True, hidden=True, help="(internal) measure the job given on stdin, print the result")
def main(precision, num_requests, concurrency, batches, threads, seed, rounds, json_path, worker) -> None:
    """Serve one request mix by our engine and by onnxruntime-genai's static batches; print the table."""
    if worker:
        click.echo(json.dumps(run_worker(json.loads(sys.stdin.read()))))
        return
    from cann_llm.runtime.artifact import OmFile
    from cann_llm.runtime.tokenizer import TextTokenizer

    click.echo("building the models (once) ...", err=True)
    ours = model_of(Engine(f"cann-llm {precision}", "cann", precision, ours=True))
    genai = model_of(Engine(f"onnxruntime-genai {precision}", "genai", precision))
    tokenizer = TextTokenizer(OmFile(ours, verify_weights=False).tokenizer_files())
    requests = request_mix(tokenizer.encode(EVAL_TEXT.read_text(encoding="utf-8")), num_requests, seed)
    job = {"threads": threads, "requests": requests}
    ours_rounds, genai_rounds = [], []
    for round_number in range(1, rounds + 1):
        click.echo(f"round {round_number}/{rounds}: cann-llm, {concurrency} clients ...", err=True)
        ours_rounds.append(spawn({**job, "kind": "cann", "model": str(ours), "concurrency": concurrency}, SCRIPT))
        genai_rows = []
        for batch in _ints(batches):
            click.echo(f"round {round_number}/{rounds}: onnxruntime-genai, batch {batch} ...", err=True)
            if genai is None:
                genai_rows.append({"batch": batch, "error": "onnxruntime-genai is not installed"})
                continue
            measured = spawn({**job, "kind": "genai", "model": str(genai), "batch": batch}, SCRIPT)
            genai_rows.append({"batch": batch, **measured})
        genai_rounds.append(genai_rows)
    genai_medians = [median_row([rows[i] for rows in genai_rounds]) for i in range(len(genai_rounds[0]))]
    report = {"settings": {"precision": precision, "requests": num_requests, "concurrency": concurrency,
                           "threads": threads, "seed": seed, "rounds": rounds, "prompt_lengths": PROMPT_LENGTHS,
                           "output_lengths": OUTPUT_LENGTHS, "prompt_tokens": sum(len(p) for p, _ in requests),
                           "output_tokens": sum(n for _, n in requests), "models": {"cann": str(ours), "genai": str(genai)}},
              **summarize({"concurrency": concurrency, **median_row(ours_rounds)}, genai_medians),
              "round_ratios": round_ratios(ours_rounds, genai_rounds)}
    print_report(table(report), report, json_path)


if __name__ == "__main__":
    main()
