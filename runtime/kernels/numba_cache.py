"""Where numba keeps the machine code it compiles: a per-user cache directory, never the install.

numba's default (`__pycache__` beside the kernel sources) needs write access to the installed package;
as any other user, or from a read-only install, numba then finds "no locator available" and `atc` and
`cann-run` do not start. `NUMBA_CACHE_DIR` is read when numba is first imported, so this module sets it
before any kernel module imports numba (runtime/kernels/__init__.py imports it first). A directory the
user set already is kept.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def numba_cache_dir() -> Path:
    """`$NUMBA_CACHE_DIR` if set, else `$XDG_CACHE_HOME/cann-llm/numba` (XDG's default: ~/.cache)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cann-llm" / "numba"


os.environ["NUMBA_CACHE_DIR"] = str(numba_cache_dir())
if "numba" in sys.modules:  # imported before us (by the embedding program): numba reads the setting at cache time
    sys.modules["numba"].config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]
