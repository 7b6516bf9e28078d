"""SmolLM2 quantized by onnxruntime's own tools, compiled by atc, beside onnxruntime running the quantized model.

    python benchmarks/onnxruntime_quantized.py [--rounds 3]

Models, made once into the cache folder from the dynamo export `python -m cann_llm.models.prepare smollm2` writes:
- dynamic: `onnxruntime.quantization.quantize_dynamic` with its defaults (int8 weights per tensor; uint8
  activations quantized per tensor at run time);
- nbits: `MatMulNBitsQuantizer` (4 bits, blocks of 32, symmetric, accuracy level 4: int8 activations).

Each is compiled paged + flash (benchmarks/peers.py's flags) and measured by `cann-run bench --onnx`: batch 1,
2 threads, the engine and onnxruntime's plain greedy loop on the quantized model in the same process, one
after the other, `--rounds` rounds of `cann-run bench`, each a fresh process; medians of prefill (512 tokens)
and decode (128 tokens) tok/s and of the ratio within each round.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import ATC_FLAGS, cache_dir, smollm2_export  # noqa: E402

from cann_llm.models.onnxruntime_quantizers import matmul_nbits, quantize_dynamic  # noqa: E402

QUANTIZERS = {"dynamic": quantize_dynamic, "nbits": matmul_nbits}


def quantized_model(kind: str) -> tuple[Path, Path]:
    """(the quantized ONNX model, its compiled artifact), made if missing."""
    folder = cache_dir() / f"smollm2-ort-{kind}"
    model, om = folder / "model.onnx", folder.with_suffix(".om")
    if not model.exists():
        source = smollm2_export()
        folder.mkdir(parents=True, exist_ok=True)
        for extra in source.parent.iterdir():  # the tokenizer and chat template atc packs
            if extra.suffix in (".json", ".jinja"):
                shutil.copy(extra, folder / extra.name)
        QUANTIZERS[kind](source, model)
    if not om.exists():
        subprocess.run([sys.executable, "-m", "cann_llm.cli.atc", f"--model={model}", f"--output={om.with_suffix('')}",
                        *ATC_FLAGS], check=True, capture_output=True)
    return model, om


def bench(model: Path, om: Path) -> dict:
    """One `cann-run bench` process: batch-1 prefill and decode of the engine and of onnxruntime."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "bench.json"
        subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "bench", "--model", str(om), "--onnx", str(model),
                        "--concurrency", "1", "--requests", "4", "--long_prefill", "", "--threads", "2",
                        "--json", str(report)], check=True, capture_output=True)
        return json.loads(report.read_text())["batch1"]


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
@click.option("--rounds", default=3, show_default=True)
def main(rounds: int) -> None:
    models = {kind: quantized_model(kind) for kind in QUANTIZERS}
    runs = {kind: [] for kind in models}
    for round_ in range(rounds):
        for kind in (list(models) if round_ % 2 == 0 else list(models)[::-1]):
            runs[kind].append(bench(*models[kind]))
    print(f"{'model':<10}{'phase':<9}{'engine tok/s':>14}{'onnxruntime':>13}{'ratio (rounds)':>30}")
    for kind, results in runs.items():
        for phase in ("prefill", "decode"):
            ours = [r["engine"][phase] for r in results]
            theirs = [r["onnxruntime"][phase] for r in results]
            ratios = [a / b for a, b in zip(ours, theirs)]
            rounds_text = " ".join(f"{r:.2f}" for r in ratios)
            print(f"{kind:<10}{phase:<9}{statistics.median(ours):>14.1f}{statistics.median(theirs):>13.1f}"
                  f"{statistics.median(ratios):>11.2f}x ({rounds_text})")


if __name__ == "__main__":
    main()
