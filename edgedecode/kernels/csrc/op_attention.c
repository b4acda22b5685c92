/* DecodeAttention on the CPU: grouped-query attention over a float16 KV cache for a float32 graph, what
 * com.microsoft.GroupQueryAttention computes for edgedecode's decode graph (do_rotary=1, rotate-half RoPE at
 * position_ids, a cache bound as both past and present), with the cache in half the bytes.
 *
 * Inputs: query [B, M, H*D] float32, or packed [B, M, (H + 2 KVH) * D] with key and value absent; key, value
 * [B, M, KVH*D] float32 (optional); past_key, past_value [B, KVH, T, D] float16; seqlens_k int32 [B] (tokens held
 * after this call, minus one); cos_cache, sin_cache [P, D/2] float32; position_ids int64 [B, M].
 * Outputs: output [B, M, H*D] float32; present_key, present_value [B, KVH, T, D] float16: the past with the new rows.
 * Attributes: num_heads, kv_num_heads, local_window_size (-1: none; W: a query sees its last W keys, itself
 * included), scale (float; 0: 1/sqrt(D)).
 *
 * For batch b, past = seqlens_k[b] + 1 - M: row i's key and value, RoPE'd (the key) at position_ids[b, i] and
 * rounded to float16, go to slot past + i of both presents; its query (RoPE'd, times scale) attends to slots
 * [past + i - W + 1 (or 0), past + i] of its KV head (head h reads KV head h / (H / KVH)) with a float32 softmax.
 * When a present is bound to its past's buffer (the runtime's KV), the call writes the new rows in place and
 * reads nothing else of the buffer; otherwise the past is copied into the present first.
 *
 * Work: the new rows' KV first (on the calling thread for one row, else rows in parallel), then attention in chunks
 * of ATTN_CHUNK keys (attention.h) on onnxruntime's intra-op pool: a decode row (M = 1) runs one task per KV head,
 * query group of at most 8 heads and chunk, whose partials go to a buffer the kernel keeps (grown, never freed
 * before the kernel: no allocation per decode call once it fits) and are merged per head in key order; a prompt run
 * (M > 1) runs one task per tile of rows x heads (at most 8 queries), which merges its chunks as it goes. Both merge
 * a query's chunks in the same order with the same arithmetic, so a row's output is the same in a run of any size
 * and on any number of threads. A call reading less than INLINE_BYTES of cache runs on the calling thread. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "ops.h"

enum { IN_QUERY, IN_KEY, IN_VALUE, IN_PAST_KEY, IN_PAST_VALUE, IN_SEQLENS, IN_COS, IN_SIN, IN_POSITIONS, INPUTS };
enum { OUT_OUTPUT, OUT_KEY, OUT_VALUE, OUTPUTS };
enum {
    INLINE_BYTES = 32 << 10, /* cache bytes below which waking the pool costs more than it saves */
    BLOCK_HEADER = 2 * ATTN_QUERIES, /* a decode task's partials: m[8], l[8], then a[8][D] */
};

typedef struct {
    const OrtApi *api;
    int64_t heads, kv_heads, window;
    float scale;
    const attn_isa *isa;
    float *scratch; /* decode partials, scratch_floats long */
    size_t scratch_floats;
    atomic_flag scratch_busy;
    char node[128];
} attention_kernel;

static OrtStatus *create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **out) {
    (void)op;
    int64_t heads, kv_heads, window;
    OrtStatus *status;
    if ((status = op_attr_int(api, info, "num_heads", &heads)) ||
        (status = op_attr_int(api, info, "kv_num_heads", &kv_heads)) ||
        (status = op_attr_int(api, info, "local_window_size", &window)))
        return status;
    char node[128];
    op_node_name(api, info, node, sizeof node);
    float scale = 0.0f;
    if ((status = api->KernelInfoGetAttribute_float(info, "scale", &scale))) {
        api->ReleaseStatus(status);
        return op_error(api, ORT_INVALID_ARGUMENT, "DecodeAttention '%s': lacks the float attribute 'scale'", node);
    }
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads)
        return op_error(api, ORT_INVALID_ARGUMENT, "DecodeAttention '%s': num_heads %lld must be a positive multiple "
                        "of kv_num_heads %lld", node, (long long)heads, (long long)kv_heads);
    if (window == 0 || window < -1 || !(scale >= 0.0f) || isinf(scale))
        return op_error(api, ORT_INVALID_ARGUMENT, "DecodeAttention '%s': local_window_size %lld (-1 or positive) or "
                        "scale %g (0 or positive) is out of range", node, (long long)window, (double)scale);
    attention_kernel *kernel = calloc(1, sizeof *kernel);
    if (!kernel)
        return op_error(api, ORT_FAIL, "DecodeAttention '%s': out of memory", node);
    kernel->api = api;
    kernel->heads = heads;
    kernel->kv_heads = kv_heads;
    kernel->window = window;
    kernel->scale = scale;
    kernel->isa = attn_isa_current();
    atomic_flag_clear(&kernel->scratch_busy);
    memcpy(kernel->node, node, sizeof node);
    *out = kernel;
    return NULL;
}

