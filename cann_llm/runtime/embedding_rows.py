"""Token embeddings read from the artifact file row by row, outside onnxruntime.

Given the table as an external initializer, onnxruntime maps it and its Gather reads the step's rows
through the mapping. Each read maps what the kernel caches around the row: a readahead window, or a whole
large folio (up to 2 MB a row) when the file's pages were cached by writing it, as right after `atc`.
A process's resident memory then grows with the vocabulary it has seen, towards the whole table (113 MB
for SmolLM2 in float32), and differs with how the file came into the page cache. Read with `pread`, a row
is copied from the page cache into the step's input and nothing stays mapped.

A tied table stored as its head's F28 weight (`GatherF28`, cann_llm/runtime/kernels/float28.py) is read the same way,
a row being a column of the head's packed panels: its panel's bytes with pread, that column decoded.

`split_off` takes a graph's Gathers of a float table in the artifact by a graph input out of the graph
(and its GatherF28s): their outputs become graph inputs, which the executor computes (`GatheredInput`)
before each run.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import numpy as np
import onnx

from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.kernels import float28
from cann_llm.runtime.ops import CUSTOM_DOMAIN, GATHER_F28, GatherF28Input, attributes
from cann_llm.runtime.proto_utils import constant_operand, graphs_within


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
        # closed when collected, not at exit: an engine's worker may still read rows then (engine.py closes the
        # engines at exit first), and the process's end closes the file anyway
        weakref.finalize(self, os.close, self._descriptor).atexit = False
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


@dataclass
class PackedColumns:
    """Rows of a table `[N, K]` stored as its transpose in F28 (a tied lm_head's MatMulF28 weight, its panels at
    `offset` in the file `path`), with the weight's exceptions; read with pread, a panel a row at most."""

    path: str
    offset: int
    name: str
    K: int
    N: int
    bias: int
    offsets: np.ndarray
    positions: np.ndarray
    values: np.ndarray

    def __post_init__(self):
        try:  # the panels stay in the file (the loader checked their size); the exceptions index rows here
            float28.check_exceptions(self.offsets, self.positions, self.values, self.K, self.N)
        except ValueError as error:
            raise AtcError("E13015", self.path, f"{self.name}: {error}") from None
        self._descriptor = os.open(self.path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._descriptor).atexit = False  # as above
        self._panel_bytes = self.K * float28.GROUP_BYTES

    def __call__(self, ids: np.ndarray, what: str = "ids") -> np.ndarray:
        """The rows of integer `ids` as `TableRows` gives them (the same refusals)."""
        flat = np.asarray(ids).reshape(-1).tolist()
        slots: dict[int, int] = {}
        for row in flat:
            if not -self.N <= row < self.N:
                raise AtcError("E10001", row, what, f"an index must be in [{-self.N}, {self.N - 1}]: {self.name} has "
                                                    f"{self.N} rows")
            slots.setdefault(row % self.N // float28.PANEL, len(slots))
        blocks = np.empty((len(slots), self.K, float28.GROUP_BYTES), np.uint8)
        for panel, slot in slots.items():
            if os.preadv(self._descriptor, [blocks[slot]], self.offset + panel * self._panel_bytes) != self._panel_bytes:
                raise AtcError("E13015", self.path, f"panel {panel} of {self.name} lies past the end of the file")
        rows = np.array([row % self.N for row in flat], np.int64)
        panels, lanes = rows // float28.PANEL, rows % float28.PANEL
        decoded = float28.columns(blocks, [slots[p] for p in panels.tolist()], lanes, self.bias)
        decoded = float28.with_exceptions(decoded, panels, lanes, self.offsets, self.positions, self.values)
        return decoded.reshape(*np.shape(ids), self.K)


@dataclass(frozen=True)
class GatheredInput:
    """A Gather taken out of the graph: `output` computed from the graph input `indices` before each run."""

    rows: TableRows | PackedColumns
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
    found += [node for node in graph.node if node.op_type == GATHER_F28.name and node.domain == CUSTOM_DOMAIN
              and node.input[GatherF28Input.PACKED] in weights and node.input[GatherF28Input.INDICES] in inputs]
    if not found:
        return model, []
    inline = {t.name: t for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL}
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    readers = []
    for node in found:
        if node.op_type == GATHER_F28.name:
            rows, indices = _packed_columns(node, weights, inline, om), node.input[GatherF28Input.INDICES]
        else:
            table, indices = node.input[0], node.input[1]
            view = weights[table]
            rows = TableRows(str(om.path), om.file_offset(view), table, tuple(view.shape), view.dtype)
        output = node.output[0]
        ids_type = inputs[indices].type.tensor_type
        readers.append(GatheredInput(rows, indices, _INDICES[ids_type.elem_type], output))
        element = onnx.TensorProto.FLOAT if isinstance(rows, PackedColumns) else tables[node.input[0]].data_type
        width = (rows.K,) if isinstance(rows, PackedColumns) else rows.shape[1:]
        graph.input.append(onnx.helper.make_tensor_value_info(output, element, [
            *(d.dim_param or d.dim_value or None for d in ids_type.shape.dim), *width]))
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


def _packed_columns(node: onnx.NodeProto, weights: dict[str, np.ndarray], inline: dict, om) -> PackedColumns:
    """The reader of a GatherF28's rows: its packed panels where the artifact holds them, its exceptions in memory
    (large ones are the artifact's mapped weights, small ones in the graph); E13015 for operands that are not
    the artifact's constants."""
    exceptions = []
    for slot in (GatherF28Input.OFFSETS, GatherF28Input.POSITIONS, GatherF28Input.VALUES):
        found = constant_operand(node.input[slot], weights, inline)
        if found is None:
            raise AtcError("E13015", om.path, f"{node.name}: GatherF28's {slot.name.lower()} is not a constant of the artifact")
        exceptions.append(found)
    attrs = attributes(node)
    packed = weights[node.input[GatherF28Input.PACKED]]
    return PackedColumns(str(om.path), om.file_offset(packed), node.input[GatherF28Input.PACKED], attrs["K"], attrs["N"],
                         attrs["bias"], *exceptions)


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)
