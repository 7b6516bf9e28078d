"""`atc` end to end: modes, reports, and every kind of bad input refused with a code and no output."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from cann_llm.cli.atc import parse_flags, run
from cann_llm.runtime.artifact import OmFile

SOC = "--soc_version=Ascend910B"


def _atc(capsys, *argv: str) -> tuple[int, str, str]:
    status = run(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _assert_refused(capsys, tmp_path, code: str, *argv: str) -> str:
    status, out, err = _atc(capsys, *argv, f"--output={tmp_path / 'out'}")
    assert status == 255
    # on stdout, as ATC prints them
    assert "ATC run failed" in out and f"{code}: [PID:" in out, out + err
    assert "Traceback" not in out + err
    assert not list(tmp_path.glob("**/*.om")) and not list(tmp_path.glob("**/.*.tmp"))
    return out


def _external_model(tmp_path):
    weight = numpy_helper.from_array(np.ones((64, 64), np.float32), "weight")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "weight"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 64])], [weight])
    path = tmp_path / "ext.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path),
              save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    return path


def test_compile_writes_om_and_fusion_result(capsys, tmp_path, tiny_llama_path):
    status, out, _ = _atc(capsys, f"--model={tiny_llama_path}", "--framework", "5", f"--output={tmp_path / 'm'}", SOC,
                          "--display-model-info=1")
    assert status == 0
    assert out.splitlines()[0] == "ATC start working now, please wait for a moment."
    assert "ATC run success, welcome to the next use." in out
    assert "============ Display Model Info start ============" in out and "layers[2], kv_heads[2]" in out
    meta = OmFile(tmp_path / "m.om").metadata
    assert meta["cmdline"].startswith("atc --model=") and meta["config"]["soc_version"] == "Ascend910B"
    assert meta["model"] == {"vocab_size": 256, "kv_cache_io": True, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                             "head_dim": 16, "family": "llama", "detected_family": "llama"}
    assert meta["kv_cache"] == {"layout": "contiguous"} and "kv_cache_layout[contiguous]" in out
    assert not {"enable_paged_attention", "kv_cache_layout", "paged_config", "paging"} & set(meta["config"])
    result = json.loads((tmp_path / "fusion_result.json").read_text())["session_and_graph_id_0_0"]["graph_fusion"]
    folded = result["ConstantFoldingPass"]
    assert isinstance(folded["match_times"], str) and int(folded["effect_times"]) > 0
    runs = [p for p in meta["pass_report"]["passes"] if p["name"] == "ConstantFoldingPass"]
    assert int(folded["effect_times"]) == sum(p["effect_times"] for p in runs) and len(runs) == 2


def test_mode_1_dumps_json_without_weights(capsys, tmp_path, tiny_llama_path):
    assert _atc(capsys, f"--model={tiny_llama_path}", "--framework=5", f"--output={tmp_path / 'm'}", SOC)[0] == 0
    status, _, _ = _atc(capsys, "--mode=1", f"--om={tmp_path / 'm.om'}", f"--json={tmp_path / 'm.json'}")
    assert status == 0
    document = json.loads((tmp_path / "m.json").read_text())
    graph = onnx.load(str(tiny_llama_path)).graph
    ops = document["graph"][0]["op"]
    assert sum(op["type"] == "Data" for op in ops) == len(graph.input)
    assert {a["key"] for a in document["attr"]} >= {"atc_cmdline", "soc_version", "atc_version", "om_info_list"}
    consts = [op for op in ops if op["type"] == "Const"]
    assert consts and all(set(op) == {"name", "type", "output_desc"} for op in consts)
    status, _, _ = _atc(capsys, "--mode=1", f"--om={tmp_path / 'm.om'}", f"--json={tmp_path / 'graph.onnx'}")
    assert status == 0
    assert len(onnx.load(str(tmp_path / "graph.onnx"), load_external_data=False).graph.node) > 0


def test_mode_6_displays_info(capsys, tmp_path, tiny_llama_path):
    _atc(capsys, f"--model={tiny_llama_path}", "--framework=5", f"--output={tmp_path / 'm'}", SOC)
    status, out, _ = _atc(capsys, "--mode=6", f"--om={tmp_path / 'm.om'}")
    assert status == 0
    assert "soc_version[Ascend910B], framework_type[5]." in out
    assert f"weight_size[{OmFile(tmp_path / 'm.om').partition_sizes()['WEIGHTS_DATA']} B]" in out
    layers = OmFile(tmp_path / "m.om").metadata["model"]["num_layers"]
    # q/k/v and gate/up merged, o, down; the lm_head
    assert f"weight   info: matmuls[{4 * layers + 1} float32], embedding[float32]." in out


def test_mode_3_lists_every_unsupported_op_at_once(capsys, tmp_path, monkeypatch):
    nodes = [helper.make_node("FindMax", ["x"], ["a"], domain="custom"),
             helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("TopKPlus", ["b"], ["y"], domain="custom")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)])
    path = tmp_path / "custom.onnx"
    onnx.save(model, str(path))
    monkeypatch.chdir(tmp_path)
    status, out, _ = _atc(capsys, "--mode=3", f"--model={path}", "--framework=5", SOC)
    assert status == 255 and "E16002" in out and "FindMax, TopKPlus" in out
    report = json.loads((tmp_path / "check_result.json").read_text())
    assert (report["result"], report["total"], report["pass"], report["fail"]) == ("failed", 3, 1, 2)
    assert [op["cause"][0]["code"] for op in report["op"]] == [1, 0, 1]
    assert "FindMax, TopKPlus" in _assert_refused(capsys, tmp_path, "E16002", f"--model={path}", "--framework=5", SOC)
    # ATC's default place for the report is $ASCEND_WORK_PATH where it is set
    (tmp_path / "work").mkdir()
    monkeypatch.setenv("ASCEND_WORK_PATH", str(tmp_path / "work"))
    (tmp_path / "check_result.json").unlink()
    status, _, _ = _atc(capsys, "--mode=3", f"--model={path}", "--framework=5", SOC)
    assert status == 255 and (tmp_path / "work" / "check_result.json").exists()
    assert not (tmp_path / "check_result.json").exists()


def test_input_shape_and_out_nodes_change_the_signature(capsys, tmp_path, tiny_llama_path):
    status, _, _ = _atc(capsys, f"--model={tiny_llama_path}", "--framework=5", f"--output={tmp_path / 'm'}", SOC,
                        "--input_shape=input_ids:1,-1;position_ids:1,-1", "--out_nodes=logits;present.1.value")
    assert status == 0
    signature = OmFile(tmp_path / "m.om").metadata["signature"]
    inputs = {v["name"]: v["shape"] for v in signature["inputs"]}
    assert inputs["input_ids"][0] == 1 and inputs["position_ids"][0] == 1 and not isinstance(inputs["input_ids"][1], int)
    assert [v["name"] for v in signature["outputs"]] == ["logits", "present.1.value"]


@pytest.mark.parametrize("argv, code", [
    (["--framework=5", SOC, "--model={tmp}/absent.onnx"], "E13001"),
    (["--framework=5", SOC, "--model=/proc/self/mem"], "E13001"),  # a regular file whose read fails (EIO)
    (["--framework=5", SOC, "--model={tmp}/junk.onnx"], "E10041"),
    (["--framework=5", SOC, "--model={tmp}/truncated/ext.onnx"], "E10041"),
    (["--framework=5", SOC, "--model={tmp}/bad_checker.onnx"], "E10041"),
    (["--framework=5", SOC, "--model={llama}", "--input_shape=tokens:1,8"], "E10016"),
    (["--framework=5", SOC, "--model={llama}", "--input_shape=input_ids:1,8,3"], "E10049"),
    (["--framework=5", SOC, "--model={llama}", "--out_nodes=nothing"], "E10016"),
    (["--framework=5", "--soc_version=Ascend123", "--model={llama}"], "E10001"),
    (["--framework=1", SOC, "--model={llama}"], "E10055"),
    ([SOC, "--model={llama}"], "E10007"),
    (["--framework=5", SOC, "--model={llama}", "--log=loud"], "E10010"),
])
def test_bad_input_is_refused_with_its_code(capsys, tmp_path, tiny_llama_path, argv, code):
    (tmp_path / "junk.onnx").write_bytes(b"\x08\x07this is not a protobuf" * 10)
    ext = _external_model(tmp_path / "truncated" if (tmp_path / "truncated").mkdir() is None else tmp_path)
    data = ext.with_name("ext.onnx.data")
    data.write_bytes(data.read_bytes()[:100])
    bad = helper.make_graph([helper.make_node("Relu", ["undefined"], ["y"])], "g", [],
                            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(bad, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "bad_checker.onnx"))
    argv = [a.format(tmp=tmp_path, llama=tiny_llama_path) for a in argv]
    _assert_refused(capsys, tmp_path, code, *argv)


def test_a_missing_model_is_named_before_a_missing_output_folder(capsys, tmp_path):
    status, out, _ = _atc(capsys, "--framework=5", SOC, f"--model={tmp_path / 'absent.onnx'}",
                          f"--output={tmp_path / 'no' / 'such' / 'm'}")
    assert status == 255 and "E13001" in out and "absent.onnx" in out and "E13004" not in out


def test_a_language_model_compiled_without_a_tokenizer_is_warned_about(capsys, tmp_path, tiny_llama_path):
    (tmp_path / "bare").mkdir()
    shutil.copyfile(tiny_llama_path, tmp_path / "bare" / "model.onnx")  # no tokenizer.json beside this copy
    status, out, _ = _atc(capsys, f"--model={tmp_path / 'bare' / 'model.onnx'}", "--framework=5", SOC,
                          f"--output={tmp_path / 'm'}")
    assert status == 0 and "W10009: no tokenizer was packed" in out
    status, out, _ = _atc(capsys, f"--model={tmp_path / 'bare' / 'model.onnx'}", "--framework=5", SOC,
                          f"--output={tmp_path / 'm'}", f"--tokenizer={tiny_llama_path.parent}")
    assert status == 0 and "W10009" not in out


def test_a_path_that_is_not_a_regular_file_is_named_so(capsys, tmp_path):
    out = _assert_refused(capsys, tmp_path, "E13001", "--framework=5", SOC, "--model=/dev/null")
    assert "Reason: not a regular file." in out


def test_unwritable_output_is_refused(capsys, tmp_path, tiny_llama_path, monkeypatch):
    (tmp_path / "file").write_text("")
    (tmp_path / "m.om").mkdir()
    for output, why in ((tmp_path / "file" / "m", "is not a directory"), (tmp_path / "m", "the path is a directory")):
        status, out, _ = _atc(capsys, f"--model={tiny_llama_path}", "--framework=5", SOC, f"--output={output}")
        assert status == 255 and "E13004" in out and why in out
    assert list(tmp_path.glob("**/*.om")) == [tmp_path / "m.om"]
    # a folder that passes the check for writing but where the weights' scratch folder cannot be made (root
    # in /sys): the system's refusal, given as mkdir gives it
    from cann_llm.passes import weight_spill

    def refused(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(weight_spill.tempfile, "mkdtemp", refused)
    status, out, _ = _atc(capsys, f"--model={tiny_llama_path}", "--framework=5", SOC, f"--output={tmp_path / 'n'}")
    assert status == 255 and "E13004" in out and "Operation not permitted" in out and "Traceback" not in out


def test_missing_output_folders_are_made_as_atc_makes_them_and_removed_again_when_the_compile_fails(
        capsys, tmp_path, tiny_llama_path):
    status, out, _ = _atc(capsys, f"--model={tiny_llama_path}", "--framework=5", SOC,
                          f"--output={tmp_path / 'new' / 'sub' / 'm'}")
    assert status == 0, out
    assert sorted(p.name for p in (tmp_path / "new" / "sub").iterdir()) == ["fusion_result.json", "m.om"]
    (tmp_path / "broken.onnx").write_bytes(b"not a model")
    status, out, _ = _atc(capsys, f"--model={tmp_path / 'broken.onnx'}", "--framework=5", SOC,
                          f"--output={tmp_path / 'other' / 'sub' / 'm'}")
    assert status == 255 and "E10041" in out
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("output, code", [("{tmp}/folder/", "E10022"), ("{tmp}/folder/.", "E10022"),
                                          ("{tmp}/" + "a" * 253, "E10021"), ("{tmp}/" + "a/" * 2100 + "m", "E10021")])
def test_an_output_without_a_file_name_or_too_long_is_refused_with_atcs_codes(capsys, tmp_path, tiny_llama_path,
                                                                             output, code):
    """`--output=$DIR/$NAME` with NAME empty wrote a hidden `.om` and said success; a name the system cannot
    take failed with E19999 at the end of the compile."""
    (tmp_path / "folder").mkdir()
    status, out, _ = _atc(capsys, f"--model={tiny_llama_path}", "--framework=5", SOC,
                          f"--output={output.format(tmp=tmp_path)}")
    assert status == 255 and f"{code}: [PID:" in out and "--output" in out
    assert list((tmp_path / "folder").iterdir()) == []


def test_a_failed_compile_leaves_the_previous_artifact_and_its_fusion_result_as_they_were(capsys, tmp_path,
                                                                                           tiny_llama_path):
    """Both are put in place together at the end; a failure before that touches neither (a failed compile
    had removed a fusion_result.json it had replaced, another output's included)."""
    status, _, _ = _atc(capsys, f"--model={tiny_llama_path}", "--framework=5", SOC, f"--output={tmp_path / 'a'}")
    assert status == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    (tmp_path / "broken.onnx").write_bytes(b"not a model")
    for name in ("a", "b"):
        status, out, _ = _atc(capsys, f"--model={tmp_path / 'broken.onnx'}", "--framework=5", SOC,
                              f"--output={tmp_path / name}")
        assert status == 255 and "E10041" in out
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "broken.onnx"} == before


