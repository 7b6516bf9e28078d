"""Models quantized by onnxruntime's quantizers, as users write them.

Dynamic quantization: `quantize_dynamic` on the tiny Llama's TorchScript export with a cache (per tensor
int8; per column uint8 with zero points), the same saved by an onnxruntime session after its optimizations
(MatMulIntegerToFloat, DynamicQuantizeMatMul), and Optimum's ORTQuantizer (`avx512_vnni`, dynamic) on its
own export of the tiny Qwen2, which also quantizes the attention's and the rotary's activation-by-activation
MatMuls, as `MatMulConstBOnly=False` does on a dynamo export with a tied head. Each compiles fused, its
projections merged onto 8-bit MatMulNBits with int8 activations, and its largest logit difference from the
float model is within 1.25× of onnxruntime's on the quantized model (both quantize the activations, this
project per block of K rather than per tensor).

Weight-only 4-bit: `MatMulNBitsQuantizer` (blocks of 32, int8 activations) on the same export writes
MatMulNBits, kept byte for byte and merged (also on Optimum's GLM, whose gate/up halves are cut at bounds
computed from a MatMulNBits' shape); in its QDQ format, on the dynamo export, blocked int4
DequantizeLinear weights, repacked. Their logits are onnxruntime's on the quantized model.

Contiguous and paged: the paged engine's greedy tokens are those of the contiguous artifact.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import compile_to, ort_reference
from fusion_utils import apply_pass
from generation_utils import engine_greedy, mixed_prompts

from cann_llm.models.onnxruntime_quantizers import matmul_nbits, optimum_dynamic, quantize_dynamic, saved_by_a_session
from cann_llm.models.optimum_export import OptimumUnavailable, ensure_optimum_venv, optimum_onnx, venv_python
from cann_llm.models.tiny import TINY_FAMILIES, tiny_onnx
from cann_llm.passes.convert_integer_matmul import ConvertIntegerMatMul
from cann_llm.compiler.compile import compile_model
from cann_llm.compiler.config import CompileConfig
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.ops import attributes

LAYERS = TINY_FAMILIES["llama"].sizes["num_hidden_layers"]
NEW_TOKENS = 24
INTEGER_OPS = ("MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "DynamicQuantizeLinear")


def _llama(tmp: Path, name: str, **options) -> tuple[Path, Path]:
    source = tiny_onnx("llama", dynamo=False, with_past=True)
    return source, quantize_dynamic(source, tmp / f"{name}.onnx", **options)


def _session_saved(tmp: Path) -> tuple[Path, Path]:
    source, quantized = _llama(tmp, "for-session")
    return source, saved_by_a_session(quantized, tmp / "session-saved.onnx")


def _every_matmul_tied(tmp: Path) -> tuple[Path, Path]:
    """A tied lm_head (the dynamo export's Transpose of the embedding table) and the attention's MatMuls
    quantized too."""
    source = tiny_onnx("llama", dynamo=True, with_past=True, overrides={"tie_word_embeddings": True})
    return source, quantize_dynamic(source, tmp / "every-matmul-tied.onnx", extra_options={"MatMulConstBOnly": False})


def _optimum_export(family: str) -> Path:
    try:
        ensure_optimum_venv()
    except OptimumUnavailable as error:
        pytest.skip(f"the optimum venv cannot be created: {error}")
    return optimum_onnx(family)


def _optimum(tmp: Path) -> tuple[Path, Path]:
    source = _optimum_export("qwen2")
    return source, optimum_dynamic(source, tmp / "optimum-avx512_vnni.onnx", venv_python())


def _four_bit(tmp: Path) -> tuple[Path, Path]:
    source = tiny_onnx("llama", dynamo=False, with_past=True)
    return source, matmul_nbits(source, tmp / "matmul-nbits.onnx")


def _four_bit_qdq(tmp: Path) -> tuple[Path, Path]:
    """Its QDQ format: blocked int4 DequantizeLinear weights, float activations (the dynamo export: at opset 18
    its ops stay valid when the quantizer raises the opset to 21)."""
    source = tiny_onnx("llama", dynamo=True, with_past=True)
    return source, matmul_nbits(source, tmp / "matmul-nbits-qdq.onnx", format="QDQ")


def _glm_four_bit(tmp: Path) -> tuple[Path, Path]:
    """GLM's packed gate_up, cut in halves at bounds computed from the MatMulNBits' output shape."""
    source = _optimum_export("glm")
    return source, matmul_nbits(source, tmp / "glm-matmul-nbits.onnx")


MODELS = {
    "quantize_dynamic": (lambda tmp: _llama(tmp, "per-tensor"),
                         {"MatMulInteger": 7 * LAYERS + 1, "DynamicQuantizeLinear": 4 * LAYERS + 1}, (8, 4), True),
    "quantize_dynamic-per-column-uint8": (
        lambda tmp: _llama(tmp, "per-column", per_channel=True, weight_type="QuantType.QUInt8"),
        {"MatMulInteger": 7 * LAYERS + 1}, (8, 4), True),
    "session-saved": (_session_saved, {"MatMulIntegerToFloat": 5 * LAYERS, "DynamicQuantizeMatMul": 2 * LAYERS + 1},
                      (8, 4), True),
    "optimum-avx512_vnni": (_optimum, {"MatMulInteger": 9 * LAYERS + 2}, (8, 4), False),
    "quantize_dynamic-every-matmul-tied-head": (_every_matmul_tied, {"MatMulInteger": 9 * LAYERS + 1}, (8, 4), False),
    "matmul_nbits_quantizer": (_four_bit, {"MatMulNBits": 7 * LAYERS + 1}, (4, 4), True),
    "matmul_nbits_quantizer-optimum-glm": (_glm_four_bit, {"MatMulNBits": 6 * LAYERS + 1}, (4, 4), True),
    # nothing for the conversion (and graphsurgeon's plain export, which the conversion test runs, does not
    # write int4 constants back as onnxruntime reads them: the compile's own export does)
    "matmul_nbits_quantizer-qdq": (_four_bit_qdq, {"DequantizeLinear": 7 * LAYERS + 1}, (4, 0), False),
}


@pytest.fixture(scope="module", params=MODELS)
def quantized(request, tmp_path_factory):
    """(float export, its quantized model, the integer ops expected, the compiled matmuls' (bits, accuracy
    level), whether the conversion is exact)."""
    make, expected, form, exact = MODELS[request.param]
    source, target = make(tmp_path_factory.mktemp(request.param))
    return source, target, expected, form, exact


def _feeds(model: Path, batch: int = 2, past: int = 3, seq: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    inputs = {i.name: i for i in ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).get_inputs()}
    feeds = {"input_ids": rng.integers(3, 256, (batch, seq)).astype(np.int64),
             "attention_mask": np.ones((batch, past + seq), np.int64),
             "position_ids": np.tile(np.arange(past, past + seq), (batch, 1)).astype(np.int64)}
    for name, value in inputs.items():
        if name.startswith("past_key_values"):
            feeds[name] = rng.standard_normal((batch, value.shape[1], past, value.shape[3])).astype(np.float32)
    return {name: value for name, value in feeds.items() if name in inputs}


def test_the_quantizers_write_integer_ops(quantized):
    _, model, expected, _, _ = quantized
    counts = Counter(node.op_type for node in onnx.load(model).graph.node)
    assert {op: counts[op] for op in expected} == expected


def test_the_conversion_is_exact_where_it_keeps_the_quantization(quantized):
    _, model, expected, _, exact = quantized
    converted, (result,) = apply_pass(onnx.load(model), ConvertIntegerMatMul())
    # MatMulNBits and QDQ weights are not this pass's
    integer_matmuls = sum(count for op, count in expected.items() if op in INTEGER_OPS[:3])
    assert (result.match_times, result.effect_times, result.rejections) == (integer_matmuls, integer_matmuls, [])
    assert not {node.op_type for node in converted.graph.node} & set(INTEGER_OPS[:3])
    if exact:
        feeds = _feeds(model)
        session = ort.InferenceSession(converted.SerializeToString(), providers=["CPUExecutionProvider"])
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        for name, value in ort_reference(model, feeds).items():
            np.testing.assert_allclose(got[name], value, atol=1e-5, rtol=0, err_msg=name)


def test_compiles_fused_with_merged_quantized_projections(quantized, tmp_path):
    source, model, expected, form, _ = quantized
    loaded = load_artifact(compile_to(model, tmp_path / "m"))
    nodes = loaded.model.graph.node
    counts = Counter(node.op_type for node in nodes)
    assert counts["FusedAttention"] == LAYERS and counts["Softmax"] == 0 and counts["SwiGlu"] == LAYERS
    assert (counts["RmsNorm"], counts["AddRmsNorm"]) == (1, 2 * LAYERS)
    assert not set(counts) & set(INTEGER_OPS + ("MatMulNBits",))
    quantized_matmuls = [attributes(node) for node in nodes if node.op_type == "MatMulInt4"]
    assert len(quantized_matmuls) == 4 * LAYERS + 1  # q/k/v and gate/up merged, o, down; the lm_head
    assert {(a["bits"], a["accuracy_level"]) for a in quantized_matmuls} == {form}
    # the artifact records what it holds, though no flag asked for quantization
    recorded = Counter()
    for kind in loaded.metadata["weights"]["matmuls"]:
        recorded[(kind["format"], kind.get("int8_activations", False))] += kind["count"]
    bits, level = form
    assert recorded == {(f"int{bits}", level == 4): 4 * LAYERS + 1}
    feeds = _feeds(model)
    ours = Executor(loaded, "onnxruntime").run(feeds)["logits"]
    theirs = ort_reference(model, feeds)["logits"]
    if not set(expected) & set(INTEGER_OPS):  # weight-only: the same arithmetic as onnxruntime's
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    else:
        float_logits = ort_reference(source, feeds)["logits"]
        assert np.abs(ours - float_logits).max() <= 1.25 * np.abs(theirs - float_logits).max()
    np.testing.assert_allclose(Executor(loaded, "reference").run(feeds)["logits"], ours, atol=1e-4, rtol=0)


def _contiguous_greedy(om: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens of a contiguous artifact, the whole sequence at every step (an empty past)."""
    loaded = load_artifact(om)
    executor = Executor(loaded, "onnxruntime")
    empty = {name: np.zeros((1, shape[1], 0, shape[3]), np.float32)
             for name, shape in _past_shapes(loaded.model).items()}
    ids, tokens = list(prompt), []
    for _ in range(new_tokens):
        feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64),
                 "position_ids": np.arange(len(ids), dtype=np.int64)[None], **empty}
        tokens.append(int(np.argmax(executor.run(feeds)["logits"][0, -1])))
        ids.append(tokens[-1])
    return tokens


