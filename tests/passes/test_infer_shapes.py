"""ShapeInferencePass on a dynamo export whose layers' past lengths are symbols of their own: given as one dim
up front, onnxruntime's symbolic inference runs once and names every value as its restarts would."""

from __future__ import annotations

import onnx
import pytest
from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

from cann_llm.compiler.loader import import_graph
from cann_llm.passes.graph_utils import light_model
from cann_llm.passes.infer_shapes import _one_past_length


def _symbolic(model: onnx.ModelProto, merges: dict[str, str]) -> tuple[int, dict[str, list]]:
    """(runs of the inference, every value's dims) with `merges` known before the first run."""
    inference = SymbolicShapeInference(2**31 - 1, auto_merge=True, guess_output_rank=False, verbose=0)
    inference._preprocess(model)
    inference.suggested_merge_.update(merges)
    runs = 0
    while inference.run_:
        inference._infer_impl()
        runs += 1
    # the graph's outputs left out: the pass keeps their declared shapes (the exporter's names) whatever it infers
    values = inference.out_mp_.graph.value_info
    return runs, {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_past_lengths_given_as_one_dim_give_the_shapes_of_every_restart_in_one_run(family):
    from cann_llm.models.tiny import tiny_onnx

    _, graph = import_graph(tiny_onnx(family, dynamo=True, with_past=True))
    model = onnx.shape_inference.infer_shapes(light_model(graph)[0], data_prop=True)
    merges = _one_past_length(model)
    pasts = {i.type.tensor_type.shape.dim[2].dim_param for i in model.graph.input if i.name.startswith("past_key_values")}
    assert len(pasts) == 4 and len(merges) == 3  # 2 layers, a key and a value each: one kept, three merged into it
    restarted, found = _symbolic(model, {})
    once, given = _symbolic(model, merges)
    assert (restarted, once) == (2, 1)  # a run a layer, as SmolLM2 took 30
    assert given.keys() == found.keys()
    renamed: dict[str, object] = {}  # the inference keeps another of the equal symbols: the same dims by another name
    for name, dims in found.items():
        assert len(dims) == len(given[name]), name
        for theirs, ours in zip(dims, given[name]):
            expected = renamed.setdefault(theirs, ours) if isinstance(theirs, str) else theirs
            assert ours == expected, name


def test_a_past_without_a_symbolic_length_merges_nothing(tiny_llama_path):
    _, graph = import_graph(tiny_llama_path)  # TorchScript: every layer's past is `past` already
    model = onnx.shape_inference.infer_shapes(light_model(graph)[0], data_prop=True)
    assert _one_past_length(model) == {}
