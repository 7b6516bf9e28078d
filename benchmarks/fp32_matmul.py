"""onnxruntime's FP32 MatMul (MLAS) on distinct weights from memory, with and without pre-packing the weights.

    python benchmarks/fp32_matmul.py [--shapes 576x3072,1536x576] [--rows 1,512] [--megabytes 100]

For each K x N: two sessions of `count` MatMul nodes on one [rows, K] input, each with weights of its own (enough of
them that they come from memory, as a decode step's do), one as onnxruntime builds it (MLAS pre-packs every
constant B), one with `session.disable_prepacking` (MLAS packs B on the fly each call, reading the weights as
stored, which is what a second session or a native op over the same unpacked bytes would need). Both on the
process-wide pool of --threads, alternating --rounds times; prints the median µs per matmul and, at one row, the
weight bytes read per second. benchmarks/fp32_gemv_probe.c is a plain GEMV of our own on the same shapes.
"""

from __future__ import annotations

import statistics
import time

import click
import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from runtime.ort_session import enable_process_thread_pool, session_options


def _session(k: int, n: int, count: int, prepack: bool) -> ort.InferenceSession:
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), f"w{i}") for i in range(count)]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(count)]
    graph = helper.make_graph(nodes, "matmuls", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, None) for i in range(count)],
                              weights)
    options = session_options()
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(helper.make_model(graph).SerializeToString(), options, providers=["CPUExecutionProvider"])


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--shapes", default="576x3072,1536x576", show_default=True, help="K x N, comma-separated")
@click.option("--rows", default="1,512", show_default=True, help="rows of the input, comma-separated")
@click.option("--megabytes", default=100.0, show_default=True, help="weights per session, to be read from memory")
@click.option("--threads", default=2, show_default=True)
@click.option("--rounds", default=5, show_default=True)
def main(shapes: str, rows: str, megabytes: float, threads: int, rounds: int) -> None:
    """Print µs per MatMul, pre-packed and not, per shape and row count."""
    enable_process_thread_pool(threads)
    for shape in shapes.split(","):
        k, n = (int(part) for part in shape.lower().split("x"))
        count = max(1, int(megabytes * 1e6 // (k * n * 4)))
        sessions = {"pre-packed": _session(k, n, count, True), "as stored": _session(k, n, count, False)}
        for m in (int(r) for r in rows.split(",")):
            x = {"x": np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)}
            times: dict[str, list[float]] = {name: [] for name in sessions}
            for _ in range(rounds):
                for name, session in sessions.items():
                    session.run(None, x)
                    start = time.perf_counter()
                    session.run(None, x)
                    times[name].append((time.perf_counter() - start) / count)
            medians = {name: statistics.median(values) for name, values in times.items()}
            rate = (lambda s: f" ({k * n * 4 / s / 1e9:.1f} GB/s)") if m == 1 else (lambda s: "")
            line = "  ".join(f"{name} {seconds * 1e6:8.1f} us{rate(seconds)}" for name, seconds in medians.items())
            click.echo(f"{k}x{n} rows {m} x{count}: {line}")


if __name__ == "__main__":
    main()
