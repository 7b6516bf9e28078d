"""Export a local Hugging Face checkpoint folder or a GGUF file to ONNX, as `cann-run export` does.

    export_checkpoint(ExportConfig(model="HF_DIR or x.gguf", output="out"))

writes out/model.onnx (external data beside it when the weights are large) with KV-cache I/O, the
tokenizer files and the generation config, so that `atc --model=out/model.onnx` finds the tokenizer.
Attention is transformers' default implementation (`sdpa`), as users export. Everything is written into
a staging folder inside the output folder and moved into place at the end, model.onnx last: a failed
export leaves the output folder as it was, and a repeated one leaves none of the earlier export's files that
it did not write itself (the user's other files are kept). Failures the user can cause are `AtcError`s with ATC's codes.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cann_llm.compiler.tokenizer_files import TOKENIZER_FILES  # what atc packs into the artifact
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.safe_files import FILE_MODE

EXPORTERS = ("dynamo", "torchscript")
# protobuf cannot hold a model over 2 GiB; well below that, one file is easier to carry around
EXTERNAL_DATA_BYTES = 256 << 20
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")
GGUF_MAGIC = b"GGUF"
# what torch.load's RuntimeError says of a file it cannot read, as opposed to any other failure while loading
_DAMAGED = ("PytorchStreamReader", "corrupted", "invalid load key", "unexpected EOF")


@dataclass(frozen=True)
class ExportConfig:
    """The flags of `cann-run export`."""

    model: str                    # a checkpoint folder (config.json + weights) or a .gguf file
    output: str                   # the folder that receives model.onnx
    exporter: str = "dynamo"      # dynamo | torchscript
    with_past: bool = True        # KV-cache inputs and outputs

    def __post_init__(self):
        if self.exporter not in EXPORTERS:
            raise AtcError("E10001", self.exporter, "--exporter", f"The value must be one of {', '.join(EXPORTERS)}.")
        if not Path(self.model).exists():  # before whether the export's packages are installed
            raise AtcError("E13001", self.model, "No such file or directory")


@dataclass
class LoadedCheckpoint:
    """A transformers model ready to export, and where its tokenizer comes from."""

    model: object
    tokenizer_folder: Path | None = None   # copy the tokenizer files found here
    tokenizer: object = None               # or save this tokenizer (GGUF, sentencepiece-only checkpoints)


def require_export_packages(cfg: ExportConfig) -> None:
    """E10055 naming the extra to install when a package this export needs is missing (they are the
    `models` extra, not the runtime's dependencies)."""
    require_packages(["torch", "transformers", *(["onnxscript"] if cfg.exporter == "dynamo" else []),
                      *(["gguf"] if cfg.model.endswith(".gguf") else [])])


def require_packages(needed: list[str]) -> None:
    """E10055 naming the `models` extra when any of the `needed` packages cannot be imported."""
    missing = []
    for name in needed:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise AtcError("E10055", f"exporting needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                                 f"not installed: pip install 'cann-llm[models]'")


def is_gguf(path: Path) -> bool:
    """True if the file starts with GGUF's magic."""
    with open(path, "rb") as handle:
        return handle.read(4) == GGUF_MAGIC


def load_checkpoint(source: str | os.PathLike) -> LoadedCheckpoint:
    """The causal LM (float32) of a checkpoint folder or a GGUF file, with transformers' default attention."""
    path = Path(source)
    if not path.exists():
        raise AtcError("E13001", path, "No such file or directory")
    if path.is_file():
        if not is_gguf(path):
            raise _not_a_checkpoint(path, "it is a file but not a GGUF file")
        return load_gguf(path)
    if not (path / "config.json").is_file():
        raise _not_a_checkpoint(path, "the folder has no config.json")
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_FILES):
        raise _not_a_checkpoint(path, "the folder has a config.json but no weights (*.safetensors or pytorch_model*.bin)")
    config = _causal_lm_config(path)
    model = _from_pretrained(str(path), config=config)
    if (path / "tokenizer.json").is_file():
        return LoadedCheckpoint(model, tokenizer_folder=path)
    return LoadedCheckpoint(model, tokenizer=_auto_tokenizer(str(path)))


def load_gguf(path: Path) -> LoadedCheckpoint:
    """A GGUF file through transformers (weights dequantised), checked against the file's own rope theta."""
    from transformers import AutoTokenizer

    model = _from_pretrained(str(path.parent), gguf_file=path.name)
    check_rope_theta(model.config, gguf_rope_theta(path))
    return LoadedCheckpoint(model, tokenizer=AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))


