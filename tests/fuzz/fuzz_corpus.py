"""What the fuzzers mutate, and how one case is made: real tiny exports (cann_llm/models/tiny.py) as ONNX bases,
their compiled artifacts (paged with a tokenizer, contiguous with FusedAttention) as `.om` bases."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import onnx

from fuzz_choices import Choices
from fuzz_om import mutate_om
from fuzz_onnx import mutate_model

# (name, family, dynamo, with_past, compile flags): the shapes of graph the compiler sees most
ONNX_BASES = (
    ("llama-paged", "llama", False, True, {"enable_paged_attention": True}),
    ("llama-flash", "llama", False, True, {"enable_flash_attention": True}),
    ("gpt2-nokv", "gpt2", False, False, {}),
)
OM_BASES = ("llama-paged", "llama-flash", "gpt2-nokv")


@dataclass
class OnnxBase:
    name: str
    model: onnx.ModelProto  # with inferred value_info, so mutations can type what they build
    tokenizer: Path
    flags: dict


def onnx_bases() -> list[OnnxBase]:
    """The ONNX bases, exported on first use."""
    from cann_llm.models.tiny import tiny_onnx

    bases = []
    for name, family, dynamo, with_past, flags in ONNX_BASES:
        path = tiny_onnx(family, dynamo=dynamo, with_past=with_past)
        model = onnx.shape_inference.infer_shapes(onnx.load(path))
        bases.append(OnnxBase(name, model, path.with_name("tokenizer.json"), flags))
    return bases


def om_bases(folder: Path, bases: list[OnnxBase]) -> dict[str, bytes]:
    """The bytes of each base compiled (paged ones with the byte tokenizer)."""
    from cann_llm.compiler.compile import compile_model
    from cann_llm.compiler.config import CompileConfig

    compiled = {}
    for base in bases:
        if base.name not in OM_BASES:
            continue
        source = folder / f"src-{base.name}"
        source.mkdir(parents=True, exist_ok=True)
        onnx.save(base.model, source / "model.onnx")
        shutil.copy(base.tokenizer, source / "tokenizer.json")
        cfg = CompileConfig(model=str(source / "model.onnx"), framework=5, output=str(folder / base.name),
                            soc_version="Ascend910B", **base.flags)
        compiled[base.name] = compile_model(cfg).output.read_bytes()
    return compiled


def onnx_case(c: Choices, bases: list[OnnxBase], folder: Path) -> dict:
    """A mutated ONNX model (its tokenizer beside it) in `folder`; the case for fuzz_pool.Pool."""
    base = c.choice(bases)
    c.note(f"base {base.name}")
    model = mutate_model(base.model, c)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    shutil.copy(base.tokenizer, folder / "tokenizer.json")
    return {"kind": "onnx", "path": str(path), "flags": base.flags, "log": c.log}


def om_case(c: Choices, bases: dict[str, bytes], folder: Path) -> dict:
    """A mutated `.om` in `folder`; the case for fuzz_pool.Pool."""
    name = c.choice(sorted(bases))
    c.note(f"base {name}")
    data = mutate_om(bases[name], c)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.om"
    path.write_bytes(data)
    return {"kind": "om", "path": str(path), "log": c.log}


def failure_class(outcome: dict) -> str | None:
    """The class a bad outcome is counted under (None for success or a coded refusal)."""
    kind = outcome["outcome"]
    if kind in ("ok", "refused"):
        return None
    if kind == "error":
        return f"{outcome['type']} at {outcome['where']}"
    if kind == "crash":
        return f"crash (exit {outcome['returncode']})"
    return kind
