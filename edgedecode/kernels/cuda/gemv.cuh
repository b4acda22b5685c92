// The GEMV family: y = norm(x) · W^T for GGUF weights read as stored, float16 in and out, float32 sums.
//
// A thread block stages its columns of x in shared memory once (float32, times the RMSNorm weight when
// there is one, times a per-position power of two, see below) with each 16-element run's sum; then each
// group of `lanes` threads takes R weight rows and walks the row's units (32 elements), lane by lane.
// A unit's codes are bytes; masking a byte in place gives a float32 whose bits are the code times a
// subnormal power of two (code * 2^-149, or code * 2^-141 for a byte at bits 8..15), which one FMA
// multiplies exactly by the staged x (x * 2^96 or x * 2^88), so each run's sum is sum(x * code) * 2^-53
// with no integer-to-float conversion. A unit adds scale * sum(x * code) + bias * sum(x) per run
// (blocks.cuh), which also applies Q4_1's m and the K-quants' mins in the same kernel.
// Subnormals must not be flushed: NVRTC compiles without -ftz (the default, kept by nvrtc.py).
#pragma once
#include "blocks.cuh"

#define ED_TWO_POW_53 9007199254740992.0f
#define ED_MAX_THREADS 256

// Staged x of one run's 16 elements: element j is multiplied by 2^96 when it is byte 0 of its word and by
// 2^88 otherwise, matching where run_dot leaves the code bits.
ED_DEV float stage_factor(int j) { return (j & 3) == 0 ? 79228162514264337593543950336.0f : 309485009821345068724781056.0f; }

ED_DEV float run_dot(const u32 (&codes)[4], const float (&x)[16]) {
    float acc = 0.0f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const u32 c = codes[w];
        acc = fmaf(x[4 * w + 0], as_float(c & 0xFFu), acc);
        acc = fmaf(x[4 * w + 1], as_float(c & 0xFF00u), acc);
        acc = fmaf(x[4 * w + 2], as_float((c >> 8) & 0xFF00u), acc);
        acc = fmaf(x[4 * w + 3], as_float((c >> 16) & 0xFF00u), acc);
    }
    return acc;
}

// Sum of v over the thread block (every thread gets it); scratch holds one float per warp.
ED_DEV float block_sum(float v, float *scratch) {
    v = group_sum(v, 32);
    const int tid = thread_x(), warps = block_dim() / 32;
    if ((tid & 31) == 0) scratch[tid >> 5] = v;
    sync_threads();
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += scratch[w];
    sync_threads();
    return total;
}

// Stage MT columns of x (starting at col0) into xs [MT][k], their run sums into sums [MT][k/16] and the
// RMSNorm factor 1/sqrt(mean(x^2) + eps) (1 without a norm) into inv [MT]. Columns past m stage zeros.
template <int MT>
ED_DEV void stage_x(const EdGemvArgs &a, int col0, float *xs, float *sums, float *inv, float *scratch) {
    const int k = a.k, runs = k / 16, tid = thread_x(), threads = block_dim();
    const u8 *gamma = reinterpret_cast<const u8 *>(a.gamma);
#pragma unroll
    for (int c = 0; c < MT; ++c) {
        const int col = col0 + c;
        const bool valid = col < a.m;
        const u8 *x = reinterpret_cast<const u8 *>(a.x) + (u64)(valid ? col : 0) * k * 2;
        float squares = 0.0f;
        for (int r = tid; r < runs; r += threads) {
            u32 xw[8], gw[8];
            ld16_a16(x + 32 * r, *reinterpret_cast<u32(*)[4]>(xw));
            ld16_a16(x + 32 * r + 16, *reinterpret_cast<u32(*)[4]>(xw + 4));
            if (gamma) {
                ld16_a16(gamma + 32 * r, *reinterpret_cast<u32(*)[4]>(gw));
                ld16_a16(gamma + 32 * r + 16, *reinterpret_cast<u32(*)[4]>(gw + 4));
            }
            float sum = 0.0f;
            float *out = xs + (u64)c * k + 16 * r;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const u32 bits = (xw[j >> 1] >> (16 * (j & 1))) & 0xFFFF;
                const float v = valid ? h2f((u16)bits) : 0.0f;
                const float g = gamma ? h2f((u16)((gw[j >> 1] >> (16 * (j & 1))) & 0xFFFF)) : 1.0f;
                squares = fmaf(v, v, squares);
                const float t = v * g;
                sum += t;
                out[j] = t * stage_factor(j);
            }
            sums[c * runs + r] = sum;
        }
        if (gamma) {
            const float total = block_sum(squares, scratch);
            if (tid == 0) inv[c] = 1.0f / sqrt_f(total / (float)k + a.eps);
        } else if (tid == 0) {
            inv[c] = 1.0f;
        }
    }
}

