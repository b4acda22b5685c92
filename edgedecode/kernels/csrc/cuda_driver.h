/* The CUDA driver API this library calls, declared in its own words from NVIDIA's documented signatures (no CUDA
 * header is needed to build), resolved at run time from libcuda.so.1 with dlopen: a machine without a GPU driver
 * builds and loads the library the same, and only the CUDA ops' kernel creation reports the driver missing.
 *
 * Kernels come as cubins that Python compiles with NVRTC (edgedecode/kernels/nvrtc.py) and hands over through
 * edgedecode_cuda_set_image before a session is created; a module is loaded once per CUDA context, at the first
 * CUDA op's kernel creation (session creation), never while a run is being captured into a CUDA graph. */
#ifndef ED_CUDA_DRIVER_H
#define ED_CUDA_DRIVER_H

#include <stddef.h>

#include "cuda_plan.h"

typedef int CUresult; /* 0: success */
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream; /* the same handle as the runtime's cudaStream_t */

/* Entry points of kernels.cu, in one order: ED_KERNEL_NAMES[i] is module->functions[i]. */
#define ED_KERNEL_COUNT 11
extern const char *const ED_KERNEL_NAMES[ED_KERNEL_COUNT];

typedef struct EdCudaModule {
    CUcontext context;
    CUmodule module;
    CUfunction functions[ED_KERNEL_COUNT];
    int arch;       /* compute capability, major * 10 + minor */
    int sm_count;   /* multiprocessors: sizes grids */
    int max_shared; /* dynamic shared memory a block may take (opted in at load) */
} EdCudaModule;

/* The kernels' module in the calling thread's current CUDA context (device 0's primary context when none is
 * current), loading it on first use. 0, or -1 with the reason in `why`. */
int ed_cuda_module(const EdCudaModule **out, char *why, size_t size);

/* Launch a planned kernel of `module` on `stream` with one by-value argument struct. 0, or -1 with `why`. */
int ed_cuda_launch(const EdCudaModule *module, const EdLaunch *launch, void *args, CUstream stream, char *why,
                   size_t size);

/* The benchmark overrides (edgedecode_cuda_set_tuning), read at kernel creation. */
EdTuning ed_cuda_tuning(void);

#endif
