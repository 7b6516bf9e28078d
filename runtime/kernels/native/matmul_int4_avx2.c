/* cann::MatMulInt4's kernels on CPUs with AVX2 and FMA but no AVX-512 VNNI (matmul_int4.h; the op is
   matmul_int4.c): the column form of the AVX-512 kernel at every row count, 16 columns a task group, a
   column's weights read front to back with software prefetch and 16 columns reduced together at the end,
   in 8-lane vectors. Without vpdpbusd an int8 dot is vpmaddubsw (unsigned by signed bytes into int16 pairs)
   then vpmaddwd into int32: exact for 4-bit weights (four blocks' pairs of 15 · 127 add up below 2^15
   before widening), and for 8-bit ones taken as w - 128 (signed), its magnitude as the unsigned operand and
   its sign moved onto the activation (|w - 128| · 127 · 2 < 2^15), the zero point's share shifted by 128
   to match. docs/performance.md#int4-matmul has what it gives against MLAS's MatMulNBits. */
#include <string.h>

#include "matmul_int4.h"

#if MATMUL_INT4_ISA == 256
#include <immintrin.h>

size_t matmul_int4_lane_bytes(int64_t m, int64_t blocks, int64_t block_bytes) {
  (void)m;
  (void)blocks;
  (void)block_bytes;
  return 0; /* no lane path here */
}

/* 8 floats from `x` (only `count` of them, the rest 0), times `scale`'s when there is one */
static inline __m256 load8(const float* x, const float* scale, int64_t count) {
  if (count >= 8) {
    const __m256 v = _mm256_loadu_ps(x);
    return scale ? _mm256_mul_ps(v, _mm256_loadu_ps(scale)) : v;
  }
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)(count > 0 ? count : 0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256 v = _mm256_maskload_ps(x, mask);
  return scale ? _mm256_mul_ps(v, _mm256_maskload_ps(scale, mask)) : v;
}

/* those times `inverse`, rounded half to even */
static inline __m256i rounded(const float* x, const float* scale, int64_t count, __m256 inverse) {
  return _mm256_cvtps_epi32(_mm256_mul_ps(load8(x, scale, count), inverse));
}

/* 32 int32 (a, b, c, d, 8 each, in that order) into 32 saturated int8 */
static inline __m256i pack32(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* the even (odd = 0) or odd (odd = 1) elements of a's 8 then b's 8, in order */
static inline __m256i alternate(__m256i a, __m256i b, int odd) {
  const __m256 fa = _mm256_castsi256_ps(a), fb = _mm256_castsi256_ps(b);
  const __m256 picked = odd ? _mm256_shuffle_ps(fa, fb, _MM_SHUFFLE(3, 1, 3, 1)) : _mm256_shuffle_ps(fa, fb, _MM_SHUFFLE(2, 0, 2, 0));
  return _mm256_permute4x64_epi64(_mm256_castps_si256(picked), _MM_SHUFFLE(3, 1, 2, 0));
}

static inline float largest8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

static inline int32_t total8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

void matmul_int4_quantize_row(void* data, size_t row) {
  const Work* w = (const Work*)data;
  const int64_t K = w->k->K, block = w->k->block;
  const float* a = w->a + (int64_t)row * K;
  int8_t* q = w->q + (int64_t)row * w->blocks * block;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < w->blocks; b++) {
    const int64_t start = b * block, count = K - start < block ? K - start : block;
    const float* s = w->a_scale ? w->a_scale + start : NULL;
    __m256 largest = _mm256_setzero_ps();
    for (int64_t i = 0; i < count; i += 8)
      largest = _mm256_max_ps(largest, _mm256_and_ps(load8(a + start + i, s ? s + i : NULL, count - i), magnitude));
    const float most = largest8(largest);
    const __m256 inverse = _mm256_set1_ps(most > 0.0f ? 127.0f / most : 0.0f);
    const float* x = a + start;
    int8_t* out = q + start;
    __m256i sum = _mm256_setzero_si256();
    for (int64_t at = 0; at < block; at += w->k->bits == 4 ? 64 : 32) {
      __m256i v[8];
      const int parts = w->k->bits == 4 ? 8 : 4;
      for (int j = 0; j < parts; j++) {
        v[j] = rounded(x + at + 8 * j, s ? s + at + 8 * j : NULL, count - at - 8 * j, inverse);
        sum = _mm256_add_epi32(sum, v[j]);
      }
      if (w->k->bits == 4) { /* elements at..at+63: their evens to the piece's first half, their odds to its second */
        const int64_t piece = at / 128 * 128, into = piece + (at - piece) / 2;
        _mm256_storeu_si256((__m256i*)(out + into), pack32(alternate(v[0], v[1], 0), alternate(v[2], v[3], 0),
                                                           alternate(v[4], v[5], 0), alternate(v[6], v[7], 0)));
        _mm256_storeu_si256((__m256i*)(out + into + PIECE), pack32(alternate(v[0], v[1], 1), alternate(v[2], v[3], 1),
                                                                   alternate(v[4], v[5], 1), alternate(v[6], v[7], 1)));
      } else {
        _mm256_storeu_si256((__m256i*)(out + at), pack32(v[0], v[1], v[2], v[3]));
      }
    }
    w->q_scale[(int64_t)row * w->blocks + b] = most > 0.0f ? most / 127.0f : 1.0f;
    w->q_sum[(int64_t)row * w->blocks + b] = total8(sum);
  }
}

