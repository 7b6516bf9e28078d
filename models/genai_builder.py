"""The tiny Llama as onnxruntime-genai's model builder writes it: one graph of onnxruntime contrib ops
(GroupQueryAttention with its rotary caches, SkipSimplifiedLayerNormalization, MatMulNBits for int4).

`genai_model("int4")` returns the folder holding `model.onnx` and `genai_config.json`, building it the
first time: the seeded tiny Llama saved with `save_pretrained` beside the byte tokenizer, then
`python -m onnxruntime_genai.models.builder -i HF -o OUT -p PRECISION -e cpu`, as a user runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from models.tiny import build_tiny_model, byte_tokenizer_json, cache_dir

PRECISIONS = ("fp32", "int4")


def builder_available() -> bool:
    """Whether onnxruntime-genai (and so its builder) is installed."""
    from importlib.util import find_spec

    return find_spec("onnxruntime_genai") is not None


def genai_model(precision: str, family: str = "llama") -> Path:
    """Folder of the builder's output for the tiny `family` at `precision` (fp32 or int4), built once."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")
    target = cache_dir() / "genai" / f"{family}-{precision}"
    if (target / "model.onnx").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        hf, out = Path(staging) / "hf", Path(staging) / "out"
        build_tiny_model(family).save_pretrained(hf)
        (hf / "tokenizer.json").write_text(byte_tokenizer_json(), encoding="utf-8")
        run = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
                              "-p", precision, "-e", "cpu"], capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"onnxruntime-genai's builder failed:\n{run.stderr[-4000:]}")
        try:  # parallel test workers may race: the first complete folder wins
            os.replace(out, target)
        except OSError:
            if not (target / "model.onnx").exists():
                raise
    return target
