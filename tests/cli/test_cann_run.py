"""`cann-run` as msame/ais_bench users drive it: inputs from files or made up, outputs, summaries, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import compile_to, ort_reference

from cann_llm.cli.cann_run import cli
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.feeds import causal_lm_inputs


@pytest.fixture(scope="module")
def om_path(tmp_path_factory, tiny_llama_path):
    return compile_to(tiny_llama_path, tmp_path_factory.mktemp("om") / "llama")


@pytest.fixture(scope="module")
def paged_om_path(tmp_path_factory, tiny_llama_path):
    return compile_to(tiny_llama_path, tmp_path_factory.mktemp("om") / "paged", enable_paged_attention=True)


def _invoke(*argv: str):
    return CliRunner().invoke(cli, list(argv), catch_exceptions=False)


def test_made_up_inputs_run_and_report_a_performance_summary(om_path, tmp_path):
    result = _invoke("--model", str(om_path), "--loop", "3", "--output", str(tmp_path), "--output_dirname", "r",
                     "--outfmt", "NPY", "--dymShape", "input_ids:2,5;past_key_values.0.key:2,2,3,16")
    assert result.exit_code == 0, result.output
    assert "[INFO] -----------------Performance Summary------------------" in result.output
    assert "NPU_compute_time (ms): min = " in result.output and "percentile(99%) = " in result.output
    summary = json.loads((tmp_path / "r_summary.json").read_text())
    assert summary["loop"] == 3 and set(summary["NPU_compute_time"]) == {"min", "max", "mean", "median", "percentile(99%)"}
    assert summary["outputs"]["logits"] == [2, 5, 256] and summary["outputs"]["present.0.key"] == [2, 2, 8, 16]
    logits = np.load(tmp_path / "r" / "pure_infer_data_0.npy")
    loaded = load_artifact(om_path)
    ids = np.zeros((2, 5), np.int64)
    expected = Executor(loaded).run(causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"], ids, 3))
    np.testing.assert_array_equal(logits, expected["logits"])


@pytest.mark.parametrize("backend", ["onnxruntime", "reference"])
def test_input_files_give_onnxruntimes_outputs(om_path, tmp_path, tiny_llama_path, backend):
    loaded = load_artifact(om_path)
    rng = np.random.default_rng(4)
    feeds = causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"],
                             rng.integers(0, 256, (1, 4), dtype=np.int64), 2, rng)
    files = []
    for index, (name, array) in enumerate(feeds.items()):
        path = tmp_path / (f"{index}.npy" if index % 2 else f"{index}.bin")
        np.save(path, array) if index % 2 else array.tofile(path)
        files.append(str(path))
    shapes = ";".join(f"{n}:{','.join(map(str, a.shape))}" for n, a in feeds.items())
    result = _invoke("--model", str(om_path), "--input", ",".join(files), "--dymShape", shapes, "--backend", backend,
                     "--output", str(tmp_path / "out"), "--output_dirname", "r", "--outfmt", "BIN")
    assert result.exit_code == 0, result.output
    expected = ort_reference(tiny_llama_path, feeds)
    for index, (name, array) in enumerate(expected.items()):
        got = np.fromfile(tmp_path / "out" / "r" / f"0_{index}.bin", dtype=array.dtype).reshape(array.shape)
        np.testing.assert_allclose(got, array, atol=1e-5, rtol=0, err_msg=name)


def test_wrong_input_count_and_missing_tokenizer_are_clear_errors(om_path, tmp_path, tiny_llama_path):
    import shutil

    np.save(tmp_path / "a.npy", np.zeros((1, 2), np.int64))
    (tmp_path / "bare").mkdir()
    shutil.copyfile(tiny_llama_path, tmp_path / "bare" / "model.onnx")  # no tokenizer beside this copy
    bare = compile_to(tmp_path / "bare" / "model.onnx", tmp_path / "bare" / "m")
    proc = subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "--model", str(om_path), "--input",
                           str(tmp_path / "a.npy")], capture_output=True, text=True)
    assert proc.returncode == 1 and "E10001" in proc.stderr and "the model has 7 inputs" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "--model", str(bare), "--prompt", "hi"],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "compiled without a tokenizer" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "generate", "--model", str(bare), "--prompt", "hi"],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "for parameter --model is invalid" in proc.stderr, proc.stderr
    # the bench's prompts are text too
    proc = subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "bench", "--model", str(bare), "--requests", "1",
                           "--long_prefill", "", "--json", str(tmp_path / "bench.json")], capture_output=True, text=True)
    assert proc.returncode == 1 and "E10001" in proc.stderr and "for parameter --model is invalid" in proc.stderr
    assert "compiled without a tokenizer" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_paged_artifact_runs_msame_style_with_one_sequence_per_input_row(paged_om_path, om_path, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "--model", str(paged_om_path), "--loop", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "NPU_compute_time (ms): min = " in proc.stdout and "Traceback" not in proc.stderr
    result = _invoke("--model", str(paged_om_path), "--dymShape", "input_ids:2,5", "--output", str(tmp_path),
                     "--output_dirname", "r", "--outfmt", "NPY", "--pure_data_type", "random")
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "r_summary.json").read_text())
    assert summary["outputs"] == {"logits": [2, 256]}
    # the same tokens through the contiguous artifact: each sequence's last position
    ids = np.random.default_rng(0).integers(0, 256, (2, 5), dtype=np.int64)
    loaded = load_artifact(om_path)
    expected = Executor(loaded).run(causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"], ids))
    np.testing.assert_allclose(np.load(tmp_path / "r" / "pure_infer_data_0.npy"), expected["logits"][:, -1],
                               atol=1e-4, rtol=0)


def test_a_paged_artifact_ranks_a_prompts_next_tokens_as_the_contiguous_one(paged_om_path, om_path):
    paged = _invoke("--model", str(paged_om_path), "--prompt", "hello there", "--topk", "3")
    contiguous = _invoke("--model", str(om_path), "--prompt", "hello there", "--topk", "3")
    assert paged.exit_code == 0, paged.output
    ranks = [line.split("id=")[1].split()[0] for line in paged.output.splitlines() if "id=" in line]
    assert len(ranks) == 3
    assert ranks == [line.split("id=")[1].split()[0] for line in contiguous.output.splitlines() if "id=" in line]


def test_paged_input_files_addressing_no_page_are_a_coded_error(paged_om_path, tmp_path):
    loaded = load_artifact(paged_om_path)
    feeds = causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"], np.zeros((1, 4), np.int64),
                             page_size=loaded.kv_cache["page_size"])
    feeds["slot_mapping"] = np.array([0, 1, -7, 3], np.int64)
    files = []
    for name, array in feeds.items():
        np.save(tmp_path / f"{name}.npy", array)
        files.append(str(tmp_path / f"{name}.npy"))
    proc = subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "--model", str(paged_om_path), "--input",
                           ",".join(files)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "E10001" in proc.stderr and "a slot is outside" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_damaged_om_is_refused(om_path, tmp_path, damage):
    data = bytearray(om_path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x55
    broken = tmp_path / "broken.om"
    broken.write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "--model", str(broken)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "E13015" in proc.stderr and ("truncated" in proc.stderr or "corrupted" in proc.stderr)
    assert "Traceback" not in proc.stderr


def _eval_ppl(om, text, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "eval-ppl", "--model", str(om), "--text", str(text),
                           "--window", "64", "--stride", "32", *argv], capture_output=True, text=True, timeout=300)


def test_eval_ppl_shows_loading_and_window_progress_on_stderr_and_json_on_stdout(om_path, tmp_path):
    from cann_llm.runtime.perplexity import perplexity
    from cann_llm.runtime.tokenizer import TextTokenizer

    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a tiny model that counted bytes. " * 4)
    proc = _eval_ppl(om_path, text, "--json", "-")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # stdout is the JSON alone
    loaded = load_artifact(om_path)
    ids = TextTokenizer(loaded.om.tokenizer_files()).encode(text.read_text())
    expected = perplexity(Executor(loaded), ids, 64, 32)
    assert abs(report["perplexity"] - expected.perplexity) < 1e-6 * expected.perplexity
    lines = proc.stderr.splitlines()
    assert lines[0] == f"loading {om_path} …" and lines[1].startswith("loaded in ") and lines[1].endswith(" s")
    assert f"perplexity: started, {expected.windows} windows" in lines
    assert any(line.startswith(f"perplexity: {expected.windows} windows in ") for line in lines)
    assert f"perplexity {report['perplexity']:.4f} over {expected.tokens_scored} tokens" in proc.stderr
    quiet = _eval_ppl(om_path, text, "--log-level", "error")
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout.startswith("perplexity ")


def test_eval_ppl_without_text_scores_the_shipped_held_out_text(om_path, tmp_path):
    """A wheel install has no repository to find eval.txt in: without --text the shipped text is scored."""
    from cann_llm.models.data_files import EVAL_TEXT

    given = _eval_ppl(om_path, EVAL_TEXT, "--max_tokens", "96", "--json", "-")
    default = subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "eval-ppl", "--model", str(om_path),
                              "--window", "64", "--stride", "32", "--max_tokens", "96", "--json", "-"],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert given.returncode == 0 and default.returncode == 0, default.stderr
    def scored(proc):
        report = json.loads(proc.stdout)
        report.pop("seconds")
        return report

    assert scored(default) == scored(given)


def _halves(tmp_path):
    """A graph that is no language model: a Reshape of x [n] to [2, -1], which compiles, and which
    onnxruntime refuses only when run on an odd n."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "halves",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, None])],
                              [helper.make_tensor("shape", TensorProto.INT64, [2], [2, -1])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "halves.onnx")
    return compile_to(tmp_path / "halves.onnx", tmp_path / "halves")