static void destroy(void *p) {
    attention_kernel *kernel = p;
    if (kernel)
        free(kernel->scratch);
    free(kernel);
}

/* One call's shapes and buffers, shared by its tasks. */
typedef struct {
    const attn_isa *isa;
    size_t batch, rows, heads, kv_heads, dim, slots, group;
    size_t subgroups, tile_rows, tiles; /* query heads of a group in subgroups of <= 8; prompt tiles of rows */
    int64_t window;
    float scale;
    const float *query, *key, *value; /* row r's q at query + r * q_stride, k at key + r * kv_stride, ... */
    size_t q_stride, kv_stride;
    const int32_t *seqlens;
    const float *cos, *sin;
    size_t half;
    const int64_t *positions;
    uint16_t *cache_k, *cache_v; /* the presents */
    float *out;
    float *partials; /* decode: per task BLOCK_HEADER + 8 * dim floats */
    size_t chunks;   /* decode: chunk tasks per head group */
} attn_call;

static int64_t past_of(const attn_call *c, size_t b) { return (int64_t)c->seqlens[b] + 1 - (int64_t)c->rows; }

/* The keys row i of batch b sees: [lo, hi]. */
static void bounds(const attn_call *c, size_t b, size_t i, int64_t *lo, int64_t *hi) {
    *hi = past_of(c, b) + (int64_t)i;
    *lo = c->window > 0 && *hi - c->window + 1 > 0 ? *hi - c->window + 1 : 0;
}

/* Rotate-half RoPE of x [dim] at the cache row's angles, times factor, into out. */
static void rotate(const attn_call *c, const float *x, int64_t position, float factor, float *out) {
    const float *cs = c->cos + (size_t)position * c->half, *sn = c->sin + (size_t)position * c->half;
    for (size_t d = 0; d < c->half; d++) {
        const float x1 = x[d], x2 = x[d + c->half];
        out[d] = (x1 * cs[d] - x2 * sn[d]) * factor;
        out[d + c->half] = (x2 * cs[d] + x1 * sn[d]) * factor;
    }
}

/* Row r (= b * rows + i) of the run: its keys and values into their slots. */
static void append_row(void *user, size_t r) {
    const attn_call *c = user;
    const size_t b = r / c->rows, i = r % c->rows;
    const size_t slot = (size_t)(past_of(c, b) + (int64_t)i);
    const int64_t position = c->positions[r];
    float rotated[ATTN_MAX_DIM];
    for (size_t h = 0; h < c->kv_heads; h++) {
        const size_t at = ((b * c->kv_heads + h) * c->slots + slot) * c->dim;
        rotate(c, c->key + r * c->kv_stride + h * c->dim, position, 1.0f, rotated);
        c->isa->to_f16(rotated, c->cache_k + at, c->dim);
        c->isa->to_f16(c->value + r * c->kv_stride + h * c->dim, c->cache_v + at, c->dim);
    }
}

/* The query heads [first, first + count) of KV head `kv` for subgroup s. */
static size_t subgroup_heads(const attn_call *c, size_t kv, size_t s, size_t *first) {
    *first = kv * c->group + s * ATTN_QUERIES;
    const size_t left = c->group - s * ATTN_QUERIES;
    return left < ATTN_QUERIES ? left : ATTN_QUERIES;
}

