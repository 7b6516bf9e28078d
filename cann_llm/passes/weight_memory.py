"""Weights that cost no memory before they are written.

graphsurgeon exports an array-valued constant by copying it into a new TensorProto, so exporting would
hold a second copy of every weight a pass made (merged projections, packed INT4) or mapped from disk
(cann_llm/compiler/loader.py `import_graph`). Detached, the graph carries stubs and the artifact writer streams
the arrays' own memory to the file.

A weight a pass derives from mapped ones (the q/k/v and gate/up projections side by side) is `Deferred`:
its values are computed when something reads them, and the writer computes each in turn as it writes it,
so a compile holds one such weight at a time instead of all of them (the model's size again).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import numpy_helper
from onnx.helper import np_dtype_to_tensor_dtype
from onnx_graphsurgeon.ir.tensor import LazyValues

from cann_llm.runtime.artifact import EXTERNAL_MIN_BYTES

DETACHED_LOCATION = "<detached>"


class Deferred(LazyValues):
    """Values of `shape` and `dtype` computed by `compute()` when read: graphsurgeon keeps them once a pass
    reads them (`Constant.values`), the artifact writer only while it writes them."""

    def __init__(self, shape: tuple[int, ...], dtype, compute: Callable[[], np.ndarray]):
        self.shape, self.dtype = tuple(int(d) for d in shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self._compute = compute

    @property
    def tensor(self) -> onnx.TensorProto:
        """The values as a TensorProto: what graphsurgeon exports for a lazy constant. A compile detaches
        its weights before exporting and never gets here; a graph exported as it is (tests, tools) gets the
        values computed."""
        return numpy_helper.from_array(self.load())

    def load(self) -> np.ndarray:
        values = np.ascontiguousarray(self._compute())
        if values.shape != self.shape or values.dtype != self.dtype:
            raise AssertionError(f"deferred values are {values.dtype}{list(values.shape)}, declared "
                                 f"{self.dtype}{list(self.shape)}")
        return values

    def __array__(self, dtype=None, copy=None):
        return self.load() if dtype is None else self.load().astype(dtype)


def read_values(constant: gs.Constant) -> np.ndarray:
    """A constant's values; deferred ones computed for the caller without graphsurgeon keeping them."""
    if isinstance(constant._values, Deferred):
        return constant._values.load()
    return np.asarray(constant.values)


def concatenated(arrays: list[np.ndarray], axis: int) -> Deferred:
    """`np.concatenate(arrays, axis)`, computed when read."""
    shape = list(arrays[0].shape)
    shape[axis] = sum(a.shape[axis] for a in arrays)
    return Deferred(tuple(shape), arrays[0].dtype, lambda: np.concatenate(arrays, axis=axis))


def _stub(name: str, shape: tuple[int, ...], dtype: np.dtype) -> onnx.TensorProto:
    stub = onnx.TensorProto(name=name, dims=shape, data_type=np_dtype_to_tensor_dtype(dtype),
                            data_location=onnx.TensorProto.EXTERNAL)
    # a location no file has: readers take the bytes from the returned arrays (calibration feeds them
    # to onnxruntime as inputs, the artifact writer streams them)
    stub.external_data.add(key="location", value=DETACHED_LOCATION)
    return stub


def detach_weights(graph: gs.Graph) -> dict[str, np.ndarray | Deferred]:
    """Replace each large array-valued or deferred constant by a bytes-free stub of its name, shape and type;
    returns the arrays (or deferred values) by name, for `write_artifact(..., detached=...)`. Constants are
    unreadable afterwards."""
    detached: dict[str, np.ndarray | Deferred] = {}
    for constant in (t for t in graph.tensors().values() if isinstance(t, gs.Constant)):
        if isinstance(constant._values, Deferred):
            deferred = constant._values
            if constant.export_dtype is not None and np.dtype(constant.export_dtype) != deferred.dtype:
                constant.values = deferred.load()  # to be cast on export like any array: rare, and small
                continue
            constant._values = LazyValues(_stub(constant.name, deferred.shape, deferred.dtype))
            detached[constant.name] = deferred
            continue
        if isinstance(constant._values, LazyValues):
            continue  # exported as the TensorProto it already is, without a copy
        values = np.asarray(constant.values)
        if values.nbytes < EXTERNAL_MIN_BYTES or np.dtype(constant.export_dtype or values.dtype) != values.dtype:
            continue
        constant._values = LazyValues(_stub(constant.name, values.shape, values.dtype))
        detached[constant.name] = np.ascontiguousarray(values)
    return detached
