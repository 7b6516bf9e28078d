"""The runtime: loads `.om` artifacts and executes them."""

from runtime.executor import Executor
from runtime.loader import LoadedModel, load_artifact

__all__ = ["Executor", "LoadedModel", "load_artifact"]
