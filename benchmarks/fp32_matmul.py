"""onnxruntime's FP32 MatMul (MLAS) on distinct weights from memory, with and without pre-packing the weights, and
the native MatMulF32 and MatMulF28 on the same weights in panels, as float32 and in 28 bits.

    python benchmarks/fp32_matmul.py [--shapes 576x3072,1536x576] [--rows 1,512] [--megabytes 100]

For each K x N: sessions of `count` matmul nodes on one [rows, K] input, each with weights of its own (enough of
them that they come from memory, as a decode step's do): one as onnxruntime builds it (MLAS pre-packs every
constant B), one with `session.disable_prepacking` (MLAS packs B on the fly each call, reading the weights as
stored, which is what a second session or a native op over the same unpacked bytes would need), and where the
native library has them, one of cann::MatMulF32 on the weights laid out in panels as the runtime lays them out
at load (cann_llm/runtime/kernels/float32_panels.py) and one of cann::MatMulF28 on the same weights packed losslessly
in 28 bits (cann_llm/runtime/kernels/float28.py). All on the process-wide pool of --threads, alternating --rounds
times; prints the median µs per matmul and, at one row, the float32 weight bytes a second the time stands for
(F28 reads 7/8 of them), and MLAS pre-packed over each native op. benchmarks/fp32_gemv_probe.c is a plain
GEMV of our own on the same shapes.
"""

from __future__ import annotations

import statistics
import time

import click
import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from cann_llm.runtime.kernels import float28, float32_panels, native
from cann_llm.runtime.ops import CUSTOM_DOMAIN
from cann_llm.runtime.ort_session import enable_process_thread_pool, session_options


def _weights(k: int, n: int, count: int) -> list[np.ndarray]:
    # a trained layer's scale: what F28's exponent window is for
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((k, n)) * 0.02).astype(np.float32) for _ in range(count)]


def _session(k: int, n: int, count: int, kind: str) -> ort.InferenceSession:
    weights, nodes = [], []
    for i, weight in enumerate(_weights(k, n, count)):
        if kind == "F32":
            weights.append(numpy_helper.from_array(float32_panels.pack(weight), f"p{i}"))
            nodes.append(helper.make_node("MatMulF32", ["x", f"p{i}"], [f"y{i}"], domain=CUSTOM_DOMAIN, K=k, N=n))
        elif kind == "F28":
            packed = float28.pack(weight)
            weights += [numpy_helper.from_array(array, f"{part}{i}") for part, array in
                        (("p", packed.packed), ("o", packed.offsets), ("q", packed.positions), ("v", packed.values))]
            nodes.append(helper.make_node("MatMulF28", ["x", f"p{i}", f"o{i}", f"q{i}", f"v{i}"], [f"y{i}"],
                                          domain=CUSTOM_DOMAIN, K=k, N=n, bias=packed.bias))
        else:
            weights.append(numpy_helper.from_array(weight, f"w{i}"))
            nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]))
    graph = helper.make_graph(nodes, "matmuls", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, None) for i in range(count)],
                              weights)
    options = session_options()
    if kind == "as stored":
        options.add_session_config_entry("session.disable_prepacking", "1")
    if kind in ("F32", "F28"):
        options.register_custom_ops_library(str(native.library_path()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CUSTOM_DOMAIN, 1)])
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--shapes", default="576x3072,1536x576", show_default=True, help="K x N, comma-separated")
@click.option("--rows", default="1,512", show_default=True, help="rows of the input, comma-separated")
@click.option("--megabytes", default=100.0, show_default=True, help="weights per session, to be read from memory")
@click.option("--threads", default=2, show_default=True)
@click.option("--rounds", default=5, show_default=True)
def main(shapes: str, rows: str, megabytes: float, threads: int, rounds: int) -> None:
    """Print µs per matmul, pre-packed, as stored, F32 and F28, per shape and row count."""
    enable_process_thread_pool(threads)
    for shape in shapes.split(","):
        k, n = (int(part) for part in shape.lower().split("x"))
        count = max(1, int(megabytes * 1e6 // (k * n * 4)))
        kinds = (("pre-packed", "as stored") + (("F32",) if native.has_float32_panel_matmul() else ())
                 + (("F28",) if native.has_float28_matmul() else ()))
        sessions = {kind: _session(k, n, count, kind) for kind in kinds}
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
            ratio = "".join(f"  pre-packed / {kind} {medians['pre-packed'] / medians[kind]:.2f}x"
                            for kind in ("F32", "F28") if kind in medians)
            click.echo(f"{k}x{n} rows {m} x{count}: {line}{ratio}")


if __name__ == "__main__":
    main()
