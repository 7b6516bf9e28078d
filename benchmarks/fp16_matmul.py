"""Does onnxruntime's CPU provider compute a float16 MatMul in float16 here? One-row MatMuls with the
same weights stored float32 and float16 (activations cast to float16 and back), alternating:

    python benchmarks/fp16_matmul.py

Prints median times and the float16 result's error against float64 arithmetic on the float16 weights:
an error at float32 level (~1e-7) means the provider widened the weights to float32 (so float16 storage
saves file size only); an error at float16 level (~1e-3) would mean float16 arithmetic.
"""

from __future__ import annotations

import statistics
import time

import click
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from cann_llm.runtime.ort_session import session_options

SHAPES = ((576, 3072), (1536, 576), (576, 49152), (4096, 4096))


def _session(weight: np.ndarray) -> ort.InferenceSession:
    k, n = weight.shape
    nodes, x, y = [], "x", "y"
    if weight.dtype == np.float16:
        nodes.append(helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16))
        nodes.append(helper.make_node("MatMul", ["x16", "w"], ["y16"]))
        nodes.append(helper.make_node("Cast", ["y16"], ["y"], to=TensorProto.FLOAT))
    else:
        nodes.append(helper.make_node("MatMul", [x, "w"], [y]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                              [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--repeat", default=50, show_default=True)
def main(repeat: int) -> None:
    """Print one line per shape."""
    rng = np.random.default_rng(0)
    for k, n in SHAPES:
        half = (rng.standard_normal((k, n)) * 0.05).astype(np.float16)
        sessions = {"float32": _session(half.astype(np.float32)), "float16": _session(half)}
        x = rng.standard_normal((1, k)).astype(np.float32)
        exact = x.astype(np.float64) @ half.astype(np.float64)
        times = {name: [] for name in sessions}
        for _ in range(repeat):
            for name, session in sessions.items():
                start = time.perf_counter()
                session.run(None, {"x": x})
                times[name].append(time.perf_counter() - start)
        error = np.abs(sessions["float16"].run(None, {"x": x})[0] - exact).max() / np.abs(exact).max()
        f32, f16 = (statistics.median(times[name][1:]) * 1000 for name in ("float32", "float16"))
        click.echo(f"[1, {k}] x [{k}, {n}]: float32 {f32:.3f} ms, float16 {f16:.3f} ms ({f32 / f16:.2f}x), "
                   f"float16 relative error {error:.1e}")


if __name__ == "__main__":
    main()
