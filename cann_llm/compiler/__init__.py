"""The ahead-of-time compiler: ONNX in, `.om` out."""

__version__ = "0.1.0"

import cann_llm.runtime  # noqa: E402,F401 - its settings of onnxruntime come before any import of onnxruntime here
