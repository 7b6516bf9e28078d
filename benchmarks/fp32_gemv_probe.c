/* A probe, not part of the runtime: how fast a plain AVX-512 FP32 GEMV (one row, y = x · W with W [K][N] row-major,
   as an ONNX MatMul's B) reads its weights on two threads, over distinct weights of MB megabytes in all: each thread
   streams a contiguous half of W's rows, ROWS of them a pass (the partial y, N floats, stays in L1), with software
   prefetch PF bytes ahead (0: none); the two halves' sums are added at the end.

       gcc -O3 -march=native -pthread benchmarks/fp32_gemv_probe.c -o /tmp/fp32_gemv_probe
       /tmp/fp32_gemv_probe 576 3072 300 4 1024     # K N MB ROWS(2|4) PF

   Set beside `python benchmarks/fp32_matmul.py` (onnxruntime's MatMul, MLAS, on the same shapes): an FP32 lead at
   batch 1 needs a kernel that reads faster than MLAS does at one row (docs/performance.md#peers-at-batch-1). */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int K, N, ROWS, PF;
static float **W, *x, *part[2];
static atomic_int posted, finished;
static int current;

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

/* thread `half`'s rows of weight m into part[half] */
static void rows_of(int m, int half) {
  const int k0 = half ? K / 2 : 0, k1 = half ? K : K / 2;
  float* y = part[half];
  memset(y, 0, sizeof(float) * (size_t)N);
  for (int k = k0; k + ROWS <= k1; k += ROWS) {
    const float* r = W[m] + (size_t)k * N;
    __m512 a[4];
    for (int i = 0; i < ROWS; i++) a[i] = _mm512_set1_ps(x[k + i]);
    for (int n = 0; n < N; n += 16) {
      __m512 v = _mm512_loadu_ps(y + n);
      for (int i = 0; i < ROWS; i++) {
        if (PF) _mm_prefetch((const char*)(r + (size_t)i * N + n) + PF, _MM_HINT_T0);
        v = _mm512_fmadd_ps(a[i], _mm512_loadu_ps(r + (size_t)i * N + n), v);
      }
      _mm512_storeu_ps(y + n, v);
    }
  }
}

static void* helper(void* unused) {
  (void)unused;
  for (int seen = 0;;) {
    const int post = atomic_load(&posted);
    if (post == seen) {
      _mm_pause();
      continue;
    }
    seen = post;
    rows_of(current, 1);
    atomic_fetch_add(&finished, 1);
  }
  return NULL;
}

static int by_value(const void* a, const void* b) { return (*(const double*)a > *(const double*)b) - (*(const double*)a < *(const double*)b); }

int main(int argc, char** argv) {
  if (argc < 6) {
    fprintf(stderr, "usage: %s K N MB ROWS(2|4) PF\n", argv[0]);
    return 2;
  }
  K = atoi(argv[1]), N = atoi(argv[2]), ROWS = atoi(argv[4]), PF = atoi(argv[5]);
  const double megabytes = atof(argv[3]);
  if (K % (2 * ROWS) || N % 16 || (ROWS != 2 && ROWS != 4)) {
    fprintf(stderr, "K must be a multiple of 2·ROWS, N of 16, ROWS 2 or 4\n");
    return 2;
  }
  const size_t bytes = (size_t)K * N * sizeof(float);
  int count = (int)(megabytes * 1e6 / bytes);
  if (count < 1) count = 1;
  W = malloc(sizeof(float*) * (size_t)count);
  for (int i = 0; i < count; i++) {
    W[i] = aligned_alloc(64, bytes);
    for (size_t j = 0; j < (size_t)K * N; j++) W[i][j] = (float)(j % 7) * 0.01f;
  }
  x = malloc(sizeof(float) * (size_t)K);
  for (int i = 0; i < K; i++) x[i] = 1.0f / (float)(i + 1);
  part[0] = aligned_alloc(64, sizeof(float) * (size_t)N);
  part[1] = aligned_alloc(64, sizeof(float) * (size_t)N);
  pthread_t thread;
  pthread_create(&thread, NULL, helper, NULL);
  double times[15];
  for (int round = 0; round < 15; round++) {
    const double start = now_us();
    for (int m = 0; m < count; m++) {
      current = m;
      atomic_store(&finished, 0);
      atomic_fetch_add(&posted, 1);
      rows_of(m, 0);
      while (atomic_load(&finished) < 1) _mm_pause();
      for (int n = 0; n < N; n += 16) _mm512_storeu_ps(part[0] + n, _mm512_add_ps(_mm512_loadu_ps(part[0] + n), _mm512_loadu_ps(part[1] + n)));
    }
    times[round] = (now_us() - start) / count;
  }
  qsort(times, 15, sizeof(double), by_value);
  printf("%dx%d x%d, %d rows a pass, prefetch %d: %.1f us (%.1f GB/s)\n", K, N, count, ROWS, PF, times[7], bytes / times[7] / 1e3);
  return 0;
}
