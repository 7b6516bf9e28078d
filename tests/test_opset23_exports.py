"""PyTorch's dynamo exporter at `opset_version=23` and 24 writes transformers' sdpa attention as ONNX's own
`Attention` op: at 23 with `RotaryEmbedding` and `RMSNormalization` and the KV heads repeated per query
head before it, at 24 with the heads left to the op; the causal and padding mask is a boolean attn_mask,
and a cache is concatenated outside the op. Each compiles fully fused, its attn_mask read back into the
attention_mask input and a causal flag (and Mistral's sliding window), so it compiles paged too; the
contiguous logits are onnxruntime's on the export (a left-padded batch), and the paged engine generates
onnxruntime's greedy tokens."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest

from conftest import compile_to, ort_reference
from cann_llm.models.export import export_causal_lm
from cann_llm.models.tiny import build_tiny_model
from cann_llm.runtime.executor import Executor
from cann_llm.runtime.loader import load_artifact
from cann_llm.runtime.ops import FusedAttentionInput
from tests.generation_utils import assert_paged_greedy_equals_onnxruntime

CASES = [("llama", 23, True), ("llama", 24, False), ("mistral", 23, True)]


@pytest.mark.parametrize("family, opset, with_past", CASES, ids=[f"{f}-{o}-{'kv' if p else 'nokv'}" for f, o, p in CASES])
def test_an_opset_23_or_24_dynamo_export_fuses_and_compiles_paged(family, opset, with_past, tmp_path):
    overrides = {"sliding_window": 4} if family == "mistral" else None  # a window the prompts pass
    source = export_causal_lm(build_tiny_model(family, overrides=overrides), tmp_path / "model.onnx", dynamo=True,
                              with_past=with_past, opset=opset)
    exported = Counter(n.op_type for n in onnx.load(source).graph.node)
    assert exported["Attention"] == 2 and exported["Softmax"] == 0  # what the test is about
    loaded = load_artifact(compile_to(source, tmp_path / "contiguous"))
    fused = [n for n in loaded.model.graph.node if n.op_type == "FusedAttention"]
    assert len(fused) == 2 and not [n for n in loaded.model.graph.node if n.op_type in ("Attention", "Softmax")]
    for node in fused:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes["causal"] == 1 and attributes.get("sliding_window", 0) == (4 if overrides else 0)
        assert node.input[FusedAttentionInput.ATTENTION_MASK] == "attention_mask"
        assert len(node.input) <= FusedAttentionInput.ATTENTION_BIAS or not node.input[FusedAttentionInput.ATTENTION_BIAS]
    ids = np.arange(3, 11)[None].repeat(2, 0)
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # left padding
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": np.maximum(np.cumsum(mask, 1) - 1, 0)}
    for value in onnx.load(source, load_external_data=False).graph.input:
        if value.name.startswith("past_key_values"):  # an empty past: [batch, kv heads, 0, head size]
            dims = value.type.tensor_type.shape.dim
            feeds[value.name] = np.zeros((2, dims[1].dim_value, 0, dims[3].dim_value), np.float32)
    got, want = Executor(loaded).run(feeds)["logits"], ort_reference(source, feeds)["logits"]
    np.testing.assert_allclose(got[mask.astype(bool)], want[mask.astype(bool)], atol=1e-4, rtol=0)
    assert_paged_greedy_equals_onnxruntime(source, compile_to(source, tmp_path / "paged", enable_paged_attention=True),
                                           new_tokens=16)


def test_a_triangle_window_over_a_cache_outside_the_op_is_refused(tmp_path):
    """A window written as a triangle of the attn_mask itself (Gemma 2's `tril(diagonal=-W)` before transformers
    4.53) counts its rows from the first key, past included; the fused op counts from the query's position, so
    over a cache concatenated outside the op the Attention is left as exported, not fused with another window."""
    import onnx_graphsurgeon as gs

    from cann_llm.compiler.loader import load_onnx
    from cann_llm.compiler.pass_manager import run_passes
    from cann_llm.compiler.pipeline import build_pipeline
    from cann_llm.passes.convert_attention import ConvertAttention

    source = export_causal_lm(build_tiny_model("llama"), tmp_path / "model.onnx", dynamo=True, with_past=True, opset=23)
    graph = gs.import_onnx(load_onnx(source))
    passes = build_pipeline(None)
    run_passes(graph, passes[:[p.name for p in passes].index(ConvertAttention.name)], {})
    for index, node in enumerate(n for n in list(graph.nodes) if n.op == "Attention"):
        mask = node.inputs[3]  # attn_mask: True where a key is seen
        shape, ones = gs.Variable(f"w{index}/shape", np.int64), gs.Variable(f"w{index}/ones", np.bool_)
        hidden = gs.Variable(f"w{index}/hidden", np.bool_, mask.shape)
        windowed = gs.Variable(f"w{index}/mask", np.bool_, mask.shape)
        graph.nodes += [
            gs.Node("Shape", inputs=[mask], outputs=[shape]),
            gs.Node("ConstantOfShape", inputs=[shape], outputs=[ones],
                    attrs={"value": onnx.numpy_helper.from_array(np.array([True]))}),
            gs.Node("Trilu", inputs=[ones, gs.Constant(f"w{index}/k", np.array(-3, np.int64))], outputs=[hidden],
                    attrs={"upper": 0}),
            gs.Node("Where", inputs=[hidden, gs.Constant(f"w{index}/no", np.array(False)), mask], outputs=[windowed])]
        node.inputs[3] = windowed
    graph.cleanup().toposort()
    result = ConvertAttention().run(graph)
    assert result.effect_times == 0 and len(result.rejections) == 2
    assert all("triangle counted from the first key" in reason for reason in result.rejections)
