// The few device primitives the kernels use, in one place: on the GPU (NVRTC) they are CUDA intrinsics
// and PTX; under the host emulator of the tests (tests/cuda_emu/emu.h, g++) the same names are plain C++.
// Nothing here includes a CUDA header: NVRTC provides the built-ins.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)

#define ED_DEV __device__ __forceinline__
#define ED_KERNEL extern "C" __global__
#define ED_SHARED __shared__

ED_DEV u32 ld32(const u8 *p) { return __ldg(reinterpret_cast<const u32 *>(p)); }
ED_DEV u32 ld16(const u8 *p) { return __ldg(reinterpret_cast<const u16 *>(p)); }
ED_DEV u32 ld8(const u8 *p) { return __ldg(p); }
ED_DEV uint4 ld128(const u8 *p) { return __ldg(reinterpret_cast<const uint4 *>(p)); }
ED_DEV u32 funnel_r(u32 lo, u32 hi, u32 shift) { return __funnelshift_r(lo, hi, shift); }
ED_DEV float as_float(u32 bits) { return __uint_as_float(bits); }
ED_DEV float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
ED_DEV u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
ED_DEV float shfl_xor(float v, int offset) { return __shfl_xor_sync(0xffffffffu, v, offset); }
ED_DEV void sync_threads() { __syncthreads(); }
ED_DEV int thread_x() { return threadIdx.x; }
ED_DEV int block_x() { return blockIdx.x; }
ED_DEV int block_y() { return blockIdx.y; }
ED_DEV int block_dim() { return blockDim.x; }
ED_DEV int grid_x() { return gridDim.x; }
ED_DEV int grid_y() { return gridDim.y; }
ED_DEV float exp_f(float v) { return expf(v); }
ED_DEV float sqrt_f(float v) { return sqrtf(v); }
extern __shared__ __align__(16) float ed_dynamic_shared[];
ED_DEV float *dynamic_shared() { return ed_dynamic_shared; }

#else
#include "emu.h"  // tests/cuda_emu: runs each thread block's threads as fibers on the host
#endif

// 16 bytes at a 2-byte aligned address, as four little-endian words: five aligned loads and a funnel shift
// (the last load is the fourth again when the address is 4-byte aligned, so nothing past the 16 bytes'
// last aligned word is read).
ED_DEV void ld16_a2(const u8 *p, u32 (&out)[4]) {
    const u8 *base = reinterpret_cast<const u8 *>(reinterpret_cast<u64>(p) & ~u64(3));
    const u32 shift = (u32)(reinterpret_cast<u64>(p) & 2) * 8;
    u32 v[5];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = ld32(base + 4 * i);
    v[4] = ld32(reinterpret_cast<const u8 *>(reinterpret_cast<u64>(p + 14) & ~u64(3)));
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = funnel_r(v[i], v[i + 1], shift);
}

// 4 bytes at a 2-byte aligned address.
ED_DEV u32 ld4_a2(const u8 *p) {
    const u32 shift = (u32)(reinterpret_cast<u64>(p) & 2) * 8;
    const u32 lo = ld32(reinterpret_cast<const u8 *>(reinterpret_cast<u64>(p) & ~u64(3)));
    const u32 hi = ld32(reinterpret_cast<const u8 *>(reinterpret_cast<u64>(p + 2) & ~u64(3)));
    return funnel_r(lo, hi, shift);
}

ED_DEV void ld16_a16(const u8 *p, u32 (&out)[4]) {
    const uint4 v = ld128(p);
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
}

// Sum over groups of `width` consecutive lanes (width a power of two, at most 32).
ED_DEV float group_sum(float v, int width) {
    for (int offset = width >> 1; offset > 0; offset >>= 1) v += shfl_xor(v, offset);
    return v;
}
