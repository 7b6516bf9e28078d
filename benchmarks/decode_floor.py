"""Where batch-1 decode time goes: a paged `.om`'s step, onnxruntime's step on the original export, and
the floor under both, one session doing nothing but the model's matmuls (M = 1), in one process.

    python benchmarks/decode_floor.py --om .cache/smollm2.om --onnx .cache/smollm2-dynamo/model.onnx

The three alternate step by step (same weights, same thread pool), so machine noise hits them alike;
medians and ratios to the floor are printed.
"""

from __future__ import annotations

import statistics
import time

import click
import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from runtime import Executor, load_artifact
from runtime.kv_cache import PagePool
from runtime.ort_session import enable_process_thread_pool, session_options


def _floor_session(loaded) -> tuple[ort.InferenceSession, dict[str, np.ndarray]]:
    """Every MatMul of the artifact with a weight initializer, alone, on a one-row input per width."""
    weights = loaded.weights
    nodes, inputs = [], {}
    for node in loaded.model.graph.node:
        if node.op_type == "MatMul" and node.input[1] in weights and weights[node.input[1]].ndim == 2:
            width = weights[node.input[1]].shape[0]
            inputs.setdefault(width, helper.make_tensor_value_info(f"x{width}", onnx.TensorProto.FLOAT, [1, width]))
            nodes.append(helper.make_node("MatMul", [f"x{width}", node.input[1]], [f"y{len(nodes)}"]))
    used = sorted({n.input[1] for n in nodes})
    initializers = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(weights[name].shape)) for name in used]
    graph = helper.make_graph(nodes, "floor", list(inputs.values()) + initializers,
                              [helper.make_tensor_value_info(n.output[0], onnx.TensorProto.FLOAT, None) for n in nodes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    feeds = {f"x{w}": np.random.default_rng(0).standard_normal((1, w)).astype(np.float32) for w in inputs}
    return session, {**feeds, **{name: weights[name] for name in used}}


@click.command()
@click.option("--om", "om_path", required=True, help="a paged artifact")
@click.option("--onnx", "onnx_path", required=True, help="the original export with KV-cache I/O")
@click.option("--context", default=128, show_default=True, help="tokens cached before the measured steps")
@click.option("--steps", default=60, show_default=True)
def main(om_path: str, onnx_path: str, context: int, steps: int) -> None:
    """Print the three medians and their ratios to the floor."""
    enable_process_thread_pool()
    loaded = load_artifact(om_path)
    page_size, dims = loaded.metadata["kv_cache"]["page_size"], loaded.metadata["model"]
    floor, floor_feeds = _floor_session(loaded)
    executor = Executor(loaded)
    pages = -(-(context + steps) // page_size)
    pool = PagePool(dims["num_layers"], pages, page_size, dims["num_kv_heads"], dims["head_dim"])
    original = ort.InferenceSession(onnx_path, session_options(), providers=["CPUExecutionProvider"])
    presents = [o.name for o in original.get_outputs() if o.name.startswith("present")]
    ids = (np.arange(context) % 1000 + 5).astype(np.int64)
    table = np.arange(pages, dtype=np.int32)[None]
    positions = np.arange(context, dtype=np.int64)
    executor.run({"input_ids": ids[None], "position_ids": positions[None], "query_start_loc": np.array([0, context], np.int32),
                  "seq_lens": np.array([context], np.int32), "block_tables": table, "slot_mapping": positions,
                  "logits_indices": np.array([context - 1])}, kv_cache=pool)
    outputs = original.run(presents, {"input_ids": ids[None], "attention_mask": np.ones((1, context), np.int64),
                                      "position_ids": positions[None],
                                      **{i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
                                         for i in original.get_inputs() if i.name.startswith("past")}})
    past = {name.replace("present", "past_key_values", 1): value for name, value in zip(presents, outputs)}
    times = {"floor": [], "paged .om": [], "onnxruntime": []}
    for step in range(steps):
        position = context + step
        start = time.perf_counter()
        floor.run(None, floor_feeds)
        times["floor"].append(time.perf_counter() - start)
        feeds = {"input_ids": np.array([[5]]), "position_ids": np.array([[position]]),
                 "query_start_loc": np.array([0, 1], np.int32), "seq_lens": np.array([position + 1], np.int32),
                 "block_tables": table, "slot_mapping": np.array([position]), "logits_indices": np.array([0])}
        start = time.perf_counter()
        executor.run(feeds, ["logits"], kv_cache=pool)
        times["paged .om"].append(time.perf_counter() - start)
        start = time.perf_counter()
        outputs = original.run(["logits", *presents], {"input_ids": np.array([[5]]), "position_ids": np.array([[position]]),
                                                       "attention_mask": np.ones((1, position + 1), np.int64), **past})
        times["onnxruntime"].append(time.perf_counter() - start)
        past = {name.replace("present", "past_key_values", 1): value for name, value in zip(presents, outputs[1:])}
    medians = {name: statistics.median(values[1:]) * 1000 for name, values in times.items()}
    for name, value in medians.items():
        click.echo(f"{name:<12} {value:7.2f} ms  {value / medians['floor']:.2f}x the floor")
    click.echo(f"onnxruntime / paged .om: {medians['onnxruntime'] / medians['paged .om']:.2f}x")


if __name__ == "__main__":
    main()
