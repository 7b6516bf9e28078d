/* cann::MatMulF32 and cann::MatMulF28 as onnxruntime custom ops: y = A · W with the float32 weight W [K, N] stored
   in panels of 16 columns, k by k, each k a group: as float32 (MatMulF32: 64 bytes a group; cann_llm/runtime/kernels/
   float32_panels.py) or in F28 (MatMulF28: 28 bits a weight, lossless, 56 bytes a group; cann_llm/runtime/kernels/
   float28.py describes the layout and is the reference). Inputs of MatMulF32: A float32 [..., K] and the panels
   float32 [ceil(N/16), K, 16]; of MatMulF28: A, the packed panels uint8 [ceil(N/16), K, 56], the exceptions'
   panel offsets int32 [ceil(N/16) + 1], their positions int32 (k · 16 + column) and values float32. Attributes
   K, N (and F28's bias).

   In F28 a group of 16 codes (56 bytes) becomes a vector of 16 floats in six instructions: `vpermb` puts each
   code's four bytes in its lane, a shift left by 4 (even codes) or 0 (odd ones) puts its 28 bits at the top, an
   arithmetic shift right by 4 puts the sign at bit 31 (and copies of it in bits 27-30), an AND clears those,
   and the window's bias is added to the exponent field of the lanes whose code is not 0 (a zero stays 0.0).
   An exception is coded 0 and added after its panel's sums, as a[k] · value.

   Up to GEMV_ROWS rows (decode) each task streams a range of panels once, four side by side, reading
   (unpacking) each group once for every row, with software prefetch ahead: the panels and the prefetch are what
   make a step faster than onnxruntime's MatMul on the same float32 bytes, and F28's 3.5 bytes a weight faster still
   (docs/performance.md#fp32-weights-in-panels). On AMD's Zen 4 float32 panels are read without it: its own
   prefetchers stream them faster alone. From more rows on, each task runs 12-row by 32-column tiles
   over pairs of panels, the shape of MLAS's own SGEMM kernel, so that prefill stays as fast as onnxruntime's
   MatMul: float32 panels where they lie, F28 ones unpacked a few pairs at a time into a scratch of the task's
   own (exceptions in place). An infinite activation meets an F28 exception's weight as 0 · inf = NaN in the
   decode path, where a float32 MatMul gives ±inf: a model already overflowing either way.
   Built where the compiler targets AVX-512 (F28: with VBMI, for `vpermb`); elsewhere an op is not registered:
   the executor then leaves float32 MatMuls to onnxruntime and unpacks F28 weights at load for its MatMul
   (cann_llm/runtime/executor.py). */
#include <stdlib.h>
#include <string.h>

#include "native_ops.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MATMUL_PANELS_ISA 512
#else
#define MATMUL_PANELS_ISA 0
#endif
#if MATMUL_PANELS_ISA && defined(__AVX512VBMI__)
#define MATMUL_F28_ISA 512
#else
#define MATMUL_F28_ISA 0
#endif

#if MATMUL_PANELS_ISA

#include <cpuid.h>
#include <immintrin.h>

#define GROUP_F28 56       /* bytes of one k of an F28 panel: 16 codes of 28 bits */
#define GROUP_F32 64       /* of a float32 panel */
#define GEMV_ROWS 4        /* rows up to which each group is unpacked once for all of them (decode) */
#define TILE_ROWS 12       /* rows of the GEMM tile: 24 accumulators, 2 weight vectors and a broadcast */
#define PREFETCH 8192      /* GEMM (F28): bytes ahead of the panel being unpacked */
#define GEMV_STREAMS 4     /* decode: panels a task reads side by side, each a stream of its own */
#define STREAM_PREFETCH 4096 /* decode: bytes ahead of each stream (docs/performance.md#fp32-weights-in-panels) */
#define MAX_GEMV_TASKS 16  /* parallel tasks a decode call splits its panels into, as MatMulInt4 */
#define GEMM_TASKS 32      /* at most, each over a range of pairs of panels */
#define SCRATCH_BYTES (256 * 1024) /* unpacked pairs a task holds at a time: half of L2, where they are reread */

typedef struct {
  int64_t K, N, bias, group; /* group: GROUP_F28 or GROUP_F32, which op this is */
} Kernel;

