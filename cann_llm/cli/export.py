"""`cann-run export`: a local Hugging Face checkpoint or GGUF file → ONNX with KV cache, ready for atc."""

from __future__ import annotations

import contextlib
import sys
import time

import click

from cann_llm.cli.coded_errors import unwind_on_sigterm
from cann_llm.models.hf_export import EXPORTERS, ExportConfig


@click.command("export")
@click.option("--model", "-m", required=True,
              help="a Hugging Face checkpoint folder (config.json, safetensors or .bin, tokenizer files) or a .gguf file")
@click.option("--output", "-o", required=True, help="folder that receives model.onnx, its tokenizer and generation config")
@click.option("--exporter", type=click.Choice(EXPORTERS), default="dynamo", show_default=True,
              help="torch.onnx.export(dynamo=True) or the TorchScript exporter")
@click.option("--past/--no-past", "with_past", default=True, show_default=True,
              help="KV-cache inputs and outputs; --no-past gives a prefill-only graph")
def export_command(model, output, exporter, with_past) -> None:
    """Export a causal LM to ONNX as users do (transformers' default attention), for `atc --model=OUTPUT/model.onnx`."""
    from cann_llm.models.hf_export import export_checkpoint, require_export_packages

    start = time.perf_counter()
    cfg = ExportConfig(model=model, output=output, exporter=exporter, with_past=with_past)
    require_export_packages(cfg)
    # the exporters print their progress: on stderr with ours, stdout keeping the one line a script reads
    with unwind_on_sigterm(), contextlib.redirect_stdout(sys.stderr):  # a half-written export removed, as on Ctrl-C
        path = export_checkpoint(cfg, log=lambda message: click.echo(f"[INFO] {message}", err=True))
    click.echo(f"[INFO] wrote {path} in {time.perf_counter() - start:.1f} s", err=True)
    click.echo(f"atc --model={path} --framework=5 --output={path.parent / 'model'} --soc_version=Ascend910B "
               f"--enable_paged_attention={0 if _stateless_recurrence(path) else 1}")


def _stateless_recurrence(path) -> bool:
    """Whether the export runs a hybrid's recurrent ops without states to carry (`--no-past`), which only a
    contiguous compile runs (docs/exporting.md#hybrid-models-gated-delta-nets-short-convolutions-mamba-2)."""
    import onnx

    from cann_llm.runtime.ops import MICROSOFT_DOMAIN, RECURRENT_CONTRIB_OPS
    from cann_llm.runtime.signature import STATE_NAME

    graph = onnx.load(str(path), load_external_data=False).graph
    recurrent = any(n.domain == MICROSOFT_DOMAIN and n.op_type in RECURRENT_CONTRIB_OPS for n in graph.node)
    return recurrent and not any(STATE_NAME.match(value.name) for value in graph.input)