/* 8 vectors into one: lane j the sum of d[j]'s lanes */
static inline __m256 sum8(const __m256* d) {
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(d[0], d[1]), _mm256_hadd_ps(d[2], d[3]));
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(d[4], d[5]), _mm256_hadd_ps(d[6], d[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* TASK_COLUMNS (16) columns for R rows (1 or ROWS), a column at a time, as the AVX-512 kernel's `sixteen`
   does: a column's row of weights read front to back and unpacked once for the R rows, each block's int32
   dots scaled into a vector of partial sums, the 16 columns reduced at the end and the zero points' share
   taken off; `both` holds [R][blocks][16] products of the scales. */
static inline __attribute__((always_inline)) void sixteen(const Work* w, int64_t n0, const uint8_t* base, int64_t r0,
                                                          int R, int bits, float* both) {
  const int64_t blocks = w->blocks, block = w->k->block, block_bytes = w->block_bytes;
  const float* scale_t = w->k->scale_t + n0 * blocks;
  const uint8_t* zero_t = w->k->zero_t + n0 * blocks;
  /* 8 bits multiply w - 128, so the zero point's share is (zero - 128) times the activations' sum */
  const __m256i zero_bias = _mm256_set1_epi32(bits == 8 ? 128 : 0);
  const __m256i low = _mm256_set1_epi8(15), flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
  __m256 shift[ROWS][2];
  for (int i = 0; i < R; i++) {
    const int64_t row = (r0 + i) * blocks;
    for (int h = 0; h < 2; h++) {
      shift[i][h] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; b++) {
        const int64_t at = b * TASK_COLUMNS + 8 * h;
        const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(scale_t + at), _mm256_set1_ps(w->q_scale[row + b]));
        _mm256_storeu_ps(both + (i * blocks + b) * TASK_COLUMNS + 8 * h, scale);
        const __m256 zero = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(zero_t + at))), zero_bias));
        shift[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(scale, zero), _mm256_set1_ps((float)w->q_sum[row + b]), shift[i][h]);
      }
    }
  }
  __m256 acc[ROWS][TASK_COLUMNS];
  for (int j = 0; j < TASK_COLUMNS; j++) {
    const uint8_t* column = base + j * blocks * block_bytes;
    __m256 sum[ROWS];
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) sum[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
      const uint8_t* piece = column + b * block_bytes;
      if (r0 == 0) { /* as in the AVX-512 kernel: the hardware's prefetch alone leaves memory underused */
        _mm_prefetch((const char*)(piece + PREFETCH), _MM_HINT_T0);
        if (block_bytes > PIECE) _mm_prefetch((const char*)(piece + PREFETCH + PIECE), _MM_HINT_T0);
      }
      if (bits == 4) { /* byte k holds elements 2k (low nibble) and 2k+1: q's evens at xb + k, odds at xb + 64 + k */
        const __m256i b0 = _mm256_loadu_si256((const __m256i*)piece), b1 = _mm256_loadu_si256((const __m256i*)(piece + 32));
        const __m256i l0 = _mm256_and_si256(b0, low), h0 = _mm256_and_si256(_mm256_srli_epi16(b0, 4), low);
        const __m256i l1 = _mm256_and_si256(b1, low), h1 = _mm256_and_si256(_mm256_srli_epi16(b1, 4), low);
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
          const int8_t* xb = w->q + ((r0 + i) * blocks + b) * block;
          const __m256i p = _mm256_add_epi16(
              _mm256_add_epi16(_mm256_maddubs_epi16(l0, _mm256_loadu_si256((const __m256i*)xb)),
                               _mm256_maddubs_epi16(l1, _mm256_loadu_si256((const __m256i*)(xb + 32)))),
              _mm256_add_epi16(_mm256_maddubs_epi16(h0, _mm256_loadu_si256((const __m256i*)(xb + PIECE))),
                               _mm256_maddubs_epi16(h1, _mm256_loadu_si256((const __m256i*)(xb + PIECE + 32)))));
          const __m256i d = _mm256_madd_epi16(p, ones);
          sum[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(both[(i * blocks + b) * TASK_COLUMNS + j]), sum[i]);
        }
      } else {
        __m256i d[ROWS];
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) d[i] = _mm256_setzero_si256();
        for (int64_t c = 0; c < block_bytes; c += 32) {
          const __m256i signed_w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(piece + c)), flip);
          const __m256i magnitude = _mm256_abs_epi8(signed_w);
