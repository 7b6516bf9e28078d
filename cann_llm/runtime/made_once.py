"""Files that many processes want at once, made by one of them: the others wait for it and read its file.

Processes that start together (a server's replicas, test workers) ask for the same native library, export
or compile at the same moment; each making its own would spend the work once per process. An exclusive
`flock` on a lock file beside the target makes the first one build and the rest wait; the target is
checked again under the lock, so whoever waited finds it made. The maker must write the target atomically
(a temp file renamed into place): a reader that does not take the lock sees the whole file or none.
"""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Callable, Iterator


@contextlib.contextmanager
def exclusive(lock: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `lock` (created, with its folder, if missing) for the block."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def made_once(target: Path, make: Callable[[], object], lock_name: str = "make.lock") -> Path:
    """`target`, made by `make()` if no process has made it yet; concurrent callers wait for one maker
    (the lock is `lock_name` in the target's folder)."""
    if not target.exists():
        with exclusive(target.with_name(lock_name)):
            if not target.exists():
                make()
    return target
