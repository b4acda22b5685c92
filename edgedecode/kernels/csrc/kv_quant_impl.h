/* One EDKV section quantized in one pass over its float32 rows (kv_quant.c; the rules are edgedecode/kv/quant.py's):
 * per group the range, the float16 (scale, zero), the codes and their packed bytes, for each (layer, head) with its
 * token rows gathered by index. Included once per CPU path with KVQ_TARGET (a target attribute) and KVQ(name)
 * (the path's function names); the arithmetic is written as element loops the compiler vectorizes, in an order that
 * keeps every float operation of the numpy reference: (x - zero) / scale in float32, rounded half to even by adding
 * 2^23 (no multiply-add: the library is built with -std=c11, so no contraction). */

#ifdef KVQ_AVX2
/* 32 codes from 4 vectors of floats already offset by 2^23: their low bytes, in order. */
KVQ_TARGET static inline void KVQ(store_codes32)(__m256 a, __m256 b, __m256 c, __m256 d, uint8_t *out) {
    const __m256i low = _mm256_set1_epi32(0xff);
    __m256i ab = _mm256_packus_epi32(_mm256_and_si256(_mm256_castps_si256(a), low),
                                     _mm256_and_si256(_mm256_castps_si256(b), low));
    __m256i cd = _mm256_packus_epi32(_mm256_and_si256(_mm256_castps_si256(c), low),
                                     _mm256_and_si256(_mm256_castps_si256(d), low));
    __m256i bytes = _mm256_packus_epi16(ab, cd); /* 4-byte groups: a0 b0 c0 d0 a1 b1 c1 d1 (a0: a's lanes 0-3) */
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)out, bytes);
}

/* (x - zero) / scale + 2^23 over 8 floats. */
KVQ_TARGET static inline __m256 KVQ(code8)(const float *x, __m256 zero, __m256 scale) {
    return _mm256_add_ps(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x), zero), scale), _mm256_set1_ps(8388608.0f));
}
#endif

/* x - zero, over scale, rounded half to even: the low byte of the float (x̂ lies in [0, 2^bits - 1]). Per token:
 * one (zero, scale) per `group` channels. */
KVQ_TARGET static inline void KVQ(codes_token)(const float *restrict x, const float *restrict zero,
                                               const float *restrict scale, int64_t d, int group,
                                               uint8_t *restrict out) {
#ifdef KVQ_AVX2
    if (group % 32 == 0) {
        for (int64_t j = 0; j < d / group; j++) {
            const __m256 z = _mm256_set1_ps(zero[j]), s = _mm256_set1_ps(scale[j]);
            for (int64_t c = j * group; c < (j + 1) * group; c += 32)
                KVQ(store_codes32)(KVQ(code8)(x + c, z, s), KVQ(code8)(x + c + 8, z, s), KVQ(code8)(x + c + 16, z, s),
                                   KVQ(code8)(x + c + 24, z, s), out + c);
        }
        return;
    }
#endif
    for (int64_t j = 0; j < d / group; j++)
        for (int64_t c = j * group; c < (j + 1) * group; c++) {
            float q = (x[c] - zero[j]) / scale[j] + 8388608.0f;
            uint32_t bits;
            memcpy(&bits, &q, sizeof bits);
            out[c] = (uint8_t)bits;
        }
}

/* Per channel: one (zero, scale) per channel. */
KVQ_TARGET static inline void KVQ(codes_channel)(const float *restrict x, const float *restrict zero,
                                                 const float *restrict scale, int64_t d, uint8_t *restrict out) {
#ifdef KVQ_AVX2
    if (d % 32 == 0) {
        for (int64_t c = 0; c < d; c += 32)
            KVQ(store_codes32)(KVQ(code8)(x + c, _mm256_loadu_ps(zero + c), _mm256_loadu_ps(scale + c)),
                               KVQ(code8)(x + c + 8, _mm256_loadu_ps(zero + c + 8), _mm256_loadu_ps(scale + c + 8)),
                               KVQ(code8)(x + c + 16, _mm256_loadu_ps(zero + c + 16), _mm256_loadu_ps(scale + c + 16)),
                               KVQ(code8)(x + c + 24, _mm256_loadu_ps(zero + c + 24), _mm256_loadu_ps(scale + c + 24)),
                               out + c);
        return;
    }
#endif
    for (int64_t c = 0; c < d; c++) {
        float q = (x[c] - zero[c]) / scale[c] + 8388608.0f;
        uint32_t bits;
        memcpy(&bits, &q, sizeof bits);
        out[c] = (uint8_t)bits;
    }
}

/* Range of n floats (a multiple of 8), and whether any is beyond ±65504 or not a number. */
KVQ_TARGET static inline int KVQ(row_range)(const float *restrict x, int64_t n, float *lo, float *hi) {
#ifdef KVQ_AVX2
    __m256 l = _mm256_loadu_ps(x), h = l;
    const __m256 limit = _mm256_set1_ps(KVQ_FP16_MAX);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 fine = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int64_t i = 0; i < n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        l = _mm256_min_ps(v, l);
        h = _mm256_max_ps(v, h);
        fine = _mm256_and_ps(fine, _mm256_cmp_ps(_mm256_and_ps(v, magnitude), limit, _CMP_LE_OQ));
    }
    float ls[8], hs[8];
    _mm256_storeu_ps(ls, l);
    _mm256_storeu_ps(hs, h);
    int bad = _mm256_movemask_ps(fine) != 0xff;
