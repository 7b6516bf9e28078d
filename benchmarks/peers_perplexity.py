"""Perplexity of this project's SmolLM2 artifacts beside onnxruntime-genai's models, on the same held-out text.

    python benchmarks/peers_perplexity.py [--window 512] [--stride 256] [--threads 2] [--json peers_ppl.json]
                                          [--om PATH ...]

The text is cann_llm/models/data/eval.txt tokenized by SmolLM2's tokenizer (the same ids for every model: the builder
keeps the Hugging Face tokenizer), scored window by window the same way for all
(cann_llm.runtime.perplexity.sliding_window_perplexity): this project's artifacts through the executor, and
onnxruntime-genai's builder models (`.cache/genai/smollm2-int4` and `-fp32`, made by benchmarks/peers.py) through
onnxruntime itself, one forward pass per window with an empty cache, which is the graph its Generator runs.
The artifacts default to the ones benchmarks/peers.py measures (`.cache/peers/smollm2-{fp32,int4}.om`);
--om adds or replaces them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import Engine, cann_artifact, model_of, print_report  # noqa: E402

from cann_llm.models.data_files import EVAL_TEXT  # noqa: E402
from cann_llm.runtime.loader import load_artifact  # noqa: E402
from cann_llm.runtime.executor import Executor  # noqa: E402
from cann_llm.runtime.perplexity import perplexity, sliding_window_perplexity  # noqa: E402


def genai_window_logits(model: Path, threads: int):
    """A `window_logits` for an onnxruntime-genai builder model: the window with no past, every row's logits."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(model / "model.onnx"), options, providers=["CPUExecutionProvider"])
    # the builder leaves the cache's head size symbolic in the graph; its config states it
    decoder = json.loads((model / "genai_config.json").read_text())["model"]["decoder"]
    empty = {i.name: np.zeros((1, int(decoder["num_key_value_heads"]), 0, int(decoder["head_size"])), np.float32)
             for i in session.get_inputs() if i.name.startswith("past_key_values")}

    def window_logits(ids: list[int]) -> np.ndarray:
        feeds = {"input_ids": np.asarray([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
        return session.run(["logits"], {**feeds, **empty})[0][0]

    return window_logits


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--window", default=512, show_default=True)
@click.option("--stride", default=256, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--om", "artifacts", multiple=True, help="an artifact to score (default: the peers' fp32 and int4)")
@click.option("--json", "json_path", default=None, help="write the rows here")
def main(window: int, stride: int, threads: int, artifacts: tuple[str, ...], json_path: str | None) -> None:
    """Print each model's perplexity on eval.txt."""
    paths = [Path(a) for a in artifacts] or [cann_artifact("fp32"), cann_artifact("int4")]
    # as `cann-run eval_ppl` tokenizes: the artifact's own tokenizer, its special tokens included
    ids = load_artifact(paths[0]).tokenizer.encode(EVAL_TEXT.read_text(encoding="utf-8"))
    rows = []
    for path in paths:
        result = perplexity(Executor(load_artifact(path), threads=threads), ids, window, stride)
        rows.append({"model": str(path), "perplexity": result.perplexity, "tokens": result.tokens_scored})
    for precision in ("fp32", "int4"):
        folder = model_of(Engine(f"onnxruntime-genai {precision}", "genai", precision))
        result = sliding_window_perplexity(genai_window_logits(folder, threads), ids, window, stride)
        rows.append({"model": f"onnxruntime-genai {precision} ({folder})", "perplexity": result.perplexity,
                     "tokens": result.tokens_scored})
    lines = [f"{row['perplexity']:9.3f}  {row['tokens']} tokens  {row['model']}" for row in rows]
    print_report(lines, {"window": window, "stride": stride, "rows": rows}, json_path)


if __name__ == "__main__":
    main()
