/* Introspection and direct kernel entry points (exports.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "exports.h"

int edgedecode_kernels_version(void) { return EDGEDECODE_KERNELS_ABI; }
uint32_t edgedecode_kernels_required_api(void) { return EDGEDECODE_ORT_API_VERSION; }
int edgedecode_kernels_cuda_built(void) { return 1; } /* cuda_*.c: gcc-built, the driver found at run time */
const char *edgedecode_kernels_cpu_isa(void) { return cpu_isa_current()->name; }
int edgedecode_kernels_set_cpu_isa(const char *name) { return cpu_isa_force(name); }

const char *edgedecode_kernels_cpu_isas(void) {
    static char list[128];
    if (!list[0]) {
        const cpu_isa *const *all = cpu_isa_all();
        for (int i = 0; all[i]; i++)
            if (all[i]->usable()) {
                if (list[0])
                    strcat(list, ",");
                strcat(list, all[i]->name);
            }
    }
    return list;
}

static int fail(char *message, size_t size, const char *what) {
    snprintf(message, size, "%s", what);
    return -1;
}

int edgedecode_kernels_abi_selftest(const OrtApiBase *base, char *message, size_t size) {
    const OrtApi *api = base->GetApi(EDGEDECODE_ORT_API_VERSION);
    if (!api)
        return fail(message, size, "GetApi returned no table for the required version");
    /* statuses: CreateStatus (0), GetErrorCode (1), GetErrorMessage (2), ReleaseStatus (93) */
    OrtStatus *status = api->CreateStatus(ORT_NOT_IMPLEMENTED, "edgedecode selftest");
    if (!status || api->GetErrorCode(status) != ORT_NOT_IMPLEMENTED ||
        strcmp(api->GetErrorMessage(status), "edgedecode selftest") != 0)
        return fail(message, size, "CreateStatus / GetErrorCode / GetErrorMessage disagree");
    api->ReleaseStatus(status);
    /* type-and-shape descriptions: slots 57-64, 99, and SetSymbolicDimensions (271) */
    OrtTensorTypeAndShapeInfo *info = NULL;
    if ((status = api->CreateTensorTypeAndShapeInfo(&info)))
        return fail(message, size, "CreateTensorTypeAndShapeInfo failed");
    const int64_t dims[3] = {2, -1, 7};
    const char *names[3] = {"", "sequence", ""};
    ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    size_t count = 0, elements = 1;
    int64_t got[3] = {0};
    const char *got_names[3] = {0};
    int ok = !api->SetTensorElementType(info, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) &&
             !api->SetDimensions(info, dims, 3) && !api->SetSymbolicDimensions(info, names, 3) &&
             !api->GetTensorElementType(info, &type) && !api->GetDimensionsCount(info, &count) &&
             !api->GetDimensions(info, got, 3) && !api->GetSymbolicDimensions(info, got_names, 3);
    ok = ok && type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 && count == 3 && got[0] == 2 && got[2] == 7 &&
         got_names[1] && strcmp(got_names[1], "sequence") == 0;
    OrtTensorTypeAndShapeInfo *fixed = NULL;
    const int64_t five_by_three[2] = {5, 3};
    ok = ok && !api->CreateTensorTypeAndShapeInfo(&fixed) && !api->SetDimensions(fixed, five_by_three, 2) &&
         !api->GetTensorShapeElementCount(fixed, &elements) && elements == 15;
    api->ReleaseTensorTypeAndShapeInfo(info);
    if (fixed)
        api->ReleaseTensorTypeAndShapeInfo(fixed);
    if (!ok)
        return fail(message, size, "the tensor type-and-shape entries disagree");
    /* a custom-op domain made and released (26, 101); the op entries are exercised by running the ops */
    OrtCustomOpDomain *domain = NULL;
    if ((status = api->CreateCustomOpDomain("edgedecode.selftest", &domain)))
        return fail(message, size, "CreateCustomOpDomain failed");
    api->ReleaseCustomOpDomain(domain);
    snprintf(message, size, "ok");
    return 0;
}

static int check(int ggml_type, int64_t k, int *qi) {
    const qtype_info *qt = qtype_lookup(ggml_type, qi);
    return qt && k > 0 && k % qt->block_elements == 0 ? 0 : -1;
}

int edgedecode_kernels_matmul(int ggml_type, int accuracy_level, int64_t k, int64_t n, int64_t m, const float *a,
                              const uint8_t *b, float *y) {
    int qi;
    if (check(ggml_type, k, &qi) || n <= 0 || m < 0 || (accuracy_level != 0 && accuracy_level != 4))
        return -1;
    const qtype_info *qt = qtype_lookup(ggml_type, NULL);
    const size_t row_bytes = (size_t)(k / qt->block_elements) * (size_t)qt->block_bytes;
    const cpu_isa *isa = cpu_isa_current();
    if (accuracy_level == 0) {
        for (int64_t i = 0; i < m; i++)
            isa->gemv_f32[qi](b, row_bytes, (size_t)n, (size_t)k, a + i * k, y + i * n);
        return 0;
    }
    const size_t row = act_q8_bytes((size_t)k);
    void *memory = aligned_alloc(64, (size_t)m * row + 64);
    act_q8 *quant = malloc((size_t)m * sizeof(act_q8) + 1);
    if (!memory || !quant) {
        free(memory);
        free(quant);
        return -1;
    }
    for (int64_t i = 0; i < m; i++) {
        act_q8_bind(&quant[i], (uint8_t *)memory + (size_t)i * row, (size_t)k);
        act_q8_quantize(isa, qi, a + i * k, (size_t)k, &quant[i]);
    }
    isa->gemm_q8[qi](b, row_bytes, (size_t)n, (size_t)k, quant, (size_t)m, y, (size_t)n);
    free(memory);
    free(quant);
    return 0;
}

int edgedecode_kernels_quantize(int ggml_type, int64_t k, const float *x, int8_t *q, float *d, int16_t *sum16,
                                int16_t *sum32) {
    int qi;
    void *memory;
    if (check(ggml_type, k, &qi) || !(memory = aligned_alloc(64, act_q8_bytes((size_t)k))))
        return -1;
    act_q8 quant;
    act_q8_bind(&quant, memory, (size_t)k);
    cpu_isa_current()->quantize(x, (size_t)k, act_block_of(qi), ACT_NATURAL, &quant);
    memcpy(q, quant.q, (size_t)k);
    memcpy(d, quant.d, (size_t)k / (size_t)act_block_of(qi) * sizeof(float));
    memcpy(sum16, quant.sum16, (size_t)k / 16 * sizeof(int16_t));
    memcpy(sum32, quant.sum32, (size_t)k / 32 * sizeof(int16_t));
    free(memory);
    return 0;
}

int edgedecode_kernels_dequantize(int ggml_type, int64_t k, int64_t rows, const uint8_t *b, float *out) {
    int qi;
    if (check(ggml_type, k, &qi) || rows < 0)
        return -1;
    const qtype_info *qt = qtype_lookup(ggml_type, NULL);
    const size_t row_bytes = (size_t)(k / qt->block_elements) * (size_t)qt->block_bytes;
    for (int64_t r = 0; r < rows; r++)
        cpu_isa_current()->dequant[qi](b + (size_t)r * row_bytes, (size_t)k, out + r * k);
    return 0;
}
