/* DecodeAttention's x86 chunk kernel, written once for two instruction sets and included by attention_avx2.c and
 * attention_avx512.c.
 *
 * The including file defines ATTN_TARGET (the function target attribute), ATTN_REGISTERS (vector registers the
 * value pass may hold: 16 with AVX2, 32 with AVX-512VL's ymm16-31), ATTN_ISA / ATTN_NAME (the attn_isa symbol and
 * its name) and a `usable` function. Vectors are 256-bit: a decode step is bound by reading the cache, and on Zen 4
 * a 512-bit operation costs two 256-bit ones.
 *
 * One chunk for n <= 8 queries (attention.h), n a compile-time constant in each instantiation:
 *   1. scores: per key, its float16 row is widened once (F16C) and multiplied into n accumulators (one per query,
 *      against the query's row); the 8 accumulators reduce to one vector of 8 scores (lane q = query q) in a fixed
 *      hadd tree, lanes whose query does not see the key become -inf; kept as st[key][8] with the running max;
 *   2. softmax: st[key] = exp(st[key] - max) a vector (8 queries) at a time, their sum kept per lane;
 *   3. values: per block of DB 8-float pieces of the head, n x DB accumulators in registers take p * v over the keys
 *      (each value row widened once per block), then go to a.
 * A query's lanes never mix with another's, and a key it does not see gives p = 0 exactly, so its result is the
 * same whichever queries share the call (what the op's determinism rests on, attention.h).
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "attention.h"

#define AK static inline __attribute__((target(ATTN_TARGET), always_inline))
#define AE static __attribute__((target(ATTN_TARGET)))

AK __m256 load_h8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* Eight vectors -> one whose lane j is the sum of v[j]'s lanes, in the same tree for every lane. */
AK __m256 sum_lanes(const __m256 v[8]) {
    const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* exp(x) for x <= 0 (and -inf): Cephes' expf polynomial after range reduction, within 2 ulp of expf; exactly 0
 * below -87.33 (where expf leaves the normal range) and for -inf, so a masked score weighs nothing at all. */
AK __m256 exp_neg(__m256 x) {
    const __m256 floor_x = _mm256_set1_ps(-87.33654f);
    const __m256 under = _mm256_cmp_ps(x, floor_x, _CMP_LT_OQ);
    x = _mm256_max_ps(floor_x, x); /* NaN stays NaN (max returns its second operand then) */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}

/* The value pass's register block: DB pieces of 8 floats for each of n queries, within the register budget. */
AK int value_block(const int n) {
    return (4 * (n + 1) <= ATTN_REGISTERS - 2) ? 4 : (2 * (n + 1) <= ATTN_REGISTERS - 2) ? 2 : 1;
}

/* a[q][d0 .. d0 + 8 DB) = sum over keys [begin, end) of w[key][q] * v[key][d0 ..], key j's weights at
 * w + (j - base) * stride. */
AK void values_block(const int n, const int DB, const uint16_t *v, size_t dim, size_t d0, int64_t begin, int64_t end,
                     const float *w, int64_t base, size_t stride, float *a) {
    __m256 acc[ATTN_QUERIES][4];
    for (int q = 0; q < n; q++)
        for (int b = 0; b < DB; b++)
            acc[q][b] = _mm256_setzero_ps();
    for (int64_t j = begin; j < end; j++) {
        const uint16_t *row = v + (size_t)j * dim + d0;
        __m256 vv[4];
        for (int b = 0; b < DB; b++)
            vv[b] = load_h8(row + 8 * b);
        const float *p = w + (size_t)(j - base) * stride;
        for (int q = 0; q < n; q++) {
            const __m256 weight = _mm256_broadcast_ss(p + q);
            for (int b = 0; b < DB; b++)
                acc[q][b] = _mm256_fmadd_ps(weight, vv[b], acc[q][b]);
        }
    }
    for (int q = 0; q < n; q++)
        for (int b = 0; b < DB; b++)
            _mm256_storeu_ps(a + (size_t)q * dim + d0 + 8 * b, acc[q][b]);
}

AK void values(const int n, const uint16_t *v, size_t dim, int64_t begin, int64_t end, const float *w, int64_t base,
               size_t stride, float *a) {
    const int DB = value_block(n);
    size_t d0 = 0;
    for (; d0 + 8 * (size_t)DB <= dim; d0 += 8 * (size_t)DB)
        values_block(n, DB, v, dim, d0, begin, end, w, base, stride, a);
    for (; d0 < dim; d0 += 8)
        values_block(n, 1, v, dim, d0, begin, end, w, base, stride, a);
}

/* The keys of [first, first + count) each query sees, as chunk-relative bounds (a query that sees none gets
 * lo = count, hi = -1), and the range any query sees [*begin, *end) and all queries see [*inner_lo, *inner_hi]. */
AK void chunk_bounds(const int n, int64_t first, size_t count, const attn_queries *queries, int32_t lo[8],
                     int32_t hi[8], int64_t *begin, int64_t *end, int64_t *inner_lo, int64_t *inner_hi) {
    *begin = (int64_t)count;
    *end = 0;
    *inner_lo = 0;
    *inner_hi = (int64_t)count - 1;
    for (int i = 0; i < n; i++) {
        int64_t l = queries->lo[i] - first, h = queries->hi[i] - first;
        l = l < 0 ? 0 : l;
        h = h > (int64_t)count - 1 ? (int64_t)count - 1 : h;
        if (l > h) {
            l = (int64_t)count;
            h = -1;
        } else {
            *begin = l < *begin ? l : *begin;
            *end = h + 1 > *end ? h + 1 : *end;
        }
        *inner_lo = l > *inner_lo ? l : *inner_lo;
        *inner_hi = h < *inner_hi ? h : *inner_hi;
        lo[i] = (int32_t)l;
        hi[i] = (int32_t)h;
    }
    for (int i = n; i < 8; i++) {
        lo[i] = (int32_t)count;
        hi[i] = -1;
    }
}

AK void chunk_empty(const int n, size_t dim, float *m, float *l, float *a) {
    for (int i = 0; i < n; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        memset(a + (size_t)i * dim, 0, dim * sizeof(float));
    }
}

/* Lanes whose (key, query) is hidden become -inf: key index per lane against the lanes' bounds. */
AK __m256 hide(__m256 s, __m256i index, __m256i lo, __m256i hi) {
    const __m256i hidden = _mm256_or_si256(_mm256_cmpgt_epi32(lo, index), _mm256_cmpgt_epi32(index, hi));
    return _mm256_blendv_ps(s, _mm256_set1_ps(-INFINITY), _mm256_castsi256_ps(hidden));
}

/* n <= 4 queries, keys in pairs: lanes 0-3 are the first key's queries, lanes 4-7 the second's. Scores, their exp
 * and their sums take a vector per pair; a query's l is the sum of its two lanes' sums (each over every other key,
 * in key order: the same two sequences, whichever key the pairs start at). Weights are kept as w[key][4]. */
AK void chunk_pairs(const int n, const uint16_t *k, const uint16_t *v, int64_t first, size_t count,
                    const attn_queries *queries, float *m, float *l, float *a) {
    const size_t dim = queries->dim;
    const float *q = queries->q;
    int32_t lo[8], hi[8];
    int64_t begin, end, inner_lo, inner_hi;
    chunk_bounds(n, first, count, queries, lo, hi, &begin, &end, &inner_lo, &inner_hi);
    if (begin >= end) {
        chunk_empty(n, dim, m, l, a);
        return;
    }
    for (int i = 0; i < 4; i++) { /* lanes 4-7: the same queries */
        lo[4 + i] = lo[i];
        hi[4 + i] = hi[i];
    }
    const __m256i lo_v = _mm256_loadu_si256((const __m256i *)lo), hi_v = _mm256_loadu_si256((const __m256i *)hi);
    const __m256i second = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const uint16_t *keys = k + (size_t)first * dim;
    _Alignas(32) float w[(ATTN_CHUNK + 1) * 4];

    __m256 max = _mm256_set1_ps(-INFINITY);
    for (int64_t j = begin; j < end; j += 2) {
        const int pair = j + 1 < end;
        __m256 acc[8];
        for (int i = 0; i < 8; i++)
            acc[i] = _mm256_setzero_ps();
        const uint16_t *row = keys + (size_t)j * dim;
        if (pair) {
            for (size_t d = 0; d < dim; d += 8) {
                const __m256 k0 = load_h8(row + d), k1 = load_h8(row + dim + d);
                for (int i = 0; i < n; i++) {
                    const __m256 qv = _mm256_load_ps(q + (size_t)i * dim + d);
                    acc[i] = _mm256_fmadd_ps(qv, k0, acc[i]);
                    acc[4 + i] = _mm256_fmadd_ps(qv, k1, acc[4 + i]);
                }
            }
        } else { /* the last key alone: the second lanes stay hidden */
            for (size_t d = 0; d < dim; d += 8) {
                const __m256 kv = load_h8(row + d);
                for (int i = 0; i < n; i++)
                    acc[i] = _mm256_fmadd_ps(_mm256_load_ps(q + (size_t)i * dim + d), kv, acc[i]);
            }
        }
        __m256 s = sum_lanes(acc);
        if (!pair || j < inner_lo || j + 1 > inner_hi)
            s = hide(s, _mm256_add_epi32(_mm256_set1_epi32((int32_t)j), second), lo_v, hi_v);
        _mm256_store_ps(w + (size_t)(j - begin) * 4, s);
        max = _mm256_max_ps(max, s);
    }
    /* a query's max over both lanes; -inf (it saw no key) subtracts 0 instead, its weights all 0 */
    max = _mm256_max_ps(max, _mm256_permute2f128_ps(max, max, 0x01));
    const __m256 shift = _mm256_andnot_ps(_mm256_cmp_ps(max, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ), max);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = begin; j < end; j += 2) {
        float *p = w + (size_t)(j - begin) * 4;
        const __m256 e = exp_neg(_mm256_sub_ps(_mm256_load_ps(p), shift));
        _mm256_store_ps(p, e);
        sum = _mm256_add_ps(sum, e);
    }
    _Alignas(32) float max_lanes[8], sums[8];
    _mm256_store_ps(max_lanes, max);
    _mm256_store_ps(sums, sum);
    for (int i = 0; i < n; i++) {
        m[i] = max_lanes[i];
        l[i] = sums[i] + sums[4 + i];
    }
    values(n, v + (size_t)first * dim, dim, begin, end, w, begin, 4, a);
}

