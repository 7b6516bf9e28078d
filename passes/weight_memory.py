"""Export a compiled graph without copying its weights.

graphsurgeon exports an array-valued constant by copying it into a new TensorProto, so exporting would
hold a second copy of every weight a pass made (merged projections, packed INT4) or mapped from disk
(compiler/loader.py `import_graph`). Detached, the graph carries stubs and the artifact writer streams
the arrays' own memory to the file.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx.helper import np_dtype_to_tensor_dtype
from onnx_graphsurgeon.ir.tensor import LazyValues

from runtime.artifact import EXTERNAL_MIN_BYTES

DETACHED_LOCATION = "<detached>"


def detach_weights(graph: gs.Graph) -> dict[str, np.ndarray]:
    """Replace each large array-valued constant by a bytes-free stub of its name, shape and type; returns the
    arrays by name, for `write_artifact(..., detached=...)`. Constants are unreadable afterwards."""
    detached = {}
    for constant in (t for t in graph.tensors().values() if isinstance(t, gs.Constant)):
        if isinstance(constant._values, LazyValues):
            continue  # exported as the TensorProto it already is, without a copy
        values = np.asarray(constant.values)
        if values.nbytes < EXTERNAL_MIN_BYTES or np.dtype(constant.export_dtype or values.dtype) != values.dtype:
            continue
        stub = onnx.TensorProto(name=constant.name, dims=values.shape, data_type=np_dtype_to_tensor_dtype(values.dtype),
                                data_location=onnx.TensorProto.EXTERNAL)
        # a location no file has: readers take the bytes from the returned arrays (calibration feeds them
        # to onnxruntime as inputs, the artifact writer streams them)
        stub.external_data.add(key="location", value=DETACHED_LOCATION)
        constant._values = LazyValues(stub)
        detached[constant.name] = np.ascontiguousarray(values)
    return detached
