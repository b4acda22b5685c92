// A host emulator for edgedecode's CUDA kernels (edgedecode/kernels/cuda), for the tests on machines with
// no GPU: prelude.cuh includes this instead of using CUDA intrinsics when the source is compiled by g++.
// Each thread of a block is a ucontext fiber; __syncthreads and warp shuffles are rendezvous points where
// a fiber yields until every live thread of its block (or warp) has arrived. Blocks run one after another,
// so `static` stands in for __shared__. Float semantics are the host's IEEE ones, subnormals kept.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define ED_DEV inline
#define ED_KERNEL extern "C"
#define ED_SHARED static
#define __launch_bounds__(...)

struct uint4 {
    unsigned x, y, z, w;
};
struct float4 {
    float x, y, z, w;
};

namespace emu {
int thread_id();
int block_x();
int block_y();
int block_dim();
int grid_x();
int grid_y();
void barrier();
float shuffle_xor(float v, int offset);
float *dynamic_shared();
}  // namespace emu

// A load as the GPU does it: from an address aligned to its width (a misaligned one faults on the device).
template <class T>
static inline T emu_load(const unsigned char *p) {
    if (reinterpret_cast<unsigned long long>(p) % sizeof(T)) {
        std::fprintf(stderr, "emu: misaligned %zu-byte load at %p\n", sizeof(T), static_cast<const void *>(p));
        std::abort();
    }
    T v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

ED_DEV unsigned ld32(const unsigned char *p) { return emu_load<unsigned>(p); }
ED_DEV unsigned ld16(const unsigned char *p) { return emu_load<unsigned short>(p); }
ED_DEV unsigned ld8(const unsigned char *p) { return *p; }
ED_DEV uint4 ld128(const unsigned char *p) { return emu_load<uint4>(p); }
ED_DEV unsigned funnel_r(unsigned lo, unsigned hi, unsigned shift) {
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> (shift & 31));
}
ED_DEV float as_float(unsigned bits) {
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
ED_DEV float h2f(unsigned short h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}
ED_DEV unsigned short f2h(float f) {
    const _Float16 v = (_Float16)f;
    unsigned short h;
    std::memcpy(&h, &v, 2);
    return h;
}
ED_DEV float shfl_xor(float v, int offset) { return emu::shuffle_xor(v, offset); }
ED_DEV void sync_threads() { emu::barrier(); }
ED_DEV int thread_x() { return emu::thread_id(); }
ED_DEV int block_x() { return emu::block_x(); }
ED_DEV int block_y() { return emu::block_y(); }
ED_DEV int block_dim() { return emu::block_dim(); }
ED_DEV int grid_x() { return emu::grid_x(); }
ED_DEV int grid_y() { return emu::grid_y(); }
ED_DEV float exp_f(float v) { return std::exp(v); }
ED_DEV float sqrt_f(float v) { return std::sqrt(v); }
ED_DEV float *dynamic_shared() { return emu::dynamic_shared(); }
