/* cann::MatMulInt4 as an onnxruntime custom op: y = A · Wᵀ with W stored in MatMulNBits' layout (B uint8
   [N][blocks][block·bits/8], 4-bit values low nibble first), a float32 scale a block and optional uint8 zero
   points (4-bit ones two a byte, low nibble first; 2^(bits-1) without them); an optional fifth input [K]
   scales A's columns first (a constant Mul before the node, moved into it by cann_llm/runtime/lowering.py's
   `with_input_scales`: AWQ's 1/s where no norm could take it).
   A is quantized to int8 per row and block (scale max|a| / 127, a · 127 / max|a| rounded half to even) as
   onnxruntime's accuracy level 4 does, and multiplied in int8. This file is the op: its inputs and checks,
   the scale tables, the scratch and the two parallel loops; the loops' bodies are the kernel file of the
   build's instruction set (matmul_int4.h says which), docs/performance.md#int4-matmul what each gives. The
   reference is cann_llm/runtime/kernels/quant_matmul.py's MatMulInt4; the executor gives this op only the nodes it
   takes (cann_llm/runtime/kernels/native/__init__.py: `takes_matmul`): accuracy level 4, 4 bits in blocks of 32, 64 or
   128 or 8 bits in blocks of 64 or 128, so that a block is one or two 64-byte pieces, or a half or a quarter
   of one. */
#define _DEFAULT_SOURCE /* sysconf's _SC_NPROCESSORS_ONLN */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "matmul_int4.h"

#if MATMUL_INT4_ISA

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
    k->zero_t = (uint8_t*)calloc((size_t)count, 1);
    k->last_group = whole < k->N ? (uint8_t*)calloc((size_t)(TASK_COLUMNS * row_bytes), 1) : NULL;
    if (!k->scale_t || !k->zero_t || (whole < k->N && !k->last_group))
      status = fail("MatMulInt4: out of memory for its scale tables");
    for (int64_t n = 0; !status && n < k->N; n++)
      for (int64_t b = 0; b < w->blocks; b++) {
        const int64_t at = ((n / TASK_COLUMNS * w->blocks) + b) * TASK_COLUMNS + n % TASK_COLUMNS;
        k->scale_t[at] = w->scales[n * w->blocks + b];
        k->zero_t[at] = (uint8_t)matmul_int4_zero_point(w, n, b);
      }
    if (!status && k->last_group) memcpy(k->last_group, w->b + whole * row_bytes, (size_t)((k->N - whole) * row_bytes));
    __atomic_store_n(&k->tables_of, status ? NULL : w->scales, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&k->lock);
  return status;
}

/* parallel tasks a call's columns go in: MAX_TASKS, or TASKS_A_CPU a CPU where there are fewer CPUs */
static int64_t task_count(void) {
  static int64_t count;
  int64_t known = __atomic_load_n(&count, __ATOMIC_RELAXED);
  if (!known) {
    const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    known = cpus > 0 && cpus * TASKS_A_CPU < MAX_TASKS ? cpus * TASKS_A_CPU : MAX_TASKS;
    __atomic_store_n(&count, known, __ATOMIC_RELAXED);
  }
  return known;
}

static OrtStatus* compute(void* kernel, OrtKernelContext* context) {
  Kernel* k = (Kernel*)kernel;
  Tensor a, b, scales, zero_points;
  OrtStatus* status = required_input(context, 0, &a, "MatMulInt4");
  if (!status) status = required_input(context, 1, &b, "MatMulInt4");
  if (!status) status = required_input(context, 2, &scales, "MatMulInt4");
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
  const int64_t pieces = (blocks * block_bytes + PIECE - 1) / PIECE, q_stride = k->bits == 4 ? pieces * 2 * PIECE : blocks * k->block;
  const int64_t per_piece = k->bits == 4 ? 2 * PIECE / k->block : 0;
  const int half_last = k->bits == 4 && blocks * block_bytes < pieces * PIECE;
  const size_t q_bytes = ((size_t)(m * q_stride) + 63) & ~(size_t)63;
  const size_t both_floats = (size_t)(MAX_TASKS * ROWS * blocks * TASK_COLUMNS);
  const size_t lane_bytes = matmul_int4_lane_bytes(m, pieces);
  const size_t floats_bytes = (sizeof(float) * (2 * (size_t)(m * blocks) + both_floats) + 63) & ~(size_t)63;
  char* scratch = (char*)aligned_alloc(64, q_bytes + floats_bytes + lane_bytes);
  if (!scratch) return fail("MatMulInt4: out of memory for the quantized activations");
  Work w = {k, a.data, scale_value ? a_scale.data : NULL, (const uint8_t*)b.data, scales.data, zp_value ? (const uint8_t*)zero_points.data : NULL,
            (int8_t*)scratch, (float*)(scratch + q_bytes), (int32_t*)((float*)(scratch + q_bytes) + m * blocks), y, m,
            blocks, block_bytes, pieces, per_piece, half_last, q_stride, 0, (float*)(scratch + q_bytes) + 2 * m * blocks,
            (uint8_t*)(scratch + q_bytes + floats_bytes)};
  w.task_columns = (k->N + task_count() - 1) / task_count();
  w.task_columns = (w.task_columns + TASK_COLUMNS - 1) / TASK_COLUMNS * TASK_COLUMNS;
  status = tables(k, &w);
  if (status) {
    free(scratch);
    return status;
  }
  if (m >= PARALLEL_ROWS) status = ORT_CALL(g_api, KernelContext_ParallelFor)(context, matmul_int4_quantize_row, (size_t)m, 0, &w);
  else
    for (int64_t r = 0; r < m; r++) matmul_int4_quantize_row(&w, (size_t)r);
  if (!status) {
    const size_t tasks = (size_t)((k->N + w.task_columns - 1) / w.task_columns); /* at most MAX_TASKS */
    status = ORT_CALL(g_api, KernelContext_ParallelFor)(context, matmul_int4_columns, tasks, 0, &w);
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
  k->bits = int_attribute_or(info, "bits", 4); /* the registry's default (cann_llm/runtime/ops.py) */
  if (!status && (k->K < 1 || k->N < 1 || (k->bits != 4 && k->bits != 8) || (k->block != 64 && k->block != 128 && !(k->bits == 4 && k->block == 32))))
    status = fail("MatMulInt4: the native kernel takes 4 bits in blocks of 32, 64 or 128, or 8 bits in blocks of 64 or 128");
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

#else

int matmul_int4_op(OrtCustomOp* op) {
  (void)op;
  return 0; /* neither AVX-512 VNNI nor AVX2 here: the executor lowers MatMulInt4 to onnxruntime's MatMulNBits */
}

#endif

/* which kernel this build registers: 512 (AVX-512 VNNI), 256 (AVX2) or 0, none (cann_llm/runtime/kernels/native/__init__.py
   asks, through ctypes) */
__attribute__((visibility("default"))) int cann_matmul_int4_built(void) { return MATMUL_INT4_ISA; }
