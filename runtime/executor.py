"""Execute a loaded artifact on one of two backends.

`onnxruntime` (the fast path): `cann` ops lowered onto onnxruntime's kernels (runtime/lowering.py), one
InferenceSession built once, weights fed zero-copy from the mapped artifact with
`add_external_initializers`. `reference`: onnx's ReferenceEvaluator, with the registry's
numpy kernels as its custom ops, the executable spec the fast path is tested against.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx.reference import ReferenceEvaluator

from compiler.artifact import SUB_BYTE_TYPES
from compiler.proto_utils import initializers_as_inputs
from runtime.kernels import reference_ops
from runtime.loader import LoadedModel
from runtime.lowering import lower_for_onnxruntime

BACKENDS = ("onnxruntime", "reference")


class Executor:
    """Runs a loaded artifact: `run(feeds) -> {output name: array}`."""

    def __init__(self, loaded: LoadedModel, backend: str = "onnxruntime", threads: int | None = None,
                 spinning: bool = True):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        self.loaded = loaded
        self.backend = backend
        self.output_names = loaded.output_names
        model, weights = _inline_sub_byte(loaded.model, loaded.weights)
        if backend == "onnxruntime":
            self._session = _ort_session(lower_for_onnxruntime(model), weights, threads, spinning)
            self._weights_fed = {}
        else:
            self._session = ReferenceEvaluator(initializers_as_inputs(model, _is_external), new_ops=reference_ops())
            self._weights_fed = weights

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Outputs named `output_names` (default all) for `feeds`."""
        names = output_names or self.output_names
        outputs = self._session.run(names, {**feeds, **self._weights_fed})
        return dict(zip(names, outputs))


def _inline_sub_byte(model: onnx.ModelProto, weights: dict[str, np.ndarray]):
    """Copy packed sub-byte weights into the graph: neither numpy nor OrtValue can describe their storage.

    Only DequantizeLinear inputs of QDQ models are stored so; the INT4 matmul's own layout is uint8.
    """
    packed = {t.name for t in model.graph.initializer if t.name in weights and t.data_type in SUB_BYTE_TYPES}
    if not packed:
        return model, weights
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for tensor in copy.graph.initializer:
        if tensor.name in packed:
            tensor.raw_data = weights[tensor.name].tobytes()
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    return copy, {name: view for name, view in weights.items() if name not in packed}


def _ort_session(model: onnx.ModelProto, weights: dict[str, np.ndarray], threads: int | None,
                 spinning: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    if not spinning:
        # idle worker threads sleep instead of spinning: needed when several sessions share the cores
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    # quantized weights are explicit ops here; onnxruntime's own QDQ rewrites would quantize activations
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    names = list(weights)
    # the OrtValues borrow the mapped memory; the executor holds `loaded`, which keeps the mapping alive
    options.add_external_initializers(names, [ort.OrtValue.ortvalue_from_numpy(weights[n]) for n in names])
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _is_external(tensor: onnx.TensorProto) -> bool:
    # weights in the artifact are fed to the reference backend as inputs, never copied into the graph
    return tensor.data_location == onnx.TensorProto.EXTERNAL
