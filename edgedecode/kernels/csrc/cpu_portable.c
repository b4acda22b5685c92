/* The portable C path: the reference every SIMD path is tested against, and the fallback where none runs.
 *
 * Accuracy level 4, per row, with a_b the activation codes of block b, d_a its scale and S16/S32 the sums of its
 * codes over each 16/32 elements (cpu_kernels.h); w the weight block's fields (ggml_blocks.h):
 *   Q4_0  y += (d*d_a) * (sum q*a - 8*S32)            Q5_0  the same with 5-bit q and 16
 *   Q4_1  y += (d*d_a) * sum q*a + (m*d_a) * S32       Q5_1  the same with 5-bit q
 *   Q8_0  y += (d*d_a) * sum q*a                        (q signed)
 *   Q4_K  y += (d*d_a) * sum_j sc_j sum_j q*a - (dmin*d_a) * sum_j m_j S32_j   (j: the 8 sub-blocks; Q5_K alike)
 *   Q6_K  y += (d*d_a) * sum_s sc_s (sum_s q*a - 32*S16_s)                     (s: the 16 sub-blocks)
 * where every sum over codes is an exact integer (at most 2^27 in magnitude) and d_a belongs to the activation block
 * that covers the weight block (32 elements for the first five types, 256 for the K-quants).
 */
#include <math.h>
#include <string.h>

#include "cpu_kernels.h"
#include "dequant_blocks.h"

static inline size_t round64(size_t n) { return (n + 63) & ~(size_t)63; }

size_t act_q8_bytes(size_t k) {
    return round64(k) + round64(k / 32 * sizeof(float)) + round64(k / 16 * 2) + round64(k / 32 * 2);
}

void act_q8_bind(act_q8 *a, void *mem, size_t k) {
    uint8_t *p = mem;
    a->q = (int8_t *)p;
    p += round64(k);
    a->d = (float *)p; /* sized for 32-element blocks, the smaller of the two */
    p += round64(k / 32 * sizeof(float));
    a->sum16 = (int16_t *)p;
    p += round64(k / 16 * 2);
    a->sum32 = (int16_t *)p;
}

/* The block's scale, or a non-finite one (NaN or inf, which every product then carries into y) with all codes 0. */
static float block_scale(const float *x, int n, float *inverse) {
    float amax = 0.0f;
    int finite = 1;
    for (int i = 0; i < n; i++) {
        const float v = fabsf(x[i]);
        finite &= isfinite(v);
        amax = v > amax ? v : amax;
    }
    if (!finite) {
        *inverse = 0.0f;
        return NAN;
    }
    const float d = amax / 127.0f;
    *inverse = d != 0.0f ? 1.0f / d : 0.0f;
    return d;
}

void act_q8_sums(act_q8 *a, size_t k) {
    for (size_t s = 0; s < k / 16; s++) {
        int sum = 0;
        for (int i = 0; i < 16; i++)
            sum += a->q[16 * s + i];
        a->sum16[s] = (int16_t)sum;
    }
    for (size_t s = 0; s < k / 32; s++)
        a->sum32[s] = (int16_t)(a->sum16[2 * s] + a->sum16[2 * s + 1]);
}

void act_q8_pair(act_q8 *a, size_t k) {
    int8_t swap[16];
    for (size_t p = 0; p + 64 <= k; p += 64) {
        memcpy(swap, a->q + p + 16, 16);
        memcpy(a->q + p + 16, a->q + p + 32, 16);
        memcpy(a->q + p + 32, swap, 16);
    }
}

static void quantize_portable(const float *x, size_t k, int block, int layout, act_q8 *a) {
    for (size_t b = 0; b < k / (size_t)block; b++) {
        const float *xb = x + b * (size_t)block;
        float inverse;
        a->d[b] = block_scale(xb, block, &inverse);
        for (int i = 0; i < block; i++)
            a->q[b * (size_t)block + (size_t)i] = (int8_t)nearbyintf(xb[i] * inverse);
    }
    act_q8_sums(a, k);
    if (layout == ACT_PAIRED)
        act_q8_pair(a, k);
}

/* ---- accuracy level 4: one row at a time ---- */

static void gemv_q8_q4_0(const uint8_t *rows, size_t row_bytes, size_t n, size_t k, const act_q8 *a, float *y) {
    for (size_t r = 0; r < n; r++) {
        const uint8_t *w = rows + r * row_bytes;
        float acc = 0.0f;
        for (size_t b = 0; b < k / 32; b++, w += 18) {
            const int8_t *q = a->q + 32 * b;
            int s = 0;
            for (int j = 0; j < 16; j++)
                s += (w[2 + j] & 15) * q[j] + (w[2 + j] >> 4) * q[j + 16];
            acc += f16_to_f32(load_u16(w)) * a->d[b] * (float)(s - 8 * a->sum32[b]);
        }
        y[r] = acc;
    }
}

