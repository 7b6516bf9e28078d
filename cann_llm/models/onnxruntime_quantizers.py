"""Models as onnxruntime's own tools write them, as users run the tools: `quantize_dynamic`,
`MatMulNBitsQuantizer`, Optimum's dynamic ORTQuantizer (in the optimum venv, cann_llm/models/optimum_export.py), and a
session's saved optimizations. For tests and benchmarks.

Each tool runs in a process of its own: `onnxruntime.quantization` imports a top-level `fusion_utils` module,
which the test suite's tests/fusion_utils.py would shadow in the tests' process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# given a path, quantize_dynamic writes `<model>-inferred.onnx` beside it and deletes it after: two runs on one
# model at once (test workers) would race for that file; given the model, it infers in a folder of its own
_QUANTIZE_DYNAMIC = ("import sys, onnx\nfrom onnxruntime.quantization import QuantType, quantize_dynamic\n"
                     "quantize_dynamic(onnx.load(sys.argv[1]), sys.argv[2], {options})\n")
_MATMUL_NBITS = ("import sys, onnx\n"
                 "from onnxruntime.quantization import QuantFormat\n"
                 "from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer\n"
                 "quantizer = MatMulNBitsQuantizer(onnx.load(sys.argv[1]), block_size={block_size}, "
                 "is_symmetric={symmetric}, accuracy_level={accuracy_level}, quant_format=QuantFormat.{format})\n"
                 "quantizer.process()\n"
                 "quantizer.model.save_model_to_file(sys.argv[2])\n")
_SAVED_BY_A_SESSION = ("import onnxruntime as ort, sys\n"
                       "options = ort.SessionOptions()\n"
                       "options.graph_optimization_level = ort.GraphOptimizationLevel.{level}\n"
                       "options.optimized_model_filepath = sys.argv[2]\n"
                       "ort.InferenceSession(sys.argv[1], options, providers=['CPUExecutionProvider'])\n")
_OPTIMUM_DYNAMIC = ("import sys, shutil\n"
                    "from optimum.onnxruntime import ORTQuantizer\n"
                    "from optimum.onnxruntime.configuration import AutoQuantizationConfig\n"
                    "quantizer = ORTQuantizer.from_pretrained(sys.argv[1], file_name='model.onnx')\n"
                    "quantizer.quantize(save_dir=sys.argv[2] + '.d', quantization_config=AutoQuantizationConfig."
                    "{config}(is_static=False, per_channel={per_channel}))\n"
                    "shutil.move(sys.argv[2] + '.d/model_quantized.onnx', sys.argv[2])\n"
                    "shutil.rmtree(sys.argv[2] + '.d')\n")


def _run(script: str, source: Path, target: Path, python: Path | str = sys.executable) -> Path:
    run = subprocess.run([str(python), "-c", script, str(source), str(target)], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"the quantizer failed on {source}:\n{run.stderr[-3000:]}")
    return target


def quantize_dynamic(source: Path, target: Path, **options: object) -> Path:
    """`quantize_dynamic(source, target, **options)`; each option's value is written into the quantizer's
    script as its `str()`: Python source such as `weight_type="QuantType.QUInt8"`, or a literal
    (`extra_options={"MatMulConstBOnly": False}`)."""
    return _run(_QUANTIZE_DYNAMIC.format(options=", ".join(f"{k}={v}" for k, v in options.items())), source, target)


def matmul_nbits(source: Path, target: Path, block_size: int = 32, symmetric: bool = True,
                 accuracy_level: int = 4, format: str = "QOperator") -> Path:
    """`MatMulNBitsQuantizer` (4 bits) on `source`: MatMulNBits (`format` QOperator), or blocked int4
    DequantizeLinear weights (QDQ, the opset raised to 21)."""
    return _run(_MATMUL_NBITS.format(block_size=block_size, symmetric=symmetric, accuracy_level=accuracy_level,
                                     format=format), source, target)


def saved_by_a_session(source: Path, target: Path, level: str = "ORT_ENABLE_EXTENDED") -> Path:
    """The graph an onnxruntime session saves after its optimizations at `level` (`optimized_model_filepath`),
    in a process of its own as a user's: a session saves the opset of every domain registered in its process,
    and the tests' process registers the cann ops."""
    return _run(_SAVED_BY_A_SESSION.format(level=level), source, target)


def optimum_dynamic(export: Path, target: Path, python: Path, config: str = "avx512_vnni",
                    per_channel: bool = False) -> Path:
    """Optimum's ORTQuantizer with the dynamic `AutoQuantizationConfig.<config>` on the Optimum export `export`
    (its folder's model.onnx), run by `python`, the optimum venv's."""
    return _run(_OPTIMUM_DYNAMIC.format(config=config, per_channel=per_channel), export.parent, target, python)
