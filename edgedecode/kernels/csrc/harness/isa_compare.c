/* Runs one matmul on every CPU path this machine (or emulator) can run, for tests/test_kernels_neon.py, which
 * builds it with a cross compiler and runs it under QEMU user mode to test the NEON paths on an x86 host.
 *
 *   isa_compare IN OUT
 *   IN:  int32 ggml_type, accuracy_level, K, N, M; float32 A[M][K]; uint8 B[N][row bytes]
 *   OUT: for each usable path, best first: char name[16]; float32 Y[M][N]; and, for A's first row, accuracy 4's
 *        int8 codes [K] and float32 scales [K / QA] in element order
 * Not part of the library (setup.py compiles csrc/*.c only).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../cpu_kernels.h"

static void *read_all(FILE *f, size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || fread(p, 1, bytes, f) != bytes) {
        fprintf(stderr, "short input\n");
        exit(2);
    }
    return p;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
        return 2;
    }
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    if (!in || !out)
        return 2;
    int32_t head[5];
    if (fread(head, sizeof head, 1, in) != 1)
        return 2;
    const int type = head[0], accuracy = head[1];
    const size_t k = (size_t)head[2], n = (size_t)head[3], m = (size_t)head[4];
    int qi;
    const qtype_info *qt = qtype_lookup(type, &qi);
    if (!qt || k % (size_t)qt->block_elements)
        return 2;
    const size_t row_bytes = k / (size_t)qt->block_elements * (size_t)qt->block_bytes;
    const float *a = read_all(in, m * k * sizeof(float));
    const uint8_t *b = read_all(in, n * row_bytes);
    float *y = malloc(m * n * sizeof(float));
    const size_t act_bytes = act_q8_bytes(k);
    uint8_t *memory = aligned_alloc(64, m * act_bytes + 64);
    act_q8 *quant = malloc(m * sizeof(act_q8));
    const cpu_isa *const *all = cpu_isa_all();
    for (int p = 0; all[p]; p++) {
        const cpu_isa *isa = all[p];
        if (!isa->usable())
            continue;
        if (accuracy == 4) {
            for (size_t i = 0; i < m; i++) {
                act_q8_bind(&quant[i], memory + i * act_bytes, k);
                act_q8_quantize(isa, qi, a + i * k, k, &quant[i]);
            }
            isa->gemm_q8[qi](b, row_bytes, n, k, quant, m, y, n);
        } else {
            for (size_t i = 0; i < m; i++)
                isa->gemv_f32[qi](b, row_bytes, n, k, a + i * k, y + i * n);
        }
        char name[16] = {0};
        strncpy(name, isa->name, sizeof name - 1);
        act_q8 first;
        act_q8_bind(&first, memory, k);
        isa->quantize(a, k, act_block_of(qi), ACT_NATURAL, &first);
        fwrite(name, 1, sizeof name, out);
        fwrite(y, sizeof(float), m * n, out);
        fwrite(first.q, 1, k, out);
        fwrite(first.d, sizeof(float), k / (size_t)act_block_of(qi), out);
    }
    return fclose(out) == 0 ? 0 : 1;
}
