/* The part of onnxruntime's public C ABI that a custom-op library needs, declared in this project's words.
 *
 * Why our own declarations: onnxruntime's headers may not be committed or fetched at build time (issue 28), and no
 * registry ships them. What a library needs from onnxruntime is a handful of facts that onnxruntime promises to keep:
 *
 *   - `OrtGetApiBase()` (exported by the runtime) returns a two-entry table, `OrtApiBase`, that never changes.
 *   - `OrtApiBase.GetApi(v)` returns the function table `OrtApi` as of API version v, or NULL if the runtime is older
 *     than v. The table only ever grows at its end, so an entry's position (its slot, counted in pointers from the
 *     start) is fixed from the version that introduced it on.
 *   - A custom op is described by an `OrtCustomOp` of callbacks; its `version` field tells the runtime how many of the
 *     callbacks exist, so a struct declared at one version keeps working on every later runtime.
 *
 * Below, every entry this library calls is declared at its slot; entries it does not call are opaque pointer slots,
 * grouped, each group commented with the slots it covers and the API version that introduced them. The
 * _Static_asserts at the end check every named slot's position, and tests/test_kernels_abi.py calls the named entries
 * of the live runtime through the library (edgedecode_kernels_abi_selftest), so a wrong slot fails loudly.
 *
 * All functions use the platform's default C calling convention (onnxruntime's ORT_API_CALL is empty on Linux and
 * macOS, the platforms this library builds on).
 */
#ifndef EDGEDECODE_ORT_ABI_H
#define EDGEDECODE_ORT_ABI_H

#include <stddef.h>
#include <stdint.h>

/* Opaque handles: the runtime owns them; the library only passes the pointers back. */
typedef struct OrtStatus OrtStatus;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtShapeInferContext OrtShapeInferContext;
typedef struct OrtOpAttr OrtOpAttr;

/* Error codes an OrtStatus carries (the runtime's enum values; only the ones used here). */
typedef enum OrtErrorCode {
    ORT_OK = 0,
    ORT_FAIL = 1,
    ORT_INVALID_ARGUMENT = 2,
    ORT_RUNTIME_EXCEPTION = 6,
    ORT_NOT_IMPLEMENTED = 9,
} OrtErrorCode;

/* Tensor element types: the values of ONNX's TensorProto.DataType, which onnxruntime uses as they are. */
typedef enum ONNXTensorElementDataType {
    ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED = 0,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT = 1,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 = 2,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 = 6,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 = 7,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 = 10,
} ONNXTensorElementDataType;

/* Whether a custom op's input or output must be present (API 8 on). */
typedef enum OrtCustomOpInputOutputCharacteristic {
    INPUT_OUTPUT_REQUIRED = 0,
    INPUT_OUTPUT_OPTIONAL = 1,
    INPUT_OUTPUT_VARIADIC = 2,
} OrtCustomOpInputOutputCharacteristic;

/* Where an input lives: the execution provider's default memory, or host memory for a device op's small inputs. */
typedef enum OrtMemType {
    OrtMemTypeCPUInput = -2,
    OrtMemTypeCPUOutput = -1,
    OrtMemTypeDefault = 0,
} OrtMemType;

/* The kind of value ReadOpAttr reads out of a node attribute (API 17). */
typedef enum OrtOpAttrType {
    ORT_OP_ATTR_UNDEFINED = 0,
    ORT_OP_ATTR_INT = 1,
    ORT_OP_ATTR_INTS = 2,
    ORT_OP_ATTR_FLOAT = 3,
    ORT_OP_ATTR_FLOATS = 4,
    ORT_OP_ATTR_STRING = 5,
} OrtOpAttrType;

/* The oldest API version whose table holds every entry named below: KernelContext_ParallelFor, the shape-inference
 * entries and ReadOpAttr arrived in version 17 (onnxruntime 1.17). */
#define EDGEDECODE_ORT_API_VERSION 17u

typedef struct OrtApi OrtApi;

/* The runtime's entry point table; it has had exactly these two entries since version 1 and cannot grow. */
typedef struct OrtApiBase {
    const OrtApi *(*GetApi)(uint32_t version); /* NULL when the runtime does not offer `version` */
    const char *(*GetVersionString)(void);     /* e.g. "1.31.1" */
} OrtApiBase;