/* Query vectors for rows [i0, i0 + n_rows) of batch b x heads [h0, h0 + n_heads), row-major, into q (aligned). */
static void load_queries(const attn_call *c, size_t b, size_t i0, size_t n_rows, size_t h0, size_t n_heads,
                         float *q, attn_queries *queries) {
    size_t n = 0;
    for (size_t i = i0; i < i0 + n_rows; i++) {
        const size_t r = b * c->rows + i;
        for (size_t h = h0; h < h0 + n_heads; h++, n++) {
            rotate(c, c->query + r * c->q_stride + h * c->dim, c->positions[r], c->scale, q + n * c->dim);
            bounds(c, b, i, &queries->lo[n], &queries->hi[n]);
        }
    }
    queries->n = n;
    queries->dim = c->dim;
    queries->q = q;
}

static uint16_t *head_keys(const attn_call *c, size_t b, size_t kv) {
    return c->cache_k + (b * c->kv_heads + kv) * c->slots * c->dim;
}
static uint16_t *head_values(const attn_call *c, size_t b, size_t kv) {
    return c->cache_v + (b * c->kv_heads + kv) * c->slots * c->dim;
}

/* Decode, task t = ((b * KVH + kv) * subgroups + s) * chunks + j: chunk j of the row's keys into its partials. */
static void decode_task(void *user, size_t t) {
    const attn_call *c = user;
    const size_t j = t % c->chunks, s = t / c->chunks % c->subgroups, kv = t / c->chunks / c->subgroups % c->kv_heads;
    const size_t b = t / c->chunks / c->subgroups / c->kv_heads;
    float *block = c->partials + t * (BLOCK_HEADER + ATTN_QUERIES * c->dim);
    size_t h0;
    const size_t n_heads = subgroup_heads(c, kv, s, &h0);
    _Alignas(32) float q[ATTN_QUERIES * ATTN_MAX_DIM];
    attn_queries queries = {0};
    load_queries(c, b, 0, 1, h0, n_heads, q, &queries);
    const int64_t first = (queries.lo[0] / ATTN_CHUNK + (int64_t)j) * ATTN_CHUNK;
    if (first > queries.hi[0]) { /* past this batch row's keys (another row of the batch has more) */
        for (size_t i = 0; i < n_heads; i++)
            block[i] = -INFINITY;
        return;
    }
    c->isa->chunk(head_keys(c, b, kv), head_values(c, b, kv), first, ATTN_CHUNK, &queries, block,
                  block + ATTN_QUERIES, block + BLOCK_HEADER);
}

/* Decode, task u = b * H + head: merge the head's chunk partials in key order into its output. */
static void decode_merge(void *user, size_t u) {
    const attn_call *c = user;
    const size_t b = u / c->heads, head = u % c->heads, kv = head / c->group, in_group = head % c->group;
    const size_t s = in_group / ATTN_QUERIES, i = in_group % ATTN_QUERIES;
    const size_t block_floats = BLOCK_HEADER + ATTN_QUERIES * c->dim;
    float m = -INFINITY, l = 0.0f, a[ATTN_MAX_DIM];
    for (size_t j = 0; j < c->chunks; j++) {
        const float *block = c->partials + (((b * c->kv_heads + kv) * c->subgroups + s) * c->chunks + j) * block_floats;
        attn_merge(&m, &l, a, block[i], block[ATTN_QUERIES + i], block + BLOCK_HEADER + i * c->dim, c->dim);
    }
    float *out = c->out + b * c->heads * c->dim + head * c->dim;
    for (size_t d = 0; d < c->dim; d++)
        out[d] = a[d] / l;
}

