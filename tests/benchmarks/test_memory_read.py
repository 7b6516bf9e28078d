"""benchmarks/memory_read.py: the reads behind the bandwidth ceiling, one stream and four, read every float they
are given, in C where the machine has a compiler, and threads reading parts add up to the whole."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from memory_read import part_reader  # noqa: E402

from cann_llm.runtime.kernels.native import c_compiler  # noqa: E402

pytestmark = pytest.mark.unit


def test_the_read_is_the_c_probe_where_a_compiler_builds_it():
    assert part_reader()[0] == ("C" if c_compiler() else "numba")


@pytest.mark.parametrize("count", [1, 63, 64, 65, 1_000_003])
def test_a_read_sums_every_float_including_those_past_the_last_full_block(count):
    values = np.arange(count, dtype=np.float32) % 7  # small integers: every partial sum is exact in float32
    _, read = part_reader()
    assert read(values) == float(values.sum(dtype=np.float64))


def test_parts_read_on_threads_cover_the_buffer():
    values = np.ones(3_000_001, np.float32)
    _, read = part_reader()
    with ThreadPoolExecutor(2) as pool:
        assert sum(pool.map(read, np.array_split(values, 2))) == values.size


@pytest.mark.parametrize("count", [1, 63, 64, 255, 256, 257, 1_000_003])
def test_the_four_stream_read_sums_every_float_including_those_after_its_four_parts(count):
    values = np.arange(count, dtype=np.float32) % 7
    _, read = part_reader(4)
    assert read(values) == float(values.sum(dtype=np.float64))
