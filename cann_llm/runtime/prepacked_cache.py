"""onnxruntime's pre-packed weights kept on disk, so processes serving one artifact share them.

onnxruntime re-lays constant matmul weights into its kernels' packed format when a session is built, on the
heap: every process serving an artifact then holds its own copy of nearly the whole model, however the
artifact's weights are mapped. Saved as an optimised model whose pre-packed weights sit in external data
(onnxruntime's `session.save_external_prepacked_constant_initializers`), they are memory-mapped on load
instead, so the page cache holds one copy for every process. The packed layout depends on onnxruntime's
version and on the CPU's instruction set, so the cache key covers both with the segment's own bytes; the
first load of an artifact on a machine writes it (about twice the artifact's size), later loads map it.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import onnxruntime as ort

from cann_llm.runtime.compatibility import cpu_features
from cann_llm.runtime.cache_home import cache_home

MODEL, DATA = "model.onnx", "model.data"
SAVE_OPTIONS = {"session.optimized_model_external_initializers_file_name": DATA,
                "session.optimized_model_external_initializers_min_size_in_bytes": "1024",
                "session.save_external_prepacked_constant_initializers": "1"}


def prepacked_model(segment: bytes, artifact_key: bytes, build: Callable[[str], None]) -> Path:
    """The saved model of `segment` (serialised ONNX) with its pre-packed weights external, built by
    `build(path)` on first use: `build` creates a session saving its optimised model to `path`. Written
    to a private folder and renamed into place, so concurrent first loads never read a half-written one."""
    digest = hashlib.sha256()
    for part in (segment, artifact_key, ort.__version__.encode(), " ".join(sorted(cpu_features())).encode()):
        digest.update(hashlib.sha256(part).digest())
    # not user_cache_dir's private fallback: a copy no other process finds shares nothing
    folder = cache_home() / "prepacked" / digest.hexdigest()[:32]
    if (folder / MODEL).exists():
        return folder / MODEL
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=folder.parent))
    try:
        build(str(staging / MODEL))
        try:
            staging.rename(folder)
        except OSError:  # another process put it in place first: use theirs
            if not (folder / MODEL).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder / MODEL
