"""FloatWeightCompressionPass: float32 MatMul weights stored in 28 bits each, losslessly (`--compress_fp32_weight`).

Each MatMul whose B is a 2-D float32 constant (directly, or through a Transpose, as a tied lm_head reads the
embedding table) becomes `cann::MatMulF28` reading the weight packed by cann_llm/runtime/kernels/float28.py: the same
values bit for bit, 7/8 of the bytes, which is what a batch-1 decode step's time is made of. A weight whose
values span too many exponents (more than 1% of them would be exceptions) or are not finite stays as it is.
A tied table's embedding lookup (a Gather by a graph input of the table whose transpose the head reads)
becomes `cann::GatherF28` on the head's packed weight, so the artifact holds the table once.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import tidy
from cann_llm.passes.weight_memory import read_values
from cann_llm.passes.weight_spill import WeightSpill, kept
from cann_llm.runtime.artifact import EXTERNAL_MIN_BYTES
from cann_llm.runtime.kernels import float28
from cann_llm.runtime.ops import CUSTOM_DOMAIN, GATHER_F28, MATMUL_F28


def _float_weight(tensor: gs.Tensor) -> tuple[gs.Constant, bool] | None:
    """The 2-D float32 constant `tensor` is, or is the transpose of, and whether it is transposed."""
    if isinstance(tensor, gs.Constant):
        return (tensor, False) if len(tensor.shape) == 2 and np.dtype(tensor.dtype) == np.float32 else None
    producer = tensor.inputs[0] if len(tensor.inputs) == 1 else None
    if producer is None or producer.op != "Transpose" or not isinstance(producer.inputs[0], gs.Constant):
        return None
    source = producer.inputs[0]
    if len(source.shape) != 2 or np.dtype(source.dtype) != np.float32 or list(producer.attrs.get("perm", [1, 0])) != [1, 0]:
        return None
    return source, True


class CompressFloatWeights:
    """Replace float32-weighted MatMuls by MatMulF28 on the weight in F28 (cann_llm/runtime/kernels/float28.py)."""

    name = "FloatWeightCompressionPass"
    switchable = True

    def __init__(self, spill: WeightSpill | None = None):
        self.spill = spill

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        # one packing per weight and orientation, however many MatMuls read it
        packed: dict[tuple[str, bool], tuple[list[gs.Constant], int] | None] = {}
        for node in list(graph.nodes):
            if node.op != "MatMul" or len(node.inputs) != 2:
                continue
            found = _float_weight(node.inputs[1])
            if found is None:
                continue
            result.match_times += 1
            key = (found[0].name, found[1])
            if key not in packed:
                packed[key] = self._pack(*found)
            if packed[key] is None:
                result.rejections.append(f"{node.name}: {found[0].name} spans too many exponents, or is not finite")
                continue
            operands, bias = packed[key]
            k, n = (found[0].shape[1], found[0].shape[0]) if found[1] else tuple(found[0].shape)
            output = node.outputs[0]
            node.outputs.clear()
            graph.nodes.append(gs.Node(MATMUL_F28.name, name=f"{node.name}/F28", domain=CUSTOM_DOMAIN,
                                       attrs={"K": int(k), "N": int(n), "bias": bias},
                                       inputs=[node.inputs[0], *operands], outputs=[output]))
            node.inputs.clear()
            result.effect_times += 1
            if found[1]:
                self._tied_lookups(graph, found[0], operands, bias)
        tidy(graph)
        return result

    @staticmethod
    def _tied_lookups(graph: gs.Graph, table: gs.Constant, operands: list[gs.Constant], bias: int) -> None:
        """The embedding Gathers of `table` by a graph input, as GatherF28 on its transpose's packed operands
        (which the runtime reads from the artifact file: a table too small to be stored apart stays as it is)."""
        if int(np.prod(operands[0].shape)) < EXTERNAL_MIN_BYTES:  # uint8: a byte an element; kept on disk, unread
            return
        inputs = {t.name for t in graph.inputs}
        for gather in [n for n in table.outputs if n.op == "Gather" and n.inputs[0] is table]:
            if gather.inputs[1].name not in inputs or gather.attrs.get("axis", 0) != 0:
                continue
            output = gather.outputs[0]
            gather.outputs.clear()
            graph.nodes.append(gs.Node(GATHER_F28.name, name=f"{gather.name}/F28", domain=CUSTOM_DOMAIN,
                                       attrs={"K": int(table.shape[1]), "N": int(table.shape[0]), "bias": bias},
                                       inputs=[*operands, gather.inputs[1]], outputs=[output]))
            gather.inputs.clear()

    def _pack(self, constant: gs.Constant, transposed: bool) -> tuple[list[gs.Constant], int] | None:
        values = read_values(constant)
        packed = float28.pack(values.T if transposed else values)
        if packed is None:
            return None
        stem = f"{constant.name}{'_t' if transposed else ''}_f28"
        operands = [gs.Constant(f"{stem}_packed", kept(self.spill, packed.packed)),
                    gs.Constant(f"{stem}_offsets", packed.offsets),
                    gs.Constant(f"{stem}_positions", packed.positions),
                    gs.Constant(f"{stem}_values", packed.values)]
        return operands, packed.bias