/* Prompt, task t = ((b * tiles + tile) * KVH + kv) * subgroups + s: a tile of rows x heads over all its chunks. */
static void prompt_task(void *user, size_t t) {
    const attn_call *c = user;
    const size_t s = t % c->subgroups, kv = t / c->subgroups % c->kv_heads;
    const size_t tile = t / c->subgroups / c->kv_heads % c->tiles, b = t / c->subgroups / c->kv_heads / c->tiles;
    const size_t i0 = tile * c->tile_rows, n_rows = i0 + c->tile_rows <= c->rows ? c->tile_rows : c->rows - i0;
    size_t h0;
    const size_t n_heads = subgroup_heads(c, kv, s, &h0), dim = c->dim;
    _Alignas(32) float q[ATTN_QUERIES * ATTN_MAX_DIM];
    attn_queries queries = {0};
    load_queries(c, b, i0, n_rows, h0, n_heads, q, &queries);
    int64_t lo = queries.lo[0], hi = queries.hi[0];
    for (size_t n = 1; n < queries.n; n++) {
        lo = queries.lo[n] < lo ? queries.lo[n] : lo;
        hi = queries.hi[n] > hi ? queries.hi[n] : hi;
    }
    float m[ATTN_QUERIES], l[ATTN_QUERIES], chunk_m[ATTN_QUERIES], chunk_l[ATTN_QUERIES];
    _Alignas(32) float a[ATTN_QUERIES * ATTN_MAX_DIM], chunk_a[ATTN_QUERIES * ATTN_MAX_DIM];
    for (size_t n = 0; n < queries.n; n++) {
        m[n] = -INFINITY;
        l[n] = 0.0f;
    }
    const uint16_t *k = head_keys(c, b, kv), *v = head_values(c, b, kv);
    for (int64_t first = lo / ATTN_CHUNK * ATTN_CHUNK; first <= hi; first += ATTN_CHUNK) {
        c->isa->chunk(k, v, first, ATTN_CHUNK, &queries, chunk_m, chunk_l, chunk_a);
        for (size_t n = 0; n < queries.n; n++)
            attn_merge(&m[n], &l[n], a + n * dim, chunk_m[n], chunk_l[n], chunk_a + n * dim, dim);
    }
    for (size_t n = 0; n < queries.n; n++) {
        const size_t i = i0 + n / n_heads, head = h0 + n % n_heads;
        float *out = c->out + ((b * c->rows + i) * c->heads + head) * dim;
        for (size_t d = 0; d < dim; d++)
            out[d] = a[n * dim + d] / l[n];
    }
}

/* fn for tasks [0, count): on the calling thread when `inline_`, else on the pool. */
static OrtStatus *run(OrtKernelContext *context, const OrtApi *api, void (*fn)(void *, size_t), size_t count,
                      int inline_, void *call) {
    if (inline_ || count == 1) {
        for (size_t t = 0; t < count; t++)
            fn(call, t);
        return NULL;
    }
    return api->KernelContext_ParallelFor(context, fn, count, 0, call);
}

/* An optional input: its view, or data NULL when the node leaves it out. */
static OrtStatus *optional_input(const OrtApi *api, OrtKernelContext *context, size_t index, tensor_view *out) {
    const OrtValue *value = NULL;
    OrtStatus *status = api->KernelContext_GetInput(context, index, &value);
    if (status || value)
        return status ? status : op_input(api, context, index, out);
    memset(out, 0, sizeof *out);
    return NULL;
}

