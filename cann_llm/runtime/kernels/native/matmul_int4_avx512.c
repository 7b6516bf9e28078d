/* cann::MatMulInt4's kernels on CPUs with AVX-512 VNNI (matmul_int4.h; the op is matmul_int4.c): products
   in int8 with vpdpbusd. Two paths: below LANE_FROM rows (decode) a column's weights are read front to back
   and 16 columns reduced together at the end, which reads SmolLM2's weights 1.1-1.6x as fast as MLAS's
   MatMulNBits; from LANE_FROM rows (prefill, decode batches) each group of 16 columns is first transposed so
   that a vector holds one column per lane, and every weight vector then serves 12 rows: 1.6-1.9x
   MatMulNBits' multiply-adds a second at 512 rows (docs/performance.md#int4-matmul). */
#include <string.h>

#include "matmul_int4.h"

#if MATMUL_INT4_ISA == 512
#include <immintrin.h>

#define LANE_ROWS 12 /* rows of a lane tile: an int32 and a float accumulator each (14, or 8 with two
                        int32 accumulators each: slower) */
#define LANE_FROM 16 /* rows from which the lane path runs (below, transposing costs about what it saves) */

size_t matmul_int4_lane_bytes(int64_t m, int64_t pieces) {
  return m >= LANE_FROM ? (size_t)(MAX_TASKS * TASK_COLUMNS * pieces * PIECE) : 0;
}

/* 16 floats from `x` (only `count` of them, the rest 0), times `scale`'s when there is one */
static inline __m512 load16(const float* x, const float* scale, int64_t count) {
  const __mmask16 mask = count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count > 0 ? count : 0)) - 1);
  const __m512 v = _mm512_maskz_loadu_ps(mask, x);
  return scale ? _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, scale)) : v;
}

/* those times `inverse`, rounded half to even */
static inline __m512i rounded(const float* x, const float* scale, int64_t count, __m512 inverse) {
  return _mm512_cvtps_epi32(_mm512_mul_ps(load16(x, scale, count), inverse));
}

void matmul_int4_quantize_row(void* data, size_t row) {
  const Work* w = (const Work*)data;
  const int64_t K = w->k->K, block = w->k->block, blocks = w->blocks;
  const float* a = w->a + (int64_t)row * K;
  const float* s = w->a_scale;
  int8_t* q = w->q + (int64_t)row * w->q_stride;
  float* q_scale = w->q_scale + (int64_t)row * blocks;
  int32_t* q_sum = w->q_sum + (int64_t)row * blocks;
  float inverse[blocks];
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t start = b * block, count = K - start < block ? K - start : block;
    __m512 largest = _mm512_setzero_ps();
    for (int64_t i = 0; i < count; i += 16)
      largest = _mm512_max_ps(largest, _mm512_abs_ps(load16(a + start + i, s ? s + start + i : NULL, count - i)));
    const float most = _mm512_reduce_max_ps(largest);
    inverse[b] = most > 0.0f ? 127.0f / most : 0.0f;
    q_scale[b] = most > 0.0f ? most / 127.0f : 1.0f;
    q_sum[b] = 0;
  }
  if (w->k->bits == 4) {
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    for (int64_t piece = 0; piece < w->pieces; piece++)
      for (int64_t i = 0; i < 2 * PIECE; i += 32) { /* 32 elements, all of one block (blocks are 32, 64 or 128) */
        const int64_t at = piece * 2 * PIECE + i;
        int8_t* out = q + piece * 2 * PIECE + i / 2;
        if (at >= blocks * block) { /* the half piece's missing half */
          _mm_storeu_si128((__m128i*)out, _mm_setzero_si128());
          _mm_storeu_si128((__m128i*)(out + PIECE), _mm_setzero_si128());
          continue;
        }
        const int64_t b = at / block;
        const __m512 times = _mm512_set1_ps(inverse[b]);
        const __m512i lo = rounded(a + at, s ? s + at : NULL, K - at, times);
        const __m512i hi = rounded(a + at + 16, s ? s + at + 16 : NULL, K - at - 16, times);
        q_sum[b] += _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
        _mm_storeu_si128((__m128i*)out, _mm512_cvtsepi32_epi8(_mm512_permutex2var_epi32(lo, evens, hi)));
        _mm_storeu_si128((__m128i*)(out + PIECE), _mm512_cvtsepi32_epi8(_mm512_permutex2var_epi32(lo, odds, hi)));
      }
    return;
  }
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t start = b * block;
    const __m512 times = _mm512_set1_ps(inverse[b]);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = 0; i < block; i += 16) {
      const __m512i v = rounded(a + start + i, s ? s + start + i : NULL, K - start - i, times);
      sum = _mm512_add_epi32(sum, v);
      _mm_storeu_si128((__m128i*)(q + start + i), _mm512_cvtsepi32_epi8(v));
    }
    q_sum[b] = _mm512_reduce_add_epi32(sum);
  }
}

