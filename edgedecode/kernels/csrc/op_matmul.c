/* MatMulGGUF on the CPU: Y[..., N] = A[..., K] . dequant(B)^T, B the matrix's GGUF rows as stored (uint8 [N, row
 * bytes]), read in place: no float copy, no repacked copy.
 *
 * Work is split over N into tasks of whole rows run on onnxruntime's intra-op pool (KernelContext_ParallelFor), so
 * each thread streams its own contiguous rows of B once. At accuracy level 4 the activations are quantized once per
 * call, before the split, into a buffer sized at kernel creation for one row (M = 1, decode: no allocation per call;
 * a second concurrent call on the same kernel, or M > 1, allocates). For M > 1 every task runs all M rows over its
 * rows of B, which stay in cache meanwhile (32 KiB of B a task, in whole multiples of 16 rows: the AVX-512 path
 * packs 16 weight rows at a time for a prompt); the SIMD paths unpack each weight row once for a tile of activation
 * rows. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "ops.h"

/* Task sizes. A decode task streams at least 64 KiB of B (a few microseconds) and, in a big matrix, 1/32 of it, so
 * each thread reads long runs of consecutive rows (the hardware prefetchers restart at every jump) while 32 tasks
 * still balance the threads; a prompt task keeps 32 KiB of B in cache for all M rows. Every matrix is split into at
 * least MIN_TASKS tasks; below INLINE_BYTES of work the whole product runs on the calling thread, where waking the
 * pool costs more than it saves. */
enum {
    TASK_BYTES_DECODE = 64 << 10,
    DECODE_TASKS = 32,
    TASK_BYTES_PROMPT = 32 << 10,
    INLINE_BYTES = 16 << 10,
    MIN_TASKS = 8,
    ROW_MULTIPLE = 4,
    PROMPT_ROW_MULTIPLE = 16, /* the AVX-512 path packs weight rows 16 at a time for many activation rows */
};

typedef struct {
    const OrtApi *api;
    int64_t k, n;
    int qi, accuracy;
    size_t row_bytes;
    const cpu_isa *isa;
    void *scratch; /* one quantized row (accuracy 4) */
    atomic_flag scratch_busy;
    char node[128];
} matmul_kernel;

static OrtStatus *create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    (void)op;
    int64_t k, n, type, accuracy;
    OrtStatus *status;
    if ((status = op_attr_int(api, info, "K", &k)) || (status = op_attr_int(api, info, "N", &n)) ||
        (status = op_attr_int(api, info, "ggml_type", &type)) ||
        (status = op_attr_int(api, info, "accuracy_level", &accuracy)))
        return status;
    char node[128];
    op_node_name(api, info, node, sizeof node);
    int qi;
    const qtype_info *qt = qtype_lookup((int)type, &qi);
    if (!qt)
        return op_error(api, ORT_INVALID_ARGUMENT, "MatMulGGUF '%s': ggml_type %lld is not one of Q4_0 (2), Q4_1 (3), "
                        "Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14)", node, (long long)type);
    if (accuracy != 0 && accuracy != 4)
        return op_error(api, ORT_INVALID_ARGUMENT, "MatMulGGUF '%s': accuracy_level %lld; 0 (float activations) "
                        "and 4 (int8 activations) are supported", node, (long long)accuracy);
    if (k <= 0 || n <= 0 || k % qt->block_elements)
        return op_error(api, ORT_INVALID_ARGUMENT, "MatMulGGUF '%s': K %lld and N %lld must be positive and K a "
                        "multiple of %s's %d-element block", node, (long long)k, (long long)n, qt->name,
                        qt->block_elements);
    matmul_kernel *kernel = calloc(1, sizeof *kernel);
    if (!kernel)
        return op_error(api, ORT_FAIL, "MatMulGGUF '%s': out of memory", node);
    kernel->api = api;
    kernel->k = k;
    kernel->n = n;
    kernel->qi = qi;
    kernel->accuracy = (int)accuracy;
    kernel->row_bytes = (size_t)(k / qt->block_elements) * (size_t)qt->block_bytes;
    kernel->isa = cpu_isa_current();
    atomic_flag_clear(&kernel->scratch_busy);
    memcpy(kernel->node, node, sizeof node);
    if (accuracy == 4 && !(kernel->scratch = aligned_alloc(64, act_q8_bytes((size_t)k)))) {
        free(kernel);
        return op_error(api, ORT_FAIL, "MatMulGGUF '%s': out of memory", node);
    }
    *out = kernel;
    return NULL;
}

static void destroy(void *p) {
    matmul_kernel *kernel = p;
    if (kernel)
        free(kernel->scratch);
    free(kernel);
}

/* One call's work, shared by the tasks. */
typedef struct {
    const matmul_kernel *kernel;
    const float *a;        /* [M, K] (accuracy 0) */
    const act_q8 *quant;   /* [M] rows (accuracy 4) */
    const uint8_t *b;      /* [N, row_bytes] */
    float *y;              /* [M, N] */
    size_t m, rows_per_task;
} matmul_call;

