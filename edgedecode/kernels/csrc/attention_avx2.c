/* DecodeAttention's AVX2 + FMA + F16C chunk kernel (x86-64 from Haswell / Zen 1 on): attention_x86_impl.h with the
 * 16 vector registers AVX2 has. */
#if defined(__x86_64__) || defined(__i386__)
#define ATTN_TARGET "avx2,fma,f16c"
#define ATTN_REGISTERS 16
#define ATTN_ISA attn_isa_avx2
#define ATTN_NAME "avx2"

static int usable(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

#include "attention_x86_impl.h"
#endif
