"""The command lines' shared surface: -h everywhere, --log-level everywhere, dashes or underscores, honest help."""

from __future__ import annotations

import logging
import re

import pytest
from click.testing import CliRunner

from cann_llm.cli.atc import parse_flags, run
from cann_llm.cli.cann_run import cli as cann_run
from cann_llm.cli.quant import cli as quant
from cann_llm.runtime.engine.config import EngineConfig

pytestmark = pytest.mark.unit

SUBCOMMANDS = sorted(cann_run.commands)


def test_cann_run_has_every_subcommand():
    assert {"run", "eval-ppl", "generate", "chat", "bench", "serve", "export"} <= set(SUBCOMMANDS)


@pytest.mark.parametrize("argv", [[name, flag] for name in SUBCOMMANDS for flag in ("-h", "--help")]
                         + [["-h"], ["--help"]], ids=" ".join)
def test_cann_run_help(argv):
    result = CliRunner().invoke(cann_run, argv)
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    if len(argv) == 2:
        assert "--log-level" in result.output


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_quant_and_atc_help(capsys, flag):
    result = CliRunner().invoke(quant, [flag])
    assert result.exit_code == 0 and "--log-level" in result.output
    assert run([flag]) == 0 and "--log-level" in capsys.readouterr().out


@pytest.mark.parametrize("command, argv, dashed, underscored, key", [
    ("generate", ["--model", "m.om", "--prompt", "p"], ["--max-new-tokens", "7"], ["--max_new_tokens", "7"],
     "max_new_tokens"),
    ("generate", ["--model", "m.om", "--prompt", "p"], ["--kv-cache-pages", "9"], ["--kv_cache_pages", "9"],
     "kv_cache_pages"),
    ("eval-ppl", ["--model", "m.om", "--text", __file__], ["--max-tokens", "5"], ["--max_tokens", "5"], "max_tokens"),
    ("run", ["--model", "m.om"], ["--warmup-count", "3"], ["--warmup_count", "3"], "warmup_count"),
])
def test_dashes_and_underscores_parse_alike(command, argv, dashed, underscored, key):
    sub = cann_run.commands[command]
    values = [sub.make_context(command, [*argv, *spelling]).params[key] for spelling in (dashed, underscored)]
    assert values[0] == values[1] != sub.make_context(command, argv).params[key]


def test_quant_takes_underscores_too():
    argv = ["--model", "m.onnx", "--output", "out"]
    assert quant.make_context("q", [*argv, "--group_size", "64"]).params["group_size"] == 64
    assert quant.make_context("q", [*argv, "--group-size", "64"]).params["group_size"] == 64


def test_atc_takes_dashes_underscores_and_log_level():
    assert parse_flags(["--soc-version=Ascend910B"]) == parse_flags(["--soc_version=Ascend910B"])
    assert parse_flags(["--log-level", "debug"])["log"] == parse_flags(["--log_level=debug"])["log"] == "debug"
    assert parse_flags(["--log=info"])["log"] == "info"


def test_log_level_configures_logging():
    sub = cann_run.commands["run"]
    sub.make_context("run", ["--model", "m.om", "--log-level", "debug"])
    assert logging.getLogger().getEffectiveLevel() == logging.DEBUG
    sub.make_context("run", ["--model", "m.om", "--log_level=error"])
    assert logging.getLogger().getEffectiveLevel() == logging.ERROR
    result = CliRunner().invoke(cann_run, ["run", "--model", "m.om", "--log-level", "verbose"])
    assert result.exit_code == 2 and "verbose" in result.output


def test_help_promises_nothing_not_done(capsys):
    assert run(["--help"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  --")}
    assert "stream" not in lines["--large_model_compilation"].lower()
    for flag in ("--large_model_compilation", "--compression_optimize_conf", "--core_type",
                 "--jit_compile"):
        assert "no effect here" in lines[flag]
    for flag in ("--singleop", "--insert_op_conf"):
        assert "refused (E10055)" in lines[flag]
    run_help = " ".join(CliRunner().invoke(cann_run, ["run", "-h"]).output.split())
    assert "no effect here" in run_help[run_help.index("--device"):][:120]


def test_engine_options_take_engine_configs_defaults():
    help_text = " ".join(CliRunner().invoke(cann_run, ["generate", "-h"]).output.split())
    defaults = EngineConfig()
    for name in ("max_batch_size", "max_context_len", "max_num_batched_tokens"):
        segment = help_text[help_text.index(f"--{name}"):]
        assert f"[default: {getattr(defaults, name)};" in segment[:300] or \
            f"[default: {getattr(defaults, name)}]" in segment[:300]
    # sized from the machine when not given: its help says how
    assert "(paged artifacts; default: 1024, or as many as fit in half of this machine's memory if fewer)" in \
        help_text[help_text.index("--kv_cache_pages"):]
    context = cann_run.commands["generate"].make_context("generate", ["--model", "m.om", "--prompt", "p"])
    assert {k: context.params[k] for k in ("max_batch_size", "kv_cache_pages", "backend")} == \
        {"max_batch_size": defaults.max_batch_size, "kv_cache_pages": defaults.kv_cache_pages, "backend": defaults.backend}


def test_atc_log_level_logs_as_log_does(capsys, tmp_path, tiny_llama_path):
    argv = [f"--model={tiny_llama_path}", "--framework=5", f"--output={tmp_path / 'm'}", "--soc_version=Ascend910B"]
    for spelling in ("--log=info", "--log-level=info"):
        assert run([*argv, spelling]) == 0
        info = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[INFO] ATC(")]
        assert any("wrote" in line for line in info), spelling
        # ATC's host log line, `[Level] Module(PID,program):yyyy-mm-dd-hh:mm:ss.SSS.SSS [file:line]msg`
        assert all(re.fullmatch(r"\[INFO\] ATC\(\d+,atc\):\d{4}-\d\d-\d\d-\d\d:\d\d:\d\d\.\d{3}\.\d{3} "
                                r"\[\w+\.py:\d+\]\S.*", line) for line in info), info[:2]
    assert run(argv) == 0  # --log=null, ATC's default: no detail log
    assert "[INFO] ATC(" not in capsys.readouterr().err
