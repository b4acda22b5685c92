// GGUF block types, read as stored. A row is split into units of 32 elements; a unit is two runs of 16
// (lo, hi), each 16-aligned in K and inside one scale block, so every element's value is
//     scale_run * code + bias_run
// with an unsigned integer code (0..255). Unit::lo/hi hold the run's 16 codes, code j in byte j % 4 of
// word j / 4. The layouts are GGML's (ggml-common.h: block_q4_0 ... block_q6_K); the per-type comments
// say where each unit's bytes sit and which elements its runs are.
#pragma once
#include "ed_cuda_args.h"
#include "prelude.cuh"

struct Unit {
    u32 lo[4], hi[4];
    float scale_lo, bias_lo, scale_hi, bias_hi;
};

// Spread 4 bits (t & 15) to bit 4 of each byte: bit i of t goes to bit 8i + 4 (the 5th bit of a code).
ED_DEV u32 spread_bit4(u32 t) { return ((t << 4) * 0x00204081u) & 0x10101010u; }

ED_DEV float half_lo(u32 w) { return h2f((u16)(w & 0xFFFF)); }
ED_DEV float half_hi(u32 w) { return h2f((u16)(w >> 16)); }

template <int TYPE> struct Block;

// Q4_0: 18 bytes per 32: d (f16), qs[16]; element j < 16 is qs[j] & 15, element j + 16 is qs[j] >> 4;
// value d * (q - 8). One block per unit: lo = elements 0..15, hi = 16..31.
template <> struct Block<ED_Q4_0> {
    static constexpr int ELEMS = 32, BYTES = 18;
    ED_DEV static void runs(int u, int &lo, int &hi) { lo = 32 * u, hi = 32 * u + 16; }
    ED_DEV static void decode(const u8 *row, int u, Unit &o) {
        const u8 *b = row + BYTES * u;
        u32 q[4];
        ld16_a2(b + 2, q);
        const float d = h2f((u16)ld16(b));
#pragma unroll
        for (int w = 0; w < 4; ++w) o.lo[w] = q[w] & 0x0F0F0F0Fu, o.hi[w] = (q[w] >> 4) & 0x0F0F0F0Fu;
        o.scale_lo = o.scale_hi = d;
        o.bias_lo = o.bias_hi = -8.0f * d;
    }
};

// Q4_1: 20 bytes per 32: d, m (f16), qs[16] as Q4_0; value d * q + m. Rows are 4-byte aligned.
template <> struct Block<ED_Q4_1> {
    static constexpr int ELEMS = 32, BYTES = 20;
    ED_DEV static void runs(int u, int &lo, int &hi) { lo = 32 * u, hi = 32 * u + 16; }
    ED_DEV static void decode(const u8 *row, int u, Unit &o) {
        const u8 *b = row + BYTES * u;
        const u32 dm = ld32(b);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const u32 q = ld32(b + 4 + 4 * w);
            o.lo[w] = q & 0x0F0F0F0Fu, o.hi[w] = (q >> 4) & 0x0F0F0F0Fu;
        }
        o.scale_lo = o.scale_hi = half_lo(dm);
        o.bias_lo = o.bias_hi = half_hi(dm);
    }
};

// Q5_0: 22 bytes per 32: d, qh (32 bits: bit j is element j's 5th bit), qs[16] as Q4_0; value d * (q - 16).
template <> struct Block<ED_Q5_0> {
    static constexpr int ELEMS = 32, BYTES = 22;
    ED_DEV static void runs(int u, int &lo, int &hi) { lo = 32 * u, hi = 32 * u + 16; }
    ED_DEV static void decode(const u8 *row, int u, Unit &o) {
        const u8 *b = row + BYTES * u;
        u32 q[4];
        ld16_a2(b + 6, q);
        const u32 qh = ld4_a2(b + 2);
        const float d = h2f((u16)ld16(b));
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            o.lo[w] = (q[w] & 0x0F0F0F0Fu) | spread_bit4((qh >> (4 * w)) & 15);
            o.hi[w] = ((q[w] >> 4) & 0x0F0F0F0Fu) | spread_bit4((qh >> (16 + 4 * w)) & 15);
        }
        o.scale_lo = o.scale_hi = d;
        o.bias_lo = o.bias_hi = -16.0f * d;
    }
};

