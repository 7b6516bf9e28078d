/* A probe, not part of the runtime: how fast a plain C int4 GEMV (one row, MatMulNBits' layout: B[N][K/128][64]
   bytes, low nibble first, a float32 scale per block of 128, zero point 8) reads weights, float arithmetic on two
   OpenMP threads, over distinct weights of --mb megabytes in all.

       gcc -O3 -march=native -ffast-math -fopenmp benchmarks/int4_gemv_probe.c -o /tmp/int4_gemv_probe
       OMP_NUM_THREADS=2 /tmp/int4_gemv_probe 576 3072 90      # K N MB; and 8 MB to stay in L3

   Set beside benchmarks/matmul_nbits_bandwidth.py (onnxruntime's MatMulNBits on the same shapes): when the figure
   is the same in L3 and from memory, the kernel is bound by its arithmetic, not by memory (docs/performance.md). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
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
int main(int argc, char** argv) {
  int K = atoi(argv[1]), N = atoi(argv[2]); double mb = atof(argv[3]);
  int blocks = K / 128; size_t wb = (size_t)N * blocks * 64 + (size_t)N * blocks * 4;
  int count = (int)(mb * 1e6 / wb); if (count < 1) count = 1;
  uint8_t** B = malloc(sizeof(void*) * count); float** S = malloc(sizeof(void*) * count);
  for (int c = 0; c < count; c++) { B[c] = malloc((size_t)N * blocks * 64); S[c] = malloc(sizeof(float) * N * blocks);
    for (size_t i = 0; i < (size_t)N * blocks * 64; i++) B[c][i] = rand(); for (int i = 0; i < N * blocks; i++) S[c][i] = 0.01f; }
  float *xe = malloc(4 * K / 2), *xo = malloc(4 * K / 2), *xs = malloc(4 * blocks), *y = malloc(4 * N);
  for (int i = 0; i < K / 2; i++) { xe[i] = 0.5f; xo[i] = 0.25f; } for (int b = 0; b < blocks; b++) xs[b] = 48.0f;
  for (int r = 0; r < 3; r++) for (int c = 0; c < count; c++) gemv(B[c], S[c], xe, xo, xs, K, N, y);
  double best = 1e9;
  for (int r = 0; r < 15; r++) { struct timespec t0, t1; clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int c = 0; c < count; c++) gemv(B[c], S[c], xe, xo, xs, K, N, y);
    clock_gettime(CLOCK_MONOTONIC, &t1); double dt = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    double per = dt / count; if (per < best) best = per; }
  printf("%dx%d %d weights %.1f MB: %.1f us a matmul (best of 15), %.1f GB/s\n", K, N, count, count * wb / 1e6, best * 1e6, wb / best / 1e9);
  return 0;
}