def gguf_rope_theta(path: Path) -> float | None:
    """`{architecture}.rope.freq_base` of a GGUF file, if it has one."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    architecture = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{architecture}.rope.freq_base")
    return None if field is None else float(field.contents())


def config_rope_theta(config) -> float | None:
    """The rope theta a transformers config carries (transformers 5 keeps it in `rope_parameters`)."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    return None if theta is None else float(theta)


def check_rope_theta(config, expected: float | None) -> None:
    """A loader that fell back to a default theta would export a model that talks garbage; refuse it."""
    if expected is None:
        return
    theta = config_rope_theta(config)
    if theta is None or abs(theta - expected) > 1e-3 * expected:
        raise AtcError("E10055", f"the loaded model has rope theta {theta}, the GGUF file says {expected}")


def _not_a_checkpoint(path: Path, why: str) -> AtcError:
    return AtcError("E10001", path, "--model",
                    f"Not a Hugging Face checkpoint (config.json and safetensors or .bin weights) nor a GGUF file: {why}.")


def _causal_lm_config(path: Path):
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError) as error:
        raise AtcError("E10055", f"the architecture in {path / 'config.json'} is unknown to transformers",
                       reason=str(error)) from None
    except OSError as error:
        raise _not_a_checkpoint(path, f"config.json cannot be read ({error})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise AtcError("E10055", f"{config.model_type} is not a causal language model transformers can load "
                       "as AutoModelForCausalLM")
    return config


def _from_pretrained(location: str, **kwargs):
    import pickle

    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        # float32 whatever the checkpoint stores: the paged kernels and the fusions work on float32 graphs;
        # mismatched sizes are loaded so that their names can be reported (transformers only prints them)
        model, loading = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, output_loading_info=True,
                                                              ignore_mismatched_sizes=True, **kwargs)
    except ValueError as error:  # e.g. "GGUF model with architecture x is not supported yet."
        raise AtcError("E10055", f"transformers cannot load {kwargs.get('gguf_file', location)}",
                       reason=str(error)) from None
    except OSError as error:
        raise AtcError("E13001", location, str(error).splitlines()[0] if str(error) else "unreadable") from None
    except NotImplementedError as error:  # gguf-py: an architecture or a quantization it does not know
        raise AtcError("E10055", f"transformers cannot load {kwargs.get('gguf_file', location)}",
                       reason=str(error) or type(error).__name__) from None
    except (SafetensorError, RuntimeError, pickle.UnpicklingError, EOFError) as error:
        # a truncated or damaged weight file: safetensors' header check, torch.load's zip reader, pickle;
        # any other RuntimeError (memory running out, say) is not the file's
        if isinstance(error, RuntimeError) and not any(word in str(error) for word in _DAMAGED):
            raise
        first = str(error).strip().split(". ")[0] if str(error).strip() else type(error).__name__
        raise AtcError("E13001", location, f"its weights cannot be read ({first})") from None
    _check_loaded_weights(location, loading)
    if hasattr(model, "set_experts_implementation"):
        # the default grouped experts cannot be exported; batched_mm runs every expert on every token
        model.set_experts_implementation("batched_mm")
    return model.eval()


def _check_loaded_weights(location: str, loading: dict) -> None:
    """A weight the architecture needs that the checkpoint lacks, or holds with other sizes than config.json
    gives, would be left randomly initialised: an export of it would talk garbage."""
    mismatched = sorted(loading.get("mismatched_keys") or ())
    missing = sorted(loading.get("missing_keys") or ())
    if mismatched:
        name, stored, expected = mismatched[0]
        more = f" and {len(mismatched) - 1} more" if len(mismatched) > 1 else ""
        raise AtcError("E10001", location, "--model", f"Its weights do not have the sizes its config.json gives: "
                       f"{name} is {list(stored)} in the weights, {list(expected)} by the config{more}.")
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise AtcError("E10001", location, "--model", f"Its weights lack {missing[0]}{more}, which the architecture "
                       "in its config.json needs.")


