"""Decode step of a small MoE model with its experts fused into cann::MoE vs left as exported, in one run.

    python benchmarks/moe_decode.py [--family qwen3_moe] [--experts 16] [--past 128]

Builds a randomly initialised Qwen-MoE big enough that the expert weights dominate (hidden 256, 16
experts of intermediate size 256, top-2: 25 MB of experts in 2 layers beside 2 MB of attention),
exports it with the dynamo exporter (KV cache I/O) and compiles it twice: as is, and with
`MoeFusionPass:off` (transformers' batched_mm graph: every token copies its k experts' weights out of the
3-D tensors, then batched matmuls). Both run through the runtime's onnxruntime backend on identical
feeds; rounds alternate between the two so machine noise hits both alike. Prints medians and ratios for
a one-token decode after --past cached positions (batch 1, and --batch sequences at once) and a
--prefill-token prompt.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import click
import numpy as np
from step_latency import median_ms  # benchmarks/ is the script's folder, so on its path

from cann_llm.compiler.compile import compile_model
from cann_llm.compiler.config import CompileConfig
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.feeds import causal_lm_inputs


def _compile(source: Path, output: Path, **flags) -> Path:
    cfg = CompileConfig(model=str(source), framework=5, output=str(output), soc_version="Ascend910B", **flags)
    return compile_model(cfg).output


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--family", type=click.Choice(["qwen3_moe", "qwen2_moe"]), default="qwen3_moe", show_default=True)
@click.option("--experts", default=16, show_default=True)
@click.option("--top-k", default=2, show_default=True)
@click.option("--past", default=128, show_default=True, help="cached positions before the decode step")
@click.option("--batch", default=8, show_default=True, help="sequences of the batched decode row")
@click.option("--prefill", default=64, show_default=True, help="prompt length of the prefill row")
@click.option("--rounds", default=5, show_default=True, help="alternating rounds; each gives one median")
@click.option("--repeat", default=30, show_default=True, help="steps timed per round and variant")
@click.option("--threads", default=2, show_default=True)
def main(family: str, experts: int, top_k: int, past: int, batch: int, prefill: int, rounds: int, repeat: int,
         threads: int) -> None:
    """Fused vs unfused MoE decode latency."""
    from cann_llm.models.tiny import tiny_onnx

    sizes = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=experts,
                 num_experts_per_tok=top_k, moe_intermediate_size=256, norm_topk_prob=family == "qwen3_moe")
    if family == "qwen2_moe":
        sizes["shared_expert_intermediate_size"] = 512
    source = tiny_onnx(family, dynamo=True, with_past=True, overrides=sizes)
    with tempfile.TemporaryDirectory() as folder:
        switch = Path(folder) / "switch.cfg"
        switch.write_text("MoeFusionPass:off\n")
        executors = {"fused": Executor(load_artifact(_compile(source, Path(folder) / "fused")), threads=threads),
                     "unfused": Executor(load_artifact(_compile(source, Path(folder) / "unfused",
                                                                fusion_switch_file=str(switch))), threads=threads)}
        loaded = executors["fused"].loaded
        signature, dims = loaded.metadata["signature"], loaded.metadata["model"]
        rng = np.random.default_rng(0)
        cases = {f"decode after {past}": causal_lm_inputs(signature, dims, rng.integers(0, dims["vocab_size"], (1, 1)),
                                                          past, rng),
                 f"decode x{batch} after {past}": causal_lm_inputs(
                     signature, dims, rng.integers(0, dims["vocab_size"], (batch, 1)), past, rng),
                 f"prefill {prefill}": causal_lm_inputs(signature, dims,
                                                        rng.integers(0, dims["vocab_size"], (1, prefill)), 0)}
        ops = {name: sum(n.op_type == "MoE" for n in e.loaded.model.graph.node) for name, e in executors.items()}
        click.echo(f"{family}: {experts} experts, top-{top_k}, hidden 256, intermediate 256; MoE ops fused "
                   f"{ops['fused']}, unfused {ops['unfused']}; {threads} threads, {rounds} rounds x {repeat} steps")
        click.echo(f"{'':<22}{'fused (ms)':>12}{'unfused (ms)':>14}{'unfused/fused':>15}")
        for name, feeds in cases.items():
            first = {k: e.run(feeds, ["logits"])["logits"] for k, e in executors.items()}
            gap = float(np.abs(first["fused"] - first["unfused"]).max())
            medians = {k: [] for k in executors}
            for _ in range(rounds):
                for key, executor in executors.items():
                    medians[key].append(median_ms(lambda: executor.run(feeds, ["logits"]), repeat))
            fused, unfused = statistics.median(medians["fused"]), statistics.median(medians["unfused"])
            click.echo(f"{name:<22}{fused:>12.3f}{unfused:>14.3f}{unfused / fused:>15.2f}"
                       f"   (max |logit difference| {gap:.1e})")


if __name__ == "__main__":
    main()
