"""The runtime: loads `.om` artifacts and executes them."""

import os

# onnxruntime's builds record their use (a device id and a database under ~/.cache/Microsoft, `.ses` files left
# in $TMPDIR) unless this says not to; it is read once, at its import. A user who sets it keeps their choice
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

from cann_llm.runtime.executor import Executor  # noqa: E402 - after the setting above
from cann_llm.runtime.loader import LoadedModel, load_artifact  # noqa: E402

__all__ = ["Executor", "LoadedModel", "load_artifact"]