#else
    float ls[8], hs[8];
    int bad = 0;
    for (int k = 0; k < 8; k++)
        ls[k] = hs[k] = x[k];
    for (int64_t i = 0; i < n; i += 8)
        for (int k = 0; k < 8; k++) {
            float v = x[i + k];
            ls[k] = v < ls[k] ? v : ls[k];
            hs[k] = v > hs[k] ? v : hs[k];
            bad |= !(v >= -KVQ_FP16_MAX && v <= KVQ_FP16_MAX);
        }
#endif
    float a = ls[0], b = hs[0];
    for (int k = 1; k < 8; k++) {
        a = ls[k] < a ? ls[k] : a;
        b = hs[k] > b ? hs[k] : b;
    }
    *lo = a;
    *hi = b;
    return bad;
}

/* Channel-wise range of `rows` rows of d floats (each row from its own pointer). */
KVQ_TARGET static inline int KVQ(column_range)(const float *const *rows, int64_t count, int64_t d, float *restrict lo,
                                               float *restrict hi) {
#ifdef KVQ_AVX2
    const __m256 limit = _mm256_set1_ps(KVQ_FP16_MAX);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 fine = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int64_t c = 0; c < d; c += 8) {
        __m256 l = _mm256_loadu_ps(rows[0] + c), h = l;
        for (int64_t r = 0; r < count; r++) {
            __m256 v = _mm256_loadu_ps(rows[r] + c);
            l = _mm256_min_ps(v, l);
            h = _mm256_max_ps(v, h);
            fine = _mm256_and_ps(fine, _mm256_cmp_ps(_mm256_and_ps(v, magnitude), limit, _CMP_LE_OQ));
        }
        _mm256_storeu_ps(lo + c, l);
        _mm256_storeu_ps(hi + c, h);
    }
    return _mm256_movemask_ps(fine) != 0xff;
#endif
    int bad = 0;
    memcpy(lo, rows[0], (size_t)d * sizeof(float));
    memcpy(hi, rows[0], (size_t)d * sizeof(float));
    for (int64_t r = 0; r < count; r++) {
        const float *restrict x = rows[r];
        for (int64_t c = 0; c < d; c++) {
            float v = x[c];
            lo[c] = v < lo[c] ? v : lo[c];
            hi[c] = v > hi[c] ? v : hi[c];
            bad |= !(v >= -KVQ_FP16_MAX && v <= KVQ_FP16_MAX);
        }
    }
    return bad;
}

KVQ_TARGET static int KVQ(quantize)(const kvq_section *s) {
    const int64_t d = s->d, cols = s->axis == KVQ_TOKEN ? d / s->group : d;
    const int64_t param_rows = s->axis == KVQ_TOKEN ? s->m : (s->m + s->group - 1) / s->group;
    const int64_t code_bytes = d * s->bits / 8;
    uint8_t codes[KVQ_MAX_D];
    float zero[KVQ_MAX_D], scale[KVQ_MAX_D], lo[KVQ_MAX_D], hi[KVQ_MAX_D];
    const float *rows[KVQ_MAX_GROUP];
    for (int64_t l = 0; l < s->layers; l++)
        for (int64_t h = 0; h < s->heads; h++) {
            const float *base = s->src + l * s->layer_stride + h * s->head_stride;
            uint8_t *out = s->codes + l * s->codes_layer_stride + h * s->m * code_bytes;
            uint16_t *scales = (uint16_t *)(s->scales + l * s->params_layer_stride) + h * param_rows * cols;
            uint16_t *zeros = (uint16_t *)(s->zeros + l * s->params_layer_stride) + h * param_rows * cols;
            if (s->axis == KVQ_TOKEN) {
                for (int64_t r = 0; r < s->m; r++) {
                    const float *x = base + s->tokens[r] * s->token_stride;
                    for (int64_t j = 0; j < cols; j++) {
                        float a, b;
                        if (KVQ(row_range)(x + j * s->group, s->group, &a, &b))
                            return KVQ_REFUSED;
                        if (a == 0.0f)
                            return KVQ_ZERO_MIN;
                        kvq_params(a, b, s->bits, &zeros[r * cols + j], &scales[r * cols + j], &zero[j], &scale[j]);
                    }
                    KVQ(codes_token)(x, zero, scale, d, s->group, codes);
                    kvq_pack(codes, d, s->bits, out + r * code_bytes);
                }
                continue;
            }
            for (int64_t t0 = 0, p = 0; t0 < s->m; t0 += s->group, p++) {
                const int64_t count = s->m - t0 < s->group ? s->m - t0 : s->group;
                for (int64_t r = 0; r < count; r++)
                    rows[r] = base + s->tokens[t0 + r] * s->token_stride;
                if (KVQ(column_range)(rows, count, d, lo, hi))
                    return KVQ_REFUSED;
                for (int64_t c = 0; c < d; c++) {
                    if (lo[c] == 0.0f)
                        return KVQ_ZERO_MIN;
                    kvq_params(lo[c], hi[c], s->bits, &zeros[p * d + c], &scales[p * d + c], &zero[c], &scale[c]);
                }
                for (int64_t r = 0; r < count; r++) {
                    KVQ(codes_channel)(rows[r], zero, scale, d, codes);
                    kvq_pack(codes, d, s->bits, out + (t0 + r) * code_bytes);
                }
            }
        }
    return KVQ_OK;
}