def _past_shapes(model: onnx.ModelProto) -> dict[str, list]:
    return {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
            for i in model.graph.input if i.name.startswith("past_key_values")}


def test_paged_engine_greedy_equals_the_contiguous_artifact(quantized, tmp_path):
    _, model, _, _, _ = quantized
    paged = compile_to(model, tmp_path / "paged", enable_paged_attention=True)
    contiguous = compile_to(model, tmp_path / "contiguous")
    prompts = mixed_prompts(2, seed=7, high=40)
    assert engine_greedy(paged, prompts, NEW_TOKENS) == [_contiguous_greedy(contiguous, p, NEW_TOKENS)
                                                          for p in prompts]


def test_compression_asked_of_a_model_that_came_quantized_warns_that_it_quantized_nothing(tmp_path):
    """MatMulNBitsQuantizer's blocks of 32 are kept whatever the conf says: the artifact records them, and the
    compile says the conf did not apply (W10011)."""
    _, model = _four_bit(tmp_path)
    result = compile_model(CompileConfig(model=str(model), framework=5, output=str(tmp_path / "m"),
                                         soc_version="Ascend910B", enable_compress_weight=True))
    came = 4 * LAYERS + 1
    assert [w.split(":")[0] for w in result.warnings if "W10011" in w] == ["W10011"]
    assert f"the model's {came} linear layers came quantized" in next(w for w in result.warnings if "W10011" in w)
    assert [(kind["format"], kind["block_size"], kind["count"]) for kind in result.metadata["weights"]["matmuls"]] \
        == [("int4", 32, came)]
    assert result.metadata["config"]["quantization"]["group_size"] == 128  # the flags, as given
    float_model = tiny_onnx("llama", dynamo=False, with_past=True)
    quantized_here = compile_model(CompileConfig(model=str(float_model), framework=5, output=str(tmp_path / "f"),
                                                 soc_version="Ascend910B", enable_compress_weight=True))
    assert not [w for w in quantized_here.warnings if "W10011" in w]