// Q5_1: 24 bytes per 32: d, m, qh, qs[16]; value d * q + m. Rows are 4-byte aligned.
template <> struct Block<ED_Q5_1> {
    static constexpr int ELEMS = 32, BYTES = 24;
    ED_DEV static void runs(int u, int &lo, int &hi) { lo = 32 * u, hi = 32 * u + 16; }
    ED_DEV static void decode(const u8 *row, int u, Unit &o) {
        const u8 *b = row + BYTES * u;
        const u32 dm = ld32(b), qh = ld32(b + 4);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const u32 q = ld32(b + 8 + 4 * w);
            o.lo[w] = (q & 0x0F0F0F0Fu) | spread_bit4((qh >> (4 * w)) & 15);
            o.hi[w] = ((q >> 4) & 0x0F0F0F0Fu) | spread_bit4((qh >> (16 + 4 * w)) & 15);
        }
        o.scale_lo = o.scale_hi = half_lo(dm);
        o.bias_lo = o.bias_hi = half_hi(dm);
    }
};

// Q8_0: 34 bytes per 32: d, qs[32] (int8); value d * qs. Codes are qs + 128 (0..255), bias -128 d.
template <> struct Block<ED_Q8_0> {
    static constexpr int ELEMS = 32, BYTES = 34;
    ED_DEV static void runs(int u, int &lo, int &hi) { lo = 32 * u, hi = 32 * u + 16; }
    ED_DEV static void decode(const u8 *row, int u, Unit &o) {
        const u8 *b = row + BYTES * u;
        ld16_a2(b + 2, o.lo);
        ld16_a2(b + 18, o.hi);
        const float d = h2f((u16)ld16(b));
#pragma unroll
        for (int w = 0; w < 4; ++w) o.lo[w] ^= 0x80808080u, o.hi[w] ^= 0x80808080u;
        o.scale_lo = o.scale_hi = d;
        o.bias_lo = o.bias_hi = -128.0f * d;
    }
};

// The K-quants' 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes s (3 words).
ED_DEV u32 scale_byte(u32 s0, u32 s1, u32 s2, int j) {
    const u32 w = j < 4 ? s0 : (j < 8 ? s1 : s2);
    return (w >> (8 * (j & 3))) & 0xFF;
}
ED_DEV void k_scale_min(u32 s0, u32 s1, u32 s2, int j, float &sc, float &mn) {
    u32 a, b;
    if (j < 4) {
        a = scale_byte(s0, s1, s2, j) & 63;
        b = scale_byte(s0, s1, s2, j + 4) & 63;
    } else {
        const u32 hi = scale_byte(s0, s1, s2, j + 4);
        a = (hi & 15) | ((scale_byte(s0, s1, s2, j - 4) >> 6) << 4);
        b = (hi >> 4) | ((scale_byte(s0, s1, s2, j) >> 6) << 4);
    }
    sc = (float)a, mn = (float)b;
}

// Q4_K: 144 bytes per 256: d, dmin (f16), scales[12] (8 packed 6-bit scale/min pairs), qs[128]. Group g
// (0..3) of 64 elements is qs[32g .. 32g+31]: element 64g + l is its byte l's low nibble (sub-block 2g), 64g
// + 32 + l the high nibble (sub-block 2g + 1); value d * sc * q - dmin * m. Unit sub = 2g + h (h: which 16
// bytes of the group): lo = 64g + 16h + [0, 16), hi = lo + 32. Rows are 16-byte aligned.
template <> struct Block<ED_Q4_K> {
    static constexpr int ELEMS = 256, BYTES = 144;
    ED_DEV static void runs(int u, int &lo, int &hi) {
        const int sub = u & 7;
        lo = 256 * (u >> 3) + 64 * (sub >> 1) + 16 * (sub & 1), hi = lo + 32;
    }
    ED_DEV static void decode(const u8 *row, int u, Unit &o) {
        const u8 *b = row + BYTES * (u >> 3);
        const int g = (u & 7) >> 1, h = u & 1;
        const uint4 head = ld128(b);
        u32 q[4];
        ld16_a16(b + 16 + 32 * g + 16 * h, q);
#pragma unroll
        for (int w = 0; w < 4; ++w) o.lo[w] = q[w] & 0x0F0F0F0Fu, o.hi[w] = (q[w] >> 4) & 0x0F0F0F0Fu;
        const float d = half_lo(head.x), dmin = half_hi(head.x);
        float sc, mn;
        k_scale_min(head.y, head.z, head.w, 2 * g, sc, mn);
        o.scale_lo = d * sc, o.bias_lo = -(dmin * mn);
        k_scale_min(head.y, head.z, head.w, 2 * g + 1, sc, mn);
        o.scale_hi = d * sc, o.bias_hi = -(dmin * mn);
    }
};

