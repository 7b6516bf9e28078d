/* cann::PagedAttention as an onnxruntime custom op, so a paged artifact runs as one session per step.

Same contract as cann_llm/runtime/kernels/paged_attention.py (paged_attention_reference is the spec; cann_llm/runtime/ops.py
the slots), with two inputs more: the page pool's key and value arrays `[layers, pages, kv_heads,
page_size, head_dim]`, which the runtime feeds as views of its pool. The node writes this step's keys and
values into them in place: onnxruntime treats inputs as read-only, but nothing else in the session reads
the pool, and each node writes only its own layer's pages before it reads them.

Every index the metadata holds is checked by each node before it is used, as check_paged_metadata checks it
for the host kernels (the checks cost microseconds a step; nothing outside the op then has to be trusted): an
error comes back as onnxruntime's status with a message starting "PagedInputError:", which the executor
raises as PagedInputError, never a read or write outside the arrays.
*/
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "native_ops.h"

enum { QUERY, KEY, VALUE, COS, SIN, QUERY_START_LOC, SEQ_LENS, BLOCK_TABLES, SLOT_MAPPING, KEY_CACHE, VALUE_CACHE,
       NUM_INPUTS };
#define QUERY_TILE 8 /* query rows of one sequence that attend together: each key row is read once for all */
#define TILE_VECTORS 128 /* query vectors (rows x the heads of a KV head) a tile's scratch holds at most */
#define PARALLEL_WORK 512 /* query·key pairs times query heads from which a layer's work is spread over the pool's
                            threads: for SmolLM2's 9 heads a batch-1 decode step from 57 tokens of context, where
                            its KV heads read their pages side by side (benchmarks/decode_attention.py
                            --sequences 1: 1.07x at 64 tokens, 1.20x at 96, none at 48) */
#define WIDE_ROWS 32 /* query rows of a wide tile at most (attend_wide), as many as 64 query vectors allow */
#define WIDE_MIN 8   /* query vectors from which a tile runs wide: fewer (a decode step's) waste the lanes */
/* the keys a part of a decode step's context holds at least (split_long_contexts): below, a part's own
   start, merge and scratch cost more than the thread it frees gains (SmolLM2's INT4 decode, its keys and
   values in cache, 0.98x a token with parts from 64 keys) */
#define SPLIT_KEYS 256

typedef struct {
  int64_t num_heads, kv_heads, head_dim, interleaved, window, layer, page_size;
  float scale;
  float softcap; /* > 0: the scaled scores capped to softcap * tanh(s / softcap) (Gemma 2), in attend_tile only */
  int64_t split_items; /* items a decode step wants at least (split_long_contexts), fixed when the kernel is made */
  int64_t alibi_heads;  /* 0, or num_heads: ALiBi's slopes follow, one a query head, in attend_tile only */
  float alibi[];        /* slope m_h: m_h * (key position - query position) added to head h's scaled scores */
} Kernel;

/* ---- rotary embedding and the cache write ---------------------------------------------------------- */

static void rotate_row(const float* src, const float* cos, const float* sin, int64_t rotary, int64_t head_dim,
                       int64_t interleaved, float* restrict dst) {
  /* a loop per half, without branches, so the compiler vectorizes them: a prefill rotates every token's
     heads before its attention spreads over the threads */
  const int64_t half = rotary / 2;
  if (interleaved) {
    for (int64_t d = 0; d < rotary; d += 2) {
      dst[d] = src[d] * cos[d] - src[d + 1] * sin[d];
      dst[d + 1] = src[d + 1] * cos[d + 1] + src[d] * sin[d + 1];
    }
  } else {
    for (int64_t d = 0; d < half; d++) dst[d] = src[d] * cos[d] - src[d + half] * sin[d];
    for (int64_t d = half; d < rotary; d++) dst[d] = src[d] * cos[d] + src[d - half] * sin[d];
  }
  for (int64_t d = rotary; d < head_dim; d++) dst[d] = src[d];
}

/* ---- attention --------------------------------------------------------------------------------------- */

typedef struct {
  const Kernel* k;
  const float* q;     /* rotated queries [T, Hq, D] */
  const float* key;   /* this layer's pages [P, KV, PS, D] */
  const float* value;
  const int32_t* starts;
  const int32_t* seq_lens;
  const int32_t* tables;
  int64_t max_blocks;
  const int64_t* tile_seq; /* per work item: its sequence, first query row and KV head */
  const int64_t* tile_row;
  float* out;         /* [T, Hq, D] */
  int64_t tile_rows;  /* query rows a tile takes at most */
  int64_t splits;      /* parts a tile's keys are cut into, each an item of its own (1: whole tiles) */
  int64_t split_keys;  /* keys a part holds at most */
  float* partial;      /* with splits: per item, per query vector, [running max, total, unnormalised output] */
} Attend;

/* Where a tile's query vector i ends: its output row, normalised by its total, or with `part` (a split tile)
   the part's running max, total and unnormalised output, which combine_parts merges. */
static inline void finish_vector(const Attend* a, int64_t first, int64_t kv, int64_t i, const float* acc,
                                 float running_max, float total, float* part);


/* the position in sequence b of its query row `first` (the step's rows end at the sequence's length) */
static inline int64_t first_position(const Attend* a, int64_t b, int64_t first) {
  return a->seq_lens[b] - (a->starts[b + 1] - a->starts[b]) + (first - a->starts[b]);
}

/* the first page a query at first_pos can see (its window's oldest key, or the sequence's start) */
static inline int64_t first_page(const Kernel* k, int64_t first_pos) {
  const int64_t oldest = k->window > 0 ? first_pos - k->window + 1 : 0;
  return (oldest > 0 ? oldest : 0) / k->page_size;
}

/* KV head kv's keys and values from position `at` of the sequence whose block table is `pages` to the end
   of at's page or to `hi`, whichever comes first: their count, their rows in *kp and *vp */
static inline int64_t key_rows(const Attend* a, const int32_t* pages, int64_t at, int64_t hi, int64_t kv, int64_t D,
                               const float** kp, const float** vp) {
  const int64_t PS = a->k->page_size, KV = a->k->kv_heads, row = at % PS;
  const int64_t start = (((int64_t)pages[at / PS] * KV + kv) * PS + row) * D;
  *kp = a->key + start;
  *vp = a->value + start;
  return hi - at < PS - row ? hi - at : PS - row;
}

/* scores[0..count) → exp(score - max) where lo <= r < hi, else 0; their sum into *sum */
static inline void softmax_row(float* scores, int64_t count, int64_t lo, int64_t hi, float max, float* sum) {
  float total = 0.0f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  const __m512 m = _mm512_set1_ps(max);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t r = 0;
  for (; r < count; r += 16) {
    const __m512i at = _mm512_add_epi32(lanes, _mm512_set1_epi32((int32_t)r));
    const __mmask16 in = _mm512_cmplt_epi32_mask(at, _mm512_set1_epi32((int32_t)count));
    const __mmask16 seen = in & _mm512_cmpge_epi32_mask(at, _mm512_set1_epi32((int32_t)lo)) &
                           _mm512_cmplt_epi32_mask(at, _mm512_set1_epi32((int32_t)hi));
    const __m512 p = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, scores + r), m)));
    _mm512_mask_storeu_ps(scores + r, in, p);
    acc = _mm512_add_ps(acc, p);
  }
  total = _mm512_reduce_add_ps(acc);
