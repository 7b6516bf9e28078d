/* The part of onnxruntime's C ABI a custom-op library uses, declared here because onnxruntime's wheels
   carry no headers. OrtApi is a table of function pointers that only ever grows at its end, so a
   function is known by its slot; the slots and the OrtCustomOp layout below are those of onnxruntime's
   public onnxruntime_c_api.h (API version 16 and later). cann_llm/runtime/kernels/native/__init__.py builds
   against this file only; tests/runtime/test_native_ops.py loads the result into onnxruntime. */
#ifndef CANN_ORT_ABI_H
#define CANN_ORT_ABI_H

#include <stddef.h>
#include <stdint.h>

/* the API version this library asks for: custom ops with CreateKernelV2 / KernelComputeV2 (status returns) */
#define ORT_API_VERSION_USED 16

typedef struct OrtApi OrtApi;
typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;

typedef enum { ORT_FLOAT = 1, ORT_UINT8 = 2, ORT_INT32 = 6, ORT_INT64 = 7 } ONNXTensorElementDataType; /* the values used here */
typedef enum { ORT_OK = 0, ORT_FAIL = 1 } OrtErrorCode;
typedef enum { ORT_MEM_DEFAULT = 0 } OrtMemType;
typedef enum { ORT_REQUIRED = 0, ORT_OPTIONAL = 1 } OrtCustomOpInputOutputCharacteristic;

typedef struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)(void);
} OrtApiBase;

typedef struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const struct OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const struct OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const struct OrtCustomOp* op);
  ONNXTensorElementDataType (*GetInputType)(const struct OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const struct OrtCustomOp* op);
  ONNXTensorElementDataType (*GetOutputType)(const struct OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const struct OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  OrtCustomOpInputOutputCharacteristic (*GetInputCharacteristic)(const struct OrtCustomOp* op, size_t index);
  OrtCustomOpInputOutputCharacteristic (*GetOutputCharacteristic)(const struct OrtCustomOp* op, size_t index);
  OrtMemType (*GetInputMemoryType)(const struct OrtCustomOp* op, size_t index);
  int (*GetVariadicInputMinArity)(const struct OrtCustomOp* op);
  int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const struct OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp* op);
  OrtStatus* (*CreateKernelV2)(const struct OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* context);
  /* later versions append more fields; a version-16 op is read only up to here */
} OrtCustomOp;

/* the functions used, by slot, with their signatures */
#define ORT_SLOT_CreateStatus 0
typedef OrtStatus* (*ORT_TYPE_CreateStatus)(OrtErrorCode code, const char* message);
#define ORT_SLOT_CreateCustomOpDomain 26
typedef OrtStatus* (*ORT_TYPE_CreateCustomOpDomain)(const char* domain, OrtCustomOpDomain** out);
#define ORT_SLOT_CustomOpDomain_Add 27
typedef OrtStatus* (*ORT_TYPE_CustomOpDomain_Add)(OrtCustomOpDomain* domain, const OrtCustomOp* op);
#define ORT_SLOT_AddCustomOpDomain 28
typedef OrtStatus* (*ORT_TYPE_AddCustomOpDomain)(OrtSessionOptions* options, OrtCustomOpDomain* domain);
#define ORT_SLOT_GetTensorMutableData 51
typedef OrtStatus* (*ORT_TYPE_GetTensorMutableData)(OrtValue* value, void** out);
#define ORT_SLOT_GetDimensionsCount 61
typedef OrtStatus* (*ORT_TYPE_GetDimensionsCount)(const OrtTensorTypeAndShapeInfo* info, size_t* out);
#define ORT_SLOT_GetDimensions 62
typedef OrtStatus* (*ORT_TYPE_GetDimensions)(const OrtTensorTypeAndShapeInfo* info, int64_t* dims, size_t count);
#define ORT_SLOT_GetTensorTypeAndShape 65
typedef OrtStatus* (*ORT_TYPE_GetTensorTypeAndShape)(const OrtValue* value, OrtTensorTypeAndShapeInfo** out);
#define ORT_SLOT_KernelInfoGetAttribute_float 85
typedef OrtStatus* (*ORT_TYPE_KernelInfoGetAttribute_float)(const OrtKernelInfo* info, const char* name, float* out);
#define ORT_SLOT_KernelInfoGetAttribute_int64 86
typedef OrtStatus* (*ORT_TYPE_KernelInfoGetAttribute_int64)(const OrtKernelInfo* info, const char* name, int64_t* out);
#define ORT_SLOT_KernelContext_GetInput 90
typedef OrtStatus* (*ORT_TYPE_KernelContext_GetInput)(const OrtKernelContext* context, size_t index, const OrtValue** out);
#define ORT_SLOT_KernelContext_GetOutput 91
typedef OrtStatus* (*ORT_TYPE_KernelContext_GetOutput)(OrtKernelContext* context, size_t index, const int64_t* dims,
                                                      size_t count, OrtValue** out);
#define ORT_SLOT_ReleaseStatus 93
typedef void (*ORT_TYPE_ReleaseStatus)(OrtStatus* status);
#define ORT_SLOT_KernelInfoGetAttributeArray_float 162
/* out NULL: *size becomes the attribute's length (ALiBi's slopes, PagedAttention) */
typedef OrtStatus* (*ORT_TYPE_KernelInfoGetAttributeArray_float)(const OrtKernelInfo* info, const char* name, float* out,
                                                                size_t* size);
#define ORT_SLOT_ReleaseTensorTypeAndShapeInfo 99
typedef void (*ORT_TYPE_ReleaseTensorTypeAndShapeInfo)(OrtTensorTypeAndShapeInfo* info);
#define ORT_SLOT_KernelContext_ParallelFor 274
typedef OrtStatus* (*ORT_TYPE_KernelContext_ParallelFor)(const OrtKernelContext* context, void (*fn)(void*, size_t),
                                                        size_t total, size_t num_batch, void* data);

/* ORT_CALL(api, Name)(arguments...): the function in slot ORT_SLOT_Name of the table */
#define ORT_CALL(api, name) ((ORT_TYPE_##name)((void* const*)(api))[ORT_SLOT_##name])

#endif
