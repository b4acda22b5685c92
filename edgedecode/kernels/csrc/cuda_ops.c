/* The CUDA ops. Each kernel object holds its node's attributes and the kernels' module of the session's CUDA
 * context (loaded at creation, so nothing is loaded while onnxruntime captures a run into a CUDA graph); Compute
 * reads its tensors, plans the launch (arithmetic only) and launches one kernel on onnxruntime's compute stream:
 * no allocation, no synchronization, no host copy, so the step can be captured and replayed.
 *
 * FusedMatMulGGUF, in the contract's form:
 *   inputs   A float16 [..., K]; B0 uint8 [N0, row bytes]; B1, B2 (optional) uint8 [N1|N2, row bytes];
 *            norm_weight (optional) float16 [K]; residual (optional) float16 [..., N]; bias (optional) float16 [N]
 *   attrs    K, N (the output width), N0, ggml_type0, N1, ggml_type1, N2, ggml_type2 (0 / absent: no such matrix),
 *            activation (0 none, 1 SiLU, 2 GELU tanh form), epsilon (float, default 1e-6)
 *   output   float16 [..., N]:
 *            a = norm_weight ? A / sqrt(mean(A^2) + epsilon) * norm_weight : A     (per row of A, float32)
 *            activation 0: Y = concat(a . dequant(B0)^T, a . dequant(B1)^T, a . dequant(B2)^T)   N = N0 + N1 + N2
 *            activation 1, 2: Y = act(a . dequant(B0)^T) * (a . dequant(B1)^T)   B0, B1 of one type, N = N0 = N1
 *            plus bias (activation 0 only), then residual, when given. */
#include "cuda_ops.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_driver.h"

typedef struct {
    const OrtApi *api;
    const EdCudaModule *module;
    EdTuning tuning;
    int fused;
    int k, segments, gate, n_out;
    int n[ED_MAX_SEGMENTS], type[ED_MAX_SEGMENTS], row_bytes[ED_MAX_SEGMENTS];
    float eps;
    char node[128];
} gemv_kernel;

typedef struct {
    const OrtApi *api;
    const EdCudaModule *module;
    int k, type, row_bytes;
    char node[128];
} gather_kernel;

static const char *CUDA_PROVIDER = "CUDAExecutionProvider";
static const char *TYPE_NAMES = "Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14)";

/* An int attribute, or `otherwise` when the node lacks it. */
static int64_t attr_int_or(const OrtApi *api, const OrtKernelInfo *info, const char *name, int64_t otherwise) {
    int64_t value;
    OrtStatus *status = api->KernelInfoGetAttribute_int64(info, name, &value);
    if (!status)
        return value;
    api->ReleaseStatus(status);
    return otherwise;
}

static OrtStatus *module_for(const OrtApi *api, const char *op, const char *node, const EdCudaModule **out) {
    char why[384];
    if (ed_cuda_module(out, why, sizeof why))
        return op_error(api, ORT_FAIL, "%s '%s': %s", op, node, why);
    return NULL;
}

static OrtStatus *check_matrix(const OrtApi *api, const char *node, int index, int64_t k, int64_t n, int64_t type,
                               int *row_bytes) {
    const int elems = ed_block_elems((int)type);
    if (!elems)
        return op_error(api, ORT_INVALID_ARGUMENT, "'%s': ggml_type%d %lld is not one of %s", node, index,
                        (long long)type, TYPE_NAMES);
    if (k <= 0 || n <= 0 || k % elems || k > (1 << 24) || n > (1 << 30))
        return op_error(api, ORT_INVALID_ARGUMENT,
                        "'%s': K %lld and N%d %lld must be positive and K a multiple of the %d-element block", node,
                        (long long)k, index, (long long)n, elems);
    *row_bytes = (int)(k / elems) * ed_block_bytes((int)type);
    return NULL;
}