def test_scratch_that_a_killed_compile_left_is_removed_and_a_running_ones_kept(capsys, tmp_path, tiny_llama_path):
    """SIGKILL (or the OOM killer) cleans nothing up: the weights' scratch folder (gigabytes for a large
    model) and staged files stay. The next compile into that folder removes those whose maker, named in
    them, is gone, and leaves alone a running compile's and another machine's or container's (a pid names
    a process only within its boot and pid namespace)."""
    from cann_llm.passes.weight_spill import SPILL_PREFIX
    from cann_llm.runtime.safe_files import SCRATCH_PREFIX, maker

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead, alive = maker().replace(str(os.getpid()), str(gone.pid), 1), maker()
    elsewhere = f"{gone.pid}@0123456789abcdefn4026531836"
    left = [tmp_path / f"{SPILL_PREFIX}{dead}-x1", tmp_path / f"{SCRATCH_PREFIX}{dead}-x2.tmp",
            tmp_path / f"{SPILL_PREFIX}{alive}-x3", tmp_path / f"{SCRATCH_PREFIX}{alive}-x4.tmp",
            tmp_path / f"{SCRATCH_PREFIX}{elsewhere}-x5.tmp", tmp_path / f"{SPILL_PREFIX}unnamed"]
    for path in left:
        path.mkdir() if path.name.startswith(SPILL_PREFIX) else path.write_bytes(b"")
    status, _, _ = _atc(capsys, f"--model={tiny_llama_path}", "--framework=5", SOC, f"--output={tmp_path / 'm'}",
                        "--enable_compress_weight=1")
    assert status == 0
    assert [path.exists() for path in left] == [False, False, True, True, True, True]


