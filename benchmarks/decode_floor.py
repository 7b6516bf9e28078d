"""Where batch-1 decode time goes: a paged `.om`'s step, onnxruntime's step on the original export, and
the floor under both, one session doing nothing but the model's matmuls (M = 1), in one process; and
under that, the memory: one read of those weights' bytes on every core, the faster of benchmarks/memory_read.py's
two forms.

    python benchmarks/decode_floor.py --om .cache/smollm2.om --onnx .cache/smollm2-dynamo/model.onnx

Where the native library has MatMulF32 (AVX-512), a fifth session holds the same matmuls as the runtime runs
a float32 artifact's: MatMulF32 on the weights laid out in panels, in one arena of huge pages, in the graph's
order; the paged step over it is what the step spends outside its matmuls. The five alternate step by step
(same weights, same thread pool), so machine noise hits them alike; medians and ratios to the floor are
printed.
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import click
import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from memory_read import STREAMS, part_reader
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.engine.kv_cache import PagePool
from cann_llm.runtime.huge_pages import HugePageArena
from cann_llm.runtime.kernels import float32_panels, native
from cann_llm.runtime.ops import CUSTOM_DOMAIN, MATMUL_F32
from cann_llm.runtime.ort_session import enable_process_thread_pool, session_options


def matmul_weights(loaded) -> dict[str, np.ndarray]:
    """Every MatMul's constant weight [K, N]: an initializer, or one read through a Transpose (a tied lm_head)."""
    weights, transposed = loaded.weights, {}
    for node in loaded.model.graph.node:
        if node.op_type == "Transpose" and node.input[0] in weights:
            transposed[node.output[0]] = node.input[0]
    found = {}
    for node in loaded.model.graph.node:
        if node.op_type != "MatMul":
            continue
        name = node.input[1]
        if name in weights and weights[name].ndim == 2:
            found[name] = weights[name]
        elif name in transposed:
            found[name] = np.ascontiguousarray(weights[transposed[name]].T)
    return found


def weight_read(weights: dict[str, np.ndarray]) -> Callable[[], float]:
    """A function timing the weights' bytes read once, split between a thread per core, in each of memory_read's
    forms, and returning the faster time (s): the bandwidth ceiling's read."""
    flat = np.concatenate([np.asarray(w, np.float32).reshape(-1) for w in weights.values()])
    cores = os.cpu_count() or 1
    parts = np.array_split(flat, cores)
    pool = ThreadPoolExecutor(cores)
    # numba's loop has one form; the C read's two take turns going first, so neither always reads second
    reads = [part_reader(streams)[1] for streams in STREAMS] if part_reader()[0] == "C" else [part_reader()[1]]

    def fastest() -> float:
        times = []
        for read in reads:
            start = time.perf_counter()
            list(pool.map(read, parts))
            times.append(time.perf_counter() - start)
        reads.reverse()
        return min(times)
    return fastest


def matmul_session(weights: dict[str, np.ndarray], rows: int = 1) -> tuple[ort.InferenceSession, dict[str, np.ndarray]]:
    """Every MatMul weight alone, on an input of `rows` rows per width; returns the session and its feeds."""
    nodes, inputs = [], {}
    for name, weight in weights.items():
        width = weight.shape[0]
        inputs.setdefault(width, helper.make_tensor_value_info(f"x{width}", onnx.TensorProto.FLOAT, [rows, width]))
        nodes.append(helper.make_node("MatMul", [f"x{width}", name], [f"y{len(nodes)}"]))
    typed = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(w.shape)) for name, w in weights.items()]
    graph = helper.make_graph(nodes, "floor", list(inputs.values()) + typed,
                              [helper.make_tensor_value_info(n.output[0], onnx.TensorProto.FLOAT, None) for n in nodes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    feeds = {f"x{w}": np.random.default_rng(0).standard_normal((rows, w)).astype(np.float32) for w in inputs}
    return session, {**feeds, **weights}


def native_matmul_session(weights: dict[str, np.ndarray]) -> tuple[ort.InferenceSession, dict, dict] | None:
    """The matmuls of `matmul_session` as the runtime runs a float32 artifact's (cann_llm/runtime/executor.py
    `_float32_panels`): MatMulF32 on panels laid out in one huge-page arena, in `weights`' order; the session,
    its feeds and the panels (kept alive while it runs). None where the library has no MatMulF32."""
    if not native.has_float32_panel_matmul():
        return None
    arena = HugePageArena([4 * int(np.prod(float32_panels.shape_of(w))) for w in weights.values()])
    panels = {f"{name}/panels": float32_panels.pack(w, arena.empty(float32_panels.shape_of(w), np.float32))
              for name, w in weights.items()}
    nodes, inputs = [], {}
    for (name, weight), panel in zip(weights.items(), panels):
        k, n = weight.shape
        inputs.setdefault(k, helper.make_tensor_value_info(f"x{k}", onnx.TensorProto.FLOAT, [1, k]))
        nodes.append(helper.make_node(MATMUL_F32.name, [f"x{k}", panel], [f"y{len(nodes)}"], domain=CUSTOM_DOMAIN,
                                      K=int(k), N=int(n)))
    typed = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(p.shape)) for name, p in panels.items()]
    graph = helper.make_graph(nodes, "native floor", list(inputs.values()) + typed,
                              [helper.make_tensor_value_info(n.output[0], onnx.TensorProto.FLOAT, None) for n in nodes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CUSTOM_DOMAIN, 1)])
    options = session_options()
    options.register_custom_ops_library(str(native.library_path()))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {f"x{k}": np.random.default_rng(0).standard_normal((1, k)).astype(np.float32) for k in inputs}
    return session, {**feeds, **panels}, panels


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", "om_path", required=True, help="a paged artifact")
@click.option("--onnx", "onnx_path", required=True, help="the original export with KV-cache I/O")
@click.option("--context", default=128, show_default=True, help="tokens cached before the measured steps")
@click.option("--steps", default=60, show_default=True)
def main(om_path: str, onnx_path: str, context: int, steps: int) -> None:
    """Print the four medians and their ratios to the floor."""
    enable_process_thread_pool()
    loaded = load_artifact(om_path)
    page_size, dims = loaded.metadata["kv_cache"]["page_size"], loaded.metadata["model"]
    weights = matmul_weights(loaded)
    floor, floor_feeds = matmul_session(weights)
    native_floor = native_matmul_session(weights)
    executor = Executor(loaded)
    pages = -(-(context + steps) // page_size)
    pool = PagePool.of(dims, pages, page_size)
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
    read = weight_read(weights)
    times = {"floor": [], "paged .om": [], "onnxruntime": [], "weight read": []}
    if native_floor is not None:
        times["native matmuls"] = []
    for step in range(steps):
        position = context + step
        times["weight read"].append(read())
        start = time.perf_counter()
        floor.run(None, floor_feeds)
        times["floor"].append(time.perf_counter() - start)
        if native_floor is not None:
            start = time.perf_counter()
            native_floor[0].run(None, native_floor[1])
            times["native matmuls"].append(time.perf_counter() - start)
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
        click.echo(f"{name:<14} {value:7.2f} ms  {value / medians['floor']:.2f}x the floor")
    click.echo(f"onnxruntime / paged .om: {medians['onnxruntime'] / medians['paged .om']:.2f}x "
               f"(the weight read: {part_reader()[0]}'s)")
    if native_floor is not None:
        click.echo(f"paged .om / native matmuls: {medians['paged .om'] / medians['native matmuls']:.3f}x; "
                   f"weight read / native matmuls: {medians['weight read'] / medians['native matmuls']:.3f}x")


if __name__ == "__main__":
    main()