/* a piece's 16 lanes of scales for a column: lanes 16 / per_piece · k onwards take its block k's, `scale`
   pointing at the first block's and the next blocks' 16 floats apart (blocks past the weights' end keep the
   last one's: their lanes' dots are 0) */
static inline __m512 lane_scales(const float* scale, int per_piece, int64_t count) {
  __m512 v = _mm512_set1_ps(scale[0]);
  if (per_piece == 2 && count > 1) v = _mm512_mask_blend_ps(0xFF00, v, _mm512_set1_ps(scale[TASK_COLUMNS]));
  if (per_piece == 4) {
    if (count > 1) v = _mm512_mask_blend_ps(0xFFF0, v, _mm512_set1_ps(scale[TASK_COLUMNS]));
    if (count > 2) v = _mm512_mask_blend_ps(0xFF00, v, _mm512_set1_ps(scale[2 * TASK_COLUMNS]));
    if (count > 3) v = _mm512_mask_blend_ps(0xF000, v, _mm512_set1_ps(scale[3 * TASK_COLUMNS]));
  }
  return v;
}

/* a piece of a column's weights: 64 bytes, or the 32 of a half piece (zeros above) */
static inline __m512i load_piece(const uint8_t* piece, int half) {
  return half ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)piece)) : _mm512_loadu_si512((const void*)piece);
}

/* TASK_COLUMNS (16) columns for R rows (1 or ROWS), a column at a time: its row of weights is read front to
   back (the group's 16 rows lie one after the other, so a task streams through memory) and unpacked once for
   the R rows, each row's dots of a piece converted and scaled into a vector of partial sums, reduced with the
   other 15 columns' at the end; the zero points' share comes off for the 16 at once. Scales and zero points
   come from the kernel's tables (16 lanes a block); `both` holds [R][blocks][16] products of the scales.
   8 bits go block by block (`per_block` pieces each); 4 bits piece by piece, `per_piece` blocks each: a
   piece of two blocks of 64 has the first block's dots in lanes 0-7 and the second's in lanes 8-15, one of
   four blocks of 32 each block's in four lanes. */
static inline __attribute__((always_inline)) void sixteen(const Work* w, int64_t n0, const uint8_t* base, int64_t r0,
                                                          int R, int bits, int per_block, int per_piece, float* both) {
  const int64_t blocks = w->blocks, block_bytes = w->block_bytes, pieces = w->pieces;
  const float* scale_t = w->k->scale_t + n0 * blocks;
  const uint8_t* zero_t = w->k->zero_t + n0 * blocks;
  const __m512i low = _mm512_set1_epi8(15);
  __m512 shift[ROWS];
  for (int i = 0; i < R; i++) {
    shift[i] = _mm512_setzero_ps();
    const int64_t row = (r0 + i) * blocks;
    for (int64_t b = 0; b < blocks; b++) {
      const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(scale_t + b * TASK_COLUMNS), _mm512_set1_ps(w->q_scale[row + b]));
      _mm512_storeu_ps(both + (i * blocks + b) * TASK_COLUMNS, scale);
      const __m512 zero = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(zero_t + b * TASK_COLUMNS))));
      shift[i] = _mm512_fmadd_ps(_mm512_mul_ps(scale, zero), _mm512_set1_ps((float)w->q_sum[row + b]), shift[i]);
    }
  }
  __m512 acc[ROWS][TASK_COLUMNS];
  for (int j = 0; j < TASK_COLUMNS; j++) {
    const uint8_t* column = base + j * blocks * block_bytes;
    __m512 sum[ROWS];
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) sum[i] = _mm512_setzero_ps();
    if (bits == 4) {
      for (int64_t p = 0; p < pieces; p++) {
        const uint8_t* piece = column + p * PIECE;
        /* the hardware's prefetch alone leaves two threads reading memory at ~30 GB/s, not ~50 */
        if (r0 == 0) _mm_prefetch((const char*)(piece + PREFETCH), PREFETCH_HINT);
        const __m512i bytes = load_piece(piece, w->half_last && p == pieces - 1);
        const __m512i even = _mm512_and_si512(bytes, low), odd = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
        const int64_t first = p * per_piece, count = blocks - first; /* the piece's first block, and blocks from it */
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
          const int8_t* xb = w->q + (r0 + i) * w->q_stride + p * 2 * PIECE;
          const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), even, _mm512_loadu_si512((const void*)xb)),
                                                odd, _mm512_loadu_si512((const void*)(xb + PIECE)));
          const __m512 scale = lane_scales(both + (i * blocks + first) * TASK_COLUMNS + j, per_piece, count);
          sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, sum[i]);
        }
      }
    } else {
      for (int64_t b = 0; b < blocks; b++) {
        const uint8_t* piece = column + b * block_bytes;
        if (r0 == 0) {
          _mm_prefetch((const char*)(piece + PREFETCH), PREFETCH_HINT);
          if (per_block == 2) _mm_prefetch((const char*)(piece + PREFETCH + PIECE), PREFETCH_HINT);
        }
        const __m512i first = _mm512_loadu_si512((const void*)piece);
        const __m512i second = per_block == 2 ? _mm512_loadu_si512((const void*)(piece + PIECE)) : _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
          const int8_t* xb = w->q + (r0 + i) * w->q_stride + b * w->k->block;
          __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), first, _mm512_loadu_si512((const void*)xb));
          if (per_block == 2) d = _mm512_dpbusd_epi32(d, second, _mm512_loadu_si512((const void*)(xb + PIECE)));
          sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(both[(i * blocks + b) * TASK_COLUMNS + j]), sum[i]);
        }
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) acc[i][j] = sum[i];
  }
  const int64_t count = w->k->N - n0 < TASK_COLUMNS ? w->k->N - n0 : TASK_COLUMNS;
  const __mmask16 valid = (__mmask16)((1u << count) - 1);
  for (int i = 0; i < R; i++) _mm512_mask_storeu_ps(w->y + (r0 + i) * w->k->N + n0, valid, _mm512_sub_ps(sum16(acc[i]), shift[i]));
}

