// GatherGGUF: rows of a GGUF table, dequantized exactly (scale * code + bias in float32, as the reference
// does), as float32 or rounded to float16. One thread per unit (32 elements) of one id.
#pragma once
#include "blocks.cuh"

ED_DEV void store_run(const EdGatherArgs &a, u64 at, const u32 (&codes)[4], float scale, float bias, bool zero) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const float code = (float)((codes[j >> 2] >> (8 * (j & 3))) & 0xFF);
        const float v = zero ? 0.0f : fmaf(scale, code, bias);
        if (a.out_float32)
            reinterpret_cast<float *>(a.y)[at + j] = v;
        else
            reinterpret_cast<u16 *>(a.y)[at + j] = f2h(v);
    }
}

template <int TYPE>
ED_DEV void gather_unit(const EdGatherArgs &a, long long i, int u) {
    long long id = a.ids[i];
    if (id < 0) id += a.vocab;
    const bool zero = id < 0 || id >= a.vocab;
    const u8 *row = reinterpret_cast<const u8 *>(a.table) + (u64)(zero ? 0 : id) * a.row_bytes;
    Unit unit;
    Block<TYPE>::decode(row, u, unit);
    int lo, hi;
    Block<TYPE>::runs(u, lo, hi);
    store_run(a, (u64)i * a.k + lo, unit.lo, unit.scale_lo, unit.bias_lo, zero);
    store_run(a, (u64)i * a.k + hi, unit.hi, unit.scale_hi, unit.bias_hi, zero);
}

ED_DEV void gather(const EdGatherArgs &a) {
    const int units = a.k / 32;
    const long long total = a.count * units;
    for (long long t = (long long)block_x() * block_dim() + thread_x(); t < total;
         t += (long long)grid_x() * block_dim()) {
        const long long i = t / units;
        const int u = (int)(t % units);
        switch (a.type) {
        case ED_Q4_0: gather_unit<ED_Q4_0>(a, i, u); break;
        case ED_Q4_1: gather_unit<ED_Q4_1>(a, i, u); break;
        case ED_Q5_0: gather_unit<ED_Q5_0>(a, i, u); break;
        case ED_Q5_1: gather_unit<ED_Q5_1>(a, i, u); break;
        case ED_Q8_0: gather_unit<ED_Q8_0>(a, i, u); break;
        case ED_Q4_K: gather_unit<ED_Q4_K>(a, i, u); break;
        case ED_Q5_K: gather_unit<ED_Q5_K>(a, i, u); break;
        case ED_Q6_K: gather_unit<ED_Q6_K>(a, i, u); break;
        default: break;
        }
    }
}
