/* The x86 SIMD kernels, written once for two instruction sets and included by cpu_avx2.c and cpu_avx512.c.
 *
 * The including file defines X86_TARGET (the function target attribute), X86_VNNI (1: AVX-512 VNNI's dpbusd/dpwssd
 * on 256-bit vectors; 0: AVX2's maddubs + madd), X86_MASK (1: AVX-512BW mask registers for Q5's fifth bit),
 * X86_TILE (how many activation rows share one unpacking of a weight row when M > 1) and X86_ISA / X86_NAME (the
 * cpu_isa symbol and name). Every function carries the target attribute, so the library is built
 * without -m flags and runs on any x86-64; cpu_dispatch.c picks a path the CPU has.
 *
 * Shapes: a weight row is nb blocks; vectors are 256-bit (32 codes, one 32-element block or sub-block, per vector).
 * At accuracy 4, 32-element types take 8 blocks at a time: eight per-block integer dot products (8 int32 lanes each)
 * are reduced to one vector of 8 block sums (lane j = block j), scaled by the 8 weight scales times the 8 activation
 * scales and accumulated in float; the K-quants accumulate each 256-element super-block's integer sum with its
 * sub-block scales applied in the integer domain (dpwssd / madd), then scale once. Rounding differs from the portable
 * path only in the order of float additions (cpu_portable.c has the formulas).
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#define KERNEL static inline __attribute__((target(X86_TARGET), always_inline))
#define ENTRY static __attribute__((target(X86_TARGET)))

/* ---- integer dot products of unsigned codes (0..255) with signed activation codes ---- */

/* acc + per-lane sums of 4 products u*s (for AVX2, u*s pairs must stay within int16: true for codes < 128). */
KERNEL __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if X86_VNNI
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* acc + per-lane sums of 2 products of int16 pairs p*w. */
KERNEL __m256i dot_s16(__m256i acc, __m256i p, __m256i w) {
#if X86_VNNI
    return _mm256_dpwssd_epi32(acc, p, w);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, w));
#endif
}

/* Eight vectors of 8 int32 -> one vector whose lane j is the sum of v[j]'s lanes. */
KERNEL __m256i sum_lanes_8x8(const __m256i v[8]) {
    const __m256i s01 = _mm256_hadd_epi32(v[0], v[1]), s23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i s45 = _mm256_hadd_epi32(v[4], v[5]), s67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i s0123 = _mm256_hadd_epi32(s01, s23), s4567 = _mm256_hadd_epi32(s45, s67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20),
                            _mm256_permute2x128_si256(s0123, s4567, 0x31));
}

KERNEL float sum_f32x8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The float16 at `at` in each of 8 blocks `stride` bytes apart, as 8 floats. */
KERNEL __m256 f16_x8(const uint8_t *p, size_t stride) {
    const __m128i h = _mm_setr_epi16((short)load_u16(p), (short)load_u16(p + stride), (short)load_u16(p + 2 * stride),
                                     (short)load_u16(p + 3 * stride), (short)load_u16(p + 4 * stride),
                                     (short)load_u16(p + 5 * stride), (short)load_u16(p + 6 * stride),
                                     (short)load_u16(p + 7 * stride));
    return _mm256_cvtph_ps(h);
}

/* The same for blocks in the order 0, 2, 4, 6, 1, 3, 5, 7: p0 points at block 0's field, p1 at block 1's. */
KERNEL __m256 f16_x8_at(const uint8_t *p0, const uint8_t *p1, size_t stride) {
    const size_t two = 2 * stride;
    const __m128i h = _mm_setr_epi16((short)load_u16(p0), (short)load_u16(p0 + two), (short)load_u16(p0 + 2 * two),
                                     (short)load_u16(p0 + 3 * two), (short)load_u16(p1), (short)load_u16(p1 + two),
                                     (short)load_u16(p1 + 2 * two), (short)load_u16(p1 + 3 * two));
    return _mm256_cvtph_ps(h);
}

KERNEL float f16(const uint8_t *p) { return _cvtsh_ss(load_u16(p)); }

/* The 32-bit words at p0 + 2i*stride (lanes 0..3) and p1 + 2i*stride (lanes 4..7). */
KERNEL __m256i u32_x8_at(const uint8_t *p0, const uint8_t *p1, size_t stride) {
    const size_t two = 2 * stride;
    __m128i lo = _mm_cvtsi32_si128((int)load_u32(p0)), hi = _mm_cvtsi32_si128((int)load_u32(p1));
    lo = _mm_insert_epi32(lo, (int)load_u32(p0 + two), 1);
    hi = _mm_insert_epi32(hi, (int)load_u32(p1 + two), 1);
    lo = _mm_insert_epi32(lo, (int)load_u32(p0 + 2 * two), 2);
    hi = _mm_insert_epi32(hi, (int)load_u32(p1 + 2 * two), 2);
    lo = _mm_insert_epi32(lo, (int)load_u32(p0 + 3 * two), 3);
    hi = _mm_insert_epi32(hi, (int)load_u32(p1 + 3 * two), 3);
    return _mm256_set_m128i(hi, lo);
}

/* Two float16 per int32 lane (a block's d and m): the low halves and the high halves as 8 floats each. */
KERNEL void f16_pairs(__m256i fields, __m256 *low, __m256 *high) {
    const __m256i halves = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(fields, _mm256_set1_epi32(0xffff)), _mm256_srli_epi32(fields, 16)), 0xd8);
    *low = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
    *high = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
}

/* 16 bytes of nibbles -> 32 codes in element order (low nibbles are elements 0..15, high 16..31). */
KERNEL __m256i nibbles_32(const uint8_t *p) {
    const __m128i x = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(15));
}

/* Q5: codes | 16 where bit j of the 32-bit qh is set. */
KERNEL __m256i fifth_bit(__m256i codes, uint32_t qh) {
#if X86_MASK
    return _mm256_mask_add_epi8(codes, (__mmask32)qh, codes, _mm256_set1_epi8(16));
#else
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                  0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_or_si256(codes, _mm256_and_si256(set, _mm256_set1_epi8(16)));
#endif
}