#pragma GCC unroll 4
          for (int i = 0; i < R; i++) {
            const __m256i x = _mm256_loadu_si256((const __m256i*)(w->q + ((r0 + i) * blocks + b) * block + c));
            d[i] = _mm256_add_epi32(d[i], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, signed_w)), ones));
          }
        }
#pragma GCC unroll 4
        for (int i = 0; i < R; i++)
          sum[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[i]), _mm256_set1_ps(both[(i * blocks + b) * TASK_COLUMNS + j]), sum[i]);
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) acc[i][j] = sum[i];
  }
  const int64_t count = w->k->N - n0 < TASK_COLUMNS ? w->k->N - n0 : TASK_COLUMNS;
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int i = 0; i < R; i++)
    for (int h = 0; h < 2; h++) {
      const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)(count - 8 * h)), lanes);
      _mm256_maskstore_ps(w->y + (r0 + i) * w->k->N + n0 + 8 * h, valid, _mm256_sub_ps(sum8(acc[i] + 8 * h), shift[i][h]));
    }
}

/* every row of the group at n0: ROWS at a time, then one by one */
static inline __attribute__((always_inline)) void group(const Work* w, int64_t n0, int bits, float* both) {
  const uint8_t* base = n0 + TASK_COLUMNS <= w->k->N ? w->b + n0 * w->blocks * w->block_bytes : w->k->last_group;
  int64_t r = 0;
  for (; r + ROWS <= w->m; r += ROWS) sixteen(w, n0, base, r, ROWS, bits, both);
  for (; r < w->m; r++) sixteen(w, n0, base, r, 1, bits, both);
}

void matmul_int4_columns(void* data, size_t task) {
  const Work* w = (const Work*)data;
  const int64_t start = (int64_t)task * w->task_columns;
  const int64_t end = start + w->task_columns < w->k->N ? start + w->task_columns : w->k->N;
  float* both = w->both + (int64_t)task * ROWS * w->blocks * TASK_COLUMNS;
  for (int64_t n = start; n < end; n += TASK_COLUMNS) {
    if (w->k->bits == 4) group(w, n, 4, both);
    else group(w, n, 8, both);
  }
}

#endif
