"""PairRotaryCanonicalizationPass on ChatGLM2/3's remote code as TorchScript exports it
(cann_llm/models/chatglm.py): each layer's query and key rotation of pairs, computed on a [..., R/2, 2] view
of them, becomes `x·cos + turn(x)·sin`, which match_rotary reads as an interleaved rotation of R dims with
the model's own angles; the logits on onnxruntime stay bit for bit. A rotation that is not the pattern is
left alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest

from cann_llm.compiler.pipeline import build_pipeline
from cann_llm.passes.canonicalize_pair_rotary import CanonicalizePairRotary
from cann_llm.passes.drop_table_slices import DropTableSlices
from cann_llm.passes.infer_shapes import InferShapes
from cann_llm.passes.match_rotary import match_rotary

FEEDS = {"input_ids": np.arange(3, 20)[None], "position_ids": np.arange(17)[None]}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from cann_llm.models.chatglm import build_chatglm, export

    return export(build_chatglm(), tmp_path_factory.mktemp("chatglm") / "model.onnx", with_past=False)


def _canonical_form(path) -> gs.Graph:
    """The export in the compiler's canonical form, standard ops only (phase 0)."""
    graph = gs.import_onnx(onnx.load(str(path)))
    for step in build_pipeline(None):
        step.run(graph)
        if isinstance(step, DropTableSlices):
            break
    InferShapes().run(graph)
    return graph


def _logits(model: onnx.ModelProto) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString()).run(["logits"], FEEDS)[0]


def test_the_pairs_rotation_is_read_as_an_interleaved_rotary_with_the_models_angles(export):
    from cann_llm.models.chatglm import HEAD_DIM

    graph = _canonical_form(export)
    result = CanonicalizePairRotary().run(graph)
    assert (result.match_times, result.effect_times) == (4, 4)  # q and k of two layers
    # each rotated head as its partial rotation writes it: [rope(x[..., :R]), x[..., R:]]
    found = [match_rotary(n.outputs[0]) for n in graph.nodes if n.op == "Concat"]
    found = [f for f in found if f is not None]
    assert [(f[1].rotary_dim, f[1].interleaved) for f in found] == [(HEAD_DIM // 2, 1)] * 4
    rewritten = gs.export_onnx(graph)
    np.testing.assert_array_equal(_logits(rewritten), _logits(onnx.load(str(export))))
    # the tables the rotation reads: each pair's angle twice, position p turning pair i by p·10000^(-4i/R)
    cos = ort.InferenceSession(_with_output(rewritten, found[0][1].cos.name).SerializeToString()).run(
        [found[0][1].cos.name], FEEDS)[0]
    width = HEAD_DIM // 2
    angles = np.arange(17)[:, None] / 10000 ** (np.arange(0, width, 2) / width)
    np.testing.assert_allclose(cos.reshape(17, width), np.repeat(np.cos(angles), 2, axis=-1), atol=1e-6)


def _with_output(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return model


def test_a_rotation_the_other_way_is_left_alone(export):
    graph = _canonical_form(export)
    turned = next(n for n in graph.nodes if n.op == "Sub")
    turned.inputs[0], turned.inputs[1] = turned.inputs[1], turned.inputs[0]  # xs1·s − xs0·c
    result = CanonicalizePairRotary().run(graph)
    assert (result.match_times, result.effect_times) == (3, 3)
