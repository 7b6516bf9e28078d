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

size_t matmul_int4_lane_bytes(int64_t m, int64_t blocks, int64_t block_bytes) {
  return m >= LANE_FROM ? (size_t)(MAX_TASKS * TASK_COLUMNS * blocks * block_bytes) : 0;
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
  const int64_t K = w->k->K, block = w->k->block;
  const float* a = w->a + (int64_t)row * K;
  int8_t* q = w->q + (int64_t)row * w->blocks * block;
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
  for (int64_t b = 0; b < w->blocks; b++) {
    const int64_t start = b * block, count = K - start < block ? K - start : block;
    const float* s = w->a_scale ? w->a_scale + start : NULL;
    __m512 largest = _mm512_setzero_ps();
    for (int64_t i = 0; i < count; i += 16)
      largest = _mm512_max_ps(largest, _mm512_abs_ps(load16(a + start + i, s ? s + i : NULL, count - i)));
    const float most = _mm512_reduce_max_ps(largest);
    const __m512 inverse = _mm512_set1_ps(most > 0.0f ? 127.0f / most : 0.0f);
    const float* x = a + start;
    int8_t* out = q + start;
    __m512i sum = _mm512_setzero_si512();
    if (w->k->bits == 4) {
      for (int64_t piece = 0; piece < block; piece += 128) {
        for (int64_t i = 0; i < 128; i += 32) {
          const int64_t at = piece + i;
          const __m512i lo = rounded(x + at, s ? s + at : NULL, count - at, inverse);
          const __m512i hi = rounded(x + at + 16, s ? s + at + 16 : NULL, count - at - 16, inverse);
          sum = _mm512_add_epi32(sum, _mm512_add_epi32(lo, hi));
          _mm_storeu_si128((__m128i*)(out + piece + i / 2), _mm512_cvtsepi32_epi8(_mm512_permutex2var_epi32(lo, evens, hi)));
          _mm_storeu_si128((__m128i*)(out + piece + PIECE + i / 2), _mm512_cvtsepi32_epi8(_mm512_permutex2var_epi32(lo, odds, hi)));
        }
      }
    } else {
      for (int64_t i = 0; i < block; i += 16) {
        const __m512i v = rounded(x + i, s ? s + i : NULL, count - i, inverse);
        sum = _mm512_add_epi32(sum, v);
        _mm_storeu_si128((__m128i*)(out + i), _mm512_cvtsepi32_epi8(v));
      }
    }
    const float scale = most > 0.0f ? most / 127.0f : 1.0f;
    const int32_t total = _mm512_reduce_add_epi32(sum);
    w->q_scale[(int64_t)row * w->blocks + b] = scale;
    w->q_sum[(int64_t)row * w->blocks + b] = total;
  }
}

/* TASK_COLUMNS (16) columns for R rows (1 or ROWS), a column at a time: its row of weights is read front to
   back (the group's 16 rows lie one after the other, so a task streams through memory) and unpacked once for
   the R rows, each row's dots of a block converted and scaled into a vector of partial sums, reduced with the
   other 15 columns' at the end; the zero points' share comes off for the 16 at once. Scales and zero points
   come from the kernel's tables (16 lanes a block); `both` holds [R][blocks][16] products of the scales. */
static inline __attribute__((always_inline)) void sixteen(const Work* w, int64_t n0, const uint8_t* base, int64_t r0,
                                                          int R, int bits, int pieces, float* both) {
  const int64_t blocks = w->blocks, block = w->k->block, block_bytes = w->block_bytes;
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
    for (int64_t b = 0; b < blocks; b++) {
      const uint8_t* piece = column + b * block_bytes;
      if (r0 == 0) { /* the hardware's prefetch alone leaves two threads reading memory at ~30 GB/s, not ~50 */
        _mm_prefetch((const char*)(piece + PREFETCH), _MM_HINT_T0);
        if (pieces == 2) _mm_prefetch((const char*)(piece + PREFETCH + PIECE), _MM_HINT_T0);
      }
      if (bits == 4) {
        const __m512i bytes = _mm512_loadu_si512((const void*)piece);
        const __m512i even = _mm512_and_si512(bytes, low), odd = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
          const int8_t* xb = w->q + ((r0 + i) * blocks + b) * block;
          const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), even, _mm512_loadu_si512((const void*)xb)),
                                                odd, _mm512_loadu_si512((const void*)(xb + PIECE)));
          sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(both[(i * blocks + b) * TASK_COLUMNS + j]), sum[i]);
        }
      } else {
        const __m512i first = _mm512_loadu_si512((const void*)piece);
        const __m512i second = pieces == 2 ? _mm512_loadu_si512((const void*)(piece + PIECE)) : _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
          const int8_t* xb = w->q + ((r0 + i) * blocks + b) * block;
          __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), first, _mm512_loadu_si512((const void*)xb));
          if (pieces == 2) d = _mm512_dpbusd_epi32(d, second, _mm512_loadu_si512((const void*)(xb + PIECE)));
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

/* The 16 columns at `base` (rows of row_bytes) as lanes, their bytes as they are: for block b and piece p,
   vector u's lane j holds column j's bytes 4u..4u+3 of that piece. */