static void gemv_q8_q4_1(const uint8_t *rows, size_t row_bytes, size_t n, size_t k, const act_q8 *a, float *y) {
    for (size_t r = 0; r < n; r++) {
        const uint8_t *w = rows + r * row_bytes;
        float acc = 0.0f;
        for (size_t b = 0; b < k / 32; b++, w += 20) {
            const int8_t *q = a->q + 32 * b;
            int s = 0;
            for (int j = 0; j < 16; j++)
                s += (w[4 + j] & 15) * q[j] + (w[4 + j] >> 4) * q[j + 16];
            acc += f16_to_f32(load_u16(w)) * a->d[b] * (float)s +
                   f16_to_f32(load_u16(w + 2)) * a->d[b] * (float)a->sum32[b];
        }
        y[r] = acc;
    }
}

/* Q5_0 and Q5_1 share the code layout; `at` is where qh starts. */
static inline int q5_dot(const uint8_t *qh4, const uint8_t *qs, const int8_t *q) {
    const uint32_t qh = load_u32(qh4);
    int s = 0;
    for (int j = 0; j < 16; j++) {
        const int lo = (qs[j] & 15) | (int)((qh >> j) & 1) << 4;
        const int hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        s += lo * q[j] + hi * q[j + 16];
    }
    return s;
}

static void gemv_q8_q5_0(const uint8_t *rows, size_t row_bytes, size_t n, size_t k, const act_q8 *a, float *y) {
    for (size_t r = 0; r < n; r++) {
        const uint8_t *w = rows + r * row_bytes;
        float acc = 0.0f;
        for (size_t b = 0; b < k / 32; b++, w += 22) {
            const int s = q5_dot(w + 2, w + 6, a->q + 32 * b);
            acc += f16_to_f32(load_u16(w)) * a->d[b] * (float)(s - 16 * a->sum32[b]);
        }
        y[r] = acc;
    }
}

static void gemv_q8_q5_1(const uint8_t *rows, size_t row_bytes, size_t n, size_t k, const act_q8 *a, float *y) {
    for (size_t r = 0; r < n; r++) {
        const uint8_t *w = rows + r * row_bytes;
        float acc = 0.0f;
        for (size_t b = 0; b < k / 32; b++, w += 24) {
            const int s = q5_dot(w + 4, w + 8, a->q + 32 * b);
            acc += f16_to_f32(load_u16(w)) * a->d[b] * (float)s +
                   f16_to_f32(load_u16(w + 2)) * a->d[b] * (float)a->sum32[b];
        }
        y[r] = acc;
    }
}

static void gemv_q8_q8_0(const uint8_t *rows, size_t row_bytes, size_t n, size_t k, const act_q8 *a, float *y) {
    for (size_t r = 0; r < n; r++) {
        const uint8_t *w = rows + r * row_bytes;
        float acc = 0.0f;
        for (size_t b = 0; b < k / 32; b++, w += 34) {
            const int8_t *q = a->q + 32 * b;
            int s = 0;
            for (int j = 0; j < 32; j++)
                s += (int8_t)w[2 + j] * q[j];
            acc += f16_to_f32(load_u16(w)) * a->d[b] * (float)s;
        }
        y[r] = acc;
    }
}

/* Q4_K and Q5_K: `qh` NULL for Q4_K. */
static float k45_superblock(const uint8_t *w, const uint8_t *qh, const uint8_t *qs, const int8_t *q,
                            const int16_t *sum32, float d_a) {
    int isum = 0, msum = 0;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        k_scale_min(w + 4, j, &sc, &m);
        const uint8_t *nib = qs + 32 * (j / 2);
        const int shift = 4 * (j & 1);
        int s = 0;
        for (int l = 0; l < 32; l++) {
            int v = (nib[l] >> shift) & 15;
            if (qh)
                v |= ((qh[l] >> j) & 1) << 4;
            s += v * q[32 * j + l];
        }
        isum += sc * s;
        msum += m * sum32[j];
    }
    return f16_to_f32(load_u16(w)) * d_a * (float)isum - f16_to_f32(load_u16(w + 2)) * d_a * (float)msum;
}

static void gemv_q8_q4_k(const uint8_t *rows, size_t row_bytes, size_t n, size_t k, const act_q8 *a, float *y) {
    for (size_t r = 0; r < n; r++) {
        const uint8_t *w = rows + r * row_bytes;
        float acc = 0.0f;
        for (size_t b = 0; b < k / 256; b++, w += 144)
            acc += k45_superblock(w, NULL, w + 16, a->q + 256 * b, a->sum32 + 8 * b, a->d[b]);
        y[r] = acc;
    }
}

static void gemv_q8_q5_k(const uint8_t *rows, size_t row_bytes, size_t n, size_t k, const act_q8 *a, float *y) {
    for (size_t r = 0; r < n; r++) {
        const uint8_t *w = rows + r * row_bytes;
        float acc = 0.0f;
        for (size_t b = 0; b < k / 256; b++, w += 176)
            acc += k45_superblock(w, w + 16, w + 48, a->q + 256 * b, a->sum32 + 8 * b, a->d[b]);
        y[r] = acc;
    }
}

