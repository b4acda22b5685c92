// edgedecode's CUDA kernels, one NVRTC program (edgedecode/kernels/nvrtc.py compiles it per device
// architecture; the cubin is cached). Entry points are extern "C" so the host finds them by name; each
// takes its argument struct (ed_cuda_args.h) by value.
#include "gather.cuh"
#include "gemv.cuh"

#define ED_GEMV(NAME, R, MT, GATED) \
    ED_KERNEL void __launch_bounds__(ED_MAX_THREADS, 1) NAME(const EdGemvArgs a) { gemv<R, MT, GATED>(a); }

ED_GEMV(ed_gemv_r1_m1, 1, 1, false)
ED_GEMV(ed_gemv_r2_m1, 2, 1, false)
ED_GEMV(ed_gemv_r4_m1, 4, 1, false)
ED_GEMV(ed_gemv_r1_m4, 1, 4, false)
ED_GEMV(ed_gemv_r2_m4, 2, 4, false)
ED_GEMV(ed_gemv_r4_m4, 4, 4, false)
ED_GEMV(ed_gemv_gated_r2_m1, 2, 1, true)
ED_GEMV(ed_gemv_gated_r4_m1, 4, 1, true)
ED_GEMV(ed_gemv_gated_r2_m4, 2, 4, true)
ED_GEMV(ed_gemv_gated_r4_m4, 4, 4, true)

ED_KERNEL void __launch_bounds__(ED_MAX_THREADS, 1) ed_gather(const EdGatherArgs a) { gather(a); }