#else
  for (int64_t r = 0; r < count; r++) {
    float p = (r >= lo && r < hi) ? fast_exp(scores[r] - max) : 0.0f;
    scores[r] = p;
    total += p;
  }
#endif
  *sum = total;
}

/* where query vector i of a tile (row first + i / group, query head g = i % group of KV head kv) lies in a
   [T, Hq, D] array: the rotated queries or the output */
static inline int64_t query_offset(const Kernel* k, int64_t first, int64_t kv, int64_t i) {
  const int64_t group = k->num_heads / k->kv_heads;
  return ((first + i / group) * k->num_heads + kv * group + i % group) * k->head_dim;
}

/* One query's scores on a page (its first position `base`, `count` rows) → its probabilities, with the
   causal and windowed visibility of the query's `position`, its running max and total carried on; returns
   what its output so far must be scaled by (1 where the page shows it nothing, its scores then zeros). */
static inline float page_softmax(const Kernel* k, float* scores, int64_t count, int64_t position, int64_t base,
                                 float* running_max, float* total) {
  int64_t hi = position - base + 1, lo = k->window > 0 ? position - k->window + 1 - base : 0;
  if (hi > count) hi = count;
  if (lo < 0) lo = 0;
  float page_max = -INFINITY;
  for (int64_t r = lo; r < hi; r++) page_max = scores[r] > page_max ? scores[r] : page_max;
  if (hi <= lo || page_max == -INFINITY) {
    for (int64_t r = 0; r < count; r++) scores[r] = 0.0f;
    return 1.0f;
  }
  const float new_max = *running_max > page_max ? *running_max : page_max;
  const float correction = fast_exp(*running_max - new_max);
  float sum = 0.0f;
  softmax_row(scores, count, lo, hi, new_max, &sum);
  *total = *total * correction + sum;
  *running_max = new_max;
  return correction;
}

/* Query rows first..first+rows-1 of sequence b, the query heads of KV head kv, over the keys at positions
   [lo, hi), a page (or what of it lies in the range) of scores at a time with an online softmax. D is a
   constant in the specialised copies below. */
static inline __attribute__((always_inline)) void attend_tile(const Attend* a, int64_t b, int64_t first, int64_t rows,
                                                              int64_t kv, const int64_t D, int64_t lo, int64_t hi,
                                                              float* part) {
  const Kernel* k = a->k;
  const int64_t group = k->num_heads / k->kv_heads, PS = k->page_size;
  const int64_t n = rows * group; /* query vectors of the tile */
  const int64_t first_pos = first_position(a, b, first);
  /* scratch on the stack, sized by the tile: at most 128 query vectors x 512 rows of a page */
  float qv[n][D] __attribute__((aligned(64)));
  float acc[n][D] __attribute__((aligned(64)));
  float scores[n][PS];
  float running_max[n], total[n];
  int64_t position[n];
  for (int64_t i = 0; i < n; i++) {
    const float* src = a->q + query_offset(k, first, kv, i);
    for (int64_t d = 0; d < D; d++) qv[i][d] = src[d] * k->scale;
    memset(acc[i], 0, sizeof(acc[i]));
    running_max[i] = -INFINITY;
    total[i] = 0.0f;
    position[i] = first_pos + i / group;
  }
  const int32_t* pages = a->tables + b * a->max_blocks;
  for (int64_t base = lo, count; base < hi; base += count) {
    const float *kp, *vp;
    count = key_rows(a, pages, base, hi, kv, D, &kp, &vp);
    for (int64_t r = 0; r < count; r++) {
      const float* kr = kp + r * D;
      for (int64_t i = 0; i < n; i++) {
        float s = 0.0f;
        for (int64_t d = 0; d < D; d++) s += qv[i][d] * kr[d];
        scores[i][r] = s;
      }
    }
    if (k->softcap > 0.0f)
      for (int64_t i = 0; i < n; i++)
        for (int64_t r = 0; r < count; r++) scores[i][r] = k->softcap * tanhf(scores[i][r] / k->softcap);
    if (k->alibi_heads)
      for (int64_t i = 0; i < n; i++) {
        const float slope = k->alibi[kv * group + i % group];
        for (int64_t r = 0; r < count; r++) scores[i][r] += slope * (float)(base + r - position[i]);
      }
    for (int64_t i = 0; i < n; i++) {
      const float correction = page_softmax(k, scores[i], count, position[i], base, &running_max[i], &total[i]);
      for (int64_t d = 0; d < D; d++) acc[i][d] *= correction;
    }
    for (int64_t r = 0; r < count; r++) {
      const float* vr = vp + r * D;
      for (int64_t i = 0; i < n; i++) {
        float p = scores[i][r];
        for (int64_t d = 0; d < D; d++) acc[i][d] += p * vr[d];
      }
    }
  }
  for (int64_t i = 0; i < n; i++) finish_vector(a, first, kv, i, acc[i], running_max[i], total[i], part);
}


/* ---- the wide tile: query vectors in the lanes, for prefill ---------------------------------------- */
#if defined(__AVX512F__)
/* `x`, which the compiler must then hold in a register: left to itself, GCC folds a vector used by four FMAs
   into each of them as a memory operand, four loads where one does, and the tile's loops then wait on the
   load ports rather than the FMAs (docs/performance.md#prefill-attention) */
static inline __attribute__((always_inline)) __m512 in_register(__m512 x) {
  __asm__("" : "+v"(x));
  return x;
}

#define WIDE_VECTORS 4 /* vectors of 16 query lanes a wide tile holds at most (64 query vectors) */
#define WIDE_CHUNK 4   /* head-dim columns of the output kept in registers while a block's values are read */
#define WIDE_KEYS 32   /* key rows a block: its scores (8 KB) stay in L1 beside the queries and the output */

/* The tile of attend_tile with its NV·16 query vectors (rows x the heads of KV head kv) in the lanes of NV
   vectors: a key row's scores for all of them are NV FMAs a head-dim column, with no sums across lanes, and
   the softmax and masks run on whole vectors. Keys go in blocks of WIDE_KEYS rows, each with its own step
   of the online softmax, so the scores are read from L1 by the value pass; a block every query of the
   tile sees in full (before the first one, no window) needs no masks. The output accumulates WIDE_CHUNK
   head-dim columns at a time in registers over a block's rows (with 8, 32 accumulators spilled). Lanes
   past the tile's vectors are padding, never written out. */
