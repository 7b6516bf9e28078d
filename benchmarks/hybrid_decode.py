"""Batch-1 decode of a Mamba-2 hybrid shaped as Granite 4.0-H-350M (random weights), paged: tokens/s and the
time a step spends handing each sequence's recurrent states in and out of the graph (`StatePool`).

    python benchmarks/hybrid_decode.py [--out .cache/bench/granite-h-350m] [--rounds 3] [--new-tokens 128]

Granite 4.0-H-350M: hidden 768, 28 Mamba-2 layers (48 heads of 32 × 128 in 8 groups) and 4 attention
layers (12 heads, 4 KV heads, no positions), tied 100,352-token vocabulary: 23 MB of states a sequence,
copied in and out of every step. The export and the artifact are made once in --out.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import click

LAYERS = 32
ATTENTION = (10, 13, 17, 27)  # the model card's attention layers; the others Mamba-2


def _build():
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        vocab_size=100352, hidden_size=768, intermediate_size=2048, shared_intermediate_size=2048,
        num_hidden_layers=LAYERS, num_attention_heads=12, num_key_value_heads=4, num_local_experts=0,
        layer_types=["attention" if i in ATTENTION else "mamba" for i in range(LAYERS)], mamba_n_heads=48,
        mamba_n_groups=8, mamba_d_state=128, mamba_d_head=32, mamba_d_conv=4, tie_word_embeddings=True,
        position_embedding_type="nope", embedding_multiplier=12.0, logits_scaling=3.0, residual_multiplier=0.246,
        attention_multiplier=0.015625)
    torch.manual_seed(0)
    return GraniteMoeHybridForCausalLM(config).eval()


def _artifact(out: Path) -> Path:
    """The paged FP32 artifact in `out`, exported and compiled on first use."""
    from cann_llm.compiler.compile import compile_model
    from cann_llm.compiler.config import CompileConfig
    from cann_llm.models.export import export_causal_lm

    om = out / "model.om"
    if not om.exists():
        source = out / "model.onnx"
        if not source.exists():
            export_causal_lm(_build(), source, dynamo=True, with_past=True, external_data=True)
        compile_model(CompileConfig(model=str(source), framework=5, output=str(out / "model"),
                                    soc_version="Ascend910B", enable_paged_attention=True))
    return om


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--out", type=click.Path(path_type=Path), default=Path(".cache/bench/granite-h-350m"),
              show_default=True, help="where the export and the artifact are kept")
@click.option("--rounds", default=3, show_default=True)
@click.option("--new-tokens", default=128, show_default=True)
@click.option("--prompt", default=32, show_default=True, help="prompt tokens")
def main(out: Path, rounds: int, new_tokens: int, prompt: int) -> None:
    """Decode tokens/s of a Granite 4.0-H-350M-shaped hybrid and its states' share of a step."""
    import numpy as np

    from cann_llm import LLMEngine, SamplingParams
    from cann_llm.runtime.engine.state_pool import StatePool

    out.mkdir(parents=True, exist_ok=True)
    om = _artifact(out)
    spent = []  # seconds in StatePool.feeds and .keep

    def timed(method):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)
        return run

    StatePool.feeds, StatePool.keep = timed(StatePool.feeds), timed(StatePool.keep)
    ids = [int(t) for t in np.random.default_rng(0).integers(1000, 90000, prompt)]
    rates, shares = [], []
    with LLMEngine(str(om)) as engine:
        engine.generate([ids], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))  # warm
        for _ in range(rounds):
            timings = {}
            for count in (1, new_tokens + 1):
                spent.clear()
                start = time.perf_counter()
                engine.generate([ids], SamplingParams(max_new_tokens=count, temperature=0, ignore_eos=True))
                timings[count] = (time.perf_counter() - start, sum(spent))
            decode = timings[new_tokens + 1][0] - timings[1][0]
            rates.append(new_tokens / decode)
            whole, states = timings[new_tokens + 1]  # the prompt's step and every decode step
            shares.append(states / whole)
            print(f"decode {rates[-1]:.1f} tok/s, states {1000 * states / (new_tokens + 1):.2f} ms a step "
                  f"({100 * shares[-1]:.1f}% of it)", flush=True)
    print(f"median: decode {statistics.median(rates):.1f} tok/s, states {100 * statistics.median(shares):.1f}% "
          f"of a step")


if __name__ == "__main__":
    main()
