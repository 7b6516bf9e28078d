"""Helpers of the native ops' tests: a session on the library built here, the float64 product a float32
matmul must come within rounding of, and operands ending at an inaccessible page."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from cann_llm.runtime.kernels import native
from cann_llm.runtime.ort_session import session_options


def native_session(model: onnx.ModelProto, library: Path | None = None) -> ort.InferenceSession:
    """`model` on two threads with the native library (this machine's, or `library`) registered."""
    options = session_options(2)
    options.register_custom_ops_library(str(library or native.library_path()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def assert_close_to_product(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """`y` is x · w within float32 rounding of its K products, relative to the sum of their magnitudes (a wrong
    column, k or missed outlier would be ~1)."""
    exact = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)) + 1e-30
    assert np.max(np.abs(y - exact) / scale) < 1e-5


def at_a_page_end(array: np.ndarray, keep: list) -> np.ndarray:
    """A copy of `array` ending where an inaccessible page begins: a read past its end faults. `keep` holds
    the mapping for as long as the copy is used."""
    page = mmap.PAGESIZE
    pages = -(-array.nbytes // page) + 1
    region = mmap.mmap(-1, pages * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    assert ctypes.CDLL(None).mprotect(ctypes.c_void_p(base + (pages - 1) * page), page, 0) == 0
    keep.append(region)
    copy = np.frombuffer(region, array.dtype, count=array.size, offset=(pages - 1) * page - array.nbytes)
    copy = copy.reshape(array.shape)
    copy[...] = array
    return copy