/* The inputs' shapes against each other; fills the call's shapes and input pointers. */
static OrtStatus *check_inputs(const attention_kernel *kernel, const tensor_view in[INPUTS], attn_call *c) {
    const OrtApi *api = kernel->api;
    const tensor_view *q = &in[IN_QUERY], *past = &in[IN_PAST_KEY];
    if (past->rank != 4 || in[IN_PAST_VALUE].rank != 4 || memcmp(past->dims, in[IN_PAST_VALUE].dims, 4 * 8) ||
        past->dims[1] != kernel->kv_heads)
        return op_error(api, ORT_INVALID_ARGUMENT, "DecodeAttention '%s': past_key and past_value must both be "
                        "[batch, kv_num_heads = %lld, slots, head_dim]", kernel->node, (long long)kernel->kv_heads);
    c->batch = (size_t)past->dims[0];
    c->slots = (size_t)past->dims[2];
    c->dim = (size_t)past->dims[3];
    c->heads = (size_t)kernel->heads;
    c->kv_heads = (size_t)kernel->kv_heads;
    c->group = c->heads / c->kv_heads;
    if (c->dim == 0 || c->dim % 2 || c->dim > ATTN_MAX_DIM)
        return op_error(api, ORT_INVALID_ARGUMENT, "DecodeAttention '%s': head_dim %zu must be even and at most %d",
                        kernel->node, c->dim, ATTN_MAX_DIM);
    const int packed = in[IN_KEY].data == NULL;
    if (packed != (in[IN_VALUE].data == NULL))
        return op_error(api, ORT_INVALID_ARGUMENT, "DecodeAttention '%s': key and value come both or neither",
                        kernel->node);
    const size_t q_width = (packed ? c->heads + 2 * c->kv_heads : c->heads) * c->dim;
    if (q->rank != 3 || (size_t)q->dims[0] != c->batch || (size_t)q->dims[2] != q_width)
        return op_error(api, ORT_INVALID_ARGUMENT, "DecodeAttention '%s': query must be [batch = %zu, rows, %zu]",
                        kernel->node, c->batch, q_width);
    c->rows = (size_t)q->dims[1];
    c->query = q->data;
    c->q_stride = q_width;
    if (packed) {
        c->key = c->query + c->heads * c->dim;
        c->value = c->key + c->kv_heads * c->dim;
        c->kv_stride = q_width;
    } else {
        for (int which = IN_KEY; which <= IN_VALUE; which++)
            if (in[which].rank != 3 || (size_t)in[which].dims[0] != c->batch ||
                (size_t)in[which].dims[1] != c->rows || (size_t)in[which].dims[2] != c->kv_heads * c->dim)
                return op_error(api, ORT_INVALID_ARGUMENT, "DecodeAttention '%s': key and value must be [%zu, %zu, "
                                "%zu]", kernel->node, c->batch, c->rows, c->kv_heads * c->dim);
        c->key = in[IN_KEY].data;
        c->value = in[IN_VALUE].data;
        c->kv_stride = c->kv_heads * c->dim;
    }
    const tensor_view *cs = &in[IN_COS], *sn = &in[IN_SIN];
    if (cs->rank != 2 || sn->rank != 2 || memcmp(cs->dims, sn->dims, 2 * 8) || (size_t)cs->dims[1] != c->dim / 2)
        return op_error(api, ORT_INVALID_ARGUMENT, "DecodeAttention '%s': cos_cache and sin_cache must both be "
                        "[positions, head_dim / 2 = %zu]", kernel->node, c->dim / 2);
    c->cos = cs->data;
    c->sin = sn->data;
    c->half = c->dim / 2;
    if (in[IN_SEQLENS].elements != c->batch || in[IN_POSITIONS].elements != c->batch * c->rows)
        return op_error(api, ORT_INVALID_ARGUMENT, "DecodeAttention '%s': seqlens_k must hold %zu values and "
                        "position_ids [%zu, %zu]", kernel->node, c->batch, c->batch, c->rows);
    c->seqlens = in[IN_SEQLENS].data;
    c->positions = in[IN_POSITIONS].data;
    for (size_t b = 0; b < c->batch; b++) {
        const int64_t total = (int64_t)c->seqlens[b] + 1;
        if (total < (int64_t)c->rows || total > (int64_t)c->slots)
            return op_error(api, ORT_INVALID_ARGUMENT, "DecodeAttention '%s': seqlens_k[%zu] = %d: the %zu new rows "
                            "and the past must fit the cache's %zu slots", kernel->node, b, c->seqlens[b], c->rows,
                            c->slots);
    }
    for (size_t r = 0; r < c->batch * c->rows; r++)
        if (c->positions[r] < 0 || c->positions[r] >= cs->dims[0])
            return op_error(api, ORT_INVALID_ARGUMENT, "DecodeAttention '%s': position_ids holds %lld, outside the "
                            "RoPE caches' %lld positions", kernel->node, (long long)c->positions[r],
                            (long long)cs->dims[0]);
    return NULL;
}

/* Decode partials: the kernel's buffer when it is free and large enough (grown here), else a buffer of this call's
 * own (*owned, freed by the caller). */
static float *decode_partials(attention_kernel *kernel, size_t floats, int *holds, float **owned) {
    *holds = 0;
    *owned = NULL;
    if (!atomic_flag_test_and_set(&kernel->scratch_busy)) {
        *holds = 1;
        if (kernel->scratch_floats < floats) {
            float *grown = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
            if (!grown)
                return NULL;
            free(kernel->scratch);
            kernel->scratch = grown;
            kernel->scratch_floats = floats;
        }
        return kernel->scratch;
    }
    *owned = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    return *owned;
}

