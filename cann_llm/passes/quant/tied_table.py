"""A lm_head tied to the embedding table: lm_head = x · Eᵀ and the token lookup both read one copy of E,
quantized (MatMulInt4 and GatherInt4, MatMulNBits' layout), blocked along the hidden size.

At 8 bits the copy is symmetric RTN. At 4 bits it is symmetric over all 16 levels (GGUF's Q4_0 scales,
`quantize_full_range`): the head's tens of thousands of rows cost more perplexity at 4 bits than all the
layers' weights, and of the forms measured on SmolLM2 this one cost the least, less than forms with zero
points whose squared error was lower (docs/quantization.md#a-4-bit-lm_head)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.graph_utils import transposed_constant
from cann_llm.passes.pattern import fused_node
from cann_llm.passes.quant.accuracy_level import EIGHT_BIT_ACCURACY_LEVEL, TIED_HEAD_ACCURACY_LEVEL
from cann_llm.passes.quant.math import EIGHT_BIT_BLOCKS, quantize_blockwise, quantize_full_range
from cann_llm.passes.weight_spill import WeightSpill, kept
from cann_llm.runtime.kernels.matmul_nbits_layout import pack_matmul_nbits


def tied_table(graph: gs.Graph, head: gs.Node) -> gs.Constant | None:
    """The embedding table E a lm_head MatMul reads as Eᵀ: through a Transpose (large tables, left unfolded)
    or as a folded copy equal to Eᵀ (small ones)."""
    weight = head.inputs[1]
    table = transposed_constant(weight)
    if table is not None:
        return table
    if not isinstance(weight, gs.Constant) or len(weight.shape) != 2:
        return None
    for gather in (n for n in graph.nodes if n.op == "Gather" and isinstance(n.inputs[0], gs.Constant)):
        table = gather.inputs[0]
        if tuple(table.shape) == tuple(weight.shape)[::-1] and np.array_equal(np.asarray(table.values).T,
                                                                              np.asarray(weight.values)):
            return table
    return None


def table_block(hidden: int, bits: int, group_size: int) -> int | None:
    """A tied table's block along the hidden size, which it must divide (the embedding lookup reads whole
    blocks): the group size at 4 bits, else the largest of 128…16; None when none divides it."""
    sizes = (group_size, 128, 64, 32, 16) if bits == 4 else EIGHT_BIT_BLOCKS
    return next((b for b in sizes if hidden % b == 0), None)


def quantize_tied_table(graph: gs.Graph, head: gs.Node, bits: int, group_size: int,
                        spill: WeightSpill | None = None) -> bool:
    """Replace `head` and the Gathers reading its table by MatMulInt4 and GatherInt4 over one `bits`-bit copy
    of the table (kept by `spill` when given); False, changing nothing, when the head reads no usable tied
    table."""
    table = tied_table(graph, head)
    if table is None:
        return False
    vocab, hidden = table.shape
    block = table_block(hidden, bits, group_size)
    if block is None:
        return False
    weight = np.asarray(table.values).T
    quantized = (quantize_full_range(weight, bits, block) if bits == 4
                 else quantize_blockwise(weight, bits, block, symmetric=True))
    blob, scales, _ = pack_matmul_nbits(quantized)  # symmetric: no zero points
    packed = gs.Constant(f"{table.name}_int{bits}", kept(spill, blob))
    packed_scales = gs.Constant(f"{table.name}_int{bits}_scales", scales)
    graph.nodes.append(fused_node("MatMulInt4", [head.inputs[0], packed, packed_scales], [head.outputs[0]],
                                  f"{head.name}_int{bits}", K=hidden, N=vocab, bits=bits, block_size=block,
                                  accuracy_level=TIED_HEAD_ACCURACY_LEVEL if bits == 4 else EIGHT_BIT_ACCURACY_LEVEL))
    head.inputs.clear()
    for gather in [n for n in graph.nodes if n.op == "Gather" and n.inputs[0] is table]:
        if gather.attrs.get("axis", 0) == 0:
            graph.nodes.append(fused_node("GatherInt4", [packed, gather.inputs[1], packed_scales],
                                          [gather.outputs[0]], f"{gather.name}_int{bits}", K=hidden,
                                          block_size=block, bits=bits))
            gather.inputs.clear()
    return True
