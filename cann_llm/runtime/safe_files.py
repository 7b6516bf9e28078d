"""Every file cann-llm writes goes through here: a fresh temp file, created exclusively in the target's own
folder, renamed into place; a symbolic link at an output path is refused, never followed. So do the user's
text files it reads, for one coded error (E13001) whatever is wrong with them.

A predictable temp name (`.x.om.<pid>.tmp`) would let another user plant a symlink there and have us overwrite
the file it points to; `mkstemp` creates a name no one could have guessed, with O_EXCL, so it never opens
an existing file. The final `rename` replaces a directory entry and does not follow a link either, so even
a link planted after the check below cannot redirect the bytes: the check is there to say so clearly.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
from pathlib import Path
from typing import IO, Callable, Iterator

from cann_llm.runtime.errors import AtcError

# the permissions a plainly created file would get; mkstemp makes 0600. Read once: reading the umask means
# setting it, which is not thread-safe later in a process's life
_UMASK = os.umask(0o022)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK
SCRATCH_PREFIX = ".atc-scratch-"  # every temp file beside an output: `.atc-scratch-<maker>-<random>.tmp`


def _process_space() -> str:
    """What tells this machine's boot and process-id namespace from any other's: a pid names one process
    only within it (two containers may share a hostname and an output folder, each with its own pids; two
    machines may both be `localhost`). Linux's boot id and pid-namespace inode; the hostname elsewhere."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
            return boot.read().strip().replace("-", "")[:16] + "n" + str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname()) or "host"


_SPACE = _process_space()
_MAKER = re.compile(r"-(\d+)@([A-Za-z0-9_]+)-")  # `-<pid>@<space>-` inside a scratch name


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
    made: list[str] = []  # the temp file, once it is there to remove
    try:
        with signals_held():  # a signal between the file's making and its name being kept would leave it
            try:
                fd, tmp = tempfile.mkstemp(dir=folder, prefix=f"{SCRATCH_PREFIX}{maker()}-", suffix=".tmp")
            except OSError as error:
                raise AtcError("E13004", path, error.strerror) from None
            made.append(tmp)
        with os.fdopen(fd, mode, encoding=encoding) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, FILE_MODE)
        refuse_symlink(path)
        os.replace(tmp, path)
    except OSError as error:
        for tmp in made:
            os.unlink(tmp)
        raise AtcError("E13004", path, error.strerror) from None
    except BaseException:
        for tmp in made:
            os.unlink(tmp)
        raise


def maker() -> str:
    """`<pid>@<process space>`, put in every scratch name so that `reap_abandoned` can tell whose maker is
    gone (`-` around it in the name)."""
    return f"{os.getpid()}@{_SPACE}"


def reap_abandoned(folder: str | os.PathLike, *prefixes: str) -> list[Path]:
    """Remove the scratch files and folders in `folder` whose names start with one of `prefixes` and whose
    maker, a process of this boot and pid namespace, is gone: one killed by SIGKILL or the OOM killer
    cleans up nothing, and a weights scratch folder of a large model is gigabytes. A maker still running,
    or of another machine or container sharing the folder, is left alone. Returns what was removed."""
    removed = []
    for prefix in prefixes:
        for path in Path(folder).glob(glob.escape(prefix) + "*"):
            made = _MAKER.search(path.name[len(prefix) - 1:])
            if made is None or made.group(2) != _SPACE or _running(int(made.group(1))) or path.is_symlink():
                continue
            try:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            except OSError:  # another user's, or gone meanwhile: not ours to insist on
                continue
            removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class Staged:
    """Files written under hidden names beside where they go, then put in place together by `commit`, or
    removed, leaving every target as it was: a compile's artifact and its fusion_result.json are both new or
    both as they were, whatever stops it."""

    def __init__(self):
        self._pairs: list[tuple[Path, Path]] = []

    def path(self, final: str | os.PathLike) -> Path:
        """A fresh hidden file beside `final`, to write in full (renamed over it by `commit`); E13004 when
        `final` could not be replaced (a link, a directory) or its folder takes no new file."""
        final = _replaceable(final)
        with signals_held():  # made and kept in the list at once: `discard` finds every one
            try:
                fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f"{SCRATCH_PREFIX}{maker()}-", suffix=".tmp")
            except OSError as error:
                raise AtcError("E13004", final, error.strerror) from None
            os.close(fd)
            self._pairs.append((Path(tmp), final))
        return Path(tmp)

    def commit(self, then: Callable[[], None] | None = None) -> None:
        """Rename every staged file over its target, with SIGINT and SIGTERM held until all are in place and
        `then` has run."""
        with signals_held():
            for _, final in self._pairs:  # every target before the first rename: all of them, or none
                _replaceable(final)
            for tmp, final in self._pairs:
                try:
                    os.chmod(tmp, FILE_MODE)
                    os.replace(tmp, final)
                except OSError as error:
                    raise AtcError("E13004", final, error.strerror) from None
            self._pairs.clear()
            if then is not None:
                then()

    def discard(self) -> None:
        """Remove what was staged and not committed."""
        for tmp, _ in self._pairs:
            tmp.unlink(missing_ok=True)
        self._pairs.clear()


def _replaceable(final: Path) -> Path:
    """`final`, refused (E13004) where a rename could not put a file: a link, a directory."""
    if refuse_symlink(final).is_dir():
        raise AtcError("E13004", final, "the path is a directory")
    return final


@contextlib.contextmanager
def staged() -> Iterator[Staged]:
    """A `Staged` whose uncommitted files are removed when the block ends, however it ends."""
    stage = Staged()
    try:
        yield stage
    finally:
        stage.discard()


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM arriving in the block are handled when it ends, by the handlers they had, or by the
    ones the block set for them (only the main thread can hold them: elsewhere the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum, frame) -> None:
        held.append(signum)

    saved = {kind: signal.signal(kind, hold) for kind in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for kind, handler in saved.items():
            if signal.getsignal(kind) is hold:  # else the block set its own: it stays
                signal.signal(kind, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)


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
