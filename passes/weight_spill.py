"""Weights a compile makes, kept on disk until the artifact is written rather than in its memory.

The quantizer packs each weight as it reaches it; held in memory, the packed weights of the whole model
would be in the compile's resident set until the writer streams them (an INT4 model's artifact size again,
35 GB for 70B parameters). `WeightSpill.keep` writes each one to a file of its own in a scratch folder
and hands back a read-only map of it: the compile holds page cache, which the kernel writes back and
reclaims under pressure, and the writer reads the map as it would the array. The folder lives beside the
output and goes when the compile ends, however it ends (`weight_spill`).
"""

from __future__ import annotations

import contextlib
import itertools
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

from runtime.artifact import EXTERNAL_MIN_BYTES

SPILL_PREFIX = ".atc-weights-"


class WeightSpill:
    """Files in `folder`, one per kept array."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._names = itertools.count()

    def keep(self, values: np.ndarray) -> np.ndarray:
        """`values` written to a file and mapped back read-only; arrays the artifact stores inline (smaller
        than its external threshold) are returned as they are."""
        values = np.ascontiguousarray(values)
        if values.nbytes < EXTERNAL_MIN_BYTES:
            return values
        path = self.folder / f"{next(self._names)}.bin"
        with open(path, "wb") as handle:
            handle.write(memoryview(values.reshape(-1)).cast("B"))
        return np.memmap(path, dtype=values.dtype, mode="r", shape=values.shape)


@contextlib.contextmanager
def weight_spill(beside: Path) -> Iterator[WeightSpill]:
    """A spill in a fresh hidden folder in `beside` (the output's folder: a temporary folder may be memory),
    removed with its files when the block ends."""
    with tempfile.TemporaryDirectory(prefix=SPILL_PREFIX, dir=beside) as folder:
        yield WeightSpill(Path(folder))


def kept(spill: WeightSpill | None, values: np.ndarray) -> np.ndarray:
    """`values` through `spill` when there is one."""
    return values if spill is None else spill.keep(values)