def test_stdout_closed_or_full_is_one_coded_line_on_stderr(tmp_path, tiny_llama_path):
    """`atc ... > atc.log` on a full disk raised a traceback from the middle of click; with stdout closed
    (`>&-`) the next file opened took its descriptor. Closed, atc runs on (its verdicts go nowhere); full,
    it says so on stderr and exits 255."""
    entry = "import sys; sys.argv[0] = 'atc'; from cann_llm.cli.entry import atc; atc()"
    argv = [sys.executable, "-c", entry, "--framework=5", SOC, f"--model={tiny_llama_path}"]
    with open("/dev/full", "w") as full:
        proc = subprocess.run([*argv, f"--output={tmp_path / 'full'}"], stdout=full, stderr=subprocess.PIPE, text=True)
    assert proc.returncode == 255 and "Traceback" not in proc.stderr
    assert "E13004" in proc.stderr and "<stdout>" in proc.stderr and "No space left on device" in proc.stderr
    proc = subprocess.run([*argv, f"--output={tmp_path / 'closed'}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, preexec_fn=lambda: os.close(1))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert OmFile(tmp_path / "closed.om").metadata["name"] == "closed"


def test_onnxruntime_leaves_no_usage_records_behind(tmp_path, tiny_llama_path):
    """onnxruntime's builds keep a device id under ~/.cache/Microsoft and `.ses` files in $TMPDIR unless told
    not to; a CI job's clean workspace should not collect them."""
    home, scratch = tmp_path / "home", tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "HOME": str(home), "TMPDIR": str(scratch), "XDG_CACHE_HOME": str(home / ".cache")}
    env.pop("ORT_DISABLE_TELEMETRY", None)
    proc = subprocess.run([sys.executable, "-m", "cann_llm.cli.atc", "--framework=5", SOC, f"--model={tiny_llama_path}",
                           f"--output={tmp_path / 'm'}"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(scratch.iterdir()) == [] and not (home / ".cache" / "Microsoft").exists()


@pytest.mark.parametrize("argv, line, word", [
    (["--modle=x.onnx"], "ERROR: unknown command line flag 'modle'. Did you mean '--model'?", "--modle"),  # a swap, not '--mode'
    (["-modle=x.onnx"], "ERROR: unknown command line flag 'modle'. Did you mean '--model'?", "--modle"),
    (["--soc_verison=Ascend910B"], "Did you mean '--soc_version'?", "--soc_verison"),
    (["--model"], "ERROR: flag '--model' is missing its argument", "--model"),
    (["stray"], "ERROR: Non-option parameter: stray", "stray"),
])
def test_command_line_errors_use_atcs_lines(capsys, argv, line, word):
    """ATC's own line, then the coded error quoting the word typed wrong (not the whole command line, which
    in a CI job's log is a screenful of flags)."""
    status, out, err = _atc(capsys, "--framework=5", "--soc_version=Ascend910B", *argv)
    assert status == 255 and line in err
    assert "E10001: " in out + err and f"Value {word} for parameter command line is invalid." in out + err


def test_flags_after_one_dash_are_taken_as_atcs_parser_takes_them(tmp_path, tiny_llama_path):
    assert parse_flags([f"-model={tiny_llama_path}", "-framework", "5", "-soc_version=Ascend910B",
                        f"--output={tmp_path / 'm'}"]) == parse_flags(
        [f"--model={tiny_llama_path}", "--framework=5", "--soc_version=Ascend910B", f"--output={tmp_path / 'm'}"])
    # a value after its flag stays a value, however it is spelled
    assert parse_flags(["--output", "-model", "-log", "-error"])["output"] == "-model"
    assert parse_flags(["-log", "-error"])["log"] == "-error"


def test_the_installed_command_exits_255_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cann_llm.cli.atc", f"--model={tmp_path}/absent.onnx", "--framework=5",
                           SOC, f"--output={tmp_path}/m"], capture_output=True, text=True)
    assert proc.returncode == 255
    assert "E13001" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
    assert subprocess.run([sys.executable, "-m", "cann_llm.cli.atc", "--help"], capture_output=True).returncode == 0


def test_one_pass_switched_off_by_name_and_debug_says_why_nothing_fused(capsys, tmp_path, tiny_llama_path):
    switch = tmp_path / "switch.json"
    switch.write_text('{"Switch": {"GraphFusion": {"AttentionFusionPass": "off"}}}')
    status, _, err = _atc(capsys, f"--model={tiny_llama_path}", "--framework=5", f"--output={tmp_path / 'm'}", SOC,
                          f"--fusion_switch_file={switch}", "--log=debug")
    assert status == 0
    ops = [n.op_type for n in OmFile(tmp_path / "m.om").graph().graph.node]
    assert "FusedAttention" not in ops and ops.count("AddRmsNorm") == 4 and ops.count("Softmax") == 2
    result = json.loads((tmp_path / "fusion_result.json").read_text())["session_and_graph_id_0_0"]["graph_fusion"]
    assert "AttentionFusionPass" not in result and result["RmsNormFusionPass"]["effect_times"] == "5"
    assert "AttentionFusionPass: switched off" in err
    # QkvFusionPass had FusedAttention nodes to pack: none, and the debug log says so for each candidate
    assert "QkvFusionPass: matched 0, applied 0" in err


def test_a_switch_that_switches_nothing_is_warned_with_the_pass_it_likely_meant(capsys, tmp_path, tiny_llama_path):
    switches = "RmsNormFusionPas:off;ConvBatchnormFusionPass:off;ShapeInferencePass:off"
    status, out, _ = _atc(capsys, f"--model={tiny_llama_path}", "--framework=5", f"--output={tmp_path / 'm'}", SOC,
                          f"--optimization_switch={switches}")
    assert status == 0
    warning = next(line for line in out.splitlines() if line.startswith("W10013"))
    assert ("ConvBatchnormFusionPass, RmsNormFusionPas (did you mean RmsNormFusionPass?), ShapeInferencePass "
            "(which always runs)") in warning
    ops = [n.op_type for n in OmFile(tmp_path / "m.om").graph().graph.node]
    assert ops.count("RmsNorm") + ops.count("AddRmsNorm") == 5  # the misspelt switch turned nothing off


def test_debug_log_gives_the_reason_a_candidate_was_refused(capsys, tmp_path):
    """Scores of q·k with no transposed keys (not attention as any exporter writes it) stay unfused."""
    shape = [1, 2, 4, 4]
    nodes = [helper.make_node("MatMul", ["q", "k"], ["scores"]), helper.make_node("Softmax", ["scores"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    values = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape) for name in ("q", "k", "v", "y")]
    path = tmp_path / "scores.onnx"
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", values[:3], values[3:]),
                                opset_imports=[helper.make_opsetid("", 17)]), str(path))
    status, _, err = _atc(capsys, f"--model={path}", "--framework=5", f"--output={tmp_path / 'm'}", SOC, "--log=debug")
    assert status == 0
    assert "AttentionFusionPass: candidate refused:" in err and "the keys are not transposed" in err


