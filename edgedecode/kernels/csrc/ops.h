/* What the custom ops share: the OrtApi table in use, status helpers, attribute reading, and the op descriptors
 * register.c adds to the domain. */
#ifndef EDGEDECODE_OPS_H
#define EDGEDECODE_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "ort_abi.h"

#define KERNEL_DOMAIN "com.edgedecode"

/* A status with a printf-style message, created through `api` (NULL `api`: none can be made; returns NULL). */
OrtStatus *op_error(const OrtApi *api, OrtErrorCode code, const char *format, ...)
    __attribute__((format(printf, 3, 4)));

/* An int64 attribute, or a status naming the node and the attribute when it is missing. */
OrtStatus *op_attr_int(const OrtApi *api, const OrtKernelInfo *info, const char *name, int64_t *out);

/* The node's name (for messages), "" when unknown; `buffer` of `size` bytes. */
const char *op_node_name(const OrtApi *api, const OrtKernelInfo *info, char *buffer, size_t size);

/* A tensor input's element type, dimensions (up to `max_dims`) and data. */
typedef struct {
    ONNXTensorElementDataType type;
    size_t rank;
    int64_t dims[8];
    size_t elements;
    void *data;
} tensor_view;

OrtStatus *op_input(const OrtApi *api, OrtKernelContext *context, size_t index, tensor_view *out);
/* An output of the given dimensions; *data receives its buffer. */
OrtStatus *op_output(const OrtApi *api, OrtKernelContext *context, size_t index, const int64_t *dims, size_t rank,
                     void **data);

/* Shape inference for ops whose output is one input's shape with its last dimension replaced (MatMulGGUF: A's
 * leading dims + N) or extended (GatherGGUF: ids' dims + K). A dimension onnxruntime knows neither by value nor by
 * name leaves the output's shape unset (its type still comes from the kernel's declaration). */
OrtStatus *op_infer_shape(const OrtApi *api, OrtShapeInferContext *context, size_t input, int replace_last,
                          const char *size_attr, ONNXTensorElementDataType type);

/* Callbacks every op here answers alike: two inputs, one float output, all required and in the provider's memory,
 * nothing variadic, opset 1 on. */
OrtCustomOpInputOutputCharacteristic op_required(const OrtCustomOp *op, size_t index);
OrtMemType op_default_memory(const OrtCustomOp *op, size_t index);
int op_one(const OrtCustomOp *op);
const char *op_cpu_provider(const OrtCustomOp *op);
size_t op_two(const OrtCustomOp *op);       /* input count of both ops */
size_t op_one_count(const OrtCustomOp *op); /* output count of both ops */
ONNXTensorElementDataType op_float_output(const OrtCustomOp *op, size_t index);
#define OP_PLAIN_CALLBACKS                                                                                           \
    .GetInputCharacteristic = op_required, .GetOutputCharacteristic = op_required,                                  \
    .GetInputMemoryType = op_default_memory, .GetVariadicInputMinArity = op_one,                                    \
    .GetVariadicInputHomogeneity = op_one, .GetVariadicOutputMinArity = op_one,                                     \
    .GetVariadicOutputHomogeneity = op_one, .GetStartVersion = op_one, .GetEndVersion = NULL

extern OrtCustomOp op_matmul_gguf_cpu;
extern OrtCustomOp op_gather_gguf_cpu;
extern OrtCustomOp op_decode_attention_cpu;

/* The table register.c obtained; the ops call through it. */
extern const OrtApi *ort_api;

#endif
