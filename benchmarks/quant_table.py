"""The quantization table for one model: .om size, held-out perplexity, batch-1 decode step
(docs/performance.md#quantization-on-smollm2).

    python benchmarks/quant_table.py --onnx .cache/smollm2-dynamo/model.onnx --out .cache/quant-table

Compiles the model once per row with `atc --enable_compress_weight=1 --compress_weight_conf=...` or
`--precision_mode=...` (recording the compiler's peak resident memory), then
measures every row in the same run: perplexity on cann_llm/models/data/eval.txt (sliding window), and the median
latency of one decode step after 256 cached tokens, rows interleaved so machine noise hits them alike.
Writes a Markdown table and a JSON file to --out.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from cann_llm.models.data_files import EVAL_TEXT
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.feeds import causal_lm_inputs
from cann_llm.runtime.perplexity import perplexity
from cann_llm.runtime.tokenizer import TextTokenizer


@dataclass(frozen=True)
class Row:
    """One row's atc settings: a --compress_weight_conf document and a --precision_mode."""

    conf: dict | None = None
    precision: str | None = None


def _int4(method: str, group: int, **extra) -> Row:
    """An INT4 row; "awq+gptq" lists both algorithms (a chain). lm_head and the embedding table tied to it
    are quantized too, to 8 bits (`lm_head_bits`), unless `extra` says otherwise: the INT4 artifact's size
    target (≤ 0.20× FP32) cannot be met with SmolLM2's 113 MB table left float."""
    algorithms = [{"name": name} for name in method.split("+")]
    return Row({"quant_mode": "INT4", "group_size": group, "algorithms": algorithms, "skip_layers": [], **extra})


ROWS = {
    "FP32": Row(),
    "FP16 storage": Row(precision="force_fp16"),
    "mixed FP16": Row(precision="allow_mix_precision"),
    "mixed BF16": Row(precision="allow_mix_precision_bf16"),
    "INT8": Row({"quant_mode": "INT8"}),
    "W8A8": Row({"quant_mode": "W8A8", "algorithms": [{"name": "smooth_quant", "params": {"alpha": 0.5}}]}),
    "W8A8 (8-bit head)": Row({"quant_mode": "W8A8", "algorithms": [{"name": "smooth_quant"}], "skip_layers": []}),
    **{f"INT4-{method.upper()} g{group}{' asym' if not symmetric else ''}": _int4(method, group, symmetric=symmetric)
       for group, symmetric in ((128, True), (32, True), (32, False)) for method in ("rtn", "awq", "gptq", "awq+gptq")},
    **{f"INT4-{method.upper()} g{group} float zp": _int4(method, group, symmetric=False, zero_points="float")
       for group in (128, 32) for method in ("rtn", "awq", "gptq", "awq+gptq")},
    "INT4-AWQ+GPTQ g32 asym (float head)": _int4("awq+gptq", 32, symmetric=False, skip_layers=["lm_head"]),
    "INT4-AWQ+GPTQ g32 asym (INT4 head)": _int4("awq+gptq", 32, symmetric=False, lm_head_bits=4),
}


def _compile(onnx_path: Path, out: Path, name: str, row: Row) -> tuple[Path, float, float]:
    """The row's .om, compile seconds and the compiler's peak resident memory (GB)."""
    stem = out / name.replace(" ", "-").lower()
    command = [sys.executable, "-m", "cann_llm.cli.atc", f"--model={onnx_path}", "--framework=5", f"--output={stem}",
               "--soc_version=Ascend910B"]
    if row.conf is not None:
        conf_path = stem.with_suffix(".json")
        conf_path.write_text(json.dumps(row.conf))
        command += ["--enable_compress_weight=1", f"--compress_weight_conf={conf_path}"]
    if row.precision is not None:
        command.append(f"--precision_mode={row.precision}")
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    if status:
        raise click.ClickException(f"atc failed for {name}: {process.stderr.read().decode()[-2000:]}")
    return stem.with_suffix(".om"), time.perf_counter() - start, usage.ru_maxrss / 2**20


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--onnx", "onnx_path", required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path))
@click.option("--rows", default=",".join(ROWS), show_default=True)
@click.option("--max_tokens", default=None, type=int, help="score only the first N tokens of the text")
@click.option("--repeat", default=30, show_default=True)
@click.option("--reuse", is_flag=True, help="measure the .om files already in --out instead of compiling")
def main(onnx_path: Path, out: Path, rows: str, max_tokens: int | None, repeat: int, reuse: bool) -> None:
    """Build and measure the table."""
    out.mkdir(parents=True, exist_ok=True)
    names = rows.split(",")
    artifacts = {}
    for name in names:
        existing = (out / name.replace(" ", "-").lower()).with_suffix(".om")
        artifacts[name] = (existing, 0.0, 0.0) if reuse and existing.exists() else _compile(onnx_path, out, name, ROWS[name])
        click.echo(f"compiled {name} in {artifacts[name][1]:.1f} s, peak {artifacts[name][2]:.2f} GB")
    # the sessions share two cores: their idle threads must sleep, not spin, or they slow each other down
    executors = {name: Executor(load_artifact(path), threads=2, spinning=False) for name, (path, _, _) in artifacts.items()}
    first = next(iter(executors.values())).loaded
    ids = TextTokenizer(first.om.tokenizer_files()).encode(EVAL_TEXT.read_text(encoding="utf-8"))
    ids = ids[:max_tokens] if max_tokens else ids
    signature, dims = first.metadata["signature"], first.metadata["model"]
    step = causal_lm_inputs(signature, dims, np.asarray([[ids[0]]]), 256, np.random.default_rng(0))
    latencies = {name: [] for name in names}
    for _ in range(repeat):
        for name, executor in executors.items():
            start = time.perf_counter()
            executor.run(step, ["logits"])
            latencies[name].append((time.perf_counter() - start) * 1000)
    fp32_size = artifacts[names[0]][0].stat().st_size
    results = []
    for name in names:
        ppl = perplexity(executors[name], ids).perplexity
        size = artifacts[name][0].stat().st_size
        step_ms = statistics.median(latencies[name])
        results.append({"row": name, "om_bytes": size, "size_vs_first": size / fp32_size, "perplexity": ppl,
                        "accuracy_levels": sorted({a.i for n in executors[name].loaded.model.graph.node
                                                   for a in n.attribute if a.name == "accuracy_level"}),
                        "decode_step_ms": step_ms, "decode_tokens_per_s": 1000 / step_ms,
                        "compile_s": artifacts[name][1], "compile_peak_gb": artifacts[name][2]})
        click.echo(f"{name:<16} {size / 1e6:8.1f} MB  ×{size / fp32_size:.3f}  ppl {ppl:8.3f}  "
                   f"step {step_ms:6.2f} ms ({1000 / step_ms:6.1f} tok/s)")
    lines = ["| weights | .om size | vs first | perplexity (eval.txt) | decode step (ms) | tokens/s | atc peak memory |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['row']} | {r['om_bytes'] / 1e6:.1f} MB | {r['size_vs_first']:.3f}× | {r['perplexity']:.3f} | "
              f"{r['decode_step_ms']:.2f} | {r['decode_tokens_per_s']:.1f} | {r['compile_peak_gb']:.2f} GB |"
              for r in results]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "table.json").write_text(json.dumps(results, indent=2) + "\n")
    click.echo("\n".join(lines))


if __name__ == "__main__":
    main()