PASS_LINE = re.compile(r"^\[ *(\d+)/(\d+)\] (\w+) +(?:matched (\d+), applied (\d+)  (\d+\.\d\d) s|switched off)$")


def _atc_process(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cann_llm.cli.atc", "--framework=5", SOC, *argv], capture_output=True, text=True)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_compile_stopped_by_a_signal_midway_leaves_nothing_in_the_output_folder(tmp_path, tiny_llama_path, signum):
    """A CI job's timeout sends SIGTERM, a user Ctrl-C: either ends atc, after ATC's failure banner and no
    traceback, by that same signal (so a shell loop over models stops too), and neither leaves the weights'
    scratch folder or a model behind. The signal goes once the scratch folder exists: the compile is then
    inside its passes. (SIGINT set back to its default in the child: a job started in the background
    inherits it ignored, and atc keeps it so, as a background job should.)"""
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "cann_llm.cli.atc", "--framework=5", SOC, f"--model={tiny_llama_path}",
                             f"--output={out / 'm'}", "--enable_compress_weight=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while not list(out.glob(".atc-weights-*")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.002)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == -signum, stderr[-2000:]
    assert "Traceback" not in stdout + stderr
    assert "ATC run failed" in stdout and signal.Signals(signum).name in stdout
    assert list(out.iterdir()) == []


def test_a_signal_once_the_artifact_is_in_place_ends_atc_as_a_success(tmp_path, tiny_llama_path):
    """The artifact and its fusion_result.json go in place together with SIGINT and SIGTERM held; a signal
    from then on has nothing to stop. It said "ATC run failed ... stopped by SIGTERM" and exited 143 beside
    a complete new artifact. The signal goes as soon as the .om exists (`--display_model_info` reads it back
    and prints it after, so atc is still running)."""
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "cann_llm.cli.atc", "--framework=5", SOC, f"--model={tiny_llama_path}",
                             f"--output={out / 'm'}", "--display_model_info=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (out / "m.om").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.001)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "ATC run success" in stdout and "ATC run failed" not in stdout, stdout + stderr
    assert sorted(p.name for p in out.iterdir()) == ["fusion_result.json", "m.om"]
    assert OmFile(out / "m.om").metadata["name"] == "m"


def test_an_auto_tune_stopped_midway_leaves_the_previous_artifact(tmp_path, tiny_llama_path):
    """The search runs on the staged artifact: stopped (or failing), the artifact compiled before stays, where
    it had been removed (and a SIGKILL left an untuned one that looked complete)."""
    argv = [sys.executable, "-m", "cann_llm.cli.atc", "--framework=5", SOC, f"--model={tiny_llama_path}",
            f"--output={tmp_path / 'm'}", "--enable_paged_attention=1"]
    assert subprocess.run(argv, capture_output=True).returncode == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    proc = subprocess.Popen([*argv, "--auto_tune_mode=GA"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # the first trial's line: the search is under way
        if line.startswith("auto tune:"):
            break
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGTERM and "stopped by SIGTERM" in stdout
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_reader_that_closes_stdout_ends_atc_quietly_with_sigpipes_status(tmp_path, tiny_llama_path):
    """`atc ... | grep -q "ATC start"`: the reader leaves after one line; atc ends as a C tool killed by SIGPIPE
    would (141), without a traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "cann_llm.cli.atc", "--framework=5", SOC, f"--model={tiny_llama_path}",
                             f"--output={tmp_path / 'm'}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=300) == 141
    assert "Traceback" not in stderr and "E19999" not in stderr


def test_a_sequence_of_a_billion_tokens_compiles_in_a_bounded_address_space(tmp_path):
    """Inference propagates the values of shape tensors element by element (a Range over the sequence): given
    a billion tokens it took all of the machine's 24 GB until the kernel killed it; past a million tokens
    only shapes are inferred, so the compile stays small."""
    import resource

    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx("llama", dynamo=False, with_past=False)
    fixed = ";".join(f"{name}:1,1000000000" for name in ("input_ids", "attention_mask", "position_ids"))
    limit = 4 << 30
    proc = subprocess.run([sys.executable, "-m", "cann_llm.cli.atc", "--framework=5", SOC, f"--model={source}",
                           f"--output={tmp_path / 'm'}", f"--input_shape={fixed}"], capture_output=True, text=True,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "m.om").is_file()


def test_atc_prints_a_line_per_pass_in_pipeline_order_with_its_counts_and_time(tmp_path, tiny_llama_path):
    switch = tmp_path / "switch.cfg"
    switch.write_text("AttentionFusionPass:off\n")
    proc = _atc_process(f"--model={tiny_llama_path}", f"--output={tmp_path / 'm'}", f"--fusion_switch_file={switch}")
    assert proc.returncode == 0, proc.stderr
    # stdout keeps ATC's own lines; the progress is on stderr, at the default --log=null
    assert proc.stdout.splitlines() == ["ATC start working now, please wait for a moment.",
                                        "ATC run success, welcome to the next use.",
                                        "W10005: 2 attention block(s) did not fuse and run as the export wrote them "
                                        "(slower; no paged KV cache): AttentionFusionPass is switched off"]
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("load: model.onnx, ") and lines[0].endswith(" s")
    assert lines[-1].startswith("write: m.om, ") and lines[-1].endswith(" s")
    matches = [PASS_LINE.match(line) for line in lines[1:-1]]
    assert all(matches), lines
    records = OmFile(tmp_path / "m.om").metadata["pass_report"]["passes"]
    assert [int(m[1]) for m in matches] == list(range(1, len(records) + 1))
    assert {int(m[2]) for m in matches} == {len(records)}
    assert [m[3] for m in matches] == [r["name"] for r in records]
    for match, record in zip(matches, records):
        if record["enabled"]:
            assert (int(match[4]), int(match[5])) == (record["match_times"], record["effect_times"])
            assert float(match[6]) >= 0
        else:
            assert match[0].endswith("switched off") and record["name"] == "AttentionFusionPass"


@pytest.mark.parametrize("algorithm, calibration", [
    ("awq", "calibration (4 samples, staged): "),  # taken layer by layer as the quantizer reaches each
    ("smooth_quant", "calibration: ")])  # all at once, before quantizing
def test_atc_shows_calibration_and_quantization_progress_inside_the_quantization_pass(tmp_path, tiny_llama_path,
                                                                                      algorithm, calibration):
    mode = "W8A8" if algorithm == "smooth_quant" else "INT4"
    config = tmp_path / "quant.json"
    config.write_text(json.dumps({"quant_mode": mode, "group_size": 32, "algorithms": [{"name": algorithm}],
                                  "calibration": {"num_samples": 4, "seq_len": 64}}))
    proc = _atc_process(f"--model={tiny_llama_path}", f"--output={tmp_path / 'm'}", "--enable_compress_weight=1",
                        f"--compress_weight_conf={config}", "--log=null")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    quantization = next(i for i, line in enumerate(lines) if "WeightQuantizationPass" in line)
    previous = next(i for i, line in enumerate(lines) if "SwiGluFusionPass" in line)
    inside = lines[previous + 1:quantization]  # printed while the pass ran, before its own line
    assert PASS_LINE.match(lines[quantization]).group(4, 5) == ("8", "8")  # 2 layers × (QKV, o, gate/up, down)
    assert inside[0] == calibration + ("started" if algorithm == "awq" else "started, 4 samples")
    assert "quantization: started, 8 weights" in inside
    assert any(line.startswith("quantization: 8 weights in ") for line in inside)
    done = [line for line in inside if line.startswith(calibration) and line.endswith(" s")]
    assert done and done[0].startswith(calibration + ("8 stages in " if algorithm == "awq" else "4 samples in "))


@pytest.mark.parametrize("opset, dims, words", [
    (99, [2, 4], "the model imports ai.onnx opset 99; supported are opsets 7 to"),
    (17, [-1, 4], "tensor x has dimension -1"),
])
def test_the_installed_command_refuses_a_model_it_cannot_run_and_writes_nothing(tmp_path, opset, dims, words):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, dims)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(tmp_path / "bad.onnx"))
    proc = subprocess.run([sys.executable, "-m", "cann_llm.cli.atc", f"--model={tmp_path}/bad.onnx", "--framework=5", SOC,
                           f"--output={tmp_path}/m"], capture_output=True, text=True)
    assert proc.returncode == 255 and "E10041" in proc.stdout and words in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.onnx"]