typedef struct {
  const Kernel* k;
  const float* a;
  const uint8_t* packed;
  const int32_t* offsets; /* F28's exceptions; NULL for float32 panels */
  const int32_t* positions;
  const float* values;
  float* y;
  int64_t m, panels, per_task; /* per_task: panels of a decode task, pairs of panels of a GEMM one */
  int64_t batch;               /* GEMM: pairs a task unpacks at a time into its scratch, SCRATCH_BYTES at most (one at least) */
  int failed;                  /* GEMM: a task found no memory for its scratch */
} Work;

/* a float32 panel's group: as it lies */
static inline __m512 load16(const uint8_t* group) { return _mm512_loadu_ps((const float*)group); }

#if MATMUL_F28_ISA

typedef struct {
  __m512i index, shift, keep, exponent, bias;
} Unpacker;

static Unpacker unpacker(int64_t bias) {
  uint8_t index[64];
  for (int j = 0; j < 16; j++)
    for (int t = 0; t < 4; t++) index[4 * j + t] = (uint8_t)(7 * j / 2 + t); /* code j starts at bit 28j */
  Unpacker u = {_mm512_loadu_si512(index), _mm512_set_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4),
                _mm512_set1_epi32((int)0x87FFFFFF), _mm512_set1_epi32(0x07800000), _mm512_set1_epi32((int)(bias << 23))};
  return u;
}

static inline __m512 decode(const Unpacker* u, __m512i bytes) {
  __m512i d = _mm512_permutexvar_epi8(u->index, bytes);
  d = _mm512_and_si512(_mm512_srai_epi32(_mm512_sllv_epi32(d, u->shift), 4), u->keep);
  /* code 0 is +0.0 whatever its other bits, as the reference decodes it */
  return _mm512_castsi512_ps(_mm512_maskz_add_epi32(_mm512_test_epi32_mask(d, u->exponent), d, u->bias));
}

/* the 16 floats of one group, read with a 64-byte load: 8 bytes past the group, so never the tensor's last */
static inline __m512 unpack16(const Unpacker* u, const uint8_t* group) { return decode(u, _mm512_loadu_si512(group)); }

/* the same for the tensor's last group, read with a masked load that stops at its end (slower: a byte mask
   made the decode loop ~15% slower when every group took it) */
static inline __m512 unpack16_last(const Unpacker* u, const uint8_t* group) {
  return decode(u, _mm512_maskz_loadu_epi8(0x00FFFFFFFFFFFFFFull, group));
}

/* group kk of a panel, `last` when the panel is the tensor's last */
static inline __m512 unpack_at(const Unpacker* u, const uint8_t* panel, int64_t kk, int64_t K, int last) {
  return last && kk == K - 1 ? unpack16_last(u, panel + kk * GROUP_F28) : unpack16(u, panel + kk * GROUP_F28);
}

#endif