struct OrtApi {
    /* slots 0-2 (API 1): status objects, the way every entry reports an error (NULL means success). */
    OrtStatus *(*CreateStatus)(OrtErrorCode code, const char *message);
    OrtErrorCode (*GetErrorCode)(const OrtStatus *status);
    const char *(*GetErrorMessage)(const OrtStatus *status);

    /* slots 3-25 (API 1): environments, sessions, session options (logging, threads, memory). Unused. */
    void *unused_3_25[23];

    /* slots 26-28 (API 1): custom-op domains, attached to a session's options. */
    OrtStatus *(*CreateCustomOpDomain)(const char *domain, OrtCustomOpDomain **out);
    OrtStatus *(*CustomOpDomain_Add)(OrtCustomOpDomain *domain, const void *op); /* op: an OrtCustomOp */
    OrtStatus *(*AddCustomOpDomain)(OrtSessionOptions *options, OrtCustomOpDomain *domain);

    /* slots 29-50 (API 1): library registration, session introspection, run options, tensor creation. Unused. */
    void *unused_29_50[22];

    /* slot 51 (API 1): a tensor's data buffer (also used on inputs: the library never writes through them). */
    OrtStatus *(*GetTensorMutableData)(OrtValue *value, void **out);

    /* slots 52-56 (API 1): string tensors, type-info casts. Unused. */
    void *unused_52_56[5];

    /* slots 57-65 (API 1): tensor element type and shape descriptions. */
    OrtStatus *(*CreateTensorTypeAndShapeInfo)(OrtTensorTypeAndShapeInfo **out);
    OrtStatus *(*SetTensorElementType)(OrtTensorTypeAndShapeInfo *info, ONNXTensorElementDataType type);
    OrtStatus *(*SetDimensions)(OrtTensorTypeAndShapeInfo *info, const int64_t *dims, size_t count);
    OrtStatus *(*GetTensorElementType)(const OrtTensorTypeAndShapeInfo *info, ONNXTensorElementDataType *out);
    OrtStatus *(*GetDimensionsCount)(const OrtTensorTypeAndShapeInfo *info, size_t *out);
    OrtStatus *(*GetDimensions)(const OrtTensorTypeAndShapeInfo *info, int64_t *dims, size_t count);
    OrtStatus *(*GetSymbolicDimensions)(const OrtTensorTypeAndShapeInfo *info, const char **names, size_t count);
    OrtStatus *(*GetTensorShapeElementCount)(const OrtTensorTypeAndShapeInfo *info, size_t *out);
    OrtStatus *(*GetTensorTypeAndShape)(const OrtValue *value, OrtTensorTypeAndShapeInfo **out);

    /* slots 66-84 (API 1): type info, memory info, allocators, maps/sequences. Unused. */
    void *unused_66_84[19];
    /* slot 85 (API 1): a kernel's float attribute (DecodeAttention's scale, the CUDA fused matmul's epsilon). */
    OrtStatus *(*KernelInfoGetAttribute_float)(const OrtKernelInfo *info, const char *name, float *out);

    /* slots 86-91 (API 1): a kernel's integer attributes and its inputs and outputs at compute time. */
    OrtStatus *(*KernelInfoGetAttribute_int64)(const OrtKernelInfo *info, const char *name, int64_t *out);
    void *unused_87; /* KernelInfoGetAttribute_string */
    OrtStatus *(*KernelContext_GetInputCount)(const OrtKernelContext *context, size_t *out);
    OrtStatus *(*KernelContext_GetOutputCount)(const OrtKernelContext *context, size_t *out);
    OrtStatus *(*KernelContext_GetInput)(const OrtKernelContext *context, size_t index, const OrtValue **out);
    OrtStatus *(*KernelContext_GetOutput)(OrtKernelContext *context, size_t index, const int64_t *dims,
                                          size_t count, OrtValue **out);

