"""The node rewrite: a MatMul and its quantized weight → cann::MatMulInt4 (MatMulNBits' layout, 4 or 8 bits)
or cann::MatMulInt8 (8 bits per output channel), float zero points as integer ones plus an offset term."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.pattern import fused_node
from cann_llm.passes.quant.math import eight_bit_block, split_float_zeros
from cann_llm.passes.weight_spill import WeightSpill, kept
from cann_llm.runtime.kernels.matmul_nbits_layout import QuantizedWeight, pack_matmul_nbits


def runs_as_matmul_nbits(quantized: QuantizedWeight, blocked: bool, int8_activations: bool) -> bool:
    """Whether the weight runs on MatMulNBits: INT4, 8-bit blocks (a lm_head), and every W8A8 weight, whose
    int8 activations are MatMulNBits' 8-bit path; the rest is MatMulInt8."""
    return quantized.bits == 4 or blocked or int8_activations


def matmul_nbits_form(quantized: QuantizedWeight, blocked: bool) -> tuple[QuantizedWeight, np.ndarray | None]:
    """The weight as MatMulNBits takes it: blocked along K, integer zero points, and the float zero points'
    remainders (None when there are none) for the offset term."""
    if quantized.bits == 8 and not blocked:
        quantized = in_blocks(quantized)
    return split_float_zeros(quantized)


