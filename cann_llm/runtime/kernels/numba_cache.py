"""Where numba keeps the machine code it compiles: a per-user cache directory, never the install.

numba's default (`__pycache__` beside the kernel sources, else `~/.cache/numba`) needs write access to
the installed package or a home directory; as a service user (`nobody`, HOME=/nonexistent) over a
read-only install, numba finds "no locator available" when a kernel module is imported, and `atc` and
`cann-run` do not start. `NUMBA_CACHE_DIR` is read when numba is first imported, so this module sets it
before any kernel module imports numba (cann_llm/runtime/kernels/__init__.py imports it first):

- `$NUMBA_CACHE_DIR` when the user set it;
- else `$XDG_CACHE_HOME/cann-llm/numba` (XDG's default: ~/.cache), when it can be created and written;
- else a fresh private temp directory for this process, removed at exit: the kernels compile again in
  each process (seconds at every start, which W13004 says), but nothing runs from a directory another
  user could have prepared (numba's cache holds pickled code, so a shared, predictable /tmp path would be
  code execution for whoever made it).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from cann_llm.runtime.cache_home import cache_home

_KEPT = {"numba": "the numba kernels' machine code", "native": "the native kernel library"}


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def user_cache_dir(kind: str) -> Path:
    """`cache_home()/<kind>` when it can be created and written, else a fresh private temp directory for
    this process, removed at exit (see above for why never a shared, predictable one)."""
    preferred = cache_home() / kind
    if _writable(preferred):
        return preferred
    private = Path(tempfile.mkdtemp(prefix=f"cann-llm-{kind}-"))
    atexit.register(shutil.rmtree, private, ignore_errors=True)
    logging.getLogger("cann_llm").warning(
        "W13004: %s cannot be written: %s made in this process are not kept, and every process makes them again "
        "(set CANN_LLM_CACHE to a folder this user can write)", preferred, _KEPT.get(kind, kind))
    return private


def numba_cache_dir() -> Path:
    """The directory numba caches into, chosen as above (a private temp directory is created here)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"])
    return user_cache_dir("numba")


os.environ["NUMBA_CACHE_DIR"] = str(numba_cache_dir())
if "numba" in sys.modules:  # imported before us (by the embedding program): numba reads the setting at cache time
    sys.modules["numba"].config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]
