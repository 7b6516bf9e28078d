/* What cann::MatMulInt4's op (matmul_int4.c) and its kernels for one instruction set share: the kernel's
   state, one call's work, and the two functions a kernel file provides. A build has one kernel file:
   matmul_int4_avx512.c on CPUs with AVX-512 VNNI, matmul_int4_avx2.c on CPUs with AVX2 and FMA but not that;
   on others there is no MatMulInt4 and the executor keeps onnxruntime's MatMulNBits. */
#ifndef CANN_MATMUL_INT4_H
#define CANN_MATMUL_INT4_H

#include <pthread.h>
#include <stdint.h>

#include "native_ops.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define MATMUL_INT4_ISA 512
#elif defined(__AVX2__) && defined(__FMA__)
#define MATMUL_INT4_ISA 256
#else
#define MATMUL_INT4_ISA 0
#endif

#define PIECE 64        /* 64 bytes of a column's weights: a 4-bit block of 128, two of 64 or four of 32, an 8-bit block
                           of 64 or half of one of 128; a 4-bit column can end in half a piece */
#define ROWS 4          /* rows computed together, sharing each unpacked weight piece */
#define TASK_COLUMNS 16 /* columns computed together: their weights stay in L1 while every row is read */
#define PREFETCH 8192   /* bytes ahead of the weights being read that a column asks for: 4096 was the best of
                           512-8192 on one host; on another (AMX, slower memory) 8192 made a decode step 1.02x
                           faster twice and 2048 1.13x slower (docs/performance.md#int4-matmul) */
#define PREFETCH_HINT _MM_HINT_T1 /* into L2, not L1: a decode step's many short streams were bound by L1's outstanding
                                   misses; with the AVX-512 kernels a step 1.06-1.10x faster in three runs, with the
                                   AVX2 ones 1.03-1.04x in two on one host, level (1.01x) in one on another */
#define MAX_TASKS 16    /* parallel tasks a call splits its columns into at most, as MLAS does for this much work */
#define TASKS_A_CPU 4   /* and at most this many a CPU: on 2 CPUs, 8 tasks read a decode step's matmuls 1.3-5.5%
                           faster than 16 (fewer streams to start a call), 21 rows 5.9%, 512 rows the same */
#define PARALLEL_ROWS 8 /* rows from which the activations are quantized on the pool's threads */

typedef struct {
  int64_t K, N, bits, block;
  /* made at the first run from the node's constant inputs (a custom op has no pre-packing step): the scales
     and zero points of every group of 16 columns, block by block ([ceil(N/16)][blocks][16]), and when N is
     not a multiple of 16 the last group's weights padded with zero columns, so every group takes one path */
  pthread_mutex_t lock;
  const float* tables_of; /* the scales they were made from */
  float* scale_t;
  uint8_t* zero_t; /* the zero points as bytes: a quarter of int32's traffic, read with the weights every call */
  uint8_t* last_group;
} Kernel;

typedef struct {
  const Kernel* k;
  const float* a;
  const float* a_scale;       /* NULL, or [K] multiplying A's columns before they are quantized */
  const uint8_t* b;
  const float* scales;
  const uint8_t* zero_points; /* NULL: 2^(bits-1) */
  int8_t* q;                  /* [M][q_stride] activations in int8: 8 bits block by block; 4 bits piece by piece, each
                                 piece's 128 elements as their 64 even ones then their 64 odd ones (zeros past K) */
  float* q_scale;             /* [M][blocks] */
  int32_t* q_sum;             /* [M][blocks] the sum of its int8 values */
  float* y;
  int64_t m, blocks, block_bytes;
  int64_t pieces;    /* 64-byte pieces of a column's weights */
  int64_t per_piece; /* 4-bit blocks a piece: 1, 2 or 4 (blocks of 128, 64, 32); 0 at 8 bits */
  int half_last;     /* a 4-bit column ends in half a piece (K = 576 in blocks of 64 or 32) */
  int64_t q_stride;  /* int8 activations a row of q */
  int64_t task_columns; /* columns of one parallel task: a multiple of 16, at most MAX_TASKS tasks */
  float* both;          /* [tasks][ROWS][blocks][16] products of weight and activation scales */
  uint8_t* lanes;       /* [tasks][16 · pieces · 64] a task's group of weights as lanes (lane_bytes) */
} Work;

/* One row of A into int8, block by block (a ParallelFor body over rows). For 4 bits, each 128 elements go
   as their 64 even ones then their 64 odd ones, the order in which a piece's low and high nibbles meet them. */
void matmul_int4_quantize_row(void* work, size_t row);
/* The columns of one parallel task for every row (a ParallelFor body over tasks). */
void matmul_int4_columns(void* work, size_t task);
/* The scratch bytes a call of m rows needs for its tasks' transposed weights (0 where the kernel does not). */
size_t matmul_int4_lane_bytes(int64_t m, int64_t pieces);

/* the zero point of column n's block b as the op's tables hold it */
static inline int32_t matmul_int4_zero_point(const Work* w, int64_t n, int64_t b) {
  if (!w->zero_points) return w->k->bits == 4 ? 8 : 128;
  if (w->k->bits == 8) return w->zero_points[n * w->blocks + b];
  const uint8_t packed = w->zero_points[n * ((w->blocks + 1) / 2) + b / 2];
  return b & 1 ? packed >> 4 : packed & 15;
}

#endif
