"""`import_graph`: a model's external data is mapped, not read, and compiles to what the inline model does."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from conftest import compile_to

from cann_llm.compiler.loader import import_graph
from cann_llm.runtime import load_artifact


def _with_external_data(source, folder):
    model = onnx.load(str(source))
    folder.mkdir()
    onnx.save(model, str(folder / "model.onnx"), save_as_external_data=True, location="weights.bin", size_threshold=1024)
    return folder / "model.onnx"


def test_external_weights_are_read_only_views_of_the_mapped_file(tmp_path, tiny_llama_path):
    path = _with_external_data(tiny_llama_path, tmp_path / "ext")
    _, graph = import_graph(path)
    mapped = [c.values for c in graph.tensors().values()
              if isinstance(c, gs.Constant) and isinstance(c._values, np.ndarray) and c.values.nbytes >= 1024]
    assert len(mapped) >= 15  # 2 layers × 7 projections, the embedding table, lm_head
    assert all(not array.flags.writeable and not array.flags.owndata for array in mapped)


def test_a_model_with_external_data_compiles_to_the_inline_models_artifact(tmp_path, tiny_llama_path):
    inline = load_artifact(compile_to(tiny_llama_path, tmp_path / "inline"))
    external = load_artifact(compile_to(_with_external_data(tiny_llama_path, tmp_path / "ext"), tmp_path / "external"))
    assert inline.model.graph == external.model.graph
    assert inline.weights.keys() == external.weights.keys()
    assert all(np.array_equal(inline.weights[name], external.weights[name]) for name in inline.weights)