def test_a_model_onnxruntime_fails_at_run_time_ends_in_a_code_not_a_traceback(tmp_path):
    om = _halves(tmp_path)
    odd = tmp_path / "odd.npy"
    np.save(odd, np.ones(3, np.float32))
    proc = subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "--model", str(om), "--input", str(odd)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "E19999" in proc.stderr and "Reshape" in proc.stderr
    assert "Traceback (most recent call last)" not in proc.stderr and 'File "' not in proc.stderr


def test_made_up_inputs_of_a_graph_that_is_no_language_model_take_the_shapes_given(tmp_path):
    result = _invoke("--model", str(_halves(tmp_path)), "--dymShape", "x:6", "--output", str(tmp_path / "out"),
                     "--outfmt", "NPY")
    assert result.exit_code == 0, result.output
    written = list((tmp_path / "out").rglob("*.npy"))
    assert len(written) == 1 and np.load(written[0]).shape == (2, 3)


def _cann_run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", *argv], capture_output=True, text=True, timeout=300)


def test_made_up_inputs_take_the_shapes_the_model_was_compiled_with(tmp_path):
    from cann_llm.models.tiny import tiny_onnx

    fixed = compile_to(tiny_onnx("llama", dynamo=False, with_past=False), tmp_path / "fixed",
                       input_shape={name: (1, 8) for name in ("input_ids", "attention_mask", "position_ids")})
    result = _invoke("--model", str(fixed), "--output", str(tmp_path / "out"), "--output_dirname", "r")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "r_summary.json").read_text())["outputs"]["logits"] == [1, 8, 256]


