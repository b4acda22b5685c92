/* The aarch64 NEON kernels, written once and included by cpu_neon.c (every AArch64 CPU) and cpu_neondot.c (the
 * ARMv8.2 dot-product extension: Cortex-A55/A75 on, Jetson Xavier and Orin). The including file defines NEON_TARGET
 * (a target attribute, or nothing), NEON_DOT (1: sdot), NEON_ISA / NEON_NAME and `usable`.
 *
 * 128-bit vectors hold 16 codes. Weights become signed codes (q minus the type's zero point: Q4_0 q - 8, Q5_0
 * q - 16, Q6_K q - 32; Q4_1, Q5_1, Q4_K and Q5_K keep 0..31, which is int8 too) so signed-by-signed dot products
 * need no offset correction. A 32-element block's integer dot product is the sum of one int32x4 (its lanes' split
 * is the instruction's business); four blocks reduce to one vector of block sums with pairwise adds and are scaled
 * in float together. K-quants multiply each sub-block's int32x4 by its scale and sum the super-block in integers.
 * Activations stay in element order. Rounding differs from the portable path only in the order of float additions.
 */
#include <arm_neon.h>
#include <math.h>

#include "cpu_kernels.h"
#include "dequant_blocks.h"

#define KERNEL static inline __attribute__((always_inline)) NEON_TARGET
#define ENTRY static NEON_TARGET

/* acc + the products of a and b, 16 int8 each, summed into 4 int32 lanes. */
KERNEL int32x4_t dot_s8(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if NEON_DOT
    return vdotq_s32(acc, a, b);
#else
    const int16x8_t low = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    const int16x8_t high = vmull_high_s8(a, b);
    return vpadalq_s16(vpadalq_s16(acc, low), high);
#endif
}

KERNEL float f16(const uint8_t *p) {
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(load_u16(p)))), 0);
}

/* The float16 at p, p + stride, p + 2 stride, p + 3 stride. */
KERNEL float32x4_t f16_x4(const uint8_t *p, size_t stride) {
    uint16x4_t h = vdup_n_u16(load_u16(p));
    h = vset_lane_u16(load_u16(p + stride), h, 1);
    h = vset_lane_u16(load_u16(p + 2 * stride), h, 2);
    h = vset_lane_u16(load_u16(p + 3 * stride), h, 3);
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
}

/* ---- activation quantization (the rule in cpu_kernels.h; equal to the portable path's bit for bit) ---- */

ENTRY void quantize(const float *x, size_t k, int block, int layout, act_q8 *a) {
    for (size_t b = 0; b < k / (size_t)block; b++) {
        const float *xb = x + b * (size_t)block;
        float32x4_t amax = vdupq_n_f32(0.0f);
        uint32x4_t finite = vdupq_n_u32(~0u);
        for (int i = 0; i < block; i += 4) {
            const float32x4_t v = vabsq_f32(vld1q_f32(xb + i));
            amax = vmaxq_f32(amax, v);
            finite = vandq_u32(finite, vcltq_f32(v, vdupq_n_f32(INFINITY))); /* false for inf and nan */
        }
        float d = vmaxvq_f32(amax) / 127.0f;
        float inverse = d != 0.0f ? 1.0f / d : 0.0f;
        if (vminvq_u32(finite) == 0) {
            d = NAN;
            inverse = 0.0f;
        }
        a->d[b] = d;
        for (int i = 0; i < block; i += 16) {
            /* vcvtnq rounds to nearest, ties to even, as nearbyintf does in the portable path */
            const int32x4_t q0 = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(xb + i), inverse));
            const int32x4_t q1 = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(xb + i + 4), inverse));
            const int32x4_t q2 = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(xb + i + 8), inverse));
            const int32x4_t q3 = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(xb + i + 12), inverse));
            const int16x8_t lo = vcombine_s16(vqmovn_s32(q0), vqmovn_s32(q1));
            const int16x8_t hi = vcombine_s16(vqmovn_s32(q2), vqmovn_s32(q3));
            const int8x16_t q = vcombine_s8(vqmovn_s16(lo), vqmovn_s16(hi));
            vst1q_s8(a->q + b * (size_t)block + (size_t)i, q);
            a->sum16[(b * (size_t)block + (size_t)i) / 16] = (int16_t)vaddlvq_s8(q);
        }
    }
    for (size_t s = 0; s < k / 32; s++)
        a->sum32[s] = (int16_t)(a->sum16[2 * s] + a->sum16[2 * s + 1]);
    if (layout == ACT_PAIRED)
        act_q8_pair(a, k);
}