KERNEL __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* Weights are read once, in order, from memory: asking for the lines PREFETCH_AHEAD bytes ahead keeps enough reads
 * in flight that a core streams at memory speed (measured on Zen 4, Q4_0 2048 x 2048 from DRAM, CPU time: 1.47 ns a
 * block without, 1.09 with 4-8 KiB ahead, 1.28 with 1 KiB). The prefetcher of the hardware alone lets the core stall. */
#define PREFETCH_AHEAD 4096
KERNEL void prefetch_ahead(const uint8_t *p, size_t bytes) {
    for (size_t line = 0; line < bytes; line += 64)
        _mm_prefetch((const char *)p + PREFETCH_AHEAD + line, _MM_HINT_T0);
}

/* ---- activation quantization (the rule in cpu_kernels.h; results equal the portable path's bit for bit) ---- */

ENTRY void quantize(const float *x, size_t k, int block, int layout, act_q8 *a) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (size_t b = 0; b < k / (size_t)block; b++) {
        const float *xb = x + b * (size_t)block;
        __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int i = 0; i < block; i += 8) {
            const __m256 v = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i));
            amax = _mm256_max_ps(amax, v);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ)); /* inf or nan */
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        float d = _mm_cvtss_f32(m) / 127.0f;
        float inverse = d != 0.0f ? 1.0f / d : 0.0f;
        if (_mm256_movemask_ps(bad)) {
            d = NAN;
            inverse = 0.0f;
        }
        a->d[b] = d;
        const __m256 iv = _mm256_set1_ps(inverse);
        for (int i = 0; i < block; i += 32) {
            /* the products round to nearest even (MXCSR's default), as nearbyintf does in the portable path */
            const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), iv));
            const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8), iv));
            const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 16), iv));
            const __m256i q3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 24), iv));
            __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
            q = _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(a->q + b * (size_t)block + (size_t)i), q);
            /* sums of each 16 codes: madd with ones gives pair sums; two hadds finish the groups */
            const __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
            const __m256i quads = _mm256_hadd_epi32(pairs, pairs);
            const __m256i groups = _mm256_hadd_epi32(quads, quads); /* lanes 0 and 4: the two groups of 16 */
            const size_t g = (b * (size_t)block + (size_t)i) / 16;
            a->sum16[g] = (int16_t)_mm256_extract_epi32(groups, 0);
            a->sum16[g + 1] = (int16_t)_mm256_extract_epi32(groups, 4);
            a->sum32[g / 2] = (int16_t)(a->sum16[g] + a->sum16[g + 1]);
        }
    }
    if (layout == ACT_PAIRED)
        act_q8_pair(a, k);
}

/* ---- accuracy level 4, 32-element types ---- */

/* The five 32-element types differ in where the codes and scales sit, how codes unpack, and the offset. */
enum { LEGACY_Q4_0, LEGACY_Q4_1, LEGACY_Q5_0, LEGACY_Q5_1, LEGACY_Q8_0 };

typedef struct {
    int type, bytes, codes_at, qh_at, offset, has_min;
} legacy_layout;

KERNEL int sum_i32x4(__m128i v) {
    v = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
    return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 1)));
}

/* Blocks b..b+7's weight scales (and Q4_1/Q5_1's mins) in the lane order of their dot products. */
KERNEL void legacy_weight_scales(legacy_layout t, const uint8_t *w, __m256 *dw, __m256 *mw) {
    const size_t s = (size_t)t.bytes;
#if X86_VNNI
    if (t.bytes <= 20) { /* Q4_0, Q4_1: four blocks' fields lie in 64 bytes, and w + 4s + 64 <= the group's end */
        const __m512i first = _mm512_loadu_si512(w), second = _mm512_loadu_si512(w + 4 * s);
        if (t.has_min) { /* 32-bit words (d | m): block j at dword j*s/4; second's at 16 + j*s/4; paired order */
            const int q = t.bytes / 4;
            const __m512i idx = _mm512_setr_epi32(0, 2 * q, 16, 16 + 2 * q, q, 3 * q, 16 + q, 16 + 3 * q, 0, 0, 0, 0, 0,
                                                  0, 0, 0);
            f16_pairs(_mm512_castsi512_si256(_mm512_permutex2var_epi32(first, idx, second)), dw, mw);
        } else { /* 16-bit words: block j's d at word j*s/2 */
            const short h = (short)(t.bytes / 2);
            const __m512i idx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                 (short)(32 + 3 * h), (short)(32 + h), 3 * h, h, (short)(32 + 2 * h), 32,
                                                 2 * h, 0);
            *dw = _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutex2var_epi16(first, idx, second)));
            *mw = *dw;
        }
        return;
    }
#endif
    if (t.has_min) { /* d and m side by side: one 32-bit load a block */
        f16_pairs(u32_x8_at(w, w + s, s), dw, mw);
    } else {
        *dw = t.type == LEGACY_Q8_0 ? f16_x8(w, s) : f16_x8_at(w, w + s, s);
        *mw = *dw;
    }
}

/* Blocks b..b+7's float contribution from their 8 integer dot products in `order` (lane i = block b + order[i]). */
KERNEL __m256 legacy_scale(legacy_layout t, const act_q8 *a, size_t b, __m256i isum, __m256i order, __m256 dw,
                           __m256 mw, __m256 acc) {
    const __m256i sums = _mm256_permutevar8x32_epi32(
        _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(a->sum32 + b))), order);
    if (t.offset)
        isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(sums, _mm256_set1_epi32(t.offset)));
    const __m256 da = _mm256_permutevar8x32_ps(_mm256_loadu_ps(a->d + b), order);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, da), acc);
    if (t.has_min)
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(mw, da), acc);
    return acc;
}

