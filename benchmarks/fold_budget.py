"""What constant folding costs at its budget, and what nested conditionals cost a compile.

    python benchmarks/fold_budget.py                 # the budget's worst cases, then depths 4, 8, 10, 12

A chain of elementwise ops on a 64 MiB constant (the largest output a fold may have) and a chain of
900×900 MatMuls, each longer than the budget admits, folded by ConstantFoldingPass alone; then `atc` on
models of `If`s nested `depth` deep on constant conditions (branches of four 900×900 MatMuls, 3-5 MB),
with each pass's time.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import click
import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper, numpy_helper

from cann_llm.cli.atc import run as atc
from cann_llm.models.nested_conditionals import nested_conditionals
from cann_llm.passes.fold_constants import EVALUATION_BYTES, TOTAL_BYTES, WORK_BUDGET, FoldConstants
from cann_llm.passes.infer_shapes import InferShapes


def _fold(nodes, initializers, shape) -> tuple[float, int, int]:
    nodes = nodes + [helper.make_node("Add", ["x", nodes[-1].output[0]], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], initializers)
    graph = gs.import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    InferShapes().run(graph)
    start = time.perf_counter()
    result = FoldConstants(size_threshold=None).run(graph)
    return time.perf_counter() - start, result.match_times, len(result.rejections)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--depths", default="4,8,10,12", show_default=True, help="nesting depths to compile")
def main(depths: str) -> None:
    """Print the fold times at the budget, then the compile time per nesting depth."""
    count = EVALUATION_BYTES // 4
    chain = [helper.make_node("Sqrt" if i % 2 else "Neg", ["c" if i == 0 else f"e{i - 1}"], [f"e{i}"])
             for i in range(TOTAL_BYTES // EVALUATION_BYTES + 8)]
    seconds, folded, skipped = _fold(chain, [numpy_helper.from_array(np.ones(count, np.float32), "c")], [count])
    print(f"elementwise chain of {len(chain)} on 64 MiB: {seconds:.2f} s, {folded} folded, {skipped} skipped")
    chain = [helper.make_node("MatMul", ["w" if i == 0 else f"m{i - 1}", "w"], [f"m{i}"])
             for i in range(WORK_BUDGET // 900**3 + 4)]
    weight = numpy_helper.from_array(np.ones((900, 900), np.float32) / 900, "w")
    seconds, folded, skipped = _fold(chain, [weight], [900, 900])
    print(f"MatMul chain of {len(chain)} at 900x900: {seconds:.2f} s, {folded} folded, {skipped} skipped")
    for depth in (int(d) for d in depths.split(",")):
        with tempfile.TemporaryDirectory() as folder:
            path = nested_conditionals(Path(folder) / "nested.onnx", depth)
            start = time.perf_counter()
            status = atc([f"--model={path}", "--framework=5", f"--output={Path(folder) / 'm'}",
                          "--soc_version=Ascend910B", "--log=error"])
            print(f"depth {depth}: {path.stat().st_size / 2**20:.1f} MB, atc exit {status}, "
                  f"{time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
