"""`fast_exp`: exp for numba loops that the compiler can vectorize; `np.exp` is its reference.

numba turns `np.exp` on a scalar into a call to libm's expf, which LLVM cannot vectorize (there is no SVML
here): in a decode step's attention, one exp per query·key pair took a third of the kernel's time. This
is Cephes' expf (range reduction by ln 2, a degree-7 polynomial, the exponent written into the float's
bits) in plain arithmetic, so the loops around it vectorize (docs/performance.md#paged-attention-kernels),
relative error under 3e-7 for x >= -87 (below that it returns exp(-87), ~1.6e-38, where float32 is
already denormal).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_LOWEST = np.float32(-87.0)


@intrinsic
def _float32_from_bits(typingctx, bits):
    signature = types.float32(types.int32)

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return signature, codegen


# numba code here calls these, not the builtins: torch.export replaces builtins.max and min process-wide while
# it traces, so a kernel that the executor's warm-up thread compiled meanwhile (a process exporting and
# serving) failed, and numba keeps a failed compile: the kernel failed for the rest of the process. Same
# results as the builtins, NaN included: the first argument unless the second compares greater (smaller).
@numba.njit(inline="always")
def larger(a, b):
    """max(a, b) inside numba code."""
    return b if b > a else a


@numba.njit(inline="always")
def smaller(a, b):
    """min(a, b) inside numba code."""
    return b if b < a else a


@numba.njit(fastmath=True, error_model="numpy", inline="always")
def fast_exp(x):
    """exp(x) for a float32 scalar inside numba code."""
    x = larger(x, _LOWEST)
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * _float32_from_bits(np.int32(n + np.float32(127.0)) << 23)


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def fast_exp_array(x: np.ndarray, out: np.ndarray) -> None:
    """`fast_exp` over a 1-D array (what the tests hold against np.exp)."""
    for i in range(x.shape[0]):
        out[i] = fast_exp(x[i])
