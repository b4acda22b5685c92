/* Launch planning for the CUDA kernels (see cuda_plan.h). */
#include "cuda_plan.h"

#include <stdio.h>
#include <string.h>

int ed_block_elems(int type) {
    switch (type) {
    case ED_Q4_0: case ED_Q4_1: case ED_Q5_0: case ED_Q5_1: case ED_Q8_0: return 32;
    case ED_Q4_K: case ED_Q5_K: case ED_Q6_K: return 256;
    default: return 0;
    }
}

int ed_block_bytes(int type) {
    switch (type) {
    case ED_Q4_0: return 18;
    case ED_Q4_1: return 20;
    case ED_Q5_0: return 22;
    case ED_Q5_1: return 24;
    case ED_Q8_0: return 34;
    case ED_Q4_K: return 144;
    case ED_Q5_K: return 176;
    case ED_Q6_K: return 210;
    default: return 0;
    }
}

/* Blocks per SM the grid is capped at: enough warps in flight to cover memory latency (4 blocks of 4 warps), few
 * enough that each block's staging of x serves several tiles of rows where there are many (the LM head). */
enum { DEFAULT_BLOCKS_PER_SM = 4 };

static int pow2_floor(int v) {
    int p = 1;
    while (p * 2 <= v) p *= 2;
    return p;
}

static int clamp(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

static unsigned shared_for(int k, int mt) { return (unsigned)(mt * (k + k / 16 + 1) * 4); }

static int blocks_for(const EdGemvArgs *a, int segments, int gated, int rows_per_block) {
    int total = 0;
    for (int s = 0; s < (gated ? 1 : segments); ++s) total += (a->rows[s] + rows_per_block - 1) / rows_per_block;
    return total;
}

int ed_plan_gemv(EdGemvArgs *a, int segments, int gated, const EdTuning *tuning, int sm_count, int max_shared,
                 EdLaunch *launch) {
    if (segments < 1 || segments > ED_MAX_SEGMENTS || (gated && segments != 2) || a->k <= 0 || a->m <= 0)
        return -1;
    for (int s = 0; s < segments; ++s) {
        const int elems = ed_block_elems(a->type[s]);
        if (!elems || a->k % elems || a->rows[s] <= 0) return -1;
        if (a->row_bytes[s] != a->k / elems * ed_block_bytes(a->type[s])) return -1;
    }
    if (gated && (a->type[0] != a->type[1] || a->rows[0] != a->rows[1])) return -1;
    for (int s = segments; s < ED_MAX_SEGMENTS; ++s) a->rows[s] = 0, a->w[s] = 0, a->type[s] = 0, a->row_bytes[s] = 0;

    const int units = a->k / 32;
    int lanes = tuning && tuning->lanes ? tuning->lanes : clamp(pow2_floor(units / 2), 8, 256);
    int threads = tuning && tuning->threads ? tuning->threads : 128;
    if (threads < lanes) threads = lanes;
    if (lanes < 8 || lanes > 256 || (lanes & (lanes - 1)) || threads % 32 || threads > 256 || threads % lanes)
        return -1;
    int groups = threads / lanes;

    const int mt = a->m > 1 && shared_for(a->k, 4) <= (unsigned)max_shared ? 4 : 1;
    if (shared_for(a->k, mt) > (unsigned)max_shared) return -1;

    /* Weight rows per group: the most (up to 4) that still gives two blocks per SM. */
    int rows = tuning && tuning->rows ? tuning->rows : 0;
    if (!rows) {
        rows = gated ? 2 : 1;
        for (int r = 4; r >= (gated ? 2 : 1); r /= 2) {
            if (blocks_for(a, segments, gated, groups * (gated ? r / 2 : r)) >= 2 * sm_count) {
                rows = r;
                break;
            }
        }
    }
    if (!(rows == 1 || rows == 2 || rows == 4) || (gated && rows == 1)) return -1;
    /* A small matrix (the 0.5B shape's 896 rows) still fills few blocks: smaller blocks, more of them. */
    while (!(tuning && tuning->threads) && threads > 32 && threads / 2 >= lanes &&
           blocks_for(a, segments, gated, groups * (gated ? rows / 2 : rows)) < 2 * sm_count)
        threads /= 2, groups = threads / lanes;
    const int per_block = groups * (gated ? rows / 2 : rows);

    int start = 0;
    for (int s = 0; s < ED_MAX_SEGMENTS; ++s) {
        a->cta_start[s] = start;
        if (s < segments && (!gated || s == 0)) start += (a->rows[s] + per_block - 1) / per_block;
    }
    a->cta_start[ED_MAX_SEGMENTS] = start;
    if (gated) a->cta_start[1] = a->cta_start[2] = start;
    a->n_out = 0;
    for (int s = 0; s < (gated ? 1 : segments); ++s) a->n_out += a->rows[s];
    a->lanes = lanes;

    snprintf(launch->kernel, sizeof launch->kernel, "ed_gemv%s_r%d_m%d", gated ? "_gated" : "", rows, mt);
    const int per_sm = tuning && tuning->blocks_per_sm > 0 ? tuning->blocks_per_sm : DEFAULT_BLOCKS_PER_SM;
    const long long cap = (long long)(sm_count > 0 ? sm_count : 1) * per_sm;
    launch->grid_x = (unsigned)(start < cap ? start : cap);
    launch->grid_y = (unsigned)((a->m + mt - 1) / mt);
    launch->threads = (unsigned)threads;
    launch->shared_bytes = shared_for(a->k, mt);
    return 0;
}

void ed_plan_gather(const EdGatherArgs *a, int sm_count, EdLaunch *launch) {
    const long long work = a->count * (a->k / 32);
    long long blocks = (work + 127) / 128;
    const long long most = (long long)(sm_count > 0 ? sm_count : 1) * 8;
    strcpy(launch->kernel, "ed_gather");
    launch->grid_x = (unsigned)(blocks < 1 ? 1 : (blocks > most ? most : blocks));
    launch->grid_y = 1;
    launch->threads = 128;
    launch->shared_bytes = 0;
}