// Q5_K: 176 bytes per 256: d, dmin, scales[12], qh[32], qs[128]. As Q4_K, plus the 5th bit of element
// 64g + l (l < 32) in bit 2g of qh[l] and of element 64g + 32 + l in bit 2g + 1. Rows are 16-byte aligned.
template <> struct Block<ED_Q5_K> {
    static constexpr int ELEMS = 256, BYTES = 176;
    ED_DEV static void runs(int u, int &lo, int &hi) { Block<ED_Q4_K>::runs(u, lo, hi); }
    ED_DEV static void decode(const u8 *row, int u, Unit &o) {
        const u8 *b = row + BYTES * (u >> 3);
        const int g = (u & 7) >> 1, h = u & 1;
        const uint4 head = ld128(b);
        u32 q[4], qh[4];
        ld16_a16(b + 48 + 32 * g + 16 * h, q);
        ld16_a16(b + 16 + 16 * h, qh);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            o.lo[w] = (q[w] & 0x0F0F0F0Fu) | (((qh[w] >> (2 * g)) & 0x01010101u) << 4);
            o.hi[w] = ((q[w] >> 4) & 0x0F0F0F0Fu) | (((qh[w] >> (2 * g + 1)) & 0x01010101u) << 4);
        }
        const float d = half_lo(head.x), dmin = half_hi(head.x);
        float sc, mn;
        k_scale_min(head.y, head.z, head.w, 2 * g, sc, mn);
        o.scale_lo = d * sc, o.bias_lo = -(dmin * mn);
        k_scale_min(head.y, head.z, head.w, 2 * g + 1, sc, mn);
        o.scale_hi = d * sc, o.bias_hi = -(dmin * mn);
    }
};

// Q6_K: 210 bytes per 256: ql[128], qh[64], scales[16] (int8), d. Half n (0, 1) of 128 elements uses
// ql[64n ..], qh[32n ..], scales[8n ..]; for l < 32 its elements l, l + 32, l + 64, l + 96 have low bits
// ql[l] & 15, ql[l + 32] & 15, ql[l] >> 4, ql[l + 32] >> 4 and high bits (qh[l] >> 0, 2, 4, 6) & 3, and
// scales[l / 16 + 0, 2, 4, 6]; value d * scale * (q - 32). Unit sub = 4n + 2s + a: lo = 128n + 32a + 16s
// + [0, 16), hi = lo + 64 (16-element sub-blocks: one scale per run). Rows are only 2-byte aligned.
template <> struct Block<ED_Q6_K> {
    static constexpr int ELEMS = 256, BYTES = 210;
    ED_DEV static void runs(int u, int &lo, int &hi) {
        const int sub = u & 7;
        lo = 256 * (u >> 3) + 128 * (sub >> 2) + 32 * (sub & 1) + 16 * ((sub >> 1) & 1), hi = lo + 64;
    }
    ED_DEV static void decode(const u8 *row, int u, Unit &o) {
        const u8 *b = row + BYTES * (u >> 3);
        const int sub = u & 7, n = sub >> 2, s = (sub >> 1) & 1, a = sub & 1;
        u32 ql[4], qh[4];
        ld16_a2(b + 64 * n + 32 * a + 16 * s, ql);
        ld16_a2(b + 128 + 32 * n + 16 * s, qh);
        const int sc_lo = (int)(signed char)ld8(b + 192 + 8 * n + s + 2 * a);
        const int sc_hi = (int)(signed char)ld8(b + 192 + 8 * n + s + 2 * a + 4);
        const float d = h2f((u16)ld16(b + 208));
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            o.lo[w] = (ql[w] & 0x0F0F0F0Fu) | (((qh[w] >> (2 * a)) & 0x03030303u) << 4);
            o.hi[w] = ((ql[w] >> 4) & 0x0F0F0F0Fu) | (((qh[w] >> (4 + 2 * a)) & 0x03030303u) << 4);
        }
        o.scale_lo = d * (float)sc_lo, o.bias_lo = -32.0f * o.scale_lo;
        o.scale_hi = d * (float)sc_hi, o.bias_hi = -32.0f * o.scale_hi;
    }
};
