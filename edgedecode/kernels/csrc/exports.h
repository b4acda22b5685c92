/* The library's exported C functions: onnxruntime's entry point, and what Python asks through ctypes without
 * onnxruntime (what the library is, which CPU path it runs) plus the kernels themselves, for tests and benchmarks. */
#ifndef EDGEDECODE_EXPORTS_H
#define EDGEDECODE_EXPORTS_H

#include <stddef.h>
#include <stdint.h>

#include "ort_abi.h"

#define EXPORT __attribute__((visibility("default")))

/* Bumped whenever these exports or the ops' contract change, so Python can tell a stale build from a current one. */
#define EDGEDECODE_KERNELS_ABI 2

EXPORT OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base);
/* Why the last RegisterCustomOps refused without a status ("" if it did not). */
EXPORT const char *edgedecode_kernels_last_refusal(void);

EXPORT int edgedecode_kernels_version(void);
EXPORT uint32_t edgedecode_kernels_required_api(void);
EXPORT int edgedecode_kernels_cuda_built(void);
/* The CPU path in use, the usable ones (comma-separated, best first), and choosing one: 0 ok, -1 unusable. */
EXPORT const char *edgedecode_kernels_cpu_isa(void);
EXPORT const char *edgedecode_kernels_cpu_isas(void);
EXPORT int edgedecode_kernels_set_cpu_isa(const char *name);

/* Calls the OrtApi entries this library names that need no session, on the live runtime, and checks what they
 * return: 0 when all agree, else -1 with the first disagreement in `message`. */
EXPORT int edgedecode_kernels_abi_selftest(const OrtApiBase *base, char *message, size_t size);

/* Y[M, N] = A[M, K] . dequant(B)^T on the calling thread with the current path; 0 ok, -1 bad arguments. */
EXPORT int edgedecode_kernels_matmul(int ggml_type, int accuracy_level, int64_t k, int64_t n, int64_t m,
                                     const float *a, const uint8_t *b, float *y);
/* Accuracy level 4's activation quantization of one row: codes [K], scales [K / QA], sums of 16 and 32 codes. */
EXPORT int edgedecode_kernels_quantize(int ggml_type, int64_t k, const float *x, int8_t *q, float *d,
                                       int16_t *sum16, int16_t *sum32);
/* rows [R, row bytes] -> floats [R, K]. */
EXPORT int edgedecode_kernels_dequantize(int ggml_type, int64_t k, int64_t rows, const uint8_t *b, float *out);


/* EDKV sections on the CPU (kv_quant.c), byte for byte edgedecode/kv/quant.py's. A section is K or V rows of float32
 * `src`, element [l][h][t][c] at l * layer_stride + h * head_stride + tokens[t] * token_stride + c (c contiguous),
 * for `layers` layers, `heads` heads and the m token indices `tokens`, head_dim d. Outputs per layer are
 * C-contiguous [heads, ...] blocks, a layer stride apart (bytes). A status: */
enum {
    KVQ_OK = 0,          /* written */
    KVQ_ZERO_MIN = 1,    /* a group's minimum is ±0, whose sign numpy's reduction order decides: not written */
    KVQ_REFUSED = 2,     /* a value not finite, or beyond what the section holds: not written (the reference raises) */
    KVQ_UNSUPPORTED = 3, /* a shape or a CPU this code does not cover */
};
/* Quantize (axis 0: token, 1: channel; group; bits 2, 3, 4 or 8): codes [heads, m, d·bits/8], float16 scales and
 * zeros [heads, params rows, cols] (kv/quant.py's params_shape). */
EXPORT int edgedecode_kv_quantize(const float *src, int64_t layers, int64_t heads, int64_t m, int64_t d,
                                  int64_t layer_stride, int64_t head_stride, int64_t token_stride,
                                  const int64_t *tokens, int axis, int group, int bits, uint8_t *codes,
                                  uint8_t *scales, uint8_t *zeros, int64_t codes_layer_stride,
                                  int64_t params_layer_stride);
/* Cast to float16 (nearest even): out [heads, m, d] per layer; KVQ_REFUSED where a value is not finite in float16. */
EXPORT int edgedecode_kv_to_fp16(const float *src, int64_t layers, int64_t heads, int64_t m, int64_t d,
                                 int64_t layer_stride, int64_t head_stride, int64_t token_stride,
                                 const int64_t *tokens, uint8_t *out, int64_t out_layer_stride);
/* zlib's crc32(*crc, buf, len) into *crc with PCLMULQDQ (crc32.c); KVQ_UNSUPPORTED (nothing written) below 64 bytes
 * or on a CPU without it. */
EXPORT int edgedecode_crc32(const uint8_t *buf, size_t len, uint32_t *crc);

#endif
