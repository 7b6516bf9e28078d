"""Shared fixtures: exported tiny models (cached on disk), the SmolLM2 export, a compile helper, and the native
library built for CPUs with AVX2 alone."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from cann_llm.compiler.compile import compile_model
from cann_llm.compiler.config import CompileConfig
from cann_llm.models.fixtures import TINY_EXPORTS
from cann_llm.runtime.made_once import made_once
from cann_llm.runtime.ort_session import session_options

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# every tiny family × exporter × {prefill, KV cache} × attention, as cann_llm/models/fixtures.py says and makes
EXPORTS = TINY_EXPORTS


def export_id(case) -> str:
    family, dynamo, with_past, attention = case
    return f"{family}-{'dynamo' if dynamo else 'ts'}-{'kv' if with_past else 'nokv'}-{attention}"


def pytest_configure(config):
    # `make test` runs two workers on two cores: torch's pool of a thread per core in each spun against the
    # other's, and transformers' reference generation of a tiny model ran 2.4-8x slower than on one thread
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _logging_as_it_was():
    """Commands run in-process (`atc`'s run, click's CliRunner with --log-level) configure the root and `atc`
    loggers; each test starts from the state before it, so none depends on which test ran before it."""
    loggers = [logging.getLogger(), logging.getLogger("atc")]
    saved = [(logger.handlers[:], logger.level) for logger in loggers]
    yield
    for logger, (handlers, level) in zip(loggers, saved):
        logger.handlers[:] = handlers
        logger.setLevel(level)


@pytest.fixture(scope="session")
def tiny_llama_path() -> Path:
    """The TorchScript export of tiny Llama with KV-cache I/O."""
    from cann_llm.models.tiny import tiny_onnx

    return tiny_onnx("llama", dynamo=False, with_past=True)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct exported with KV cache (dynamo), prepared once per cache."""
    from cann_llm.models.prepare import smollm2_onnx

    return smollm2_onnx()


@pytest.fixture(scope="session")
def avx2_library() -> Path:
    """The native library built with `-mno-avx512f`: its MatMulInt4 and attention tiles are the AVX2 kernels
    (on an AVX-512 machine, the library built here takes the others)."""
    from cann_llm.runtime.kernels import native

    built = native.library_path(("-mno-avx512f",))
    assert native.matmul_kernel(built) == 256
    return built


def compile_to(model: Path, output: Path, **flags) -> Path:
    """Compile with the Python API (the same config the CLI builds); returns the .om path."""
    cfg = CompileConfig(model=str(model), framework=5, output=str(output), soc_version="Ascend910B", **flags)
    return compile_model(cfg).output


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    """`compiled(model, **flags)`: the .om of `model` compiled with `flags`, made once per test run and shared
    by the test workers (two compiles give identical bytes: tests/test_parity.py), for tests that only read
    it; a test that changes its artifact, or whose subject is the compile, compiles its own."""
    root = tmp_path_factory.getbasetemp()
    root = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "compiled"

    defaults = {f.name: f.default for f in dataclasses.fields(CompileConfig)}

    def compile_once(model: Path, **flags) -> Path:
        # a flag at its default compiles what its absence does; a flag naming a file (a paged or
        # fusion-switch config written per test) is keyed by what the file says
        said = {key: Path(value).read_text() if isinstance(value, str) and os.path.isfile(value) else value
                for key, value in flags.items() if not _at_default(value, defaults.get(key, dataclasses.MISSING))}
        key = hashlib.sha1(json.dumps([str(model), sorted(said.items())], default=str).encode()).hexdigest()[:16]
        output = root / key / "model.om"
        # the compile writes the .om atomically: it exists whole or not at all
        return made_once(output, lambda: compile_to(model, output.with_suffix(""), **flags), "compile.lock")

    return compile_once


def _at_default(value, default) -> bool:
    """`value` is the field's default, of its type too: the metadata records `True` and `1` apart."""
    return type(value) is type(default) and value == default


def ort_reference(model: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """onnxruntime on the original model, graph optimisations off so nothing can hide a difference."""
    options = session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))
