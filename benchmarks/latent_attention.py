"""Batch-1 decode of a model with DeepSeek-V2-Lite's attention (random weights): the paged artifact, which attends
over the cached latent (LatentAttentionAbsorptionPass), beside the contiguous one, which runs the export as it is
and expands its whole latent cache through `kv_b_proj` every step.

    python benchmarks/latent_attention.py [--out .cache/bench/deepseek-v2-lite-attention] [--rounds 3]

DeepSeek-V2-Lite's attention: hidden 2048, 16 heads, a 512-wide latent and a 64-wide rotated key cached, keys
of 128 + 64 and values of 128 a head; here 4 such layers with dense MLPs (1,408 wide) and an 8,192-token
vocabulary, so a step is mostly attention. Each round times a short and a long context, both artifacts one
after the other, and prints decode tokens/s and how many of their greedy tokens agree. The export and the
artifacts are made once in --out.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import click

LAYERS = 4


def _build():
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=8192, hidden_size=2048, intermediate_size=1408, num_hidden_layers=LAYERS, num_attention_heads=16,
        num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, first_k_dense_replace=LAYERS, max_position_embeddings=4096)
    torch.manual_seed(0)
    return DeepseekV2ForCausalLM(config).eval()


def _artifacts(out: Path) -> dict[str, Path]:
    """{"contiguous", "paged"}: the FP32 artifacts in `out`, exported and compiled on first use."""
    from cann_llm.compiler.compile import compile_model
    from cann_llm.compiler.config import CompileConfig
    from cann_llm.models.export import export_causal_lm

    source = out / "model.onnx"
    if not source.exists():
        export_causal_lm(_build(), source, dynamo=True, with_past=True, external_data=True)
    artifacts = {}
    for name, paged in (("contiguous", False), ("paged", True)):
        om = out / f"{name}.om"
        if not om.exists():
            compile_model(CompileConfig(model=str(source), framework=5, output=str(out / name),
                                        soc_version="Ascend910B", enable_paged_attention=paged))
        artifacts[name] = om
    return artifacts


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--out", type=click.Path(path_type=Path), default=Path(".cache/bench/deepseek-v2-lite-attention"),
              show_default=True, help="where the export and the artifacts are kept")
@click.option("--rounds", default=3, show_default=True)
@click.option("--new-tokens", default=64, show_default=True)
@click.option("--contexts", default="64,1024", show_default=True, help="prompt lengths, comma-separated")
def main(out: Path, rounds: int, new_tokens: int, contexts: str) -> None:
    """Decode tokens/s of the paged (absorbed) and contiguous (as exported) latent attention, side by side."""
    import numpy as np

    from cann_llm import LLMEngine, SamplingParams

    out.mkdir(parents=True, exist_ok=True)
    artifacts = _artifacts(out)
    lengths = [int(n) for n in contexts.split(",")]
    prompts = {n: [int(t) for t in np.random.default_rng(n).integers(3, 8000, n)] for n in lengths}
    rates: dict[tuple[str, int], list[float]] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    # no prefix cache: the one-token run before each timed one would serve the prompt of the timed one
    engines = {name: LLMEngine(str(om), max_context_len=max(lengths) + new_tokens + 2,
                               **({"enable_prefix_caching": False} if name == "paged" else {}))
               for name, om in artifacts.items()}
    try:
        for engine in engines.values():  # warm
            engine.generate([prompts[lengths[0]]], SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True))
        for _ in range(rounds):
            for n in lengths:
                for name, engine in engines.items():
                    took = {}
                    for count in (1, new_tokens + 1):
                        start = time.perf_counter()
                        result = engine.generate([prompts[n]], SamplingParams(max_new_tokens=count, temperature=0,
                                                                              ignore_eos=True))
                        took[count] = time.perf_counter() - start
                    rates.setdefault((name, n), []).append(new_tokens / (took[new_tokens + 1] - took[1]))
                    tokens[(name, n)] = list(result[0].outputs[0].token_ids)
                    print(f"{name:10} context {n:5}: decode {rates[(name, n)][-1]:7.1f} tok/s", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    for n in lengths:
        paged, contiguous = (statistics.median(rates[(name, n)]) for name in ("paged", "contiguous"))
        agree = next((i for i, (a, b) in enumerate(zip(tokens[("paged", n)], tokens[("contiguous", n)])) if a != b),
                     len(tokens[("paged", n)]))
        print(f"context {n}: paged {paged:.1f} tok/s, contiguous {contiguous:.1f} tok/s, {paged / contiguous:.2f}x; "
              f"{agree} of {len(tokens[('paged', n)])} greedy tokens agree")


if __name__ == "__main__":
    main()
