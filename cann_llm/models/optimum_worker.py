"""Runs inside an optimum venv (transformers 4.57 and optimum-onnx, or the legacy one: transformers 4.37 and
optimum 1.17), never in the project's own venv.

    python -m cann_llm.models.optimum_worker [--form=FORM] SEED FAMILY CHECKPOINT OUTPUT [FAMILY CHECKPOINT OUTPUT ...]

exports each checkpoint folder into OUTPUT in one of Optimum's forms: `with-past` (the default), its
`text-generation-with-past` task (model.onnx); `no-past`, its `text-generation` task (model.onnx, no cache
inputs); `merged`, as Optimum before its single-graph exports did: the decoder without a cache and the one
with a cache, merged by `merge_decoders` into decoder_model_merged.onnx (an `If` on `use_cache_branch`).
In the legacy venv: `legacy`, optimum 1.17's `text-generation-with-past` export (model.onnx), and
`legacy-merged`, its `legacy=True` export (decoder_model_merged.onnx among the three files it writes),
both through TorchScript as every torch of that time exported (torch 2.13 defaults to dynamo).
CHECKPOINT `build` builds the tiny model here first (cann_llm.models.tiny.build_tiny_model, same sizes and seed,
this transformers' default attention).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path


TASKS = {"with-past": "text-generation-with-past", "no-past": "text-generation"}


def export(family: str, checkpoint: str, output: str, seed: int, form: str = "with-past") -> None:
    """Optimum's export of one checkpoint, as `optimum-cli export onnx --task ...` does (`form` above)."""
    from optimum.exporters.onnx import main_export

    with tempfile.TemporaryDirectory() as scratch:
        if checkpoint == "build":
            import transformers

            from cann_llm.models.tiny import TINY_FAMILIES, build_tiny_model

            # transformers' default: sdpa where this version's class has it, eager where not (GPT-2 before 4.42)
            sdpa = getattr(getattr(transformers, TINY_FAMILIES[family].model_class), "_supports_sdpa", False)
            checkpoint = f"{scratch}/{family}"
            build_tiny_model(family, seed, "sdpa" if sdpa else "eager").save_pretrained(checkpoint)
        if form == "merged":
            _merged_decoder(checkpoint, Path(output), Path(scratch))
        elif form.startswith("legacy"):
            _with_torchscript()
            main_export(checkpoint, output=output, task="text-generation-with-past", device="cpu",
                        legacy=form == "legacy-merged")
        else:
            main_export(checkpoint, output=output, task=TASKS[form], device="cpu")


def _with_torchscript() -> None:
    """`torch.onnx.export` as optimum 1.x called it in its time: the TorchScript exporter."""
    import torch

    export = torch.onnx.export
    if getattr(export, "torchscript_default", False):
        return

    def torchscript(*args, **kwargs):
        kwargs.setdefault("dynamo", False)
        return export(*args, **kwargs)

    torchscript.torchscript_default = True
    torch.onnx.export = torchscript


def _merged_decoder(checkpoint: str, output: Path, scratch: Path) -> None:
    from optimum.exporters.onnx.convert import export as export_onnx
    from optimum.exporters.tasks import TasksManager
    from optimum.onnx.graph_transformations import merge_decoders
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    config = TasksManager.get_exporter_config_constructor("onnx", model, task="text-generation-with-past",
                                                          library_name="transformers")
    for name, with_past in (("decoder_model.onnx", False), ("decoder_with_past_model.onnx", True)):
        export_onnx(model, config(model.config, task="text-generation", use_past=True, use_past_in_inputs=with_past),
                    scratch / name, opset=18)
    output.mkdir(parents=True, exist_ok=True)
    merge_decoders(scratch / "decoder_model.onnx", scratch / "decoder_with_past_model.onnx",
                   save_path=output / "decoder_model_merged.onnx")


def main(argv: list[str]) -> None:
    form = "with-past"
    if argv[0].startswith("--form="):
        form, argv = argv[0].removeprefix("--form="), argv[1:]
    seed, jobs = int(argv[0]), argv[1:]
    for index in range(0, len(jobs), 3):
        export(jobs[index], jobs[index + 1], jobs[index + 2], seed, form)


if __name__ == "__main__":
    main(sys.argv[1:])
