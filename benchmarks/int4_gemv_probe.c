/* A probe, not part of the runtime: how fast a C int4 GEMV (one row, MatMulNBits' layout: B[N][K/128][64]
   bytes, low nibble first, a float32 scale per block of 128, zero point 8) reads weights on OpenMP threads, over
   distinct weights of MB megabytes in all; `float` multiplies in float32, `vnni` in int8 with AVX-512 VNNI
   (activations quantized per block, as onnxruntime's accuracy level 4 does; needs a CPU with avx512_vnni).

       gcc -O3 -march=native -ffast-math -fopenmp benchmarks/int4_gemv_probe.c -o /tmp/int4_gemv_probe
       OMP_NUM_THREADS=2 /tmp/int4_gemv_probe 576 3072 90 vnni    # K N MB float|vnni; 8 MB stays in L3

   Set beside benchmarks/matmul_nbits_bandwidth.py (onnxruntime's MatMulNBits on the same shapes): when a figure
   is the same in L3 and from memory, that kernel is bound by its arithmetic, not by memory (docs/performance.md). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <immintrin.h>
#include <omp.h>
/* y[n] = sum_b scale[n,b] * sum_k (q - 8) * x[b*128+k], MatMulNBits layout: B[N][blocks][64] bytes, low nibble first */
static void gemv(const uint8_t* B, const float* S, const float* xe, const float* xo, const float* xsum, int K, int N, float* y) {
  const int blocks = K / 128;
  #pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const uint8_t* row = B + (size_t)n * blocks * 64;
    float acc = 0.0f;
    for (int b = 0; b < blocks; b++) {
      const uint8_t* q = row + b * 64;
      const float* e = xe + b * 64; const float* o = xo + b * 64;
      float s = 0.0f;
      for (int i = 0; i < 64; i++) s += (float)(q[i] & 15) * e[i] + (float)(q[i] >> 4) * o[i];
      acc += S[n * blocks + b] * (s - 8.0f * xsum[b]);
    }
    y[n] = acc;
  }
}
/* int8 activations (per block scale), u8 nibbles: acc_i32 += q * x8; y += scale_w * scale_x * (acc - 8 * sum x8) */
static void gemv_vnni(const uint8_t* B, const float* S, const int8_t* xe, const int8_t* xo, const int32_t* xsum, const float* xscale, int K, int N, float* y) {
  const int blocks = K / 128;
  #pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const uint8_t* row = B + (size_t)n * blocks * 64;
    float acc = 0.0f;
    for (int b = 0; b < blocks; b++) {
      const uint8_t* q = row + b * 64;
      const int8_t* e = xe + b * 64; const int8_t* o = xo + b * 64;
      __m512i qv = _mm512_loadu_si512((const void*)q);
      __m512i lo = _mm512_and_si512(qv, _mm512_set1_epi8(15));
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(qv, 4), _mm512_set1_epi8(15));
      __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void*)e));
      a = _mm512_dpbusd_epi32(a, hi, _mm512_loadu_si512((const void*)o));
      int32_t s = _mm512_reduce_add_epi32(a);
      acc += S[n * blocks + b] * xscale[b] * (float)(s - 8 * xsum[b]);
    }
    y[n] = acc;
  }
}
int main(int argc, char** argv) {
  if (argc < 5) { fprintf(stderr, "usage: int4_gemv_probe K N MB float|vnni\n"); return 2; }
  int K = atoi(argv[1]), N = atoi(argv[2]); double mb = atof(argv[3]); int vnni = argv[4][0] == 'v';
  int blocks = K / 128; size_t wb = (size_t)N * blocks * 64 + (size_t)N * blocks * 4;
  int count = (int)(mb * 1e6 / wb); if (count < 1) count = 1;
  uint8_t** B = malloc(sizeof(void*) * count); float** S = malloc(sizeof(void*) * count);
  for (int c = 0; c < count; c++) {
    B[c] = malloc((size_t)N * blocks * 64);
    S[c] = malloc(sizeof(float) * N * blocks);
    for (size_t i = 0; i < (size_t)N * blocks * 64; i++) B[c][i] = rand();
    for (int i = 0; i < N * blocks; i++) S[c][i] = 0.01f;
  }
  float *xe = malloc(4 * K / 2), *xo = malloc(4 * K / 2), *xs = malloc(4 * blocks), *y = malloc(4 * N);
  for (int i = 0; i < K / 2; i++) { xe[i] = 0.5f; xo[i] = 0.25f; } for (int b = 0; b < blocks; b++) xs[b] = 48.0f;
  int8_t *qe = malloc(K / 2), *qo = malloc(K / 2); int32_t* qs = malloc(4 * blocks); float* qsc = malloc(4 * blocks);
  for (int i = 0; i < K / 2; i++) { qe[i] = (int8_t)(i % 50 - 25); qo[i] = (int8_t)(i % 30 - 15); }
  for (int b = 0; b < blocks; b++) { qs[b] = 3; qsc[b] = 0.02f; }
#define RUN(c) (vnni ? gemv_vnni(B[c], S[c], qe, qo, qs, qsc, K, N, y) : gemv(B[c], S[c], xe, xo, xs, K, N, y))
  for (int r = 0; r < 3; r++) for (int c = 0; c < count; c++) RUN(c);
  double best = 1e9;
  for (int r = 0; r < 15; r++) { struct timespec t0, t1; clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int c = 0; c < count; c++) RUN(c);
    clock_gettime(CLOCK_MONOTONIC, &t1); double dt = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    double per = dt / count; if (per < best) best = per; }
  printf("%s %dx%d %d weights %.1f MB: %.1f us a matmul (best of 15), %.1f GB/s\n", vnni ? "vnni" : "float", K, N, count, count * wb / 1e6, best * 1e6, wb / best / 1e9);
  return 0;
}