    /* slot 92 (API 1): ReleaseEnv. Unused. */
    void *unused_92;
    /* slot 93 (API 1) */
    void (*ReleaseStatus)(OrtStatus *status);
    /* slots 94-98 (API 1): releasing memory info, sessions, values, run options, type info. Unused. */
    void *unused_94_98[5];
    /* slot 99 (API 1) */
    void (*ReleaseTensorTypeAndShapeInfo)(OrtTensorTypeAndShapeInfo *info);
    /* slot 100 (API 1): ReleaseSessionOptions. Unused. */
    void *unused_100;
    /* slot 101 (API 1): the last entry of version 1. */
    void (*ReleaseCustomOpDomain)(OrtCustomOpDomain *domain);

    /* slots 102-192: API 2-9 (model metadata, threading, IO binding, providers, arenas, array attributes, sparse
     * tensors) and slot 192 (API 10, HasValue). Unused. */
    void *unused_102_192[91];
    /* slot 193 (API 10): the stream a CUDA op must launch on (the provider's cudaStream_t; NULL on the CPU). */
    OrtStatus *(*KernelContext_GetGPUComputeStream)(const OrtKernelContext *context, void **out);
    /* slots 194-243: API 10-15: provider options, logging setup, KernelInfo input/output queries. Unused. */
    void *unused_194_243[50];
    /* slot 244 (API 15): the node's name, for error messages. */
    OrtStatus *(*KernelInfo_GetNodeName)(const OrtKernelInfo *info, char *out, size_t *size);
    /* slots 245-266: API 15-16 (loggers, constant inputs, allocators, build info, provider options, RunAsync,
     * KernelContext_GetResource) and slot 266 (API 17, SetUserLoggingFunction). Unused. */
    void *unused_245_266[22];

    /* slots 267-274 (API 17): shape inference for custom ops, attribute reading, and the intra-op thread pool. */
    OrtStatus *(*ShapeInferContext_GetInputCount)(const OrtShapeInferContext *context, size_t *out);
    /* the returned info belongs to the context: never released by the caller */
    OrtStatus *(*ShapeInferContext_GetInputTypeShape)(const OrtShapeInferContext *context, size_t index,
                                                      OrtTensorTypeAndShapeInfo **info);
    OrtStatus *(*ShapeInferContext_GetAttribute)(const OrtShapeInferContext *context, const char *name,
                                                 const OrtOpAttr **attr);
    OrtStatus *(*ShapeInferContext_SetOutputTypeShape)(const OrtShapeInferContext *context, size_t index,
                                                       const OrtTensorTypeAndShapeInfo *info);
    OrtStatus *(*SetSymbolicDimensions)(OrtTensorTypeAndShapeInfo *info, const char **names, size_t count);
    OrtStatus *(*ReadOpAttr)(const OrtOpAttr *attr, OrtOpAttrType type, void *data, size_t len, size_t *out);
    void *unused_273; /* SetDeterministicCompute */
    /* Runs fn(user, i) for i in [0, total) on the session's intra-op pool; num_batch 0 lets the pool split. */
    OrtStatus *(*KernelContext_ParallelFor)(const OrtKernelContext *context, void (*fn)(void *user, size_t i),
                                            size_t total, size_t num_batch, void *user);
    /* The table goes on (slot 275 and later, API 17 and newer); nothing past slot 274 is used, so it ends here. */
};

