/* The NEON path with the ARMv8.2 dot-product instructions (sdot), where the CPU has them (Jetson Xavier, Orin). */
#if defined(__aarch64__)
#include <sys/auxv.h>

#define NEON_TARGET __attribute__((target("arch=armv8.2-a+dotprod")))
#define NEON_DOT 1
#define NEON_ISA cpu_isa_neondot
#define NEON_NAME "neondot"

#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1UL << 20) /* Linux's AArch64 hwcap bit for the dot-product instructions */
#endif

static int usable(void) { return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0; }

#include "cpu_neon_impl.h"
#endif
