/* Choosing the CPU path at run time: one build runs on any CPU of its architecture and takes the best path the CPU
 * offers (cpu_isa.usable asks the CPU), unless EDGEDECODE_KERNELS_ISA names another usable one. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

static const qtype_info QTYPES[QI_COUNT] = {
    {GGML_Q4_0, "Q4_0", 32, 18},   {GGML_Q4_1, "Q4_1", 32, 20},   {GGML_Q5_0, "Q5_0", 32, 22},
    {GGML_Q5_1, "Q5_1", 32, 24},   {GGML_Q8_0, "Q8_0", 32, 34},   {GGML_Q4_K, "Q4_K", 256, 144},
    {GGML_Q5_K, "Q5_K", 256, 176}, {GGML_Q6_K, "Q6_K", 256, 210},
};

const qtype_info *qtype_lookup(int ggml_type, int *index) {
    for (int i = 0; i < QI_COUNT; i++)
        if (QTYPES[i].ggml_type == ggml_type) {
            if (index)
                *index = i;
            return &QTYPES[i];
        }
    return NULL;
}

static const cpu_isa *const ALL[] = {
#if defined(__x86_64__) || defined(__i386__)
    &cpu_isa_avx512vnni,
    &cpu_isa_avx2,
#endif
#if defined(__aarch64__)
    &cpu_isa_neondot,
    &cpu_isa_neon,
#endif
    &cpu_isa_portable,
    NULL,
};

const cpu_isa *const *cpu_isa_all(void) { return ALL; }

static _Atomic(const cpu_isa *) current;

static const cpu_isa *by_name(const char *name) {
    for (int i = 0; ALL[i]; i++)
        if (strcmp(ALL[i]->name, name) == 0 && ALL[i]->usable())
            return ALL[i];
    return NULL;
}

static const cpu_isa *best(void) {
    const char *wanted = getenv("EDGEDECODE_KERNELS_ISA");
    if (wanted && *wanted) {
        const cpu_isa *chosen = by_name(wanted);
        if (chosen)
            return chosen;
    }
    for (int i = 0; ALL[i]; i++)
        if (ALL[i]->usable())
            return ALL[i];
    return &cpu_isa_portable;
}

const cpu_isa *cpu_isa_current(void) {
    const cpu_isa *isa = atomic_load(&current);
    if (!isa) {
        isa = best();
        atomic_store(&current, isa);
    }
    return isa;
}

int cpu_isa_force(const char *name) {
    const cpu_isa *isa = by_name(name);
    if (!isa)
        return -1;
    atomic_store(&current, isa);
    return 0;
}