static inline __attribute__((always_inline)) void attend_wide(const Attend* a, int64_t b, int64_t first, int64_t rows,
                                                              int64_t kv, const int64_t D, const int NV) {
  const Kernel* k = a->k;
  const int64_t group = k->num_heads / k->kv_heads, PS = k->page_size, L = NV * 16;
  const int64_t n = rows * group;
  const int64_t first_pos = first_position(a, b, first), last_pos = first_pos + rows - 1;
  float qt[D][L] __attribute__((aligned(64)));
  float acc[D][L] __attribute__((aligned(64)));
  float scores[WIDE_KEYS][L] __attribute__((aligned(64)));
  __mmask16 visible[WIDE_KEYS][WIDE_VECTORS];
  int32_t position[L] __attribute__((aligned(64)));
  for (int64_t i = 0; i < L; i++) {
    const float* src = a->q + query_offset(k, first, kv, i);
    position[i] = i < n ? (int32_t)(first_pos + i / group) : -1;
    for (int64_t d = 0; d < D; d++) qt[d][i] = i < n ? src[d] * k->scale : 0.0f;
  }
  memset(acc, 0, sizeof(acc));
  __m512 running_max[WIDE_VECTORS], total[WIDE_VECTORS];
  __m512i pos[WIDE_VECTORS];
  for (int v = 0; v < NV; v++) {
    running_max[v] = _mm512_set1_ps(-INFINITY);
    total[v] = _mm512_setzero_ps();
    pos[v] = _mm512_load_si512((const void*)(position + 16 * v));
  }
  const int32_t* pages = a->tables + b * a->max_blocks;
  for (int64_t page_index = first_page(k, first_pos); page_index <= last_pos / PS; page_index++) {
    const float *page_keys, *page_values;
    const int64_t page_base = page_index * PS;
    const int64_t page_count = key_rows(a, pages, page_base, last_pos + 1, kv, D, &page_keys, &page_values);
    for (int64_t r0 = 0; r0 < page_count; r0 += WIDE_KEYS) {
      const int64_t count = page_count - r0 < WIDE_KEYS ? page_count - r0 : WIDE_KEYS, base = page_base + r0;
      const float *kp = page_keys + r0 * D, *vp = page_values + r0 * D;
      int64_t r = 0;
      for (; r + 4 <= count; r += 4) { /* four key rows at once: 4·NV independent sums */
        __m512 s[4][WIDE_VECTORS];
        for (int j = 0; j < 4; j++)
          for (int v = 0; v < NV; v++) s[j][v] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
          __m512 q[WIDE_VECTORS];
          for (int v = 0; v < NV; v++) q[v] = in_register(_mm512_load_ps(&qt[d][16 * v]));
          for (int j = 0; j < 4; j++) {
            const __m512 key = _mm512_set1_ps(kp[(r + j) * D + d]);
            for (int v = 0; v < NV; v++) s[j][v] = _mm512_fmadd_ps(q[v], key, s[j][v]);
          }
        }
        for (int j = 0; j < 4; j++)
          for (int v = 0; v < NV; v++) _mm512_store_ps(&scores[r + j][16 * v], s[j][v]);
      }
      for (; r < count; r++) {
        __m512 s[WIDE_VECTORS];
        for (int v = 0; v < NV; v++) s[v] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
          const __m512 key = _mm512_set1_ps(kp[r * D + d]);
          for (int v = 0; v < NV; v++) s[v] = _mm512_fmadd_ps(_mm512_load_ps(&qt[d][16 * v]), key, s[v]);
        }
        for (int v = 0; v < NV; v++) _mm512_store_ps(&scores[r][16 * v], s[v]);
      }
      /* causal and windowed visibility: key position base + r, query position in the lane */
      const int seen_by_all = k->window <= 0 && base + count - 1 <= first_pos;
      __m512 block_max[WIDE_VECTORS];
      for (int v = 0; v < NV; v++) block_max[v] = _mm512_set1_ps(-INFINITY);
      for (r = 0; r < count; r++) {
        const __m512i key = _mm512_set1_epi32((int32_t)(base + r));
        for (int v = 0; v < NV; v++) {
          __mmask16 seen = 0xFFFF;
          if (!seen_by_all) {
            seen = _mm512_cmpge_epi32_mask(pos[v], key);
            if (k->window > 0)
              seen &= _mm512_cmplt_epi32_mask(_mm512_sub_epi32(pos[v], _mm512_set1_epi32((int32_t)k->window)), key);
            visible[r][v] = seen;
          }
          block_max[v] = _mm512_mask_max_ps(block_max[v], seen, block_max[v], _mm512_load_ps(&scores[r][16 * v]));
        }
      }
      __m512 correction[WIDE_VECTORS];
      for (int v = 0; v < NV; v++) {
        const __m512 new_max = _mm512_max_ps(running_max[v], block_max[v]);
        /* lanes that have seen nothing yet keep -inf: their correction is exp of a NaN, clamped to tiny, on zeros */
        correction[v] = exp16(_mm512_sub_ps(running_max[v], new_max));
        running_max[v] = new_max;
        total[v] = _mm512_mul_ps(total[v], correction[v]);
      }
      for (r = 0; r < count; r++)
        for (int v = 0; v < NV; v++) {
          __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(&scores[r][16 * v]), running_max[v]));
          if (!seen_by_all) p = _mm512_maskz_mov_ps(visible[r][v], p);
          _mm512_store_ps(&scores[r][16 * v], p);
          total[v] = _mm512_add_ps(total[v], p);
        }
      for (int64_t d0 = 0; d0 < D; d0 += WIDE_CHUNK) {
        __m512 o[WIDE_CHUNK][WIDE_VECTORS];
        for (int dd = 0; dd < WIDE_CHUNK; dd++)
          for (int v = 0; v < NV; v++) o[dd][v] = _mm512_mul_ps(_mm512_load_ps(&acc[d0 + dd][16 * v]), correction[v]);
        for (r = 0; r < count; r++) {
          const float* value = vp + r * D + d0;
          for (int v = 0; v < NV; v++) {
            const __m512 p = in_register(_mm512_load_ps(&scores[r][16 * v]));
            for (int dd = 0; dd < WIDE_CHUNK; dd++) o[dd][v] = _mm512_fmadd_ps(p, _mm512_set1_ps(value[dd]), o[dd][v]);
          }
        }
        for (int dd = 0; dd < WIDE_CHUNK; dd++)
          for (int v = 0; v < NV; v++) _mm512_store_ps(&acc[d0 + dd][16 * v], o[dd][v]);
      }
    }
  }
  float inverse[L] __attribute__((aligned(64)));
  for (int v = 0; v < NV; v++) {
    const __m512 t = total[v];
    _mm512_store_ps(inverse + 16 * v, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(t, _mm512_setzero_ps(), _CMP_GT_OQ),
                                                           _mm512_set1_ps(1.0f), t));
  }
  for (int64_t i = 0; i < n; i++) {
    float* dst = a->out + query_offset(k, first, kv, i);
    for (int64_t d = 0; d < D; d++) dst[d] = acc[d][i] * inverse[i];
  }
}
#endif

/* ---- the wide tile on CPUs with AVX2 alone: attend_wide in 8-lane vectors --------------------------- */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define WIDE_VECTORS 4 /* vectors of 8 query lanes a wide tile holds at most (32 query vectors) */
#define WIDE_CHUNK 8   /* head-dim columns a head dim must be a multiple of for the tile */
#define WIDE_KEYS 32   /* key rows a block, as in attend_wide */

/* all ones in the lanes whose query (position in `pos`) sees the key at `key`: causal, and windowed */
static inline __m256 seen8(__m256i pos, __m256i key, int64_t window) {
  __m256i seen = _mm256_xor_si256(_mm256_cmpgt_epi32(key, pos), _mm256_set1_epi32(-1));
  if (window > 0) seen = _mm256_and_si256(seen, _mm256_cmpgt_epi32(key, _mm256_sub_epi32(pos, _mm256_set1_epi32((int32_t)window))));
  return _mm256_castsi256_ps(seen);
}

/* attend_wide's tile with NV·8 query vectors in the lanes of NV 8-lane vectors: two key rows' scores at a
   time (2·NV sums), keys in blocks of WIDE_KEYS rows as there (their scores stay in L1, a block every
   query sees unmasked), the visibility recomputed where it is needed rather than kept, and the output
   accumulating 8 / NV head-dim columns at a time in registers over a block's rows. */
