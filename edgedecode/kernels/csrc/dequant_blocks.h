/* Dequantizing one GGUF block into floats, per type, in plain C: the exact weights accuracy level 0 multiplies by
 * and GatherGGUF writes. Included by each instruction-set file, whose target attributes let the compiler vectorize
 * the loops; the values are the same everywhere (each is one float product, or one product and one sum). */
#ifndef EDGEDECODE_DEQUANT_BLOCKS_H
#define EDGEDECODE_DEQUANT_BLOCKS_H

#include "ggml_blocks.h"

static inline void dq_q4_0(const uint8_t *b, float *out) {
    const float d = f16_to_f32(load_u16(b));
    for (int j = 0; j < 16; j++) {
        out[j] = d * (float)((b[2 + j] & 15) - 8);
        out[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
    }
}

static inline void dq_q4_1(const uint8_t *b, float *out) {
    const float d = f16_to_f32(load_u16(b)), m = f16_to_f32(load_u16(b + 2));
    for (int j = 0; j < 16; j++) {
        out[j] = d * (float)(b[4 + j] & 15) + m;
        out[j + 16] = d * (float)(b[4 + j] >> 4) + m;
    }
}

static inline void dq_q5_0(const uint8_t *b, float *out) {
    const float d = f16_to_f32(load_u16(b));
    const uint32_t qh = load_u32(b + 2);
    for (int j = 0; j < 16; j++) {
        const int lo = (b[6 + j] & 15) | (int)((qh >> j) & 1) << 4;
        const int hi = (b[6 + j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        out[j] = d * (float)(lo - 16);
        out[j + 16] = d * (float)(hi - 16);
    }
}

static inline void dq_q5_1(const uint8_t *b, float *out) {
    const float d = f16_to_f32(load_u16(b)), m = f16_to_f32(load_u16(b + 2));
    const uint32_t qh = load_u32(b + 4);
    for (int j = 0; j < 16; j++) {
        const int lo = (b[8 + j] & 15) | (int)((qh >> j) & 1) << 4;
        const int hi = (b[8 + j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        out[j] = d * (float)lo + m;
        out[j + 16] = d * (float)hi + m;
    }
}

static inline void dq_q8_0(const uint8_t *b, float *out) {
    const float d = f16_to_f32(load_u16(b));
    for (int j = 0; j < 32; j++)
        out[j] = d * (float)(int8_t)b[2 + j];
}

static inline void dq_q4_k(const uint8_t *b, float *out) {
    const float d = f16_to_f32(load_u16(b)), dmin = f16_to_f32(load_u16(b + 2));
    const uint8_t *qs = b + 16;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        k_scale_min(b + 4, j, &sc, &m);
        const float scale = d * (float)sc, offset = dmin * (float)m;
        const uint8_t *q = qs + 32 * (j / 2);
        const int shift = 4 * (j & 1);
        for (int l = 0; l < 32; l++)
            out[32 * j + l] = scale * (float)((q[l] >> shift) & 15) - offset;
    }
}

static inline void dq_q5_k(const uint8_t *b, float *out) {
    const float d = f16_to_f32(load_u16(b)), dmin = f16_to_f32(load_u16(b + 2));
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        k_scale_min(b + 4, j, &sc, &m);
        const float scale = d * (float)sc, offset = dmin * (float)m;
        const uint8_t *q = qs + 32 * (j / 2);
        const int shift = 4 * (j & 1);
        for (int l = 0; l < 32; l++) {
            const int v = ((q[l] >> shift) & 15) | ((qh[l] >> j) & 1) << 4;
            out[32 * j + l] = scale * (float)v - offset;
        }
    }
}

static inline void dq_q6_k(const uint8_t *b, float *out) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16_to_f32(load_u16(b + 208));
    for (int h = 0; h < 2; h++) {
        const uint8_t *l8 = ql + 64 * h, *h8 = qh + 32 * h;
        float *o = out + 128 * h;
        const int8_t *s = sc + 8 * h;
        for (int l = 0; l < 32; l++) {
            const int q1 = (l8[l] & 15) | ((h8[l] >> 0) & 3) << 4;
            const int q2 = (l8[l + 32] & 15) | ((h8[l] >> 2) & 3) << 4;
            const int q3 = (l8[l] >> 4) | ((h8[l] >> 4) & 3) << 4;
            const int q4 = (l8[l + 32] >> 4) | ((h8[l] >> 6) & 3) << 4;
            const int is = l / 16;
            o[l] = d * (float)s[is] * (float)(q1 - 32);
            o[l + 32] = d * (float)s[is + 2] * (float)(q2 - 32);
            o[l + 64] = d * (float)s[is + 4] * (float)(q3 - 32);
            o[l + 96] = d * (float)s[is + 6] * (float)(q4 - 32);
        }
    }
}

typedef void (*dq_block_fn)(const uint8_t *block, float *out);

/* The whole row: k / elements blocks. */
static inline void dq_row(const uint8_t *row, size_t k, float *out, dq_block_fn dq, int elements, int bytes) {
    for (size_t b = 0; b < k / (size_t)elements; b++)
        dq(row + b * (size_t)bytes, out + b * (size_t)elements);
}

/* Accuracy level 0: y[r] = x . dequant(row r), block by block through a small float buffer; `dot` is the path's
 * float dot product of `elements` floats. */
static inline void gemv_f32_rows(const uint8_t *rows, size_t row_bytes, size_t n, size_t k, const float *x, float *y,
                                 dq_block_fn dq, int elements, int bytes, float (*dot)(const float *, const float *,
                                                                                      size_t)) {
    float w[256];
    for (size_t r = 0; r < n; r++) {
        const uint8_t *row = rows + r * row_bytes;
        float acc = 0.0f;
        for (size_t b = 0; b < k / (size_t)elements; b++) {
            dq(row + b * (size_t)bytes, w);
            acc += dot(w, x + b * (size_t)elements, (size_t)elements);
        }
        y[r] = acc;
    }
}

#endif
