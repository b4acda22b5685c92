/* The CUDA ops' own glue (csrc/cuda_ops.c: attributes, inputs, planning) on onnxruntime's CPU provider, launching
 * through the host emulator instead of the driver: a float16 decode graph of the CUDA form then runs end to end on a
 * machine without a GPU (tests/test_graph_cuda.py). This file stands in for csrc/cuda_driver.c (the three functions
 * cuda_ops.c calls) and for register.c (the same ops, declared for the CPU provider). */
#include <stdio.h>
#include <string.h>

#include "cuda_driver.h"
#include "cuda_ops.h"

int emu_run(const EdLaunch *launch, void *args); /* emu_launch.cpp */

/* What the planner sizes launches by: few multiprocessors, so blocks take several tiles of rows as on a card. */
static EdCudaModule module = {.arch = 90, .sm_count = 2, .max_shared = 200 * 1024};

int ed_cuda_module(const EdCudaModule **out, char *why, size_t size) {
    (void)why, (void)size;
    *out = &module;
    return 0;
}

int ed_cuda_launch(const EdCudaModule *m, const EdLaunch *launch, void *args, CUstream stream, char *why,
                   size_t size) {
    (void)m, (void)stream; /* the CPU provider has no stream: the emulator runs the launch to completion */
    if (emu_run(launch, args)) {
        snprintf(why, size, "emulated %s deadlocked", launch->kernel);
        return -1;
    }
    return 0;
}

EdTuning ed_cuda_tuning(void) {
    const EdTuning none = {0, 0, 0, 0};
    return none;
}

static const char *cpu_provider(const OrtCustomOp *op) {
    (void)op;
    return "CPUExecutionProvider";
}

static OrtCustomOp ops[3];
static OrtCustomOpDomain *domain;

OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    const OrtApi *api = base->GetApi(EDGEDECODE_ORT_API_VERSION);
    if (!api)
        return NULL;
    ort_api = api;
    OrtStatus *status = NULL;
    if (!domain) {
        const OrtCustomOp *cuda[3] = {&op_matmul_gguf_cuda, &op_gather_gguf_cuda, &op_fused_matmul_gguf_cuda};
        status = api->CreateCustomOpDomain(KERNEL_DOMAIN, &domain);
        for (int i = 0; i < 3 && !status; i++) {
            ops[i] = *cuda[i];
            ops[i].GetExecutionProviderType = cpu_provider;
            status = api->CustomOpDomain_Add(domain, &ops[i]);
        }
    }
    return status ? status : api->AddCustomOpDomain(options, domain);
}