static inline __mmask16 columns_mask(const Kernel* k, int64_t panel) {
  const int64_t left = k->N - panel * 16;
  return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* panel p's exceptions added to `sums` (rows × 16 floats, row r at r · 16) */
static void exceptions(const Work* w, int64_t p, float* sums, int64_t rows) {
  const int64_t K = w->k->K;
  for (int32_t e = w->offsets[p]; e < w->offsets[p + 1]; e++) {
    const int64_t kk = w->positions[e] >> 4, lane = w->positions[e] & 15;
    for (int64_t r = 0; r < rows; r++) sums[r * 16 + lane] += w->a[r * K + kk] * w->values[e];
  }
}

/* a line ahead, or the task's last line (`stop`) where that lies past it: beyond are the next task's panels,
   which this thread will not read (a single stream 4 KiB ahead without the stop made SmolLM2's FP32 decode step
   1.08-1.10x slower). Into L2, not L1, as MatMulInt4 does: L1's few outstanding misses bounded the streams, F28's
   most (docs/performance.md#fp32-weights-in-panels) */
static inline void prefetch_within(const char* ahead, const char* stop) {
  _mm_prefetch(ahead < stop ? ahead : stop, _MM_HINT_T1);
}

/* whether float32 decode prefetches its streams: not on AMD's family 25 (Zen 4; Zen 3 has no AVX-512), where the
   hardware's prefetch alone read the step's float32 panels 1.20-1.29x faster
   (docs/performance.md#the-hardwares-prefetch-on-zen-4); Intel's and AMD's family 26 keep it, as measured
   when it was tuned. -DGEMV_SOFTWARE_PREFETCH=0|1 fixes it at build time (the tests build the other form). */
static int software_prefetch(void) {
#ifdef GEMV_SOFTWARE_PREFETCH
  return GEMV_SOFTWARE_PREFETCH;
#else
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return 1;
  const int amd = ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u; /* "AuthenticAMD" */
  if (!amd || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 1;
  const unsigned family = ((eax >> 8) & 0xf) == 0xf ? 0xf + ((eax >> 20) & 0xff) : (eax >> 8) & 0xf;
  return family != 25;
#endif
}
/* chosen as the library loads, before any session can register it, so no compute reads it while it is written */
static int g_f32_prefetch = 1;
__attribute__((constructor)) static void choose_f32_prefetch(void) { g_f32_prefetch = software_prefetch(); }

/* the offset from a stream's panel STREAM_PREFETCH ahead of `at`: past the panel's P bytes, in the stream's panel
   of the next S */
static inline int64_t stream_ahead(int64_t at, int64_t P, int64_t S) {
  const int64_t ahead = at + STREAM_PREFETCH;
  return ahead < P ? ahead : ahead + (S - 1) * P;
}

/* decode: ROWS rows times the S panels from p, each group read (unpacked) once, the S panels read side by side:
   one stream of lines a panel, each prefetched STREAM_PREFETCH ahead where PF (F28 always, float32 where
   software_prefetch()), near a panel's end into the start of its panel in the next S. More streams kept more
   lines in flight: SmolLM2's F28 decode step 1.07x faster than one stream a task, its float32 one level
   (docs/performance.md#fp32-weights-in-panels). FORMAT f32 or f28: GROUP
   its bytes, SETUP what LOAD(src, kk, K, last) needs, EXCEPTIONS whether it has them */
#define GEMV(FORMAT, ROWS, S, GROUP, SETUP, LOAD, EXCEPTIONS, PF)                                                     \
  static void gemv_##FORMAT##_##ROWS##_##S(const Work* w, int64_t p, const char* stop) {                           \
    const Kernel* k = w->k;                                                                                          \
    const int64_t K = k->K, P = K * GROUP;                                                                           \
    SETUP                                                                                                            \
    const uint8_t* src = w->packed + p * P;                                                                          \
    __m512 acc[ROWS][S];                                                                                             \
    for (int r = 0; r < ROWS; r++)                                                                                   \
      for (int s = 0; s < S; s++) acc[r][s] = _mm512_setzero_ps();                                                  \
    for (int64_t kk = 0; kk < K - 1; kk++) {                                                                         \
      if (PF)                                                                                                        \
        for (int s = 0; s < S; s++) prefetch_within((const char*)src + s * P + stream_ahead(kk * GROUP, P, S), stop); \
      __m512 av[ROWS];                                                                                               \
      for (int r = 0; r < ROWS; r++) av[r] = _mm512_set1_ps(w->a[r * K + kk]);                                       \
      for (int s = 0; s < S; s++) {                                                                                  \
        const __m512 wv = LOAD(src + s * P, kk, K, 0);                                                               \
        for (int r = 0; r < ROWS; r++) acc[r][s] = _mm512_fmadd_ps(av[r], wv, acc[r][s]);                           \
      }                                                                                                              \
    }                                                                                                                \
    const int last = p + S == w->panels; /* its last panel is the tensor's, read to its end and no further */      \
    for (int s = 0; s < S; s++) {                                                                                    \
      if (PF) prefetch_within((const char*)src + s * P + stream_ahead((K - 1) * GROUP, P, S), stop);               \
      const __m512 wv = LOAD(src + s * P, K - 1, K, last && s == S - 1);                                           \
      float sums[ROWS * 16];                                                                                         \
      for (int r = 0; r < ROWS; r++)                                                                                 \
        _mm512_storeu_ps(sums + r * 16, _mm512_fmadd_ps(_mm512_set1_ps(w->a[r * K + K - 1]), wv, acc[r][s]));       \
      if (EXCEPTIONS) exceptions(w, p + s, sums, ROWS);                                                              \
      const __mmask16 mask = columns_mask(k, p + s);                                                                 \
      for (int r = 0; r < ROWS; r++)                                                                                 \
        _mm512_mask_storeu_ps(w->y + r * k->N + (p + s) * 16, mask, _mm512_loadu_ps(sums + r * 16));                \
    }                                                                                                                \
  }
#define GEMV_ROWS_OF(FORMAT, S, GROUP, SETUP, LOAD, EXCEPTIONS, PF)                                                     \
  GEMV(FORMAT, 1, S, GROUP, SETUP, LOAD, EXCEPTIONS, PF)                                                             \
  GEMV(FORMAT, 2, S, GROUP, SETUP, LOAD, EXCEPTIONS, PF)                                                             \
  GEMV(FORMAT, 3, S, GROUP, SETUP, LOAD, EXCEPTIONS, PF)                                                             \
  GEMV(FORMAT, 4, S, GROUP, SETUP, LOAD, EXCEPTIONS, PF)
#define GEMV_ALL(FORMAT, GROUP, SETUP, LOAD, EXCEPTIONS, PF)                                                        \
  GEMV_ROWS_OF(FORMAT, 1, GROUP, SETUP, LOAD, EXCEPTIONS, PF)                                                        \
  GEMV_ROWS_OF(FORMAT, 2, GROUP, SETUP, LOAD, EXCEPTIONS, PF)                                                        \
  GEMV_ROWS_OF(FORMAT, 3, GROUP, SETUP, LOAD, EXCEPTIONS, PF)                                                        \
  GEMV_ROWS_OF(FORMAT, 4, GROUP, SETUP, LOAD, EXCEPTIONS, PF)                                                        \
  _Static_assert(GEMV_ROWS == 4 && GEMV_STREAMS == 4, "the table below is written out for 4 rows and 4 streams"); \
  typedef void (*Gemv_##FORMAT)(const Work*, int64_t, const char*);                                                 \
  static const Gemv_##FORMAT GEMV_##FORMAT[GEMV_ROWS][GEMV_STREAMS] = {                                             \
      {gemv_##FORMAT##_1_1, gemv_##FORMAT##_1_2, gemv_##FORMAT##_1_3, gemv_##FORMAT##_1_4},                         \
      {gemv_##FORMAT##_2_1, gemv_##FORMAT##_2_2, gemv_##FORMAT##_2_3, gemv_##FORMAT##_2_4},                         \
      {gemv_##FORMAT##_3_1, gemv_##FORMAT##_3_2, gemv_##FORMAT##_3_3, gemv_##FORMAT##_3_4},                         \
      {gemv_##FORMAT##_4_1, gemv_##FORMAT##_4_2, gemv_##FORMAT##_4_3, gemv_##FORMAT##_4_4}};
#define LOAD_F32(src, kk, K, last) load16((src) + (kk) * GROUP_F32)
GEMV_ALL(f32, GROUP_F32, , LOAD_F32, 0, 1)
GEMV_ALL(f32_hw, GROUP_F32, , LOAD_F32, 0, 0) /* the hardware's prefetch alone */
#if MATMUL_F28_ISA
#define LOAD_F28(src, kk, K, last) unpack_at(&u, src, kk, K, last)
GEMV_ALL(f28, GROUP_F28, const Unpacker u = unpacker(k->bias);, LOAD_F28, 1, 1)
#endif

/* a decode task: its panels [p0, p1) GEMV_STREAMS at a time (fewer at its end) */
static void gemv_task(void* work, size_t task) {
  const Work* w = (const Work*)work;
  const int64_t p0 = (int64_t)task * w->per_task, p1 = p0 + w->per_task < w->panels ? p0 + w->per_task : w->panels;
  const char* stop = (const char*)w->packed + p1 * w->k->K * w->k->group - 64;
  const int64_t rows = (w->m < GEMV_ROWS ? w->m : GEMV_ROWS) - 1, P = w->k->K * w->k->group;
  const int f32_prefetch = g_f32_prefetch;
  /* the first STREAM_PREFETCH bytes of each stream, which the loop's prefetch ahead does not reach */
  if (w->k->group != GROUP_F32 || f32_prefetch)
    for (int64_t s = 0; s < GEMV_STREAMS && p0 + s < p1; s++)
      for (int64_t at = 0; at < STREAM_PREFETCH; at += 64) prefetch_within((const char*)w->packed + (p0 + s) * P + at, stop);
  for (int64_t p = p0; p < p1; p += GEMV_STREAMS) {
    const int64_t streams = (p1 - p < GEMV_STREAMS ? p1 - p : GEMV_STREAMS) - 1;
#if MATMUL_F28_ISA
    if (w->k->group == GROUP_F28) {
      GEMV_f28[rows][streams](w, p, stop);
      continue;
    }
#endif
    (f32_prefetch ? GEMV_f32 : GEMV_f32_hw)[rows][streams](w, p, stop);
  }
}

/* TILE_ROWS rows of a, ld apart, times two panels' 16 columns (k by k, ldb floats apart: a scratch's pair or
   float32 panels as they lie) into y, ld_y apart, the columns of `first` and `second`'s masks. Its own
   function, so that nothing of the unpacking stays live in the registers the 24 accumulators need. */
__attribute__((noinline)) static void tile_12(const float* a, int64_t lda, const float* first_b, const float* second_b,
                                              int64_t ldb, int64_t K, float* y,
                                              int64_t ldy, __mmask16 first, __mmask16 second) {
#define ROW(i) __m512 c##i##0 = _mm512_setzero_ps(), c##i##1 = _mm512_setzero_ps();
  ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)
#undef ROW
  for (int64_t kk = 0; kk < K; kk++) {
    const __m512 b0 = _mm512_loadu_ps(first_b + kk * ldb), b1 = _mm512_loadu_ps(second_b + kk * ldb);
#define ROW(i)                                                      \
  {                                                                 \
    const __m512 av = _mm512_set1_ps(a[i * lda + kk]);              \
    c##i##0 = _mm512_fmadd_ps(av, b0, c##i##0);                     \
    c##i##1 = _mm512_fmadd_ps(av, b1, c##i##1);                     \
  }
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)
#undef ROW
  }
#define ROW(i)                                                      \
  _mm512_mask_storeu_ps(y + i * ldy, first, c##i##0);               \
  _mm512_mask_storeu_ps(y + i * ldy + 16, second, c##i##1);
  ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)
#undef ROW
}

/* the same for fewer rows (a call's last ones): one function per count, its accumulators in registers */
#define TILE(ROWS)                                                                                                  \
  __attribute__((noinline)) static void tile_##ROWS(const float* a, int64_t lda, const float* first_b,               \
                                                    const float* second_b, int64_t ldb, int64_t K, float* y,        \
                                                    int64_t ldy, __mmask16 first, __mmask16 second) {               \
    __m512 c0[ROWS], c1[ROWS];                                                                                      \
    for (int i = 0; i < ROWS; i++) c0[i] = c1[i] = _mm512_setzero_ps();                                             \
    for (int64_t kk = 0; kk < K; kk++) {                                                                            \
      const __m512 b0 = _mm512_loadu_ps(first_b + kk * ldb), b1 = _mm512_loadu_ps(second_b + kk * ldb);          \
      for (int i = 0; i < ROWS; i++) {                                                                              \
        const __m512 av = _mm512_set1_ps(a[i * lda + kk]);                                                          \
        c0[i] = _mm512_fmadd_ps(av, b0, c0[i]);                                                                     \
        c1[i] = _mm512_fmadd_ps(av, b1, c1[i]);                                                                     \
      }                                                                                                             \
    }                                                                                                               \
    for (int i = 0; i < ROWS; i++) {                                                                                \
      _mm512_mask_storeu_ps(y + i * ldy, first, c0[i]);                                                             \
      _mm512_mask_storeu_ps(y + i * ldy + 16, second, c1[i]);                                                       \
    }                                                                                                               \
  }
TILE(1)
TILE(2)
TILE(3)
TILE(4)
TILE(5)
TILE(6)
TILE(7)
TILE(8)
TILE(9)
TILE(10)
TILE(11)

typedef void (*Tile)(const float*, int64_t, const float*, const float*, int64_t, int64_t, float*, int64_t, __mmask16,
                     __mmask16);
static const Tile TILES[TILE_ROWS + 1] = {NULL, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8, tile_9,
                                          tile_10, tile_11, tile_12};

/* many rows on float32 panels: every tile of rows over each of the task's pairs of panels, read where they lie
   (a pair, 128 bytes a k, stays in L2 while the tiles of rows pass over it) */
static void gemm_f32_task(void* work, size_t task) {
  const Work* w = (const Work*)work;
  const Kernel* k = w->k;
  const int64_t K = k->K, N = k->N, pairs = (w->panels + 1) / 2;
  const int64_t end = (int64_t)(task + 1) * w->per_task < pairs ? (int64_t)(task + 1) * w->per_task : pairs;
  for (int64_t pair = (int64_t)task * w->per_task; pair < end; pair++) {
    const int64_t p = 2 * pair;
    const float* first_b = (const float*)w->packed + p * K * 16;
    /* a last panel without a second: its own columns again, never stored */
    const float* second_b = p + 1 < w->panels ? first_b + K * 16 : first_b;
    const __mmask16 first = columns_mask(k, p), second = p + 1 < w->panels ? columns_mask(k, p + 1) : 0;
    for (int64_t r = 0; r < w->m; r += TILE_ROWS) {
      const int64_t rows = w->m - r < TILE_ROWS ? w->m - r : TILE_ROWS;
      TILES[rows](w->a + r * K, K, first_b, second_b, 16, K, w->y + r * N + p * 16, N, first, second);
    }
  }
}

#if MATMUL_F28_ISA
/* one F28 panel unpacked into its half of the scratch's pair (`to`: 32 floats a k), its exceptions in place; a
   panel past the weight's last (an odd count) as zeros */
static void unpack_panel(const Work* w, int64_t p, float* to) {
  const int64_t K = w->k->K;
  if (p >= w->panels) {
    for (int64_t kk = 0; kk < K; kk++) _mm512_store_ps(to + kk * 32, _mm512_setzero_ps());
    return;
  }
  const uint8_t* src = w->packed + p * K * GROUP_F28;
  const Unpacker u = unpacker(w->k->bias);
  for (int64_t kk = 0; kk < K; kk++) {
    _mm_prefetch((const char*)src + kk * GROUP_F28 + PREFETCH, _MM_HINT_T0);
    _mm512_store_ps(to + kk * 32, unpack_at(&u, src, kk, K, p == w->panels - 1));
  }
  for (int32_t e = w->offsets[p]; e < w->offsets[p + 1]; e++)
    to[(w->positions[e] >> 4) * 32 + (w->positions[e] & 15)] = w->values[e];
}

/* many rows on F28 panels: the task's pairs of panels, a few at a time unpacked into its scratch (kept in L2),
   every tile of rows run over each of them while the rows stay in L1 */
static void gemm_f28_task(void* work, size_t task) {
  Work* w = (Work*)work;
  const Kernel* k = w->k;
  const int64_t K = k->K, N = k->N, pairs = (w->panels + 1) / 2;
  /* the task's own, so that the memory in use is the running tasks' (a thread's), not the call's */
  float* scratch = (float*)aligned_alloc(64, (size_t)(w->batch * K * 32) * sizeof(float));
  if (!scratch) { /* a ParallelFor body cannot fail: run() reports it once the loop is done */
    __atomic_store_n(&w->failed, 1, __ATOMIC_RELAXED);
    return;
  }
  const int64_t end = (int64_t)(task + 1) * w->per_task < pairs ? (int64_t)(task + 1) * w->per_task : pairs;
  for (int64_t first_pair = (int64_t)task * w->per_task; first_pair < end; first_pair += w->batch) {
    const int64_t count = end - first_pair < w->batch ? end - first_pair : w->batch;
    for (int64_t i = 0; i < 2 * count; i++) unpack_panel(w, 2 * first_pair + i, scratch + i / 2 * K * 32 + i % 2 * 16);
    for (int64_t r = 0; r < w->m; r += TILE_ROWS) {
      const int64_t rows = w->m - r < TILE_ROWS ? w->m - r : TILE_ROWS;
      for (int64_t i = 0; i < count; i++) {
        const int64_t p = 2 * (first_pair + i);
        const __mmask16 first = columns_mask(k, p), second = p + 1 < w->panels ? columns_mask(k, p + 1) : 0;
        TILES[rows](w->a + r * K, K, scratch + i * K * 32, scratch + i * K * 32 + 16, 32, K, w->y + r * N + p * 16, N,
                    first, second);
      }
    }
  }
  free(scratch);
}
#endif

/* y for `w` (its operands checked): the output of A's shape with N last, then decode's or GEMM's tasks */
static OrtStatus* run(OrtKernelContext* context, const Tensor* a, Work* w) {
  const Kernel* k = w->k;
  int64_t dims[6];
  memcpy(dims, a->dims, sizeof(dims));
  dims[a->rank - 1] = k->N;
  OrtValue* output = NULL;
  float* y = NULL;
  OrtStatus* status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 0, dims, a->rank, &output);
  if (!status) status = ORT_CALL(g_api, GetTensorMutableData)(output, (void**)&y);
  if (status) return status;
  w->y = y;
  w->m = elements(a) / k->K;
  if (w->m == 0) return NULL;
  if (w->m <= GEMV_ROWS) {
    w->per_task = (w->panels + MAX_GEMV_TASKS - 1) / MAX_GEMV_TASKS;
    return ORT_CALL(g_api, KernelContext_ParallelFor)(context, gemv_task, (size_t)((w->panels + w->per_task - 1) / w->per_task), 0, w);
  }
  const int64_t pairs = (w->panels + 1) / 2, most = pairs < GEMM_TASKS ? pairs : GEMM_TASKS;
  w->per_task = (pairs + most - 1) / most;
  w->batch = SCRATCH_BYTES / (k->K * 32 * (int64_t)sizeof(float));
  w->batch = w->batch < 1 ? 1 : w->batch > w->per_task ? w->per_task : w->batch;
  void (*task)(void*, size_t) = gemm_f32_task;
#if MATMUL_F28_ISA
  if (k->group == GROUP_F28) task = gemm_f28_task;
#endif
  status = ORT_CALL(g_api, KernelContext_ParallelFor)(context, task, (size_t)((pairs + w->per_task - 1) / w->per_task), 0, w);
  if (!status && w->failed) status = fail("MatMulF28: out of memory for the unpacked weights' scratch");
  return status;
}

static OrtStatus* compute_f32(void* kernel, OrtKernelContext* context) {
  const Kernel* k = (const Kernel*)kernel;
  Tensor a, panels;
  OrtStatus* status = required_input(context, 0, &a, "MatMulF32");
  if (!status) status = required_input(context, 1, &panels, "MatMulF32");
  if (status) return status;
  const int64_t count = (k->N + 15) / 16;
  if (a.rank < 1 || a.dims[a.rank - 1] != k->K) return fail("MatMulF32: A's last axis is not K");
  if (elements(&panels) != count * k->K * 16) return fail("MatMulF32: the panels are not [ceil(N/16), K, 16]");
  Work w = {k, a.data, (const uint8_t*)panels.data, NULL, NULL, NULL, NULL, 0, count, 0, 1, 0};
  return run(context, &a, &w);
}

#if MATMUL_F28_ISA
static OrtStatus* compute_f28(void* kernel, OrtKernelContext* context) {
  const Kernel* k = (const Kernel*)kernel;
  Tensor a, packed, offsets, positions, values;
  OrtStatus* status = required_input(context, 0, &a, "MatMulF28");
  if (!status) status = required_input(context, 1, &packed, "MatMulF28");
  if (!status) status = required_input(context, 2, &offsets, "MatMulF28");
  if (!status) status = required_input(context, 3, &positions, "MatMulF28");
  if (!status) status = required_input(context, 4, &values, "MatMulF28");
  if (status) return status;
  const int64_t panels = (k->N + 15) / 16;
  if (a.rank < 1 || a.dims[a.rank - 1] != k->K) return fail("MatMulF28: A's last axis is not K");
  if (elements(&packed) != panels * k->K * GROUP_F28) return fail("MatMulF28: the packed weight is not [ceil(N/16), K, 56]");
  if (elements(&offsets) != panels + 1) return fail("MatMulF28: the exception offsets are not [ceil(N/16) + 1]");
  const int32_t* offset = (const int32_t*)offsets.data;
  const int32_t* position = (const int32_t*)positions.data;
  if (elements(&positions) != elements(&values) || offset[0] != 0 || offset[panels] != elements(&positions))
    return fail("MatMulF28: the exception offsets do not span its positions and values");
  /* every call: an operand need not be a constant, and a wrong offset or position would read and write out of
     bounds; the exceptions are a few per ten thousand weights, so this reads a few ints per panel */
  for (int64_t p = 0; p < panels; p++)
    if (offset[p + 1] < offset[p]) return fail("MatMulF28: the exception offsets decrease");
  for (int64_t e = 0; e < elements(&positions); e++)
    if (position[e] < 0 || position[e] >= k->K * 16) return fail("MatMulF28: an exception position is outside [0, K · 16)");
  Work w = {k, a.data, (const uint8_t*)packed.data, offset, position, values.data, NULL, 0, panels, 0, 1, 0};
  return run(context, &a, &w);
}
#endif

/* K and N (and F28's bias) of a kernel reading groups of `group` bytes */
static OrtStatus* create(const OrtKernelInfo* info, int64_t group, void** out) {
  Kernel* k = (Kernel*)calloc(1, sizeof(Kernel));
  if (!k) return fail("out of memory for a matmul kernel");
  k->group = group;
  OrtStatus* status = int_attribute(info, "K", &k->K);
  if (!status) status = int_attribute(info, "N", &k->N);
  if (!status && group == GROUP_F28) status = int_attribute(info, "bias", &k->bias);
  if (!status && (k->K < 1 || k->N < 1 || k->bias < 0 || k->bias > 239 || k->K > INT32_MAX / 16 || k->N > INT32_MAX))
    status = fail(group == GROUP_F28 ? "MatMulF28: K must be in [1, 2^27), N in [1, 2^31) and bias in [0, 239]"
                                     : "MatMulF32: K must be in [1, 2^27) and N in [1, 2^31)");
  if (status) {
    free(k);
    return status;
  }
  *out = k;
  return NULL;
}

static size_t one(const OrtCustomOp* op) { (void)op; return 1; }
static size_t two(const OrtCustomOp* op) { (void)op; return 2; }
static ONNXTensorElementDataType float32(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ORT_FLOAT; }

static OrtStatus* create_f32(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  (void)api;
  return create(info, GROUP_F32, out);
}
static const char* f32_name(const OrtCustomOp* op) { (void)op; return "MatMulF32"; }

int matmul_f32_op(OrtCustomOp* op) {
  common_op(op);
  op->GetName = f32_name;
  op->GetInputType = float32;
  op->GetInputTypeCount = two;
  op->GetOutputType = float32;
  op->GetOutputTypeCount = one;
  op->CreateKernelV2 = create_f32;
  op->KernelComputeV2 = compute_f32;
  return 1;
}

#if MATMUL_F28_ISA
static OrtStatus* create_f28(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  (void)api;
  return create(info, GROUP_F28, out);
}
static const char* f28_name(const OrtCustomOp* op) { (void)op; return "MatMulF28"; }
static size_t five(const OrtCustomOp* op) { (void)op; return 5; }
static ONNXTensorElementDataType f28_input(const OrtCustomOp* op, size_t i) {
  (void)op;
  return i == 1 ? ORT_UINT8 : i == 2 || i == 3 ? ORT_INT32 : ORT_FLOAT;
}

int matmul_f28_op(OrtCustomOp* op) {
  common_op(op);
  op->GetName = f28_name;
  op->GetInputType = f28_input;
  op->GetInputTypeCount = five;
  op->GetOutputType = float32;
  op->GetOutputTypeCount = one;
  op->CreateKernelV2 = create_f28;
  op->KernelComputeV2 = compute_f28;
  return 1;
}
#else
int matmul_f28_op(OrtCustomOp* op) {
  (void)op;
  return 0; /* no AVX-512 VBMI here: the executor unpacks F28 weights at load for onnxruntime's MatMul */
}
#endif

#else

int matmul_f32_op(OrtCustomOp* op) {
  (void)op;
  return 0; /* no AVX-512 here: the executor leaves float32 MatMuls to onnxruntime */
}
int matmul_f28_op(OrtCustomOp* op) {
  (void)op;
  return 0;
}

#endif

/* whether this build registers MatMulF28 and MatMulF32 (cann_llm/runtime/kernels/native/__init__.py asks, through ctypes) */
__attribute__((visibility("default"))) int cann_matmul_f28_built(void) { return MATMUL_F28_ISA; }
__attribute__((visibility("default"))) int cann_matmul_f32_built(void) { return MATMUL_PANELS_ISA; }
/* whether MatMulF32's decode prefetches its streams in software on this CPU (the tests ask, to build the other form) */
__attribute__((visibility("default"))) int cann_matmul_f32_software_prefetch(void) {
#if MATMUL_PANELS_ISA
  return g_f32_prefetch; /* what the constructor chose, not a second reading of the CPU */
#else
  return 0;
#endif
}