static void run_task(void *user, size_t task) {
    const matmul_call *call = user;
    const matmul_kernel *kernel = call->kernel;
    const size_t n = (size_t)kernel->n, k = (size_t)kernel->k;
    const size_t first = task * call->rows_per_task;
    const size_t rows = first + call->rows_per_task <= n ? call->rows_per_task : n - first;
    const uint8_t *b = call->b + first * kernel->row_bytes;
    if (kernel->accuracy == 4) {
        kernel->isa->gemm_q8[kernel->qi](b, kernel->row_bytes, rows, k, call->quant, call->m, call->y + first, n);
        return;
    }
    for (size_t m = 0; m < call->m; m++)
        kernel->isa->gemv_f32[kernel->qi](b, kernel->row_bytes, rows, k, call->a + m * k, call->y + m * n + first);
}

typedef struct {
    const matmul_kernel *kernel;
    const float *a;
    act_q8 *quant;
} quantize_call;

static void quantize_task(void *user, size_t m) {
    const quantize_call *call = user;
    const size_t k = (size_t)call->kernel->k;
    act_q8_quantize(call->kernel->isa, call->kernel->qi, call->a + m * k, k, &call->quant[m]);
}

static size_t rows_per_task(size_t n, size_t row_bytes, size_t m) {
    if (n * row_bytes * m <= INLINE_BYTES)
        return n;
    size_t rows = (m == 1 ? TASK_BYTES_DECODE : TASK_BYTES_PROMPT) / row_bytes;
    if (m == 1 && rows < n / DECODE_TASKS)
        rows = n / DECODE_TASKS;
    const size_t spread = (n + MIN_TASKS - 1) / MIN_TASKS;
    if (rows > spread)
        rows = spread;
    const size_t multiple = m == 1 ? ROW_MULTIPLE : PROMPT_ROW_MULTIPLE;
    rows = (rows + multiple - 1) / multiple * multiple;
    return rows ? rows : multiple;
}

static OrtStatus *compute(void *p, OrtKernelContext *context) {
    matmul_kernel *kernel = p;
    const OrtApi *api = kernel->api;
    tensor_view a, b;
    OrtStatus *status;
    if ((status = op_input(api, context, 0, &a)) || (status = op_input(api, context, 1, &b)))
        return status;
    if (a.rank < 1 || a.dims[a.rank - 1] != kernel->k)
        return op_error(api, ORT_INVALID_ARGUMENT, "MatMulGGUF '%s': A's last dimension must be K = %lld",
                        kernel->node, (long long)kernel->k);
    if (b.rank != 2 || b.dims[0] != kernel->n || (size_t)b.dims[1] != kernel->row_bytes)
        return op_error(api, ORT_INVALID_ARGUMENT, "MatMulGGUF '%s': B must be uint8 [N, row bytes] = [%lld, %zu]",
                        kernel->node, (long long)kernel->n, kernel->row_bytes);
    int64_t dims[8];
    memcpy(dims, a.dims, sizeof dims);
    dims[a.rank - 1] = kernel->n;
    float *y;
    if ((status = op_output(api, context, 0, dims, a.rank, (void **)&y)))
        return status;
    const size_t m = a.elements / (size_t)kernel->k, n = (size_t)kernel->n, k = (size_t)kernel->k;
    if (m == 0)
        return NULL;

    matmul_call call = {kernel, a.data, NULL, b.data, y, m, rows_per_task(n, kernel->row_bytes, m)};
    act_q8 one;
    act_q8 *quant = &one;
    void *memory = NULL;
    int holds_scratch = 0;
    if (kernel->accuracy == 4) {
        const size_t row_bytes = act_q8_bytes(k);
        if (m == 1 && !atomic_flag_test_and_set(&kernel->scratch_busy)) {
            holds_scratch = 1;
            act_q8_bind(&one, kernel->scratch, k);
        } else {
            memory = aligned_alloc(64, (m * row_bytes + m * sizeof(act_q8) + 63) / 64 * 64);
            if (!memory)
                return op_error(api, ORT_FAIL, "MatMulGGUF '%s': out of memory for %zu rows", kernel->node, m);
            quant = (act_q8 *)((uint8_t *)memory + m * row_bytes);
            for (size_t i = 0; i < m; i++)
                act_q8_bind(&quant[i], (uint8_t *)memory + i * row_bytes, k);
        }
        if (m == 1) {
            act_q8_quantize(kernel->isa, kernel->qi, a.data, k, quant);
        } else {
            quantize_call qcall = {kernel, a.data, quant};
            status = api->KernelContext_ParallelFor(context, quantize_task, m, 0, &qcall);
        }
        call.quant = quant;
    }
    const size_t tasks = (n + call.rows_per_task - 1) / call.rows_per_task;
    if (!status && tasks == 1)
        run_task(&call, 0);
    else if (!status)
        status = api->KernelContext_ParallelFor(context, run_task, tasks, 0, &call);
    if (holds_scratch)
        atomic_flag_clear(&kernel->scratch_busy);
    free(memory);
    return status;
}

static const char *name(const OrtCustomOp *op) { (void)op; return "MatMulGGUF"; }
static ONNXTensorElementDataType input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
}
static OrtStatus *infer(const OrtCustomOp *op, OrtShapeInferContext *context) {
    (void)op;
    return op_infer_shape(ort_api, context, 0, 1, "N", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
}

OrtCustomOp op_matmul_gguf_cpu = {
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