/* as in_register for attend_wide */
static inline __attribute__((always_inline)) __m256 in_register8(__m256 x) {
  __asm__("" : "+x"(x));
  return x;
}

static inline __attribute__((always_inline)) void attend_wide8(const Attend* a, int64_t b, int64_t first, int64_t rows,
                                                               int64_t kv, const int64_t D, const int NV) {
  const Kernel* k = a->k;
  const int64_t group = k->num_heads / k->kv_heads, PS = k->page_size, L = NV * 8;
  const int CH = 8 / NV;
  const int64_t n = rows * group;
  const int64_t first_pos = first_position(a, b, first), last_pos = first_pos + rows - 1;
  float qt[D][L] __attribute__((aligned(32)));
  float acc[D][L] __attribute__((aligned(32)));
  float scores[WIDE_KEYS][L] __attribute__((aligned(32)));
  int32_t position[L] __attribute__((aligned(32)));
  for (int64_t i = 0; i < L; i++) {
    const float* src = a->q + query_offset(k, first, kv, i);
    position[i] = i < n ? (int32_t)(first_pos + i / group) : -1;
    for (int64_t d = 0; d < D; d++) qt[d][i] = i < n ? src[d] * k->scale : 0.0f;
  }
  memset(acc, 0, sizeof(acc));
  __m256 running_max[WIDE_VECTORS], total[WIDE_VECTORS];
  __m256i pos[WIDE_VECTORS];
  for (int v = 0; v < NV; v++) {
    running_max[v] = _mm256_set1_ps(-INFINITY);
    total[v] = _mm256_setzero_ps();
    pos[v] = _mm256_load_si256((const __m256i*)(position + 8 * v));
  }
  const __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  const int32_t* pages = a->tables + b * a->max_blocks;
  for (int64_t page_index = first_page(k, first_pos); page_index <= last_pos / PS; page_index++) {
    const float *page_keys, *page_values;
    const int64_t page_base = page_index * PS;
    const int64_t page_count = key_rows(a, pages, page_base, last_pos + 1, kv, D, &page_keys, &page_values);
    for (int64_t r0 = 0; r0 < page_count; r0 += WIDE_KEYS) {
      const int64_t count = page_count - r0 < WIDE_KEYS ? page_count - r0 : WIDE_KEYS, base = page_base + r0;
      const float *kp = page_keys + r0 * D, *vp = page_values + r0 * D;
      const int seen_by_all = k->window <= 0 && base + count - 1 <= first_pos;
      int64_t r = 0;
      for (; r + 2 <= count; r += 2) {
        __m256 s0[WIDE_VECTORS], s1[WIDE_VECTORS];
        for (int v = 0; v < NV; v++) s0[v] = s1[v] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
          const __m256 k0 = _mm256_set1_ps(kp[r * D + d]), k1 = _mm256_set1_ps(kp[(r + 1) * D + d]);
          for (int v = 0; v < NV; v++) {
            const __m256 q = in_register8(_mm256_load_ps(&qt[d][8 * v]));
            s0[v] = _mm256_fmadd_ps(q, k0, s0[v]);
            s1[v] = _mm256_fmadd_ps(q, k1, s1[v]);
          }
        }
        for (int v = 0; v < NV; v++) {
          _mm256_store_ps(&scores[r][8 * v], s0[v]);
          _mm256_store_ps(&scores[r + 1][8 * v], s1[v]);
        }
      }
      for (; r < count; r++) {
        __m256 s[WIDE_VECTORS];
        for (int v = 0; v < NV; v++) s[v] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
          const __m256 key = _mm256_set1_ps(kp[r * D + d]);
          for (int v = 0; v < NV; v++) s[v] = _mm256_fmadd_ps(_mm256_load_ps(&qt[d][8 * v]), key, s[v]);
        }
        for (int v = 0; v < NV; v++) _mm256_store_ps(&scores[r][8 * v], s[v]);
      }
      __m256 block_max[WIDE_VECTORS];
      for (int v = 0; v < NV; v++) block_max[v] = _mm256_set1_ps(-INFINITY);
      for (r = 0; r < count; r++) {
        const __m256i key = _mm256_set1_epi32((int32_t)(base + r));
        for (int v = 0; v < NV; v++) {
          const __m256 larger = _mm256_max_ps(block_max[v], _mm256_load_ps(&scores[r][8 * v]));
          block_max[v] = seen_by_all ? larger : _mm256_blendv_ps(block_max[v], larger, seen8(pos[v], key, k->window));
        }
      }
      __m256 correction[WIDE_VECTORS];
      for (int v = 0; v < NV; v++) {
        const __m256 new_max = _mm256_max_ps(running_max[v], block_max[v]);
        /* lanes that have seen nothing yet keep -inf: their correction is exp of a NaN, clamped to tiny, on zeros */
        correction[v] = exp8(_mm256_sub_ps(running_max[v], new_max));
        running_max[v] = new_max;
        total[v] = _mm256_mul_ps(total[v], correction[v]);
      }
      for (r = 0; r < count; r++) {
        const __m256i key = _mm256_set1_epi32((int32_t)(base + r));
        for (int v = 0; v < NV; v++) {
          const __m256 p = _mm256_and_ps(seen_by_all ? all : seen8(pos[v], key, k->window),
                                         exp8(_mm256_sub_ps(_mm256_load_ps(&scores[r][8 * v]), running_max[v])));
          _mm256_store_ps(&scores[r][8 * v], p);
          total[v] = _mm256_add_ps(total[v], p);
        }
      }
      for (int64_t d0 = 0; d0 < D; d0 += CH) {
        __m256 o[8][WIDE_VECTORS];
        for (int dd = 0; dd < CH; dd++)
          for (int v = 0; v < NV; v++) o[dd][v] = _mm256_mul_ps(_mm256_load_ps(&acc[d0 + dd][8 * v]), correction[v]);
        for (r = 0; r < count; r++) {
          const float* value = vp + r * D + d0;
          for (int v = 0; v < NV; v++) {
            const __m256 p = in_register8(_mm256_load_ps(&scores[r][8 * v]));
            for (int dd = 0; dd < CH; dd++) o[dd][v] = _mm256_fmadd_ps(p, _mm256_set1_ps(value[dd]), o[dd][v]);
          }
        }
        for (int dd = 0; dd < CH; dd++)
          for (int v = 0; v < NV; v++) _mm256_store_ps(&acc[d0 + dd][8 * v], o[dd][v]);
      }
    }
  }
  float inverse[L] __attribute__((aligned(32)));
  for (int v = 0; v < NV; v++) {
    const __m256 t = total[v];
    _mm256_store_ps(inverse + 8 * v, _mm256_and_ps(_mm256_cmp_ps(t, _mm256_setzero_ps(), _CMP_GT_OQ),
                                                   _mm256_div_ps(_mm256_set1_ps(1.0f), t)));
  }
  for (int64_t i = 0; i < n; i++) {
    float* dst = a->out + query_offset(k, first, kv, i);
    for (int64_t d = 0; d < D; d++) dst[d] = acc[d][i] * inverse[i];
  }
}
#endif

/* ---- the narrow tile: a decode step's few query vectors, 16 key rows a reduction --------------------- */
#if defined(__AVX512F__)
/* A decode step's keys and values come from memory (the step's weights have streamed through the caches
   since this layer last read them): while a block of 16 key rows is scored, the key rows NARROW_AHEAD
   blocks on are fetched, and the block's own value rows, read once the page's scores are in. */
