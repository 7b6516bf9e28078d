"""`cann-llm-quant`: offline weight quantization writing a standard ONNX model any onnxruntime runs.

    cann-llm-quant --model model.onnx --format onnx --quant-method rtn --bits 4 --group-size 128 --output DIR

INT4 becomes blocked DequantizeLinear (opset 21), INT8 per-channel DequantizeLinear; DIR gets
model.onnx + model.onnx.data, quant_report.json, and the tokenizer files found beside the input.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import ContextManager

import click
import onnx
import onnx_graphsurgeon as gs

from cann_llm.cli.coded_errors import main_with_codes
from cann_llm.cli.common_options import CONTEXT_SETTINGS, log_level_option, shows_progress
from cann_llm.compiler.config import CompileConfig
from cann_llm.compiler.loader import import_graph, load_onnx
from cann_llm.compiler.pass_manager import run_passes
from cann_llm.compiler.pipeline import build_pipeline, calibration_samples
from cann_llm.compiler.tokenizer_files import tokenizer_files
from cann_llm.passes.canonicalize_gemm import CanonicalizeGemm
from cann_llm.passes.infer_shapes import InferShapes
from cann_llm.passes.quant.calibration import collect_input_statistics
from cann_llm.passes.quant.calibration_windows import within_positions
from cann_llm.passes.quant.config import (BITS, DEFAULT_CALIBRATION_TEXT, DEFAULT_SEQ_LEN, HESSIAN_METHODS, MAX_SEQ_LEN, METHODS,
                                 QuantConfig)
from cann_llm.passes.quant.quantize_weights import QuantizeWeights
from cann_llm.passes.quant.quantize_weights_qdq import QDQ_OPSET, QuantizeWeightsQDQ
from cann_llm.passes.quant.staged_calibration import StagedStatistics
from cann_llm.passes.upcast_float_compute import compute_in_float32
from cann_llm.passes.upgrade_opset import upgrade_opset
from cann_llm.runtime.errors import AtcError, invalid_value
from cann_llm.runtime.progress import note
from cann_llm.runtime.safe_files import make_dir, refuse_symlink


def quantize_to_qdq(model_path: Path, cfg: QuantConfig, out_dir: Path, progress: bool = False) -> dict:
    """Quantize `model_path` into `out_dir`; returns the report (also written as quant_report.json).
    `progress` shows each stage on stderr: load, calibration, quantization, save. A failure leaves nothing:
    `out_dir` and its missing parents are made only once every output is ready to write."""
    _check_output(out_dir)
    source = CompileConfig(model=str(model_path), framework=5, output=str(model_path.with_suffix("")),
                           soc_version="Ascend910B", quantization=cfg)
    tokenizer = tokenizer_files(source)
    start = time.perf_counter()
    model = load_onnx(model_path)
    note(f"load: {model_path.name}, {len(model.graph.node)} nodes, {time.perf_counter() - start:.2f} s",
         enabled=progress)
    with _fused_statistics(source, bool(tokenizer), progress) as statistics:
        graph = gs.import_onnx(model)
        compute_in_float32(graph)  # as atc reads a bfloat16 or float16 model: the QDQ model computes in float32
        InferShapes().run(graph)
        CanonicalizeGemm().run(graph)  # atc quantizes a Gemm's weight as a MatMul's: so does the QDQ route
        graph = upgrade_opset(graph, QDQ_OPSET)
        quantizer = QuantizeWeightsQDQ(cfg, statistics, progress=progress)
        result = quantizer.run(graph)
    unmatched = [p for p in cfg.skip_layers if p not in quantizer.matched_patterns]
    if unmatched:
        raise AtcError("E10001", ",".join(unmatched), "--skip", "The pattern matches no MatMul node or weight.")
    if result.effect_times == 0:
        raise AtcError("E10001", model_path, "--model", "The model has no MatMul with a constant 2-D float weight.")
    report = {"source": model_path.name, "method": cfg.method, "bits": cfg.bits, "symmetric": cfg.symmetric,
              "group_size": cfg.group_size if cfg.bits == 4 else None, "opset": QDQ_OPSET,
              "quantized": quantizer.layers, "skipped": result.rejections}
    start = time.perf_counter()
    files = {"quant_report.json": (json.dumps(report, indent=2) + "\n").encode(),
             **{name: text.encode() for name, text in tokenizer.items()}}
    _save(gs.export_onnx(graph), files, out_dir)
    note(f"save: {out_dir / 'model.onnx'}, {time.perf_counter() - start:.2f} s", enabled=progress)
    return report


def fused_graph(cfg: CompileConfig) -> gs.Graph:
    """The graph atc's weight quantization would see: every pass of the pipeline before it."""
    _, graph = import_graph(cfg.model)  # weights memory-mapped, as atc reads them
    raised = compute_in_float32(graph)
    origin = raised.weights if raised else None
    run_passes(graph, [p for p in build_pipeline(cfg, origin=origin) if not isinstance(p, QuantizeWeights)], {})
    return graph