ED_DEV float gate_act(float g, int gate) {
    if (gate == ED_GATE_SILU) return g / (1.0f + exp_f(-g));
    // GELU, tanh form: 0.5 g (1 + tanh(z)), z = sqrt(2/pi) (g + 0.044715 g^3), computed as g * sigmoid(2z), the
    // same function without 1 + tanh(z)'s cancellation for negative z
    const float z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return g / (1.0f + exp_f(-2.0f * z));
}

// R weight rows per group (gated: R/2 gate rows, then the R/2 up rows of the same outputs), MT columns.
template <int TYPE, int R, int MT, bool GATED>
ED_DEV void gemv_rows(const EdGemvArgs &a, int seg, int out_row0, int col0, const float *xs, const float *sums,
                      const float *inv, float *reduce) {
    constexpr int RO = GATED ? R / 2 : R;
    const int k = a.k, runs = k / 16, units = k / 32, lanes = a.lanes;
    const int tid = thread_x(), lane = tid % lanes;
    const int rows = a.rows[seg];
    const u8 *wrow[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const int s = GATED ? (i < RO ? 0 : 1) : seg;
        int j = out_row0 + (GATED ? i % RO : i);
        j = j < rows ? j : rows - 1;  // rows past the end read the last row; their sums are not written
        wrow[i] = reinterpret_cast<const u8 *>(a.w[s]) + (u64)j * a.row_bytes[s];
    }
    float acc[R][MT];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int c = 0; c < MT; ++c) acc[i][c] = 0.0f;

    for (int u = lane; u < units; u += lanes) {
        Unit unit[R];
#pragma unroll
        for (int i = 0; i < R; ++i) Block<TYPE>::decode(wrow[i], u, unit[i]);
        int lo, hi;
        Block<TYPE>::runs(u, lo, hi);
#pragma unroll
        for (int c = 0; c < MT; ++c) {
            float xl[16], xh[16];
            const float *xc = xs + (u64)c * k;
#pragma unroll
            for (int j = 0; j < 16; j += 4) {
                const float4 l4 = *reinterpret_cast<const float4 *>(xc + lo + j);
                const float4 h4 = *reinterpret_cast<const float4 *>(xc + hi + j);
                xl[j] = l4.x, xl[j + 1] = l4.y, xl[j + 2] = l4.z, xl[j + 3] = l4.w;
                xh[j] = h4.x, xh[j + 1] = h4.y, xh[j + 2] = h4.z, xh[j + 3] = h4.w;
            }
            const float sum_lo = sums[c * runs + lo / 16], sum_hi = sums[c * runs + hi / 16];
#pragma unroll
            for (int i = 0; i < R; ++i) {
                const float dot_lo = run_dot(unit[i].lo, xl) * ED_TWO_POW_53;
                const float dot_hi = run_dot(unit[i].hi, xh) * ED_TWO_POW_53;
                float t = acc[i][c];
                t = fmaf(unit[i].scale_lo, dot_lo, t);
                t = fmaf(unit[i].bias_lo, sum_lo, t);
                t = fmaf(unit[i].scale_hi, dot_hi, t);
                t = fmaf(unit[i].bias_hi, sum_hi, t);
                acc[i][c] = t;
            }
        }
    }

    // Sum over the group's lanes: shuffles within a warp, then (groups wider than a warp) shared memory.
    const int width = lanes < 32 ? lanes : 32;
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int c = 0; c < MT; ++c) acc[i][c] = group_sum(acc[i][c], width);
    if (lanes > 32) {
        const int warp = tid >> 5, warps_per_group = lanes >> 5;
        if ((tid & 31) == 0) {
#pragma unroll
            for (int i = 0; i < R; ++i)
#pragma unroll
                for (int c = 0; c < MT; ++c) reduce[(warp * R + i) * MT + c] = acc[i][c];
        }
        sync_threads();
        const int first = (warp / warps_per_group) * warps_per_group;
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
            for (int c = 0; c < MT; ++c) {
                float t = 0.0f;
                for (int w = 0; w < warps_per_group; ++w) t += reduce[((first + w) * R + i) * MT + c];
                acc[i][c] = t;
            }
        sync_threads();  // the block's next tile writes `reduce` again
    }

    // Output o * MT + c (row o, column c) is written by lane (o * MT + c) % lanes of the group: every lane holds
    // every sum, and a group of 8 lanes has fewer lanes than the 16 outputs of R = 4 rows by MT = 4 columns.
    for (int idx = lane; idx < RO * MT; idx += lanes) {
        const int o = idx / MT, c = idx % MT;
        const int j = out_row0 + o, col = col0 + c;
        float v = 0.0f, g = 0.0f;
#pragma unroll
        for (int i = 0; i < RO; ++i)
#pragma unroll
            for (int cc = 0; cc < MT; ++cc)
                if (i == o && cc == c) v = acc[GATED ? RO + i : i][cc], g = acc[i][cc];
        if (j < rows && col < a.m) {
            const float scale = inv[c];
            v *= scale;
            if (GATED) v *= gate_act(g * scale, a.gate);
            int out_col = j;
            if (!GATED)
                for (int s = 0; s < seg; ++s) out_col += a.rows[s];
            if (!GATED && a.bias) v += h2f(reinterpret_cast<const u16 *>(a.bias)[out_col]);
            const u64 at = (u64)col * a.n_out + out_col;
            if (a.residual) v += h2f(reinterpret_cast<const u16 *>(a.residual)[at]);
            reinterpret_cast<u16 *>(a.y)[at] = f2h(v);
        }
    }
}