def in_blocks(quantized: QuantizedWeight) -> QuantizedWeight:
    """A per-output-channel 8-bit weight in MatMulNBits' blocked form: the same integers, each column's
    scale (and zero point) repeated for every block along K."""
    rows = quantized.values.shape[0]
    block = eight_bit_block(rows)
    n_blocks = -(-rows // block)
    zero_points = None if quantized.zero_points is None else np.repeat(quantized.zero_points, n_blocks, axis=0)
    return QuantizedWeight(quantized.values, np.repeat(quantized.scales, n_blocks, axis=0), zero_points, 8, block)


class QuantizedMatMulWriter:
    """Writes the quantized MatMuls of one pass run; the 0/1 block-sum matrices of the offset terms are
    shared between the MatMuls of one (K, block). With a `spill`, the packed weights go to disk as made."""

    def __init__(self, spill: WeightSpill | None = None) -> None:
        self._block_sums: dict[tuple[int, int], gs.Constant] = {}
        self._packed: dict[str, gs.Constant] = {}
        self.spill = spill

    def _constants(self, weight_name: str, matmul: gs.Node, arrays: dict[str, np.ndarray | None]) -> list:
        """The Constants of a weight's packed arrays (name suffix → array; None: no such array). A weight two
        MatMuls read (Gemma 3n's AltUp router) is packed once where both pack it alike, and under the second
        MatMul's name where not (AWQ scales it by each reader's activations): one name, one array."""
        names = {suffix: f"{weight_name}{suffix}" for suffix in arrays}
        if any(name in self._packed and not np.array_equal(self._packed[name].values, arrays[suffix])
               for suffix, name in names.items() if arrays[suffix] is not None):
            names = {suffix: f"{weight_name}/{matmul.name}{suffix}" for suffix in arrays}
        found = []
        for suffix, array in arrays.items():
            if array is None:
                continue
            if names[suffix] not in self._packed:
                self._packed[names[suffix]] = gs.Constant(names[suffix], kept(self.spill, array))
            found.append(self._packed[names[suffix]])
        return found

    def matmul_nbits(self, graph: gs.Graph, matmul: gs.Node, weight_name: str, quantized: QuantizedWeight,
                     remainders: np.ndarray | None, accuracy_level: int) -> None:
        """Replace `matmul` by MatMulInt4 over `quantized` (in `matmul_nbits_form`)."""
        rows, cols = quantized.values.shape
        bits, name = quantized.bits, f"{matmul.name}_int{quantized.bits}"
        blob, scales, zero_points = pack_matmul_nbits(quantized)
        packed = self._constants(weight_name, matmul, {f"_int{bits}": blob, "_scales": scales,
                                                       "_zero_points": zero_points})
        scales = packed[1]
        inputs = [matmul.inputs[0], *packed]
        output = matmul.outputs[0]
        if remainders is not None:
            output = self._add_block_offsets(graph, matmul.inputs[0], rows, scales, remainders, quantized.block_size,
                                             output, name)
        node = fused_node("MatMulInt4", inputs, [output], name, K=rows, N=cols, bits=bits,
                          block_size=quantized.block_size, accuracy_level=accuracy_level)
        matmul.inputs.clear()
        graph.nodes.append(node)

    def matmul_int8(self, graph: gs.Graph, matmul: gs.Node, weight_name: str, quantized: QuantizedWeight) -> None:
        """Replace `matmul` by MatMulInt8 over a per-output-channel 8-bit weight."""
        zero_points = None if quantized.zero_points is None else quantized.zero_points.reshape(-1)
        inputs = [matmul.inputs[0], *self._constants(weight_name, matmul, {
            "_int8": quantized.values, "_scales": quantized.scales.reshape(-1).astype(np.float32),
            "_zero_points": zero_points})]
        node = fused_node("MatMulInt8", inputs, [matmul.outputs[0]], f"{matmul.name}_int8")
        matmul.inputs.clear()
        graph.nodes.append(node)

    def _add_block_offsets(self, graph: gs.Graph, x: gs.Tensor, rows: int, scales: gs.Constant, remainders: np.ndarray,
                           block: int, output: gs.Tensor, name: str) -> gs.Variable:
        """output = product + (x's sums over each block of K) · offsets, offsets = scale · remainder per block
        and column; returns the tensor `product` the MatMulInt4 is to write. The remainders are stored as
        int8 (|remainder| <= 0.5 when the zero point lies in the 4-bit range, so 1/254 of a step) and the
        offsets built from them by constant nodes, which onnxruntime folds once when the session loads.
        One 0/1 block-sum matrix per (K, block), shared: unlike Reshape + ReduceSum it needs no padding when
        K is not a whole number of blocks, and side by side the two took the same time within this
        machine's noise."""
        key = (rows, block)
        if key not in self._block_sums:
            sums = np.zeros((rows, remainders.shape[0]), np.float32)
            sums[np.arange(rows), np.arange(rows) // block] = 1.0
            self._block_sums[key] = gs.Constant(f"block_sums_{rows}x{block}", sums)
        unit = max(0.5, float(np.abs(remainders).max())) / 127
        stored = gs.Constant(f"{name}_remainders", np.rint(remainders.T / unit).astype(np.int8))
        variable = {part: gs.Variable(f"{name}_{part}", dtype=np.float32)
                    for part in ("remainders_float", "steps", "offsets_nk", "offsets", "block_sums", "offset", "product")}
        output.inputs.clear()  # the Add takes it over from the MatMul being replaced
        graph.nodes += [
            gs.Node("Cast", f"{name}/CastRemainders", attrs={"to": 1}, inputs=[stored],
                    outputs=[variable["remainders_float"]]),
            gs.Node("Mul", f"{name}/Steps", inputs=[scales, variable["remainders_float"]], outputs=[variable["steps"]]),
            gs.Node("Mul", f"{name}/Unit", inputs=[variable["steps"], gs.Constant(f"{name}_unit", np.array(unit, np.float32))],
                    outputs=[variable["offsets_nk"]]),
            gs.Node("Transpose", f"{name}/Transpose", attrs={"perm": [1, 0]}, inputs=[variable["offsets_nk"]],
                    outputs=[variable["offsets"]]),
            gs.Node("MatMul", f"{name}/BlockSums", inputs=[x, self._block_sums[key]], outputs=[variable["block_sums"]]),
            gs.Node("MatMul", f"{name}/Offsets", inputs=[variable["block_sums"], variable["offsets"]],
                    outputs=[variable["offset"]]),
            gs.Node("Add", f"{name}/AddOffsets", inputs=[variable["product"], variable["offset"]], outputs=[output]),
        ]
        return variable["product"]