/* ---- accuracy level 4, 32-element types ---- */

enum { LEGACY_Q4_0, LEGACY_Q4_1, LEGACY_Q5_0, LEGACY_Q5_1, LEGACY_Q8_0 };

typedef struct {
    int type, bytes, codes_at, qh_at, zero, has_min;
} legacy_layout;

/* 32 bits of qh -> 16 bytes holding 0x10 where bit `first + j` is set, j = 0..15. */
KERNEL uint8x16_t fifth_bits(uint32_t qh, int first) {
    static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint16_t half = (uint16_t)(qh >> first);
    const uint8x16_t bytes = vcombine_u8(vdup_n_u8((uint8_t)half), vdup_n_u8((uint8_t)(half >> 8)));
    return vandq_u8(vtstq_u8(bytes, vld1q_u8(bit)), vdupq_n_u8(16));
}

/* One block's integer dot product with its 32 activation codes, as 4 int32 lanes to be summed. */
KERNEL int32x4_t legacy_block(legacy_layout t, const uint8_t *w, const int8_t *q) {
    int8x16_t lo, hi;
    if (t.type == LEGACY_Q8_0) {
        lo = vld1q_s8((const int8_t *)(w + 2));
        hi = vld1q_s8((const int8_t *)(w + 18));
    } else {
        const uint8x16_t x = vld1q_u8(w + t.codes_at);
        uint8x16_t l = vandq_u8(x, vdupq_n_u8(15)), h = vshrq_n_u8(x, 4);
        if (t.qh_at) {
            const uint32_t qh = load_u32(w + t.qh_at);
            l = vorrq_u8(l, fifth_bits(qh, 0));
            h = vorrq_u8(h, fifth_bits(qh, 16));
        }
        const int8x16_t zero = vdupq_n_s8((int8_t)t.zero);
        lo = vsubq_s8(vreinterpretq_s8_u8(l), zero);
        hi = vsubq_s8(vreinterpretq_s8_u8(h), zero);
    }
    return dot_s8(dot_s8(vdupq_n_s32(0), lo, vld1q_s8(q)), hi, vld1q_s8(q + 16));
}

KERNEL float legacy_row(legacy_layout t, const uint8_t *w, size_t nb, const act_q8 *a) {
    const size_t s = (size_t)t.bytes;
    float32x4_t acc = vdupq_n_f32(0.0f);
    size_t b = 0;
    for (; b + 4 <= nb; b += 4, w += 4 * s) {
        const int8_t *q = a->q + 32 * b;
        const int32x4_t v0 = legacy_block(t, w, q), v1 = legacy_block(t, w + s, q + 32);
        const int32x4_t v2 = legacy_block(t, w + 2 * s, q + 64), v3 = legacy_block(t, w + 3 * s, q + 96);
        const int32x4_t isum = vpaddq_s32(vpaddq_s32(v0, v1), vpaddq_s32(v2, v3)); /* lane j = block b + j */
        const float32x4_t da = vld1q_f32(a->d + b);
        acc = vfmaq_f32(acc, vcvtq_f32_s32(isum), vmulq_f32(f16_x4(w, s), da));
        if (t.has_min) {
            const float32x4_t sums = vcvtq_f32_s32(vmovl_s16(vld1_s16(a->sum32 + b)));
            acc = vfmaq_f32(acc, sums, vmulq_f32(f16_x4(w + 2, s), da));
        }
    }
    float y = vaddvq_f32(acc);
    for (; b < nb; b++, w += s) {
        y += f16(w) * a->d[b] * (float)vaddvq_s32(legacy_block(t, w, a->q + 32 * b));
        if (t.has_min)
            y += f16(w + 2) * a->d[b] * (float)a->sum32[b];
    }
    return y;
}

