"""Calibration statistics of MatMul inputs: H = Σ xᵀx and Σ |x| per input channel, over real text.

The fused float graph runs on onnxruntime with the tensors of interest added as outputs; statistics are
accumulated sample by sample in float32 (as GPTQ's reference does; a model's Hessians are its largest
calibration state, and the methods widen one at a time to float64 where they factor it), so memory holds
one sample's activations at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort

from cann_llm.passes.weight_memory import detach_weights
from cann_llm.runtime.feeds import causal_lm_inputs
from cann_llm.runtime.lowering import lower_for_onnxruntime
from cann_llm.runtime.ort_session import session_options
from cann_llm.runtime.progress import progress as progress_of
from cann_llm.runtime.proto_utils import initializers_as_inputs
from cann_llm.runtime.signature import io_signature, llm_dimensions

KEPT_ROWS = 256


@dataclass
class InputStatistics:
    """What GPTQ, AWQ and the accuracy-level choice need to know about the activations entering one weight."""

    hessian: np.ndarray
    abs_sum: np.ndarray
    abs_max: np.ndarray | None = None
    rows: int = 0
    kept: list = field(default_factory=list)  # a few activation rows from each sample, KEPT_ROWS in all

    @property
    def examples(self) -> np.ndarray:
        return np.concatenate(self.kept)[:KEPT_ROWS]

    @property
    def mean_abs(self) -> np.ndarray:
        return self.abs_sum / max(self.rows, 1)


def collect_input_statistics(graph: gs.Graph, names: list[str], samples: list[np.ndarray],
                             threads: int | None = None, with_hessian: bool = True,
                             progress: bool = False) -> dict[str, InputStatistics]:
    """Run the float graph on each token sample ([seq] ids) and accumulate statistics of `names` (the
    Hessians, the costly part, only when asked); `progress` reports each sample on stderr."""
    copy = graph.copy()
    detached = detach_weights(copy)
    model = gs.export_onnx(copy, do_type_check=False)
    # the whole graph runs at once: merged weights computed once for every sample (the staged run computes
    # each stage's alone, cann_llm/passes/quant/staged_calibration.py)
    weights = {name: np.asarray(values) for name, values in detached.items()}
    known = {v.name for v in model.graph.output}
    tensors = graph.tensors()
    for name in names:
        if name not in known:
            elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(tensors[name].dtype or np.float32))
            model.graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
    # the weights enter as inputs, fed the graph's own arrays: onnxruntime copies initializers, even
    # external ones, and that copy would double the compile's memory
    lowered = initializers_as_inputs(lower_for_onnxruntime(model), lambda tensor: tensor.name in weights)
    session = ort.InferenceSession(lowered.SerializeToString(), session_options(threads),
                                   providers=["CPUExecutionProvider"])
    signature = io_signature(model)
    dims = llm_dimensions(signature)
    statistics: dict[str, InputStatistics] = {}
    for ids in progress_of(samples, "calibration", unit="sample", enabled=progress):
        outputs = session.run(names, {**causal_lm_inputs(signature, dims, np.asarray(ids, np.int64)[None]), **weights})
        for name, value in zip(names, outputs):
            accumulate(statistics, name, value, len(samples), with_hessian)
    return statistics


def accumulate(statistics: dict[str, InputStatistics], name: str, value: np.ndarray, samples: int,
               with_hessian: bool) -> None:
    """Add one sample's values of tensor `name` ([..., K]) to its statistics (created on first use)."""
    rows = value.reshape(-1, value.shape[-1]).astype(np.float32)
    stats = statistics.get(name)
    if stats is None:
        hessian = np.zeros((rows.shape[1],) * 2 if with_hessian else (0, 0), np.float32)
        stats = statistics[name] = InputStatistics(hessian, np.zeros(rows.shape[1]))
    if with_hessian:
        stats.hessian += rows.T @ rows
    stats.abs_sum += np.abs(rows).sum(axis=0, dtype=np.float64)
    peak = np.abs(rows).max(axis=0)
    stats.abs_max = peak if stats.abs_max is None else np.maximum(stats.abs_max, peak)
    stats.rows += rows.shape[0]
    # a copy: a view would keep the whole sample's activations alive
    stats.kept.append(rows[:: max(1, rows.shape[0] * samples // KEPT_ROWS)][: KEPT_ROWS // samples + 1].copy())