static void to_lanes(const uint8_t* base, int64_t row_bytes, int64_t blocks, int64_t block_bytes, uint8_t* out) {
  const int64_t pieces = block_bytes / PIECE;
  for (int64_t b = 0; b < blocks; b++)
    for (int64_t p = 0; p < pieces; p++) {
      __m512i r[16];
      for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512((const void*)(base + j * row_bytes + b * block_bytes + p * PIECE));
      transpose16(r);
      for (int u = 0; u < 16; u++) _mm512_storeu_si512((void*)(out + ((b * pieces + p) * 16 + u) * 64), r[u]);
    }
}

/* R rows (at most LANE_ROWS) of the 16 columns of group n0 from their `lanes`: a column in each lane, so a
   block's int32 dots come out as one vector a row (no sums across lanes), scaled once a block and row, and
   each vector of weights serves R rows. 4 bits: lane vector u's low nibbles meet the activation bytes
   4u..4u+3 of the block as `q` lays them out (a piece's even elements first), its high nibbles bytes
   64+4u.. (the odd ones). */
static inline __attribute__((always_inline)) void lane_tile(const Work* w, int64_t n0, const __m512i* lanes, int64_t r0, const int R, int bits) {
  const int64_t blocks = w->blocks, block = w->k->block, pieces = w->block_bytes / PIECE;
  const float* scale_t = w->k->scale_t + n0 * blocks;
  const uint8_t* zero_t = w->k->zero_t + n0 * blocks;
  const int8_t* x = w->q + r0 * blocks * block;
  const int64_t stride = blocks * block;
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[LANE_ROWS];
  for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    __m512i dot[LANE_ROWS];
    for (int i = 0; i < R; i++) dot[i] = _mm512_setzero_si512();
    const int8_t* xb = x + b * block;
    if (bits == 4) {
      for (int u = 0; u < 16; u++) {
        const __m512i bytes = _mm512_loadu_si512((const void*)(lanes + b * 16 + u));
        const __m512i even = _mm512_and_si512(bytes, low), odd = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
        for (int i = 0; i < R; i++) {
          int32_t e, o;
          memcpy(&e, xb + i * stride + 4 * u, sizeof(e));
          memcpy(&o, xb + i * stride + PIECE + 4 * u, sizeof(o));
          dot[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[i], even, _mm512_set1_epi32(e)), odd, _mm512_set1_epi32(o));
        }
      }
    } else {
      for (int64_t v = 0; v < pieces * 16; v++) {
        const __m512i bytes = _mm512_loadu_si512((const void*)(lanes + b * pieces * 16 + v));
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
static inline __attribute__((always_inline)) void lane_group(const Work* w, int64_t n0, int bits, __m512i* lanes) {
  const uint8_t* base = n0 + TASK_COLUMNS <= w->k->N ? w->b + n0 * w->blocks * w->block_bytes : w->k->last_group;
  to_lanes(base, w->blocks * w->block_bytes, w->blocks, w->block_bytes, (uint8_t*)lanes);
  int64_t r = 0;
  for (; r + LANE_ROWS <= w->m; r += LANE_ROWS) lane_tile(w, n0, lanes, r, LANE_ROWS, bits);
  switch (w->m - r) {
#define REST(n) case n: lane_tile(w, n0, lanes, r, n, bits); break;
    REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7) REST(8) REST(9) REST(10) REST(11)
#undef REST
    default: break;
  }
}

/* every row of the group at n0: ROWS at a time, then one by one */
static inline __attribute__((always_inline)) void group(const Work* w, int64_t n0, int bits, int pieces, float* both) {
  const uint8_t* base = n0 + TASK_COLUMNS <= w->k->N ? w->b + n0 * w->blocks * w->block_bytes : w->k->last_group;
  int64_t r = 0;
  for (; r + ROWS <= w->m; r += ROWS) sixteen(w, n0, base, r, ROWS, bits, pieces, both);
  for (; r < w->m; r++) sixteen(w, n0, base, r, 1, bits, pieces, both);
}

void matmul_int4_columns(void* data, size_t task) {
  const Work* w = (const Work*)data;
  const int64_t start = (int64_t)task * w->task_columns;
  const int64_t end = start + w->task_columns < w->k->N ? start + w->task_columns : w->k->N;
  float* both = w->both + (int64_t)task * ROWS * w->blocks * TASK_COLUMNS;
  if (w->m >= LANE_FROM) {
    __m512i* lanes = (__m512i*)(w->lanes + (int64_t)task * w->blocks * w->block_bytes * TASK_COLUMNS);
    for (int64_t n = start; n < end; n += TASK_COLUMNS) {
      if (w->k->bits == 4) lane_group(w, n, 4, lanes);
      else lane_group(w, n, 8, lanes);
    }
    return;
  }
  for (int64_t n = start; n < end; n += TASK_COLUMNS) {
    if (w->k->bits == 4) group(w, n, 4, 1, both);
    else if (w->block_bytes == PIECE) group(w, n, 8, 1, both);
    else group(w, n, 8, 2, both);
  }
}

#endif