/* ---- accuracy level 4, K-quants ---- */

KERNEL float k45_row(int bytes, int five, const uint8_t *w, size_t nb, const act_q8 *a) {
    float y = 0.0f;
    for (size_t b = 0; b < nb; b++, w += bytes) {
        const int8_t *q = a->q + 256 * b;
        const uint8_t *qs = w + (five ? 48 : 16), *qh = w + 16;
        int32x4_t isum = vdupq_n_s32(0);
        int32_t msum = 0;
        for (int j = 0; j < 8; j++) {
            int sc, m;
            k_scale_min(w + 4, j, &sc, &m);
            msum += m * a->sum32[8 * b + (size_t)j];
            int32x4_t v = vdupq_n_s32(0);
            for (int h = 0; h < 2; h++) {
                uint8x16_t x = vld1q_u8(qs + 32 * (j / 2) + 16 * h);
                x = j & 1 ? vshrq_n_u8(x, 4) : vandq_u8(x, vdupq_n_u8(15));
                if (five) /* bit j of qh[l] is the fifth bit of sub-block j's element l */
                    x = vorrq_u8(x, vshlq_n_u8(vandq_u8(vshlq_u8(vld1q_u8(qh + 16 * h), vdupq_n_s8((int8_t)-j)),
                                                        vdupq_n_u8(1)), 4));
                v = dot_s8(v, vreinterpretq_s8_u8(x), vld1q_s8(q + 32 * j + 16 * h));
            }
            isum = vmlaq_n_s32(isum, v, sc);
        }
        y += f16(w) * a->d[b] * (float)vaddvq_s32(isum) - f16(w + 2) * a->d[b] * (float)msum;
    }
    return y;
}

KERNEL float q6k_row(const uint8_t *w, size_t nb, const act_q8 *a) {
    float y = 0.0f;
    for (size_t b = 0; b < nb; b++, w += 210) {
        const int8_t *q = a->q + 256 * b;
        const int8_t *sc = (const int8_t *)(w + 192);
        int32x4_t isum = vdupq_n_s32(0);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
            for (int half = 0; half < 2; half++) { /* elements l = 16*half .. 16*half + 15 of each quarter */
                const uint8x16_t l0 = vld1q_u8(ql + 16 * half), l1 = vld1q_u8(ql + 32 + 16 * half);
                const uint8x16_t hb = vld1q_u8(qh + 16 * half), m4 = vdupq_n_u8(15), m3 = vdupq_n_u8(3);
                const uint8x16_t quarter[4] = {
                    vorrq_u8(vandq_u8(l0, m4), vshlq_n_u8(vandq_u8(hb, m3), 4)),
                    vorrq_u8(vandq_u8(l1, m4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 2), m3), 4)),
                    vorrq_u8(vshrq_n_u8(l0, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 4), m3), 4)),
                    vorrq_u8(vshrq_n_u8(l1, 4), vshlq_n_u8(vshrq_n_u8(hb, 6), 4)),
                };
                for (int t = 0; t < 4; t++) { /* group 8h + 2t + half: 16 elements at 128h + 32t + 16 half */
                    const int8x16_t codes = vsubq_s8(vreinterpretq_s8_u8(quarter[t]), vdupq_n_s8(32));
                    const int32x4_t v = dot_s8(vdupq_n_s32(0), codes, vld1q_s8(q + 128 * h + 32 * t + 16 * half));
                    isum = vmlaq_n_s32(isum, v, sc[8 * h + 2 * t + half]);
                }
            }
        }
        y += f16(w + 208) * a->d[b] * (float)vaddvq_s32(isum);
    }
    return y;
}

