"""Weights a compile makes, kept on disk until the artifact is written rather than in its memory.

The quantizer packs each weight as it reaches it; held in memory, the packed weights of the whole model
would be in the compile's resident set until the writer streams them (an INT4 model's artifact size again,
35 GB for 70B parameters). `WeightSpill.keep` appends each one to a file in a scratch folder and hands back
`Deferred` values that read it back when something reads them, as the artifact writer does one weight at a
time (cann_llm/passes/weight_memory.py). Nothing stays open or mapped between reads: a model of any number of
weights holds no file descriptors for them. The folder lives beside the output (the output's disk needs
room for the packed weights twice while the artifact is written) and is removed when the compile returns
or raises (`weight_spill`); a process killed outright leaves its `.atc-weights-*` folder behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

from cann_llm.passes.weight_memory import Deferred
from cann_llm.runtime.artifact import EXTERNAL_MIN_BYTES
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.safe_files import maker, reap_abandoned, signals_held

SPILL_PREFIX = ".atc-weights-"


class WeightSpill:
    """One file in `folder` that kept arrays are appended to."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.path = folder / "weights.bin"
        self._end = 0

    def keep(self, values: np.ndarray) -> np.ndarray | Deferred:
        """`values` appended to the file, returned as `Deferred` values that read them back; arrays the artifact
        stores inline (smaller than its external threshold) are returned as they are. A failed write (a full
        disk) is E13004."""
        values = np.ascontiguousarray(values)
        if values.nbytes < EXTERNAL_MIN_BYTES:
            return values
        offset = self._end
        try:
            with open(self.path, "ab") as handle:
                handle.write(memoryview(values.reshape(-1).view(np.uint8)))
        except OSError as error:
            raise AtcError("E13004", self.path, error.strerror or str(error)) from None
        self._end += values.nbytes
        shape, dtype, path = values.shape, values.dtype, self.path
        return Deferred(shape, dtype, lambda: _read(path, offset, shape, dtype))


def _read(path: Path, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    with open(path, "rb") as handle:
        handle.seek(offset)
        values = np.fromfile(handle, dtype=np.uint8, count=count * dtype.itemsize)
    if values.size != count * dtype.itemsize:
        raise AtcError("E13001", path, f"it ends at {os.path.getsize(path)} bytes, inside the weight kept at {offset}")
    return values.view(dtype).reshape(shape)


@contextlib.contextmanager
def weight_spill(beside: Path) -> Iterator[WeightSpill]:
    """A spill in a fresh hidden folder in `beside` (the output's folder: a temporary folder may be memory),
    removed with its file when the block ends, by a return, an exception or a signal (held until it is gone).
    Those a killed compile left there are removed first (`reap_abandoned`)."""
    reap_abandoned(beside, SPILL_PREFIX)
    folder = None
    try:
        with signals_held():  # a signal between the folder's making and its name being kept would leave it
            try:
                folder = tempfile.mkdtemp(prefix=f"{SPILL_PREFIX}{maker()}-", dir=beside)
            except OSError as error:  # a folder the user cannot write (a read-only mount, /sys): the output's fault
                raise AtcError("E13004", beside, error.strerror or str(error)) from None
        yield WeightSpill(Path(folder))
    finally:
        if folder is not None:
            with signals_held():
                shutil.rmtree(folder, ignore_errors=True)


def kept(spill: WeightSpill | None, values: np.ndarray) -> np.ndarray | Deferred:
    """`values` through `spill` when there is one."""
    return values if spill is None else spill.keep(values)
