"""The public Python face of the project: `from cann_llm import ...`."""

from compiler import __version__
from compiler.compile import compile_model
from compiler.config import CompileConfig
from runtime import Executor, LoadedModel, load_artifact

__all__ = ["CompileConfig", "Executor", "LoadedModel", "__version__", "compile_model", "load_artifact"]