#define NARROW_AHEAD 2
static inline void narrow_prefetch(const float* kp, const float* vp, int64_t r0, int64_t count, int64_t D) {
  const int64_t lines = 16 * D / 16, ahead = r0 + 16 * NARROW_AHEAD;
  for (int64_t l = 0; l < lines; l++) {
    if (ahead + l / (D / 16) < count) _mm_prefetch((const char*)(kp + ahead * D + l * 16), _MM_HINT_T0);
    if (r0 + l / (D / 16) < count) _mm_prefetch((const char*)(vp + r0 * D + l * 16), _MM_HINT_T1);
  }
}

/* The tile of attend_tile for NQ < WIDE_MIN query vectors and D = 64 or 128: each query vector sits in D/16
   registers; a key row's dot is D/16 FMAs into one vector and the dots of 16 key rows are reduced together
   (sum16) into 16 scores, each block of 16 rows scored for every query vector while it is in L1; the
   output accumulates in registers over a page's value rows, CW vectors of head-dim columns at a time, the
   page's correction applied as they are loaded. */
static inline __attribute__((always_inline)) void attend_narrow(const Attend* a, int64_t b, int64_t first, int64_t kv,
                                                                const int64_t D, const int NQ, int64_t lo, int64_t hi,
                                                                float* part) {
  const Kernel* k = a->k;
  const int64_t group = k->num_heads / k->kv_heads, PS = k->page_size;
  const int DV = (int)(D / 16), CW = NQ <= 3 ? 4 : 2;
  const int64_t first_pos = first_position(a, b, first);
  __m512 q[WIDE_MIN][8];
  float acc[NQ][D] __attribute__((aligned(64)));
  float scores[NQ][PS];
  float running_max[NQ], total[NQ], correction[NQ];
  int64_t position[NQ];
  for (int i = 0; i < NQ; i++) {
    const float* src = a->q + query_offset(k, first, kv, i);
    for (int v = 0; v < DV; v++) q[i][v] = _mm512_mul_ps(_mm512_loadu_ps(src + 16 * v), _mm512_set1_ps(k->scale));
    memset(acc[i], 0, sizeof(acc[i]));
    running_max[i] = -INFINITY;
    total[i] = 0.0f;
    position[i] = first_pos + i / group;
  }
  const int32_t* pages = a->tables + b * a->max_blocks;
  for (int64_t base = lo, count; base < hi; base += count) {
    const float *kp, *vp;
    count = key_rows(a, pages, base, hi, kv, D, &kp, &vp);
    for (int64_t r0 = 0; r0 < count; r0 += 16) {
      const int64_t m = count - r0 < 16 ? count - r0 : 16;
      narrow_prefetch(kp, vp, r0, count, D);
      for (int i = 0; i < NQ; i++) {
        __m512 t[16];
        for (int j = 0; j < 16; j++) {
          if (j >= m) {
            t[j] = _mm512_setzero_ps();
            continue;
          }
          const float* kr = kp + (r0 + j) * D;
          __m512 s = _mm512_mul_ps(q[i][0], _mm512_loadu_ps(kr));
          for (int v = 1; v < DV; v++) s = _mm512_fmadd_ps(q[i][v], _mm512_loadu_ps(kr + 16 * v), s);
          t[j] = s;
        }
        _mm512_mask_storeu_ps(scores[i] + r0, (__mmask16)(m >= 16 ? 0xFFFFu : (1u << m) - 1), sum16(t));
      }
    }
    for (int i = 0; i < NQ; i++)
      correction[i] = page_softmax(k, scores[i], count, position[i], base, &running_max[i], &total[i]);
    for (int c = 0; c < DV; c += CW) {
      __m512 o[WIDE_MIN][4];
      for (int i = 0; i < NQ; i++)
        for (int w = 0; w < CW; w++) o[i][w] = _mm512_mul_ps(_mm512_load_ps(acc[i] + 16 * (c + w)), _mm512_set1_ps(correction[i]));
      for (int64_t r = 0; r < count; r++) {
        const float* vr = vp + r * D + 16 * c;
        __m512 v[4];
        for (int w = 0; w < CW; w++) v[w] = _mm512_loadu_ps(vr + 16 * w);
        for (int i = 0; i < NQ; i++) {
          const __m512 p = _mm512_set1_ps(scores[i][r]);
          for (int w = 0; w < CW; w++) o[i][w] = _mm512_fmadd_ps(p, v[w], o[i][w]);
        }
      }
      for (int i = 0; i < NQ; i++)
        for (int w = 0; w < CW; w++) _mm512_store_ps(acc[i] + 16 * (c + w), o[i][w]);
    }
  }
  for (int i = 0; i < NQ; i++) finish_vector(a, first, kv, i, acc[i], running_max[i], total[i], part);
}
#endif

static inline void finish_vector(const Attend* a, int64_t first, int64_t kv, int64_t i, const float* acc,
                                 float running_max, float total, float* part) {
  const int64_t D = a->k->head_dim;
  if (part) {
    float* record = part + i * (D + 2);
    record[0] = running_max;
    record[1] = total;
    memcpy(record + 2, acc, sizeof(float) * (size_t)D);
    return;
  }
  float* dst = a->out + query_offset(a->k, first, kv, i);
  const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
  for (int64_t d = 0; d < D; d++) dst[d] = acc[d] * inverse;
}

/* the rows of a tile (`tile` of the step) and the positions [*lo, *hi) of the keys its queries see: from the
   oldest key its first query's window holds to its last query */
static inline int64_t tile_keys(const Attend* a, int64_t tile, int64_t* lo, int64_t* hi) {
  const int64_t b = a->tile_seq[tile], first = a->tile_row[tile];
  int64_t rows = a->starts[b + 1] - first;
  if (rows > a->tile_rows) rows = a->tile_rows;
  const int64_t first_pos = first_position(a, b, first), oldest = a->k->window > 0 ? first_pos - a->k->window + 1 : 0;
  *lo = oldest > 0 ? oldest : 0;
  *hi = first_pos + rows;
  return rows;
}

