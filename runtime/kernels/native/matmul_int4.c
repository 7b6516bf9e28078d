/* cann::MatMulInt4 as an onnxruntime custom op, on CPUs with AVX-512 VNNI: y = A · Wᵀ with W stored in
   MatMulNBits' layout (B uint8 [N][blocks][block·bits/8], 4-bit values low nibble first), a float32 scale a
   block and optional uint8 zero points (4-bit ones two a byte, low nibble first; 2^(bits-1) without them);
   an optional fifth input [K] scales A's columns first (a constant Mul before the node, moved into it by
   runtime/lowering.py's `with_input_scales`: AWQ's 1/s where no norm could take it).
   A is quantized to int8 per row and block (scale max|a| / 127, a · 127 / max|a| rounded half to even) as
   onnxruntime's accuracy level 4 does, and multiplied in int8 with vpdpbusd. Two paths: below LANE_FROM rows
   (decode) a column's weights are read front to back and 16 columns reduced together at the end, which
   reads SmolLM2's weights 1.1-1.6x as fast as MLAS's MatMulNBits; from LANE_FROM rows (prefill, decode
   batches) each group of 16 columns is first transposed so that a vector holds one column per lane, and
   every weight vector then serves 12 rows: 1.6-1.9x MatMulNBits' multiply-adds a second at 512 rows
   (docs/performance.md#int4-matmul). The reference is
   runtime/kernels/quant_matmul.py's MatMulInt4; the executor gives this op only the nodes it takes
   (runtime/kernels/native/__init__.py: `takes_matmul`): accuracy level 4, 4 bits in blocks of 128, or 8 bits
   in blocks of 64 or 128, so that a block is one or two 64-byte pieces. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "native_ops.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

#define PIECE 64      /* weight bytes one vpdpbusd pair (4 bits) or one vpdpbusd (8 bits) reads */
#define ROWS 4        /* rows computed together, sharing each unpacked weight piece */
#define TASK_COLUMNS 16 /* columns computed together: their weights stay in L1 while every row is read */
#define PREFETCH 4096  /* bytes ahead of the weights being read that a column asks for (best of 512-8192 here) */
#define MAX_TASKS 16    /* parallel tasks a call splits its columns into, as MLAS does for this much work */
#define PARALLEL_ROWS 8 /* rows from which the activations are quantized on the pool's threads */
#define LANE_ROWS 12    /* rows of a lane tile: an int32 and a float accumulator each (14, or 8 with two
                           int32 accumulators each: slower) */
#define LANE_FROM 16    /* rows from which the lane path runs (below, transposing costs about what it saves) */

typedef struct {
  int64_t K, N, bits, block;
  /* made at the first run from the node's constant inputs (a custom op has no pre-packing step): the scales
     and zero points of every group of 16 columns, block by block ([ceil(N/16)][blocks][16]), and when N is
     not a multiple of 16 the last group's weights padded with zero columns, so every group takes one path */
  pthread_mutex_t lock;
  const float* tables_of; /* the scales they were made from */
  float* scale_t;
  int32_t* zero_t;
  uint8_t* last_group;
} Kernel;

typedef struct {
  const Kernel* k;
  const float* a;
  const float* a_scale;       /* NULL, or [K] multiplying A's columns before they are quantized */
  const uint8_t* b;
  const float* scales;
  const uint8_t* zero_points; /* NULL: 2^(bits-1) */
  int8_t* q;                  /* [M][blocks][block] activations in int8, 4-bit blocks deinterleaved by piece */
  float* q_scale;             /* [M][blocks] */
  int32_t* q_sum;             /* [M][blocks] the sum of its int8 values */
  float* y;
  int64_t m, blocks, block_bytes;
  int64_t task_columns; /* columns of one parallel task: a multiple of 16, at most MAX_TASKS tasks */
  float* both;           /* [tasks][ROWS][blocks][16] products of weight and activation scales */
  __m512i* lanes;        /* [tasks][16 · blocks · block bytes] a task's group of weights as lanes */
} Work;

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

