"""PrecisionConversionPass: store float weights in the dtype `--precision_mode` asks for.

cann_llm/passes/precision_config.py says why a mode changes storage only. A converted weight becomes a
float16 (or bfloat16) initializer followed by a Cast to float32, so the graph keeps its float32
arithmetic and any ONNX runner reads it; onnxruntime folds the Cast when its session loads.

Weights considered: 2-D float32 initializers read only as a MatMul/Gemm weight (directly or through a
Transpose, as a tied lm_head reads the embedding table) or as the table of a Gather whose indices are
a graph input (the token embedding). The embedding table and the lm_head weight form the "table" class
that the mixed modes keep in float32.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import lm_head, naming_patterns, tidy
from cann_llm.passes.precision_config import OP_TYPE_PREFIX, PrecisionPolicy
from cann_llm.passes.weight_memory import read_values
from cann_llm.runtime.errors import AtcError

_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def _readers(constant: gs.Constant) -> list[tuple[gs.Node, gs.Tensor]]:
    """(node, the tensor it reads) for the users of `constant`, looking through a Transpose."""
    pairs = []
    for node in constant.outputs:
        if node.op == "Transpose":
            pairs += [(reader, node.outputs[0]) for reader in node.outputs[0].outputs]
        else:
            pairs.append((node, constant))
    return pairs


def _weight_role(constant: gs.Constant, graph_inputs: set[str], head: gs.Node | None) -> str | None:
    """"table" (embedding lookup or lm_head), "matmul", or None when some reader is neither."""
    role = "matmul"
    for node, tensor in _readers(constant):
        if node.op in ("MatMul", "Gemm") and node.inputs[1] is tensor:
            role = "table" if node is head else role
        elif node.op == "Gather" and node.inputs[0] is tensor and node.inputs[1].name in graph_inputs:
            role = "table"
        else:
            return None
    return role


class ConvertPrecision:
    """Convert float32 weights to the policy's storage dtype; kept ones (`--keep_dtype`) and those outside
    the dtype's finite range stay float32."""

    name = "PrecisionConversionPass"
    switchable = False

    def __init__(self, policy: PrecisionPolicy):
        self.policy = policy

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        policy = self.policy
        if policy.weight_dtype is None:
            return result
        head = lm_head(graph)
        graph_inputs = {t.name for t in graph.inputs}
        target, limit = _DTYPES[policy.weight_dtype], float(ml_dtypes.finfo(_DTYPES[policy.weight_dtype]).max)
        matched: set[str] = set()
        constants = {id(t): t for n in graph.nodes for t in n.inputs if isinstance(t, gs.Constant)}
        for constant in constants.values():
            if len(constant.shape) != 2 or np.dtype(constant.dtype) != np.float32:
                continue
            role = _weight_role(constant, graph_inputs, head)
            if role is None:
                continue
            result.match_times += 1
            kept = self._kept_by(constant, head)
            matched.update(kept)
            values = read_values(constant)  # a deferred weight computed for the conversion, not kept
            if kept:
                result.rejections.append(f"{constant.name}: kept by --keep_dtype {', '.join(sorted(kept))}")
            elif role == "table" and not policy.convert_table:
                result.rejections.append(f"{constant.name}: the {policy.mode} mode keeps the embedding/lm_head table")
            elif np.abs(values).max(initial=0.0) > limit:
                result.rejections.append(f"{constant.name}: values beyond {policy.weight_dtype}'s range")
            elif policy.exact_only and not np.array_equal(values.astype(target).astype(values.dtype), values):
                result.rejections.append(f"{constant.name}: values {policy.weight_dtype} does not hold exactly "
                                         "(not the model's own dtype): kept float32")
            else:
                self._convert(graph, constant, values.astype(target))
                result.effect_times += 1
        unmatched = [e for e in (*policy.keep_names, *(OP_TYPE_PREFIX + o for o in policy.keep_op_types))
                     if e not in matched]
        if unmatched:
            raise AtcError("E10016", ", ".join(unmatched), "keep_dtype")
        tidy(graph)
        return result

    def _kept_by(self, constant: gs.Constant, head: gs.Node | None) -> set[str]:
        """The `--keep_dtype` entries naming a reader of `constant`, or the weight itself."""
        entries = set()
        for node, _ in _readers(constant):
            entries.update(naming_patterns(node, constant.name, head, self.policy.keep_names))
            if node.op in self.policy.keep_op_types:
                entries.add(OP_TYPE_PREFIX + node.op)
        return entries

    def _convert(self, graph: gs.Graph, constant: gs.Constant, stored: np.ndarray) -> None:
        narrow = gs.Constant(f"{constant.name}_{self.policy.weight_dtype}", stored)
        wide = gs.Variable(f"{constant.name}_float", dtype=np.float32, shape=list(constant.shape))
        for node in list(constant.outputs):
            for index, tensor in enumerate(node.inputs):
                if tensor is constant:
                    node.inputs[index] = wide
        graph.nodes.append(gs.Node("Cast", name=f"{constant.name}/Cast", attrs={"to": 1}, inputs=[narrow], outputs=[wide]))
