"""Execute a loaded artifact on one of two backends.

`onnxruntime` (the fast path): one InferenceSession built once, weights fed zero-copy from the mapped
artifact with `add_external_initializers`. `reference`: onnx's ReferenceEvaluator, with the registry's
numpy kernels as its custom ops, the executable spec the fast path is tested against.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper
from onnx.reference import ReferenceEvaluator

from runtime.loader import LoadedModel

BACKENDS = ("onnxruntime", "reference")


class Executor:
    """Runs a loaded artifact: `run(feeds) -> {output name: array}`."""

    def __init__(self, loaded: LoadedModel, backend: str = "onnxruntime", threads: int | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        self.loaded = loaded
        self.backend = backend
        self.output_names = loaded.output_names
        if backend == "onnxruntime":
            self._session = _ort_session(loaded, threads)
            self._weights_fed = {}
        else:
            self._session = ReferenceEvaluator(_weights_as_inputs(loaded.model))
            self._weights_fed = loaded.weights

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Outputs named `output_names` (default all) for `feeds`."""
        names = output_names or self.output_names
        outputs = self._session.run(names, {**feeds, **self._weights_fed})
        return dict(zip(names, outputs))


def _ort_session(loaded: LoadedModel, threads: int | None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    options.log_severity_level = 3
    names = list(loaded.weights)
    # the OrtValues borrow the mapped memory; `loaded` keeps the mapping alive as long as the session
    options.add_external_initializers(names, [ort.OrtValue.ortvalue_from_numpy(loaded.weights[n]) for n in names])
    return ort.InferenceSession(loaded.model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _weights_as_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph with external initializers turned into inputs, so weights are fed, not copied."""
    light = onnx.ModelProto()
    light.CopyFrom(model)
    graph = light.graph
    external = [t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in external)
    kept = [t for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return light
