/* GatherGGUF on the CPU: out[..., K] = dequant(table[ids[...]]), the embedding rows of a GGUF table read in place
 * (the same bytes a tied LM head's MatMulGGUF reads). An id outside [0, V) fails the call with a status naming it.
 *
 * The CPU kernel writes float32 (dtype 1). onnxruntime infers a custom op's output type from the first kernel
 * declaration whose input types match, and both inputs (uint8 table, int64 ids) are the same whatever the dtype, so
 * one op name cannot offer two output types; a float16 gather belongs to a device op whose graph asks for it. */
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "ops.h"

typedef struct {
    const OrtApi *api;
    int64_t k;
    int qi;
    size_t row_bytes;
    const cpu_isa *isa;
    char node[128];
} gather_kernel;

static OrtStatus *create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    (void)op;
    int64_t k, type, dtype;
    OrtStatus *status;
    if ((status = op_attr_int(api, info, "K", &k)) || (status = op_attr_int(api, info, "ggml_type", &type)) ||
        (status = op_attr_int(api, info, "dtype", &dtype)))
        return status;
    char node[128];
    op_node_name(api, info, node, sizeof node);
    int qi;
    const qtype_info *qt = qtype_lookup((int)type, &qi);
    if (!qt)
        return op_error(api, ORT_INVALID_ARGUMENT, "GatherGGUF '%s': ggml_type %lld is not a type this library reads",
                        node, (long long)type);
    if (dtype != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
        return op_error(api, ORT_INVALID_ARGUMENT, "GatherGGUF '%s': dtype %lld; the CPU kernel writes float32 (1)",
                        node, (long long)dtype);
    if (k <= 0 || k % qt->block_elements)
        return op_error(api, ORT_INVALID_ARGUMENT, "GatherGGUF '%s': K %lld must be a positive multiple of %s's "
                        "%d-element block", node, (long long)k, qt->name, qt->block_elements);
    gather_kernel *kernel = calloc(1, sizeof *kernel);
    if (!kernel)
        return op_error(api, ORT_FAIL, "GatherGGUF '%s': out of memory", node);
    *kernel = (gather_kernel){api, k, qi, (size_t)(k / qt->block_elements) * (size_t)qt->block_bytes,
                              cpu_isa_current(), {0}};
    memcpy(kernel->node, node, sizeof node);
    *out = kernel;
    return NULL;
}

static void destroy(void *kernel) { free(kernel); }

static OrtStatus *compute(void *p, OrtKernelContext *context) {
    const gather_kernel *kernel = p;
    const OrtApi *api = kernel->api;
    tensor_view table, ids;
    OrtStatus *status;
    if ((status = op_input(api, context, 0, &table)) || (status = op_input(api, context, 1, &ids)))
        return status;
    if (table.rank != 2 || (size_t)table.dims[1] != kernel->row_bytes)
        return op_error(api, ORT_INVALID_ARGUMENT, "GatherGGUF '%s': the table must be uint8 [V, %zu]", kernel->node,
                        kernel->row_bytes);
    if (ids.rank >= 8)
        return op_error(api, ORT_INVALID_ARGUMENT, "GatherGGUF '%s': ids of rank %zu; at most 7", kernel->node,
                        ids.rank);
    const int64_t vocab = table.dims[0];
    const int64_t *id = ids.data;
    for (size_t i = 0; i < ids.elements; i++)
        if (id[i] < 0 || id[i] >= vocab)
            return op_error(api, ORT_INVALID_ARGUMENT, "GatherGGUF '%s': id %lld at position %zu is outside [0, %lld)",
                            kernel->node, (long long)id[i], i, (long long)vocab);
    int64_t dims[8];
    memcpy(dims, ids.dims, ids.rank * sizeof dims[0]);
    dims[ids.rank] = kernel->k;
    float *out;
    if ((status = op_output(api, context, 0, dims, ids.rank + 1, (void **)&out)))
        return status;
    const uint8_t *rows = table.data;
    for (size_t i = 0; i < ids.elements; i++)
        kernel->isa->dequant[kernel->qi](rows + (size_t)id[i] * kernel->row_bytes, (size_t)kernel->k,
                                         out + i * (size_t)kernel->k);
    return NULL;
}

static const char *name(const OrtCustomOp *op) { (void)op; return "GatherGGUF"; }
static ONNXTensorElementDataType input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
}
static OrtStatus *infer(const OrtCustomOp *op, OrtShapeInferContext *context) {
    (void)op;
    return op_infer_shape(ort_api, context, 1, 0, "K", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
}

OrtCustomOp op_gather_gguf_cpu = {
    .version = EDGEDECODE_ORT_API_VERSION,
    .GetName = name,
    .GetExecutionProviderType = op_cpu_provider,
    .GetInputType = input_type,
    .GetInputTypeCount = op_two,
    .GetOutputType = op_float_output,
    .GetOutputTypeCount = op_one_count,
    .KernelDestroy = destroy,
    OP_PLAIN_CALLBACKS,
    .CreateKernelV2 = create,
    .KernelComputeV2 = compute,
    .InferOutputShapeFn = infer,
};
