"""Helpers for fusion tests: run one pass alone, then execute the result on both backends."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort

from cann_llm.passes.infer_shapes import InferShapes
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.artifact import write_artifact
from cann_llm.runtime.lowering import lower_for_onnxruntime
from cann_llm.runtime.ort_session import session_options
from cann_llm.runtime.signature import io_signature, llm_dimensions


def apply_pass(model: onnx.ModelProto, *passes):
    """(rewritten model, results of each pass); shapes are inferred first, as the pipeline does."""
    graph = gs.import_onnx(model)
    InferShapes().run(graph)
    results = [p.run(graph) for p in passes]
    return gs.export_onnx(graph, do_type_check=False), results


def op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def run_original(model: onnx.ModelProto, feeds) -> list[np.ndarray]:
    """onnxruntime on the unfused graph, optimisations off (`cann` ops fused earlier are lowered)."""
    options = session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    model = lower_for_onnxruntime(model)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def run_fused(model: onnx.ModelProto, feeds, backend: str, folder: Path) -> list[np.ndarray]:
    """The fused graph through a real artifact and the runtime's executor."""
    if not any(o.domain == "cann" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("cann", 1))
    path = folder / f"fused-{backend}.om"
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # write_artifact consumes the model it is given
    signature = io_signature(copy)
    write_artifact(path, copy, {"name": "fused", "signature": signature, "model": llm_dimensions(signature)})
    return list(Executor(load_artifact(path), backend).run(feeds).values())


def assert_parity(original: onnx.ModelProto, fused: onnx.ModelProto, feeds, folder: Path, atol: float = 1e-5) -> None:
    """Both backends on the fused graph reproduce onnxruntime on the original."""
    expected = run_original(original, feeds)
    for backend in ("onnxruntime", "reference"):
        got = run_fused(fused, feeds, backend, folder)
        for a, b in zip(got, expected):
            np.testing.assert_allclose(a, b, atol=atol, rtol=0, err_msg=backend)