def _fused_statistics(source: CompileConfig, has_tokenizer: bool,
                      progress: bool) -> ContextManager[dict | StagedStatistics]:
    """Calibration statistics taken on the graph atc would compile (fused), and the same way, so that
    compiling the QDQ model gives the same integers as compressing inside atc: fusions keep the names of
    the values that MatMuls read. A context: staged statistics report their progress until it ends."""
    cfg = source.quantization
    if not cfg.needs_calibration:
        return contextlib.nullcontext({})
    if not has_tokenizer:
        raise invalid_value(cfg.method, "quant-method", f"{cfg.method} calibrates on text tokenized with the model's "
                                                        f"own tokenizer: put its tokenizer.json beside the model.")
    samples = calibration_samples(source)  # the text and the windows refused before the fusions run
    start = time.perf_counter()
    graph = fused_graph(source)
    note(f"fusions: {len(graph.nodes)} nodes, {time.perf_counter() - start:.2f} s", enabled=progress)
    samples = within_positions(graph, samples, cfg)
    if cfg.method in HESSIAN_METHODS:
        return StagedStatistics(graph, samples, progress=progress)
    names = sorted({n.inputs[0].name for n in graph.nodes if n.op == "MatMul"})
    return contextlib.nullcontext(collect_input_statistics(graph, names, samples, progress=progress))


def _check_output(out_dir: Path) -> None:
    """E13004 before any work when `out_dir` cannot be made a directory: it or a parent is a file."""
    folder = out_dir.absolute()
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise AtcError("E13004", out_dir, f"{folder} is not a directory")


