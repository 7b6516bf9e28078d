"""Calibration statistics taken stage by stage, when the quantizer asks for them, so memory holds one
MatMul input's statistics at a time rather than every layer's.

`collect_input_statistics` runs the float model once with every MatMul input as an output and keeps all
their Hessians until the last layer is quantized: ~0.4 GB for SmolLM2, ~22 GB for a 7B Llama (32 layers ×
(3 × 4096² + 11008²) float32), a multiple of the model. Here a request for one tensor's statistics runs only
the nodes that tensor still needs, from the tensors earlier stages left behind (the frontier, per sample)
to the requested tensor and every tensor a node not yet run will read; the caller releases the statistics
once its MatMul is quantized. Each node runs once over the samples, so the whole costs about one forward
pass plus a small session per stage, and the frontier (a few hidden states per sample) is what stays.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort

from cann_llm.passes.quant.calibration import InputStatistics, accumulate
from cann_llm.passes.weight_memory import detach_weights
from cann_llm.runtime.feeds import causal_lm_inputs
from cann_llm.runtime.lowering import lower_for_onnxruntime
from cann_llm.runtime.ort_session import session_options
from cann_llm.runtime.progress import Progress
from cann_llm.runtime.signature import io_signature, llm_dimensions


class StagedStatistics:
    """`get(name)`: the statistics of one tensor over the samples, computed on first request; `pop(name)`:
    release them. Used as a context (`with StagedStatistics(...) as stats:`), it reports each stage run
    as a unit of `Progress("calibration")` when `progress` is set."""

    def __init__(self, graph: gs.Graph, samples: list[np.ndarray], with_hessian: bool = True,
                 threads: int | None = None, progress: bool = False):
        copy = graph.copy()
        self._weights = detach_weights(copy)
        exported = gs.export_onnx(copy, do_type_check=False)
        signature = io_signature(exported)
        dims = llm_dimensions(signature)
        self._model = lower_for_onnxruntime(exported)
        graph_proto = self._model.graph
        self._nodes = list(graph_proto.node)
        self._producer = {out: i for i, node in enumerate(self._nodes) for out in node.output if out}
        self._consumers: dict[str, set[int]] = {}
        for i, node in enumerate(self._nodes):
            for name in node.input:
                self._consumers.setdefault(name, set()).add(i)
        self._initializers = {t.name: t for t in graph_proto.initializer}
        self._executed: set[int] = set()
        self._frontier: list[dict[str, np.ndarray]] = [causal_lm_inputs(signature, dims, np.asarray(ids, np.int64)[None])
                                                       for ids in samples]
        self._samples, self._with_hessian, self._threads = len(samples), with_hessian, threads
        self._statistics: dict[str, InputStatistics] = {}
        # the stages run as the quantizer asks, so their number is known only at the end
        self._progress = Progress(f"calibration ({len(samples)} samples, staged)", unit="stage", enabled=progress)

    def __enter__(self) -> "StagedStatistics":
        self._progress.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._progress.__exit__(exc_type, exc, tb)

    def get(self, name: str) -> InputStatistics | None:
        """The statistics of `name` (computed now if they were not); None when the graph has no such tensor."""
        if name not in self._statistics:
            if name in self._producer and self._producer[name] not in self._executed:
                self._run_stage(name)
            elif name in self._frontier[0]:  # a graph input, or computed and still to be read
                for frontier in self._frontier:
                    accumulate(self._statistics, name, frontier[name], self._samples, self._with_hessian)
        return self._statistics.get(name)

    def pop(self, name: str, default: InputStatistics | None = None) -> InputStatistics | None:
        """Release the statistics of `name`."""
        return self._statistics.pop(name, default)

    def _stage_nodes(self, target: str) -> list[int]:
        needed, stack = set(), [target]
        while stack:
            name = stack.pop()
            index = self._producer.get(name)
            if index is None or index in needed or index in self._executed or name in self._frontier[0]:
                continue
            needed.add(index)
            stack.extend(self._nodes[index].input)
        return sorted(needed)

    def _run_stage(self, target: str) -> None:
        stage = self._stage_nodes(target)
        inside = set(stage)
        produced = {out for i in stage for out in self._nodes[i].output if out}
        read = {name for i in stage for name in self._nodes[i].input if name and name not in produced}
        later = self._executed | inside
        keep = sorted(name for name in produced
                      if name == target or any(c not in later for c in self._consumers.get(name, ())))
        weights = sorted(name for name in read if name in self._weights)
        cached = sorted(name for name in read if name in self._frontier[0])
        initializers = [self._initializers[name] for name in sorted(read) if name in self._initializers
                        and name not in self._weights]
        inputs = [onnx.helper.make_tensor_value_info(name, self._elem_type(name), None) for name in cached + weights]
        outputs = [onnx.helper.make_empty_tensor_value_info(name) for name in keep]
        model = onnx.helper.make_model(onnx.helper.make_graph([self._nodes[i] for i in stage], "stage", inputs,
                                                              outputs, initializers),
                                       opset_imports=self._model.opset_import, ir_version=self._model.ir_version)
        options = session_options(self._threads)
        # numpy's Hessian products follow every run: a pool left spinning would hold the cores they need
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        # a merged weight is computed for its stage and dropped with it
        weight_feeds = {name: np.asarray(self._weights[name]) for name in weights}
        for frontier in self._frontier:
            values = session.run(keep, {**{name: frontier[name] for name in cached}, **weight_feeds})
            frontier.update(zip(keep, values))
            accumulate(self._statistics, target, frontier[target], self._samples, self._with_hessian)
        self._executed |= inside
        self._progress.update(status=target)
        for name in [n for n in self._frontier[0] if all(c in self._executed for c in self._consumers.get(n, ()))]:
            for frontier in self._frontier:
                del frontier[name]

    def _elem_type(self, name: str) -> int:
        if name in self._weights:
            return onnx.helper.np_dtype_to_tensor_dtype(self._weights[name].dtype)
        return onnx.helper.np_dtype_to_tensor_dtype(self._frontier[0][name].dtype)
