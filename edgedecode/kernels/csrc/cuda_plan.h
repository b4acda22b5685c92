/* How a CUDA GEMV or gather is launched: pure C (no driver calls), so the emulator tests
 * (tests/cuda_emu) run the same planning as the library. */
#ifndef ED_CUDA_PLAN_H
#define ED_CUDA_PLAN_H

#include "../cuda/ed_cuda_args.h"

/* Overrides for benchmarks (edgedecode_cuda_set_tuning); 0 = the default rule. */
typedef struct EdTuning {
    int lanes;   /* threads per row group: 8..256, a power of two */
    int rows;    /* weight rows per group: 1, 2 or 4 (gated: 2 or 4) */
    int threads; /* threads per block: 64..256, a multiple of 32 */
    int blocks_per_sm; /* the grid's cap, in blocks per multiprocessor: blocks then take several tiles of rows */
} EdTuning;

typedef struct EdLaunch {
    char kernel[32]; /* entry point in kernels.cu */
    unsigned grid_x, grid_y, threads, shared_bytes;
} EdLaunch;

/* Complete args (cta_start, lanes, n_out) for `segments` weight matrices and args->m rows of x, and say
 * how to launch. `sm_count` sizes the grid; `max_shared` is the most dynamic shared memory a block may
 * take. Returns 0, or -1 when the shapes are not launchable (K not whole blocks, more than 3 segments,
 * x too long for shared memory). */
int ed_plan_gemv(EdGemvArgs *args, int segments, int gated, const EdTuning *tuning, int sm_count, int max_shared,
                 EdLaunch *launch);

/* Elements per block of a GGML type (32 or 256), 0 for a type the kernels do not read. */
int ed_block_elems(int ggml_type);
/* Bytes per block, 0 for a type the kernels do not read. */
int ed_block_bytes(int ggml_type);

void ed_plan_gather(const EdGatherArgs *args, int sm_count, EdLaunch *launch);

#endif
