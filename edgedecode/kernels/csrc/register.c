/* The library's entry point for onnxruntime: RegisterCustomOps adds the domain com.edgedecode with every op of every
 * execution provider built, after checking that the runtime offers the API version the ops are declared at. */
#include <pthread.h>
#include <stdio.h>

#include "cuda_ops.h"
#include "exports.h"
#include "ops.h"

/* The CUDA ops come first: onnxruntime builds an op name's one schema, shape inference included, from the first op
 * registered under it, and theirs infer the output type from the node (float or float16). */
static const OrtCustomOp *const OPS[] = {
    &op_matmul_gguf_cuda,
    &op_gather_gguf_cuda,
    &op_fused_matmul_gguf_cuda,
    &op_matmul_gguf_cpu,
    &op_gather_gguf_cpu,
    &op_decode_attention_cpu,
    NULL,
};

/* One domain object serves every session: onnxruntime keeps a pointer to it in each session's options and reads
 * its ops while building the session, so it must live as long as the process. */
static OrtCustomOpDomain *domain;
static pthread_mutex_t domain_lock = PTHREAD_MUTEX_INITIALIZER;
static char refusal[256];

const char *edgedecode_kernels_last_refusal(void) { return refusal; }

/* The highest API version below `wanted` the runtime offers (0: none), and that version's table. */
static uint32_t older_api(const OrtApiBase *base, uint32_t wanted, const OrtApi **table) {
    for (uint32_t v = wanted - 1; v >= 1; v--)
        if ((*table = base->GetApi(v)))
            return v;
    *table = NULL;
    return 0;
}

EXPORT OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    const OrtApi *api = base->GetApi(EDGEDECODE_ORT_API_VERSION);
    if (!api) {
        const OrtApi *old;
        const uint32_t offered = older_api(base, EDGEDECODE_ORT_API_VERSION, &old);
        const char *version = base->GetVersionString ? base->GetVersionString() : "?";
        snprintf(refusal, sizeof refusal,
                 "edgedecode's kernels need onnxruntime C API version >= %u (onnxruntime 1.%u); this onnxruntime "
                 "(%s) offers API versions up to %u",
                 EDGEDECODE_ORT_API_VERSION, EDGEDECODE_ORT_API_VERSION, version, offered);
        /* with no table at all no status can be made: nothing is registered and the refusal is kept for
         * edgedecode_kernels_last_refusal */
        return old ? old->CreateStatus(ORT_FAIL, refusal) : NULL;
    }
    ort_api = api;
    pthread_mutex_lock(&domain_lock);
    OrtStatus *status = NULL;
    if (!domain) {
        OrtCustomOpDomain *created = NULL;
        status = api->CreateCustomOpDomain(KERNEL_DOMAIN, &created);
        for (size_t i = 0; !status && OPS[i]; i++)
            status = api->CustomOpDomain_Add(created, OPS[i]);
        if (status && created)
            api->ReleaseCustomOpDomain(created);
        else
            domain = created;
    }
    pthread_mutex_unlock(&domain_lock);
    return status ? status : api->AddCustomOpDomain(options, domain);
}
