"""Where every millisecond of a batch-1 decode step goes, measured inside the engine serving one request.

    python benchmarks/step_breakdown.py --om .cache/smollm2-paged.om [--prompt-tokens 32] [--steps 128]

The engine runs as `cann-run` runs it (onnxruntime's process-wide pool); timers wrap, for the length of the
run, the step, the runner's input building, every onnxruntime session run and every host kernel call of
the executor, and sampling. For the decode steps (one token each) it prints the median step, each part's
median and share, the count of session crossings and host calls per step, the slowest segments, and what
is left: Python between the parts (scheduling, bookkeeping, the executor's own loop).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import click

import cann_llm.runtime.engine.engine as engine_module
from cann_llm.runtime.engine.engine import LLMEngine
from cann_llm.runtime.executor import _HostStep


class Timers:
    """Seconds per labelled call, grouped by the step they fell in."""

    def __init__(self):
        self.step = 0
        self.calls: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.tokens: dict[int, int] = {}

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls[self.step][label].append(time.perf_counter() - start)
        return timed


def _segment_label(index: int, step) -> str:
    if isinstance(step, _HostStep):
        return f"host {step.kernel.__name__}"
    return f"segment {index} -> {step.outputs[0] if step.outputs else '?'}"


def instrument(engine: LLMEngine) -> Timers:
    """Timers around the engine's step and the parts of it (for this engine only, until it is closed)."""
    timers = Timers()
    step, run = engine.step, engine.runner.run

    def counted_step():
        timers.step += 1
        return timers.wrap("step", step)()

    def counted_run(batch):
        timers.tokens[timers.step] = batch.total_tokens
        return run(batch)

    engine.step = counted_step
    engine.runner.run = counted_run
    if hasattr(engine.runner, "feeds"):
        engine.runner.feeds = timers.wrap("inputs", engine.runner.feeds)
    for index, part in enumerate(engine.runner.executor._steps):
        part.run = timers.wrap(_segment_label(index, part), part.run)
    engine_module.process_logits = timers.wrap("sampling", engine_module.process_logits)
    engine_module.draw = timers.wrap("sampling", engine_module.draw)
    return timers


def report(timers: Timers) -> list[str]:
    """The lines printed: medians over the decode steps (one token, not the first)."""
    decode = [s for s, n in timers.tokens.items() if n == 1 and s > 1]
    if not decode:
        return ["no decode steps were measured"]

    def median_total(predicate) -> float:
        return statistics.median(sum(sum(v) for k, v in timers.calls[s].items() if predicate(k)) for s in decode) * 1000

    step = median_total(lambda k: k == "step")
    parts = {
        "onnxruntime sessions": median_total(lambda k: k.startswith("segment")),
        "host kernels": median_total(lambda k: k.startswith("host")),
        "runner inputs": median_total(lambda k: k == "inputs"),
        "sampling": median_total(lambda k: k == "sampling"),
    }
    sample = timers.calls[decode[0]]
    crossings = sum(len(v) for k, v in sample.items() if k.startswith("segment"))
    host_calls = sum(len(v) for k, v in sample.items() if k.startswith("host"))
    lines = [f"decode steps measured: {len(decode)}; median step {step:.2f} ms ({1000 / step:.1f} tok/s)",
             f"per step: {crossings} onnxruntime session runs, {host_calls} host kernel calls"]
    for name, value in parts.items():
        lines.append(f"  {name:<22} {value:7.2f} ms  {value / step:6.1%}")
    rest = step - sum(parts.values())
    lines.append(f"  {'Python between them':<22} {rest:7.2f} ms  {rest / step:6.1%}")
    segments = {k for s in decode for k in timers.calls[s] if k.startswith(("segment", "host"))}
    per_label = {k: statistics.median(sum(timers.calls[s].get(k, [0.0])) for s in decode) * 1000 for k in segments}
    lines.append("slowest parts (median ms per step):")
    for label, value in sorted(per_label.items(), key=lambda item: -item[1])[:8]:
        lines.append(f"  {value:7.3f}  {label}")
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", "om_path", required=True, help="the artifact (paged or contiguous)")
@click.option("--prompt-tokens", default=32, show_default=True)
@click.option("--steps", default=128, show_default=True, help="tokens generated (EOS held off)")
@click.option("--threads", type=int, default=None, help="onnxruntime's threads (default: its own choice)")
@click.option("--host-attention", is_flag=True, help="the segmented plan: attention as host kernels between sessions")
@click.option("--onnxruntime-matmul", is_flag=True, help="onnxruntime's MatMulNBits, not the native int8 matmul")
def main(om_path: str, prompt_tokens: int, steps: int, threads: int | None, host_attention: bool,
         onnxruntime_matmul: bool) -> None:
    """Print the breakdown of the decode steps of one request."""
    with LLMEngine(om_path, max_batch_size=1, max_context_len=prompt_tokens + steps + 8, kv_cache_pages=64,
                   threads=threads, process_thread_pool=True, host_attention=host_attention,
                   native_matmul=not onnxruntime_matmul) as engine:
        engine.generate([5 + i % 200 for i in range(prompt_tokens)], max_new_tokens=4, temperature=0.0, ignore_eos=True)
        timers = instrument(engine)
        prompt = [7 + i % 190 for i in range(prompt_tokens)]
        engine.generate(prompt, max_new_tokens=steps, temperature=0.0, ignore_eos=True)
    for line in report(timers):
        click.echo(line)


if __name__ == "__main__":
    main()
