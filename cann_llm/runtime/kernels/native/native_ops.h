/* What the native ops share: onnxruntime's API table, error statuses, reading a tensor, a vectorizable exp,
   a 16-way reduction of vectors, and the fillers that describe each op to onnxruntime (library.c registers them). */
#ifndef CANN_NATIVE_OPS_H
#define CANN_NATIVE_OPS_H

#include <math.h>
#include <stdint.h>

#include "ort_abi.h"

#define DOMAIN "cann"

extern const OrtApi* g_api; /* set once by RegisterCustomOps */

typedef struct {
  const float* data;
  int64_t dims[6];
  size_t rank;
} Tensor;

OrtStatus* fail(const char* message);
/* `value`'s dims (at most 6) and data; an error status for more dims */
OrtStatus* tensor_of(const OrtValue* value, Tensor* out);
int64_t elements(const Tensor* t);
/* input `index` of the running node, which must be present; the error names `op` */
OrtStatus* required_input(OrtKernelContext* context, size_t index, Tensor* out, const char* op);
/* the node's int attribute `name`; an error status when it has none */
OrtStatus* int_attribute(const OrtKernelInfo* info, const char* name, int64_t* out);
/* the node's int attribute `name`, or `fallback` when it has none */
int64_t int_attribute_or(const OrtKernelInfo* info, const char* name, int64_t fallback);

/* Cephes' expf as cann_llm/runtime/kernels/fast_math.py has it (the numpy reference there holds both): plain
   arithmetic the compiler vectorizes, where libm's expf is a call per element. Clamped to [-87, 88]: -87
   gives ~1.6e-38 (-inf, a masked score, gives it too), 88 ~1.7e38, the largest exponent float32 holds. Its
   constants, once for it and for its 16- and 8-lane forms below: */
#define EXP_LO (-87.0f)
#define EXP_HI 88.0f
#define EXP_LOG2E 1.4426950408889634f
#define EXP_LN2_HI 0.693359375f /* ln 2 in two parts, for an exact n · ln 2 */
#define EXP_LN2_LO (-2.12194440e-4f)
#define EXP_P0 1.9875691500e-4f /* the polynomial's coefficients, highest power first */
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

static inline float fast_exp(float x) {
  x = x > EXP_LO ? x : EXP_LO;
  x = x < EXP_HI ? x : EXP_HI;
  float n = floorf(x * EXP_LOG2E + 0.5f);
  float r = x - n * EXP_LN2_HI - n * EXP_LN2_LO;
  float p = EXP_P0;
  p = p * r + EXP_P1;
  p = p * r + EXP_P2;
  p = p * r + EXP_P3;
  p = p * r + EXP_P4;
  p = p * r + EXP_P5;
  p = p * r * r + r + 1.0f;
  union { int32_t i; float f; } bits = {.i = ((int32_t)n + 127) << 23};
  return p * bits.f;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* fast_exp on 16 lanes (the same clamp, polynomial and rounding) */
static inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x));
  __m512 p = _mm512_set1_ps(EXP_P0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* 16 vectors into one: lane j the sum of d[j]'s lanes */
static inline __m512 sum16(const __m512 d[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; i++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of d[2i], d[2i+1] */
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]), _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
  for (int i = 0; i < 4; i++) { /* per 128-bit lane: that lane's sums of d[4i..4i+3] */
    const __m512d p = _mm512_castps_pd(a[2 * i]), q = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)), _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
  }
  for (int i = 0; i < 2; i++) /* 128-bit lanes: halves of d[8i..8i+3]'s sums, then of d[8i+4..8i+7]'s */
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* fast_exp on 8 lanes (the same clamp, polynomial and rounding) */
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(EXP_LOG2E), _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x));
  __m256 p = _mm256_set1_ps(EXP_P0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

/* an op description with what every op here has alike (CPU, required inputs and outputs, a kernel freed
   with free()); the op's own file sets its name, types, counts, kernel creation and compute */
void common_op(OrtCustomOp* op);
OrtCustomOpInputOutputCharacteristic required(const OrtCustomOp* op, size_t index);

void paged_attention_op(OrtCustomOp* op);
void swiglu_op(OrtCustomOp* op);
/* fills `op` and returns 1 where the CPU has what a kernel needs (AVX-512 VNNI, or AVX2 and FMA), else 0 */
int matmul_int4_op(OrtCustomOp* op);
/* fill `op` and return 1 where the CPU has AVX-512 (MatMulF32) or AVX-512 with VBMI (MatMulF28), else 0
   (matmul_panels.c) */
int matmul_f28_op(OrtCustomOp* op);
int matmul_f32_op(OrtCustomOp* op);

#endif