static OrtStatus *create_matmul(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    (void)op;
    gemv_kernel kernel = {.api = api, .segments = 1, .eps = 1e-6f};
    op_node_name(api, info, kernel.node, sizeof kernel.node);
    int64_t k, n, type, accuracy;
    OrtStatus *status;
    if ((status = op_attr_int(api, info, "K", &k)) || (status = op_attr_int(api, info, "N", &n)) ||
        (status = op_attr_int(api, info, "ggml_type", &type)))
        return status;
    accuracy = attr_int_or(api, info, "accuracy_level", 0);
    if (accuracy != 0)
        return op_error(api, ORT_INVALID_ARGUMENT,
                        "MatMulGGUF '%s': accuracy_level %lld; the CUDA op computes with float activations "
                        "(accuracy_level 0)", kernel.node, (long long)accuracy);
    if ((status = check_matrix(api, kernel.node, 0, k, n, type, &kernel.row_bytes[0])))
        return status;
    kernel.k = (int)k, kernel.n[0] = kernel.n_out = (int)n, kernel.type[0] = (int)type;
    kernel.tuning = ed_cuda_tuning();
    if ((status = module_for(api, "MatMulGGUF", kernel.node, &kernel.module)))
        return status;
    gemv_kernel *copy = malloc(sizeof kernel);
    if (!copy)
        return op_error(api, ORT_FAIL, "MatMulGGUF '%s': out of memory", kernel.node);
    *copy = kernel;
    *out = copy;
    return NULL;
}

static OrtStatus *create_fused(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    (void)op;
    gemv_kernel kernel = {.api = api, .fused = 1};
    op_node_name(api, info, kernel.node, sizeof kernel.node);
    int64_t k, n, n0, type0;
    OrtStatus *status;
    if ((status = op_attr_int(api, info, "K", &k)) || (status = op_attr_int(api, info, "N", &n)) ||
        (status = op_attr_int(api, info, "N0", &n0)) || (status = op_attr_int(api, info, "ggml_type0", &type0)))
        return status;
    const int64_t dims[ED_MAX_SEGMENTS] = {n0, attr_int_or(api, info, "N1", 0), attr_int_or(api, info, "N2", 0)};
    const int64_t types[ED_MAX_SEGMENTS] = {type0, attr_int_or(api, info, "ggml_type1", 0),
                                            attr_int_or(api, info, "ggml_type2", 0)};
    const int64_t gate = attr_int_or(api, info, "activation", 0);
    float eps = 1e-6f;
    if ((status = api->KernelInfoGetAttribute_float(info, "epsilon", &eps)))
        api->ReleaseStatus(status), eps = 1e-6f;
    kernel.k = (int)k, kernel.eps = eps, kernel.gate = (int)gate;
    int64_t total = 0;
    for (int s = 0; s < ED_MAX_SEGMENTS && dims[s] > 0; s++) {
        if ((status = check_matrix(api, kernel.node, s, k, dims[s], types[s], &kernel.row_bytes[s])))
            return status;
        kernel.n[s] = (int)dims[s], kernel.type[s] = (int)types[s], kernel.segments = s + 1;
        total += dims[s];
    }
    if (gate < 0 || gate > ED_GATE_GELU_TANH)
        return op_error(api, ORT_INVALID_ARGUMENT, "FusedMatMulGGUF '%s': activation %lld; 0 (none), 1 (SiLU) or 2 "
                        "(GELU, tanh form)", kernel.node, (long long)gate);
    if (gate && (kernel.segments != 2 || kernel.n[0] != kernel.n[1] || kernel.type[0] != kernel.type[1]))
        return op_error(api, ORT_INVALID_ARGUMENT, "FusedMatMulGGUF '%s': a gated product needs B0 and B1 of one "
                        "type and N0 = N1 (and no B2)", kernel.node);
    kernel.n_out = gate ? kernel.n[0] : (int)total;
    if (n != kernel.n_out)
        return op_error(api, ORT_INVALID_ARGUMENT, "FusedMatMulGGUF '%s': N %lld; the matrices give %d", kernel.node,
                        (long long)n, kernel.n_out);
    kernel.tuning = ed_cuda_tuning();
    if ((status = module_for(api, "FusedMatMulGGUF", kernel.node, &kernel.module)))
        return status;
    gemv_kernel *copy = malloc(sizeof kernel);
    if (!copy)
        return op_error(api, ORT_FAIL, "FusedMatMulGGUF '%s': out of memory", kernel.node);
    *copy = kernel;
    *out = copy;
    return NULL;
}

