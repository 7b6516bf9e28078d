"""Priority under a burst: many requests submitted at once to one engine, a share of them urgent
(`priority` 0) and the rest not (1); the time to first token of each class, and whether every request ends.

    python benchmarks/priority_burst.py --om .cache/peers/smollm2-int4-awq-head4.om [--requests 200]
        [--urgent 0.2] [--prompt_tokens 64] [--new_tokens 32] [--max_batch_size 32]

Prompts are distinct windows of cann_llm/models/data/eval.txt (no prefix shared), greedy, EOS held off. The same
burst runs twice: with the priorities, and with every request at priority 0 (first come, first served),
so the urgent class's TTFT can be set beside what it would be without them.
"""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cann_llm.runtime.engine.engine import LLMEngine  # noqa: E402
from cann_llm.runtime.engine.sampling import SamplingParams  # noqa: E402


def _p99(values: list[float]) -> float:
    return sorted(values)[max(0, int(round(0.99 * len(values))) - 1)]


def burst(engine: LLMEngine, prompts: list[list[int]], urgent: set[int], new_tokens: int,
          with_priorities: bool) -> dict[str, list[float]]:
    """TTFT (ms) of each class after submitting every prompt at once."""
    requests = [engine.submit(prompt, SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True,
                                                     priority=0 if i in urgent or not with_priorities else 1))
                for i, prompt in enumerate(prompts)]
    for request in requests:
        request.result()
    ttft = {"urgent": [], "other": []}
    for i, request in enumerate(requests):
        ttft["urgent" if i in urgent else "other"].append(request.stats.ttft_s * 1000)
    return ttft


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", "om_path", required=True)
@click.option("--requests", default=200, show_default=True)
@click.option("--urgent", "urgent_share", default=0.2, show_default=True, help="share of requests at priority 0")
@click.option("--prompt_tokens", default=64, show_default=True)
@click.option("--new_tokens", default=32, show_default=True)
@click.option("--max_batch_size", default=32, show_default=True)
def main(om_path: str, requests: int, urgent_share: float, prompt_tokens: int, new_tokens: int,
         max_batch_size: int) -> None:
    """Print each class's TTFT median and p99, with priorities and without."""
    with LLMEngine(om_path, max_batch_size=max_batch_size, kv_cache_pages=512, max_context_len=512) as engine:
        text = (Path(__file__).resolve().parents[1] / "cann_llm" / "models" / "data" / "eval.txt").read_text()
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        prompts = [ids[i * prompt_tokens:(i + 1) * prompt_tokens] for i in range(requests)]
        urgent = set(random.Random(0).sample(range(requests), int(requests * urgent_share)))
        engine.generate(prompts[0], max_new_tokens=4, temperature=0)  # warm the kernels
        for with_priorities in (True, False):
            engine.reset_prefix_cache()
            ttft = burst(engine, prompts, urgent, new_tokens, with_priorities)
            label = "priorities" if with_priorities else "first come"
            for kind, values in ttft.items():
                click.echo(f"{label:10} {kind:6} n={len(values):3} TTFT median {statistics.median(values):8.0f} ms  "
                           f"p99 {_p99(values):8.0f} ms  max {max(values):8.0f} ms")
            if with_priorities:
                click.echo(f"urgent p99 / other p99 = {_p99(ttft['urgent']) / _p99(ttft['other']):.2f}; "
                           f"all {requests} requests ended")


if __name__ == "__main__":
    main()
