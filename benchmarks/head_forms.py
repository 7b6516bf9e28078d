"""Perplexity of SmolLM2 with only its tied lm_head / embedding table quantized, in several 4-bit forms.

    python benchmarks/head_forms.py [--forms 64:sym,64:zero,64:clip,64:full,32:sym,32:zero,32:full]

Each form quantizes the table (lm_head's [576, 49152] weight, which the embedding also reads through a
Transpose) of onnxruntime-genai's FP32 model (benchmarks/peers.py builds it), dequantizes it back to float32 and
scores the model on eval.txt as benchmarks/peers_perplexity.py scores onnxruntime-genai's models (window 512,
stride 256, one forward pass a window): what the table's form alone costs, the layers kept float. A form is
BLOCK:KIND, KIND one of `sym` (±7 levels, `quantize_blockwise`), `zero` (integer zero points), `clip` (zero
points, each block's range clipped to its least squared error), `full` (all 16 levels, `quantize_full_range`,
what atc writes for a 4-bit tied table). It prints each form's squared error over the table's energy too.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import click
import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import Engine, model_of  # noqa: E402
from peers_perplexity import genai_window_logits  # noqa: E402

from cann_llm.models.data_files import EVAL_TEXT  # noqa: E402
from cann_llm.passes.quant.math import quantize_blockwise, quantize_full_range  # noqa: E402
from cann_llm.passes.quant.search import clip_search  # noqa: E402
from cann_llm.runtime.kernels.matmul_nbits_layout import dequantize_blockwise  # noqa: E402
from cann_llm.runtime.perplexity import sliding_window_perplexity  # noqa: E402
from cann_llm.runtime.tokenizer import TextTokenizer  # noqa: E402

HEAD = "lm_head.MatMul.weight"
KINDS = {
    "sym": lambda w, block: quantize_blockwise(w, 4, block, symmetric=True),
    "zero": lambda w, block: quantize_blockwise(w, 4, block, symmetric=False),
    "clip": lambda w, block: clip_search(w, None, 4, block, symmetric=False),
    "full": lambda w, block: quantize_full_range(w, 4, block),
}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--forms", default="64:sym,64:zero,64:clip,64:full,32:sym,32:zero,32:full", show_default=True,
              help="BLOCK:KIND, comma-separated; KIND: " + " | ".join(KINDS))
@click.option("--threads", default=2, show_default=True)
def main(forms: str, threads: int) -> None:
    """Print each form's relative squared error and perplexity, beside the FP32 table's."""
    source = model_of(Engine("onnxruntime-genai fp32", "genai", "fp32"))
    if source is None:
        raise click.ClickException("onnxruntime-genai's model builder is not installed (pip install -e '.[bench]')")
    model = onnx.load(str(source / "model.onnx"), load_external_data=True)
    table = next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == HEAD).astype(np.float32)
    files = {name: (source / name).read_text(encoding="utf-8") for name in ("tokenizer.json", "tokenizer_config.json")
             if (source / name).exists()}
    ids = TextTokenizer(files).encode(EVAL_TEXT.read_text(encoding="utf-8"))
    for form in ["fp32", *forms.split(",")]:
        if form == "fp32":
            weight = table
        else:
            block, kind = form.split(":")
            if kind not in KINDS:
                raise click.BadParameter(f"{kind!r} is not one of {', '.join(KINDS)}", param_hint="--forms")
            weight = dequantize_blockwise(KINDS[kind](table, int(block))).astype(np.float32)
        error = float(np.mean((weight - table) ** 2) / np.mean(table ** 2))
        swapped = onnx.ModelProto()
        swapped.CopyFrom(model)
        for tensor in swapped.graph.initializer:
            if tensor.name == HEAD:
                tensor.CopyFrom(numpy_helper.from_array(weight, HEAD))
        with tempfile.TemporaryDirectory() as folder:
            onnx.save(swapped, str(Path(folder) / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
            shutil.copy(source / "genai_config.json", Path(folder) / "genai_config.json")
            result = sliding_window_perplexity(genai_window_logits(Path(folder), threads), ids, 512, 256)
        click.echo(f"{form:>10}  squared error {error:.4f} of the table's energy  perplexity {result.perplexity:.3f}")


if __name__ == "__main__":
    main()
