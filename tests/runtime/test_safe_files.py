"""Planted symlinks at every path we write: each refused with E13004 and the file it points to unchanged;
a side output that cannot be written leaves no new `.om`; a tokenizer file linked from outside its folder
is refused."""

from __future__ import annotations

import os
import shutil

import onnx
import pytest
from click.testing import CliRunner
from conftest import compile_to
from onnx import helper

from cann_llm.cli.atc import run as atc
from cann_llm.cli.cann_run import cli as cann_run
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.safe_files import FILE_MODE, atomic_writer, make_dir, open_append, write_bytes, write_text
from cann_llm.runtime.serving.guard import Guard

VICTIM_TEXT = "the victim's own bytes\n"
SOC = "--soc_version=Ascend910B"


@pytest.fixture
def victim(tmp_path):
    """A file outside the output folder that a planted link points to."""
    (tmp_path / "elsewhere").mkdir()
    path = tmp_path / "elsewhere" / "victim.txt"
    path.write_text(VICTIM_TEXT)
    return path


def _plant(link, target) -> None:
    os.symlink(target, link)


def _assert_untouched(victim) -> None:
    assert victim.read_text() == VICTIM_TEXT


def _leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.unit
def test_a_write_replaces_the_file_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    write_text(target, "new\n")
    assert target.read_text() == "new\n" and _leftovers(tmp_path) == []
    assert target.stat().st_mode & 0o777 == FILE_MODE


@pytest.mark.unit
def test_a_symlink_at_the_output_path_is_refused_and_its_target_unchanged(tmp_path, victim):
    link = tmp_path / "out.json"
    _plant(link, victim)
    with pytest.raises(AtcError, match="E13004") as caught:
        write_bytes(link, b"attacker-controlled")
    assert "symbolic link" in caught.value.message
    _assert_untouched(victim)
    assert link.is_symlink() and _leftovers(tmp_path) == []


@pytest.mark.unit
def test_a_dangling_symlink_is_refused_too(tmp_path):
    link = tmp_path / "out.json"
    _plant(link, tmp_path / "would-be-created")
    with pytest.raises(AtcError, match="E13004"):
        write_text(link, "x")
    assert not (tmp_path / "would-be-created").exists()


@pytest.mark.unit
def test_links_planted_at_the_old_predictable_temp_names_are_never_opened(tmp_path, victim):
    # the writer once used `.<name>.<pid>.tmp`; whatever sits at such names must stay as it is
    for name in (f".out.om.{os.getpid()}.tmp", ".out.om.tmp", f".out.om.{os.getpid()}"):
        _plant(tmp_path / name, victim)
    write_bytes(tmp_path / "out.om", b"artifact")
    assert (tmp_path / "out.om").read_bytes() == b"artifact"
    _assert_untouched(victim)


