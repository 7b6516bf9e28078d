"""The ahead-of-time compiler: ONNX in, `.om` out."""

__version__ = "0.1.0"
