/* GGUF's quantized block layouts, as facts of the file format, in this project's words.
 *
 * A matrix row of K elements is stored as K / QK consecutive blocks; all multi-byte fields are little-endian and
 * blocks are packed (no padding), so a row of Q4_0 is K/32 * 18 bytes. Scales are IEEE binary16.
 *
 *   type  id  elements bytes layout
 *   Q4_0   2     32     18  d f16 | qs[16]: element j in the low nibble of qs[j], element j+16 in the high nibble;
 *                              value d * (q - 8)
 *   Q4_1   3     32     20  d f16 | m f16 | qs[16] as Q4_0; value d * q + m
 *   Q5_0   6     32     22  d f16 | qh[4] | qs[16]: low nibbles as Q4_0, bit j of the 32-bit qh is element j's 5th
 *                              bit; value d * (q - 16)
 *   Q5_1   7     32     24  d f16 | m f16 | qh[4] | qs[16] as Q5_0; value d * q + m
 *   Q8_0   8     32     34  d f16 | qs[32] int8; value d * q
 *   Q4_K  12    256    144  d f16 | dmin f16 | scales[12] | qs[128]: eight 32-element sub-blocks, each with a 6-bit
 *                              scale sc and a 6-bit min m (packed below); bytes 32i..32i+31 of qs hold sub-block 2i in
 *                              their low nibbles and 2i+1 in their high nibbles; value d*sc*q - dmin*m
 *   Q5_K  13    256    176  d | dmin | scales[12] | qh[32] | qs[128]: nibbles as Q4_K; bit i of qh[l] is the 5th
 *                              bit of element 32i + l; value as Q4_K with 5-bit q
 *   Q6_K  14    256    210  ql[128] | qh[64] | scales[16] int8 | d f16: sixteen 16-element sub-blocks, value
 *                              d * sc * (q - 32); for each half h (128 elements) and l in 0..31, with ql' = ql + 64h
 *                              and qh' = qh + 32h: element 128h+l     = ql'[l] low nibble    | (qh'[l] >> 0 & 3) << 4
 *                                                   element 128h+l+32  = ql'[l+32] low nibble | (qh'[l] >> 2 & 3) << 4
 *                                                   element 128h+l+64  = ql'[l] high nibble   | (qh'[l] >> 4 & 3) << 4
 *                                                   element 128h+l+96  = ql'[l+32] high nibble| (qh'[l] >> 6 & 3) << 4
 *
 * Q4_K/Q5_K's 12 scale bytes: for sub-block j < 4, sc = s[j] & 63 and m = s[j+4] & 63; for j >= 4,
 * sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4 and m = (s[j+4] >> 4) | (s[j] >> 6) << 4.
 */
#ifndef EDGEDECODE_GGML_BLOCKS_H
#define EDGEDECODE_GGML_BLOCKS_H

#include <stdint.h>
#include <string.h>

enum {
    GGML_Q4_0 = 2,
    GGML_Q4_1 = 3,
    GGML_Q5_0 = 6,
    GGML_Q5_1 = 7,
    GGML_Q8_0 = 8,
    GGML_Q4_K = 12,
    GGML_Q5_K = 13,
    GGML_Q6_K = 14,
};

/* The eight types as a dense index, the order every per-type table in the library uses. */
enum qtype_index { QI_Q4_0, QI_Q4_1, QI_Q5_0, QI_Q5_1, QI_Q8_0, QI_Q4_K, QI_Q5_K, QI_Q6_K, QI_COUNT };

typedef struct {
    int ggml_type;
    const char *name;
    int block_elements; /* 32 or 256 */
    int block_bytes;
} qtype_info;

/* The entry for a GGML type id, or NULL for a type the library does not read; *index receives its dense index. */
const qtype_info *qtype_lookup(int ggml_type, int *index);

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* binary16 -> binary32, exact for every input (subnormals, infinities and NaNs included). */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        int shift = 0;
        while (!(man & 0x400u)) {
            man <<= 1;
            shift++;
        }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* binary32 -> binary16, round to nearest even (GatherGGUF's float16 output). */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u) /* inf or nan */
        return (uint16_t)(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
    if (abs >= 0x477ff000u) /* rounds to >= 65520: overflow */
        return (uint16_t)(sign | 0x7c00u);
    if (abs < 0x38800000u) { /* below the smallest normal half: subnormal or zero */
        if (abs < 0x33000000u)
            return (uint16_t)sign;
        uint32_t man = (abs & 0x7fffffu) | 0x800000u;
        int shift = 126 - (int)(abs >> 23); /* 14..24 */
        uint32_t half = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1)))
            half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((abs - 0x38000000u) >> 13);
    uint32_t rem = abs & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1)))
        half++;
    return (uint16_t)(sign | half);
}

/* Q4_K/Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes s. */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

#endif