static void gemv_q8_q6_k(const uint8_t *rows, size_t row_bytes, size_t n, size_t k, const act_q8 *a, float *y) {
    for (size_t r = 0; r < n; r++) {
        const uint8_t *w = rows + r * row_bytes;
        float acc = 0.0f;
        for (size_t b = 0; b < k / 256; b++, w += 210) {
            const int8_t *q = a->q + 256 * b;
            const int16_t *s16 = a->sum16 + 16 * b;
            const int8_t *sc = (const int8_t *)(w + 192);
            int isum = 0;
            for (int h = 0; h < 2; h++) {
                const uint8_t *l8 = w + 64 * h, *h8 = w + 128 + 32 * h;
                int s[8] = {0};
                for (int l = 0; l < 32; l++) {
                    const int is = l / 16;
                    const int8_t *qq = q + 128 * h + l;
                    s[is + 0] += ((l8[l] & 15) | ((h8[l] >> 0) & 3) << 4) * qq[0];
                    s[is + 2] += ((l8[l + 32] & 15) | ((h8[l] >> 2) & 3) << 4) * qq[32];
                    s[is + 4] += ((l8[l] >> 4) | ((h8[l] >> 4) & 3) << 4) * qq[64];
                    s[is + 6] += ((l8[l + 32] >> 4) | ((h8[l] >> 6) & 3) << 4) * qq[96];
                }
                for (int t = 0; t < 8; t++)
                    isum += sc[8 * h + t] * (s[t] - 32 * s16[8 * h + t]);
            }
            acc += f16_to_f32(load_u16(w + 208)) * a->d[b] * (float)isum;
        }
        y[r] = acc;
    }
}

/* The reference takes one activation row at a time. */
#define PORTABLE_GEMM(name)                                                                                       \
    static void gemm_q8_##name(const uint8_t *rows, size_t row_bytes, size_t n, size_t k, const act_q8 *a,       \
                               size_t m, float *y, size_t y_stride) {                                            \
        for (size_t i = 0; i < m; i++)                                                                           \
            gemv_q8_##name(rows, row_bytes, n, k, &a[i], y + i * y_stride);                                      \
    }
PORTABLE_GEMM(q4_0)
PORTABLE_GEMM(q4_1)
PORTABLE_GEMM(q5_0)
PORTABLE_GEMM(q5_1)
PORTABLE_GEMM(q8_0)
PORTABLE_GEMM(q4_k)
PORTABLE_GEMM(q5_k)
PORTABLE_GEMM(q6_k)

/* ---- accuracy level 0 and dequantization ---- */

static float dot_portable(const float *a, const float *b, size_t n) {
    float acc[8] = {0};
    for (size_t i = 0; i < n; i += 8)
        for (int j = 0; j < 8; j++)
            acc[j] += a[i + j] * b[i + j];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

#define PORTABLE_TYPE(name, dq, elements, bytes)                                                                \
    static void gemv_f32_##name(const uint8_t *rows, size_t row_bytes, size_t n, size_t k, const float *x,      \
                                float *y) {                                                                    \
        gemv_f32_rows(rows, row_bytes, n, k, x, y, dq, elements, bytes, dot_portable);                          \
    }                                                                                                          \
    static void dequant_##name(const uint8_t *row, size_t k, float *out) { dq_row(row, k, out, dq, elements, bytes); }

PORTABLE_TYPE(q4_0, dq_q4_0, 32, 18)
PORTABLE_TYPE(q4_1, dq_q4_1, 32, 20)
PORTABLE_TYPE(q5_0, dq_q5_0, 32, 22)
PORTABLE_TYPE(q5_1, dq_q5_1, 32, 24)
PORTABLE_TYPE(q8_0, dq_q8_0, 32, 34)
PORTABLE_TYPE(q4_k, dq_q4_k, 256, 144)
PORTABLE_TYPE(q5_k, dq_q5_k, 256, 176)
PORTABLE_TYPE(q6_k, dq_q6_k, 256, 210)

static int always(void) { return 1; }

const cpu_isa cpu_isa_portable = {
    .name = "portable",
    .usable = always,
    .quantize = quantize_portable,
    .act_layout = {ACT_NATURAL},
    .gemm_q8 = {gemm_q8_q4_0, gemm_q8_q4_1, gemm_q8_q5_0, gemm_q8_q5_1, gemm_q8_q8_0, gemm_q8_q4_k, gemm_q8_q5_k,
                gemm_q8_q6_k},
    .gemv_f32 = {gemv_f32_q4_0, gemv_f32_q4_1, gemv_f32_q5_0, gemv_f32_q5_1, gemv_f32_q8_0, gemv_f32_q4_k,
                 gemv_f32_q5_k, gemv_f32_q6_k},
    .dequant = {dequant_q4_0, dequant_q4_1, dequant_q5_0, dequant_q5_1, dequant_q8_0, dequant_q4_k, dequant_q5_k,
                dequant_q6_k},
};
