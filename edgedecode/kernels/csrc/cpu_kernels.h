/* The CPU kernels' interface: activation quantization, per-type matrix-vector products, row dequantization, and the
 * table of them for each instruction-set path (portable C, AVX2, AVX-512 VNNI, NEON), chosen at run time.
 *
 * Accuracy level 4 (int8 activations) quantizes a float row of K elements in blocks of QA elements, QA = 32 for the
 * 32-element types (Q4_0 ... Q8_0) and 256 for the K-quants (the weight's block, as llama.cpp's Q8_0/Q8_K):
 *     d = max|a| / 127 (float32),  q = round_half_even(a * (1/d)) (float32 product; q = 0 where d = 0).
 * and keeps, besides q and d, the integer sums of every 16 and every 32 codes, which fold the types' offsets into
 * one product per block. Y is then, per row, the sum over weight blocks of the exact integer dot products times the
 * float scales (formulas in cpu_portable.c); paths differ only in the order of the float additions.
 */
#ifndef EDGEDECODE_CPU_KERNELS_H
#define EDGEDECODE_CPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "ggml_blocks.h"

/* One row of quantized activations; the arrays live in caller-provided memory (act_q8_bind). */
typedef struct {
    int8_t *q;      /* [K] codes */
    float *d;       /* [K / QA] scales */
    int16_t *sum16; /* [K / 16] sum of each 16 codes (|sum| <= 2032) */
    int16_t *sum32; /* [K / 32] sum of each 32 codes (|sum| <= 4064) */
} act_q8;

/* Bytes one quantized row of K elements takes (64-byte aligned pieces), and carving a row's arrays out of `mem`
 * (64-byte aligned, act_q8_bytes(k) long). K is a multiple of 32. */
size_t act_q8_bytes(size_t k);
void act_q8_bind(act_q8 *a, void *mem, size_t k);
/* Fill sum16 and sum32 from the codes (in element order). */
void act_q8_sums(act_q8 *a, size_t k);
/* Reorder element-order codes into ACT_PAIRED (in place). */
void act_q8_pair(act_q8 *a, size_t k);

/* The activation block QA of a type index: 256 for the K-quants, else 32. */
static inline int act_block_of(int qi) { return qi >= QI_Q4_K ? 256 : 32; }

/* The order the codes are stored in, which a path's kernels may choose per type (the sums and scales are always in
 * element order): ACT_NATURAL, element order; ACT_PAIRED, within each pair of 32-element blocks (64 codes), the
 * first 16 codes of both blocks, then the last 16 of both: [b0 0..15, b1 0..15, b0 16..31, b1 16..31], so the
 * nibbles of two Q4/Q5 blocks, loaded side by side, meet their activations without a shuffle. An odd last block
 * stays in element order. */
enum { ACT_NATURAL = 0, ACT_PAIRED = 1 };

typedef void (*quantize_fn)(const float *x, size_t k, int block, int layout, act_q8 *out);
/* y[i * y_stride + r] = dot(row r of B, a[i]) for r in [0, n), i in [0, m); rows are row_bytes apart, k elements
 * a row. m = 1 is decode; a path may unpack a weight row once for several activation rows. */
typedef void (*gemm_q8_fn)(const uint8_t *rows, size_t row_bytes, size_t n, size_t k, const act_q8 *a, size_t m,
                           float *y, size_t y_stride);
typedef void (*gemv_f32_fn)(const uint8_t *rows, size_t row_bytes, size_t n, size_t k, const float *x, float *y);
typedef void (*dequant_fn)(const uint8_t *row, size_t k, float *out);

typedef struct {
    const char *name; /* "portable", "avx2", "avx512vnni", "neon", "neondot" */
    int (*usable)(void); /* whether this CPU runs the path */
    quantize_fn quantize;
    unsigned char act_layout[QI_COUNT]; /* the layout gemm_q8[type] reads */
    gemm_q8_fn gemm_q8[QI_COUNT];
    gemv_f32_fn gemv_f32[QI_COUNT];
    dequant_fn dequant[QI_COUNT];
} cpu_isa;

/* Quantize one row for type index qi as `isa`'s kernels read it. */
static inline void act_q8_quantize(const cpu_isa *isa, int qi, const float *x, size_t k, act_q8 *out) {
    isa->quantize(x, k, act_block_of(qi), isa->act_layout[qi], out);
}

extern const cpu_isa cpu_isa_portable;
#if defined(__x86_64__) || defined(__i386__)
extern const cpu_isa cpu_isa_avx2;
extern const cpu_isa cpu_isa_avx512vnni;
#endif
#if defined(__aarch64__)
extern const cpu_isa cpu_isa_neon;
extern const cpu_isa cpu_isa_neondot;
#endif

/* The path in use: the best this CPU runs, unless EDGEDECODE_KERNELS_ISA names another usable one (first call
 * decides) or cpu_isa_force chose one since. */
const cpu_isa *cpu_isa_current(void);
/* Choose the path by name; 0 on success, -1 when it is unknown or this CPU cannot run it. */
int cpu_isa_force(const char *name);
/* Every path compiled in, best first, NULL-terminated. */
const cpu_isa *const *cpu_isa_all(void);

#endif