def _auto_tokenizer(location: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(location)
    except (OSError, ValueError, TypeError):
        return None  # a model without a tokenizer still exports; atc then compiles it without one


def export_checkpoint(cfg: ExportConfig, log: Callable[[str], None] = lambda message: None) -> Path:
    """Load `cfg.model`, export it into `cfg.output`; returns the path of model.onnx."""
    from cann_llm.models.export import export_causal_lm
    from cann_llm.models.recurrent_export import Unexportable

    output = Path(cfg.output)
    if output.exists() and not output.is_dir():
        raise AtcError("E13004", output, "it exists and is not a folder")
    log(f"loading {cfg.model} ...")
    loaded = load_checkpoint(cfg.model)
    architecture = type(loaded.model).__name__
    created = not output.exists()
    try:
        output.mkdir(parents=True, exist_ok=True)
        # a private staging folder inside the output, so the final renames stay on one file system
        staging = Path(tempfile.mkdtemp(prefix=".export-", dir=output))
    except OSError as error:
        raise AtcError("E13004", output, error.strerror or str(error)) from None
    try:
        _write_tokenizer(loaded, staging)
        loaded.model.generation_config.save_pretrained(str(staging))
        large = sum(p.numel() * p.element_size() for p in loaded.model.parameters()) >= EXTERNAL_DATA_BYTES
        log(f"exporting {architecture} with the {cfg.exporter} exporter "
            f"({'with' if cfg.with_past else 'without'} KV cache) ...")
        try:
            export_causal_lm(loaded.model, staging / "model.onnx", dynamo=cfg.exporter == "dynamo",
                             with_past=cfg.with_past, external_data=large)
        except Unexportable as error:  # what the other exporter would meet too
            raise AtcError("E10055", f"{architecture} cannot be exported", reason=str(error)) from None
        except Exception as error:  # the exporters raise anything; the user gets the line that names the cause
            other = "torchscript" if cfg.exporter == "dynamo" else "dynamo"
            raise AtcError("E10055", f"the {cfg.exporter} exporter cannot export {architecture} (try --exporter "
                                     f"{other})", reason=_cause(error)) from None
        _move_into_place(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            shutil.rmtree(output, ignore_errors=True)
        raise
    staging.rmdir()
    return output / "model.onnx"


def _move_into_place(staging: Path, output: Path) -> None:
    """The staged export into `output`, model.onnx last (a folder holding it holds everything it needs). An
    earlier export's files that this one did not write are removed first: atc packs every tokenizer file
    beside the model, and a stale chat template or external data file would be read as this export's."""
    written = {item.name for item in staging.iterdir()}
    # the earlier model.onnx first: stopped in between, the folder holds no model that lacks its files
    for name in ("model.onnx", *TOKENIZER_FILES, "model.onnx.data"):
        if (name == "model.onnx" or name not in written) and (output / name).is_file():
            (output / name).unlink()
    for item in sorted(staging.iterdir(), key=lambda p: p.name == "model.onnx"):
        # as a plainly created file would be: the exporter writes its external data with mkstemp's 0600,
        # which another user's atc could not read
        os.chmod(item, FILE_MODE)
        item.replace(output / item.name)


def _write_tokenizer(loaded: LoadedCheckpoint, folder: Path) -> None:
    if loaded.tokenizer_folder is not None:
        for name in TOKENIZER_FILES:
            if (loaded.tokenizer_folder / name).is_file():
                shutil.copyfile(loaded.tokenizer_folder / name, folder / name)
    elif loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(str(folder))


def _cause(error: Exception) -> str:
    """The line of an exporter's error that names what it could not convert: dynamo's ends on advice to debug
    and report, its op (`No ONNX function found for prims.erf_inv`) comes first; TorchScript's is its last."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    named = next((line for line in lines if "No ONNX function found" in line or "is not supported" in line), None)
    return named or (lines[-1] if lines else type(error).__name__)
