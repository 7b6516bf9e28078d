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

size_t matmul_int4_lane_bytes(int64_t m, int64_t pieces) {
  (void)m;
  (void)pieces;
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
  const int64_t K = w->k->K, block = w->k->block, blocks = w->blocks;
  const float* a = w->a + (int64_t)row * K;
  const float* s = w->a_scale;
  int8_t* q = w->q + (int64_t)row * w->q_stride;
  float* q_scale = w->q_scale + (int64_t)row * blocks;
  int32_t* q_sum = w->q_sum + (int64_t)row * blocks;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  float inverse[blocks];
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t start = b * block, count = K - start < block ? K - start : block;
    __m256 largest = _mm256_setzero_ps();
    for (int64_t i = 0; i < count; i += 8)
      largest = _mm256_max_ps(largest, _mm256_and_ps(load8(a + start + i, s ? s + start + i : NULL, count - i), magnitude));
    const float most = largest8(largest);
    inverse[b] = most > 0.0f ? 127.0f / most : 0.0f;
    q_scale[b] = most > 0.0f ? most / 127.0f : 1.0f;
    q_sum[b] = 0;
  }
  if (w->k->bits == 4) {
    for (int64_t piece = 0; piece < w->pieces; piece++)
      for (int64_t i = 0; i < 2 * PIECE; i += 64) { /* 64 elements: one block, or two of 32 */
        const int64_t at = piece * 2 * PIECE + i;
        int8_t* out = q + piece * 2 * PIECE + i / 2; /* their evens to the piece's first half, their odds to its second */
        if (at >= blocks * block) { /* the half piece's missing half */
          _mm256_storeu_si256((__m256i*)out, _mm256_setzero_si256());
          _mm256_storeu_si256((__m256i*)(out + PIECE), _mm256_setzero_si256());
          continue;
        }
        __m256i v[8];
        for (int j = 0; j < 8; j++) {
          /* past the last block (a half piece) the loads are masked to zeros: any block's inverse will do */
          const int64_t b = (at + 8 * j) / block < blocks ? (at + 8 * j) / block : blocks - 1;
          v[j] = rounded(a + at + 8 * j, s ? s + at + 8 * j : NULL, K - at - 8 * j, _mm256_set1_ps(inverse[b]));
          q_sum[b] += total8(v[j]);
        }
        _mm256_storeu_si256((__m256i*)out, pack32(alternate(v[0], v[1], 0), alternate(v[2], v[3], 0),
                                                  alternate(v[4], v[5], 0), alternate(v[6], v[7], 0)));
        _mm256_storeu_si256((__m256i*)(out + PIECE), pack32(alternate(v[0], v[1], 1), alternate(v[2], v[3], 1),
                                                            alternate(v[4], v[5], 1), alternate(v[6], v[7], 1)));
      }
    return;
  }
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t start = b * block;
    const __m256 times = _mm256_set1_ps(inverse[b]);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t at = 0; at < block; at += 32) {
      __m256i v[4];
      for (int j = 0; j < 4; j++) {
        v[j] = rounded(a + start + at + 8 * j, s ? s + start + at + 8 * j : NULL, K - start - at - 8 * j, times);
        sum = _mm256_add_epi32(sum, v[j]);
      }
      _mm256_storeu_si256((__m256i*)(q + start + at), pack32(v[0], v[1], v[2], v[3]));
    }
    q_sum[b] = total8(sum);
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
   taken off; `both` holds [R][blocks][16] products of the scales. 4 bits go piece by piece, `per_piece`
   blocks each (two blocks of 64: each half of the piece's bytes dotted and scaled on its own; four of 32:
   each quarter's lanes of a half's dots scaled by its own). */
