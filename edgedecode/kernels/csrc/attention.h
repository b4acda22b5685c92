/* DecodeAttention's compute kernels: what one instruction-set path provides, and the table of paths.
 *
 * The op (op_attention.c) splits attention into chunks: a chunk is up to ATTN_CHUNK consecutive keys of one KV head,
 * starting at a multiple of ATTN_CHUNK (absolute cache slots), seen by up to ATTN_QUERIES query vectors at once (the
 * query heads of one group, or of several rows of a prompt run). For each query q the chunk kernel returns the
 * partial softmax of the chunk:
 *     m_q = max_j s_qj,   l_q = sum_j exp(s_qj - m_q),   a_q = sum_j exp(s_qj - m_q) v_j,   s_qj = q . k_j
 * over the keys j the query sees (lo_q <= j <= hi_q; the others are left out: m_q = -inf, l_q = 0, a_q = 0 when it
 * sees none). The queries come rotated and scaled. The op merges the chunks of a query in key order
 * (attn_merge), so a query's output depends only on its own keys and never on which other queries shared its
 * chunks, how many rows the run had, or how the work was split over threads.
 *
 * A path's arithmetic per query is the same whatever the other lanes hold: dot products reduce in a fixed tree per
 * lane, and a key a query does not see contributes exactly nothing. Paths differ from each other in the order of
 * float additions and in exp's last bits (the SIMD paths' exp is a polynomial within 2 ulp of expf's).
 */
#ifndef EDGEDECODE_ATTENTION_H
#define EDGEDECODE_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

enum {
    ATTN_CHUNK = 128,    /* keys a chunk holds at most (its K and V stay in L1/L2 while the queries use them) */
    ATTN_QUERIES = 8,    /* query vectors one chunk call serves */
    ATTN_PAIRED = 4,     /* calls of at most this many queries may take another kernel than larger ones: a query
                          * must meet the same one in every call (the op keeps each subgroup's size) */
    ATTN_MAX_DIM = 256,  /* the largest head_dim */
};

typedef struct {
    size_t n;                         /* queries, 1..ATTN_QUERIES */
    size_t dim;                       /* head_dim: even, <= ATTN_MAX_DIM (a multiple of 8 for the SIMD paths) */
    const float *q;                   /* [n][dim], rotated and scaled, 32-byte aligned rows */
    int64_t lo[ATTN_QUERIES];         /* the first and last key slot each query sees (absolute) */
    int64_t hi[ATTN_QUERIES];
} attn_queries;

/* One chunk: keys [first, first + count) of one KV head, `k` and `v` pointing at the head's slot 0 (float16 rows of
 * `dim`). Writes m[n], l[n] and a[n][dim]. */
typedef void (*attn_chunk_fn)(const uint16_t *k, const uint16_t *v, int64_t first, size_t count,
                              const attn_queries *queries, float *m, float *l, float *a);
/* float32 -> float16, round to nearest even (the cache's new rows). */
typedef void (*attn_to_f16_fn)(const float *x, uint16_t *out, size_t n);

typedef struct {
    const char *name; /* "portable", "avx2", "avx512" */
    int (*usable)(void);
    attn_chunk_fn chunk;
    attn_to_f16_fn to_f16;
} attn_isa;

extern const attn_isa attn_isa_portable;
#if defined(__x86_64__) || defined(__i386__)
extern const attn_isa attn_isa_avx2;
extern const attn_isa attn_isa_avx512;
#endif

/* The path that goes with the matmul kernels' current path (cpu_isa_current, so EDGEDECODE_KERNELS_ISA and
 * edgedecode_kernels_set_cpu_isa choose it too): avx512vnni -> avx512, avx2 -> avx2, any other -> portable. */
const attn_isa *attn_isa_current(void);

/* A query's running merge of chunk partials, in key order: state (m, l, a[dim]) starts at (-inf, 0, 0). */
void attn_merge(float *m, float *l, float *a, float chunk_m, float chunk_l, const float *chunk_a, size_t dim);

#endif