/* One block's float contribution from its integer dot product (the tail). */
KERNEL float legacy_one(legacy_layout t, const uint8_t *w, const act_q8 *a, size_t b, int isum) {
    float y = f16(w) * a->d[b] * (float)(isum - t.offset * a->sum32[b]);
    if (t.has_min)
        y += f16(w + 2) * a->d[b] * (float)a->sum32[b];
    return y;
}

/* Two Q4/Q5 blocks' codes, side by side (ACT_PAIRED's order): lo = both blocks' elements 0..15, hi = 16..31. */
KERNEL void legacy_pair_codes(legacy_layout t, const uint8_t *w, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(w + t.codes_at))),
                                              _mm_loadu_si128((const __m128i *)(w + t.bytes + t.codes_at)), 1);
    *lo = _mm256_and_si256(x, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
    if (t.qh_at) { /* bit j of a block's qh is element j's fifth bit: elements 0..15 are the low nibbles */
        const uint32_t h0 = load_u32(w + t.qh_at), h1 = load_u32(w + t.bytes + t.qh_at);
        *lo = fifth_bit(*lo, (h0 & 0xffffu) | h1 << 16);
        *hi = fifth_bit(*hi, h0 >> 16 | (h1 & 0xffff0000u));
    }
}

/* One weight row of a 32-element type against mt activation rows (mt a constant where this is inlined): out[i]. */
KERNEL void legacy_row(legacy_layout t, const uint8_t *w, size_t nb, const act_q8 *a, const int mt, float *out) {
    const size_t s = (size_t)t.bytes;
    const __m256i paired_order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256i natural_order = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 acc[X86_TILE];
    float tail[X86_TILE];
    for (int i = 0; i < mt; i++) {
        acc[i] = _mm256_setzero_ps();
        tail[i] = 0.0f;
    }
    size_t b = 0;
    for (; b + 8 <= nb; b += 8, w += 8 * s) {
        prefetch_ahead(w, 8 * s);
        __m256 dw, mw;
        legacy_weight_scales(t, w, &dw, &mw);
        if (t.type == LEGACY_Q8_0) {
            /* the sign moves from the weight onto the activation, so the unsigned operand is |w| <= 128 and
             * AVX2's int16 pair sums cannot saturate */
            __m256i v[8], magnitude[8];
            for (int j = 0; j < 8; j++) {
                v[j] = load256(w + (size_t)j * s + 2);
                magnitude[j] = _mm256_sign_epi8(v[j], v[j]);
            }
            for (int i = 0; i < mt; i++) {
                const int8_t *q = a[i].q + 32 * b;
                __m256i dots[8];
                for (int j = 0; j < 8; j++)
                    dots[j] = dot_u8s8(_mm256_setzero_si256(), magnitude[j], _mm256_sign_epi8(load256(q + 32 * j), v[j]));
                acc[i] = legacy_scale(t, &a[i], b, sum_lanes_8x8(dots), natural_order, dw, mw, acc[i]);
            }
        } else {
            __m256i lo[4], hi[4];
            for (int p = 0; p < 4; p++)
                legacy_pair_codes(t, w + 2 * (size_t)p * s, &lo[p], &hi[p]);
            for (int i = 0; i < mt; i++) {
                const int8_t *q = a[i].q + 32 * b;
                __m256i v[4];
                for (int p = 0; p < 4; p++)
                    v[p] = dot_u8s8(dot_u8s8(_mm256_setzero_si256(), lo[p], load256(q + 64 * p)), hi[p],
                                    load256(q + 64 * p + 32));
                /* three horizontal adds leave lane j = block [0,2,4,6,1,3,5,7][j] */
                const __m256i isum = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
                acc[i] = legacy_scale(t, &a[i], b, isum, paired_order, dw, mw, acc[i]);
            }
        }
    }
    while (b < nb) {
        if (t.type != LEGACY_Q8_0 && b + 2 <= nb) {
            __m256i lo, hi;
            legacy_pair_codes(t, w, &lo, &hi);
            for (int i = 0; i < mt; i++) {
                const int8_t *q = a[i].q + 32 * b;
                const __m256i v = dot_u8s8(dot_u8s8(_mm256_setzero_si256(), lo, load256(q)), hi, load256(q + 32));
                tail[i] += legacy_one(t, w, &a[i], b, sum_i32x4(_mm256_castsi256_si128(v)));
                tail[i] += legacy_one(t, w + s, &a[i], b + 1, sum_i32x4(_mm256_extracti128_si256(v, 1)));
            }
            w += 2 * s;
            b += 2;
        } else { /* Q8_0, or an odd last block, whose codes stay in element order */
            __m256i u, v = _mm256_setzero_si256();
            if (t.type == LEGACY_Q8_0) {
                v = load256(w + 2);
                u = _mm256_sign_epi8(v, v);
            } else {
                u = nibbles_32(w + t.codes_at);
                if (t.qh_at)
                    u = fifth_bit(u, load_u32(w + t.qh_at));
            }
            for (int i = 0; i < mt; i++) {
                __m256i q = load256(a[i].q + 32 * b);
                if (t.type == LEGACY_Q8_0)
                    q = _mm256_sign_epi8(q, v);
                const __m256i d = dot_u8s8(_mm256_setzero_si256(), u, q);
                tail[i] += legacy_one(t, w, &a[i], b,
                                      sum_i32x4(_mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1))));
            }
            w += s;
            b += 1;
        }
    }
    for (int i = 0; i < mt; i++)
        out[i] = sum_f32x8(acc[i]) + tail[i];
}

/* ---- accuracy level 4, K-quants (one activation scale per 256-element super-block) ---- */

/* Q4_K/Q5_K's eight 6-bit scales and mins, as int16 [sc0..sc7] and [m0..m7], in vector registers throughout.
 * With the 12 bytes as dwords D0, D1, D2: sc0..3 = D0 & 63 (per byte), m0..3 = D1 & 63,
 * sc4..7 = (D2 & 15) | (D0 >> 6) << 4, m4..7 = (D2 >> 4 & 15) | (D1 >> 6) << 4. The 16-byte load reads 4 bytes of
 * the block's codes too, which are ignored. */
