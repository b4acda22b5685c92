/* The CUDA execution provider's ops (cuda_ops.c): MatMulGGUF and GatherGGUF as the contract describes them, on
 * float16, and FusedMatMulGGUF (RMSNorm, up to three weight matrices, a gate and a residual add in one kernel). */
#ifndef ED_CUDA_OPS_H
#define ED_CUDA_OPS_H

#include "ops.h"

extern OrtCustomOp op_matmul_gguf_cuda;
extern OrtCustomOp op_gather_gguf_cuda;
extern OrtCustomOp op_fused_matmul_gguf_cuda;

#endif