def _save(model: onnx.ModelProto, files: dict[str, bytes], out_dir: Path) -> None:
    """model.onnx + model.onnx.data and `files` ({name: bytes}) into `out_dir`: all written into a temporary
    folder first and then renamed into place, so that a failed write leaves no part of the output, and
    neither does it leave folders it made."""
    names = ("model.onnx.data", "model.onnx", *files)
    made = next((folder for folder in reversed((out_dir, *out_dir.parents)) if not folder.exists()), None)
    make_dir(out_dir)
    tmp = None
    try:
        targets = [refuse_symlink(out_dir / name) for name in names]
        tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=".quant-"))
        onnx.save(model, str(tmp / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                  location="model.onnx.data", size_threshold=1024)
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        for target in targets:
            os.replace(tmp / target.name, target)
    except OSError as error:
        _remove(made)
        raise AtcError("E13004", out_dir, error.strerror or str(error)) from None
    except BaseException:
        _remove(made)
        raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _remove(folder: Path | None) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


class _FlagSettings(QuantConfig):
    """The settings cann-llm-quant's flags give, refused in the flags' names."""

    PARAMETERS = {**QuantConfig.PARAMETERS, "method": "quant-method", "bits": "bits", "group_size": "group-size",
                  "skip_layers": "skip", "lm_head_bits": "lm-head-bits", "lm_head_group_size": "lm-head-group-size",
                  "calibration_text": "calibration-text", "num_samples": "num-samples", "seq_len": "seq-len"}


@click.command(context_settings=CONTEXT_SETTINGS)
@log_level_option
@click.option("--model", required=True, type=click.Path(path_type=Path), help="input ONNX model")
@click.option("--format", "out_format", type=click.Choice(["onnx"]), default="onnx", show_default=True)
@click.option("--quant-method", "method", default="rtn", show_default=True, help=" | ".join(METHODS))
@click.option("--bits", type=int, default=4, show_default=True, help=" | ".join(map(str, BITS)))
@click.option("--group-size", type=int, default=128, show_default=True, help="INT4 block size (32, 64, 128)")
@click.option("--symmetric/--asymmetric", default=True, show_default=True)
@click.option("--skip", "skip", multiple=True,
              help="node or weight name pattern to leave unquantized (fnmatch; lm_head = the logits MatMul)")
@click.option("--keep-lm-head/--quantize-lm-head", default=True, show_default=True,
              help="leave the MatMul giving the logits float (as --skip lm_head), or quantize it to --lm-head-bits")
@click.option("--lm-head-bits", type=click.Choice(["4", "8"]), default="8", show_default=True,
              help="lm_head's bits when it is quantized (8: blocked int8, as atc's lm_head_bits)")
@click.option("--lm-head-group-size", type=int, default=None,
              help="a 4-bit lm_head's block size (32, 64, 128; default: --group-size), as atc's lm_head_group_size")
@click.option("--act-order/--no-act-order", default=True, show_default=True,
              help="GPTQ: visit input channels by decreasing activation energy")
@click.option("--calibration-text", default=DEFAULT_CALIBRATION_TEXT, show_default=False,
              help="AWQ/GPTQ calibration text (default: the shipped cann_llm/models/data/calibration.txt)")
@click.option("--num-samples", type=int, default=32, show_default=True, help="calibration windows")
@click.option("--seq-len", type=int, default=None,
              help=f"tokens per calibration window, at most {MAX_SEQ_LEN} and the model's positions "
                   f"[default: {DEFAULT_SEQ_LEN}, or the model's positions when fewer]")
@click.option("--output", required=True, type=click.Path(path_type=Path), help="output directory")
def cli(model, out_format, method, bits, group_size, symmetric, skip, keep_lm_head, lm_head_bits, lm_head_group_size,
        act_order, calibration_text, num_samples, seq_len, output) -> None:
    """Quantize an ONNX LLM's weights into a standard QDQ ONNX model."""
    del out_format  # ONNX is the only format; the flag is there for the command lines users already have
    if method == "smooth_quant":
        raise AtcError("E10055", "W8A8 quantizes activations per token at run time, which has no standard QDQ "
                                 "form; compile with atc --compress_weight_conf quant_mode W8A8 instead")
    skip = tuple(dict.fromkeys((*skip, "lm_head") if keep_lm_head else skip))
    cfg = _FlagSettings(method=method, bits=bits, group_size=group_size, symmetric=symmetric, skip_layers=skip,
                        lm_head_bits=int(lm_head_bits), lm_head_group_size=lm_head_group_size, act_order=act_order,
                        calibration_text=calibration_text, num_samples=num_samples, seq_len=seq_len)
    report = quantize_to_qdq(model, cfg, output, progress=shows_progress())
    click.echo(f"[INFO] quantized {len(report['quantized'])} MatMul weights ({cfg.method}, {cfg.bits}-bit), "
               f"skipped {len(report['skipped'])}; wrote {output / 'model.onnx'}")


def main() -> None:
    """Console entry point."""
    main_with_codes(cli)


if __name__ == "__main__":
    main()
