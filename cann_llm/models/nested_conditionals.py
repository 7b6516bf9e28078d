"""A hostile but valid model: `If`s nested `depth` deep on constant conditions (or on a `flag` input), each
branch a chain of MatMuls of one weight. 3.3 MB at depth 8 (900×900 weight), it once held atc for over
77 s: every pass that visits subgraphs visits all 2^depth branches. tests/passes/test_fold_constants.py
and benchmarks/fold_budget.py compile it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def nested_conditionals(path: Path, depth: int, size: int = 900, chain: int = 4, run_time: bool = False) -> Path:
    """Write the model to `path` and return it; `y = x + f(w)`, with f folding to a constant, or with
    `run_time` every condition the bool input `flag`."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((size, size)).astype(np.float32) / size,
                                     "w")

    def branch(level: int, tag: str) -> onnx.GraphProto:
        nodes, previous = [], "w"
        for index in range(chain):
            nodes.append(helper.make_node("MatMul", [previous, "w"], [f"{tag}_m{level}_{index}"]))
            previous = f"{tag}_m{level}_{index}"
        if level < depth:
            cond = numpy_helper.from_array(np.array(level % 2 == 0), f"{tag}_cond")
            nodes += [helper.make_node("Identity", ["flag"], [f"{tag}_c{level}"]) if run_time else
                      helper.make_node("Constant", [], [f"{tag}_c{level}"], value=cond),
                      helper.make_node("If", [f"{tag}_c{level}"], [f"{tag}_if{level}"],
                                       then_branch=branch(level + 1, tag + "t"), else_branch=branch(level + 1, tag + "e")),
                      helper.make_node("Add", [previous, f"{tag}_if{level}"], [f"{tag}_sum{level}"])]
            previous = f"{tag}_sum{level}"
        nodes.append(helper.make_node("Identity", [previous], [f"{tag}_out{level}"]))
        return helper.make_graph(nodes, f"branch_{tag}", [],
                                 [helper.make_tensor_value_info(f"{tag}_out{level}", TensorProto.FLOAT, [size, size])])

    root = branch(1, "r")
    graph = helper.make_graph([*root.node, helper.make_node("Add", ["x", "r_out1"], ["y"])], "nested",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size, size])]
                              + ([helper.make_tensor_value_info("flag", TensorProto.BOOL, [])] if run_time else []),
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size, size])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path
