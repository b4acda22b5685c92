/* The baseline NEON path (every AArch64 CPU, e.g. a Jetson Nano's Cortex-A57): cpu_neon_impl.h with widening
 * multiplies in place of the dot-product instruction. */
#if defined(__aarch64__)
#define NEON_TARGET
#define NEON_DOT 0
#define NEON_ISA cpu_isa_neon
#define NEON_NAME "neon"

static int usable(void) { return 1; }

#include "cpu_neon_impl.h"
#endif
