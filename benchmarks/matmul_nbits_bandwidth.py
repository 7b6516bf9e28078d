"""How fast onnxruntime's MatMulNBits reads int4 weights at one row (a batch-1 decode step's matmuls).

    python benchmarks/matmul_nbits_bandwidth.py [--shapes 576x3072,576x576,576x960,1536x576] [--threads 2]

For each K×N shape, a graph of `count` MatMulNBits nodes (block 128, accuracy level 4, as atc's INT4 writes
them) on one [1, K] input, each with weights of its own: few enough to stay in the L3 cache (--cached MB, 28
by default) and then enough to be read from memory (--uncached MB, 90). It prints microseconds per matmul
and the weight bytes read per second, to hold against what the machine reads (benchmarks/peers.py's probe).
"""

from __future__ import annotations

import time

import click
import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

BLOCK = 128


def weight_bytes(k: int, n: int) -> int:
    """One int4 weight's bytes: packed values and a float32 scale per block."""
    blocks = -(-k // BLOCK)
    return n * blocks * BLOCK // 2 + n * blocks * 4


def session(k: int, n: int, count: int, threads: int) -> ort.InferenceSession:
    """`count` MatMulNBits on one input, each with random weights of its own."""
    rng = np.random.default_rng(0)
    blocks = -(-k // BLOCK)
    nodes, weights, outputs = [], [], []
    for i in range(count):
        weights += [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, BLOCK // 2), dtype=np.uint8), f"w{i}"),
                    numpy_helper.from_array((rng.random(n * blocks) * 0.01).astype(np.float32), f"s{i}")]
        nodes.append(helper.make_node("MatMulNBits", ["x", f"w{i}", f"s{i}"], [f"y{i}"], domain="com.microsoft",
                                      K=k, N=n, bits=4, block_size=BLOCK, accuracy_level=4))
        outputs.append(helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "matmuls", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, k])],
                              outputs, weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def measure(k: int, n: int, count: int, threads: int, runs: int) -> float:
    """Seconds per matmul, the median of `runs` runs of the whole graph."""
    run = session(k, n, count, threads).run
    x = {"x": np.random.default_rng(1).random((1, k), dtype=np.float32)}
    for _ in range(3):
        run(None, x)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run(None, x)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / count


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--shapes", default="576x3072,576x576,576x960,1536x576", show_default=True, help="K x N, comma-separated")
@click.option("--threads", default=2, show_default=True)
@click.option("--cached", default=28.0, show_default=True, help="MB of weights in the cached case")
@click.option("--uncached", default=90.0, show_default=True, help="MB of weights in the uncached case")
@click.option("--runs", default=30, show_default=True)
def main(shapes: str, threads: int, cached: float, uncached: float, runs: int) -> None:
    """Print µs per matmul and GB/s of weights read, cached and uncached, per shape."""
    for shape in shapes.split(","):
        k, n = (int(part) for part in shape.lower().split("x"))
        nbytes = weight_bytes(k, n)
        for label, megabytes in (("in L3", cached), ("from memory", uncached)):
            count = max(1, int(megabytes * 1e6 // nbytes))
            seconds = measure(k, n, count, threads, runs)
            click.echo(f"{k}x{n} {label:<12} {count:4d} weights, {count * nbytes / 1e6:5.1f} MB: "
                       f"{seconds * 1e6:7.1f} us a matmul, {nbytes / seconds / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