KERNEL void k_scales(const uint8_t *s12, __m128i *sc, __m128i *mins) {
    const __m128i v = _mm_loadu_si128((const __m128i *)s12);
    const __m128i low = _mm_and_si128(v, _mm_set1_epi8(63));                             /* [sc0..3, m0..3, ...] */
    const __m128i d2 = _mm_srlv_epi32(_mm_shuffle_epi32(v, 0xaa), _mm_setr_epi32(0, 4, 0, 0)); /* [D2, D2 >> 4] */
    const __m128i high = _mm_or_si128(_mm_and_si128(d2, _mm_set1_epi8(15)),
                                      _mm_and_si128(_mm_srli_epi32(v, 2), _mm_set1_epi8(0x30))); /* [sc4..7, m4..7] */
    const __m128i both = _mm_unpacklo_epi32(low, high); /* [sc0..3, sc4..7, m0..3, m4..7] */
    *sc = _mm_cvtepu8_epi16(both);
    *mins = _mm_cvtepu8_epi16(_mm_srli_si128(both, 8));
}

/* int16 lane `i` of x, in every int16 lane (x repeated in both 128-bit halves). */
KERNEL __m256i spread_i16(__m256i x, int i) {
    return _mm256_shuffle_epi8(x, _mm256_set1_epi16((short)(2 * i | (2 * i + 1) << 8)));
}

/* Q4_K (five 0) and Q5_K against mt activation rows:
 * y += (d*d_a) * sum_j sc_j sum q*a - (dmin*d_a) * sum_j m_j S32_j. */
KERNEL void k45_row(int bytes, int five, const uint8_t *w, size_t nb, const act_q8 *a, const int mt, float *out) {
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    __m256 acc[X86_TILE];
    __m128 acc_min[X86_TILE];
    for (int i = 0; i < mt; i++) {
        acc[i] = _mm256_setzero_ps();
        acc_min[i] = _mm_setzero_ps();
    }
    for (size_t b = 0; b < nb; b++, w += bytes) {
        prefetch_ahead(w, (size_t)bytes);
        __m128i sc16, m16;
        k_scales(w + 4, &sc16, &m16);
        const __m256i scales = _mm256_broadcastsi128_si256(sc16);
        const uint8_t *qs = w + (five ? 48 : 16);
        const __m256i high = five ? load256(w + 16) : _mm256_setzero_si256();
        /* two accumulators a row (even and odd sub-blocks), so the dot products do not wait on each other */
        __m256i even[X86_TILE], odd[X86_TILE];
        for (int i = 0; i < mt; i++)
            even[i] = odd[i] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i x = load256(qs + 32 * c);
            __m256i lo = _mm256_and_si256(x, m4), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
            if (five) { /* bit 2c / 2c+1 of each qh byte is the fifth bit of sub-block 2c / 2c+1 */
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * c), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * c + 1), one), 4));
            }
            const __m256i sc_lo = spread_i16(scales, 2 * c), sc_hi = spread_i16(scales, 2 * c + 1);
            for (int i = 0; i < mt; i++) {
                const int8_t *q = a[i].q + 256 * b + 64 * c;
                even[i] = dot_s16(even[i], _mm256_maddubs_epi16(lo, load256(q)), sc_lo);
                odd[i] = dot_s16(odd[i], _mm256_maddubs_epi16(hi, load256(q + 32)), sc_hi);
            }
        }
        const float d = f16(w), dmin = f16(w + 2);
        for (int i = 0; i < mt; i++) {
            const __m128i msum = _mm_madd_epi16(m16, _mm_loadu_si128((const __m128i *)(a[i].sum32 + 8 * b)));
            const float da = a[i].d[b];
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(even[i], odd[i])), _mm256_set1_ps(d * da),
                                     acc[i]);
            acc_min[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(msum), _mm_set1_ps(dmin * da), acc_min[i]);
        }
    }
    for (int i = 0; i < mt; i++) {
        __m128 mins = _mm_add_ps(acc_min[i], _mm_movehl_ps(acc_min[i], acc_min[i]));
        mins = _mm_add_ss(mins, _mm_movehdup_ps(mins));
        out[i] = sum_f32x8(acc[i]) - _mm_cvtss_f32(mins);
    }
}

/* Q6_K against mt activation rows: y += (d*d_a) * sum_s sc_s (sum_s q*a - 32 S16_s), q 0..63 unsigned. */
KERNEL void q6k_row(const uint8_t *w, size_t nb, const act_q8 *a, const int mt, float *out) {
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[X86_TILE];
    for (int i = 0; i < mt; i++)
        acc[i] = _mm256_setzero_ps();
    for (size_t b = 0; b < nb; b++, w += 210) {
        prefetch_ahead(w, 210);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(w + 192));
        const __m256i sc = _mm256_cvtepi8_epi16(sc8);
        /* even groups' scales in the low half, odd groups' in the high half (int16): the pair sums of a 32-code
         * vector cover groups g (low half) and g + 1 (high half), so one shuffle spreads both */
        const __m256i paired = _mm256_cvtepi8_epi16(
            _mm_shuffle_epi8(sc8, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
        __m256i part[X86_TILE][2]; /* two chains a row, as in Q4_K */
        for (int i = 0; i < mt; i++) {
            /* -32 * sum_s sc_s S16_s, lane-wise (only the total matters) */
            const __m256i offset = _mm256_madd_epi16(sc, _mm256_loadu_si256((const __m256i *)(a[i].sum16 + 16 * b)));
            part[i][0] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 5));
            part[i][1] = _mm256_setzero_si256();
        }
        for (int h = 0; h < 2; h++) {
            const __m256i ql0 = load256(w + 64 * h), ql1 = load256(w + 64 * h + 32), qh = load256(w + 128 + 32 * h);
            const __m256i codes[4] = {
                _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30)),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30)),
            };
            for (int t = 0; t < 4; t++) {
                const __m256i scale = spread_i16(paired, 4 * h + t); /* groups 8h+2t and 8h+2t+1 */
                for (int i = 0; i < mt; i++)
                    part[i][t & 1] = dot_s16(part[i][t & 1],
                                             _mm256_maddubs_epi16(codes[t], load256(a[i].q + 256 * b + 128 * h + 32 * t)),
                                             scale);
            }
        }
        const float d = f16(w + 208);
        for (int i = 0; i < mt; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(part[i][0], part[i][1])),
                                     _mm256_set1_ps(d * a[i].d[b]), acc[i]);
    }
    for (int i = 0; i < mt; i++)
        out[i] = sum_f32x8(acc[i]);
}

