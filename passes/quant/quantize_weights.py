"""WeightQuantizationPass: constant-weight MatMuls → cann::MatMulInt4 (MatMulNBits layout) or MatMulInt8.

Two sources of quantized weights:
- a float weight, when `--enable_compress_weight` asks for it: quantized here, by round-to-nearest, GPTQ
  or AWQ (the last two from calibration statistics of each MatMul's input over real text; AWQ's input
  scaling is folded into the RmsNorm before the MatMul where it alone reads the norm, else a Mul);
- a DequantizeLinear feeding the MatMul (a QDQ model, e.g. from `cann-llm-quant`): its integers are
  repacked as they are, never quantized again, so both routes give the same bytes for the same method.
INT4 is blocked along K (block = the group size); INT8 is per output channel. Names matching the skip
patterns (fnmatch on node and weight names; `lm_head` = the MatMul producing the logits) stay float.
Runs after the fusions, so merged QKV and gate/up weights are quantized as the matrices that run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from passes.graph_utils import lm_head, naming_patterns, scale_input
from passes.pattern import FusionPass, fused_node, producer
from passes.quant.calibration import InputStatistics, collect_input_statistics
from passes.quant.config import HESSIAN_METHODS, QuantConfig
from passes.quant.math import EIGHT_BIT_BLOCKS, eight_bit_block, quantize_8bit_blocked, quantize_blockwise, split_float_zeros
from passes.quant.search import int8_activation_error, quantize_weights_together
from passes.quant.staged_calibration import StagedStatistics
from runtime.errors import AtcError
from runtime.kernels.matmul_nbits_layout import QuantizedWeight, dequantize_blockwise, pack_matmul_nbits

# relative output error int8 activations may add to a layer before it keeps float activations; well
# above the ~0.5% that rounding to 127 levels costs on ordinary activations, well below outlier layers'
ACCURACY_THRESHOLD = 0.02
# 8-bit MatMulNBits runs with int8 activations: onnxruntime's float-activation 8-bit path is a slow
# fallback here ([1,576]×[576,49152]: 71 ms at level 0, 0.52 ms at level 4; 4-bit level 0 0.63 ms)
EIGHT_BIT_ACCURACY_LEVEL = 4


def _in_blocks(quantized: QuantizedWeight) -> QuantizedWeight:
    """A per-output-channel 8-bit weight in MatMulNBits' blocked form: the same integers, each column's
    scale (and zero point) repeated for every block along K."""
    rows = quantized.values.shape[0]
    block = eight_bit_block(rows)
    n_blocks = -(-rows // block)
    zero_points = None if quantized.zero_points is None else np.repeat(quantized.zero_points, n_blocks, axis=0)
    return QuantizedWeight(quantized.values, np.repeat(quantized.scales, n_blocks, axis=0), zero_points, 8, block)


@dataclass
class QuantMatch:
    matmul: gs.Node
    quantized: QuantizedWeight
    input_scale: np.ndarray | None = None  # AWQ: the activations are multiplied by this first
    blocked: bool = False  # 8-bit in MatMulNBits' blocked layout (lm_head, W8A8), not MatMulInt8's per channel


def _qdq_weight(weight: gs.Tensor) -> QuantizedWeight | str | None:
    """The integers behind a DequantizeLinear weight; None if the weight is not one; a reason if unusable."""
    dequantize = producer(weight, "DequantizeLinear")
    if dequantize is None:
        return None
    values, scales = dequantize.inputs[0], dequantize.inputs[1]
    zero_points = dequantize.inputs[2] if len(dequantize.inputs) > 2 and dequantize.inputs[2].name else None
    if not all(isinstance(t, gs.Constant) for t in [values, scales] + ([zero_points] if zero_points else [])):
        return "the DequantizeLinear inputs are not constants"
    q = np.asarray(values.values)
    if q.ndim != 2:
        return "the quantized weight is not 2-D"
    kind = np.dtype(q.dtype).name
    block, axis = dequantize.attrs.get("block_size", 0), dequantize.attrs.get("axis", 1)
    zp = None if zero_points is None else np.asarray(zero_points.values)
    blocked_bits = {"int4": 4, "uint4": 4, "int8": 8, "uint8": 8}.get(kind)
    if blocked_bits and axis == 0 and block in (16, 32, 64, 128, 256):  # INT4, or an 8-bit lm_head
        offset, scale_values = 2 ** (blocked_bits - 1), np.asarray(scales.values, np.float32)
        if kind.startswith("int") and zp is not None and np.any(zp.astype(np.int16) != 0):
            return QuantizedWeight((q.astype(np.int16) + offset).astype(np.uint8), scale_values,
                                   (zp.astype(np.int16) + offset).astype(np.uint8), blocked_bits, block)
        if kind.startswith("int"):
            return QuantizedWeight(q.astype(np.int8), scale_values, None, blocked_bits, block)
        zero = zp if zp is not None else np.zeros_like(scale_values, np.uint8)
        return QuantizedWeight(q.astype(np.uint8), scale_values, zero.astype(np.uint8), blocked_bits, block)
    if kind in ("int8", "uint8") and axis in (1, -1) and not block and np.asarray(scales.values).size == q.shape[1]:
        scale = np.asarray(scales.values, np.float32).reshape(1, -1)
        return QuantizedWeight(q, scale, None if zp is None else zp.reshape(1, -1), 8, q.shape[0])
    return f"unsupported DequantizeLinear ({kind}, axis {axis}, block {block})"


def _float_weight(weight: gs.Tensor) -> bool:
    return isinstance(weight, gs.Constant) and len(weight.shape) == 2 and np.dtype(weight.dtype) == np.float32


def _tied_table(graph: gs.Graph, head: gs.Node) -> gs.Constant | None:
    """The embedding table E a lm_head MatMul reads as Eᵀ: through a Transpose (large tables, left unfolded)
    or as a folded copy equal to Eᵀ (small ones)."""
    weight = head.inputs[1]
    transpose = producer(weight, "Transpose")
    if transpose is not None and list(transpose.attrs.get("perm", [1, 0])) == [1, 0] \
            and isinstance(transpose.inputs[0], gs.Constant) and len(transpose.inputs[0].shape) == 2:
        return transpose.inputs[0]
    if not isinstance(weight, gs.Constant) or len(weight.shape) != 2:
        return None
    for gather in (n for n in graph.nodes if n.op == "Gather" and isinstance(n.inputs[0], gs.Constant)):
        table = gather.inputs[0]
        if tuple(table.shape) == tuple(weight.shape)[::-1] and np.array_equal(np.asarray(table.values).T,
                                                                              np.asarray(weight.values)):
            return table
    return None


class QuantizeWeights(FusionPass):
    """Quantize (or repack) MatMul weights."""

    name = "WeightQuantizationPass"
    anchor = "MatMul"

    def __init__(self, config: QuantConfig | None = None, samples: list[np.ndarray] | None = None):
        self.config, self.samples = config, samples
        self.bits = config.bits if config else None
        self.group_size = config.group_size if config else 128
        self.symmetric = config.symmetric if config else True
        self.skip = config.skip_layers if config else ()
        self.head_bits = (config.lm_head_bits if config.bits == 4 else 8) if config else None
        self.matched_patterns: set[str] = set()
        self.accuracy_levels: dict[str, int] = {}
        self._head: gs.Node | None = None
        self._statistics: dict[str, InputStatistics] | StagedStatistics = {}
        self._block_sums: dict[tuple[int, int], gs.Constant] = {}

    def run(self, graph: gs.Graph):
        self._head = lm_head(graph)
        if self.bits and "lm_head" not in self.skip:
            self._quantize_tied_table(graph)
        calibrating = self.config is not None and self.config.needs_calibration
        if self.samples and calibrating and self.config.method in HESSIAN_METHODS:
            # taken layer by layer as the quantizer reaches each, then released
            self._statistics = StagedStatistics(graph, self.samples)
        elif self.samples:  # SmoothQuant's ranges, or the accuracy-level choice's few activation rows
            inputs = sorted({n.inputs[0].name for n in graph.nodes if n.op == "MatMul" and len(n.inputs) == 2
                             and not self._skipped(n)
                             and (_float_weight(n.inputs[1]) or producer(n.inputs[1], "DequantizeLinear"))})
            self._statistics = collect_input_statistics(graph, inputs, self.samples if calibrating
                                                        else self.samples[:4], with_hessian=False)
            self.matched_patterns.clear()
        result = super().run(graph)
        self._statistics = {}
        if self._head is not None:
            self.matched_patterns.add("lm_head")
        unmatched = [p for p in self.skip if p not in self.matched_patterns] if self.bits else []
        if unmatched:
            raise AtcError("E10001", ",".join(unmatched), "skip_layers",
                           "The pattern matches no MatMul node or weight of the compiled graph.")
        return result

    def _head_block(self, hidden: int) -> int | None:
        """A tied table's block along the hidden size, which it must divide (the embedding lookup reads whole
        blocks): the group size at 4 bits, else the largest of 128…16."""
        sizes = (self.group_size, 128, 64, 32, 16) if self.head_bits == 4 else EIGHT_BIT_BLOCKS
        return next((b for b in sizes if hidden % b == 0), None)

    def _quantize_tied_table(self, graph: gs.Graph) -> None:
        """lm_head = x · Eᵀ with E the embedding table: both read one copy of E quantized to `lm_head_bits`
        (MatMulInt4 and GatherInt4, MatMulNBits' layout), blocked along the hidden size."""
        head = self._head
        table = _tied_table(graph, head) if head is not None else None
        if table is None:
            return
        vocab, hidden = table.shape
        block = self._head_block(hidden)
        if block is None:
            return
        bits = self.head_bits
        quantized = quantize_blockwise(np.asarray(table.values).T, bits, block, symmetric=True)
        blob, scales, _ = pack_matmul_nbits(quantized)
        packed = gs.Constant(f"{table.name}_int{bits}", blob)
        packed_scales = gs.Constant(f"{table.name}_int{bits}_scales", scales)
        graph.nodes.append(fused_node("MatMulInt4", [head.inputs[0], packed, packed_scales], [head.outputs[0]],
                                      f"{head.name}_int{bits}", K=hidden, N=vocab, bits=bits, block_size=block,
                                      accuracy_level=0 if bits == 4 else EIGHT_BIT_ACCURACY_LEVEL))
        head.inputs.clear()
        for gather in [n for n in graph.nodes if n.op == "Gather" and n.inputs[0] is table]:
            if gather.attrs.get("axis", 0) == 0:
                graph.nodes.append(fused_node("GatherInt4", [packed, gather.inputs[1], packed_scales],
                                              [gather.outputs[0]], f"{gather.name}_int{bits}", K=hidden,
                                              block_size=block, bits=bits))
                gather.inputs.clear()
        self.matched_patterns.add("lm_head")

    def _accuracy_level(self, activations: str, quantized: QuantizedWeight, input_scale: np.ndarray | None) -> int:
        """4 (int8 activations, faster) where the measured output error of doing so is below
        ACCURACY_THRESHOLD, else 0 (float activations); fixed when the configuration says so.
        `activations` names the MatMul's input before any AWQ scaling (the calibrated value)."""
        setting = str(self.config.accuracy_level) if self.config else "0"
        stats = self._statistics.get(activations)
        if setting != "auto" or stats is None:
            level = 4 if setting == "4" else 0
        else:
            examples = stats.examples * (input_scale if input_scale is not None else 1.0)
            error = int8_activation_error(examples, dequantize_blockwise(quantized), quantized.block_size)
            level = 4 if error < ACCURACY_THRESHOLD else 0
        self.accuracy_levels[activations] = level
        return level

    def _skipped(self, node: gs.Node) -> str | None:
        patterns = naming_patterns(node, node.inputs[1].name, self._head, self.skip)
        self.matched_patterns.update(patterns)
        return patterns[0] if patterns else None

    def match(self, graph: gs.Graph, matmul: gs.Node) -> QuantMatch | str:
        weight = matmul.inputs[1]
        from_qdq = _qdq_weight(weight)
        if isinstance(from_qdq, str):
            return from_qdq
        if from_qdq is not None:  # a blocked 8-bit DequantizeLinear is an lm_head packed as atc packs it
            blocked = from_qdq.bits == 8 and producer(weight).attrs.get("block_size", 0) > 0
            return QuantMatch(matmul, from_qdq, blocked=blocked)
        if self.bits is None:
            return "weight compression is off"
        if not _float_weight(weight):
            return "the weight is not a constant 2-D float32 matrix"
        pattern = self._skipped(matmul)
        if pattern is not None:
            return f"skipped by pattern {pattern!r}"
        values = np.asarray(weight.values)
        if matmul is self._head and self.bits == 4 and self.head_bits == 8:
            return QuantMatch(matmul, quantize_8bit_blocked(values), blocked=True)
        block = self.group_size if self.bits == 4 else weight.shape[0]
        config = self.config
        stats = self._statistics.get(matmul.inputs[0].name)
        (quantized,), input_scale = quantize_weights_together(
            [values], config.method, self.bits, block, self.symmetric, stats and stats.hessian,
            stats and stats.mean_abs, config.act_order, config.damp, stats and stats.abs_max, config.alpha,
            config.float_zeros)
        return QuantMatch(matmul, quantized, input_scale)

    def rewrite(self, graph: gs.Graph, match: QuantMatch) -> None:
        matmul, quantized = match.matmul, match.quantized
        source, activations = matmul.inputs[1], matmul.inputs[0].name
        if match.input_scale is not None:
            matmul.inputs[0] = scale_input(graph, matmul.inputs[0], match.input_scale, f"{matmul.name}_awq")
        rows, cols = quantized.values.shape
        name = source.name
        # W8A8 runs on onnxruntime's int8 kernels, which are MatMulNBits' 8-bit path with int8 activations
        dynamic = self.config is not None and self.config.activations == "int8"
        if dynamic and quantized.bits == 8 and not match.blocked:
            quantized = _in_blocks(quantized)
        if quantized.bits == 4 or match.blocked or dynamic:
            bits = quantized.bits
            quantized, remainders = split_float_zeros(quantized)
            blob, scales, zero_points = pack_matmul_nbits(quantized)
            scales = gs.Constant(f"{name}_scales", scales)
            inputs = [matmul.inputs[0], gs.Constant(f"{name}_int{bits}", blob), scales]
            if zero_points is not None:
                inputs.append(gs.Constant(f"{name}_zero_points", zero_points))
            level = self._accuracy_level(activations, quantized, match.input_scale) if bits == 4 \
                else EIGHT_BIT_ACCURACY_LEVEL
            output = matmul.outputs[0]
            if remainders is not None:
                output = self._add_block_offsets(graph, matmul.inputs[0], rows, scales, remainders,
                                                 quantized.block_size, output, f"{matmul.name}_int{bits}")
            node = fused_node("MatMulInt4", inputs, [output], f"{matmul.name}_int{bits}", K=rows, N=cols,
                              bits=bits, block_size=quantized.block_size, accuracy_level=level)
        else:
            inputs = [matmul.inputs[0], gs.Constant(f"{name}_int8", quantized.values),
                      gs.Constant(f"{name}_scales", quantized.scales.reshape(-1).astype(np.float32))]
            if quantized.zero_points is not None:
                inputs.append(gs.Constant(f"{name}_zero_points", quantized.zero_points.reshape(-1)))
            node = fused_node("MatMulInt8", inputs, [matmul.outputs[0]], f"{matmul.name}_int8")
        matmul.inputs.clear()
        graph.nodes.append(node)
        self._statistics.pop(activations, None)

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
