"""Speculative decoding with a draft model at batch 1, on held-out natural text: the target alone (one token
a step) against the target with each draft, greedy, the same prompts, rounds alternating.

    python benchmarks/draft_speculation.py --target .cache/peers/smollm2-fp32.om \\
        --draft .cache/peers/smollm2-int4-awq-head4.om --draft .cache/peers/smollm2-w8a8.om [--tokens 128] [--k 4]

Prompts are windows of cann_llm/models/data/eval.txt (held out: never used to choose anything), continued as plain
text with EOS held off, so the output is new text rather than a copy of its prompt (where prompt lookup
would do as well). Every engine runs in this process on onnxruntime's process-wide pool (as `cann-run`
runs them: two sessions with pools of their own spin against each other on two cores). Prints tok/s per
round, the median ratio to the target alone, the share of draft tokens kept, and whether every output
equals the target's.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cann_llm.runtime.engine.engine import LLMEngine  # noqa: E402
from cann_llm.runtime.engine.sampling import SamplingParams  # noqa: E402


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--target", required=True, help="the target artifact (paged)")
@click.option("--draft", "drafts", multiple=True, required=True, help="a draft artifact (repeatable)")
@click.option("--k", default=4, show_default=True, help="num_speculative_tokens")
@click.option("--tokens", default=128, show_default=True, help="new tokens per prompt")
@click.option("--prompts", "num_prompts", default=3, show_default=True)
@click.option("--prompt_tokens", default=64, show_default=True)
@click.option("--rounds", default=3, show_default=True)
def main(target: str, drafts: tuple[str, ...], k: int, tokens: int, num_prompts: int, prompt_tokens: int,
         rounds: int) -> None:
    """Print each round's decode rates, then medians, ratios and agreement."""
    names = ["target alone", *drafts]
    engines = [LLMEngine(target, process_thread_pool=True)]
    engines += [LLMEngine(target, process_thread_pool=True, draft_model=d, num_speculative_tokens=k) for d in drafts]
    text = (Path(__file__).resolve().parents[1] / "cann_llm" / "models" / "data" / "eval.txt").read_text()
    ids = engines[0].tokenizer.encode(text, add_special_tokens=False)
    stride = len(ids) // num_prompts
    prompts = [ids[i * stride:i * stride + prompt_tokens] for i in range(num_prompts)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in names}
    outputs: dict[str, list] = {}
    try:
        for engine in engines:
            engine.generate(prompts[0][:8], max_new_tokens=8, temperature=0)  # warm
            engine.stats.draft_tokens = engine.stats.accepted_tokens = 0
        for round_ in range(rounds):
            for name, engine in zip(names, engines):
                start = time.perf_counter()
                results = [engine.generate([prompt], params)[0].outputs[0].token_ids for prompt in prompts]
                rates[name].append(num_prompts * tokens / (time.perf_counter() - start))
                outputs[name] = results
            click.echo(f"round {round_ + 1}: " + ", ".join(f"{n.split('/')[-1]} {rates[n][-1]:.1f} tok/s" for n in names))
        base = statistics.median(rates[names[0]])
        click.echo(f"target alone: {base:.1f} tok/s (median of {rounds})")
        for name, engine in zip(names[1:], engines[1:]):
            ratios = [r / b for r, b in zip(rates[name], rates[names[0]])]
            kept = engine.stats.accepted_tokens / max(1, engine.stats.draft_tokens)
            click.echo(f"{name}: {statistics.median(rates[name]):.1f} tok/s, {statistics.median(ratios):.2f}x "
                       f"(rounds {' '.join(f'{r:.2f}' for r in ratios)}), drafts kept {kept:.0%}, "
                       f"outputs equal the target's: {outputs[name] == outputs[names[0]]}")
    finally:
        for engine in engines:
            engine.close()


if __name__ == "__main__":
    main()