static inline __attribute__((always_inline)) void sixteen(const Work* w, int64_t n0, const uint8_t* base, int64_t r0,
                                                          int R, int bits, int per_piece, float* both) {
  const int64_t blocks = w->blocks, block = w->k->block, block_bytes = w->block_bytes, pieces = w->pieces;
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
    if (bits == 4) { /* byte k of a piece holds elements 2k (low nibble) and 2k+1: q's evens at xb + k, odds at xb + 64 + k */
      for (int64_t p = 0; p < pieces; p++) {
        const uint8_t* piece = column + p * PIECE;
        if (r0 == 0) _mm_prefetch((const char*)(piece + PREFETCH), PREFETCH_HINT); /* as in the AVX-512 kernel */
        const int half = w->half_last && p == pieces - 1;
        const __m256i b0 = _mm256_loadu_si256((const __m256i*)piece);
        const __m256i b1 = half ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i*)(piece + 32));
        const __m256i l0 = _mm256_and_si256(b0, low), h0 = _mm256_and_si256(_mm256_srli_epi16(b0, 4), low);
        const __m256i l1 = _mm256_and_si256(b1, low), h1 = _mm256_and_si256(_mm256_srli_epi16(b1, 4), low);
        const int64_t first = p * per_piece; /* the piece's first block: each 16 bytes of it a block when four */
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
          const int8_t* xb = w->q + (r0 + i) * w->q_stride + p * 2 * PIECE;
          const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(l0, _mm256_loadu_si256((const __m256i*)xb)),
                                              _mm256_maddubs_epi16(h0, _mm256_loadu_si256((const __m256i*)(xb + PIECE))));
          const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(l1, _mm256_loadu_si256((const __m256i*)(xb + 32))),
                                              _mm256_maddubs_epi16(h1, _mm256_loadu_si256((const __m256i*)(xb + PIECE + 32))));
          const float* s0 = both + (i * blocks + first) * TASK_COLUMNS + j;
          if (per_piece == 1) {
            sum[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones)), _mm256_set1_ps(*s0), sum[i]);
          } else if (per_piece == 2) {
            sum[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p0, ones)), _mm256_set1_ps(*s0), sum[i]);
            if (!half) sum[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p1, ones)), _mm256_set1_ps(s0[TASK_COLUMNS]), sum[i]);
          } else { /* lanes 0-3 of a half's dots are one block's, lanes 4-7 the next one's */
            const __m256 first_half = _mm256_blend_ps(_mm256_set1_ps(s0[0]), _mm256_set1_ps(s0[TASK_COLUMNS]), 0xF0);
            sum[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p0, ones)), first_half, sum[i]);
            if (!half) {
              const __m256 second_half = _mm256_blend_ps(_mm256_set1_ps(s0[2 * TASK_COLUMNS]), _mm256_set1_ps(s0[3 * TASK_COLUMNS]), 0xF0);
              sum[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p1, ones)), second_half, sum[i]);
            }
          }
        }
      }
    } else {
      for (int64_t b = 0; b < blocks; b++) {
        const uint8_t* piece = column + b * block_bytes;
        if (r0 == 0) { /* as in the AVX-512 kernel: the hardware's prefetch alone leaves memory underused */
          _mm_prefetch((const char*)(piece + PREFETCH), PREFETCH_HINT);
          if (block_bytes > PIECE) _mm_prefetch((const char*)(piece + PREFETCH + PIECE), PREFETCH_HINT);
        }
        __m256i d[ROWS];
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) d[i] = _mm256_setzero_si256();
        for (int64_t c = 0; c < block_bytes; c += 32) {
          const __m256i signed_w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(piece + c)), flip);
          const __m256i magnitude = _mm256_abs_epi8(signed_w);
#pragma GCC unroll 4
          for (int i = 0; i < R; i++) {
            const __m256i x = _mm256_loadu_si256((const __m256i*)(w->q + (r0 + i) * w->q_stride + b * block + c));
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
static inline __attribute__((always_inline)) void group(const Work* w, int64_t n0, int bits, int per_piece, float* both) {
  const uint8_t* base = n0 + TASK_COLUMNS <= w->k->N ? w->b + n0 * w->blocks * w->block_bytes : w->k->last_group;
  int64_t r = 0;
  for (; r + ROWS <= w->m; r += ROWS) sixteen(w, n0, base, r, ROWS, bits, per_piece, both);
  for (; r < w->m; r++) sixteen(w, n0, base, r, 1, bits, per_piece, both);
}

void matmul_int4_columns(void* data, size_t task) {
  const Work* w = (const Work*)data;
  const int64_t start = (int64_t)task * w->task_columns;
  const int64_t end = start + w->task_columns < w->k->N ? start + w->task_columns : w->k->N;
  float* both = w->both + (int64_t)task * ROWS * w->blocks * TASK_COLUMNS;
  for (int64_t n = start; n < end; n += TASK_COLUMNS) {
    if (w->per_piece == 4) group(w, n, 4, 4, both);
    else if (w->per_piece == 2) group(w, n, 4, 2, both);
    else if (w->per_piece == 1) group(w, n, 4, 1, both);
    else group(w, n, 8, 1, both);
  }
}

#endif
