"""`atc` never imports torch, even where torch is installed (as it is beside these tests): onnxruntime's
symbolic shape inference, which ShapeInferencePass runs, lives in a package whose `__init__` imports torch
whenever it can, and a compile would carry 1.3 s and ~185 MB of a library it never calls."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from cann_llm.models.tiny import tiny_onnx

_COMPILE = """
import sys
from cann_llm.compiler.compile import compile_model
from cann_llm.compiler.config import CompileConfig

compile_model(CompileConfig(model=sys.argv[1], framework=5, output=sys.argv[2], soc_version="Ascend910B",
                            enable_paged_attention=True))
print("torch" in sys.modules, "onnxruntime.tools.symbolic_shape_infer" in sys.modules)
"""


def test_a_compile_that_runs_the_symbolic_shape_inference_imports_no_torch(tmp_path):
    assert importlib.util.find_spec("torch") is not None  # the tests' own environment: torch is there to import
    # a TorchScript export: its reshape targets are computed at run time, so the symbolic inference runs
    model = tiny_onnx("llama", dynamo=False, with_past=True)
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(model), str(tmp_path / "model")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True"]