#define GEMM_ENTRY(name, call)                                                                                     \
    ENTRY void gemm_q8_##name(const uint8_t *rows, size_t row_bytes, size_t n, size_t k, const act_q8 *a,        \
                              size_t m, float *y, size_t y_stride) {                                              \
        for (size_t i = 0; i < m; i++)                                                                           \
            for (size_t r = 0; r < n; r++) {                                                                     \
                const uint8_t *w = rows + r * row_bytes;                                                         \
                const act_q8 *act = a + i;                                                                       \
                y[i * y_stride + r] = call;                                                                      \
            }                                                                                                    \
    }

/*                                         type         bytes codes qh zero min */
GEMM_ENTRY(q4_0, legacy_row((legacy_layout){LEGACY_Q4_0, 18, 2, 0, 8, 0}, w, k / 32, act))
GEMM_ENTRY(q4_1, legacy_row((legacy_layout){LEGACY_Q4_1, 20, 4, 0, 0, 1}, w, k / 32, act))
GEMM_ENTRY(q5_0, legacy_row((legacy_layout){LEGACY_Q5_0, 22, 6, 2, 16, 0}, w, k / 32, act))
GEMM_ENTRY(q5_1, legacy_row((legacy_layout){LEGACY_Q5_1, 24, 8, 4, 0, 1}, w, k / 32, act))
GEMM_ENTRY(q8_0, legacy_row((legacy_layout){LEGACY_Q8_0, 34, 2, 0, 0, 0}, w, k / 32, act))
GEMM_ENTRY(q4_k, k45_row(144, 0, w, k / 256, act))
GEMM_ENTRY(q5_k, k45_row(176, 1, w, k / 256, act))
GEMM_ENTRY(q6_k, q6k_row(w, k / 256, act))

/* ---- accuracy level 0 and dequantization ---- */

ENTRY float dot_f32(const float *x, const float *w, size_t n) {
    float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);
    for (size_t i = 0; i < n; i += 8) {
        acc0 = vfmaq_f32(acc0, vld1q_f32(x + i), vld1q_f32(w + i));
        acc1 = vfmaq_f32(acc1, vld1q_f32(x + i + 4), vld1q_f32(w + i + 4));
    }
    return vaddvq_f32(vaddq_f32(acc0, acc1));
}

#define NEON_TYPE(name, dq, elements, bytes)                                                                      \
    ENTRY void gemv_f32_##name(const uint8_t *rows, size_t row_bytes, size_t n, size_t k, const float *x,       \
                               float *y) {                                                                       \
        gemv_f32_rows(rows, row_bytes, n, k, x, y, dq, elements, bytes, dot_f32);                                \
    }                                                                                                           \
    ENTRY void dequant_##name(const uint8_t *row, size_t k, float *out) { dq_row(row, k, out, dq, elements, bytes); }

NEON_TYPE(q4_0, dq_q4_0, 32, 18)
NEON_TYPE(q4_1, dq_q4_1, 32, 20)
NEON_TYPE(q5_0, dq_q5_0, 32, 22)
NEON_TYPE(q5_1, dq_q5_1, 32, 24)
NEON_TYPE(q8_0, dq_q8_0, 32, 34)
NEON_TYPE(q4_k, dq_q4_k, 256, 144)
NEON_TYPE(q5_k, dq_q5_k, 256, 176)
NEON_TYPE(q6_k, dq_q6_k, 256, 210)

const cpu_isa NEON_ISA = {
    .name = NEON_NAME,
    .usable = usable,
    .quantize = quantize,
    .act_layout = {ACT_NATURAL},
    .gemm_q8 = {gemm_q8_q4_0, gemm_q8_q4_1, gemm_q8_q5_0, gemm_q8_q5_1, gemm_q8_q8_0, gemm_q8_q4_k, gemm_q8_q5_k,
                gemm_q8_q6_k},
    .gemv_f32 = {gemv_f32_q4_0, gemv_f32_q4_1, gemv_f32_q5_0, gemv_f32_q5_1, gemv_f32_q8_0, gemv_f32_q4_k,
                 gemv_f32_q5_k, gemv_f32_q6_k},
    .dequant = {dequant_q4_0, dequant_q4_1, dequant_q5_0, dequant_q5_1, dequant_q8_0, dequant_q4_k, dequant_q5_k,
                dequant_q6_k},
};
