/* DecodeAttention's portable chunk kernel (plain C, the fallback where no SIMD path runs and the reference the SIMD
 * paths are tested against), the chunk merge every path shares, and the choice of path.
 *
 * Per chunk (attention.h): each key row and each value row is widened to float once and used by every query that
 * sees it; scores, exp (libm's expf) and the weighted sum of values run in float32 in key order. */
#include <math.h>
#include <string.h>

#include "attention.h"
#include "cpu_kernels.h"
#include "ggml_blocks.h"

static void widen(const uint16_t *row, size_t dim, float *out) {
    for (size_t d = 0; d < dim; d++)
        out[d] = f16_to_f32(row[d]);
}

static void chunk_portable(const uint16_t *k, const uint16_t *v, int64_t first, size_t count,
                           const attn_queries *queries, float *m, float *l, float *a) {
    const size_t n = queries->n, dim = queries->dim;
    int64_t lo[ATTN_QUERIES], hi[ATTN_QUERIES], begin = first + (int64_t)count, end = first;
    for (size_t i = 0; i < n; i++) {
        lo[i] = queries->lo[i] > first ? queries->lo[i] : first;
        hi[i] = queries->hi[i] < first + (int64_t)count - 1 ? queries->hi[i] : first + (int64_t)count - 1;
        if (lo[i] <= hi[i]) {
            begin = lo[i] < begin ? lo[i] : begin;
            end = hi[i] + 1 > end ? hi[i] + 1 : end;
        }
        m[i] = -INFINITY;
        l[i] = 0.0f;
        memset(a + i * dim, 0, dim * sizeof(float));
    }
    float st[ATTN_CHUNK][ATTN_QUERIES], row[ATTN_MAX_DIM];
    for (int64_t j = begin; j < end; j++) {
        widen(k + (size_t)j * dim, dim, row);
        for (size_t i = 0; i < n; i++) {
            float s = -INFINITY;
            if (j >= lo[i] && j <= hi[i]) {
                const float *q = queries->q + i * dim;
                s = 0.0f;
                for (size_t d = 0; d < dim; d++)
                    s += q[d] * row[d];
            }
            st[j - begin][i] = s;
            m[i] = s > m[i] ? s : m[i];
        }
    }
    for (int64_t j = begin; j < end; j++) {
        widen(v + (size_t)j * dim, dim, row);
        for (size_t i = 0; i < n; i++) {
            if (j < lo[i] || j > hi[i])
                continue;
            const float p = expf(st[j - begin][i] - m[i]);
            l[i] += p;
            float *out = a + i * dim;
            for (size_t d = 0; d < dim; d++)
                out[d] += p * row[d];
        }
    }
}

static void to_f16_portable(const float *x, uint16_t *out, size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] = f32_to_f16(x[i]);
}

static int always(void) { return 1; }

const attn_isa attn_isa_portable = {
    .name = "portable",
    .usable = always,
    .chunk = chunk_portable,
    .to_f16 = to_f16_portable,
};

const attn_isa *attn_isa_current(void) {
#if defined(__x86_64__) || defined(__i386__)
    const char *path = cpu_isa_current()->name;
    if (strcmp(path, "avx512vnni") == 0 && attn_isa_avx512.usable())
        return &attn_isa_avx512;
    if ((strcmp(path, "avx512vnni") == 0 || strcmp(path, "avx2") == 0) && attn_isa_avx2.usable())
        return &attn_isa_avx2;
#endif
    return &attn_isa_portable;
}

void attn_merge(float *m, float *l, float *a, float chunk_m, float chunk_l, const float *chunk_a, size_t dim) {
    if (chunk_m == -INFINITY) /* the chunk held no key of this query */
        return;
    if (*m == -INFINITY) {
        *m = chunk_m;
        *l = chunk_l;
        memcpy(a, chunk_a, dim * sizeof(float));
        return;
    }
    const float top = chunk_m > *m ? chunk_m : *m;
    const float old = expf(*m - top), new = expf(chunk_m - top);
    *l = *l * old + chunk_l * new;
    for (size_t d = 0; d < dim; d++)
        a[d] = a[d] * old + chunk_a[d] * new;
    *m = top;
}