/* ---- accuracy level 0 and dequantization ---- */

/* 32 codes -> 32 float weights scale * code + bias (codes 0..15 with s0, b0; 16..31 with s1, b1) in w[0..3], each
 * rounded once by the fused multiply-add: the very values the portable decoders (dequant_blocks.h) compute, whose
 * products of a float16-derived scale and a small code are exact. */
KERNEL void weights_32(__m256i codes, int is_signed, __m256 s0, __m256 b0, __m256 s1, __m256 b1, __m256 w[4]) {
    const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int g = 0; g < 4; g++) {
        const __m256i c = is_signed ? _mm256_cvtepi8_epi32(part[g]) : _mm256_cvtepu8_epi32(part[g]);
        w[g] = _mm256_fmadd_ps(g < 2 ? s0 : s1, _mm256_cvtepi32_ps(c), g < 2 ? b0 : b1);
    }
}

/* The codes of chunk `sub` (0 for the 32-element types; 0..7 for the K-quants, 32 elements each) of a block, in
 * element order, with what turns them into weights: w = scale * code + bias for codes 0..15 and scale1 * code +
 * bias1 for 16..31 (Q6_K's two 16-element groups; the same pair otherwise). Q8_0's codes are signed (*is_signed). */
typedef struct {
    __m256i codes;
    float scale, bias, scale1, bias1;
    int is_signed;
} chunk_codes;

KERNEL chunk_codes block_codes(int qi, const uint8_t *w, int sub) {
    chunk_codes c = {.is_signed = 0};
    switch (qi) {
    case QI_Q4_0:
    case QI_Q5_0:
        c.scale = f16(w);
        c.codes = qi == QI_Q4_0 ? nibbles_32(w + 2) : fifth_bit(nibbles_32(w + 6), load_u32(w + 2));
        c.bias = c.scale * (qi == QI_Q4_0 ? -8.0f : -16.0f); /* exact: a float16 times a power of two */
        break;
    case QI_Q4_1:
    case QI_Q5_1:
        c.scale = f16(w);
        c.bias = f16(w + 2);
        c.codes = qi == QI_Q4_1 ? nibbles_32(w + 4) : fifth_bit(nibbles_32(w + 8), load_u32(w + 4));
        break;
    case QI_Q8_0:
        c.scale = f16(w);
        c.bias = 0.0f;
        c.codes = load256(w + 2);
        c.is_signed = 1;
        break;
    case QI_Q4_K:
    case QI_Q5_K: {
        int sc, m;
        k_scale_min(w + 4, sub, &sc, &m);
        c.scale = f16(w) * (float)sc;
        c.bias = -(f16(w + 2) * (float)m);
        const uint8_t *qs = w + (qi == QI_Q5_K ? 48 : 16) + 32 * (sub / 2);
        const __m256i x = load256(qs);
        c.codes = _mm256_and_si256(sub & 1 ? _mm256_srli_epi16(x, 4) : x, _mm256_set1_epi8(15));
        if (qi == QI_Q5_K) /* bit `sub` of qh[l] is element l's fifth bit */
            c.codes = _mm256_or_si256(
                c.codes, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(load256(w + 16), sub), _mm256_set1_epi8(1)),
                                           4));
        break;
    }
    default: { /* Q6_K: chunk sub = quarter t of half h; its two 16-element groups have their own scales */
        const int h = sub / 4, t = sub % 4;
        const int8_t *sc = (const int8_t *)(w + 192);
        const float d = f16(w + 208);
        c.scale = d * (float)sc[8 * h + 2 * t];
        c.scale1 = d * (float)sc[8 * h + 2 * t + 1];
        c.bias = -32.0f * c.scale;
        c.bias1 = -32.0f * c.scale1;
        const __m256i low = load256(w + 64 * h + 32 * (t & 1)), qh = load256(w + 128 + 32 * h);
        const __m256i nibbles = _mm256_and_si256(t < 2 ? low : _mm256_srli_epi16(low, 4), _mm256_set1_epi8(15));
        const __m256i two = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), _mm256_set1_epi8(3));
        c.codes = _mm256_or_si256(nibbles, _mm256_slli_epi16(two, 4));
        return c;
    }
    }
    c.scale1 = c.scale;
    c.bias1 = c.bias;
    return c;
}

/* The 32 weights of chunk `sub` of a block. */
KERNEL void block_weights(int qi, const uint8_t *w, int sub, __m256 out[4]) {
    const chunk_codes c = block_codes(qi, w, sub);
    weights_32(c.codes, c.is_signed, _mm256_set1_ps(c.scale), _mm256_set1_ps(c.bias), _mm256_set1_ps(c.scale1),
               _mm256_set1_ps(c.bias1), out);
}

