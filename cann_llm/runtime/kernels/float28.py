"""F28: float32 matmul weights stored in 28 bits each, losslessly, and the MatMulF28 op that reads them.

A float32 weight is a sign, an 8-bit exponent and a 23-bit mantissa. A trained matrix's nonzero weights
span few binades: nearly all of them fall in one window of 15 exponents, so each weight keeps its sign and
mantissa and a 4-bit code for its exponent in the window (`bias` + 1 .. `bias` + 15); code 0 is a zero.
The few weights outside the window (tiny ones, denormals, -0.0) are coded 0 and listed beside the matrix as
exceptions, with their exact values. A batch-1 decode step reads every weight once, so reading 3.5 bytes a
weight instead of 4 makes an FP32 step's matmuls ~12% shorter, with the float32 model's values exactly.

Layout (`pack`), for a MatMul's B `[K, N]`: panels of 16 columns (the last one zero-padded), each stored k
by k as 16 codes of 28 bits in 56 bytes (code j at bits 28j .. 28j+27, little-endian): `packed` uint8
`[ceil(N/16), K, 56]`. A code is `sign << 27 | (exponent - bias) << 23 | mantissa`. Exceptions: `positions`
int32 (k · 16 + column within its panel), `values` float32, grouped by panel, panel p's from `offsets[p]` to
`offsets[p + 1]` (int32 `[ceil(N/16) + 1]`).

The native kernel (cann_llm/runtime/kernels/native/matmul_panels.c) computes the op on CPUs with AVX-512 VBMI; elsewhere
the executor unpacks the weight once at load and onnxruntime runs a MatMul (cann_llm/runtime/executor.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.kernels import register_kernel
from cann_llm.runtime.ops import GATHER_F28, MATMUL_F28

PANEL = 16  # columns of a panel: one 512-bit vector of float32
GROUP_BYTES = PANEL * 28 // 8  # one k of a panel
WINDOW = 15  # exponents a 4-bit code covers (code 0 is zero)
MAX_EXCEPTIONS = 0.01  # a matrix with more of its weights outside any window stays float32
MAX_K = 1 << 27  # an exception's position k · 16 + column is an int32


@dataclass(frozen=True)
class PackedF28:
    """One weight in F28: what MatMulF28 reads besides A, and its attributes."""

    packed: np.ndarray  # uint8 [panels, K, 56]
    offsets: np.ndarray  # int32 [panels + 1]
    positions: np.ndarray  # int32 [exceptions]
    values: np.ndarray  # float32 [exceptions]
    K: int
    N: int
    bias: int


def pack(weight: np.ndarray, max_exceptions: float = MAX_EXCEPTIONS) -> PackedF28 | None:
    """`weight` (float32 `[K, N]`, any strides: a transpose is read as it lies) in F28, or None where it does not
    pay: a weight that is not finite, or more than `max_exceptions` of them outside the best window of 15
    exponents. Its temporaries are a few MB at a time, whatever its size."""
    if weight.dtype != np.float32 or weight.ndim != 2 or 0 in weight.shape or weight.shape[0] >= MAX_K:
        return None
    k, n = weight.shape
    panels = -(-n // PANEL)
    source = weight.view(np.uint32)  # a transposed view is read a block of its columns at a time, never copied
    step = max(1, (1 << 20) // (k * PANEL))  # panels a chunk: temporaries of a few MB, in the caches
    chunks = [(first, min(panels, first + step)) for first in range(0, panels, step)]
    # the exponents of the nonzero weights (denormals in bin 0), in one pass of chunks
    histogram, negative_zeros = np.zeros(256, np.int64), 0
    for first, last in chunks:
        bits = source[:, first * PANEL:min(n, last * PANEL)]
        magnitude = bits & np.uint32(0x7FFFFFFF)
        histogram += np.bincount((magnitude[magnitude != 0] >> 23).ravel(), minlength=256)
        negative_zeros += int(np.count_nonzero(bits == np.uint32(0x80000000)))
    if histogram[255]:
        return None
    # the window of 15 normal exponents holding the most nonzero weights; denormals (exponent 0) never coded
    normal = histogram[1:255]
    lowest = 1 + int(np.argmax(np.convolve(normal, np.ones(WINDOW, np.int64), "valid"))) if normal.any() else 1
    outside = int(histogram.sum() - histogram[lowest:lowest + WINDOW].sum()) + negative_zeros
    if outside > max_exceptions * weight.size:
        return None
    packed = np.empty((panels, k, PANEL // 2, 7), np.uint8)
    positions, values, counts = [], [], np.zeros(panels, np.int64)
    for first, last in chunks:
        chunk = np.zeros((k, (last - first) * PANEL), np.uint32)
        columns = source[:, first * PANEL:min(n, last * PANEL)]
        chunk[:, :columns.shape[1]] = columns
        bits = np.ascontiguousarray(chunk.reshape(k, last - first, PANEL).transpose(1, 0, 2))  # [panels, K, 16]
        codes, outliers = _codes(bits, lowest)
        pairs = codes[..., 0::2].astype(np.uint64) | codes[..., 1::2].astype(np.uint64) << np.uint64(28)
        packed[first:last] = pairs.view(np.uint8).reshape(last - first, k, PANEL // 2, 8)[..., :7]
        flat = np.flatnonzero(outliers)  # by panel, then k, then column: the order the kernel applies them
        panel_of, position = np.divmod(flat, k * PANEL)
        counts[first:last] = np.bincount(panel_of, minlength=last - first)
        positions.append(position.astype(np.int32))
        values.append(bits.reshape(-1)[flat].view(np.float32))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return PackedF28(packed.reshape(panels, k, GROUP_BYTES), offsets, np.concatenate(positions),
                     np.concatenate(values), k, n, lowest - 1)


def _codes(bits: np.ndarray, lowest: int) -> tuple[np.ndarray, np.ndarray]:
    """The 28-bit codes of float32 `bits` for the window from exponent `lowest`, and where a weight is an
    exception (outside the window, not +0.0)."""
    exponent = (bits >> 23) & 0xFF
    coded = ((bits & 0x7FFFFFFF) != 0) & (exponent >= lowest) & (exponent < lowest + WINDOW)
    codes = np.where(coded, (bits >> 31) << 27 | (exponent - np.uint32(lowest - 1)) << 23 | (bits & 0x7FFFFF),
                     np.uint32(0))
    return codes, ~coded & (bits != 0)


def check(packed: np.ndarray, offsets: np.ndarray, positions: np.ndarray, values: np.ndarray, K: int, N: int) -> None:
    """Raise ValueError unless the operands are a weight `[K, N]` in F28's layout: what every reader of an
    artifact's operands holds them to before indexing with them (the native op checks the same)."""
    panels = -(-N // PANEL)
    if np.size(packed) != panels * K * GROUP_BYTES:
        raise ValueError(f"the packed weight holds {np.size(packed)} bytes, K {K} and N {N} make {panels * K * GROUP_BYTES}")
    check_exceptions(offsets, positions, values, K, N)


def check_exceptions(offsets: np.ndarray, positions: np.ndarray, values: np.ndarray, K: int, N: int) -> None:
    """`check`'s part for the exceptions alone."""
    panels = -(-N // PANEL)
    offsets, positions = np.asarray(offsets), np.asarray(positions)
    if offsets.shape != (panels + 1,) or np.shape(values) != positions.shape or positions.ndim != 1:
        raise ValueError(f"the exceptions are not offsets [{panels + 1}] with positions and values of one length")
    if offsets[0] != 0 or offsets[-1] != positions.size or np.any(np.diff(offsets) < 0):
        raise ValueError("the exception offsets do not rise from 0 to the number of exceptions")
    if positions.size and (positions.min() < 0 or positions.max() >= K * PANEL):
        raise ValueError(f"an exception position is outside [0, {K * PANEL})")


def unpack(packed: np.ndarray, offsets: np.ndarray, positions: np.ndarray, values: np.ndarray, *, K: int, N: int,
           bias: int) -> np.ndarray:
    """The float32 `[K, N]` weight that `pack` stored, bit for bit (ValueError for operands `check` refuses)."""
    check(packed, offsets, positions, values, K, N)
    panels = -(-N // PANEL)
    groups = np.asarray(packed, np.uint8).reshape(panels, K, PANEL // 2, 7)
    offsets, positions = np.asarray(offsets, np.int64), np.asarray(positions, np.int64)
    values = np.asarray(values, np.float32).view(np.uint32)
    bits = np.empty((K, panels * PANEL), np.uint32)
    step = max(1, (1 << 20) // (K * PANEL))  # panels a chunk, as pack takes them
    for first in range(0, panels, step):
        last = min(panels, first + step)
        wide = np.zeros((last - first, K, PANEL // 2, 8), np.uint8)
        wide[..., :7] = groups[first:last]
        pairs = wide.view(np.uint64)[..., 0]
        codes = np.empty((last - first, K, PANEL), np.uint32)
        codes[..., 0::2] = pairs & np.uint64(0xFFFFFFF)
        codes[..., 1::2] = (pairs >> np.uint64(28)) & np.uint64(0xFFFFFFF)
        chunk = _float_bits(codes, bias)
        mine = slice(int(offsets[first]), int(offsets[last]))
        panel_of = np.repeat(np.arange(last - first), np.diff(offsets[first:last + 1]))
        chunk.reshape(-1)[panel_of * K * PANEL + positions[mine]] = values[mine]
        bits[:, first * PANEL:last * PANEL] = chunk.transpose(1, 0, 2).reshape(K, -1)
    return np.ascontiguousarray(bits[:, :N]).view(np.float32)


def _float_bits(codes: np.ndarray, bias: int) -> np.ndarray:
    """float32 bits of 28-bit codes (uint32): the sign and mantissa as they are, the exponent code plus `bias`;
    code 0 is +0.0."""
    exponent = (codes >> 23) & 15
    return np.where(exponent != 0, (codes >> 27) << 31 | (exponent + np.uint32(bias)) << 23 | (codes & 0x7FFFFF),
                    np.uint32(0)).astype(np.uint32)


def columns(blocks: np.ndarray, which: np.ndarray, lanes: np.ndarray, bias: int) -> np.ndarray:
    """Column `lanes[i]` (0-15) of panel `blocks[which[i]]` (`blocks` uint8 `[n, K, 56]`, panels' bytes) as
    float32 `[len(lanes), K]`, exceptions still 0 (`with_exceptions` puts them in): a tied embedding's rows,
    read from its head's panels; only the four bytes of each code are gathered."""
    lanes = np.asarray(lanes, np.int64)
    k = blocks.shape[1]
    at = (7 * lanes // 2)[:, None, None] + np.arange(4)  # the four bytes holding code lane, from bit 28·lane
    raw = blocks[np.asarray(which, np.int64)[:, None, None], np.arange(k)[None, :, None], at]  # [n, K, 4]
    codes = (np.ascontiguousarray(raw).view(np.uint32)[..., 0] >> (4 * (lanes & 1))[:, None].astype(np.uint32))
    return _float_bits(codes & np.uint32(0xFFFFFFF), bias).view(np.float32)


def with_exceptions(rows: np.ndarray, panels: np.ndarray, lanes: np.ndarray, offsets: np.ndarray,
                    positions: np.ndarray, values: np.ndarray) -> np.ndarray:
    """`rows` (`columns`' result for these panels and lanes) with their exceptions' values put in, in place;
    the operands as `check` holds them."""
    for row, (panel, lane) in enumerate(zip(panels.tolist(), lanes.tolist())):
        mine = slice(int(offsets[panel]), int(offsets[panel + 1]))
        if mine.start == mine.stop:
            continue
        where = positions[mine]
        hit = (where & 15) == lane
        rows[row, where[hit] >> 4] = values[mine][hit]
    return rows


@register_kernel(GATHER_F28)
def GatherF28(packed: np.ndarray, offsets: np.ndarray, positions: np.ndarray, values: np.ndarray,
              indices: np.ndarray, *, K: int, N: int, bias: int) -> np.ndarray:
    """Rows `indices` of the table W `[N, K]` whose transpose (a tied lm_head's weight) is stored in F28: the
    embedding lookup that reads its head's bytes. An index outside [-N, N) is refused (E10001)."""
    ids = np.asarray(indices).reshape(-1).astype(np.int64)
    if ids.size and (ids.min() < -N or ids.max() >= N):
        raise AtcError("E10001", int(ids[(ids < -N) | (ids >= N)][0]), "indices", f"an index must be in [{-N}, {N - 1}]")
    check(packed, offsets, positions, values, K, N)
    ids = ids % N
    panels, lanes = ids // PANEL, ids % PANEL
    blocks = np.asarray(packed, np.uint8).reshape(-1, K, GROUP_BYTES)
    rows = with_exceptions(columns(blocks, panels, lanes, bias), panels, lanes, offsets, positions, values)
    return rows.reshape(*np.shape(indices), K)


@register_kernel(MATMUL_F28)
def MatMulF28(a: np.ndarray, packed: np.ndarray, offsets: np.ndarray, positions: np.ndarray, values: np.ndarray, *,
              K: int, N: int, bias: int) -> np.ndarray:
    """a · W with the float32 weight W `[K, N]` stored in F28 (`pack`)."""
    weight = unpack(packed, offsets, positions, values, K=K, N=N, bias=bias)
    return np.matmul(a.astype(np.float32), weight)
