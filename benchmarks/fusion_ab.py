"""Batch-1 decode of one model compiled with a fusion pass and without it, in one process.

    python benchmarks/fusion_ab.py --family qwen3 --fusion QkvFusionPass [--int4] [--rounds 11] [--steps 128]

The model is a randomly initialised one of the family at SmolLM2-135M's sizes (hidden 576, 30 layers, 9 heads
of 64, 3 KV heads, intermediate 1536, vocabulary 49,152), exported by PyTorch's dynamo exporter with
transformers' defaults and kept in `.cache/bench/`. It is compiled twice, paged with flash prefill (and INT4
RTN weights with `--int4`), the second time with `--fusion_switch_file` turning the pass off; both engines
run on onnxruntime's process-wide pool as `cann-run` runs them. Each round every engine decodes --steps tokens
greedily after the same 32-token prompt, in turn (the order reversed every other round); it prints each
one's milliseconds a token round by round, the ratio (off over on: above 1 is faster with the fusion) with
its median, the fused-node counts, and whether the two decoded the same tokens.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import click

from engine_rounds import decode_rounds, report

from cann_llm.compiler.compile import compile_model
from cann_llm.compiler.config import CompileConfig
from cann_llm.models.tiny import TINY_FAMILIES, cache_dir
from cann_llm.runtime import load_artifact
from cann_llm.runtime.engine.engine import LLMEngine

PROMPT = [7 + i % 190 for i in range(32)]
SMOLLM2_SIZES = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192)


def _export(family: str) -> Path:
    """The family at SmolLM2's sizes, exported once."""
    import torch
    import transformers

    from cann_llm.models.export import export_causal_lm

    path = cache_dir() / "bench" / f"{family}-smollm2-size" / "model.onnx"
    if not path.exists():
        spec = TINY_FAMILIES[family]
        config = getattr(transformers, spec.config_class)(**{**spec.sizes, **SMOLLM2_SIZES})
        torch.manual_seed(0)
        model = getattr(transformers, spec.model_class)(config).eval()
        export_causal_lm(model, path, dynamo=True, with_past=True, external_data=True)
    return path


def _compile(source: Path, name: str, int4: bool, switch: Path | None) -> Path:
    output = source.parent / name
    if not output.with_suffix(".om").exists():
        compile_model(CompileConfig(model=str(source), framework=5, output=str(output), soc_version="Ascend910B",
                                    enable_paged_attention=True, enable_flash_attention=True,
                                    enable_compress_weight=int4,
                                    fusion_switch_file=str(switch) if switch else None))
    return output.with_suffix(".om")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--family", default="qwen3", show_default=True, type=click.Choice(sorted(TINY_FAMILIES)))
@click.option("--fusion", default="QkvFusionPass", show_default=True, help="the pass compiled in and out")
@click.option("--int4", is_flag=True, help="INT4 RTN weights (--enable_compress_weight) in both")
@click.option("--rounds", default=11, show_default=True)
@click.option("--steps", default=128, show_default=True, help="tokens decoded a round (EOS held off)")
@click.option("--threads", default=2, show_default=True)
def main(family: str, fusion: str, int4: bool, rounds: int, steps: int, threads: int) -> None:
    """Time decode steps of the model compiled with the fusion and without it, alternating."""
    source = _export(family)
    switch = source.parent / f"{fusion}-off.cfg"
    switch.write_text(f"{fusion}:off\n")
    precision = "int4" if int4 else "fp32"
    artifacts = {True: _compile(source, f"{precision}-fused", int4, None),
                 False: _compile(source, f"{precision}-{fusion}-off", int4, switch)}
    for fused, om in artifacts.items():
        counts = Counter(node.op_type for node in load_artifact(om).model.graph.node)
        click.echo(f"{fusion} {'on' if fused else 'off'}: " + json.dumps(
            {op: counts[op] for op in ("MatMul", "MatMulInt4", "MatMulF32", "Split", "PagedAttention") if counts[op]}))
    engines = {fused: LLMEngine(om, max_batch_size=1, max_context_len=len(PROMPT) + steps + 8, kv_cache_pages=64,
                                threads=threads, process_thread_pool=True) for fused, om in artifacts.items()}
    for engine in engines.values():  # warm-up
        engine.generate(PROMPT, max_new_tokens=4, temperature=0.0, ignore_eos=True)
    times, tokens = decode_rounds(engines, PROMPT, steps, rounds)
    click.echo(report(times, tokens, {True: f"{fusion} on", False: f"{fusion} off"}, faster=True, slower=False))


if __name__ == "__main__":
    main()