/* ---- accuracy level 4, many activation rows (prompts): weight rows packed 16 at a time (AVX-512 only) ---- */
#if X86_VNNI
/* A prompt's product is bound by arithmetic, not memory: the one-row kernels above spend most of their instructions
 * turning each block's integer dot product into a float (horizontal adds, one per block and activation row). Here a
 * tile of 16 weight rows is first unpacked into a scratch buffer, in L2, with the rows side by side (int32 lane r of
 * a 512-bit vector holds four codes of row r), so every dpbusd serves 16 rows and the float work is per 16 rows.
 * The scratch is per call and the GGUF stays the only copy of the weights. */
/* Below these many activation rows packing costs more than it saves (tools/bench/matmul_gguf.py, 1B shape, one
 * thread): from 16 rows for the 32-element types, from 32 for the K-quants, whose blocks take longer to unpack
 * (Q4_K qkv at 16 rows: 2.08-2.12 ms packed against 1.63-1.64 one row at a time). */
enum { PACK_ROWS = 16, PACK_ACTS = 8, PACK_MIN_M = 16, PACK_MIN_M_KQUANT = 32 };

/* One 32-element chunk of a 16-row tile: codes[g], lane r = row r's codes 4g..4g+3 (unsigned bytes); scale[h] and
 * bias[h], lane r = the scale and bias of row r's codes 16h..16h+15. Signed codes (Q8_0) are stored + 128. */
typedef struct {
    __m512i codes[8];
    __m512 scale[2], bias[2];
} packed_chunk;

/* Index vectors of the three rounds of two-source permutes that turn 8 vectors of two rows each (row 2p's 8 dwords,
 * then row 2p+1's) into 8 vectors of one column each (lane r = row r's dword g). Source lanes 16..31 are the second
 * operand, which holds the rows after the first's, so each index is (row within the pair of sources) * width +
 * column: round A, rows 4q..4q+3 of columns 4h..4h+3 (lane L: row L/4, width 8); round B, rows 8s..8s+7 of columns
 * 2j, 2j+1 of those four (lane L: row L/2, width 4); round C, all 16 rows of one column (lane L: row L, width 2). */
typedef struct {
    __m512i a[2], b[2], c[2];
} transpose_index;

KERNEL transpose_index transpose_indices(void) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    transpose_index t;
    for (int h = 0; h < 2; h++) {
        t.a[h] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(lane, 2), 3),
                                  _mm512_add_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(3)), _mm512_set1_epi32(4 * h)));
        t.b[h] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(lane, 1), 2),
                                  _mm512_add_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(1)), _mm512_set1_epi32(2 * h)));
        t.c[h] = _mm512_add_epi32(_mm512_slli_epi32(lane, 1), _mm512_set1_epi32(h));
    }
    return t;
}

/* Rows [0, nrows) of the tile at `rows` (rows past nrows: zero codes and scales), every chunk of K. */
KERNEL void pack_tile(int qi, int elements, int bytes, const uint8_t *rows, size_t row_bytes, size_t nrows,
                      size_t chunks, packed_chunk *out) {
    float scale[2][PACK_ROWS], bias[2][PACK_ROWS];
    memset(scale, 0, sizeof scale);
    memset(bias, 0, sizeof bias);
    const int subs = elements / 32;
    const transpose_index t = transpose_indices();
    for (size_t c = 0; c < chunks; c++) {
        const uint8_t *block = rows + c / (size_t)subs * (size_t)bytes;
        __m256i codes[PACK_ROWS];
        for (size_t r = 0; r < PACK_ROWS; r++) {
            if (r >= nrows) {
                codes[r] = _mm256_setzero_si256();
                continue;
            }
            const chunk_codes cc = block_codes(qi, block + r * row_bytes, (int)(c % (size_t)subs));
            codes[r] = cc.is_signed ? _mm256_xor_si256(cc.codes, _mm256_set1_epi8(-128)) : cc.codes;
            scale[0][r] = cc.scale;
            scale[1][r] = cc.scale1;
            bias[0][r] = cc.bias;
            bias[1][r] = cc.bias1;
        }
        __m512i z[8], a[8], b[8];
        for (int p = 0; p < 8; p++)
            z[p] = _mm512_inserti64x4(_mm512_castsi256_si512(codes[2 * p]), codes[2 * p + 1], 1);
        for (int q = 0; q < 4; q++) /* a[2q + h]: rows 4q..4q+3, columns 4h..4h+3 */
            for (int h = 0; h < 2; h++)
                a[2 * q + h] = _mm512_permutex2var_epi32(z[2 * q], t.a[h], z[2 * q + 1]);
        for (int s = 0; s < 2; s++) /* b[4s + 2h + j]: rows 8s..8s+7, columns 4h + 2j, 4h + 2j + 1 */
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 2; j++)
                    b[4 * s + 2 * h + j] = _mm512_permutex2var_epi32(a[4 * s + h], t.b[j], a[4 * s + 2 + h]);
        for (int g = 0; g < 8; g++) /* column g = 4h + 2j + parity */
            out[c].codes[g] = _mm512_permutex2var_epi32(b[g / 2], t.c[g % 2], b[4 + g / 2]);
        for (int h = 0; h < 2; h++) {
            out[c].scale[h] = _mm512_loadu_ps(scale[h]);
            out[c].bias[h] = _mm512_loadu_ps(bias[h]);
        }
    }
}

/* How a type's integer sums become floats: `offset` (Q4_0 8, Q5_0 16, Q8_0 128 after the shift, Q6_K 32) is
 * subtracted in integers, per 16 codes where `halves` (Q6_K's two scales a chunk) else per 32; a type without one
 * adds bias * (sum of the activation codes) in floats. `paired`: the activations are in ACT_PAIRED order. */
typedef struct {
    int elements, offset, halves, paired;
} tiled_form;

