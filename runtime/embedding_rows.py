"""Token embeddings read from the artifact file row by row, outside onnxruntime.

Given the table as an external initializer, onnxruntime maps it and its Gather reads the step's rows
through the mapping. Each read maps what the kernel caches around the row: a readahead window, or a whole
large folio (up to 2 MB a row) when the file's pages were cached by writing it, as right after `atc`.
A process's resident memory then grows with the vocabulary it has seen, towards the whole table (113 MB
for SmolLM2 in float32), and differs with how the file came into the page cache. Read with `pread`, a row
is copied from the page cache into the step's input and nothing stays mapped.

`split_off` takes a graph's Gathers of a float table in the artifact by a graph input out of the graph:
their outputs become graph inputs, which the executor computes (`GatheredInput`) before each run.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import numpy as np
import onnx

from runtime.errors import AtcError
from runtime.proto_utils import graphs_within


@dataclass
class TableRows:
    """Rows of the table `name`, stored at `offset` in the file `path`, read with pread."""

    path: str
    offset: int
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    def __post_init__(self):
        # the file as it was opened: one rewritten in place later is not read half old, half new
        self._descriptor = os.open(self.path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._descriptor)
        self._row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    def __call__(self, ids: np.ndarray, what: str = "ids") -> np.ndarray:
        """The rows of integer `ids` (any shape; negative ids count from the end, as ONNX's Gather does);
        an id outside the table is E10001 naming `what` held it."""
        rows, size = self.shape[0], self._row_bytes
        # Python ints, not numpy calls: a decode step reads one row, and the per-call cost of a few numpy
        # operations on a cold cache was a tenth of a millisecond (1% of a 135M model's FP32 step)
        flat = np.asarray(ids).reshape(-1).tolist()
        raw = np.empty((len(flat), size), np.uint8)
        for slot, row in enumerate(flat):
            if not -rows <= row < rows:
                raise AtcError("E10001", row, what, f"an index must be in [{-rows}, {rows - 1}]: {self.name} has {rows} rows")
            if os.preadv(self._descriptor, [raw[slot]], self.offset + row % rows * size) != size:
                raise AtcError("E13015", self.path, f"row {row % rows} of {self.name} lies past the end of the file")
        return raw.view(self.dtype).reshape(*np.shape(ids), *self.shape[1:])


@dataclass(frozen=True)
class GatheredInput:
    """A Gather taken out of the graph: `output` computed from the graph input `indices` before each run."""

    rows: TableRows
    indices: str
    index_dtype: np.dtype  # the input's declared type
    output: str

    def feed(self, values: dict[str, np.ndarray]) -> None:
        """Add the Gather's output to `values`; without its indices, onnxruntime refuses the feeds itself."""
        if self.indices not in values:
            return
        ids = np.asarray(values[self.indices])
        if ids.dtype != self.index_dtype:  # what onnxruntime would have refused
            raise AtcError("E10001", ids.dtype, self.indices, f"{self.indices} needs {self.index_dtype}")
        values[self.output] = self.rows(ids, self.indices)


def split_off(model: onnx.ModelProto, weights: dict[str, np.ndarray], om) -> tuple[onnx.ModelProto,
                                                                                    list[GatheredInput]]:
    """A copy of `model` without its Gathers of float tables (weights in the artifact `om`) by graph inputs,
    each Gather's output a graph input instead, and the readers that compute them. A table that another
    node also reads (a tied head's transpose) stays in the graph for it; the index inputs stay declared,
    so onnxruntime still checks they are fed with their type and rank."""
    graph = model.graph
    inputs = {value.name: value for value in graph.input if value.type.tensor_type.elem_type in _INDICES}
    tables = {t.name: t for t in graph.initializer if t.name in weights and t.data_type in _FLOATS}
    found = [node for node in graph.node
             if node.op_type == "Gather" and node.domain in ("", "ai.onnx") and len(node.input) == 2
             and node.input[0] in tables and node.input[1] in inputs and _axis(node) == 0]
    if not found:
        return model, []
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    readers = []
    for node in found:
        table, indices, output = node.input[0], node.input[1], node.output[0]
        view = weights[table]
        ids_type = inputs[indices].type.tensor_type
        rows = TableRows(str(om.path), om.file_offset(view), table, tuple(view.shape), view.dtype)
        readers.append(GatheredInput(rows, indices, _INDICES[ids_type.elem_type], output))
        graph.input.append(onnx.helper.make_tensor_value_info(output, tables[table].data_type, [
            *(d.dim_param or d.dim_value or None for d in ids_type.shape.dim), *view.shape[1:]]))
    # by position: the copy's nodes are other objects than the model's
    gone = {index for index, node in enumerate(model.graph.node) if node in found}
    nodes = [node for index, node in enumerate(graph.node) if index not in gone]
    del graph.node[:]
    graph.node.extend(nodes)
    # a subgraph (an If's branch) may read the table from this graph
    read = {name for g in graphs_within(graph) for node in g.node for name in node.input} | {o.name for o in graph.output}
    for tensor in [t for t in graph.initializer if t.name in tables and t.name not in read]:
        graph.initializer.remove(tensor)
    return copy, readers


# tables numpy can hand to onnxruntime as a feed (not bfloat16: its type is ml_dtypes', which onnxruntime refuses)
_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16})
_INDICES = {onnx.TensorProto.INT64: np.dtype(np.int64), onnx.TensorProto.INT32: np.dtype(np.int32)}


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)
