/* The native custom-op library: registers the ops of this folder in the `cann` domain of a session.
   onnxruntime calls RegisterCustomOps from SessionOptions.register_custom_ops_library. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "native_ops.h"

const OrtApi* g_api;

OrtStatus* fail(const char* message) { return ORT_CALL(g_api, CreateStatus)(ORT_FAIL, message); }

OrtStatus* tensor_of(const OrtValue* value, Tensor* out) {
  OrtTensorTypeAndShapeInfo* info = NULL;
  OrtStatus* status = ORT_CALL(g_api, GetTensorTypeAndShape)(value, &info);
  if (status) return status;
  status = ORT_CALL(g_api, GetDimensionsCount)(info, &out->rank);
  if (!status && out->rank > 6) status = fail("PagedInputError: an operand of more than 6 dimensions");
  if (!status) status = ORT_CALL(g_api, GetDimensions)(info, out->dims, out->rank);
  ORT_CALL(g_api, ReleaseTensorTypeAndShapeInfo)(info);
  if (!status) status = ORT_CALL(g_api, GetTensorMutableData)((OrtValue*)value, (void**)&out->data);
  return status;
}

OrtStatus* required_input(OrtKernelContext* context, size_t index, Tensor* out, const char* op) {
  const OrtValue* value = NULL;
  OrtStatus* status = ORT_CALL(g_api, KernelContext_GetInput)(context, index, &value);
  if (!status && !value) {
    char message[96];
    snprintf(message, sizeof(message), "%s: a required input is missing", op);
    return fail(message);
  }
  return status ? status : tensor_of(value, out);
}

OrtStatus* int_attribute(const OrtKernelInfo* info, const char* name, int64_t* out) {
  return ORT_CALL(g_api, KernelInfoGetAttribute_int64)(info, name, out);
}

int64_t int_attribute_or(const OrtKernelInfo* info, const char* name, int64_t fallback) {
  int64_t value = fallback;
  OrtStatus* status = int_attribute(info, name, &value);
  if (status) {
    ORT_CALL(g_api, ReleaseStatus)(status);
    value = fallback;
  }
  return value;
}

int64_t elements(const Tensor* t) {
  int64_t n = 1;
  for (size_t i = 0; i < t->rank; i++) n *= t->dims[i];
  return n;
}

static const char* cpu_provider(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static OrtMemType default_memory(const OrtCustomOp* op, size_t index) { (void)op; (void)index; return ORT_MEM_DEFAULT; }
static int variadic_arity(const OrtCustomOp* op) { (void)op; return 1; }
static int variadic_homogeneity(const OrtCustomOp* op) { (void)op; return 1; }
static void destroy_kernel(void* kernel) { free(kernel); }

OrtCustomOpInputOutputCharacteristic required(const OrtCustomOp* op, size_t index) {
  (void)op;
  (void)index;
  return ORT_REQUIRED;
}

void common_op(OrtCustomOp* op) {
  memset(op, 0, sizeof(*op));
  op->version = ORT_API_VERSION_USED;
  op->GetExecutionProviderType = cpu_provider;
  op->KernelDestroy = destroy_kernel;
  op->GetInputCharacteristic = required;
  op->GetOutputCharacteristic = required;
  op->GetInputMemoryType = default_memory;
  op->GetVariadicInputMinArity = variadic_arity;
  op->GetVariadicInputHomogeneity = variadic_homogeneity;
  op->GetVariadicOutputMinArity = variadic_arity;
  op->GetVariadicOutputHomogeneity = variadic_homogeneity;
}

static OrtCustomOp g_ops[5];

__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  g_api = base->GetApi(ORT_API_VERSION_USED);
  if (!g_api) return NULL; /* an onnxruntime older than the API this library uses cannot say so any other way */
  paged_attention_op(&g_ops[0]);
  swiglu_op(&g_ops[1]);
  size_t count = 2 + (size_t)matmul_int4_op(&g_ops[2]);
  count += (size_t)matmul_f28_op(&g_ops[count]);
  count += (size_t)matmul_f32_op(&g_ops[count]);
  OrtCustomOpDomain* domain = NULL;
  OrtStatus* status = ORT_CALL(g_api, CreateCustomOpDomain)(DOMAIN, &domain);
  for (size_t i = 0; !status && i < count; i++)
    status = ORT_CALL(g_api, CustomOpDomain_Add)(domain, &g_ops[i]);
  if (!status) status = ORT_CALL(g_api, AddCustomOpDomain)(options, domain);
  return status;
}