/* Input `index` if the node has it (an omitted optional input leaves *present 0). */
static OrtStatus *optional_input(const OrtApi *api, OrtKernelContext *context, size_t index, tensor_view *view,
                                 int *present) {
    size_t count = 0;
    const OrtValue *value = NULL;
    OrtStatus *status = api->KernelContext_GetInputCount(context, &count);
    if (!status && index < count)
        status = api->KernelContext_GetInput(context, index, &value);
    *present = !status && value;
    return status || !value ? status : op_input(api, context, index, view);
}

static OrtStatus *launch(const OrtApi *api, const EdCudaModule *module, const EdLaunch *plan, void *args,
                         OrtKernelContext *context, const char *op, const char *node) {
    void *stream = NULL;
    OrtStatus *status = api->KernelContext_GetGPUComputeStream(context, &stream);
    if (status)
        return status;
    char why[256];
    if (ed_cuda_launch(module, plan, args, (CUstream)stream, why, sizeof why))
        return op_error(api, ORT_RUNTIME_EXCEPTION, "%s '%s': %s", op, node, why);
    return NULL;
}

static OrtStatus *compute_gemv(void *p, OrtKernelContext *context) {
    const gemv_kernel *kernel = p;
    const OrtApi *api = kernel->api;
    const char *op = kernel->fused ? "FusedMatMulGGUF" : "MatMulGGUF";
    tensor_view a, w, gamma, residual, bias;
    int has_gamma = 0, has_residual = 0, has_bias = 0;
    OrtStatus *status = op_input(api, context, 0, &a);
    if (status)
        return status;
    if (a.rank < 1 || a.dims[a.rank - 1] != kernel->k)
        return op_error(api, ORT_INVALID_ARGUMENT, "%s '%s': A's last dimension must be K = %d", op, kernel->node,
                        kernel->k);
    EdGemvArgs args;
    memset(&args, 0, sizeof args);
    for (int s = 0; s < kernel->segments; s++) {
        int present = 1;
        if ((status = optional_input(api, context, (size_t)(1 + s), &w, &present)))
            return status;
        if (!present || w.rank != 2 || w.dims[0] != kernel->n[s] || w.dims[1] != kernel->row_bytes[s])
            return op_error(api, ORT_INVALID_ARGUMENT, "%s '%s': B%d must be uint8 [%d, %d]", op, kernel->node, s,
                            kernel->n[s], kernel->row_bytes[s]);
        args.w[s] = w.data;
        args.rows[s] = kernel->n[s], args.type[s] = kernel->type[s], args.row_bytes[s] = kernel->row_bytes[s];
    }
    int64_t dims[8];
    memcpy(dims, a.dims, sizeof dims);
    dims[a.rank - 1] = kernel->n_out;
    if (kernel->fused) {
        if ((status = optional_input(api, context, 4, &gamma, &has_gamma)) ||
            (status = optional_input(api, context, 5, &residual, &has_residual)) ||
            (status = optional_input(api, context, 6, &bias, &has_bias)))
            return status;
        if (has_bias && (kernel->gate || bias.elements != (size_t)kernel->n_out))
            return op_error(api, ORT_INVALID_ARGUMENT, "FusedMatMulGGUF '%s': bias must hold N = %d values (and "
                            "the product not be gated)", kernel->node, kernel->n_out);
        if (has_gamma && (gamma.elements != (size_t)kernel->k))
            return op_error(api, ORT_INVALID_ARGUMENT, "FusedMatMulGGUF '%s': norm_weight must hold K = %d values",
                            kernel->node, kernel->k);
        if (has_residual && (residual.rank != a.rank || memcmp(residual.dims, dims, a.rank * sizeof dims[0])))
            return op_error(api, ORT_INVALID_ARGUMENT, "FusedMatMulGGUF '%s': residual must have the output's shape",
                            kernel->node);
    }
    if ((status = op_output(api, context, 0, dims, a.rank, &args.y)))
        return status;
    const size_t m = a.elements / (size_t)kernel->k;
    if (m == 0)
        return NULL;
    if (m > (1u << 30))
        return op_error(api, ORT_INVALID_ARGUMENT, "%s '%s': %zu rows of A", op, kernel->node, m);
    args.x = a.data;
    args.gamma = has_gamma ? gamma.data : NULL;
    args.residual = has_residual ? residual.data : NULL;
    args.bias = has_bias ? bias.data : NULL;
    args.k = kernel->k, args.m = (int)m, args.gate = kernel->gate, args.eps = kernel->eps;
    EdLaunch plan;
    if (ed_plan_gemv(&args, kernel->segments, kernel->gate != 0, &kernel->tuning, kernel->module->sm_count,
                     kernel->module->max_shared, &plan))
        return op_error(api, ORT_INVALID_ARGUMENT, "%s '%s': no launch fits K %d with %zu rows (shared memory)", op,
                        kernel->node, kernel->k, m);
    return launch(api, kernel->module, &plan, &args, context, op, kernel->node);
}