/* 5 to 8 queries, one key at a time: lane i of a key's score vector is query i. Weights are kept as w[key][8]. */
AK void chunk_single(const int n, const uint16_t *k, const uint16_t *v, int64_t first, size_t count,
                     const attn_queries *queries, float *m, float *l, float *a) {
    const size_t dim = queries->dim;
    const float *q = queries->q;
    int32_t lo[8], hi[8];
    int64_t begin, end, inner_lo, inner_hi;
    chunk_bounds(n, first, count, queries, lo, hi, &begin, &end, &inner_lo, &inner_hi);
    if (begin >= end) {
        chunk_empty(n, dim, m, l, a);
        return;
    }
    const __m256i lo_v = _mm256_loadu_si256((const __m256i *)lo), hi_v = _mm256_loadu_si256((const __m256i *)hi);
    const uint16_t *keys = k + (size_t)first * dim;
    _Alignas(32) float w[ATTN_CHUNK * ATTN_QUERIES];

    __m256 max = _mm256_set1_ps(-INFINITY);
    for (int64_t j = begin; j < end; j++) {
        const uint16_t *row = keys + (size_t)j * dim;
        __m256 acc[8];
        for (int i = 0; i < 8; i++)
            acc[i] = _mm256_setzero_ps();
        for (size_t d = 0; d < dim; d += 8) {
            const __m256 kv = load_h8(row + d);
            for (int i = 0; i < n; i++)
                acc[i] = _mm256_fmadd_ps(_mm256_load_ps(q + (size_t)i * dim + d), kv, acc[i]);
        }
        __m256 s = sum_lanes(acc);
        if (j < inner_lo || j > inner_hi)
            s = hide(s, _mm256_set1_epi32((int32_t)j), lo_v, hi_v);
        _mm256_store_ps(w + (size_t)(j - begin) * ATTN_QUERIES, s);
        max = _mm256_max_ps(max, s);
    }
    const __m256 shift = _mm256_andnot_ps(_mm256_cmp_ps(max, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ), max);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = begin; j < end; j++) {
        float *p = w + (size_t)(j - begin) * ATTN_QUERIES;
        const __m256 e = exp_neg(_mm256_sub_ps(_mm256_load_ps(p), shift));
        _mm256_store_ps(p, e);
        sum = _mm256_add_ps(sum, e);
    }
    _Alignas(32) float max_lanes[8], sums[8];
    _mm256_store_ps(max_lanes, max);
    _mm256_store_ps(sums, sum);
    for (int i = 0; i < n; i++) {
        m[i] = max_lanes[i];
        l[i] = sums[i];
    }
    values(n, v + (size_t)first * dim, dim, begin, end, w, begin, ATTN_QUERIES, a);
}

AE void chunk(const uint16_t *k, const uint16_t *v, int64_t first, size_t count, const attn_queries *queries,
              float *m, float *l, float *a) {
    switch (queries->n) {
    case 1: chunk_pairs(1, k, v, first, count, queries, m, l, a); break;
    case 2: chunk_pairs(2, k, v, first, count, queries, m, l, a); break;
    case 3: chunk_pairs(3, k, v, first, count, queries, m, l, a); break;
    case 4: chunk_pairs(4, k, v, first, count, queries, m, l, a); break;
    case 5: chunk_single(5, k, v, first, count, queries, m, l, a); break;
    case 6: chunk_single(6, k, v, first, count, queries, m, l, a); break;
    case 7: chunk_single(7, k, v, first, count, queries, m, l, a); break;
    default: chunk_single(8, k, v, first, count, queries, m, l, a); break;
    }
}

AE void to_f16(const float *x, uint16_t *out, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++)
        out[i] = (uint16_t)_cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

const attn_isa ATTN_ISA = {
    .name = ATTN_NAME,
    .usable = usable,
    .chunk = chunk,
    .to_f16 = to_f16,
};