static OrtStatus *compute(void *p, OrtKernelContext *context) {
    attention_kernel *kernel = p;
    const OrtApi *api = kernel->api;
    tensor_view in[INPUTS];
    OrtStatus *status = NULL;
    for (size_t i = 0; i < INPUTS && !status; i++)
        status = i == IN_KEY || i == IN_VALUE ? optional_input(api, context, i, &in[i]) : op_input(api, context, i,
                                                                                                   &in[i]);
    if (status)
        return status;
    attn_call c = {0};
    if ((status = check_inputs(kernel, in, &c)))
        return status;
    c.isa = c.dim % 8 ? &attn_isa_portable : kernel->isa;
    c.window = kernel->window;
    c.scale = kernel->scale > 0.0f ? kernel->scale : 1.0f / sqrtf((float)c.dim);
    const int64_t out_dims[3] = {(int64_t)c.batch, (int64_t)c.rows, (int64_t)(c.heads * c.dim)};
    void *present[2];
    if ((status = op_output(api, context, OUT_OUTPUT, out_dims, 3, (void **)&c.out)) ||
        (status = op_output(api, context, OUT_KEY, in[IN_PAST_KEY].dims, 4, &present[0])) ||
        (status = op_output(api, context, OUT_VALUE, in[IN_PAST_VALUE].dims, 4, &present[1])))
        return status;
    const size_t cache_bytes = c.batch * c.kv_heads * c.slots * c.dim * sizeof(uint16_t);
    for (int i = 0; i < 2; i++)
        if (present[i] != in[IN_PAST_KEY + i].data) /* not bound in place: the present starts as the past */
            memcpy(present[i], in[IN_PAST_KEY + i].data, cache_bytes);
    c.cache_k = present[0];
    c.cache_v = present[1];
    if (c.rows == 0)
        return NULL;

    /* the last row's keys per batch row (the most any row reads) and the chunks they span */
    size_t longest = 0, keys = 0;
    for (size_t b = 0; b < c.batch; b++) {
        int64_t lo, hi;
        bounds(&c, b, c.rows - 1, &lo, &hi);
        const size_t span = (size_t)(hi / ATTN_CHUNK - lo / ATTN_CHUNK + 1);
        longest = span > longest ? span : longest;
        keys += (size_t)(hi - lo + 1);
    }
    const int small = keys * c.kv_heads * c.dim * 2 * sizeof(uint16_t) < INLINE_BYTES; /* K and V of a row */
    if ((status = run(context, api, append_row, c.batch * c.rows, c.rows == 1 || small, &c)))
        return status;

    c.subgroups = (c.group + ATTN_QUERIES - 1) / ATTN_QUERIES;
    if (c.rows > 1) {
        c.tile_rows = c.group <= ATTN_PAIRED ? ATTN_PAIRED / c.group : 1; /* a query's chunks: the same kernel */
        c.tiles = (c.rows + c.tile_rows - 1) / c.tile_rows;
        return run(context, api, prompt_task, c.batch * c.tiles * c.kv_heads * c.subgroups, small, &c);
    }
    c.chunks = longest;
    const size_t tasks = c.batch * c.kv_heads * c.subgroups * c.chunks;
    int holds;
    float *owned;
    c.partials = decode_partials(kernel, tasks * (BLOCK_HEADER + ATTN_QUERIES * c.dim), &holds, &owned);
    if (!c.partials)
        status = op_error(api, ORT_FAIL, "DecodeAttention '%s': out of memory for %zu chunks", kernel->node, tasks);
    if (!status)
        status = run(context, api, decode_task, tasks, small, &c);
    if (!status)
        status = run(context, api, decode_merge, c.batch * c.heads, c.chunks * c.heads * c.dim < INLINE_BYTES / 4,
                     &c);
    if (holds)
        atomic_flag_clear(&kernel->scratch_busy);
    free(owned);
    return status;
}

static const char *name(const OrtCustomOp *op) { (void)op; return "DecodeAttention"; }

static size_t input_count(const OrtCustomOp *op) { (void)op; return INPUTS; }
static size_t output_count(const OrtCustomOp *op) { (void)op; return OUTPUTS; }

static ONNXTensorElementDataType input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    switch (i) {
    case IN_PAST_KEY:
    case IN_PAST_VALUE: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    case IN_SEQLENS: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    case IN_POSITIONS: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    }
}