static void destroy(void *kernel) { free(kernel); }

static OrtStatus *create_gather(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    (void)op;
    gather_kernel kernel = {.api = api};
    op_node_name(api, info, kernel.node, sizeof kernel.node);
    int64_t k, type, dtype;
    OrtStatus *status;
    if ((status = op_attr_int(api, info, "K", &k)) || (status = op_attr_int(api, info, "ggml_type", &type)))
        return status;
    dtype = attr_int_or(api, info, "dtype", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16);
    if (dtype != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
        return op_error(api, ORT_INVALID_ARGUMENT, "GatherGGUF '%s': dtype %lld; the CUDA op writes float16 (10)",
                        kernel.node, (long long)dtype);
    if ((status = check_matrix(api, kernel.node, 0, k, 1, type, &kernel.row_bytes)))
        return status;
    kernel.k = (int)k, kernel.type = (int)type;
    if ((status = module_for(api, "GatherGGUF", kernel.node, &kernel.module)))
        return status;
    gather_kernel *copy = malloc(sizeof kernel);
    if (!copy)
        return op_error(api, ORT_FAIL, "GatherGGUF '%s': out of memory", kernel.node);
    *copy = kernel;
    *out = copy;
    return NULL;
}

static OrtStatus *compute_gather(void *p, OrtKernelContext *context) {
    const gather_kernel *kernel = p;
    const OrtApi *api = kernel->api;
    tensor_view table, ids;
    OrtStatus *status;
    if ((status = op_input(api, context, 0, &table)) || (status = op_input(api, context, 1, &ids)))
        return status;
    if (table.rank != 2 || table.dims[1] != kernel->row_bytes || table.dims[0] > (1 << 30))
        return op_error(api, ORT_INVALID_ARGUMENT, "GatherGGUF '%s': the table must be uint8 [V, %d]", kernel->node,
                        kernel->row_bytes);
    if (ids.rank >= 8)
        return op_error(api, ORT_INVALID_ARGUMENT, "GatherGGUF '%s': ids of rank %zu; at most 7", kernel->node,
                        ids.rank);
    int64_t dims[8];
    memcpy(dims, ids.dims, ids.rank * sizeof dims[0]);
    dims[ids.rank] = kernel->k;
    EdGatherArgs args;
    memset(&args, 0, sizeof args);
    if ((status = op_output(api, context, 0, dims, ids.rank + 1, &args.y)))
        return status;
    if (ids.elements == 0)
        return NULL;
    args.table = table.data, args.ids = ids.data, args.count = (long long)ids.elements;
    args.vocab = (int)table.dims[0], args.row_bytes = kernel->row_bytes, args.k = kernel->k, args.type = kernel->type;
    EdLaunch plan;
    ed_plan_gather(&args, kernel->module->sm_count, &plan);
    return launch(api, kernel->module, &plan, &args, context, "GatherGGUF", kernel->node);
}

/* Shape inference. One schema serves every kernel of an op name (onnxruntime builds it from the first op
 * registered under the name), so the output's element type follows the node, not the provider: MatMulGGUF's is
 * A's, GatherGGUF's its dtype attribute. register.c adds these ops before the CPU ones. */
static ONNXTensorElementDataType input_element_type(OrtShapeInferContext *context, size_t index) {
    OrtTensorTypeAndShapeInfo *info = NULL; /* owned by the context */
    ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    OrtStatus *status = ort_api->ShapeInferContext_GetInputTypeShape(context, index, &info);
    if (!status)
        status = ort_api->GetTensorElementType(info, &type);
    if (status)
        ort_api->ReleaseStatus(status);
    return type;
}

static OrtStatus *infer_matmul(const OrtCustomOp *op, OrtShapeInferContext *context) {
    (void)op;
    return op_infer_shape(ort_api, context, 0, 1, "N", input_element_type(context, 0));
}

static OrtStatus *infer_gather(const OrtCustomOp *op, OrtShapeInferContext *context) {
    (void)op;
    const OrtOpAttr *attr = NULL;
    int64_t dtype = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    size_t read = 0;
    OrtStatus *status = ort_api->ShapeInferContext_GetAttribute(context, "dtype", &attr);
    if (!status && attr)
        status = ort_api->ReadOpAttr(attr, ORT_OP_ATTR_INT, &dtype, sizeof dtype, &read);
    if (status)
        ort_api->ReleaseStatus(status), dtype = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    return op_infer_shape(ort_api, context, 1, 0, "K", (ONNXTensorElementDataType)dtype);
}

static OrtStatus *infer_fused(const OrtCustomOp *op, OrtShapeInferContext *context) {
    (void)op;
    return op_infer_shape(ort_api, context, 0, 1, "N", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16);
}

static const char *cuda_provider(const OrtCustomOp *op) {
    (void)op;
    return CUDA_PROVIDER;
}
static ONNXTensorElementDataType half_output(const OrtCustomOp *op, size_t index) {
    (void)op, (void)index;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
}
static const char *matmul_name(const OrtCustomOp *op) { (void)op; return "MatMulGGUF"; }
static const char *gather_name(const OrtCustomOp *op) { (void)op; return "GatherGGUF"; }
static const char *fused_name(const OrtCustomOp *op) { (void)op; return "FusedMatMulGGUF"; }
static ONNXTensorElementDataType matmul_input(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
}
static ONNXTensorElementDataType gather_input(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
}
static ONNXTensorElementDataType fused_input(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i >= 1 && i <= 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
}
static size_t seven(const OrtCustomOp *op) { (void)op; return 7; }
static OrtCustomOpInputOutputCharacteristic fused_characteristic(const OrtCustomOp *op, size_t index) {
    (void)op;
    return index <= 1 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
}

OrtCustomOp op_matmul_gguf_cuda = {
    .version = EDGEDECODE_ORT_API_VERSION,
    .GetName = matmul_name,
    .GetExecutionProviderType = cuda_provider,
    .GetInputType = matmul_input,
    .GetInputTypeCount = op_two,
    .GetOutputType = half_output,
    .GetOutputTypeCount = op_one_count,
    .KernelDestroy = destroy,
    OP_PLAIN_CALLBACKS,
    .CreateKernelV2 = create_matmul,
    .KernelComputeV2 = compute_gemv,
    .InferOutputShapeFn = infer_matmul,
};

OrtCustomOp op_gather_gguf_cuda = {
    .version = EDGEDECODE_ORT_API_VERSION,
    .GetName = gather_name,
    .GetExecutionProviderType = cuda_provider,
    .GetInputType = gather_input,
    .GetInputTypeCount = op_two,
    .GetOutputType = half_output,
    .GetOutputTypeCount = op_one_count,
    .KernelDestroy = destroy,
    OP_PLAIN_CALLBACKS,
    .CreateKernelV2 = create_gather,
    .KernelComputeV2 = compute_gather,
    .InferOutputShapeFn = infer_gather,
};

OrtCustomOp op_fused_matmul_gguf_cuda = {
    .version = EDGEDECODE_ORT_API_VERSION,
    .GetName = fused_name,
    .GetExecutionProviderType = cuda_provider,
    .GetInputType = fused_input,
    .GetInputTypeCount = seven,
    .GetOutputType = half_output,
    .GetOutputTypeCount = op_one_count,
    .KernelDestroy = destroy,
    OP_PLAIN_CALLBACKS,
    .GetInputCharacteristic = fused_characteristic,
    .CreateKernelV2 = create_fused,
    .KernelComputeV2 = compute_gemv,
    .InferOutputShapeFn = infer_fused,
};