/* item = (tile · kv_heads + kv) · splits + part: one KV head of a tile, or with splits one part of its keys */
static void attend_item(void* data, size_t item) {
  const Attend* a = (const Attend*)data;
  const int64_t whole = (int64_t)item / a->splits, split = (int64_t)item % a->splits;
  int64_t kv = whole % a->k->kv_heads, tile = whole / a->k->kv_heads;
  int64_t b = a->tile_seq[tile], first = a->tile_row[tile];
  int64_t lo, hi;
  const int64_t rows = tile_keys(a, tile, &lo, &hi);
  float* part = NULL;
  if (a->splits > 1) {
    part = a->partial + (int64_t)item * WIDE_MIN * (a->k->head_dim + 2);
    lo += split * a->split_keys;
    if (hi > lo + a->split_keys) hi = lo + a->split_keys;
    if (lo >= hi) { /* a shorter context than the longest: nothing in this part */
      for (int64_t i = 0; i < rows * (a->k->num_heads / a->k->kv_heads); i++) {
        part[i * (a->k->head_dim + 2)] = -INFINITY;
        part[i * (a->k->head_dim + 2) + 1] = 0.0f;
      }
      return;
    }
  }
  if (a->k->softcap > 0.0f || a->k->alibi_heads) { /* the cap and ALiBi are applied by the generic tile alone */
    attend_tile(a, b, first, rows, kv, a->k->head_dim, lo, hi, part);
    return;
  }
#if defined(__AVX512F__)
  const int64_t n = rows * (a->k->num_heads / a->k->kv_heads), vectors = (n + 15) / 16;
  if (n < WIDE_MIN && (a->k->head_dim == 64 || a->k->head_dim == 128)) {
    switch (n * 1000 + a->k->head_dim) {
#define NARROW(count) case count * 1000 + 64: attend_narrow(a, b, first, kv, 64, count, lo, hi, part); return; \
                      case count * 1000 + 128: attend_narrow(a, b, first, kv, 128, count, lo, hi, part); return;
      NARROW(1) NARROW(2) NARROW(3) NARROW(4) NARROW(5) NARROW(6) NARROW(7)
#undef NARROW
      default: break;
    }
  }
  if (n >= WIDE_MIN && vectors <= WIDE_VECTORS && a->k->head_dim % WIDE_CHUNK == 0 && a->k->head_dim <= 256) {
    const int64_t D = a->k->head_dim;
    switch (vectors * 1000 + (D == 64 ? 64 : D == 128 ? 128 : 0)) {
      case 1064: attend_wide(a, b, first, rows, kv, 64, 1); return;
      case 2064: attend_wide(a, b, first, rows, kv, 64, 2); return;
      case 3064: attend_wide(a, b, first, rows, kv, 64, 3); return;
      case 4064: attend_wide(a, b, first, rows, kv, 64, 4); return;
      case 1128: attend_wide(a, b, first, rows, kv, 128, 1); return;
      case 2128: attend_wide(a, b, first, rows, kv, 128, 2); return;
      case 3128: attend_wide(a, b, first, rows, kv, 128, 3); return;
      case 4128: attend_wide(a, b, first, rows, kv, 128, 4); return;
      case 1000: attend_wide(a, b, first, rows, kv, D, 1); return;
      case 2000: attend_wide(a, b, first, rows, kv, D, 2); return;
      case 3000: attend_wide(a, b, first, rows, kv, D, 3); return;
      default: attend_wide(a, b, first, rows, kv, D, 4); return;
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const int64_t n = rows * (a->k->num_heads / a->k->kv_heads), vectors = (n + 7) / 8;
  if (n >= WIDE_MIN && vectors <= WIDE_VECTORS && a->k->head_dim % WIDE_CHUNK == 0 && a->k->head_dim <= 256) {
    const int64_t D = a->k->head_dim;
    switch (vectors * 1000 + (D == 64 ? 64 : 0)) {
      case 1064: attend_wide8(a, b, first, rows, kv, 64, 1); return;
      case 2064: attend_wide8(a, b, first, rows, kv, 64, 2); return;
      case 3064: attend_wide8(a, b, first, rows, kv, 64, 3); return;
      case 4064: attend_wide8(a, b, first, rows, kv, 64, 4); return;
      case 1000: attend_wide8(a, b, first, rows, kv, D, 1); return;
      case 2000: attend_wide8(a, b, first, rows, kv, D, 2); return;
      case 3000: attend_wide8(a, b, first, rows, kv, D, 3); return;
      default: attend_wide8(a, b, first, rows, kv, D, 4); return;
    }
  }
#endif
  switch (a->k->head_dim) {
    case 64: attend_tile(a, b, first, rows, kv, 64, lo, hi, part); break;
    case 128: attend_tile(a, b, first, rows, kv, 128, lo, hi, part); break;
    default: attend_tile(a, b, first, rows, kv, a->k->head_dim, lo, hi, part); break;
  }
}

/* ---- the checks ---------------------------------------------------------------------------------- */

static OrtStatus* check_metadata(const Kernel* k, const Tensor* starts, const Tensor* lens, const Tensor* tables,
                                 const Tensor* slots, int64_t tokens, int64_t num_pages) {
  char message[256];
  if (starts->rank != 1 || lens->rank != 1 || tables->rank != 2 || slots->rank != 1)
    return fail("PagedInputError: query_start_loc, seq_lens and slot_mapping must be 1-d, block_tables 2-d");
  int64_t batch = lens->dims[0], max_blocks = tables->dims[1];
  if (starts->dims[0] != batch + 1 || tables->dims[0] != batch)
    return fail("PagedInputError: query_start_loc, seq_lens and block_tables do not describe the same sequences");
  if (slots->dims[0] != tokens) return fail("PagedInputError: slot_mapping does not have one slot per token");
  const int32_t* s = (const int32_t*)starts->data;
  const int32_t* len = (const int32_t*)lens->data;
  const int32_t* table = (const int32_t*)tables->data;
  if (s[0] != 0 || s[batch] != tokens) {
    snprintf(message, sizeof(message), "PagedInputError: query_start_loc must run from 0 to the step's %lld tokens",
             (long long)tokens);
    return fail(message);
  }
  for (int64_t b = 0; b < batch; b++) {
    int64_t rows = (int64_t)s[b + 1] - s[b];
    if (rows < 0) return fail("PagedInputError: query_start_loc decreases");
    if (len[b] < rows) return fail("PagedInputError: a sequence's seq_lens is shorter than its new tokens");
    int64_t needed = (len[b] + k->page_size - 1) / k->page_size;
    if (needed > max_blocks) {
      snprintf(message, sizeof(message), "PagedInputError: a context of %d tokens needs %lld pages, the block "
               "tables have %lld", len[b], (long long)needed, (long long)max_blocks);
      return fail(message);
    }
    for (int64_t p = 0; p < needed; p++)
      if (table[b * max_blocks + p] < 0 || table[b * max_blocks + p] >= num_pages)
        return fail("PagedInputError: a block table names a page outside the pool");
  }
  const int64_t* slot = (const int64_t*)slots->data;
  for (int64_t t = 0; t < tokens; t++)
    if (slot[t] < 0 || slot[t] >= num_pages * k->page_size) return fail("PagedInputError: a slot is outside the pool");
  return NULL;
}

/* ---- a long context's decode over many items ------------------------------------------------------ */

/* A decode step of few sequences has few items (a tile a sequence, times the KV heads): over a long context
   each item reads many pages while the other threads wait. Where every tile is a decode tile (fewer than
   WIDE_MIN query vectors) and there are fewer than k->split_items items, each tile's keys are cut into parts
   of at least SPLIT_KEYS keys, each part an item with its own online softmax (flash-decoding), merged by
   combine_parts. Sets a->splits, split_keys and partial (or *status when out of memory). */
static void split_long_contexts(Attend* a, int64_t tiles, OrtStatus** status) {
  const Kernel* k = a->k;
  const int64_t group = k->num_heads / k->kv_heads, whole = tiles * k->kv_heads;
  if (whole >= k->split_items) return;
  int64_t most = 0;
  for (int64_t tile = 0; tile < tiles; tile++) {
    int64_t lo, hi;
    if (tile_keys(a, tile, &lo, &hi) * group >= WIDE_MIN) return; /* a prefill tile: it runs whole */
    if (hi - lo > most) most = hi - lo;
  }
  const int64_t wanted = (k->split_items + whole - 1) / whole;
  int64_t parts = most / SPLIT_KEYS < wanted ? most / SPLIT_KEYS : wanted;
  if (parts < 2) return;
  /* parts of even length in whole blocks of 16 rows (so at most `parts` of them, none under SPLIT_KEYS) */
  const int64_t keys = ((most + parts - 1) / parts + 15) / 16 * 16, splits = (most + keys - 1) / keys;
  a->partial = (float*)malloc(sizeof(float) * (size_t)(whole * splits * WIDE_MIN * (k->head_dim + 2)));
  if (!a->partial) {
    *status = fail("out of memory for the attention's parts");
    return;
  }
  a->splits = splits;
  a->split_keys = keys;
}

/* Each split tile's query vectors from its parts: outputs weighed by exp(part max - max) over the totals. */
static void combine_parts(const Attend* a, int64_t tiles) {
  const Kernel* k = a->k;
  const int64_t group = k->num_heads / k->kv_heads, D = k->head_dim, stride = WIDE_MIN * (D + 2);
  for (int64_t tile = 0; tile < tiles; tile++) {
    int64_t lo, hi;
    const int64_t n = tile_keys(a, tile, &lo, &hi) * group;
    for (int64_t kv = 0; kv < k->kv_heads; kv++) {
      const float* parts = a->partial + (tile * k->kv_heads + kv) * a->splits * stride;
      for (int64_t i = 0; i < n; i++) {
        float most = -INFINITY, total = 0.0f;
        for (int64_t s = 0; s < a->splits; s++) most = fmaxf(most, parts[s * stride + i * (D + 2)]);
        float* dst = a->out + query_offset(k, a->tile_row[tile], kv, i);
        for (int64_t d = 0; d < D; d++) dst[d] = 0.0f;
        if (most == -INFINITY) continue; /* nothing visible: zeros, as a whole tile gives */
        for (int64_t s = 0; s < a->splits; s++) {
          const float* record = parts + s * stride + i * (D + 2);
          if (record[0] == -INFINITY) continue;
          const float weight = expf(record[0] - most);
          total += weight * record[1];
          for (int64_t d = 0; d < D; d++) dst[d] += weight * record[2 + d];
        }
        const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t d = 0; d < D; d++) dst[d] *= inverse;
      }
    }
  }
}

/* ---- the op --------------------------------------------------------------------------------------- */

static OrtStatus* compute(void* kernel, OrtKernelContext* context) {
  const Kernel* k = (const Kernel*)kernel;
  const OrtValue* values[NUM_INPUTS] = {0};
  Tensor t[NUM_INPUTS];
  memset(t, 0, sizeof(t));
  for (int i = 0; i < NUM_INPUTS; i++) {
    OrtStatus* status = ORT_CALL(g_api, KernelContext_GetInput)(context, i, &values[i]);
    if (status) return status;
    if (values[i] && (status = tensor_of(values[i], &t[i]))) return status;
  }
  if (!values[QUERY] || !values[KEY_CACHE] || !values[VALUE_CACHE] || !values[QUERY_START_LOC] || !values[SEQ_LENS] ||
      !values[BLOCK_TABLES] || !values[SLOT_MAPPING])
    return fail("PagedInputError: a required input is missing");
  const int64_t H = k->num_heads, KV = k->kv_heads, D = k->head_dim, PS = k->page_size;
  if (H % KV) return fail("PagedInputError: the query heads do not group over the KV heads");
  /* fewer rows a tile when many query heads share a KV head (multi-query attention): the scratch stays bounded */
  int64_t tile_rows = TILE_VECTORS / (H / KV);
  if (tile_rows > QUERY_TILE) tile_rows = QUERY_TILE;
  if (tile_rows < 1) return fail("PagedInputError: more than 128 query heads share one KV head");
#if defined(__AVX512F__)
  /* wide tiles take as many rows as 64 query vectors hold, when that beats the narrow tile's rows */
  const int64_t wide_rows = (16 * 4) / (H / KV) < WIDE_ROWS ? (16 * 4) / (H / KV) : WIDE_ROWS;
  if (D % WIDE_CHUNK == 0 && D <= 256 && wide_rows > tile_rows) tile_rows = wide_rows;
#elif defined(__AVX2__) && defined(__FMA__)
  const int64_t wide_rows = (8 * WIDE_VECTORS) / (H / KV) < WIDE_ROWS ? (8 * WIDE_VECTORS) / (H / KV) : WIDE_ROWS;
  if (D % WIDE_CHUNK == 0 && D <= 256 && wide_rows > tile_rows) tile_rows = wide_rows;
#endif
  const Tensor* kc = &t[KEY_CACHE];
  if (kc->rank != 5 || t[VALUE_CACHE].rank != 5 || memcmp(kc->dims, t[VALUE_CACHE].dims, sizeof(kc->dims)) ||
      kc->dims[0] <= k->layer || kc->dims[2] != KV || kc->dims[3] != PS || kc->dims[4] != D)
    return fail("PagedInputError: the page pool does not have the node's layer, heads and page size");
  const int64_t num_pages = kc->dims[1];
  const Tensor* query = &t[QUERY];
  const int packed = values[KEY] == NULL;
  if (query->rank != 3 || query->dims[0] != 1) return fail("PagedInputError: query is not [1, tokens, width]");
  const int64_t T = query->dims[1];
  const int64_t qwidth = packed ? (H + 2 * KV) * D : H * D;
  if (query->dims[2] != qwidth) return fail("PagedInputError: query's width does not match the node's heads");
  if (!packed) {
    if (!values[VALUE] || t[KEY].rank != 3 || t[VALUE].rank != 3 || t[KEY].dims[1] != T || t[VALUE].dims[1] != T ||
        t[KEY].dims[2] != KV * D || t[VALUE].dims[2] != KV * D || t[KEY].dims[0] != 1 || t[VALUE].dims[0] != 1)
      return fail("PagedInputError: key and value are not [1, tokens, kv_heads * head_dim]");
  }
  int64_t rotary = 0, rotary_rows = 0;
  if (values[COS]) {
    if (!values[SIN] || t[COS].rank < 1 || t[SIN].rank != t[COS].rank ||
        memcmp(t[COS].dims, t[SIN].dims, sizeof(t[COS].dims)))
      return fail("PagedInputError: cos and sin do not have one shape");
    rotary = t[COS].dims[t[COS].rank - 1];
    rotary_rows = rotary ? elements(&t[COS]) / rotary : 0;
    if (rotary > D || rotary % 2 || (rotary_rows != 1 && rotary_rows != T))
      return fail("PagedInputError: cos/sin do not fit the tokens and head_dim");
  }
  OrtStatus* status = check_metadata(k, &t[QUERY_START_LOC], &t[SEQ_LENS], &t[BLOCK_TABLES], &t[SLOT_MAPPING], T,
                                     num_pages);
  if (status) return status;

  float* key_cache = (float*)kc->data + k->layer * num_pages * KV * PS * D;
  float* value_cache = (float*)t[VALUE_CACHE].data + k->layer * num_pages * KV * PS * D;
  const float* qsrc = query->data;
  const float* ksrc = packed ? query->data : t[KEY].data;
  const float* vsrc = packed ? query->data : t[VALUE].data;
  const int64_t qstride = qwidth, kstride = packed ? qwidth : KV * D;
  const int64_t kofs = packed ? H * D : 0, vofs = packed ? (H + KV) * D : 0;
  const int64_t* slots = (const int64_t*)t[SLOT_MAPPING].data;
  float* q = (float*)malloc(sizeof(float) * (size_t)(T * H * D + 1));
  if (!q) return fail("out of memory for the rotated queries");
  for (int64_t tok = 0; tok < T; tok++) {
    const float* cos = rotary ? t[COS].data + (rotary_rows == 1 ? 0 : tok) * rotary : NULL;
    const float* sin = rotary ? t[SIN].data + (rotary_rows == 1 ? 0 : tok) * rotary : NULL;
    int64_t page = slots[tok] / PS, row = slots[tok] % PS;
    for (int64_t h = 0; h < H; h++)
      rotate_row(qsrc + tok * qstride + h * D, cos, sin, rotary, D, k->interleaved, q + (tok * H + h) * D);
    for (int64_t h = 0; h < KV; h++) {
      float* kdst = key_cache + ((page * KV + h) * PS + row) * D;
      rotate_row(ksrc + tok * kstride + kofs + h * D, cos, sin, rotary, D, k->interleaved, kdst);
      memcpy(value_cache + ((page * KV + h) * PS + row) * D, vsrc + tok * kstride + vofs + h * D, sizeof(float) * D);
    }
  }

  const int64_t batch = t[SEQ_LENS].dims[0];
  const int32_t* starts = (const int32_t*)t[QUERY_START_LOC].data;
  const int32_t* lens = (const int32_t*)t[SEQ_LENS].data;
  int64_t tiles = 0, work = 0;
  for (int64_t b = 0; b < batch; b++) {
    tiles += (starts[b + 1] - starts[b] + tile_rows - 1) / tile_rows;
    work += (int64_t)(starts[b + 1] - starts[b]) * lens[b];
  }
  int64_t* tile_seq = (int64_t*)malloc(sizeof(int64_t) * (size_t)(2 * tiles + 1));
  if (!tile_seq) {
    free(q);
    return fail("out of memory for the attention tiles");
  }
  int64_t* tile_row = tile_seq + tiles;
  int64_t n = 0;
  for (int64_t b = 0; b < batch; b++)
    for (int64_t first = starts[b]; first < starts[b + 1]; first += tile_rows) {
      tile_seq[n] = b;
      tile_row[n++] = first;
    }
  const int64_t output_dims[3] = {1, T, H * D};
  OrtValue* output = NULL;
  status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 0, output_dims, 3, &output);
  float* out = NULL;
  if (!status) status = ORT_CALL(g_api, GetTensorMutableData)(output, (void**)&out);
  if (!status && T > 0) {
    Attend a = {k, q, key_cache, value_cache, starts, lens, (const int32_t*)t[BLOCK_TABLES].data,
                t[BLOCK_TABLES].dims[1], tile_seq, tile_row, out, tile_rows, 1, 0, NULL};
    const int parallel = work * H >= PARALLEL_WORK;
    if (parallel) split_long_contexts(&a, tiles, &status); /* parts only pay where threads take them */
    size_t items = (size_t)(tiles * KV * a.splits);
    if (!status) {
      if (parallel && items > 1) {
        status = ORT_CALL(g_api, KernelContext_ParallelFor)(context, attend_item, items, 0, &a);
      } else {
        for (size_t i = 0; i < items; i++) attend_item(&a, i);
      }
    }
    if (!status && a.splits > 1) combine_parts(&a, tiles);
    free(a.partial);
  }
  free(tile_seq);
  free(q);
  return status;
}

