"""Standard ops that onnx's reference evaluator cannot run as exporters write them, replaced in the reference
backend (`reference_ops`): the numpy of each beside its OpRun class.

- GatherElements: onnx.reference gathers with `np.choose`, which takes at most 64 choices, so a gather
  along a longer axis fails (Optimum's GPT-J reads its 256-row rotary table with one, GatherElements on
  axis 1); `np.take_along_axis` has no such bound.
"""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun


def gather_elements(data: np.ndarray, indices: np.ndarray, axis: int = 0) -> np.ndarray:
    """ONNX GatherElements: negative indices count from the end of `axis`."""
    indices = np.asarray(indices, np.int64)
    return np.take_along_axis(data, np.where(indices < 0, indices + data.shape[axis], indices), axis=axis)


class GatherElements(OpRun):
    op_domain = ""

    def _run(self, data, indices, axis=None):
        return (gather_elements(data, indices, 0 if axis is None else axis),)


REPLACED: tuple[type[OpRun], ...] = (GatherElements,)
