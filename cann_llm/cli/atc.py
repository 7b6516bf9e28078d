"""`atc`: ATC's command line over `cann_llm.compiler.compile_model`.

Both `--k=v` and `--k v`, dashes or underscores; unknown flags, missing values and positional words are
refused with ATC's `ERROR:` lines; values are checked by `CompileConfig` with ATC's codes. On failure
ATC's banner and the coded message go to stderr and the exit status is 255, as ATC's is.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import shlex
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import click

from cann_llm.cli.common_options import LOG_LEVELS, StderrHandler
from cann_llm.cli.process_end import die_by, reader_gone, stdout_gone, stdout_to_devnull
from cann_llm.compiler.config import CompileConfig
from cann_llm.compiler.inapplicable_flags import NOT_APPLICABLE, REFUSED
from cann_llm.runtime.artifact import OmFile
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.safe_files import write_bytes

START = "ATC start working now, please wait for a moment."
SUCCESS = "ATC run success, welcome to the next use."
FAILURE = "ATC run failed, Please check the detail log, Try 'atc --help' for more information"
EXIT_FAILURE = 255
HELP_WORDS = ("--help", "-help", "--h", "-h")

# (flag, section, help). Every flag here is a CompileConfig field.
FLAGS: list[tuple[str, str, str]] = [
    ("mode", "General", "Run mode. 0: generate offline model (default); 1: convert .om (or ONNX) to JSON; "
                        "3: only pre-check; 6: display model info"),
    ("model", "Input", "Model file (.onnx; external data beside it)"),
    ("framework", "Input", "Framework type. 5: ONNX (0 Caffe, 1 MindSpore, 3 TensorFlow are not supported)"),
    ("input_shape", "Input", 'Input shapes, e.g. "input_ids:1,-1;position_ids:1,-1"; -1 dynamic, "1~128" range'),
    ("dynamic_batch_size", "Input", 'Batch gears, e.g. "1,2,4,8" (2 to 100), with -1 at dim 0 of --input_shape; a feed '
                                    "runs at the smallest gear that holds it, larger ones are refused"),
    ("dynamic_dims", "Input", 'Dim gears, e.g. "8,8;16,16": one value per -1 of --input_shape, in order; needs '
                              "--input_format=ND"),
    ("input_shape_range", "Input", 'Deprecated in ATC (W10004): ranges as "input_ids:[1~8,-1]"; the same as "~" in '
                                   "--input_shape"),
    ("input_format", "Input", "Input format: NCHW (default), ND, NCDHW; recorded in the artifact; --dynamic_dims "
                              "needs ND"),
    ("tokenizer", "Input", "Folder with tokenizer.json (+ chat template) to embed; default: beside --model"),
    ("output", "Output", "Output file path and name, without the .om suffix"),
    ("out_nodes", "Output", 'Outputs to keep: "name1;name2" or "node:0;node:1"'),
    ("output_type", "Output", "FP32 or FP16: float outputs cast to it, or per output \"node:0:FP16;...\" (FP16 "
                              "not on a model with a KV cache); UINT8, INT8: E10055"),
    ("soc_version", "Target", "Target profile (e.g. Ascend910B, Ascend310P3); execution is on the host CPU"),
    ("precision_mode", "Feature", "Storage dtype of float weights (compute is float32 on the CPU): "
                                  "must_keep_origin_dtype (default here), force_fp16, allow_mix_precision, "
                                  "allow_mix_precision_bf16, force_fp32, allow_fp32_to_fp16, ..."),
    ("precision_mode_v2", "Feature", "The same choice by ATC's newer names: fp16, origin, cube_fp16in_fp32out, "
                                     "mixed_float16, mixed_bfloat16 (cube_hif8, mixed_hif8: E10055); not with "
                                     "--precision_mode (E10047)"),
    ("modify_mixlist", "Feature", "JSON whose \"black-list\": {\"to-add\": [op types]} keeps those ops' weights in their "
                                  "dtype in a mixed mode (other lists: arithmetic is float32 for every op here)"),
    ("keep_dtype", "Feature", "File of node or weight names (globs, lm_head) or OpType::X whose weights keep their dtype"),
    ("optimization_switch", "Feature", 'Pass switches on the command line: "PassName:off;OtherPass:on"'),
    ("oo_level", "Feature", "O3 (default): every pass; O1: the switchable fusions off (as ALL:off in a switch file)"),
    ("fusion_switch_file", "Feature", "Fusion switches: lines 'PassName:off' or ATC's JSON {\"Switch\": ...}"),
    ("enable_flash_attention", "LLM", "Blockwise prefill attention in the paged kernel (true/false, 1/0); "
                                      "without a paged KV cache ignored with warning W10002"),
    ("enable_paged_attention", "LLM", "Paged KV cache owned by the runtime (true/false, 1/0)"),
    ("kv_cache_layout", "LLM", "contiguous (past/present graph I/O) or paged (the same as --enable_paged_attention=1)"),
    ("paged_config", "LLM", 'a JSON file of the paged KV cache\'s settings, such as {"page_size": 128}; used only when paged'),
    ("large_model_compilation", "LLM", "Accepted for compatibility; no effect here: every compile bounds its memory "
                                       "(weights memory-mapped, merged weights computed as they are written, "
                                       "packed weights kept on disk until written, calibration layer by layer)"),
    ("enable_compress_weight", "LLM", "Quantize weights (true/false)"),
    ("compress_weight_conf", "LLM", "Quantization config (JSON; its \"calibration\" object sets calibration)"),
    ("compress_fp32_weight", "LLM", "Store float32 MatMul weights in 28 bits each, losslessly (true/false): the same "
                                    "values, 7/8 of the bytes a decode step reads (docs/atc.md#fp32-weights-in-28-bits)"),
    ("keep_layers", "LLM", "Keep only the first N decoder layers, then the final norm and the head: a draft model "
                           "for speculative decoding (cann-run --draft_model) from the same ONNX; 0: all (default)"),
    ("pipeline_stages", "LLM", "K: write K artifacts OUTPUT_stage0.om … of contiguous layer ranges, served by K "
                               "processes on Ray (cann-run --model OUTPUT_stage0.om); 0: one artifact (default)"),
    ("model_type", "LLM", "Model family (llama, glm, qwen, ...); default: detected from the graph"),
    ("auto_tune_mode", "Model Tuning", "RL, GA or RL,GA: after compiling, measure the engine's settings on this "
                                       "machine (threads, the matmul kernel, the prefill chunk) and record the "
                                       "fastest in the artifact, which the runtime then uses by default"),
    ("om", "Debug", "The .om to read in modes 1 and 6 (an .onnx in mode 1 with --framework=5)"),
    ("json", "Debug", "JSON output path of mode 1 (a path ending in .onnx writes the graph as ONNX)"),
    ("check_report", "Debug", "Pre-check report path (default check_result.json in $ASCEND_WORK_PATH if set, else here)"),
    ("export_compile_stat", "Debug", "1 (default) or 2: write fusion_result.json beside the output; 0: do not"),
    ("display_model_info", "Debug", "Print the model info block after compiling (0/1)"),
    ("log", "Debug", "Log level: debug, info, warning, error, null (default); --log-level is the same flag"),
]
# ATC's flags that this target accepts and ignores (warning W10003), or refuses (E10055), with the reason
FLAGS += [(name, "Not applicable on this target", f"no effect here (W10003): {spec.why}")
          for name, spec in NOT_APPLICABLE.items()]
FLAGS += [(name, "Not supported on this target", f"refused (E10055): {why}") for name, why in REFUSED.items()]
# other spellings of a flag, beside its dashed form
_ALIASES = {"log": ("log_level",)}
_LOG_LEVELS = {**LOG_LEVELS, "null": logging.CRITICAL + 1}  # ATC's null: nothing logged


def usage() -> str:
    """ATC-style usage text."""
    lines = ["usage: atc <args>", "example:",
             "  atc --model=./model.onnx --framework=5 --output=./model --soc_version=Ascend910B",
             "  atc --mode=6 --om=./model.om",
             "flags: --flag=value or --flag value; dashes or underscores (--soc-version = --soc_version)", ""]
    width = max(len(name) for name, _, _ in FLAGS) + 2
    for section in dict.fromkeys(s for _, s, _ in FLAGS):
        lines.append(f"[{section}]")
        lines += [f"  --{name:<{width}}{text}" for name, s, text in FLAGS if s == section]
        lines.append("")
    return "\n".join(lines)


def _spellings(name: str) -> list[str]:
    names = [name, *_ALIASES.get(name, ())]
    return list(dict.fromkeys(f"--{spelling}" for n in names for spelling in (n, n.replace("_", "-"))))


def parse_flags(argv: list[str]) -> dict[str, str | None]:
    """atc's command line (no program name) → {flag: string or None}; any flag spelled with dashes or
    underscores; `_FlagError` for what ATC refuses with its `ERROR:` lines."""
    params = [click.Option(_spellings(name), name, type=str) for name, _, _ in FLAGS]
    params.append(click.Argument(["positional"], nargs=-1))
    command = click.Command("atc", params=params, add_help_option=False)
    try:
        context = command.make_context("atc", _two_dashes(argv), resilient_parsing=False)
    except click.NoSuchOption as error:
        name = error.option_name.lstrip("-")
        close = _nearest_flag(name.replace("-", "_"))
        hint = f". Did you mean '--{close}'?" if close else ""
        raise _FlagError(f"unknown command line flag '{name}'{hint}", error.option_name) from None
    except click.BadOptionUsage as error:
        raise _FlagError(f"flag '{error.option_name}' is missing its argument", error.option_name) from None
    params = dict(context.params)
    positional = params.pop("positional")
    if positional:
        raise _FlagError(f"Non-option parameter: {positional[0]}", positional[0])
    return params


class _FlagError(Exception):
    def __init__(self, message: str, word: str):
        super().__init__(message)
        self.word = word  # what was typed wrong: the coded error quotes it, not the whole command line


_SINGLE_DASH = re.compile(r"-[A-Za-z][A-Za-z0-9_-]+(=.*)?", re.DOTALL)


def _two_dashes(argv: list[str]) -> list[str]:
    """`-model=x` as `--model=x`: ATC's gflags parser takes a flag after one dash or two. Only a word where a
    flag may stand: not the value after a flag given without `=` (every flag takes one), nor past `--`."""
    words, value_next = [], False
    for at, word in enumerate(argv):
        if word == "--":
            return words + argv[at:]
        if not value_next and _SINGLE_DASH.fullmatch(word):
            word = "-" + word
        value_next = not value_next and word.startswith("--") and "=" not in word
        words.append(word)
    return words


def _nearest_flag(name: str) -> str | None:
    """The flag a typo most likely meant: the fewest edits away, a swap of two neighbours counting as one, a
    flag of the typo's length first among equals, if at most a quarter of its letters are off; else the one
    difflib finds alike (a flag cut short: `dynamic_batch`)."""
    flags = [flag for flag, _, _ in FLAGS]
    best = min(flags, key=lambda flag: (_edits(name, flag), len(flag) != len(name)))
    if _edits(name, best) <= max(1, len(name) // 4):
        return best
    return next(iter(difflib.get_close_matches(name, flags, n=1, cutoff=0.75)), None)


def _edits(a: str, b: str) -> int:
    """Optimal string alignment distance: insertions, deletions, substitutions and adjacent swaps."""
    rows = [list(range(len(b) + 1))] + [[i] + [0] * len(b) for i in range(1, len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            rows[i][j] = min(rows[i - 1][j] + 1, rows[i][j - 1] + 1, rows[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                rows[i][j] = min(rows[i][j], rows[i - 2][j - 2] + 1)
    return rows[len(a)][len(b)]


class _AtcLogFormat(logging.Formatter):
    """ATC's host log line, its time as ATC writes it (`2026-12-06-22:42:13.775.123`: milliseconds, then
    microseconds), so that what parses ATC's logs parses these."""

    def formatTime(self, record, datefmt=None):  # noqa: N802 - logging's name
        micros = int(record.created * 1e6) % 1000000
        return time.strftime("%Y-%m-%d-%H:%M:%S", time.localtime(record.created)) + \
            f".{micros // 1000:03d}.{micros % 1000:03d}"