static ONNXTensorElementDataType output_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == OUT_OUTPUT ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
}

static OrtCustomOpInputOutputCharacteristic input_characteristic(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == IN_KEY || i == IN_VALUE ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

/* A shape onnxruntime knows by value or by name for every dimension, copied; 0 when it does not. */
static int known_shape(const OrtApi *api, OrtShapeInferContext *context, size_t input, int64_t dims[4],
                       const char *names[4], size_t *rank, OrtStatus **status) {
    OrtTensorTypeAndShapeInfo *info = NULL; /* owned by the context */
    if ((*status = api->ShapeInferContext_GetInputTypeShape(context, input, &info)) ||
        (*status = api->GetDimensionsCount(info, rank)) || *rank > 4 ||
        (*status = api->GetDimensions(info, dims, *rank)) ||
        (*status = api->GetSymbolicDimensions(info, names, *rank)))
        return 0;
    for (size_t i = 0; i < *rank; i++)
        if (dims[i] < 0 && (!names[i] || !names[i][0]))
            return 0;
    return 1;
}

static OrtStatus *set_shape(const OrtApi *api, OrtShapeInferContext *context, size_t output,
                            ONNXTensorElementDataType type, const int64_t *dims, const char **names, size_t rank) {
    OrtTensorTypeAndShapeInfo *info = NULL;
    OrtStatus *status = api->CreateTensorTypeAndShapeInfo(&info);
    if (status)
        return status;
    if (!(status = api->SetTensorElementType(info, type)) && !(status = api->SetDimensions(info, dims, rank)) &&
        !(status = api->SetSymbolicDimensions(info, names, rank)))
        status = api->ShapeInferContext_SetOutputTypeShape(context, output, info);
    api->ReleaseTensorTypeAndShapeInfo(info);
    return status;
}

/* output: [batch, rows, num_heads * head_dim] from query and past_key; the presents: their pasts' shapes. Shapes
 * onnxruntime does not know are left unset (the kernel checks them at run time). */
static OrtStatus *infer(const OrtCustomOp *op, OrtShapeInferContext *context) {
    (void)op;
    const OrtApi *api = ort_api;
    OrtStatus *status = NULL;
    int64_t past[4], query[4];
    const char *past_names[4] = {0}, *query_names[4] = {0};
    size_t past_rank = 0, query_rank = 0;
    if (!known_shape(api, context, IN_PAST_KEY, past, past_names, &past_rank, &status) || past_rank != 4)
        return status;
    for (size_t output = OUT_KEY; output <= OUT_VALUE; output++)
        if ((status = set_shape(api, context, output, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, past, past_names, 4)))
            return status;
    if (!known_shape(api, context, IN_QUERY, query, query_names, &query_rank, &status) || query_rank != 3 ||
        past[3] < 0)
        return status;
    const OrtOpAttr *attr = NULL;
    int64_t heads = 0;
    size_t read = 0;
    if ((status = api->ShapeInferContext_GetAttribute(context, "num_heads", &attr)) ||
        (status = api->ReadOpAttr(attr, ORT_OP_ATTR_INT, &heads, sizeof heads, &read)))
        return status;
    query[2] = heads * past[3];
    query_names[2] = "";
    return set_shape(api, context, OUT_OUTPUT, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, query, query_names, 3);
}

OrtCustomOp op_decode_attention_cpu = {
    .version = EDGEDECODE_ORT_API_VERSION,
    .GetName = name,
    .GetExecutionProviderType = op_cpu_provider,
    .GetInputType = input_type,
    .GetInputTypeCount = input_count,
    .GetOutputType = output_type,
    .GetOutputTypeCount = output_count,
    .KernelDestroy = destroy,
    .GetInputCharacteristic = input_characteristic,
    .GetOutputCharacteristic = op_required,
    .GetInputMemoryType = op_default_memory,
    .GetVariadicInputMinArity = op_one,
    .GetVariadicInputHomogeneity = op_one,
    .GetVariadicOutputMinArity = op_one,
    .GetVariadicOutputHomogeneity = op_one,
    .CreateKernelV2 = create,
    .KernelComputeV2 = compute,
    .InferOutputShapeFn = infer,
    .GetStartVersion = op_one,
    .GetEndVersion = NULL,
};
