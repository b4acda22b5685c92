/* DecodeAttention's AVX-512 chunk kernel (Skylake-X / Zen 4 on): attention_x86_impl.h on 256-bit vectors with the 32
 * registers AVX-512VL gives them, so the value pass holds wider blocks of the head. */
#if defined(__x86_64__) || defined(__i386__)
#define ATTN_TARGET "avx2,fma,f16c,avx512f,avx512vl"
#define ATTN_REGISTERS 32
#define ATTN_ISA attn_isa_avx512
#define ATTN_NAME "avx512"

static int usable(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
}

#include "attention_x86_impl.h"
#endif