@contextmanager
def _atc_log(level: str) -> Iterator[None]:
    """ATC's detail log on stderr at `level` while a run lasts; the logger is as it was afterwards, so a run
    called in-process (tests, scripts) leaves no handler on a stream that may since have closed."""
    handler = StderrHandler()
    handler.setFormatter(_AtcLogFormat(f"[%(levelname)s] ATC({os.getpid()},atc):%(asctime)s [%(module)s.py:%(lineno)d]"
                                       f"%(message)s"))
    logger = logging.getLogger("atc")
    saved_handlers, saved_level = logger.handlers[:], logger.level
    logger.handlers[:] = [handler]
    logger.setLevel(_LOG_LEVELS.get(level, logging.CRITICAL + 1))
    try:
        yield
    finally:
        logger.handlers[:] = saved_handlers
        logger.setLevel(saved_level)


class _Stopped(BaseException):
    """SIGTERM (a CI job's timeout, `docker stop`) or SIGINT raised where atc is, so that the way out removes
    the weights' scratch folder and any half-written file."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _StdoutFailed(Exception):
    """stdout refused a line (a full disk under `atc ... > atc.log`, a closed descriptor)."""


def _say(text: str) -> None:
    """A line on stdout, where ATC prints its verdicts."""
    try:
        click.echo(text)
    except BrokenPipeError:
        raise
    except OSError as error:
        raise _StdoutFailed(error.strerror or str(error)) from None


_owns_the_process = False  # atc's own process (`main`), not a caller's run of `run`


def _in_place() -> None:
    """Once the artifact is in place, a signal has nothing left to stop but the verdict's few lines: atc's
    own process ignores SIGINT and SIGTERM from then on and ends as it would have (success), never "stopped"
    beside a complete new artifact. Ignored at the system's level: the interpreter, ending, puts back the
    default action (death by the signal) in place of a handler, but leaves an ignored signal ignored. (A
    caller's run of `run` keeps its own handlers: a late Ctrl-C there still stops it.)"""
    if _owns_the_process:
        for each in (signal.SIGINT, signal.SIGTERM):
            signal.signal(each, signal.SIG_IGN)


def _stop(signum, frame) -> None:
    # once: a second signal while the way out runs would cut the clean-up short
    for each in (signal.SIGINT, signal.SIGTERM):
        signal.signal(each, signal.SIG_IGN)
    raise _Stopped(signum)


def _fail(text: str) -> int:
    # on stdout, as ATC prints them (a CI script's `atc ... > atc.log; grep -E 'E[0-9]{5}' atc.log` finds them);
    # stderr flushed first, so a terminal shows the detail log before the verdict
    sys.stderr.flush()
    _say(FAILURE)
    _say(text)
    return EXIT_FAILURE


def run(argv: list[str]) -> int:
    """Run atc with `argv` (no program name); returns the exit status."""
    if any(word in HELP_WORDS for word in argv):
        _say(usage())
        return 0
    debug = False
    try:
        _say(START)
        flags = parse_flags(argv)
        debug = flags.get("log") == "debug"
        flags["cmdline"] = "atc " + " ".join(shlex.quote(word) for word in argv)
        cfg = CompileConfig.from_flags(**flags)
        with _atc_log(cfg.log):
            warnings = [*cfg.warnings, *_dispatch(cfg)]
    except (KeyboardInterrupt, _Stopped) as stop:
        signum = signal.SIGINT if isinstance(stop, KeyboardInterrupt) else stop.signum
        _fail(f"atc was stopped by {signal.Signals(signum).name}")
        return 128 + signum
    except (BrokenPipeError, _StdoutFailed):
        raise  # stdout's reader is gone (`main` ends quietly), or stdout cannot be written (`main` says so on stderr)
    except _FlagError as error:
        click.echo(f"ERROR: {error}", err=True)
        return _fail(AtcError("E10001", error.word, "command line", str(error)).render())
    except AtcError as error:
        if debug:
            traceback.print_exc()
        return _fail(error.render())
    except Exception as error:  # an internal failure still gets ATC's form, the traceback only in debug
        if debug:
            traceback.print_exc()
        return _fail(AtcError("E19999", reason=f"{type(error).__name__}: {error}").render())
    _say(SUCCESS)
    for warning in warnings:
        _say(warning)
    return 0


def _dispatch(cfg: CompileConfig) -> list[str]:
    """Run the mode `cfg` asks for; the warnings of a compile."""
    from cann_llm.compiler.om_info import display_model_info

    if cfg.mode == 0:
        from cann_llm.compiler.compile import compile_model

        # ATC's console progress, whatever --log says: that sets the level of the detail log
        result = compile_model(cfg, progress=True, committed=_in_place)
        logging.getLogger("atc").info("wrote %s (%d bytes)", result.output, result.size)
        if cfg.display_model_info:
            _say(display_model_info(OmFile(result.output, verify_weights=False)))
        return result.warnings
    if cfg.mode == 1:
        _dump_json(cfg)
    elif cfg.mode == 3:
        _precheck(cfg)
    elif cfg.mode == 6:
        _say(display_model_info(OmFile(cfg.om)))
    return []


def _dump_json(cfg: CompileConfig) -> None:
    from cann_llm.compiler.om_info import model_json, om_json

    target = Path(cfg.json)
    if cfg.om.endswith(".onnx"):
        from cann_llm.compiler.loader import load_onnx

        model = load_onnx(cfg.om)
        if target.suffix == ".onnx":
            raise AtcError("E10055", "--json=*.onnx writes a compiled .om as ONNX; the input is ONNX already")
        document = model_json(model, {"framework_type": 5})
    else:
        om = OmFile(cfg.om)
        if target.suffix == ".onnx":
            write_bytes(target, om.graph().SerializeToString())
            return
        document = om_json(om)
    write_bytes(target, (json.dumps(document, indent=2, ensure_ascii=False) + "\n").encode())


def _precheck(cfg: CompileConfig) -> None:
    import onnx_graphsurgeon as gs

    from cann_llm.compiler.loader import load_onnx
    from cann_llm.compiler.precheck import check_ops, unsupported_types, write_check_report

    records = check_ops(gs.import_onnx(load_onnx(cfg.model)))
    write_check_report(Path(cfg.check_report_path), Path(cfg.model).stem, records)
    unsupported = unsupported_types(records)
    if unsupported:
        raise AtcError("E16002", ", ".join(unsupported), reason=f"details in {cfg.check_report_path}")


def main() -> None:
    """Console entry point. Stopped by SIGINT or SIGTERM, atc ends by that signal once it has cleaned up, so
    that the shell running it (a loop over models, say) sees it was stopped."""
    global _owns_the_process
    _owns_the_process = True
    signal.signal(signal.SIGTERM, _stop)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # a background job's ignored SIGINT stays so
        signal.signal(signal.SIGINT, _stop)
    try:
        status = run(sys.argv[1:])
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            raise
        except OSError as error:
            raise _StdoutFailed(error.strerror or str(error)) from None
    except _Stopped as stop:  # one that came while the verdict was printed
        status = 128 + stop.signum
    except BrokenPipeError:
        status = reader_gone() if stdout_gone() else _fail(AtcError(
            "E19999", reason="BrokenPipeError: the reader of stderr closed it").render())
    except _StdoutFailed as error:  # the verdict goes to stderr, and what stdout still buffers nowhere
        sys.stderr.write(f"{FAILURE}\n{AtcError('E13004', '<stdout>', str(error)).render()}\n")
        stdout_to_devnull()
        status = EXIT_FAILURE
    if status - 128 in (signal.SIGINT, signal.SIGTERM):
        die_by(status - 128)
    sys.exit(status)


if __name__ == "__main__":
    main()