@pytest.mark.unit
def test_a_failure_while_writing_leaves_the_old_file_and_no_temp_file(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_writer(target) as handle:
            handle.write(b"half")
            raise RuntimeError("interrupted")
    assert target.read_bytes() == b"old" and _leftovers(tmp_path) == []


@pytest.mark.unit
def test_a_missing_folder_is_e13004(tmp_path):
    with pytest.raises(AtcError, match="E13004") as caught:
        write_text(tmp_path / "no" / "such" / "out.json", "x")
    assert "does not exist" in caught.value.message


@pytest.mark.unit
def test_the_audit_log_refuses_a_symlink(tmp_path, victim):
    link = tmp_path / "audit.jsonl"
    _plant(link, victim)
    with pytest.raises(AtcError, match="E13004"):
        Guard(audit_log=str(link))
    _assert_untouched(victim)
    guard = Guard(audit_log=str(tmp_path / "real.jsonl"))
    guard.audit(None, "m", "/v1/completions", 200)
    guard.close()
    assert (tmp_path / "real.jsonl").read_text().count("\n") == 1
    with open_append(tmp_path / "real.jsonl") as handle:  # appends, never truncates
        handle.write("more\n")
    assert (tmp_path / "real.jsonl").read_text().count("\n") == 2


@pytest.mark.unit
def test_an_output_folder_that_is_a_symlink_is_refused(tmp_path, victim):
    _plant(tmp_path / "outputs", victim.parent)
    with pytest.raises(AtcError, match="E13004"):
        make_dir(tmp_path / "outputs")


def _compile_argv(model, output) -> list[str]:
    return [f"--model={model}", "--framework=5", f"--output={output}", SOC]


def test_compile_refuses_symlinked_om_and_fusion_result_and_leaves_the_targets(capsys, tmp_path, victim,
                                                                              tiny_llama_path):
    out = tmp_path / "out"
    out.mkdir()
    for planted in ("m.om", "fusion_result.json"):
        _plant(out / planted, victim)
        assert atc(_compile_argv(tiny_llama_path, out / "m")) == 255
        err = capsys.readouterr().out
        assert "E13004" in err and "symbolic link" in err and "Traceback" not in err, err
        _assert_untouched(victim)
        assert sorted(p.name for p in out.iterdir()) == [planted]
        (out / planted).unlink()


def test_an_unwritable_fusion_result_fails_the_run_and_leaves_no_new_om(capsys, tmp_path, tiny_llama_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "fusion_result.json").mkdir()  # the rename onto it fails, after the passes ran
    assert atc(_compile_argv(tiny_llama_path, out / "m")) == 255
    err = capsys.readouterr().out
    assert "E13004" in err and "fusion_result.json" in err and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == ["fusion_result.json"]


def test_check_report_and_json_refuse_a_symlink(capsys, tmp_path, victim, tiny_llama_path):
    om = compile_to(tiny_llama_path, tmp_path / "m")
    _plant(tmp_path / "report.json", victim)
    assert atc(["--mode=3", f"--model={tiny_llama_path}", "--framework=5", SOC,
                f"--check_report={tmp_path / 'report.json'}"]) == 255
    assert "E13004" in capsys.readouterr().out
    _plant(tmp_path / "dump.json", victim)
    assert atc(["--mode=1", f"--om={om}", f"--json={tmp_path / 'dump.json'}"]) == 255
    assert "E13004" in capsys.readouterr().out
    _assert_untouched(victim)


def test_cann_run_refuses_symlinked_output_files_and_folder(tmp_path, victim, tiny_llama_path):
    om = compile_to(tiny_llama_path, tmp_path / "m")
    out = tmp_path / "results"
    out.mkdir()
    argv = ["run", "--model", str(om), "--output", str(out), "--output_dirname", "r", "--outfmt", "NPY",
            "--dymShape", "input_ids:2,5;past_key_values.0.key:2,2,3,16"]
    _plant(out / "r_summary.json", victim)
    result = CliRunner().invoke(cann_run, argv)
    assert isinstance(result.exception, AtcError) and result.exception.code == "E13004"
    _assert_untouched(victim)
    (out / "r_summary.json").unlink()
    shutil.rmtree(out / "r")
    _plant(out / "r", victim.parent)  # the outputs folder itself
    result = CliRunner().invoke(cann_run, argv)
    assert isinstance(result.exception, AtcError) and result.exception.code == "E13004"
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim.txt"]


def _model_with_tokenizer_link(tmp_path, target) -> str:
    folder = tmp_path / "model"
    folder.mkdir()
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(folder / "model.onnx"))
    os.symlink(target, folder / "tokenizer.json")
    return str(folder / "model.onnx")


def test_a_tokenizer_linked_from_outside_the_model_folder_is_refused(capsys, tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text('{"not": "yours"}')
    model = _model_with_tokenizer_link(tmp_path, secret)
    assert atc(_compile_argv(model, tmp_path / "out")) == 255
    err = capsys.readouterr().out
    assert "E13001" in err and "outside the model folder" in err and "Traceback" not in err
    assert not list(tmp_path.glob("*.om"))


def test_a_hugging_face_cache_snapshot_may_link_into_its_own_blobs(capsys, tmp_path):
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "3f2a").write_text('{"version": "1.0"}')
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    os.symlink("../../blobs/3f2a", snapshot / "tokenizer.json")
    model = _model_with_tokenizer_link(tmp_path, snapshot / "tokenizer.json")  # only --tokenizer's is read
    argv = _compile_argv(model, tmp_path / "out") + [f"--tokenizer={snapshot}"]
    assert atc(argv) == 0, capsys.readouterr().err
    secret = tmp_path / "secret.json"
    secret.write_text('{"not": "yours"}')
    (snapshot / "tokenizer.json").unlink()
    os.symlink(secret, snapshot / "tokenizer.json")  # outside the repository's blobs: still refused
    assert atc(argv) == 255 and "E13001" in capsys.readouterr().out


def test_a_tokenizer_that_is_not_json_is_refused(capsys, tmp_path):
    model = _model_with_tokenizer_link(tmp_path, "tokenizer.real")
    (tmp_path / "model" / "tokenizer.real").write_text("{broken")
    assert atc(_compile_argv(model, tmp_path / "out")) == 255
    assert "E10032" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.om"))


def test_signals_held_come_after_the_block_to_the_handler_in_place_then():
    """A signal in the block runs its handler once the block is over; a handler the block sets stays (atc
    ignores signals once its artifact is in place); off the main thread the block simply runs."""
    import signal
    import threading

    from cann_llm.runtime.safe_files import signals_held

    seen = []
    saved = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with signals_held():
            signal.raise_signal(signal.SIGTERM)
            seen.append("inside")
        assert seen == ["inside", signal.SIGTERM]
        with signals_held():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN and seen == ["inside", signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, saved)
    ran = []

    def elsewhere():
        with signals_held():
            ran.append(threading.current_thread().name)
    worker = threading.Thread(target=elsewhere, name="worker")
    worker.start()
    worker.join()
    assert ran == ["worker"]
