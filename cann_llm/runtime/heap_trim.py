"""Give the C heap's free pages back to the system once a model is loaded.

Loading leaves tens of MB freed but resident in glibc's heap: parsing the tokenizer's JSON (~23 MB for
SmolLM2's), building the sessions, the graph protos. glibc returns freed memory only from the top of the
heap, so it stays counted in the process's resident set for its whole life; `malloc_trim(0)` releases
every free page, wherever it is. Elsewhere than glibc (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache


@lru_cache(maxsize=1)
def _trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    """Return the C heap's free pages to the system (glibc's `malloc_trim(0)`); a no-op without glibc."""
    trim = _trim()
    if trim is not None:
        trim(0)
