"""Load time and one-step latency of a compiled `.om` beside onnxruntime on the original ONNX, in one run.

    python benchmarks/step_latency.py --om .cache/smollm2-contiguous.om --onnx .cache/smollm2-dynamo/model.onnx

The artifact must keep contiguous past/present I/O (compiled without --enable_paged_attention). Both sides
get identical inputs (a prefill of --seq tokens, and a one-token decode after --past cached
positions); runs alternate between the two so machine noise hits both alike. Prints medians and ratios.
"""

from __future__ import annotations

import statistics
import time

import click
import numpy as np
import onnxruntime as ort

from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.feeds import causal_lm_inputs
from cann_llm.runtime.ort_session import session_options


def median_ms(fn, repeat: int) -> float:
    """The median wall time of `repeat` calls of fn, in milliseconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", "om_path", required=True)
@click.option("--onnx", "onnx_path", required=True)
@click.option("--seq", default=128, show_default=True, help="prefill length")
@click.option("--past", default=256, show_default=True, help="cached positions before the decode step")
@click.option("--repeat", default=20, show_default=True)
@click.option("--threads", default=2, show_default=True)
def main(om_path: str, onnx_path: str, seq: int, past: int, repeat: int, threads: int) -> None:
    """Compare load time and step latency."""
    options = session_options(threads)
    loads = {"om": [], "onnx": []}
    for _ in range(3):
        start = time.perf_counter()
        executor = Executor(load_artifact(om_path), threads=threads)
        loads["om"].append(time.perf_counter() - start)
        start = time.perf_counter()
        session = ort.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
        loads["onnx"].append(time.perf_counter() - start)
    loaded = executor.loaded
    signature, dims = loaded.metadata["signature"], loaded.metadata["model"]
    rng = np.random.default_rng(0)
    cases = {
        f"prefill {seq}": causal_lm_inputs(signature, dims, rng.integers(0, dims["vocab_size"], (1, seq)), 0),
        f"decode after {past}": causal_lm_inputs(signature, dims, rng.integers(0, dims["vocab_size"], (1, 1)), past, rng),
    }
    click.echo(f"{'':<22}{'om (ms)':>10}{'onnx (ms)':>11}{'om/onnx':>9}")
    click.echo(f"{'load + session':<22}{statistics.median(loads['om']) * 1000:>10.1f}"
               f"{statistics.median(loads['onnx']) * 1000:>11.1f}"
               f"{statistics.median(loads['om']) / statistics.median(loads['onnx']):>9.2f}")
    for name, feeds in cases.items():
        medians = {"om": [], "onnx": []}
        for _ in range(3):
            medians["om"].append(median_ms(lambda: executor.run(feeds, ["logits"]), repeat // 3 + 1))
            medians["onnx"].append(median_ms(lambda: session.run(["logits"], feeds), repeat // 3 + 1))
        om_ms, onnx_ms = statistics.median(medians["om"]), statistics.median(medians["onnx"])
        click.echo(f"{name:<22}{om_ms:>10.1f}{onnx_ms:>11.1f}{om_ms / onnx_ms:>9.2f}")


if __name__ == "__main__":
    main()
