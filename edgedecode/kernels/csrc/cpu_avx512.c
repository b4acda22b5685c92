/* The AVX-512 VNNI path (Ice Lake / Zen 4 on): cpu_x86_impl.h on 256-bit vectors with dpbusd/dpwssd and AVX-512BW
 * mask registers. 256-bit vectors, not 512: on Zen 4 a 512-bit op costs two 256-bit ones, and a decode step is
 * bound by memory, not by vector width. */
#if defined(__x86_64__) || defined(__i386__)
#define X86_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"
#define X86_VNNI 1
#define X86_TILE 4 /* activation rows a weight row is unpacked for (registers: 16 ymm, 32 with AVX-512) */
#define X86_MASK 1
#define X86_ISA cpu_isa_avx512vnni
#define X86_NAME "avx512vnni"

static int usable(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

#include "cpu_x86_impl.h"
#endif
