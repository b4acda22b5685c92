/* The launch arguments of edgedecode's CUDA kernels, shared by the host glue (gcc, cuda_ops.c) and the
 * kernels (NVRTC, kernels.cu): one definition, so both sides agree on the layout. Only 8-byte pointers
 * and 4-byte ints/floats, pointers first: the same layout under the x86-64/aarch64 and nvptx64 ABIs. */
#ifndef ED_CUDA_ARGS_H
#define ED_CUDA_ARGS_H

#define ED_MAX_SEGMENTS 3 /* weight matrices one fused GEMV reads (Q, K, V) */

/* GGML's type numbers of the block types the kernels read. */
#define ED_Q4_0 2
#define ED_Q4_1 3
#define ED_Q5_0 6
#define ED_Q5_1 7
#define ED_Q8_0 8
#define ED_Q4_K 12
#define ED_Q5_K 13
#define ED_Q6_K 14

/* Epilogue of a gated GEMV: y = act(w0 · x) * (w1 · x). */
#define ED_GATE_NONE 0
#define ED_GATE_SILU 1
#define ED_GATE_GELU_TANH 2

/* y[m, :] = concat over segments s of (norm(x[m]) · W_s^T) (+ bias) (+ residual[m, :]), float16 in and out,
 * float32 accumulation. Gated: y[m, j] = act(norm(x[m]) · W_0[j]) * (norm(x[m]) · W_1[j]) (+ residual[m, j]). */
typedef struct EdGemvArgs {
    const void *x;        /* float16 [m, k] */
    const void *gamma;    /* float16 [k]: RMSNorm weight applied to x first, or NULL for no norm */
    const void *residual; /* float16 [m, n_out] added to the result, or NULL */
    const void *bias;     /* float16 [n_out] added to the product before the residual (not gated), or NULL */
    void *y;              /* float16 [m, n_out] */
    const void *w[ED_MAX_SEGMENTS]; /* uint8 [rows[s], row_bytes[s]]: GGUF rows as stored */
    int rows[ED_MAX_SEGMENTS];      /* rows of each segment, 0 past the last */
    int type[ED_MAX_SEGMENTS];      /* GGML type of each segment (gated: both the same) */
    int row_bytes[ED_MAX_SEGMENTS];
    int cta_start[ED_MAX_SEGMENTS + 1]; /* first thread block of each segment; [segments] = grid size */
    int k;                /* reduction length (elements of a row) */
    int m;                /* rows of x (tokens) */
    int n_out;            /* columns of y: sum of rows, or rows[0] when gated */
    int lanes;            /* threads that share one row group: 8, 16, 32, 64, 128 or 256 */
    int gate;             /* ED_GATE_* */
    float eps;            /* RMSNorm epsilon */
} EdGemvArgs;

/* y[i, :] = dequant(table[ids[i]]) for i < count; an id in [-vocab, 0) counts from the end, any other
 * outside [0, vocab) gives a row of zeros (a device kernel cannot fail the run). */
typedef struct EdGatherArgs {
    const void *table;    /* uint8 [vocab, row_bytes] */
    const long long *ids; /* int64 [count] */
    void *y;              /* float16 or float32 [count, k] */
    long long count;
    int vocab;
    int row_bytes;
    int k;
    int type;             /* GGML type */
    int out_float32;      /* 1: y is float32, 0: float16 */
    int pad_;
} EdGatherArgs;

#endif
