/* The AVX2 + FMA + F16C path (x86-64 from Haswell / Zen 1 on): cpu_x86_impl.h with maddubs-based dot products. */
#if defined(__x86_64__) || defined(__i386__)
#define X86_TARGET "avx2,fma,f16c"
#define X86_VNNI 0
#define X86_TILE 2 /* activation rows a weight row is unpacked for (registers: 16 ymm, 32 with AVX-512) */
#define X86_MASK 0
#define X86_ISA cpu_isa_avx2
#define X86_NAME "avx2"

static int usable(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

#include "cpu_x86_impl.h"
#endif
