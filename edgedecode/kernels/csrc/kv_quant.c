/* EDKV section encoding on the CPU (exports.h: edgedecode_kv_quantize, edgedecode_kv_to_fp16): the asymmetric
 * min/max quantizers of edgedecode/kv/quant.py and the float16 cast of FP16 sections, byte for byte, in one pass
 * over a section's float32 rows read where they lie (token rows gathered by index, no copy).
 *
 * What the numpy reference would refuse (a value not finite or beyond ±65504) or decide by the order of its
 * reduction (a group whose minimum is ±0: the sign of the float16 zero) is not written here: the call says so and
 * the caller leaves that section to the reference. Paths: the element loops of kv_quant_impl.h compiled for
 * AVX2 + F16C on x86-64 where the CPU has them and the kernels' path is not forced to "portable", else for the
 * build's baseline; the FP16 cast needs F16C (elsewhere the caller casts with numpy). */
#include <math.h>
#include <string.h>

#include "cpu_kernels.h"
#include "exports.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define KVQ_FP16_MAX 65504.0f
#define KVQ_FP16_OVERFLOW 65520.0f /* the smallest magnitude float16 rounds to infinity */
#define KVQ_MAX_D 1024
#define KVQ_MAX_GROUP 1024

enum { KVQ_TOKEN = 0, KVQ_CHANNEL = 1 };

typedef struct {
    const float *src; /* element [l][h][t][c] at l * layer_stride + h * head_stride + t * token_stride + c */
    int64_t layer_stride, head_stride, token_stride;
    int64_t layers, heads, m, d;
    const int64_t *tokens; /* [m] */
    int axis, group, bits;
    uint8_t *codes;        /* [layers] of C-contiguous [heads, m, d·bits/8], codes_layer_stride bytes apart */
    uint8_t *scales;       /* [layers] of C-contiguous float16 [heads, params...], params_layer_stride apart */
    uint8_t *zeros;        /* likewise */
    int64_t codes_layer_stride, params_layer_stride;
} kvq_section;