def test_run_refuses_inputs_it_cannot_take_with_their_code(om_path, tmp_path):
    np.save(tmp_path / "flat.npy", np.zeros(4, np.int64))
    cases = [(["--dymShape", "foo:1,5"], "E10016", "Op name foo specified in --dymShape"),
             (["--input", ",".join([str(tmp_path)] * 7)], "E13001", "Is a directory"),
             (["--input", ",".join([str(tmp_path / "flat.npy")] * 7)], "E10001", "input_ids has 2 dimensions"),
             (["--prompt", ""], "E10001", "The prompt is empty"),
             (["--prompt", "Hi \udcff"], "E10001", "not valid UTF-8")]
    for argv, code, words in cases:
        proc = _cann_run("--model", str(om_path), *argv)
        assert proc.returncode == 1 and f"[ERROR] {code}" in proc.stderr and words in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_eval_ppl_refuses_a_text_that_is_not_utf8_or_empty(om_path, tmp_path):
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    (tmp_path / "empty.txt").write_text("")
    for name, code in (("latin1.txt", "E13001"), ("empty.txt", "E10001"), ("absent.txt", "E13001")):
        proc = _eval_ppl(om_path, tmp_path / name)
        assert proc.returncode == 1 and f"[ERROR] {code}" in proc.stderr and name in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_runs_in_the_same_second_write_their_outputs_to_folders_of_their_own(om_path, tmp_path, monkeypatch):
    """The output folder is named for the second a run ends in (as ais_bench names it); parallel runs shared
    one and overwrote each other's files, each saying it wrote them."""
    from cann_llm.cli import cann_run

    monkeypatch.setattr(cann_run, "_second", lambda: "2026_12_06-22_41_40")
    folders = []
    for _ in range(3):
        result = _invoke("--model", str(om_path), "--loop", "1", "--output", str(tmp_path), "--outfmt", "NPY",
                         "--dymShape", "input_ids:1,3;past_key_values.0.key:1,2,0,16")
        assert result.exit_code == 0, result.output
        folders.append(result.output.split("[INFO] output path:")[1].strip())
    names = [folder.rsplit("/", 1)[1] for folder in folders]
    assert names == ["2026_12_06-22_41_40", "2026_12_06-22_41_40_1", "2026_12_06-22_41_40_2"]
    assert {p.name for p in tmp_path.glob("*_summary.json")} == {f"{name}_summary.json" for name in names}
    # a folder named by the user, nested: the path printed and the summary beside the folder it names
    result = _invoke("--model", str(om_path), "--loop", "1", "--output", str(tmp_path), "--output_dirname", "a/b",
                     "--outfmt", "NPY", "--dymShape", "input_ids:1,3;past_key_values.0.key:1,2,0,16")
    assert result.exit_code == 0 and f"[INFO] output path:{tmp_path / 'a' / 'b'}" in result.output, result.output
    assert (tmp_path / "a" / "b_summary.json").exists() and list((tmp_path / "a" / "b").glob("*.npy"))