/* ---- registration ---------------------------------------------------------------------------------- */

static OrtStatus* create_kernel(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  (void)api;
  size_t slopes = 0; /* ALiBi's, when the node has them: the kernel's allocation holds them */
  OrtStatus* no_slopes = ORT_CALL(g_api, KernelInfoGetAttributeArray_float)(info, "alibi_slopes", NULL, &slopes);
  if (no_slopes) { /* the registry's default: none */
    ORT_CALL(g_api, ReleaseStatus)(no_slopes);
    slopes = 0;
  }
  Kernel* k = (Kernel*)calloc(1, sizeof(Kernel) + slopes * sizeof(float));
  if (!k) return fail("out of memory for a PagedAttention kernel");
  k->alibi_heads = (int64_t)slopes;
  OrtStatus* status = NULL;
  if (slopes) {
    size_t read = slopes;
    status = ORT_CALL(g_api, KernelInfoGetAttributeArray_float)(info, "alibi_slopes", k->alibi, &read);
  }
  if (!status) status = int_attribute(info, "num_heads", &k->num_heads);
  if (!status) status = int_attribute(info, "kv_num_heads", &k->kv_heads);
  if (!status) status = int_attribute(info, "head_dim", &k->head_dim);
  if (!status) status = int_attribute(info, "layer", &k->layer);
  if (!status) status = int_attribute(info, "page_size", &k->page_size);
  if (!status) status = ORT_CALL(g_api, KernelInfoGetAttribute_float)(info, "scale", &k->scale);
  /* the registry's defaults (cann_llm/runtime/ops.py): the compiler may leave these off */
  k->interleaved = int_attribute_or(info, "rotary_interleaved", 0);
  k->window = int_attribute_or(info, "sliding_window", 0);
  /* two items a core, so that threads taking them as they finish end together (SmolLM2's one sequence has
     3, one KV head each: on two threads one read two heads' keys while the other waited); at most 64,
     which keeps a many-core pool busy */
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  k->split_items = cores < 2 ? 4 : cores > 32 ? 64 : 2 * cores;
  OrtStatus* no_cap = ORT_CALL(g_api, KernelInfoGetAttribute_float)(info, "softcap", &k->softcap);
  if (no_cap) { /* the registry's default: none */
    ORT_CALL(g_api, ReleaseStatus)(no_cap);
    k->softcap = 0.0f;
  }
  if (!status && (k->num_heads < 1 || k->kv_heads < 1 || k->head_dim < 1 || k->page_size < 1 || k->layer < 0))
    status = fail("PagedInputError: the node's heads, head_dim, page_size and layer must be positive");
  if (!status && !(k->softcap >= 0.0f && k->softcap <= 1e6f))
    status = fail("PagedInputError: the node's softcap must lie in [0, 1e6]");
  if (!status && k->alibi_heads && k->alibi_heads != k->num_heads)
    status = fail("PagedInputError: the node's alibi_slopes must hold one slope a query head");
  if (status) {
    free(k);
    return status;
  }
  *out = k;
  return NULL;
}