/* 2^k as a double, |k| < 1000. */
static inline double pow2(int k) {
    uint64_t bits = (uint64_t)(k + 1023) << 52;
    double v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* The nearest float16 on one side of v (|v| <= 65504): the smallest >= v when `up`, else the largest <= v, as its
 * bits, and its value in *exact. kv/quant.py's _round_fp16_exact: v's binade (frexp's exponent, at least -13) sets
 * the step 2^(e-11); v is counted in steps, rounded outwards, and the bits built from the count. */
static inline uint16_t fp16_round(double v, int up, double *exact) {
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    int e = (int)((bits >> 52) & 0x7ff) - 1022; /* frexp's exponent (v = 0: -1022, and v counts 0 steps anyway) */
    int binade = e < -13 ? -13 : e;
    int shift = 11 - binade;
    double steps = up ? ceil(v * pow2(shift)) : floor(v * pow2(shift));
    int64_t count = (int64_t)fabs(steps);
    uint16_t magnitude = count == 0 ? 0 : (uint16_t)(((binade + 14) << 10) + count - 1024);
    *exact = steps * pow2(-shift);
    return (uint16_t)(magnitude | (signbit(steps) ? 0x8000u : 0u));
}

/* kv/quant.py's _fp16_params for one group of range [lo, hi]: zero rounded down from lo, then scale rounded up
 * from (hi - zero) / (2^bits - 1) (at least 2^-24), both in float64; float16 bits out, float32 values for the
 * codes. */
static inline void kvq_params(float lo, float hi, int bits, uint16_t *zero_bits, uint16_t *scale_bits, float *zero,
                              float *scale) {
    double zero64, scale64;
    *zero_bits = fp16_round((double)lo, 0, &zero64);
    double step = ((double)hi - zero64) / (double)((1 << bits) - 1);
    *scale_bits = fp16_round(step < 0x1p-24 ? 0x1p-24 : step, 1, &scale64);
    *zero = (float)zero64;
    *scale = (float)scale64;
}

/* Codes [d] -> packed bytes, lowest bits first (3 bits: the low two bits as 2-bit codes, then the high bits). */
static inline void kvq_pack(const uint8_t *restrict q, int64_t d, int bits, uint8_t *restrict out) {
    switch (bits) {
    case 8:
        memcpy(out, q, (size_t)d);
        break;
    case 4:
        for (int64_t i = 0; i < d / 2; i++)
            out[i] = (uint8_t)(q[2 * i] | q[2 * i + 1] << 4);
        break;
    case 2:
        for (int64_t i = 0; i < d / 4; i++)
            out[i] = (uint8_t)(q[4 * i] | q[4 * i + 1] << 2 | q[4 * i + 2] << 4 | q[4 * i + 3] << 6);
        break;
    case 3:
        for (int64_t i = 0; i < d / 4; i++)
            out[i] = (uint8_t)((q[4 * i] & 3) | (q[4 * i + 1] & 3) << 2 | (q[4 * i + 2] & 3) << 4 |
                               (q[4 * i + 3] & 3) << 6);
        for (int64_t i = 0; i < d / 8; i++) {
            uint8_t byte = 0;
            for (int k = 0; k < 8; k++)
                byte |= (uint8_t)((q[8 * i + k] >> 2 & 1) << k);
            out[d / 4 + i] = byte;
        }
        break;
    }
}

#define KVQ_TARGET
#define KVQ(name) kvq_portable_##name
#include "kv_quant_impl.h"
#undef KVQ_TARGET
#undef KVQ

#if defined(__x86_64__) || defined(__i386__)
#define KVQ_TARGET __attribute__((target("avx2,fma,f16c")))
#define KVQ(name) kvq_avx2_##name
#define KVQ_AVX2
#include "kv_quant_impl.h"
#undef KVQ_TARGET
#undef KVQ
#undef KVQ_AVX2

/* The x86 paths the kernels run (cpu_dispatch.c) all have AVX2 and F16C; "portable" has neither. */
static int x86_path(void) { return strcmp(cpu_isa_current()->name, "portable") != 0; }

__attribute__((target("avx2,f16c"))) static int to_fp16_f16c(const float *const *rows, int64_t count, int64_t d,
                                                              uint16_t *out) {
    const __m256 limit = _mm256_set1_ps(KVQ_FP16_OVERFLOW);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 fine = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int64_t r = 0; r < count; r++) {
        const float *x = rows[r];
        for (int64_t c = 0; c < d; c += 8) {
            __m256 v = _mm256_loadu_ps(x + c);
            fine = _mm256_and_ps(fine, _mm256_cmp_ps(_mm256_and_ps(v, magnitude), limit, _CMP_LT_OQ));
            _mm_storeu_si128((__m128i *)(out + r * d + c), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        }
    }
    return _mm256_movemask_ps(fine) == 0xff ? KVQ_OK : KVQ_REFUSED;
}
#endif

static int check_section(const kvq_section *s) {
    if (s->layers < 0 || s->heads < 0 || s->m < 1 || s->d < 8 || s->d > KVQ_MAX_D || s->d % 8)
        return KVQ_UNSUPPORTED;
    if (s->bits != 2 && s->bits != 3 && s->bits != 4 && s->bits != 8)
        return KVQ_UNSUPPORTED;
    if (s->d * s->bits % 8 || (s->bits == 3 && s->d % 8))
        return KVQ_UNSUPPORTED;
    if (s->axis == KVQ_TOKEN)
        return s->group >= 8 && s->group % 8 == 0 && s->d % s->group == 0 ? KVQ_OK : KVQ_UNSUPPORTED;
    return s->axis == KVQ_CHANNEL && s->group >= 1 && s->group <= KVQ_MAX_GROUP ? KVQ_OK : KVQ_UNSUPPORTED;
}

int edgedecode_kv_quantize(const float *src, int64_t layers, int64_t heads, int64_t m, int64_t d,
                           int64_t layer_stride, int64_t head_stride, int64_t token_stride, const int64_t *tokens,
                           int axis, int group, int bits, uint8_t *codes, uint8_t *scales, uint8_t *zeros,
                           int64_t codes_layer_stride, int64_t params_layer_stride) {
    const kvq_section s = {src,    layer_stride, head_stride, token_stride, layers, heads,
                           m,      d,            tokens,      axis,         group,  bits,
                           codes,  scales,       zeros,       codes_layer_stride, params_layer_stride};
    int status = check_section(&s);
    if (status != KVQ_OK)
        return status;
#if defined(__x86_64__) || defined(__i386__)
    if (x86_path())
        return kvq_avx2_quantize(&s);
#endif
    return kvq_portable_quantize(&s);
}

int edgedecode_kv_to_fp16(const float *src, int64_t layers, int64_t heads, int64_t m, int64_t d,
                          int64_t layer_stride, int64_t head_stride, int64_t token_stride, const int64_t *tokens,
                          uint8_t *out, int64_t out_layer_stride) {
    if (layers < 0 || heads < 0 || m < 1 || d < 8 || d % 8)
        return KVQ_UNSUPPORTED;
#if defined(__x86_64__) || defined(__i386__)
    if (!x86_path())
        return KVQ_UNSUPPORTED;
    enum { BATCH = 64 };
    const float *rows[BATCH];
    for (int64_t l = 0; l < layers; l++)
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *dst = (uint16_t *)(out + l * out_layer_stride) + h * m * d;
            for (int64_t t0 = 0; t0 < m; t0 += BATCH) {
                const int64_t count = m - t0 < BATCH ? m - t0 : BATCH;
                for (int64_t r = 0; r < count; r++)
                    rows[r] = src + l * layer_stride + h * head_stride + tokens[t0 + r] * token_stride;
                if (to_fp16_f16c(rows, count, d, dst + t0 * d) != KVQ_OK)
                    return KVQ_REFUSED;
            }
        }
    return KVQ_OK;
#else
    (void)src, (void)layer_stride, (void)head_stride, (void)token_stride, (void)tokens, (void)out;
    (void)out_layer_stride;
    return KVQ_UNSUPPORTED;
#endif
}