// One tile of rows: the type is the tile's segment's, one switch per tile.
template <int R, int MT, bool GATED>
ED_DEV void gemv_tile(const EdGemvArgs &a, int seg, int out_row0, int col0, const float *xs, const float *sums,
                      const float *inv, float *reduce) {
    switch (a.type[seg]) {
    case ED_Q4_0: gemv_rows<ED_Q4_0, R, MT, GATED>(a, seg, out_row0, col0, xs, sums, inv, reduce); break;
    case ED_Q4_1: gemv_rows<ED_Q4_1, R, MT, GATED>(a, seg, out_row0, col0, xs, sums, inv, reduce); break;
    case ED_Q5_0: gemv_rows<ED_Q5_0, R, MT, GATED>(a, seg, out_row0, col0, xs, sums, inv, reduce); break;
    case ED_Q5_1: gemv_rows<ED_Q5_1, R, MT, GATED>(a, seg, out_row0, col0, xs, sums, inv, reduce); break;
    case ED_Q8_0: gemv_rows<ED_Q8_0, R, MT, GATED>(a, seg, out_row0, col0, xs, sums, inv, reduce); break;
    case ED_Q4_K: gemv_rows<ED_Q4_K, R, MT, GATED>(a, seg, out_row0, col0, xs, sums, inv, reduce); break;
    case ED_Q5_K: gemv_rows<ED_Q5_K, R, MT, GATED>(a, seg, out_row0, col0, xs, sums, inv, reduce); break;
    case ED_Q6_K: gemv_rows<ED_Q6_K, R, MT, GATED>(a, seg, out_row0, col0, xs, sums, inv, reduce); break;
    default: break;
    }
}

// A block stages its columns of x once, then takes tiles of rows (cta_start: the first tile of each segment; its
// last entry, the number of tiles) blockIdx.x, blockIdx.x + gridDim.x, ...: a grid smaller than the tiles
// (the LM head's thousands) stages x a few hundred times rather than once per tile.
template <int R, int MT, bool GATED>
ED_DEV void gemv(const EdGemvArgs &a) {
    ED_SHARED float scratch[ED_MAX_THREADS / 32];
    ED_SHARED float reduce[ED_MAX_THREADS / 32 * R * MT];
    constexpr int RO = GATED ? R / 2 : R;
    const int groups = block_dim() / a.lanes, group = thread_x() / a.lanes;
    const int col0 = block_y() * MT;

    float *xs = dynamic_shared();               // [MT][k]
    float *sums = xs + (u64)MT * a.k;           // [MT][k / 16]
    float *inv = sums + (u64)MT * (a.k / 16);   // [MT]
    stage_x<MT>(a, col0, xs, sums, inv, scratch);
    sync_threads();

    for (int tile = block_x(); tile < a.cta_start[ED_MAX_SEGMENTS]; tile += grid_x()) {
        int seg = 0;
        while (seg + 1 < ED_MAX_SEGMENTS && a.rows[seg + 1] > 0 && tile >= a.cta_start[seg + 1]) ++seg;
        const int out_row0 = ((tile - a.cta_start[seg]) * groups + group) * RO;
        gemv_tile<R, MT, GATED>(a, seg, out_row0, col0, xs, sums, inv, reduce);
    }
}
