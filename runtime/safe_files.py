"""Every file cann-llm writes goes through here: a fresh temp file, created exclusively in the target's own
folder, renamed into place; a symbolic link at an output path is refused, never followed. So do the user's
text files it reads, for one coded error (E13001) whatever is wrong with them.

A predictable temp name (`.x.om.<pid>.tmp`) lets another user plant a symlink there and have us overwrite
the file it points to; `mkstemp` creates a name no one could have guessed, with O_EXCL, so it never opens
an existing file. The final `rename` replaces a directory entry and does not follow a link either, so even
a link planted after the check below cannot redirect the bytes: the check is there to say so clearly.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator

from runtime.errors import AtcError

# the permissions a plainly created file would get; mkstemp makes 0600. Read once: reading the umask means
# setting it, which is not thread-safe later in a process's life
_UMASK = os.umask(0o022)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK


def refuse_symlink(path: str | os.PathLike) -> Path:
    """`path` as a Path; E13004 when it is a symbolic link (dangling or not)."""
    path = Path(path)
    if path.is_symlink():
        raise AtcError("E13004", path, "the path is a symbolic link; cann-llm never writes through one")
    return path


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "wb", encoding: str | None = None) -> Iterator[IO]:
    """A handle on a fresh temp file beside `path`; on a clean exit the file is synced and renamed to `path`,
    on any exception it is removed and `path` is untouched. OS failures are E13004."""
    path = refuse_symlink(path)
    folder = path.parent
    if not folder.is_dir():
        raise AtcError("E13004", path, f"the directory {folder} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as error:
        raise AtcError("E13004", path, error.strerror) from None
    try:
        with os.fdopen(fd, mode, encoding=encoding) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, FILE_MODE)
        refuse_symlink(path)
        os.replace(tmp, path)
    except OSError as error:
        os.unlink(tmp)
        raise AtcError("E13004", path, error.strerror) from None
    except BaseException:
        os.unlink(tmp)
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """`data` atomically at `path` (see `atomic_writer`)."""
    with atomic_writer(path) as handle:
        handle.write(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    """`text` as UTF-8, atomically at `path` (see `atomic_writer`)."""
    write_bytes(path, text.encode("utf-8"))


def read_text(path: str | os.PathLike) -> str:
    """A user's UTF-8 text file (a chat template, a document); E13001 naming why it cannot be read."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except UnicodeDecodeError as error:
        raise AtcError("E13001", path, f"the file is not UTF-8 text: {error}") from None
    except OSError as error:
        raise AtcError("E13001", path, error.strerror or str(error)) from None


def open_append(path: str | os.PathLike) -> IO[str]:
    """A UTF-8 text handle appending to `path` (created if missing), refusing a symbolic link at `path`
    (O_NOFOLLOW: no window between a check and the open). For logs, which grow in place."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as error:
        if path.is_symlink():
            raise AtcError("E13004", path, "the path is a symbolic link; cann-llm never writes through one") from None
        raise AtcError("E13004", path, error.strerror) from None
    return os.fdopen(fd, "a", encoding="utf-8")


def make_dir(path: str | os.PathLike) -> Path:
    """`path` as a directory (parents included, existing ones kept), refusing a symbolic link at `path`."""
    path = refuse_symlink(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise AtcError("E13004", path, error.strerror) from None
    return path