static const char* op_name(const OrtCustomOp* op) { (void)op; return "PagedAttention"; }
static size_t input_count(const OrtCustomOp* op) { (void)op; return NUM_INPUTS; }
static size_t output_count(const OrtCustomOp* op) { (void)op; return 1; }
static ONNXTensorElementDataType output_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ORT_FLOAT; }

static ONNXTensorElementDataType input_type(const OrtCustomOp* op, size_t i) {
  (void)op;
  switch (i) {
    case QUERY_START_LOC: case SEQ_LENS: case BLOCK_TABLES: return ORT_INT32;
    case SLOT_MAPPING: return ORT_INT64;
    default: return ORT_FLOAT;
  }
}

static OrtCustomOpInputOutputCharacteristic input_characteristic(const OrtCustomOp* op, size_t i) {
  (void)op;
  return (i == KEY || i == VALUE || i == COS || i == SIN) ? ORT_OPTIONAL : ORT_REQUIRED;
}



void paged_attention_op(OrtCustomOp* op) {
  common_op(op);
  op->GetName = op_name;
  op->GetInputType = input_type;
  op->GetInputTypeCount = input_count;
  op->GetOutputType = output_type;
  op->GetOutputTypeCount = output_count;
  op->GetInputCharacteristic = input_characteristic;
  op->CreateKernelV2 = create_kernel;
  op->KernelComputeV2 = compute;
}