/* One row of A into int8, block by block. For 4 bits, each 128 elements go as their 64 even ones then their
   64 odd ones, the order in which a piece's low and high nibbles meet them. */
static void quantize_row(void* data, size_t row) {
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

static inline float zero_point(const Work* w, int64_t n, int64_t b) {
  if (!w->zero_points) return w->k->bits == 4 ? 8.0f : 128.0f;
  if (w->k->bits == 8) return (float)w->zero_points[n * w->blocks + b];
  const uint8_t packed = w->zero_points[n * ((w->blocks + 1) / 2) + b / 2];
  return (float)(b & 1 ? packed >> 4 : packed & 15);
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
  const int32_t* zero_t = w->k->zero_t + n0 * blocks;
  const __m512i low = _mm512_set1_epi8(15);
  __m512 shift[ROWS];
  for (int i = 0; i < R; i++) {
    shift[i] = _mm512_setzero_ps();
    const int64_t row = (r0 + i) * blocks;
    for (int64_t b = 0; b < blocks; b++) {
      const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(scale_t + b * TASK_COLUMNS), _mm512_set1_ps(w->q_scale[row + b]));
      _mm512_storeu_ps(both + (i * blocks + b) * TASK_COLUMNS, scale);
      const __m512 zero = _mm512_cvtepi32_ps(_mm512_loadu_si512((const void*)(zero_t + b * TASK_COLUMNS)));
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
  const int32_t* zero_t = w->k->zero_t + n0 * blocks;
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
    const __m512 zero = _mm512_cvtepi32_ps(_mm512_loadu_si512((const void*)(zero_t + b * TASK_COLUMNS)));
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

static void column_task(void* data, size_t task) {
  const Work* w = (const Work*)data;
  const int64_t start = (int64_t)task * w->task_columns;
  const int64_t end = start + w->task_columns < w->k->N ? start + w->task_columns : w->k->N;
  float* both = w->both + (int64_t)task * ROWS * w->blocks * TASK_COLUMNS;
  if (w->m >= LANE_FROM) {
    __m512i* lanes = w->lanes + (int64_t)task * w->blocks * w->block_bytes * TASK_COLUMNS / 64;
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

/* the kernel's tables and padded last group for `w`'s constant inputs, made once */
static OrtStatus* tables(Kernel* k, const Work* w) {
  if (__atomic_load_n(&k->tables_of, __ATOMIC_ACQUIRE) == w->scales) return NULL;
  pthread_mutex_lock(&k->lock);
  OrtStatus* status = NULL;
  if (k->tables_of != w->scales) {
    const int64_t groups = (k->N + TASK_COLUMNS - 1) / TASK_COLUMNS, count = groups * w->blocks * TASK_COLUMNS;
    const int64_t whole = k->N / TASK_COLUMNS * TASK_COLUMNS, row_bytes = w->blocks * w->block_bytes;
    free(k->scale_t);
    free(k->zero_t);
    free(k->last_group);
    k->scale_t = (float*)calloc((size_t)count, sizeof(float));
    k->zero_t = (int32_t*)calloc((size_t)count, sizeof(int32_t));
    k->last_group = whole < k->N ? (uint8_t*)calloc((size_t)(TASK_COLUMNS * row_bytes), 1) : NULL;
    if (!k->scale_t || !k->zero_t || (whole < k->N && !k->last_group))
      status = fail("MatMulInt4: out of memory for its scale tables");
    for (int64_t n = 0; !status && n < k->N; n++)
      for (int64_t b = 0; b < w->blocks; b++) {
        const int64_t at = ((n / TASK_COLUMNS * w->blocks) + b) * TASK_COLUMNS + n % TASK_COLUMNS;
        k->scale_t[at] = w->scales[n * w->blocks + b];
        k->zero_t[at] = (int32_t)zero_point(w, n, b);
      }
    if (!status && k->last_group) memcpy(k->last_group, w->b + whole * row_bytes, (size_t)((k->N - whole) * row_bytes));
    __atomic_store_n(&k->tables_of, status ? NULL : w->scales, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&k->lock);
  return status;
}

static OrtStatus* input(OrtKernelContext* context, size_t index, Tensor* out) {
  const OrtValue* value = NULL;
  OrtStatus* status = ORT_CALL(g_api, KernelContext_GetInput)(context, index, &value);
  if (!status && !value) return fail("MatMulInt4: a required input is missing");
  return status ? status : tensor_of(value, out);
}

static OrtStatus* compute(void* kernel, OrtKernelContext* context) {
  Kernel* k = (Kernel*)kernel;
  Tensor a, b, scales, zero_points;
  OrtStatus* status = input(context, 0, &a);
  if (!status) status = input(context, 1, &b);
  if (!status) status = input(context, 2, &scales);
  if (status) return status;
  const OrtValue *zp_value = NULL, *scale_value = NULL;
  Tensor a_scale;
  status = ORT_CALL(g_api, KernelContext_GetInput)(context, 3, &zp_value);
  if (!status && zp_value) status = tensor_of(zp_value, &zero_points);
  if (!status) status = ORT_CALL(g_api, KernelContext_GetInput)(context, 4, &scale_value);
  if (!status && scale_value) status = tensor_of(scale_value, &a_scale);
  if (status) return status;
  if (scale_value && elements(&a_scale) != k->K) return fail("MatMulInt4: the input scale is not [K]");
  const int64_t blocks = (k->K + k->block - 1) / k->block, block_bytes = k->block * k->bits / 8;
  if (a.rank < 1 || a.dims[a.rank - 1] != k->K) return fail("MatMulInt4: A's last axis is not K");
  if (elements(&b) != k->N * blocks * block_bytes) return fail("MatMulInt4: B is not [N, ceil(K/block), block·bits/8]");
  if (elements(&scales) != k->N * blocks) return fail("MatMulInt4: scales are not [N · ceil(K/block)]");
  const int64_t zp_bytes = k->bits == 4 ? k->N * ((blocks + 1) / 2) : k->N * blocks;
  if (zp_value && elements(&zero_points) != zp_bytes) return fail("MatMulInt4: zero points of the wrong size");
  int64_t dims[6];
  memcpy(dims, a.dims, sizeof(dims));
  dims[a.rank - 1] = k->N;
  OrtValue* output = NULL;
  float* y = NULL;
  status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 0, dims, a.rank, &output);
  if (!status) status = ORT_CALL(g_api, GetTensorMutableData)(output, (void**)&y);
  if (status) return status;
  const int64_t m = elements(&a) / k->K;
  if (m == 0) return NULL;
  /* 64-byte aligned rows, so a piece of activations never straddles a cache line more than it must */
  const size_t q_bytes = ((size_t)(m * blocks * k->block) + 63) & ~(size_t)63;
  const size_t both_floats = (size_t)(MAX_TASKS * ROWS * blocks * TASK_COLUMNS);
  const size_t lane_bytes = m >= LANE_FROM ? (size_t)(MAX_TASKS * TASK_COLUMNS * blocks * block_bytes) : 0;
  const size_t floats_bytes = (sizeof(float) * (2 * (size_t)(m * blocks) + both_floats) + 63) & ~(size_t)63;
  char* scratch = (char*)aligned_alloc(64, q_bytes + floats_bytes + lane_bytes);
  if (!scratch) return fail("MatMulInt4: out of memory for the quantized activations");
  Work w = {k, a.data, scale_value ? a_scale.data : NULL, (const uint8_t*)b.data, scales.data, zp_value ? (const uint8_t*)zero_points.data : NULL,
            (int8_t*)scratch, (float*)(scratch + q_bytes), (int32_t*)((float*)(scratch + q_bytes) + m * blocks), y, m,
            blocks, block_bytes, 0, (float*)(scratch + q_bytes) + 2 * m * blocks, (__m512i*)(scratch + q_bytes + floats_bytes)};
  w.task_columns = (k->N + MAX_TASKS - 1) / MAX_TASKS;
  w.task_columns = (w.task_columns + TASK_COLUMNS - 1) / TASK_COLUMNS * TASK_COLUMNS;
  status = tables(k, &w);
  if (status) {
    free(scratch);
    return status;
  }
  if (m >= PARALLEL_ROWS) status = ORT_CALL(g_api, KernelContext_ParallelFor)(context, quantize_row, (size_t)m, 0, &w);
  else
    for (int64_t r = 0; r < m; r++) quantize_row(&w, (size_t)r);
  if (!status) {
    const size_t tasks = (size_t)((k->N + w.task_columns - 1) / w.task_columns); /* at most MAX_TASKS */
    status = ORT_CALL(g_api, KernelContext_ParallelFor)(context, column_task, tasks, 0, &w);
  }
  free(scratch);
  return status;
}

static OrtStatus* create_kernel(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  (void)api;
  Kernel* k = (Kernel*)calloc(1, sizeof(Kernel));
  if (!k) return fail("out of memory for a MatMulInt4 kernel");
  OrtStatus* status = int_attribute(info, "K", &k->K);
  if (!status) status = int_attribute(info, "N", &k->N);
  if (!status) status = int_attribute(info, "block_size", &k->block);
  if (!status && int_attribute(info, "bits", &k->bits)) k->bits = 4; /* the registry's default (runtime/ops.py) */
  if (!status && (k->K < 1 || k->N < 1 || !((k->bits == 4 && k->block == 128) || (k->bits == 8 && (k->block == 64 || k->block == 128)))))
    status = fail("MatMulInt4: the native kernel takes 4 bits in blocks of 128, or 8 bits in blocks of 64 or 128");
  if (!status && pthread_mutex_init(&k->lock, NULL)) status = fail("MatMulInt4: no mutex");
  if (status) {
    free(k);
    return status;
  }
  *out = k;
  return NULL;
}

static void destroy_kernel(void* kernel) {
  Kernel* k = (Kernel*)kernel;
  pthread_mutex_destroy(&k->lock);
  free(k->scale_t);
  free(k->zero_t);
  free(k->last_group);
  free(k);
}

static const char* op_name(const OrtCustomOp* op) { (void)op; return "MatMulInt4"; }
static size_t five(const OrtCustomOp* op) { (void)op; return 5; }
static size_t one(const OrtCustomOp* op) { (void)op; return 1; }
static ONNXTensorElementDataType input_type(const OrtCustomOp* op, size_t i) {
  (void)op;
  return i == 1 || i == 3 ? ORT_UINT8 : ORT_FLOAT;
}
static ONNXTensorElementDataType float32(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ORT_FLOAT; }
static OrtCustomOpInputOutputCharacteristic optional_from_3(const OrtCustomOp* op, size_t index) {
  (void)op;
  return index >= 3 ? ORT_OPTIONAL : ORT_REQUIRED;
}

int matmul_int4_op(OrtCustomOp* op) {
  common_op(op);
  op->GetName = op_name;
  op->GetInputType = input_type;
  op->GetInputTypeCount = five;
  op->GetInputCharacteristic = optional_from_3;
  op->GetOutputType = float32;
  op->GetOutputTypeCount = one;
  op->CreateKernelV2 = create_kernel;
  op->KernelComputeV2 = compute;
  op->KernelDestroy = destroy_kernel;
  return 1;
}

#define MATMUL_INT4_BUILT 1
#else

int matmul_int4_op(OrtCustomOp* op) {
  (void)op;
  return 0; /* no VNNI here: the executor lowers MatMulInt4 to onnxruntime's MatMulNBits */
}

#define MATMUL_INT4_BUILT 0
#endif

/* whether this build registers MatMulInt4 (runtime/kernels/native/__init__.py asks, through ctypes) */
__attribute__((visibility("default"))) int cann_matmul_int4_built(void) { return MATMUL_INT4_BUILT; }