/* A custom op as declared at API version 17: the callbacks the runtime reads for an op of that version. */
typedef struct OrtCustomOp {
    uint32_t version; /* the API version these callbacks follow; EDGEDECODE_ORT_API_VERSION here */

    /* API 1 */
    void *(*CreateKernel)(const struct OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info);
    const char *(*GetName)(const struct OrtCustomOp *op);
    const char *(*GetExecutionProviderType)(const struct OrtCustomOp *op); /* NULL: the CPU provider */
    ONNXTensorElementDataType (*GetInputType)(const struct OrtCustomOp *op, size_t index);
    size_t (*GetInputTypeCount)(const struct OrtCustomOp *op);
    ONNXTensorElementDataType (*GetOutputType)(const struct OrtCustomOp *op, size_t index);
    size_t (*GetOutputTypeCount)(const struct OrtCustomOp *op);
    void (*KernelCompute)(void *kernel, OrtKernelContext *context);
    void (*KernelDestroy)(void *kernel);

    /* API 8 */
    OrtCustomOpInputOutputCharacteristic (*GetInputCharacteristic)(const struct OrtCustomOp *op, size_t index);
    OrtCustomOpInputOutputCharacteristic (*GetOutputCharacteristic)(const struct OrtCustomOp *op, size_t index);

    /* API 13 */
    OrtMemType (*GetInputMemoryType)(const struct OrtCustomOp *op, size_t index);

    /* API 14: variadic inputs and outputs */
    int (*GetVariadicInputMinArity)(const struct OrtCustomOp *op);
    int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp *op);
    int (*GetVariadicOutputMinArity)(const struct OrtCustomOp *op);
    int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp *op);

    /* API 16: kernel creation and compute that report errors as a status (used instead of the API 1 pair) */
    OrtStatus *(*CreateKernelV2)(const struct OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                 void **kernel);
    OrtStatus *(*KernelComputeV2)(void *kernel, OrtKernelContext *context);

    /* API 17: output type and shape inference, and the op's opset range */
    OrtStatus *(*InferOutputShapeFn)(const struct OrtCustomOp *op, OrtShapeInferContext *context);
    int (*GetStartVersion)(const struct OrtCustomOp *op);
    int (*GetEndVersion)(const struct OrtCustomOp *op);

    /* Later versions append in-place and alias hints; a runtime reads them only from ops declaring those versions.
     * Kept zero so the struct's tail is well defined whatever reads it. */
    void *after_version_17[4];
} OrtCustomOp;

/* Every named OrtApi entry sits at the slot onnxruntime gives it (slot = offset / pointer size). */
#define EDGEDECODE_ORT_SLOT(entry) (offsetof(OrtApi, entry) / sizeof(void *))
_Static_assert(EDGEDECODE_ORT_SLOT(CreateStatus) == 0, "OrtApi slot");
_Static_assert(EDGEDECODE_ORT_SLOT(GetErrorMessage) == 2, "OrtApi slot");
_Static_assert(EDGEDECODE_ORT_SLOT(CreateCustomOpDomain) == 26, "OrtApi slot");
_Static_assert(EDGEDECODE_ORT_SLOT(AddCustomOpDomain) == 28, "OrtApi slot");
_Static_assert(EDGEDECODE_ORT_SLOT(GetTensorMutableData) == 51, "OrtApi slot");
_Static_assert(EDGEDECODE_ORT_SLOT(CreateTensorTypeAndShapeInfo) == 57, "OrtApi slot");
_Static_assert(EDGEDECODE_ORT_SLOT(GetTensorTypeAndShape) == 65, "OrtApi slot");
_Static_assert(EDGEDECODE_ORT_SLOT(KernelInfoGetAttribute_float) == 85, "OrtApi slot");
_Static_assert(EDGEDECODE_ORT_SLOT(KernelInfoGetAttribute_int64) == 86, "OrtApi slot");
_Static_assert(EDGEDECODE_ORT_SLOT(KernelContext_GetOutput) == 91, "OrtApi slot");
_Static_assert(EDGEDECODE_ORT_SLOT(ReleaseStatus) == 93, "OrtApi slot");
_Static_assert(EDGEDECODE_ORT_SLOT(ReleaseTensorTypeAndShapeInfo) == 99, "OrtApi slot");
_Static_assert(EDGEDECODE_ORT_SLOT(ReleaseCustomOpDomain) == 101, "OrtApi slot: the end of version 1");
_Static_assert(EDGEDECODE_ORT_SLOT(KernelContext_GetGPUComputeStream) == 193, "OrtApi slot");
_Static_assert(EDGEDECODE_ORT_SLOT(KernelInfo_GetNodeName) == 244, "OrtApi slot");
_Static_assert(EDGEDECODE_ORT_SLOT(ShapeInferContext_GetInputCount) == 267, "OrtApi slot");
_Static_assert(EDGEDECODE_ORT_SLOT(ReadOpAttr) == 272, "OrtApi slot");
_Static_assert(EDGEDECODE_ORT_SLOT(KernelContext_ParallelFor) == 274, "OrtApi slot");
/* The callbacks of OrtCustomOp: 22 pointers after the version field at version 17. */
_Static_assert(offsetof(OrtCustomOp, GetEndVersion) == offsetof(OrtCustomOp, CreateKernel) + 20 * sizeof(void *),
               "OrtCustomOp layout");

#endif
