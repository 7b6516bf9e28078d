"""The project's cache folder, where kernels, pre-packed weights and generated models are kept outside the
install: `$CANN_LLM_CACHE`, else `$XDG_CACHE_HOME/cann-llm` (~/.cache/cann-llm). Reading it has no side
effects (cann_llm/runtime/kernels/numba_cache.py decides, at import, what numba writes where)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """The project's cache folder: `$CANN_LLM_CACHE`, else `$XDG_CACHE_HOME/cann-llm` (~/.cache/cann-llm)."""
    if os.environ.get("CANN_LLM_CACHE"):
        return Path(os.environ["CANN_LLM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cann-llm"
