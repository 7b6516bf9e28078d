"""`cann-llm-quant`: a standard QDQ model that plain onnxruntime runs, equal to the dequantized original."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from conftest import compile_to, ort_reference
from onnx import numpy_helper

from cann_llm.cli.quant import cli
from cann_llm.models.data_files import EVAL_TEXT
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.feeds import causal_lm_inputs


def _quantize(source, out, *flags):
    return CliRunner().invoke(cli, ["--model", str(source), "--output", str(out), *flags])


def _feeds(loaded, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, loaded.metadata["model"]["vocab_size"], (2, 5), dtype=np.int64)
    return causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"], ids, 3, rng)


@pytest.mark.parametrize("dynamo", [False, True], ids=["ts", "dynamo"])
@pytest.mark.parametrize("flags", [("--bits", "4", "--group-size", "32"), ("--bits", "4", "--group-size", "64", "--asymmetric"),
                                   ("--bits", "8"), ("--bits", "4", "--group-size", "32", "--quantize-lm-head")],
                         ids=["int4-g32", "uint4-g64", "int8", "int4-g32-head8"])
def test_qdq_model_equals_the_original_with_dequantized_weights(tmp_path, dynamo, flags):
    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx("llama", dynamo=dynamo, with_past=True)
    result = _quantize(source, tmp_path / "q", *flags)
    assert result.exit_code == 0, result.output
    head = "--quantize-lm-head" in flags  # then lm_head too, as blocked 8-bit
    report = json.loads((tmp_path / "q" / "quant_report.json").read_text())
    assert len(report["quantized"]) == 14 + head and len(report["skipped"]) == 1 - head  # 2 layers × 7 projections
    qdq = onnx.load(str(tmp_path / "q" / "model.onnx"))
    assert sum(n.op_type == "DequantizeLinear" for n in qdq.graph.node) == 14 + head
    assert {o.version for o in qdq.opset_import if o.domain in ("", "ai.onnx")} == {21}

    # the reference: the original model whose weights are replaced by what the QDQ nodes compute
    dequantized = {n.output[0]: n for n in qdq.graph.node if n.op_type == "DequantizeLinear"}
    init = {t.name: t for t in qdq.graph.initializer}
    original = onnx.load(str(source))
    from onnx.reference import ReferenceEvaluator

    replaced = 0
    for tensor in original.graph.initializer:
        node = dequantized.get(f"{tensor.name}_dequantized")
        if node is not None:
            inputs = [numpy_helper.to_array(init[name]) for name in node.input]
            value = ReferenceEvaluator(onnx.helper.make_model(onnx.helper.make_graph(
                [node], "dq", [], [onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)],
                [init[name] for name in node.input]), opset_imports=[onnx.helper.make_opsetid("", 21)])).run(None, {})[0]
            assert value.shape == tuple(tensor.dims) and len(inputs) >= 2
            tensor.CopyFrom(numpy_helper.from_array(value.astype(np.float32), tensor.name))
            replaced += 1
    assert replaced == 14 + head
    reference_path = tmp_path / "dequantized.onnx"
    onnx.save(original, str(reference_path))

    loaded = load_artifact(compile_to(tmp_path / "q" / "model.onnx", tmp_path / "qdq"))
    feeds = _feeds(loaded)
    expected = ort_reference(reference_path, feeds)
    got = ort_reference(tmp_path / "q" / "model.onnx", feeds)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], atol=1e-5, rtol=0, err_msg=name)
    # atc merges the QDQ projections (qkv, gate_up) and repacks their integers into MatMulInt4/MatMulInt8
    # (float activations): both backends reproduce the dequantized original; an 8-bit lm_head runs with
    # int8 activations, so the logits then differ by that rounding alone
    ops = [n.op_type for n in loaded.model.graph.node]
    assert ops.count("MatMulInt4" if "4" in flags[1] else "MatMulInt8") == 2 * 4 + head and "DequantizeLinear" not in ops
    for got in (Executor(loaded, "reference").run(feeds), Executor(loaded).run(feeds)):
        for name in expected:
            if head and name == "logits":
                error = np.linalg.norm(got[name] - expected[name]) / np.linalg.norm(expected[name])
                assert error < 1e-2, error
            else:
                np.testing.assert_allclose(got[name], expected[name], atol=1e-5, rtol=0, err_msg=name)


def _run_quant(model, out, *flags):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "cann_llm.cli.quant", "--model", str(model), "--output", str(out), *flags],
                          capture_output=True, text=True)


@pytest.mark.parametrize("flags, code, parameter", [
    (("--bits", "3"), "E10001", "--bits"), (("--group-size", "100"), "E10001", "--group-size"),
    (("--quant-method", "fp3"), "E10001", "--quant-method"), (("--quant-method", "smooth_quant"), "E10055", None),
    (("--skip", "no_such_layer*"), "E10001", "--skip"), (("--quant-method", "gptq", "--bits", "8"), "E10001", "--quant-method"),
    (("--quant-method", "awq", "--seq-len", "100000", "--num-samples", "2"), "E10001", "--seq-len"),
    (("--quant-method", "gptq", "--num-samples", "0"), "E10001", "--num-samples"),
    (("--quant-method", "gptq", "--num-samples", "1000", "--seq-len", "2048"), "E10001", "--num-samples"),
])
def test_bad_settings_are_refused_in_the_flags_names_creating_nothing(tmp_path, tiny_llama_path, flags, code, parameter):
    proc = _run_quant(tiny_llama_path, tmp_path / "out" / "q", *flags)
    assert proc.returncode == 1 and f"{code}: [PID:" in proc.stderr and "Traceback" not in proc.stderr
    if parameter:
        assert f"for parameter {parameter} is invalid" in proc.stderr, proc.stderr
    assert "parameter --compress_weight_conf" not in proc.stderr and "--tokenizer" not in proc.stderr
    assert not (tmp_path / "out").exists()  # not even the folder


def test_a_missing_model_creates_no_output_folder(tmp_path):
    proc = _run_quant(tmp_path / "nope.onnx", tmp_path / "qb" / "x")
    assert proc.returncode == 1 and "E13001: [PID:" in proc.stderr and "nope.onnx" in proc.stderr
    assert not (tmp_path / "qb").exists()


def test_an_output_under_a_file_is_refused_before_any_work(tmp_path, tiny_llama_path):
    (tmp_path / "file").write_text("")
    proc = _run_quant(tiny_llama_path, tmp_path / "file" / "q")
    assert proc.returncode == 1 and "E13004: [PID:" in proc.stderr and "is not a directory" in proc.stderr
    assert "load: " not in proc.stderr  # refused before the model was read


def test_a_calibrating_method_without_a_tokenizer_names_cann_llm_quants_own_flags(tmp_path, tiny_llama_path):
    import shutil

    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(tiny_llama_path, alone / "model.onnx")  # no tokenizer.json beside it
    proc = _run_quant(alone / "model.onnx", tmp_path / "q", "--quant-method", "awq")
    assert proc.returncode == 1 and "E10001: [PID:" in proc.stderr
    assert "Value awq for parameter --quant-method is invalid" in proc.stderr
    assert "tokenizer.json beside the model" in proc.stderr and "--tokenizer" not in proc.stderr
    assert "--compress_weight_conf" not in proc.stderr and not (tmp_path / "q").exists()


@pytest.fixture()
def binary_text(tmp_path):
    path = tmp_path / "binary.bin"
    path.write_bytes(bytes(range(128, 256)) * 8)  # no UTF-8 text starts with a continuation byte
    return path


@pytest.mark.parametrize("algorithms", [[{"name": "awq"}], [{"name": "rtn"}]], ids=["awq", "rtn"])
def test_calibration_text_that_is_not_utf8_is_refused_by_atc_without_output(tmp_path, tiny_llama_path, binary_text,
                                                                           algorithms):
    from cann_llm.runtime.errors import AtcError

    config = tmp_path / "quant.json"  # RTN reads the text too: its accuracy level is chosen on it
    config.write_text(json.dumps({"algorithms": algorithms, "calibration": {"text_file": str(binary_text)}}))
    with pytest.raises(AtcError) as caught:
        compile_to(tiny_llama_path, tmp_path / "m", enable_compress_weight=True, compress_weight_conf=str(config))
    assert caught.value.code == "E13001" and "the file is not UTF-8 text" in caught.value.message
    assert str(binary_text) in caught.value.message and sorted(p.name for p in tmp_path.iterdir()) == [
        "binary.bin", "quant.json"]


def test_calibration_text_that_is_not_utf8_is_refused_by_cann_llm_quant_without_output(tmp_path, tiny_llama_path,
                                                                                      binary_text):
    proc = _run_quant(tiny_llama_path, tmp_path / "q", "--quant-method", "gptq", "--calibration-text", str(binary_text))
    assert proc.returncode == 1 and "E13001: [PID:" in proc.stderr and "the file is not UTF-8 text" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "q").exists()


@pytest.fixture()
def llama_with_config(tmp_path, tiny_llama_path):
    """The tiny Llama beside its tokenizer and a Hugging Face config.json declaring 128 positions."""
    import shutil

    folder = tmp_path / "llama"
    folder.mkdir()
    for name in ("model.onnx", "tokenizer.json"):
        shutil.copy(tiny_llama_path.parent / name, folder / name)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 128}))
    return folder / "model.onnx"


def test_a_window_longer_than_the_config_declares_is_refused_and_the_default_fits(tmp_path, llama_with_config):
    from cann_llm.compiler.config import CompileConfig
    from cann_llm.compiler.pipeline import calibration_samples
    from cann_llm.runtime.errors import AtcError

    config = tmp_path / "quant.json"
    config.write_text(json.dumps({"algorithms": [{"name": "awq"}], "group_size": 32,
                                  "calibration": {"num_samples": 2, "seq_len": 256}}))
    with pytest.raises(AtcError) as caught:
        compile_to(llama_with_config, tmp_path / "m", enable_compress_weight=True, compress_weight_conf=str(config))
    assert caught.value.code == "E10001" and "--compress_weight_conf calibration.seq_len" in caught.value.message
    assert f"at most 128 positions (max_position_embeddings in {llama_with_config.parent / 'config.json'})" \
           in caught.value.message
    proc = _run_quant(llama_with_config, tmp_path / "q", "--quant-method", "gptq", "--seq-len", "256")
    assert "Value 256 for parameter --seq-len is invalid" in proc.stderr and not (tmp_path / "q").exists()
    config.write_text(json.dumps({"algorithms": [{"name": "awq"}], "group_size": 32, "calibration": {"num_samples": 2}}))
    cfg = CompileConfig(model=str(llama_with_config), framework=5, output=str(tmp_path / "m"), soc_version="Ascend910B",
                        enable_compress_weight=True, compress_weight_conf=str(config))
    assert [len(sample) for sample in calibration_samples(cfg)] == [128, 128]  # not the default 512


def test_a_window_longer_than_the_position_table_is_refused_before_calibration(tmp_path):
    from cann_llm.models.tiny import tiny_onnx
    from cann_llm.runtime.errors import AtcError

    source = tiny_onnx("gpt2", dynamo=True, with_past=True)  # GPT-2's learned positions: a table of 256 rows
    config = tmp_path / "quant.json"
    config.write_text(json.dumps({"algorithms": [{"name": "awq"}], "group_size": 32,
                                  "calibration": {"num_samples": 2, "seq_len": 512}}))
    with pytest.raises(AtcError) as caught:
        compile_to(source, tmp_path / "m", enable_compress_weight=True, compress_weight_conf=str(config))
    assert caught.value.code == "E10001" and "--compress_weight_conf calibration.seq_len" in caught.value.message
    assert "at most 256 positions (the rows of its position table)" in caught.value.message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quant.json"]  # no artifact, no spilled weights


CALIBRATION = {"num_samples": 4, "seq_len": 64}


@pytest.mark.parametrize("flags, conf", [
    (("--bits", "4", "--group-size", "32"), {"quant_mode": "INT4", "group_size": 32}),
    (("--bits", "4", "--group-size", "64", "--asymmetric"), {"quant_mode": "INT4", "group_size": 64, "symmetric": False}),
    (("--bits", "8"), {"quant_mode": "INT8"}),
    (("--bits", "4", "--group-size", "32", "--quant-method", "gptq", "--num-samples", "4", "--seq-len", "64"),
     {"quant_mode": "INT4", "group_size": 32, "algorithms": [{"name": "gptq"}], "calibration": CALIBRATION}),
    (("--bits", "4", "--group-size", "32", "--quant-method", "awq", "--num-samples", "4", "--seq-len", "64"),
     {"quant_mode": "INT4", "group_size": 32, "algorithms": [{"name": "awq"}], "calibration": CALIBRATION}),
    (("--bits", "4", "--group-size", "32", "--quant-method", "awq+gptq", "--num-samples", "4", "--seq-len", "64"),
     {"quant_mode": "INT4", "group_size": 32, "algorithms": [{"name": "awq"}, {"name": "gptq"}], "calibration": CALIBRATION}),
    (("--bits", "4", "--group-size", "32", "--quantize-lm-head"),
     {"quant_mode": "INT4", "group_size": 32, "skip_layers": []}),
    (("--bits", "4", "--group-size", "32", "--quantize-lm-head", "--lm-head-bits", "4", "--lm-head-group-size", "64"),
     {"quant_mode": "INT4", "group_size": 32, "skip_layers": [], "lm_head_bits": 4, "lm_head_group_size": 64}),
], ids=["int4-g32", "uint4-g64", "int8", "gptq-g32", "awq-g32", "awq-gptq-g32", "int4-g32-head8", "int4-g32-head4-g64"])
def test_qdq_route_and_direct_compression_give_the_same_packed_bytes(tmp_path, tiny_llama_path, flags, conf):
    result = _quantize(tiny_llama_path, tmp_path / "q", *flags)
    assert result.exit_code == 0, result.output
    config = tmp_path / "quant.json"
    config.write_text(json.dumps({"algorithms": [{"name": "rtn"}], "skip_layers": ["lm_head"], **conf}))
    via_qdq = load_artifact(compile_to(tmp_path / "q" / "model.onnx", tmp_path / "via_qdq"))
    direct = load_artifact(compile_to(tiny_llama_path, tmp_path / "direct", enable_compress_weight=True,
                                      compress_weight_conf=str(config)))

    def packed(loaded):
        nodes = [n for n in loaded.model.graph.node if n.op_type.startswith("MatMulInt")]
        return [[loaded.weights[name] for name in n.input[1:] if name in loaded.weights] for n in nodes]

    first, second = packed(via_qdq), packed(direct)
    assert len(first) == len(second) == 2 * 4 + (conf.get("skip_layers") == [])  # the lm_head too
    for a, b in zip(first, second):
        assert len(a) == len(b) and all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b))


@pytest.mark.parametrize("family, dynamo, quantized", [("gpt2", False, 8), ("gpt2", True, 8), ("qwen2_moe", False, 8),
                                                       ("qwen2_moe", True, 8)])
def test_both_routes_quantize_gemms_and_keep_routers_float_alike(tmp_path, family, dynamo, quantized):
    """GPT-2's Conv1D layers are Gemms in both exporters' graphs, and so are the dynamo exporter's Qwen2-MoE
    shared experts and routers; a TorchScript router reaches its TopK through a Softmax and a Cast: the QDQ
    route quantizes what atc does (GPT-2's c_attn, attn.c_proj, c_fc and mlp.c_proj of each layer; Qwen2-MoE's
    q/k/v, o and shared gate/up and down) and keeps the routers float as atc does."""
    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx(family, dynamo=dynamo, with_past=family != "gpt2")
    result = _quantize(source, tmp_path / "q", "--bits", "4", "--group-size", "32")
    assert result.exit_code == 0, result.output
    config = tmp_path / "quant.json"
    config.write_text(json.dumps({"quant_mode": "INT4", "group_size": 32, "algorithms": [{"name": "rtn"}],
                                  "skip_layers": ["lm_head"]}))
    via_qdq = load_artifact(compile_to(tmp_path / "q" / "model.onnx", tmp_path / "via_qdq"))
    direct = load_artifact(compile_to(source, tmp_path / "direct", enable_compress_weight=True,
                                      compress_weight_conf=str(config)))
    first, second = ([[loaded.weights[name] for name in n.input[1:] if name in loaded.weights]
                      for n in loaded.model.graph.node if n.op_type == "MatMulInt4"] for loaded in (via_qdq, direct))
    assert len(first) == len(second) == quantized
    for a, b in zip(first, second):
        assert len(a) == len(b) and all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b))


def test_gptq_and_awq_then_gptq_outputs_are_closer_to_the_float_model_than_rtn(tmp_path, tiny_llama_path):
    from cann_llm.models.tiny import byte_tokenizer_json
    from cann_llm.runtime.tokenizer import TextTokenizer

    text = EVAL_TEXT.read_text()[:2000]
    ids = np.asarray([TextTokenizer({"tokenizer.json": byte_tokenizer_json()}).encode(text)[:256]], np.int64)
    reference = load_artifact(compile_to(tiny_llama_path, tmp_path / "fp32"))
    feeds = causal_lm_inputs(reference.metadata["signature"], reference.metadata["model"], ids)
    expected = Executor(reference).run(feeds, ["logits"])["logits"]
    errors = {}
    for methods in (["rtn"], ["gptq"], ["awq", "gptq"]):
        name = "+".join(methods)
        config = tmp_path / f"{name}.json"
        config.write_text(json.dumps({"quant_mode": "INT4", "group_size": 32, "algorithms": [{"name": m} for m in methods],
                                      "calibration": {"num_samples": 8, "seq_len": 128}}))
        loaded = load_artifact(compile_to(tiny_llama_path, tmp_path / name, enable_compress_weight=True,
                                          compress_weight_conf=str(config)))
        assert loaded.metadata["config"]["quantization"]["method"] == name
        errors[name] = float(np.mean((Executor(loaded).run(feeds, ["logits"])["logits"] - expected) ** 2))
    assert errors["gptq"] < 0.8 * errors["rtn"] and errors["awq+gptq"] < 0.8 * errors["rtn"], errors


@pytest.mark.parametrize("dynamo", [False, True], ids=["ts", "dynamo"])
@pytest.mark.parametrize("head_bits", [4, 8])
def test_a_tied_lm_head_and_its_embedding_share_one_quantized_table_when_asked(tmp_path, dynamo, head_bits):
    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx("llama_tied", dynamo=dynamo, with_past=True)
    config = tmp_path / "quant.json"
    sizes, artifacts = {}, {}
    for skip in ("lm_head", None):
        config.write_text(json.dumps({"quant_mode": "INT4", "group_size": 32, "skip_layers": [skip] if skip else [],
                                      "accuracy_level": "0", "lm_head_bits": head_bits, "lm_head_group_size": 64}))
        path = compile_to(source, tmp_path / f"skip-{skip}", enable_compress_weight=True, compress_weight_conf=str(config))
        artifacts[skip], sizes[skip] = load_artifact(path), path.stat().st_size
    kept, quantized = artifacts["lm_head"], artifacts[None]
    assert [n.op_type for n in kept.model.graph.node].count("GatherInt4") == 0
    nodes = {n.op_type: n for n in quantized.model.graph.node if n.op_type in ("GatherInt4",)}
    heads = [n for n in quantized.model.graph.node if n.op_type == "MatMulInt4" and n.output[0] == "logits"]
    assert len(heads) == 1 and nodes["GatherInt4"].input[0] == heads[0].input[1]  # one table, two readers
    assert {a.name: a.i for a in heads[0].attribute}["bits"] == head_bits
    assert {a.name: a.i for a in nodes["GatherInt4"].attribute}["bits"] == head_bits
    # a 4-bit table in the head's own blocks, its activations in int8 (the native kernel's) as an 8-bit one's
    head_attributes = {a.name: a.i for a in heads[0].attribute}
    assert (head_attributes["block_size"], head_attributes["accuracy_level"]) == (64, 4)
    table_bytes = 256 * 64  # vocab × hidden of the tiny model, float32 when kept
    assert sizes["lm_head"] - sizes[None] > table_bytes * (4 - head_bits / 8 - 0.5)  # one narrow copy replaced it
    feeds = _feeds(quantized)
    fast, reference = Executor(quantized).run(feeds), Executor(quantized, "reference").run(feeds)
    for name in fast:  # the 8-bit head rounds its activations to int8 (level 4), in both backends alike
        np.testing.assert_allclose(fast[name], reference[name], atol=1e-5, rtol=0, err_msg=name)


def test_accuracy_level_is_chosen_per_layer_by_measured_error(tmp_path, tiny_llama_path):
    from cann_llm.passes.quant.accuracy_level import ACCURACY_THRESHOLD

    levels = {}
    for setting in ("0", "auto"):
        config = tmp_path / f"{setting}.json"
        config.write_text(json.dumps({"quant_mode": "INT4", "group_size": 32, "accuracy_level": setting,
                                      "calibration": {"num_samples": 4, "seq_len": 64}}))
        loaded = load_artifact(compile_to(tiny_llama_path, tmp_path / setting, enable_compress_weight=True,
                                          compress_weight_conf=str(config)))
        nodes = [n for n in loaded.model.graph.node if n.op_type == "MatMulInt4"]
        levels[setting] = [next(a.i for a in n.attribute if a.name == "accuracy_level") for n in nodes]
        if setting == "0":
            exact = Executor(loaded).run(_feeds(loaded), ["logits"])["logits"]
        else:
            approximate = Executor(loaded).run(_feeds(loaded), ["logits"])["logits"]
    assert set(levels["0"]) == {0} and len(levels["auto"]) == 8
    assert 4 in levels["auto"]  # random tiny weights and byte-level text: ordinary activations
    relative = np.linalg.norm(approximate - exact) / np.linalg.norm(exact)
    assert relative < 4 * ACCURACY_THRESHOLD


def test_w8a8_smooth_quant_runs_integer_matmuls_close_to_the_float_model(tmp_path, tiny_llama_path):
    config = tmp_path / "w8a8.json"
    config.write_text(json.dumps({"quant_mode": "W8A8", "algorithms": [{"name": "smooth_quant", "params": {"alpha": 0.5}}],
                                  "calibration": {"num_samples": 4, "seq_len": 64}}))
    loaded = load_artifact(compile_to(tiny_llama_path, tmp_path / "w8a8", enable_compress_weight=True,
                                      compress_weight_conf=str(config)))
    ops = [n for n in loaded.model.graph.node if n.op_type.startswith("MatMul")]
    # onnxruntime's int8 kernels: 8-bit MatMulNBits with int8 activations (accuracy_level 4)
    assert [n.op_type for n in ops].count("MatMulInt4") == 2 * 4 and len(ops) == 2 * 4 + 1  # and the float lm_head
    assert all({a.name: a.i for a in n.attribute}.get("bits") == 8 and
               {a.name: a.i for a in n.attribute}["accuracy_level"] == 4 for n in ops if n.op_type == "MatMulInt4")
    assert loaded.metadata["config"]["quantization"]["accuracy_level"] == "4"  # what they run at, not "auto"
    feeds = _feeds(loaded)
    fast = Executor(loaded).run(feeds, ["logits"])["logits"]
    reference = Executor(loaded, "reference").run(feeds, ["logits"])["logits"]  # rounds activations the same way
    np.testing.assert_allclose(fast, reference, atol=1e-4, rtol=0)
    exact = Executor(load_artifact(compile_to(tiny_llama_path, tmp_path / "fp32"))).run(feeds, ["logits"])["logits"]
    assert np.linalg.norm(fast - exact) / np.linalg.norm(exact) < 0.05


@pytest.mark.parametrize("conf", [{"quant_mode": "W8A8", "algorithms": [{"name": "gptq"}]},
                                  {"quant_mode": "W8A8", "algorithms": [{"name": "smooth_quant", "params": {"alpha": 2}}]},
                                  {"quant_mode": "INT8", "algorithms": [{"name": "smooth_quant"}]},
                                  {"quant_mode": "INT4", "skip_layers": ["lm_head", "no_such_layer*"]},
                                  {"quant_mode": "INT4", "group_size": 100}, {"quant_mode": "INT3"},
                                  {"quant_mode": "INT4", "algorithms": [{"name": "fp3"}]},
                                  {"quant_mode": "INT4", "algorithms": [{"name": "gptq"}, {"name": "awq"}]},
                                  {"quant_mode": "INT4", "skip_layers": [], "lm_head_bits": 2},
                                  {"quant_mode": "INT4", "skip_layers": [], "lm_head_bits": 4, "lm_head_group_size": 48},
                                  {"quant_mode": "INT4", "lm_head_group_size": True},
                                  {"quant_mode": "INT4", "zero_points": "float"},  # symmetric by default
                                  {"quant_mode": "INT8", "symmetric": False, "zero_points": "float"},
                                  {"quant_mode": "INT4", "symmetric": False, "zero_points": "fp8"},
                                  {"quant_mode": "INT4", "algorithms": []}, {"quant_mode": "INT4", "symmetric": "false"},
                                  {"quant_mode": "W8A8", "accuracy_level": 0},
                                  {"algorithms": [{"name": "gptq", "params": {"damp": -1}}]},
                                  {"algorithms": [{"name": "awq"}], "calibration": {"seq_len": 20000, "num_samples": 2}},
                                  {"calibration": {"num_sample": 4}}])
def test_bad_compression_configs_are_refused_without_output(tmp_path, tiny_llama_path, conf):
    from cann_llm.runtime.errors import AtcError

    config = tmp_path / "bad.json"
    config.write_text(json.dumps(conf))
    with pytest.raises(AtcError) as caught:
        compile_to(tiny_llama_path, tmp_path / "m", enable_compress_weight=True, compress_weight_conf=str(config))
    assert caught.value.code == "E10001" and not (tmp_path / "m.om").exists()


@pytest.mark.parametrize("head_bits, head_group, block", [(4, None, 32), (4, 64, 64), (8, None, 64)])
def test_an_untied_lm_head_is_quantized_to_lm_head_bits_when_not_skipped(tmp_path, tiny_llama_path, head_bits,
                                                                          head_group, block):
    config = tmp_path / "quant.json"
    config.write_text(json.dumps({"quant_mode": "INT4", "group_size": 32, "skip_layers": [], "accuracy_level": "0",
                                  "lm_head_bits": head_bits, "lm_head_group_size": head_group}))
    loaded = load_artifact(compile_to(tiny_llama_path, tmp_path / "m", enable_compress_weight=True,
                                      compress_weight_conf=str(config)))
    (head,) = [n for n in loaded.model.graph.node if n.output[0] == "logits"]
    attributes = {a.name: a.i for a in head.attribute}
    assert head.op_type == "MatMulInt4" and attributes["bits"] == head_bits
    assert attributes["block_size"] == block  # a 4-bit head's own group size, else the layers'; 8 bits: 64 | hidden
    assert attributes["accuracy_level"] == (0 if head_bits == 4 else 4)
    feeds = _feeds(loaded)
    fast = Executor(loaded).run(feeds, ["logits"])["logits"]
    reference = Executor(loaded, "reference").run(feeds, ["logits"])["logits"]
    np.testing.assert_allclose(fast, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", [["rtn"], ["awq", "gptq"]], ids=["rtn", "awq-gptq"])
def test_float_zero_points_are_closer_to_the_float_model_than_integer_ones(tmp_path, tiny_llama_path, method):
    # a block's range is [min, max] and its zero point is not rounded: never a coarser grid
    loaded, errors = {}, {}
    exact_artifact = load_artifact(compile_to(tiny_llama_path, tmp_path / "fp32"))
    feeds = _feeds(exact_artifact)
    exact = Executor(exact_artifact).run(feeds, ["logits"])["logits"]
    for zero_points in ("integer", "float"):
        config = tmp_path / f"{zero_points}.json"
        config.write_text(json.dumps({"quant_mode": "INT4", "group_size": 32, "symmetric": False,
                                      "zero_points": zero_points, "accuracy_level": "0",
                                      "algorithms": [{"name": m} for m in method],
                                      "calibration": {"num_samples": 4, "seq_len": 64}}))
        loaded[zero_points] = load_artifact(compile_to(tiny_llama_path, tmp_path / zero_points,
                                                       enable_compress_weight=True, compress_weight_conf=str(config)))
        fast = Executor(loaded[zero_points]).run(feeds, ["logits"])["logits"]
        errors[zero_points] = float(np.mean((fast - exact) ** 2))
    nodes = [n.op_type for n in loaded["float"].model.graph.node]
    # each projection: MatMulInt4 with integer zero points, plus its offset term (block sums · offsets, Add)
    assert nodes.count("MatMulInt4") == 2 * 4 and nodes.count("Transpose") == 2 * 4
    assert all(len(n.input) == 4 for n in loaded["float"].model.graph.node if n.op_type == "MatMulInt4")
    reference = Executor(loaded["float"], "reference").run(feeds, ["logits"])["logits"]
    fast = Executor(loaded["float"]).run(feeds, ["logits"])["logits"]
    np.testing.assert_allclose(fast, reference, atol=1e-4, rtol=0)
    # random tiny weights: nearly every block holds 0 already, so only the zero point's rounding is saved
    assert errors["float"] < errors["integer"], errors


def test_a_float_zero_point_artifact_generates_alike_paged_and_contiguous(tmp_path, tiny_llama_path):
    # the offset terms sit between the projections and the paged attention; the engine must not care
    from generation_utils import mixed_prompts

    from cann_llm import LLMEngine

    config = tmp_path / "float.json"
    config.write_text(json.dumps({"quant_mode": "INT4", "group_size": 32, "symmetric": False, "zero_points": "float",
                                  "accuracy_level": "0"}))
    prompts, outputs = mixed_prompts(6), {}
    for paged in (False, True):
        om = compile_to(tiny_llama_path, tmp_path / f"paged-{paged}", enable_paged_attention=paged,
                        enable_compress_weight=True, compress_weight_conf=str(config))
        with LLMEngine(om, max_batch_size=6, max_context_len=256, kv_cache_pages=32) as engine:
            requests = [engine.submit(p, max_new_tokens=24, temperature=0, ignore_eos=True) for p in prompts]
            for request in requests:
                request.result()
            outputs[paged] = [request.output_ids for request in requests]
            assert engine.paged == paged
    assert outputs[True] == outputs[False] and all(len(ids) == 24 for ids in outputs[True])


def test_cann_llm_quant_shows_each_stage_on_stderr_unless_only_errors_are_asked_for(tmp_path, tiny_llama_path):
    flags = ("--quant-method", "awq", "--group-size", "32", "--num-samples", "4", "--seq-len", "64")
    quiet = _quantize(tiny_llama_path, tmp_path / "quiet", *flags, "--log-level", "error")
    assert quiet.exit_code == 0 and quiet.stderr == ""
    result = _quantize(tiny_llama_path, tmp_path / "q", *flags)  # the default level, warning, as it was
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [f"[INFO] quantized 14 MatMul weights (awq, 4-bit), skipped 1; "
                                          f"wrote {tmp_path / 'q' / 'model.onnx'}"]
    lines = result.stderr.splitlines()
    stages = ["load: model.onnx, ", "fusions: ", "calibration (4 samples, staged): started",
              "quantization: started, 14 weights", "quantization: 14 weights in ",
              "calibration (4 samples, staged): 8 stages in ",
              f"save: {tmp_path / 'q' / 'model.onnx'}, "]
    found = [next((i for i, line in enumerate(lines) if line.startswith(stage)), None) for stage in stages]
    assert None not in found and found == sorted(found), lines