/* A 16×16 transpose of 32-bit lanes: afterwards r[u]'s lane j is what r[j]'s lane u was. */
static inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) { /* r[4i+k]'s 128-bit lane L: lane 4L+k of r[4i..4i+3] */
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; k++) { /* then the 4×4 of 128-bit lanes among r[k], r[4+k], r[8+k], r[12+k] */
    const __m512i a = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44), b = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44), d = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
    t[k] = _mm512_shuffle_i32x4(a, c, 0x88);
    t[4 + k] = _mm512_shuffle_i32x4(a, c, 0xDD);
    t[8 + k] = _mm512_shuffle_i32x4(b, d, 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
  for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* The 16 columns at `base` (rows of row_bytes) as lanes, their bytes as they are: for piece p, vector u's lane j
   holds column j's bytes 4u..4u+3 of that piece (zeros past the end of a half piece). */
static void to_lanes(const uint8_t* base, int64_t row_bytes, int64_t pieces, uint8_t* out) {
  for (int64_t p = 0; p < pieces; p++) {
    const int64_t left = row_bytes - p * PIECE;
    const __mmask64 mask = left >= PIECE ? ~(__mmask64)0 : ((__mmask64)1 << left) - 1;
    __m512i r[16];
    for (int j = 0; j < 16; j++) r[j] = _mm512_maskz_loadu_epi8(mask, (const void*)(base + j * row_bytes + p * PIECE));
    transpose16(r);
    for (int u = 0; u < 16; u++) _mm512_storeu_si512((void*)(out + (p * 16 + u) * 64), r[u]);
  }
}

/* R rows (at most LANE_ROWS) of the 16 columns of group n0 from their `lanes`: a column in each lane, so a
   block's int32 dots come out as one vector a row (no sums across lanes), scaled once a block and row, and
   each vector of weights serves R rows. 4 bits: lane vector u of a piece holds bytes 4u..4u+3, whose low
   nibbles meet the activation bytes 4u..4u+3 of the piece as `q` lays them out (its even elements first) and
   high nibbles bytes 64+4u.. (the odd ones); a piece of `per_piece` blocks gives each 16 / per_piece of its
   vectors. */
static inline __attribute__((always_inline)) void lane_tile(const Work* w, int64_t n0, const __m512i* lanes, int64_t r0,
                                                            const int R, int bits, int per_piece) {
  const int64_t blocks = w->blocks, per_block = w->block_bytes / PIECE;
  const float* scale_t = w->k->scale_t + n0 * blocks;
  const uint8_t* zero_t = w->k->zero_t + n0 * blocks;
  const int64_t stride = w->q_stride;
  const int8_t* x = w->q + r0 * stride;
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[LANE_ROWS];
  for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    __m512i dot[LANE_ROWS];
    for (int i = 0; i < R; i++) dot[i] = _mm512_setzero_si512();
    if (bits == 4) {
      const int64_t p = b / per_piece, first = b % per_piece * 16 / per_piece;
      const int8_t* xb = x + p * 2 * PIECE;
      for (int u = first; u < first + 16 / per_piece; u++) {
        const __m512i bytes = _mm512_loadu_si512((const void*)(lanes + p * 16 + u));
        const __m512i even = _mm512_and_si512(bytes, low), odd = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
        for (int i = 0; i < R; i++) {
          int32_t e, o;
          memcpy(&e, xb + i * stride + 4 * u, sizeof(e));
          memcpy(&o, xb + i * stride + PIECE + 4 * u, sizeof(o));
          dot[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[i], even, _mm512_set1_epi32(e)), odd, _mm512_set1_epi32(o));
        }
      }
    } else {
      const int8_t* xb = x + b * w->k->block;
      for (int64_t v = 0; v < per_block * 16; v++) {
        const __m512i bytes = _mm512_loadu_si512((const void*)(lanes + b * per_block * 16 + v));
        for (int i = 0; i < R; i++) {
          int32_t four;
          memcpy(&four, xb + i * stride + 4 * v, sizeof(four));
          dot[i] = _mm512_dpbusd_epi32(dot[i], bytes, _mm512_set1_epi32(four));
        }
      }
    }
    const __m512 scale = _mm512_loadu_ps(scale_t + b * TASK_COLUMNS);
    const __m512 zero = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(zero_t + b * TASK_COLUMNS))));
    for (int i = 0; i < R; i++) {
      const int64_t at = (r0 + i) * blocks + b;
      const __m512 shifted = _mm512_fnmadd_ps(zero, _mm512_set1_ps((float)w->q_sum[at]), _mm512_cvtepi32_ps(dot[i]));
      acc[i] = _mm512_fmadd_ps(shifted, _mm512_mul_ps(scale, _mm512_set1_ps(w->q_scale[at])), acc[i]);
    }
  }
  const int64_t count = w->k->N - n0 < TASK_COLUMNS ? w->k->N - n0 : TASK_COLUMNS;
  const __mmask16 valid = (__mmask16)((1u << count) - 1);
  for (int i = 0; i < R; i++) _mm512_mask_storeu_ps(w->y + (r0 + i) * w->k->N + n0, valid, acc[i]);
}

