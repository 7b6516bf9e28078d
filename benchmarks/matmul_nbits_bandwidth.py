"""onnxruntime's MatMulNBits beside the native MatMulInt4 (cann_llm/runtime/kernels/native/matmul_int4.c) on the same bytes.

    python benchmarks/matmul_nbits_bandwidth.py [--shapes 576x576,576x960,576x3072,1536x576,576x49152:8:64]
                                                [--rows 1] [--megabytes 90] [--threads 2] [--rounds 3]

A shape is K x N, optionally :bits:block (default 4 bits in blocks of 128, accuracy level 4, as atc's INT4
writes them; 576x49152:8:64 is SmolLM2's 8-bit head). For each, two sessions of `count` matmul nodes on
one [rows, K] input, each node with weights of its own, enough of them (--megabytes) that the weights come
from memory as a decode step's do: one session of MatMulNBits, one of the native op (its library
registered), both on onnxruntime's process-wide pool of --threads, as the engine runs them. The two
alternate --rounds times, 15 runs each; it prints the median microseconds per matmul, the weight bytes read
per second at one row (multiply-adds per second at more), and MatMulNBits' time over the native op's.
"""

from __future__ import annotations

import statistics
import time

import click
import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from cann_llm.runtime.kernels import native
from cann_llm.runtime.ops import CUSTOM_DOMAIN
from cann_llm.runtime.ort_session import enable_process_thread_pool, session_options


def weight_bytes(k: int, n: int, bits: int, block: int) -> int:
    """One weight's bytes: packed values and a float32 scale per block."""
    blocks = -(-k // block)
    return n * blocks * block * bits // 8 + n * blocks * 4


def model(k: int, n: int, bits: int, block: int, count: int, native_op: bool) -> onnx.ModelProto:
    """`count` matmuls on one input, each with random weights of its own (the same for both kernels)."""
    rng = np.random.default_rng(0)
    blocks = -(-k // block)
    nodes, weights, outputs = [], [], []
    op, domain = ("MatMulInt4", CUSTOM_DOMAIN) if native_op else ("MatMulNBits", "com.microsoft")
    for i in range(count):
        weights += [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8), f"w{i}"),
                    numpy_helper.from_array((rng.random(n * blocks) * 0.01).astype(np.float32), f"s{i}")]
        nodes.append(helper.make_node(op, ["x", f"w{i}", f"s{i}"], [f"y{i}"], domain=domain, K=k, N=n, bits=bits,
                                      block_size=block, accuracy_level=4))
        outputs.append(helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "matmuls", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
                              outputs, weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])


def session(graph: onnx.ModelProto, threads: int, native_op: bool) -> ort.InferenceSession:
    options = session_options(threads)
    if native_op:
        options.register_custom_ops_library(str(native.library_path()))
    return ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])


def timings(run, x: dict, runs: int) -> list[float]:
    run(None, x)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run(None, x)
        times.append(time.perf_counter() - start)
    return times


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--shapes", default="576x576,576x960,576x3072,1536x576,576x49152:8:64", show_default=True,
              help="K x N[:bits:block], comma-separated")
@click.option("--rows", default=1, show_default=True, help="rows of the input (1: a decode step; 512: a prefill)")
@click.option("--megabytes", default=90.0, show_default=True, help="weights per session, to be read from memory")
@click.option("--threads", default=2, show_default=True)
@click.option("--rounds", default=3, show_default=True)
def main(shapes: str, rows: int, megabytes: float, threads: int, rounds: int) -> None:
    """Print µs per matmul and GB/s for both kernels, and their ratio, per shape."""
    if not native.has_int8_matmul():
        raise click.ClickException("this CPU has neither AVX-512 VNNI nor AVX2: the native MatMulInt4 does not run here")
    enable_process_thread_pool(threads)
    for shape in shapes.split(","):
        size, *rest = shape.lower().split(":")
        k, n = (int(part) for part in size.split("x"))
        bits, block = (int(rest[0]), int(rest[1])) if rest else (4, 128)
        nbytes = weight_bytes(k, n, bits, block)
        count = max(1, int(megabytes * 1e6 // nbytes))
        runs = {kind: session(model(k, n, bits, block, count, kind == "native"), threads, kind == "native").run
                for kind in ("MatMulNBits", "native")}
        x = {"x": np.random.default_rng(1).standard_normal((rows, k), dtype=np.float32)}
        times: dict[str, list[float]] = {kind: [] for kind in runs}
        for _ in range(rounds):
            for kind, run in runs.items():
                times[kind] += timings(run, x, 15)
        medians = {kind: statistics.median(values) / count for kind, values in times.items()}
        # one row reads the weights; many rows compute on them
        rate = ((lambda s: f"{nbytes / s / 1e9:5.1f} GB/s") if rows == 1 else
                (lambda s: f"{rows * k * n / s / 1e9:5.1f} G MAC/s"))
        line = " ".join(f"{kind} {seconds * 1e6:8.1f} us ({rate(seconds)})" for kind, seconds in medians.items())
        click.echo(f"{k}x{n} {bits}-bit/{block} rows {rows} x{count}: {line}  "
                   f"MatMulNBits / native {medians['MatMulNBits'] / medians['native']:.2f}x")


if __name__ == "__main__":
    main()