/* Activation rows a[0..mt) against a packed tile: y[i * y_stride + r] for the rows `keep` marks. */
KERNEL void tiled_acts(tiled_form f, const packed_chunk *p, size_t chunks, const act_q8 *a, const int mt, float *y,
                       size_t y_stride, __mmask16 keep) {
    __m512 acc[PACK_ACTS];
    for (int i = 0; i < mt; i++)
        acc[i] = _mm512_setzero_ps();
    const size_t act_block = f.elements == 256 ? 8 : 1; /* chunks per activation scale */
    for (size_t c = 0; c < chunks; c++) {
        /* where the chunk's codes 0..15 and 16..31 sit in a row of activation codes */
        size_t lo = 32 * c, hi = 32 * c + 16;
        if (f.paired && (c % 2 || c + 1 < chunks)) {
            lo = 64 * (c / 2) + 16 * (c % 2);
            hi = lo + 32;
        }
        const packed_chunk *pc = p + c;
#pragma GCC unroll 8 /* whole, so the accumulators stay in registers (rolled, GCC kept them in memory: 1.3x slower) */
        for (int i = 0; i < mt; i++) {
            const int8_t *q = a[i].q;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int g = 0; g < 4; g++) {
                s0 = _mm512_dpbusd_epi32(s0, pc->codes[g], _mm512_set1_epi32((int)load_u32((const uint8_t *)q + lo + 4 * g)));
                s1 = _mm512_dpbusd_epi32(s1, pc->codes[4 + g], _mm512_set1_epi32((int)load_u32((const uint8_t *)q + hi + 4 * g)));
            }
            const __m512 da = _mm512_set1_ps(a[i].d[c / act_block]);
            if (f.halves) {
                s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(f.offset * a[i].sum16[2 * c]));
                s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(f.offset * a[i].sum16[2 * c + 1]));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(pc->scale[0], da), acc[i]);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(pc->scale[1], da), acc[i]);
            } else if (f.offset) {
                const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(f.offset * a[i].sum32[c]));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(pc->scale[0], da), acc[i]);
            } else {
                const __m512 bias = _mm512_mul_ps(pc->bias[0], _mm512_set1_ps((float)a[i].sum32[c]));
                const __m512 t = _mm512_fmadd_ps(pc->scale[0], _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), bias);
                acc[i] = _mm512_fmadd_ps(t, da, acc[i]);
            }
        }
    }
    for (int i = 0; i < mt; i++)
        _mm512_mask_storeu_ps(y + (size_t)i * y_stride, keep, acc[i]);
}

/* All n weight rows against m activation rows, 16 weight rows at a time. 0 when the scratch cannot be had. */
KERNEL int gemm_tiled(tiled_form f, int qi, int bytes, const uint8_t *rows, size_t row_bytes, size_t n, size_t k,
                      const act_q8 *a, size_t m, float *y, size_t y_stride) {
    const size_t chunks = k / 32;
    packed_chunk *tile = aligned_alloc(64, chunks * sizeof *tile);
    if (!tile)
        return 0;
    for (size_t r0 = 0; r0 < n; r0 += PACK_ROWS) {
        const size_t nrows = n - r0 < PACK_ROWS ? n - r0 : PACK_ROWS;
        const __mmask16 keep = (__mmask16)((1u << nrows) - 1);
        pack_tile(qi, f.elements, bytes, rows + r0 * row_bytes, row_bytes, nrows, chunks, tile);
        size_t i = 0;
        for (; i + PACK_ACTS <= m; i += PACK_ACTS)
            tiled_acts(f, tile, chunks, a + i, PACK_ACTS, y + i * y_stride + r0, y_stride, keep);
        switch (m - i) { /* the rest, with a constant count so the accumulators stay in registers */
        case 7: tiled_acts(f, tile, chunks, a + i, 7, y + i * y_stride + r0, y_stride, keep); break;
        case 6: tiled_acts(f, tile, chunks, a + i, 6, y + i * y_stride + r0, y_stride, keep); break;
        case 5: tiled_acts(f, tile, chunks, a + i, 5, y + i * y_stride + r0, y_stride, keep); break;
        case 4: tiled_acts(f, tile, chunks, a + i, 4, y + i * y_stride + r0, y_stride, keep); break;
        case 3: tiled_acts(f, tile, chunks, a + i, 3, y + i * y_stride + r0, y_stride, keep); break;
        case 2: tiled_acts(f, tile, chunks, a + i, 2, y + i * y_stride + r0, y_stride, keep); break;
        case 1: tiled_acts(f, tile, chunks, a + i, 1, y + i * y_stride + r0, y_stride, keep); break;
        default: break;
        }
    }
    free(tile);
    return 1;
}
#define TILED(form, qi, bytes)                                                                                    \
    if (m >= ((form).elements == 256 ? PACK_MIN_M_KQUANT : PACK_MIN_M) &&                                       \
        gemm_tiled(form, qi, bytes, rows, row_bytes, n, k, a, m, y, y_stride))                \
        return;
#else
#define TILED(form, qi, bytes)
#endif

/* The entry points: all weight rows against activation rows in tiles of X86_TILE (the weights' codes unpacked once
 * per tile), then one at a time; with many activation rows, 16 weight rows at a time where the path can. */
#define GEMM_ENTRY(name, tiled, call)                                                                              \
    ENTRY void gemm_q8_##name(const uint8_t *rows, size_t row_bytes, size_t n, size_t k, const act_q8 *a,        \
                              size_t m, float *y, size_t y_stride) {                                              \
        tiled                                                                                                    \
        float out[X86_TILE];                                                                                     \
        size_t i = 0;                                                                                            \
        for (; i + X86_TILE <= m; i += X86_TILE)                                                                 \
            for (size_t r = 0; r < n; r++) {                                                                     \
                const uint8_t *w = rows + r * row_bytes;                                                         \
                const act_q8 *acts = a + i;                                                                      \
                const int mt = X86_TILE;                                                                         \
                call;                                                                                            \
                for (int j = 0; j < X86_TILE; j++)                                                               \
                    y[(i + (size_t)j) * y_stride + r] = out[j];                                                  \
            }                                                                                                    \
        for (; i < m; i++)                                                                                       \
            for (size_t r = 0; r < n; r++) {                                                                     \
                const uint8_t *w = rows + r * row_bytes;                                                         \
                const act_q8 *acts = a + i;                                                                      \
                const int mt = 1;                                                                                \
                call;                                                                                            \
                y[i * y_stride + r] = out[0];                                                                    \
            }                                                                                                    \
    }