/* every row of the group at n0, LANE_ROWS rows at a time, its weights first transposed into `lanes` */
static inline __attribute__((always_inline)) void lane_group(const Work* w, int64_t n0, int bits, int per_piece, __m512i* lanes) {
  const uint8_t* base = n0 + TASK_COLUMNS <= w->k->N ? w->b + n0 * w->blocks * w->block_bytes : w->k->last_group;
  to_lanes(base, w->blocks * w->block_bytes, w->pieces, (uint8_t*)lanes);
  int64_t r = 0;
  for (; r + LANE_ROWS <= w->m; r += LANE_ROWS) lane_tile(w, n0, lanes, r, LANE_ROWS, bits, per_piece);
  switch (w->m - r) {
#define REST(n) case n: lane_tile(w, n0, lanes, r, n, bits, per_piece); break;
    REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7) REST(8) REST(9) REST(10) REST(11)
#undef REST
    default: break;
  }
}

/* every row of the group at n0: ROWS at a time, then one by one */
static inline __attribute__((always_inline)) void group(const Work* w, int64_t n0, int bits, int per_block, int per_piece,
                                                        float* both) {
  const uint8_t* base = n0 + TASK_COLUMNS <= w->k->N ? w->b + n0 * w->blocks * w->block_bytes : w->k->last_group;
  int64_t r = 0;
  for (; r + ROWS <= w->m; r += ROWS) sixteen(w, n0, base, r, ROWS, bits, per_block, per_piece, both);
  for (; r < w->m; r++) sixteen(w, n0, base, r, 1, bits, per_block, per_piece, both);
}

void matmul_int4_columns(void* data, size_t task) {
  const Work* w = (const Work*)data;
  const int64_t start = (int64_t)task * w->task_columns;
  const int64_t end = start + w->task_columns < w->k->N ? start + w->task_columns : w->k->N;
  float* both = w->both + (int64_t)task * ROWS * w->blocks * TASK_COLUMNS;
  const int64_t per_piece = w->per_piece;
  if (w->m >= LANE_FROM) {
    __m512i* lanes = (__m512i*)(w->lanes + (int64_t)task * w->pieces * PIECE * TASK_COLUMNS);
    for (int64_t n = start; n < end; n += TASK_COLUMNS) {
      if (per_piece == 4) lane_group(w, n, 4, 4, lanes);
      else if (per_piece == 2) lane_group(w, n, 4, 2, lanes);
      else if (per_piece == 1) lane_group(w, n, 4, 1, lanes);
      else lane_group(w, n, 8, 1, lanes);
    }
    return;
  }
  for (int64_t n = start; n < end; n += TASK_COLUMNS) {
    if (per_piece == 4) group(w, n, 4, 1, 4, both);
    else if (per_piece == 2) group(w, n, 4, 1, 2, both);
    else if (per_piece == 1) group(w, n, 4, 1, 1, both);
    else if (w->block_bytes == PIECE) group(w, n, 8, 1, 1, both);
    else group(w, n, 8, 2, 1, both);
  }
}

#endif
