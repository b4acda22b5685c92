/* Helpers the custom ops share: statuses, attributes, tensors, and output shape inference. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "ops.h"

const OrtApi *ort_api;

OrtStatus *op_error(const OrtApi *api, OrtErrorCode code, const char *format, ...) {
    char message[512];
    va_list args;
    va_start(args, format);
    vsnprintf(message, sizeof message, format, args);
    va_end(args);
    return api ? api->CreateStatus(code, message) : NULL;
}

const char *op_node_name(const OrtApi *api, const OrtKernelInfo *info, char *buffer, size_t size) {
    size_t length = size;
    OrtStatus *status = api->KernelInfo_GetNodeName(info, buffer, &length);
    if (status) { /* too long or unavailable: no name rather than a failure */
        api->ReleaseStatus(status);
        buffer[0] = '\0';
    }
    return buffer;
}

OrtStatus *op_attr_int(const OrtApi *api, const OrtKernelInfo *info, const char *name, int64_t *out) {
    OrtStatus *status = api->KernelInfoGetAttribute_int64(info, name, out);
    if (!status)
        return NULL;
    api->ReleaseStatus(status);
    char node[128];
    return op_error(api, ORT_INVALID_ARGUMENT, "node '%s' lacks the int attribute '%s'",
                    op_node_name(api, info, node, sizeof node), name);
}

OrtStatus *op_input(const OrtApi *api, OrtKernelContext *context, size_t index, tensor_view *out) {
    const OrtValue *value = NULL;
    OrtStatus *status = api->KernelContext_GetInput(context, index, &value);
    if (status)
        return status;
    OrtTensorTypeAndShapeInfo *info = NULL;
    if ((status = api->GetTensorTypeAndShape(value, &info)))
        return status;
    size_t rank = 0;
    if (!(status = api->GetTensorElementType(info, &out->type)) && !(status = api->GetDimensionsCount(info, &rank))) {
        if (rank > sizeof out->dims / sizeof out->dims[0])
            status = op_error(api, ORT_INVALID_ARGUMENT, "input %zu has rank %zu; at most 8 is supported", index,
                              rank);
        else if (!(status = api->GetDimensions(info, out->dims, rank)))
            status = api->GetTensorShapeElementCount(info, &out->elements);
    }
    api->ReleaseTensorTypeAndShapeInfo(info);
    out->rank = rank;
    if (!status)
        status = api->GetTensorMutableData((OrtValue *)value, &out->data);
    return status;
}

OrtStatus *op_output(const OrtApi *api, OrtKernelContext *context, size_t index, const int64_t *dims, size_t rank,
                     void **data) {
    OrtValue *value = NULL;
    OrtStatus *status = api->KernelContext_GetOutput(context, index, dims, rank, &value);
    if (status)
        return status;
    return api->GetTensorMutableData(value, data);
}

OrtStatus *op_infer_shape(const OrtApi *api, OrtShapeInferContext *context, size_t input, int replace_last,
                          const char *size_attr, ONNXTensorElementDataType type) {
    OrtTensorTypeAndShapeInfo *in = NULL; /* owned by the context */
    OrtStatus *status = api->ShapeInferContext_GetInputTypeShape(context, input, &in);
    if (status)
        return status;
    size_t rank = 0;
    if ((status = api->GetDimensionsCount(in, &rank)))
        return status;
    if (rank > 8 || (replace_last && rank == 0))
        return NULL; /* the kernel reports the error at run time */
    int64_t dims[9];
    const char *names[9] = {0};
    if ((status = api->GetDimensions(in, dims, rank)) || (status = api->GetSymbolicDimensions(in, names, rank)))
        return status;
    const size_t kept = replace_last ? rank - 1 : rank;
    for (size_t i = 0; i < kept; i++)
        if (dims[i] < 0 && (!names[i] || !names[i][0]))
            return NULL; /* a dimension known neither by value nor by name */
    const OrtOpAttr *attr = NULL;
    if ((status = api->ShapeInferContext_GetAttribute(context, size_attr, &attr)))
        return status;
    int64_t size = 0;
    size_t read = 0;
    if ((status = api->ReadOpAttr(attr, ORT_OP_ATTR_INT, &size, sizeof size, &read)))
        return status;
    dims[kept] = size;
    names[kept] = "";
    OrtTensorTypeAndShapeInfo *out = NULL;
    if ((status = api->CreateTensorTypeAndShapeInfo(&out)))
        return status;
    if (!(status = api->SetTensorElementType(out, type)) && !(status = api->SetDimensions(out, dims, kept + 1)) &&
        !(status = api->SetSymbolicDimensions(out, names, kept + 1)))
        status = api->ShapeInferContext_SetOutputTypeShape(context, 0, out);
    api->ReleaseTensorTypeAndShapeInfo(out);
    return status;
}

OrtCustomOpInputOutputCharacteristic op_required(const OrtCustomOp *op, size_t index) {
    (void)op, (void)index;
    return INPUT_OUTPUT_REQUIRED;
}

OrtMemType op_default_memory(const OrtCustomOp *op, size_t index) {
    (void)op, (void)index;
    return OrtMemTypeDefault;
}

int op_one(const OrtCustomOp *op) {
    (void)op;
    return 1;
}

const char *op_cpu_provider(const OrtCustomOp *op) {
    (void)op;
    return "CPUExecutionProvider";
}

size_t op_two(const OrtCustomOp *op) {
    (void)op;
    return 2;
}

size_t op_one_count(const OrtCustomOp *op) {
    (void)op;
    return 1;
}

ONNXTensorElementDataType op_float_output(const OrtCustomOp *op, size_t index) {
    (void)op, (void)index;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