/*                                          type         bytes codes qh offset min */
GEMM_ENTRY(q4_0, TILED(((tiled_form){32, 8, 0, 1}), QI_Q4_0, 18), legacy_row((legacy_layout){LEGACY_Q4_0, 18, 2, 0, 8, 0}, w, k / 32, acts, mt, out))
GEMM_ENTRY(q4_1, TILED(((tiled_form){32, 0, 0, 1}), QI_Q4_1, 20), legacy_row((legacy_layout){LEGACY_Q4_1, 20, 4, 0, 0, 1}, w, k / 32, acts, mt, out))
GEMM_ENTRY(q5_0, TILED(((tiled_form){32, 16, 0, 1}), QI_Q5_0, 22), legacy_row((legacy_layout){LEGACY_Q5_0, 22, 6, 2, 16, 0}, w, k / 32, acts, mt, out))
GEMM_ENTRY(q5_1, TILED(((tiled_form){32, 0, 0, 1}), QI_Q5_1, 24), legacy_row((legacy_layout){LEGACY_Q5_1, 24, 8, 4, 0, 1}, w, k / 32, acts, mt, out))
GEMM_ENTRY(q8_0, TILED(((tiled_form){32, 128, 0, 0}), QI_Q8_0, 34), legacy_row((legacy_layout){LEGACY_Q8_0, 34, 2, 0, 0, 0}, w, k / 32, acts, mt, out))
GEMM_ENTRY(q4_k, TILED(((tiled_form){256, 0, 0, 0}), QI_Q4_K, 144), k45_row(144, 0, w, k / 256, acts, mt, out))
GEMM_ENTRY(q5_k, TILED(((tiled_form){256, 0, 0, 0}), QI_Q5_K, 176), k45_row(176, 1, w, k / 256, acts, mt, out))
GEMM_ENTRY(q6_k, TILED(((tiled_form){256, 32, 1, 0}), QI_Q6_K, 210), q6k_row(w, k / 256, acts, mt, out))

KERNEL void gemv_f32_type(int qi, int elements, int bytes, const uint8_t *rows, size_t row_bytes, size_t n, size_t k,
                          const float *x, float *y) {
    const int subs = elements / 32;
    for (size_t r = 0; r < n; r++) {
        const uint8_t *w = rows + r * row_bytes;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (size_t b = 0; b < k / (size_t)elements; b++, w += bytes) {
            prefetch_ahead(w, (size_t)bytes);
            for (int sub = 0; sub < subs; sub++) {
                __m256 v[4];
                block_weights(qi, w, sub, v);
                const float *xs = x + b * (size_t)elements + 32 * (size_t)sub;
                acc0 = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xs), acc0);
                acc1 = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xs + 8), acc1);
                acc0 = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xs + 16), acc0);
                acc1 = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xs + 24), acc1);
            }
        }
        y[r] = sum_f32x8(_mm256_add_ps(acc0, acc1));
    }
}

KERNEL void dequant_type(int qi, int elements, int bytes, const uint8_t *row, size_t k, float *out) {
    for (size_t b = 0; b < k / (size_t)elements; b++, row += bytes)
        for (int sub = 0; sub < elements / 32; sub++) {
            __m256 v[4];
            block_weights(qi, row, sub, v);
            for (int g = 0; g < 4; g++)
                _mm256_storeu_ps(out + b * (size_t)elements + 32 * (size_t)sub + 8 * g, v[g]);
        }
}

#define X86_TYPE(name, qi, elements, bytes)                                                                       \
    ENTRY void gemv_f32_##name(const uint8_t *rows, size_t row_bytes, size_t n, size_t k, const float *x,       \
                               float *y) {                                                                       \
        gemv_f32_type(qi, elements, bytes, rows, row_bytes, n, k, x, y);                                         \
    }                                                                                                           \
    ENTRY void dequant_##name(const uint8_t *row, size_t k, float *out) {                                         \
        dequant_type(qi, elements, bytes, row, k, out);                                                          \
    }

X86_TYPE(q4_0, QI_Q4_0, 32, 18)
X86_TYPE(q4_1, QI_Q4_1, 32, 20)
X86_TYPE(q5_0, QI_Q5_0, 32, 22)
X86_TYPE(q5_1, QI_Q5_1, 32, 24)
X86_TYPE(q8_0, QI_Q8_0, 32, 34)
X86_TYPE(q4_k, QI_Q4_K, 256, 144)
X86_TYPE(q5_k, QI_Q5_K, 256, 176)
X86_TYPE(q6_k, QI_Q6_K, 256, 210)

const cpu_isa X86_ISA = {
    .name = X86_NAME,
    .usable = usable,
    .quantize = quantize,
    .act_layout = {ACT_PAIRED, ACT_PAIRED, ACT_PAIRED, ACT_PAIRED, ACT_NATURAL, ACT_NATURAL, ACT_NATURAL, ACT_NATURAL},
    .gemm_q8 = {gemm_q8_q4_0, gemm_q8_q4_1, gemm_q8_q5_0, gemm_q8_q5_1, gemm_q8_q8_0, gemm_q8_q4_k, gemm_q8_q5_k,
                gemm_q8_q6_k},
    .gemv_f32 = {gemv_f32_q4_0, gemv_f32_q4_1, gemv_f32_q5_0, gemv_f32_q5_1, gemv_f32_q8_0, gemv_f32_q4_k,
                 gemv_f32_q5_k, gemv_f32_q6_k},
    .dequant = {dequant_q4_0, dequant_q4_1, dequant_q5_0, dequant_q5_1, dequant_q8_0, dequant_q4_k, dequant_q5_k,
                dequant_q6_k},
};
