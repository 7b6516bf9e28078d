"""Progress of long work on stderr: a tqdm bar on a terminal, plain lines in logs and pipes.

A bar redrawn with carriage returns turns a CI log into one unreadable line, so away from a terminal the
same calls print a line when the work starts, at most one every `LINE_INTERVAL` seconds while it runs,
and one when it ends, with the time it took.
"""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")
LINE_INTERVAL = 10.0


class Progress:
    """`with Progress("calibration", total=64, unit="sample") as bar: ... bar.update()`.

    `stream` defaults to stderr; `enabled=False` makes every call a no-op (library use, `--log=null`)."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "it", *, stream: TextIO | None = None,
                 enabled: bool = True):
        self.desc, self.total, self.unit = desc, total, unit
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.count = 0
        self._bar: tqdm | None = None
        self._start = self._last_line = 0.0

    def __enter__(self) -> "Progress":
        self._start = self._last_line = time.perf_counter()
        if not self.enabled:
            return self
        if _is_terminal(self.stream):
            self._bar = tqdm(desc=self.desc, total=self.total, unit=self.unit, file=self.stream, leave=False)
        else:
            self._line(f"{self.desc}: started" + (f", {self.total} {self.unit}s" if self.total else ""))
        return self

    def update(self, n: int = 1, status: str = "") -> None:
        """Count `n` more units done; `status` is a short note shown beside the count."""
        self.count += n
        if not self.enabled:
            return
        if self._bar is not None:
            if status:
                self._bar.set_postfix_str(status, refresh=False)
            self._bar.update(n)
            return
        now = time.perf_counter()
        if now - self._last_line >= LINE_INTERVAL:
            self._last_line = now
            of = f"/{self.total}" if self.total else ""
            self._line(f"{self.desc}: {self.count}{of} {self.unit}s" + (f" ({status})" if status else ""))

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._bar is not None:
            self._bar.close()
        if self.enabled and exc_type is None:
            self._line(f"{self.desc}: {self.count} {self.unit}s in {self.elapsed:.1f} s")

    @property
    def elapsed(self) -> float:
        """Seconds since the work started."""
        return time.perf_counter() - self._start

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it", *,
             enabled: bool = True) -> Iterator[T]:
    """`items`, reporting each one taken as a unit of progress."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(desc, total, unit, enabled=enabled) as bar:
        for item in items:
            yield item
            bar.update()


def note(text: str, *, stream: TextIO | None = None, enabled: bool = True) -> None:
    """One line of progress, a step done (`[ 3/27] SomePass  matched 2, applied 2  0.41 s`): printed above
    any bar running on a terminal, as a plain line in logs."""
    if not enabled:
        return
    stream = stream or sys.stderr
    if _is_terminal(stream):
        tqdm.write(text, file=stream)
    else:
        print(text, file=stream, flush=True)


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
