/* Matrix products for a few rows of x on the CPU, y (M, N) = x (M, K) @ W^T, with W float32 or quantized in groups
   of 32 along K (and, last, the attention of one new token per row over its cached keys and values).

   float32: W (N, K)

   int8: q (N, K) int8, scale (N, K/32) fp16:                 W[n, k] = scale[n, g] * q[n, k]
   int4: q (N, K/2) uint8, scale and min (N, K/32) fp16:      W[n, k] = scale[n, g] * q4[n, k] + min[n, g]
         in each group's 16 bytes, byte j holds element j in its low nibble and element j + 16 in its high one
         (GGUF's Q4_0 / Q4_1 order, so the file's bits are used as they are).
   GGUF's Q4_K, Q5_K, Q6_K (blocks of 256) and Q5_0 (blocks of 32): q (N, K / block * block bytes) uint8, each row
         its blocks as the file holds them (layouts: quant/formats.py). A row's scales d * sc and minimums dmin * m
         per group of 32 (Q6_K: per 16) are computed once as floats, exactly as the reference computes them; then
         each group is scale * q + min, one FMA a weight, in the same loop as int4.

   x stays float: each group of W is dequantized in registers, exactly as the reference computes it (one rounding of
   scale * q + min), and multiplied with x in float. For float32 W this is the same loop without the dequantizing:
   at decode's few rows it beats a GEMM library, whose blocking and packing pay off only for many rows. Rows of W
   are split across OpenMP threads (the runtime torch itself uses); up to ROWS_AT_ONCE rows of x share each
   dequantized group. One row of x (batch-1 decode) on AVX-512 takes a loop per format instead (the section "one row
   of x"). The one inexact product is a draft model's: int4 with x in int8 (its own section). Built at first use
   with the machine's C compiler and -march=native: AVX-512, AVX2 + FMA + F16C, or plain C. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else /* built without OpenMP: one thread */
static int omp_get_num_threads(void) { return 1; }
static int omp_get_thread_num(void) { return 0; }
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

#define GROUP 32
#define ROWS_AT_ONCE 4
#define PREFETCH_BYTES 2048 /* how far ahead in W to prefetch at least: rows are short, the next ones follow */
#define INLINE static inline __attribute__((always_inline))

/* Whether one row of x against Q5_0, Q4_K or Q6_K takes x in int8 (off with exact products:
   accessory_set_int8x_one_row). */
static int int8x_one_row = 1;

static float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

/* ---- vectors: a group's 32 weights are VECTORS registers of LANES floats ------------------------------------ */

#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define ISA "avx512"
INLINE vec vec_zero(void) { return _mm512_setzero_ps(); }
INLINE vec vec_load(const float *p) { return _mm512_loadu_ps(p); }
INLINE vec vec_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
INLINE vec vec_add(vec a, vec b) { return _mm512_add_ps(a, b); }
INLINE float vec_sum(vec a) { return _mm512_reduce_add_ps(a); }
INLINE vec vec_set1(float a) { return _mm512_set1_ps(a); }
INLINE vec vec_mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
INLINE vec vec_div(vec a, vec b) { return _mm512_div_ps(a, b); }
INLINE vec vec_max(vec a, vec b) { return _mm512_max_ps(a, b); }
INLINE float vec_max_lane(vec a) { return _mm512_reduce_max_ps(a); }
INLINE void vec_store(float *p, vec a) { _mm512_storeu_ps(p, a); }
INLINE vec vec_exp2_int(vec n) { /* 2^n for integral n in float range */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
INLINE vec vec_round(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

/* The 16 sums of v[0..15] in one vector, lane k = sum of v[k]: a transpose-and-add network (about 3 shuffles or
   adds per sum, where reducing each vector alone takes about 8). */
INLINE vec vec_sum_lanes(const vec v[LANES]) {
    __m512 pairs[8], quads[4], halves[2];
    for (int p = 0; p < 8; p++) /* each 128-bit lane: 2 partial sums of v[2p], 2 of v[2p + 1] */
        pairs[p] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * p], v[2 * p + 1]), _mm512_unpackhi_ps(v[2 * p], v[2 * p + 1]));
    for (int q = 0; q < 4; q++) { /* each 128-bit lane: that lane's sums of v[4q..4q+3] */
        __m512d c = _mm512_castps_pd(pairs[2 * q]), d = _mm512_castps_pd(pairs[2 * q + 1]);
        quads[q] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    }
    for (int h = 0; h < 2; h++) /* add 128-bit lanes pairwise, twice: lane l sums v[4l..4l+3] over all lanes */
        halves[h] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * h], quads[2 * h + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(quads[2 * h], quads[2 * h + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* A group's 16 possible values, scale * [0..15] + min (one FMA: the reference's single rounding), turn its nibbles
   into weights with one permute per 16 of them. */
INLINE void int4_group(const uint8_t *q, float s, float m, vec w[]) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(s), iota, _mm512_set1_ps(m));
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    w[0] = _mm512_permutexvar_ps(v, table); /* only the low 4 bits of each index count */
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}

INLINE void int8_group(const int8_t *q, float s, vec w[]) {
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_mul_ps(_mm512_set1_ps(s), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                     _mm_loadu_si128((const __m128i *)(q + 16 * i)))));
}

/* GGUF's block formats (quant/formats.py), one group of 32 weights: scale * q + min with the group's float scale
   and minimum (computed once per row by block_scales), one FMA per weight, so rounded once as the reference is. */

/* Q4_K: 32 values, the nibbles at `shift` (0: low, 4: high) of 32 bytes; a 16-value table, as int4. */
INLINE void q4k_group(const uint8_t *q, int shift, float s, float m, vec w[]) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(s), iota, _mm512_set1_ps(m));
    const __m128i count = _mm_cvtsi32_si128(shift);
    for (int i = 0; i < 2; i++) /* the permute reads an index's low 4 bits: no mask needed */
        w[i] = _mm512_permutexvar_ps(_mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * i))),
                                                      count), table);
}

/* The 32 values s * [0..31] + m, as two tables: a 5-bit index selects from them (bit 4 picks the second). */
INLINE void table32(float s, float m, __m512 *low, __m512 *high) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    *low = _mm512_fmadd_ps(_mm512_set1_ps(s), iota, _mm512_set1_ps(m));
    *high = _mm512_fmadd_ps(_mm512_set1_ps(s), _mm512_add_ps(iota, _mm512_set1_ps(16)), _mm512_set1_ps(m));
}

/* (low & 15) | (high4 & ~15): bits 0-3 from `low`, the rest from `high4` (a bitwise select, one instruction). */
INLINE __m512i merge_nibble(__m512i low, __m512i high4) {
    return _mm512_ternarylogic_epi32(low, high4, _mm512_set1_epi32(15), 0xE4);
}

/* Q5_K: as Q4_K, plus a 5th bit: bit `bit` of 32 more bytes. */
INLINE void q5k_group(const uint8_t *qs, const uint8_t *qh, int shift, int bit, float s, float m, vec w[]) {
    __m512 low, high;
    table32(s, m, &low, &high);
    const __m128i count = _mm_cvtsi32_si128(shift), count_h = _mm_cvtsi32_si128(bit);
    for (int i = 0; i < 2; i++) {
        __m512i l = _mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16 * i))), count);
        __m512i h = _mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 16 * i))), count_h);
        w[i] = _mm512_permutex2var_ps(low, merge_nibble(l, _mm512_slli_epi32(h, 4)), high); /* reads bits 0-4 */
    }
}

/* Q6_K: 6-bit values, 4 low bits at `shift` of 32 bytes, 2 high bits at `shift_h` of 32 more; a scale per 16. */
INLINE void q6k_group(const uint8_t *ql, const uint8_t *qh, int shift, int shift_h, const float *s, const float *m,
                      vec w[]) {
    const __m128i count = _mm_cvtsi32_si128(shift), count_h = _mm_cvtsi32_si128(shift_h);
    for (int i = 0; i < 2; i++) {
        __m512i l = _mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 16 * i))), count);
        __m512i h = _mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 16 * i))), count_h);
        __m512i q = _mm512_and_si512(merge_nibble(l, _mm512_slli_epi32(h, 4)), _mm512_set1_epi32(63));
        w[i] = _mm512_fmadd_ps(_mm512_set1_ps(s[i]), _mm512_cvtepi32_ps(q), _mm512_set1_ps(m[i]));
    }
}

/* Q5_0: one block (d, then 32 5th bits as a little-endian uint32, then 16 bytes: values j and j + 16 in byte j's
   low and high nibble); m = -16 s. */
INLINE void q50_group(const uint8_t *block, float s, float m, vec w[]) {
    __m512 low, high;
    table32(s, m, &low, &high);
    uint32_t bits;
    memcpy(&bits, block + 2, sizeof bits);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i qs = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 6))), all = _mm512_set1_epi32(bits);
    __m512i h0 = _mm512_slli_epi32(_mm512_srlv_epi32(all, iota), 4);
    __m512i h1 = _mm512_slli_epi32(_mm512_srlv_epi32(all, _mm512_add_epi32(iota, _mm512_set1_epi32(16))), 4);
    w[0] = _mm512_permutex2var_ps(low, merge_nibble(qs, h0), high);
    w[1] = _mm512_permutex2var_ps(low, merge_nibble(_mm512_srli_epi32(qs, 4), h1), high);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
typedef __m256 vec;
#define LANES 8
#define ISA "avx2"
INLINE vec vec_zero(void) { return _mm256_setzero_ps(); }
INLINE vec vec_load(const float *p) { return _mm256_loadu_ps(p); }
INLINE vec vec_fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
INLINE vec vec_add(vec a, vec b) { return _mm256_add_ps(a, b); }
INLINE float vec_sum(vec a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
INLINE vec vec_set1(float a) { return _mm256_set1_ps(a); }
INLINE vec vec_mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
INLINE vec vec_div(vec a, vec b) { return _mm256_div_ps(a, b); }
INLINE vec vec_max(vec a, vec b) { return _mm256_max_ps(a, b); }
INLINE float vec_max_lane(vec a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
INLINE void vec_store(float *p, vec a) { _mm256_storeu_ps(p, a); }
INLINE vec vec_exp2_int(vec n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
INLINE vec vec_round(vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

/* The 8 sums of v[0..7] in one vector, lane k = sum of v[k] (as the AVX-512 network, one level less). */
INLINE vec vec_sum_lanes(const vec v[LANES]) {
    __m256 pairs[4], quads[2];
    for (int p = 0; p < 4; p++)
        pairs[p] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * p], v[2 * p + 1]), _mm256_unpackhi_ps(v[2 * p], v[2 * p + 1]));
    for (int q = 0; q < 2; q++) {
        __m256d c = _mm256_castps_pd(pairs[2 * q]), d = _mm256_castps_pd(pairs[2 * q + 1]);
        quads[q] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(c, d)), _mm256_castpd_ps(_mm256_unpackhi_pd(c, d)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20), _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}

INLINE void int4_group(const uint8_t *q, float s, float m, vec w[]) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    __m256i v0 = _mm256_cvtepu8_epi32(bytes), v1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
    __m256i low = _mm256_set1_epi32(15);
    __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
    w[0] = _mm256_fmadd_ps(vs, _mm256_cvtepi32_ps(_mm256_and_si256(v0, low)), vm); /* elements 0..7 */
    w[1] = _mm256_fmadd_ps(vs, _mm256_cvtepi32_ps(_mm256_and_si256(v1, low)), vm); /* 8..15 */
    w[2] = _mm256_fmadd_ps(vs, _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), vm);  /* 16..23 */
    w[3] = _mm256_fmadd_ps(vs, _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), vm);  /* 24..31 */
}

INLINE void int8_group(const int8_t *q, float s, vec w[]) {
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_mul_ps(_mm256_set1_ps(s),
                             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i)))));
}

/* GGUF's block formats, one group of 32 weights (as the AVX-512 versions): 8 values at a time, converted and
   scaled by one FMA each. */
INLINE __m256i bytes8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

INLINE __m256 scaled(__m256i q, float s, float m) {
    return _mm256_fmadd_ps(_mm256_set1_ps(s), _mm256_cvtepi32_ps(q), _mm256_set1_ps(m));
}

INLINE void q4k_group(const uint8_t *q, int shift, float s, float m, vec w[]) {
    const __m128i count = _mm_cvtsi32_si128(shift);
    for (int i = 0; i < 4; i++)
        w[i] = scaled(_mm256_and_si256(_mm256_srl_epi32(bytes8(q + 8 * i), count), _mm256_set1_epi32(15)), s, m);
}

INLINE void q5k_group(const uint8_t *qs, const uint8_t *qh, int shift, int bit, float s, float m, vec w[]) {
    const __m128i count = _mm_cvtsi32_si128(shift), count_h = _mm_cvtsi32_si128(bit);
    for (int i = 0; i < 4; i++) {
        __m256i l = _mm256_and_si256(_mm256_srl_epi32(bytes8(qs + 8 * i), count), _mm256_set1_epi32(15));
        __m256i h = _mm256_and_si256(_mm256_slli_epi32(_mm256_srl_epi32(bytes8(qh + 8 * i), count_h), 4),
                                     _mm256_set1_epi32(16));
        w[i] = scaled(_mm256_or_si256(l, h), s, m);
    }
}

INLINE void q6k_group(const uint8_t *ql, const uint8_t *qh, int shift, int shift_h, const float *s, const float *m,
                      vec w[]) {
    const __m128i count = _mm_cvtsi32_si128(shift), count_h = _mm_cvtsi32_si128(shift_h);
    for (int i = 0; i < 4; i++) {
        __m256i l = _mm256_and_si256(_mm256_srl_epi32(bytes8(ql + 8 * i), count), _mm256_set1_epi32(15));
        __m256i h = _mm256_and_si256(_mm256_slli_epi32(_mm256_srl_epi32(bytes8(qh + 8 * i), count_h), 4),
                                     _mm256_set1_epi32(48));
        w[i] = scaled(_mm256_or_si256(l, h), s[i / 2], m[i / 2]);
    }
}

INLINE void q50_group(const uint8_t *block, float s, float m, vec w[]) {
    uint32_t bits;
    memcpy(&bits, block + 2, sizeof bits);
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), all = _mm256_set1_epi32(bits);
    for (int i = 0; i < 4; i++) { /* values 8i..8i+7: bytes 8(i % 2).., low nibbles for i < 2, high ones after */
        __m256i l = _mm256_srli_epi32(bytes8(block + 6 + 8 * (i % 2)), 4 * (i / 2));
        __m256i h = _mm256_slli_epi32(_mm256_srlv_epi32(all, _mm256_add_epi32(iota, _mm256_set1_epi32(8 * i))), 4);
        w[i] = scaled(_mm256_or_si256(_mm256_and_si256(l, _mm256_set1_epi32(15)),
                                      _mm256_and_si256(h, _mm256_set1_epi32(16))), s, m);
    }
}

#else
typedef float vec;
#define LANES 1
#define ISA "generic"
INLINE vec vec_zero(void) { return 0.0f; }
INLINE vec vec_load(const float *p) { return *p; }
INLINE vec vec_fma(vec a, vec b, vec c) { return a * b + c; }
INLINE vec vec_add(vec a, vec b) { return a + b; }
INLINE float vec_sum(vec a) { return a; }
INLINE vec vec_set1(float a) { return a; }
INLINE vec vec_mul(vec a, vec b) { return a * b; }
INLINE vec vec_div(vec a, vec b) { return a / b; }
INLINE vec vec_max(vec a, vec b) { return a > b ? a : b; }
INLINE float vec_max_lane(vec a) { return a; }
INLINE void vec_store(float *p, vec a) { *p = a; }
INLINE vec vec_exp2_int(vec n) { return ldexpf(1.0f, (int)n); }
INLINE vec vec_round(vec a) { return nearbyintf(a); }
INLINE vec vec_sum_lanes(const vec v[LANES]) { return v[0]; }

INLINE void int4_group(const uint8_t *q, float s, float m, vec w[]) {
    for (int j = 0; j < GROUP / 2; j++) {
        w[j] = s * (float)(q[j] & 15) + m;
        w[j + GROUP / 2] = s * (float)(q[j] >> 4) + m;
    }
}

INLINE void int8_group(const int8_t *q, float s, vec w[]) {
    for (int j = 0; j < GROUP; j++) w[j] = s * (float)q[j];
}

INLINE void q4k_group(const uint8_t *q, int shift, float s, float m, vec w[]) {
    for (int j = 0; j < GROUP; j++) w[j] = s * (float)((q[j] >> shift) & 15) + m;
}

INLINE void q5k_group(const uint8_t *qs, const uint8_t *qh, int shift, int bit, float s, float m, vec w[]) {
    for (int j = 0; j < GROUP; j++) w[j] = s * (float)(((qs[j] >> shift) & 15) | (((qh[j] >> bit) & 1) << 4)) + m;
}

INLINE void q6k_group(const uint8_t *ql, const uint8_t *qh, int shift, int shift_h, const float *s, const float *m,
                      vec w[]) {
    for (int j = 0; j < GROUP; j++)
        w[j] = s[j / 16] * (float)(((ql[j] >> shift) & 15) | (((qh[j] >> shift_h) & 3) << 4)) + m[j / 16];
}

INLINE void q50_group(const uint8_t *block, float s, float m, vec w[]) {
    uint32_t bits;
    memcpy(&bits, block + 2, sizeof bits);
    for (int j = 0; j < GROUP / 2; j++) {
        w[j] = s * (float)((block[6 + j] & 15) | (((bits >> j) & 1) << 4)) + m;
        w[j + GROUP / 2] = s * (float)((block[6 + j] >> 4) | (((bits >> (j + 16)) & 1) << 4)) + m;
    }
}
#endif

#define VECTORS (GROUP / LANES)

/* Rows of W per tile: each loaded vector of x feeds ROWS_OF_W products, each weight vector ROWS_AT_ONCE ones, and
   every accumulator stays in a register (32 vector registers with AVX-512, 16 with AVX2). */
#if LANES == 16
#define ROWS_OF_W 4
#elif LANES == 8
#define ROWS_OF_W 2
#else
#define ROWS_OF_W 1
#endif

/* ---- the formats of W ---------------------------------------------------------------------------------------- */

/* Each is a constant at every call (the dispatch below), so its branches fold away. */
enum { F32, INT8, INT4, Q4_K, Q5_K, Q6_K, Q5_0 };

/* GGUF's blocks: values and bytes per block, and its groups of 32 (a group's own scale and minimum). */
#define BLOCK_VALUES(fmt) ((fmt) == Q5_0 ? 32 : 256)
#define BLOCK_BYTES(fmt) ((fmt) == Q4_K ? 144 : (fmt) == Q5_K ? 176 : (fmt) == Q6_K ? 210 : 22)
#define GGUF(fmt) ((fmt) >= Q4_K)
#define SCALES_PER_GROUP(fmt) ((fmt) == Q6_K ? 2 : 1) /* Q6_K scales every 16 values */

INLINE int64_t row_bytes_of(const int fmt, int64_t K) {
    if (GGUF(fmt)) return K / BLOCK_VALUES(fmt) * BLOCK_BYTES(fmt);
    return fmt == INT4 ? K / 2 : fmt == INT8 ? K : 4 * K;
}

INLINE float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return half_to_float(h);
}

/* A row of W's group scales and minimums as floats, for a GGUF block format: the products d * sc and dmin * m that
   the reference computes (exact in float32), so that scale * q + min rounds as its d * sc * q - dmin * m does.
   Q6_K: two per group (one per 16 values), min = -32 scale; Q5_0: min = -16 d (q - 32 and q - 16, exactly). */
INLINE void block_scales(const int fmt, const uint8_t *row, int64_t K, float *s, float *mn) {
    for (int64_t b = 0; b < K / BLOCK_VALUES(fmt); b++) {
        const uint8_t *block = row + b * BLOCK_BYTES(fmt);
        if (fmt == Q5_0) {
            s[b] = half_at(block);
            mn[b] = -16.0f * s[b];
        } else if (fmt == Q6_K) {
            const float d = half_at(block + 208);
            for (int i = 0; i < 16; i++) {
                s[16 * b + i] = d * (float)(int8_t)block[192 + i];
                mn[16 * b + i] = -32.0f * s[16 * b + i];
            }
        } else { /* Q4_K, Q5_K: 8 six-bit scales and minimums packed in 12 bytes (formats.py _k_scales) */
            const float d = half_at(block), dmin = half_at(block + 2);
            const uint8_t *p = block + 4;
            for (int i = 0; i < 8; i++) {
                const int sc = i < 4 ? p[i] & 63 : (p[i + 4] & 15) | ((p[i - 4] >> 6) << 4);
                const int m = i < 4 ? p[i + 4] & 63 : (p[i + 4] >> 4) | ((p[i] >> 6) << 4);
                s[8 * b + i] = d * (float)sc;
                mn[8 * b + i] = -(dmin * (float)m);
            }
        }
    }
}

/* Group g of a row of W (32 weights) as vectors; s and mn the row's scales and minimums. */
INLINE void group_weights(const int fmt, const uint8_t *row, int64_t g, const float *s, const float *mn, vec w[]) {
    const int i = g % 8; /* the group within a 256-value block */
    const uint8_t *block = GGUF(fmt) ? row + g * 32 / BLOCK_VALUES(fmt) * BLOCK_BYTES(fmt) : row;
    switch (fmt) {
        case INT4: int4_group(row + g * GROUP / 2, s[g], mn[g], w); break;
        case INT8: int8_group((const int8_t *)row + g * GROUP, s[g], w); break;
        case F32:
            for (int v = 0; v < VECTORS; v++) w[v] = vec_load((const float *)row + g * GROUP + v * LANES);
            break;
        /* Q4_K: 128 bytes of nibbles after 16 of scales, 32 bytes per pair of groups (low nibbles, then high). */
        case Q4_K: q4k_group(block + 16 + (i / 2) * 32, (i % 2) * 4, s[g], mn[g], w); break;
        /* Q5_K: as Q4_K after 32 bytes of 5th bits (bit i of byte l for value l of group i). */
        case Q5_K: q5k_group(block + 48 + (i / 2) * 32, block + 16, (i % 2) * 4, i, s[g], mn[g], w); break;
        /* Q6_K: two halves of 128 values; in each, 64 bytes of low nibbles (groups 0, 1 low, then 2, 3 high) and
           32 bytes of 2-bit pairs (group k at bits 2k). */
        case Q6_K:
            q6k_group(block + (i / 4) * 64 + (i % 2) * 32, block + 128 + (i / 4) * 32, (i / 2 % 2) * 4, (i % 4) * 2,
                      s + 2 * g, mn + 2 * g, w);
            break;
        case Q5_0: q50_group(block, s[g], mn[g], w); break;
    }
}

/* ---- a tile: tile_n rows of W against tile_m rows of x ------------------------------------------------------- */

/* W's rows are `row_bytes` apart from q; s and mn hold each row's group scales and mins as floats, `stride` apart.
   `tile_m`, `tile_n` and `fmt` are constants at every call (the dispatch below), so the branches fold away. */
INLINE void dot_tile(const float *x, int64_t K, const uint8_t *q, int64_t row_bytes, const float *s, const float *mn,
                     int64_t stride, float *y, int64_t N, const int tile_m, const int tile_n, const int fmt,
                     const int prefetch) {
    const int64_t groups = K / GROUP;
    /* Prefetch the next tile's rows (a tile of float32 rows is longer than PREFETCH_BYTES). */
    const int64_t ahead = tile_n * row_bytes > PREFETCH_BYTES ? tile_n * row_bytes : PREFETCH_BYTES;
    /* A small tile has too few accumulators to hide the FMAs' latency: give each two, for alternate vectors. */
    const int split = tile_m * tile_n < 8 ? 2 : 1;
    vec acc[ROWS_OF_W][ROWS_AT_ONCE][2], w[ROWS_OF_W][VECTORS];
    for (int j = 0; j < tile_n; j++)
        for (int r = 0; r < tile_m; r++) acc[j][r][0] = acc[j][r][1] = vec_zero();
    for (int64_t g = 0; g < groups; g++) {
        for (int j = 0; j < tile_n; j++) {
            const uint8_t *row = q + j * row_bytes;
#if LANES > 1
            if (prefetch) { /* where group g's bytes are, about (exactly for our formats) */
                const char *at = (const char *)row + g * row_bytes_of(fmt, 256) / 8 + ahead;
                _mm_prefetch(at, _MM_HINT_T0);
                if (fmt == F32) _mm_prefetch(at + 64, _MM_HINT_T0);
            }
#endif
            group_weights(fmt, row, g, s + j * stride, mn + j * stride, w[j]);
        }
        for (int r = 0; r < tile_m; r++)
            for (int i = 0; i < VECTORS; i++) {
                vec xv = vec_load(x + r * K + g * GROUP + i * LANES);
                for (int j = 0; j < tile_n; j++) acc[j][r][i % split] = vec_fma(w[j][i], xv, acc[j][r][i % split]);
            }
    }
    if (split == 2)
        for (int j = 0; j < tile_n; j++)
            for (int r = 0; r < tile_m; r++) acc[j][r][0] = vec_add(acc[j][r][0], acc[j][r][1]);
    if (tile_n * tile_m == LANES && LANES > 1) { /* a full tile: its sums in one vector (lane tile_n r + j) */
        vec each[LANES], sums[1];
        for (int r = 0; r < tile_m; r++)
            for (int j = 0; j < tile_n; j++) each[r * tile_n + j] = acc[j][r][0];
        vec_store((float *)sums, vec_sum_lanes(each));
        for (int r = 0; r < tile_m; r++) memcpy(y + r * N, (float *)sums + r * tile_n, tile_n * sizeof(float));
        return;
    }
    for (int j = 0; j < tile_n; j++)
        for (int r = 0; r < tile_m; r++) y[r * N + j] = vec_sum(acc[j][r][0]);
}

/* y[:, n..n+tile_n) for tile_n rows of W: their scales (and mins) as floats once, then every row of x. */
INLINE void tile_columns(const float *x, int64_t M, int64_t K, const uint8_t *q, int64_t row_bytes,
                         const uint16_t *scale, const uint16_t *mins, float *y, int64_t N, const int tile_n,
                         const int fmt) {
    const int64_t groups = K / GROUP, stride = groups * SCALES_PER_GROUP(fmt);
    float s[ROWS_OF_W * stride], mn[ROWS_OF_W * stride];
    if (GGUF(fmt))
        for (int j = 0; j < tile_n; j++) block_scales(fmt, q + j * row_bytes, K, s + j * stride, mn + j * stride);
    else
        for (int64_t i = 0; i < tile_n * groups && fmt != F32; i++) {
            s[i] = half_to_float(scale[i]);
            mn[i] = fmt == INT4 ? half_to_float(mins[i]) : 0.0f;
        }
    /* The first pass over the tile prefetches the next one; the others find this one in the cache. */
    int64_t m = 0;
    if (M >= ROWS_AT_ONCE) {
        dot_tile(x, K, q, row_bytes, s, mn, stride, y, N, ROWS_AT_ONCE, tile_n, fmt, 1);
        for (m = ROWS_AT_ONCE; m + ROWS_AT_ONCE <= M; m += ROWS_AT_ONCE)
            dot_tile(x + m * K, K, q, row_bytes, s, mn, stride, y + m * N, N, ROWS_AT_ONCE, tile_n, fmt, 0);
    }
    const int first = m == 0;
    _Static_assert(ROWS_AT_ONCE == 4, "the rows of x left over are 1, 2 or 3");
    switch (M - m) {
        case 3: dot_tile(x + m * K, K, q, row_bytes, s, mn, stride, y + m * N, N, 3, tile_n, fmt, first); break;
        case 2: dot_tile(x + m * K, K, q, row_bytes, s, mn, stride, y + m * N, N, 2, tile_n, fmt, first); break;
        case 1: dot_tile(x + m * K, K, q, row_bytes, s, mn, stride, y + m * N, N, 1, tile_n, fmt, first); break;
    }
}

/* ---- one row of x (batch-1 decode) ------------------------------------------------------------------------- */

/* With one row of x each weight is used once, so the product costs what decoding the weights costs. On AVX-512
   (with its byte and word instructions, BW) each format has its own loop over a row of W: the block's layout
   unrolled (constant shifts), the scales of a row converted to floats first, several vectors at once (bytes where
   the layout allows), and 4 accumulators (an FMA's latency is 4 vectors' worth of work). Elsewhere one row of x
   takes the tiles above. Every weight is still dequantized in registers exactly as the reference computes it. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define ONE_ROW 1

/* A block's bytes PREFETCH_BYTES ahead, a cache line at a time: W streams from memory once a token, and a
   prefetch per line keeps more of it in flight than the hardware's own (Qwen2.5-0.5B's products from memory, 1
   thread: Q6_K 7.4 -> 9.8 GB/s, Q5_0 with x in int8 10.1 -> 11.8). */
INLINE void prefetch_block(const uint8_t *block, int bytes) {
    for (int at = 0; at < bytes; at += 64) _mm_prefetch((const char *)block + PREFETCH_BYTES + at, _MM_HINT_T0);
}

INLINE __m512 iota16(void) { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
INLINE __m512i bytes16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
INLINE float sum4(const __m512 acc[4]) {
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

/* Q5_0: W = d * (q - 16), exact. One table per block, d * (i - 16) for a nibble i; a lane whose 5th bit is set (the
   block's 32 bits, as masks) adds 16 d, which gives d * (i + 16 - 16) exactly (the sum is representable). */
INLINE void q50_block(const uint8_t *block, const float *x, __m512 *a0, __m512 *a1) {
    uint32_t bits;
    memcpy(&bits, block + 2, sizeof bits);
    uint16_t half;
    memcpy(&half, block, sizeof half);
    const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16((short)half)); /* broadcast, then converted: no scalar step */
    const __m512 low = _mm512_mul_ps(d, _mm512_sub_ps(iota16(), _mm512_set1_ps(16)));
    const __m512 d16 = _mm512_mul_ps(d, _mm512_set1_ps(16));
    const __m512i v = bytes16(block + 6);
    __m512 w0 = _mm512_permutexvar_ps(v, low), w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), low);
    w0 = _mm512_mask_add_ps(w0, (__mmask16)bits, w0, d16);
    w1 = _mm512_mask_add_ps(w1, (__mmask16)(bits >> 16), w1, d16);
    *a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), *a0);
    *a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + 16), *a1);
}

INLINE float row_q5_0(const float *x, int64_t K, const uint8_t *row) {
    const int64_t blocks = K / 32;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        _mm_prefetch((const char *)row + 22 * b + PREFETCH_BYTES, _MM_HINT_T0); /* 44 bytes a pass: a line or so */
        q50_block(row + 22 * b, x + 32 * b, &acc[0], &acc[1]);
        q50_block(row + 22 * b + 22, x + 32 * b + 32, &acc[2], &acc[3]);
    }
    if (b < blocks) q50_block(row + 22 * b, x + 32 * b, &acc[0], &acc[1]);
    return sum4(acc);
}

/* Q4_K / Q5_K's 8 scales d * sc and minimums -(dmin * m) of a block (lanes 0-7, 8-15), unpacked from their 12
   bytes in general registers (formats.py _k_scales), converted 16 at once. */
INLINE __m512 k_scale_vector(const uint8_t *block) {
    uint64_t a;
    uint32_t c;
    memcpy(&a, block + 4, sizeof a);
    memcpy(&c, block + 12, sizeof c);
    const uint32_t sc_low = (uint32_t)a & 0x3f3f3f3fu, m_low = (uint32_t)(a >> 32) & 0x3f3f3f3fu;
    const uint32_t sc_high = (c & 0x0f0f0f0fu) | ((uint32_t)(a >> 2) & 0x30303030u);
    const uint32_t m_high = ((c >> 4) & 0x0f0f0f0fu) | ((uint32_t)(a >> 34) & 0x30303030u);
    const __m128i packed = _mm_set_epi32((int)m_high, (int)m_low, (int)sc_high, (int)sc_low);
    const __m512 both = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(packed));
    const float d = half_at(block), dmin = half_at(block + 2);
    const __m512 factor = _mm512_setr_ps(d, d, d, d, d, d, d, d, -dmin, -dmin, -dmin, -dmin, -dmin, -dmin, -dmin, -dmin);
    return _mm512_mul_ps(both, factor); /* d * sc, then -(dmin * m): exact */
}

INLINE void k_scales(const uint8_t *block, float *s, float *mn) {
    float out[16];
    _mm512_storeu_ps(out, k_scale_vector(block));
    memcpy(s, out, 8 * sizeof(float));
    memcpy(mn, out + 8, 8 * sizeof(float));
}

/* Q4_K: per pair of groups 32 bytes, the first group in their low nibbles, the second in their high ones; a
   group's 16 values s * i + mn (s * i exact, so one rounding, as the reference's) as a table read by the nibble. */
INLINE float row_q4_k(const float *x, int64_t K, const uint8_t *row) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b = 0; b < K / 256; b++) {
        const uint8_t *block = row + 144 * b;
        prefetch_block(block, 144);
        float s[8], mn[8];
        k_scales(block, s, mn);
        for (int p = 0; p < 4; p++) {
            const float *xp = x + 256 * b + 64 * p;
            const __m512i lo = bytes16(block + 16 + 32 * p), hi = bytes16(block + 32 + 32 * p);
            const __m512 t0 = _mm512_add_ps(_mm512_mul_ps(iota16(), _mm512_set1_ps(s[2 * p])), _mm512_set1_ps(mn[2 * p]));
            const __m512 t1 = _mm512_add_ps(_mm512_mul_ps(iota16(), _mm512_set1_ps(s[2 * p + 1])),
                                            _mm512_set1_ps(mn[2 * p + 1]));
            acc[0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(lo, t0), _mm512_loadu_ps(xp), acc[0]);
            acc[1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(hi, t0), _mm512_loadu_ps(xp + 16), acc[1]);
            acc[2] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(lo, 4), t1), _mm512_loadu_ps(xp + 32), acc[2]);
            acc[3] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(hi, 4), t1), _mm512_loadu_ps(xp + 48), acc[3]);
        }
    }
    return sum4(acc);
}

/* Q5_K: as Q4_K, plus group i's 5th bits, bit i of 32 bytes (as masks): two tables, s * i + mn and s * (i + 16) + mn,
   and each lane reads the one its bit picks. */
INLINE float row_q5_k(const float *x, int64_t K, const uint8_t *row) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const __m512 iota_high = _mm512_add_ps(iota16(), _mm512_set1_ps(16));
    for (int64_t b = 0; b < K / 256; b++) {
        const uint8_t *block = row + 176 * b;
        prefetch_block(block, 176);
        float s[8], mn[8];
        k_scales(block, s, mn);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(block + 16));
        for (int p = 0; p < 4; p++) {
            const float *xp = x + 256 * b + 64 * p;
            const __mmask32 h0 = _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << (2 * p))));
            const __mmask32 h1 = _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(2 << (2 * p))));
            const __m512i lo = bytes16(block + 48 + 32 * p), hi = bytes16(block + 64 + 32 * p);
            const __m512i lo1 = _mm512_srli_epi32(lo, 4), hi1 = _mm512_srli_epi32(hi, 4);
            const __m512 s0 = _mm512_set1_ps(s[2 * p]), m0 = _mm512_set1_ps(mn[2 * p]);
            const __m512 s1 = _mm512_set1_ps(s[2 * p + 1]), m1 = _mm512_set1_ps(mn[2 * p + 1]);
            const __m512 t0 = _mm512_fmadd_ps(s0, iota16(), m0), u0 = _mm512_fmadd_ps(s0, iota_high, m0);
            const __m512 t1 = _mm512_fmadd_ps(s1, iota16(), m1), u1 = _mm512_fmadd_ps(s1, iota_high, m1);
            __m512 w;
            w = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(lo, t0), (__mmask16)h0, lo, u0);
            acc[0] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xp), acc[0]);
            w = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(hi, t0), (__mmask16)(h0 >> 16), hi, u0);
            acc[1] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xp + 16), acc[1]);
            w = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(lo1, t1), (__mmask16)h1, lo1, u1);
            acc[2] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xp + 32), acc[2]);
            w = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(hi1, t1), (__mmask16)(h1 >> 16), hi1, u1);
            acc[3] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xp + 48), acc[3]);
        }
    }
    return sum4(acc);
}

/* Q6_K: a half-block's 128 values decoded as bytes, 64 at a time (low nibbles joined to their 2 high bits, minus
   32), then 16 at a time sign-extended, converted and scaled: W = (d * sc) * (q - 32), exact. */
/* A Q6_K block's half h (128 values) as codes 0..63, one byte each in the values' order: v[0] values 0..63, v[1]
   64..127. Each half's 32 high-bit bytes hold values l, l + 32, l + 64, l + 96's 2 bits at bits 0, 2, 4, 6: in both
   256-bit halves of a vector, shifted per 16-bit word to bits 4-5 (left 4 / 2 for the first 64 values, right 0 / 2
   for the next 64), then joined to the low nibbles. */
INLINE void q6_k_codes(const uint8_t *block, int h, __m512i v[2]) {
    const __m512i up = _mm512_set_epi64(0x0002000200020002, 0x0002000200020002, 0x0002000200020002, 0x0002000200020002,
                                        0x0004000400040004, 0x0004000400040004, 0x0004000400040004, 0x0004000400040004);
    const __m512i down = _mm512_set_epi64(0x0002000200020002, 0x0002000200020002, 0x0002000200020002, 0x0002000200020002,
                                          0, 0, 0, 0);
    const __m512i nibble = _mm512_set1_epi8(15), six = _mm512_set1_epi8(63);
    const __m512i low = _mm512_loadu_si512((const void *)(block + 64 * h));
    const __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(block + 128 + 32 * h)));
    v[0] = _mm512_and_si512(_mm512_ternarylogic_epi32(low, _mm512_sllv_epi16(high, up), nibble, 0xE4), six);
    v[1] = _mm512_and_si512(_mm512_ternarylogic_epi32(_mm512_srli_epi16(low, 4), _mm512_srlv_epi16(high, down), nibble,
                                                      0xE4), six);
}

/* A Q6_K block's 16 scales d * sc (one per 16 values), exact. */
INLINE __m512 q6_k_scales(const uint8_t *block) {
    return _mm512_mul_ps(_mm512_set1_ps(half_at(block + 208)),
                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 192)))));
}

INLINE float row_q6_k(const float *x, int64_t K, const uint8_t *row) {
    const __m512i bias = _mm512_set1_epi8(32);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b = 0; b < K / 256; b++) {
        const uint8_t *block = row + 210 * b;
        prefetch_block(block, 210);
        float s[16];
        _mm512_storeu_ps(s, q6_k_scales(block));
        for (int h = 0; h < 2; h++) {
            const float *xh = x + 256 * b + 128 * h;
            __m512i v[2];
            q6_k_codes(block, h, v);
            int8_t q[128]; /* each q - 32 */
            for (int k = 0; k < 2; k++) _mm512_storeu_si512(q + 64 * k, _mm512_sub_epi8(v[k], bias));
            /* read back by widening loads (one shuffle a vector; extracting from the register first takes two) */
            __asm__ volatile("" ::: "memory");
            for (int i = 0; i < 8; i++) {
                const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * i)))),
                                               _mm512_set1_ps(s[8 * h + i]));
                acc[i % 4] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xh + 16 * i), acc[i % 4]);
            }
        }
    }
    return sum4(acc);
}

/* int4: W = s * q + mn per group of 32 (byte j of a group's 16 holds element j in its low nibble, j + 16 in its
   high one); a group's 16 values s * i + mn as a table read by the nibble, as int4_group computes them. Two groups a
   pass, one accumulator per 16 values. */
INLINE float row_int4(const float *x, int64_t K, const uint8_t *row, const uint16_t *scale, const uint16_t *mins) {
    const int64_t groups = K / 32;
    float s[groups + 16], mn[groups + 16];
    int64_t g = 0;
    for (; g + 16 <= groups; g += 16) {
        _mm512_storeu_ps(s + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + g))));
        _mm512_storeu_ps(mn + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + g))));
    }
    for (; g < groups; g++) {
        s[g] = half_to_float(scale[g]);
        mn[g] = half_to_float(mins[g]);
    }
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (g = 0; g + 2 <= groups; g += 2) {
        const __m512 t0 = _mm512_fmadd_ps(_mm512_set1_ps(s[g]), iota16(), _mm512_set1_ps(mn[g]));
        const __m512 t1 = _mm512_fmadd_ps(_mm512_set1_ps(s[g + 1]), iota16(), _mm512_set1_ps(mn[g + 1]));
        const __m512i v0 = bytes16(row + 16 * g), v1 = bytes16(row + 16 * g + 16);
        const float *xg = x + 32 * g;
        acc[0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v0, t0), _mm512_loadu_ps(xg), acc[0]);
        acc[1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), t0), _mm512_loadu_ps(xg + 16), acc[1]);
        acc[2] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v1, t1), _mm512_loadu_ps(xg + 32), acc[2]);
        acc[3] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), t1), _mm512_loadu_ps(xg + 48), acc[3]);
    }
    if (g < groups) {
        const __m512 t = _mm512_fmadd_ps(_mm512_set1_ps(s[g]), iota16(), _mm512_set1_ps(mn[g]));
        const __m512i v = bytes16(row + 16 * g);
        acc[0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, t), _mm512_loadu_ps(x + 32 * g), acc[0]);
        acc[1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t), _mm512_loadu_ps(x + 32 * g + 16), acc[1]);
    }
    return sum4(acc);
}

/* int8 (Q8_0): W = scale * q. */
INLINE float row_int8(const float *x, int64_t K, const int8_t *row, const uint16_t *scale) {
    const int64_t groups = K / 32;
    float s[groups + 16];
    int64_t g = 0;
    for (; g + 16 <= groups; g += 16) _mm512_storeu_ps(s + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + g))));
    for (; g < groups; g++) s[g] = half_to_float(scale[g]);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (g = 0; g + 2 <= groups; g += 2) {
        const __m512 s0 = _mm512_set1_ps(s[g]), s1 = _mm512_set1_ps(s[g + 1]);
        const int8_t *q = row + 32 * g;
        const float *xg = x + 32 * g;
        acc[0] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), s0),
                                 _mm512_loadu_ps(xg), acc[0]);
        acc[1] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))), s0),
                                 _mm512_loadu_ps(xg + 16), acc[1]);
        acc[2] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32)))), s1),
                                 _mm512_loadu_ps(xg + 32), acc[2]);
        acc[3] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 48)))), s1),
                                 _mm512_loadu_ps(xg + 48), acc[3]);
    }
    for (; g < groups; g++)
        for (int i = 0; i < 2; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 32 * g + 16 * i)))),
                                                   _mm512_set1_ps(s[g])), _mm512_loadu_ps(x + 32 * g + 16 * i), acc[i]);
    return sum4(acc);
}

/* y (1, N) = x (1, K) @ W^T, rows of W split across threads. A big W (the output head) streams from memory faster
   when each thread walks its rows as two runs far apart, taken in turn (Gemma 3 270M's head, 2 cores, 4 KiB pages:
   4.85 against 5.2 ms, as fast as with huge pages); the layers' products, a few MiB, as fast in one run. */
#define BIG_W (16 << 20)
#define ONE_ROW_LOOP(N, BYTES, BODY)                                                                                 \
    _Pragma("omp parallel") {                                                                                        \
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num(), runs = (BYTES) >= BIG_W ? 2 : 1;\
        const int64_t first = (N) * thread / threads, last = (N) * (thread + 1) / threads;                           \
        const int64_t run = (last - first + runs - 1) / runs;                                                        \
        for (int64_t i = 0; i < run; i++)                                                                            \
            for (int64_t n = first + i; n < last; n += run) BODY;                                                    \
    }
#define DEFINE_ONE_ROW(NAME, FMT, ROW_FN)                                                                            \
    static void NAME(const float *x, int64_t K, const uint8_t *q, int64_t N, float *y) {                             \
        const int64_t row_bytes = row_bytes_of(FMT, K);                                                              \
        ONE_ROW_LOOP(N, N * row_bytes, y[n] = ROW_FN(x, K, q + n * row_bytes))                                       \
    }
DEFINE_ONE_ROW(one_row_q4_k, Q4_K, row_q4_k)
DEFINE_ONE_ROW(one_row_q5_k, Q5_K, row_q5_k)
DEFINE_ONE_ROW(one_row_q6_k, Q6_K, row_q6_k)
DEFINE_ONE_ROW(one_row_q5_0, Q5_0, row_q5_0)

static void one_row_int8(const float *x, int64_t K, const int8_t *q, const uint16_t *scale, int64_t N, float *y) {
    ONE_ROW_LOOP(N, N * K, y[n] = row_int8(x, K, q + n * K, scale + n * (K / 32)))
}

static void one_row_int4(const float *x, int64_t K, const uint8_t *q, const uint16_t *scale, const uint16_t *mins,
                         int64_t N, float *y) {
    ONE_ROW_LOOP(N, N * K / 2, y[n] = row_int4(x, K, q + n * (K / 2), scale + n * (K / 32), mins + n * (K / 32)))
}
#endif

/* ---- int4 with x in int8 (a draft model's products) --------------------------------------------------------- */

/* A draft's products need not be exact (every token it proposes is verified), so its int4 weights may be multiplied
   the way llama.cpp multiplies Q4_1 with x: x quantized to int8 per group of 32 (scale max |x| / 127, as Q8_0),
   integer dot products of 4 bytes a lane (AVX-512 VNNI's vpdpbusd, or AVX2's vpmaddubsw and vpmaddwd), then per
   group y += s * xs * sum(q * xq) + mn * sum(x). The weights are repacked for it (dispatch.py pack_int4_int8x) in
   tiles of 16 rows of W, so that a vector's lanes are rows and no row needs a horizontal sum: per tile and group 256
   bytes, 4 vectors of 64; vector i's 4 bytes 4r..4r+3 hold row r's inputs 4i..4i+3 in their low nibbles and
   16+4i..16+4i+3 in their high ones (AVX2 takes a tile's rows 0-7 and 8-15 as two halves of 32 bytes); scales and
   minimums (tiles, groups, 16) fp16. Rows past N are zeros. */
#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)) || \
    (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define INT8X 1

/* A row of x as int8 per group of 32: xq = x * (127 / max |x|) rounded to nearest even (as torch.round), the
   group's scale xs = max |x| / 127, and the float sums of its two halves of 16 (xsum, K / 16 of them). */
static void quantize_x(const float *x, int64_t K, int8_t *xq, float *xs, float *xsum) {
    for (int64_t g = 0; g < K / 32; g++) {
        const float *xg = x + 32 * g;
        vec most = vec_zero(), halves[2] = {vec_zero(), vec_zero()};
        for (int v = 0; v < VECTORS; v++) {
            const vec value = vec_load(xg + v * LANES);
            most = vec_max(most, vec_max(value, vec_mul(value, vec_set1(-1.0f))));
            halves[v * LANES / 16] = vec_add(halves[v * LANES / 16], value);
        }
        const float top = vec_max_lane(most), inverse = top > 0 ? 127.0f / top : 0.0f;
        float rounded[32];
        for (int v = 0; v < VECTORS; v++)
            vec_store(rounded + v * LANES, vec_round(vec_mul(vec_load(xg + v * LANES), vec_set1(inverse))));
        for (int k = 0; k < 32; k++) xq[32 * g + k] = (int8_t)rounded[k];
        xs[g] = top / 127.0f;
        xsum[2 * g] = vec_sum(halves[0]);
        xsum[2 * g + 1] = vec_sum(halves[1]);
    }
}

INLINE int32_t four_bytes(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(__AVX512VNNI__)
#define TILE_PARTS 1 /* a tile at once */
/* One tile's 16 rows of W times one quantized row of x. */
INLINE void int8x_tile(const int8_t *xq, const float *xs, const float *xsum, int64_t groups, const uint8_t *q,
                       const uint16_t *scale, const uint16_t *mins, int part, float *out) {
    (void)part;
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512 acc = _mm512_setzero_ps(), acc_min = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *v = q + 256 * g;
        const int8_t *xg = xq + 32 * g;
        __m512i low = _mm512_setzero_si512(), high = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) {
            const __m512i w = _mm512_loadu_si512((const void *)(v + 64 * i));
            low = _mm512_dpbusd_epi32(low, _mm512_and_si512(w, nibble), _mm512_set1_epi32(four_bytes(xg + 4 * i)));
            high = _mm512_dpbusd_epi32(high, _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble),
                                       _mm512_set1_epi32(four_bytes(xg + 16 + 4 * i)));
        }
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + 16 * g)));
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + 16 * g)));
        const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(low, high));
        acc = _mm512_fmadd_ps(dots, _mm512_mul_ps(s, _mm512_set1_ps(xs[g])), acc);
        acc_min = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[2 * g] + xsum[2 * g + 1]), acc_min);
    }
    _mm512_storeu_ps(out, _mm512_add_ps(acc, acc_min));
}
#else
#define TILE_PARTS 2 /* a tile's rows 0-7, then 8-15 */
/* Half `part` of one tile (8 rows of W) times one quantized row of x. A byte product is at most 15 * 127, so the 8
   vpmaddubsw sums of a group (pairs of products) add up in 16 bits without saturating (8 * 3810 < 32767). */
INLINE void int8x_tile(const int8_t *xq, const float *xs, const float *xsum, int64_t groups, const uint8_t *q,
                       const uint16_t *scale, const uint16_t *mins, int part, float *out) {
    const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps(), acc_min = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *v = q + 256 * g + 32 * part;
        const int8_t *xg = xq + 32 * g;
        __m256i pairs = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(v + 64 * i));
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(_mm256_and_si256(w, nibble),
                                                                 _mm256_set1_epi32(four_bytes(xg + 4 * i))));
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), nibble),
                                                                 _mm256_set1_epi32(four_bytes(xg + 16 + 4 * i))));
        }
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + 16 * g + 8 * part)));
        const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + 16 * g + 8 * part)));
        const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
        acc = _mm256_fmadd_ps(dots, _mm256_mul_ps(s, _mm256_set1_ps(xs[g])), acc);
        acc_min = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[2 * g] + xsum[2 * g + 1]), acc_min);
    }
    _mm256_storeu_ps(out, _mm256_add_ps(acc, acc_min));
}
#endif

/* y (M, N) = x (M, K) @ W^T, W packed as above (ceil(N / 16) tiles). Returns 0, or -1 without memory. */
int accessory_linear_int4_int8x(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *scale,
                                const uint16_t *mins, int64_t N, float *y) {
    const int64_t groups = K / 32, units = (N + 15) / 16 * TILE_PARTS, rows = 16 / TILE_PARTS;
    int8_t *xq = malloc(M * K);
    float *xs = malloc(3 * M * groups * sizeof(float)), *xsum = xs + M * groups;
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) quantize_x(x + m * K, K, xq + m * K, xs + m * groups, xsum + 2 * m * groups);
#pragma omp parallel for schedule(static)
    for (int64_t unit = 0; unit < units; unit++) {
        const int64_t t = unit / TILE_PARTS, n = unit * rows, kept = N - n < rows ? N - n : rows;
        if (kept <= 0) continue; /* a padding half */
        for (int64_t m = 0; m < M; m++) {
            float out[16];
            int8x_tile(xq + m * K, xs + m * groups, xsum + 2 * m * groups, groups, q + 256 * groups * t,
                       scale + 16 * groups * t, mins + 16 * groups * t, (int)(unit % TILE_PARTS), out);
            memcpy(y + m * N + n, out, kept * sizeof(float));
        }
    }
    free(xq);
    free(xs);
    return 0;
}
/* ---- a prompt's products: x in int8, W's tiles unpacked to integer codes ------------------------------------

   With many rows of x, dequantizing W to floats and multiplying in float32 is bound by the float FMAs (a GEMM
   library's, at best). llama.cpp multiplies in integers instead, and so does this: x quantized to int8 as above,
   each tile of W unpacked once to its integer codes (exact: W = s * code + mn, with s and mn a group's float scale
   and minimum as block_scales makes them; codes 0..63), then per group y += s * xs * sum(code * xq) + mn * sum(x),
   the sums of products in integers, 4 a lane an instruction (VNNI), each code reused by every row of x. Only x's
   rounding to int8 differs from the exact product (at most half of max |x| / 127 per value of a group). */

#if LANES == 16
typedef __m512i ivec;
INLINE ivec ivec_zero(void) { return _mm512_setzero_si512(); }
INLINE ivec ivec_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
INLINE ivec ivec_set1(int32_t a) { return _mm512_set1_epi32(a); }
INLINE vec ivec_to_vec(ivec a) { return _mm512_cvtepi32_ps(a); }
/* acc + each lane's 4 products of unsigned bytes u and signed bytes s (no saturation: codes are at most 63). */
INLINE ivec ivec_dot4(ivec acc, ivec u, ivec s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
#define INT8X_ROWS 4 /* rows of x at once: with 2 tiles, 8 integer and 8 float accumulators of 32 registers */
#else
typedef __m256i ivec;
INLINE ivec ivec_zero(void) { return _mm256_setzero_si256(); }
INLINE ivec ivec_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE ivec ivec_set1(int32_t a) { return _mm256_set1_epi32(a); }
INLINE vec ivec_to_vec(ivec a) { return _mm256_cvtepi32_ps(a); }
INLINE ivec ivec_dot4(ivec acc, ivec u, ivec s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
#define INT8X_ROWS 2 /* AVX2's 16 registers */
#endif
#define INT8X_TILES 2 /* tiles of W (LANES rows each) at once: each x broadcast feeds two products */
#define SUB(fmt) ((fmt) == Q6_K ? 16 : 32) /* values that share a scale */

/* A row of W's integer codes (K bytes), as group_weights reads them. */
INLINE void row_codes(const int fmt, const uint8_t *row, int64_t K, uint8_t *codes) {
    for (int64_t b = 0; b < K / BLOCK_VALUES(fmt); b++) {
        const uint8_t *block = row + b * BLOCK_BYTES(fmt);
        uint8_t *out = codes + b * BLOCK_VALUES(fmt);
        if (fmt == Q5_0) {
            uint32_t bits;
            memcpy(&bits, block + 2, sizeof bits);
#if defined(__AVX512BW__) && defined(__AVX512VL__) /* the 5th bits as byte masks: 16 added where set */
            const __m128i qs = _mm_loadu_si128((const __m128i *)(block + 6)), low4 = _mm_set1_epi8(15);
            const __m128i low = _mm_and_si128(qs, low4), high = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
            _mm_storeu_si128((__m128i *)out, _mm_mask_add_epi8(low, (__mmask16)bits, low, _mm_set1_epi8(16)));
            _mm_storeu_si128((__m128i *)(out + 16),
                             _mm_mask_add_epi8(high, (__mmask16)(bits >> 16), high, _mm_set1_epi8(16)));
            continue;
#endif
            for (int j = 0; j < 16; j++) {
                out[j] = (block[6 + j] & 15) | (((bits >> j) & 1) << 4);
                out[j + 16] = (block[6 + j] >> 4) | (((bits >> (j + 16)) & 1) << 4);
            }
            continue;
        }
        for (int i = 0; i < 8; i++) /* group i of the block's 8 */
            for (int j = 0; j < 32; j++) {
                const int shift = (i % 2) * 4;
                if (fmt == Q4_K) out[32 * i + j] = (block[16 + (i / 2) * 32 + j] >> shift) & 15;
                if (fmt == Q5_K)
                    out[32 * i + j] = ((block[48 + (i / 2) * 32 + j] >> shift) & 15) | (((block[16 + j] >> i) & 1) << 4);
                if (fmt == Q6_K)
                    out[32 * i + j] = ((block[(i / 4) * 64 + (i % 2) * 32 + j] >> ((i / 2 % 2) * 4)) & 15) |
                                      (((block[128 + (i / 4) * 32 + j] >> ((i % 4) * 2)) & 3) << 4);
            }
    }
}

/* Rows n.. of W, INT8X_TILES tiles of LANES (zeros past N), as the products read them: tile t's codes at
   codes + t K LANES, value k of its row r at byte (k / 4) 4 LANES + 4 r + k % 4 (a vector holds 4 values of each
   row); its scales and minimums, (K / SUB, LANES), at s and mn + t (K / SUB) LANES. `row` holds K codes and
   `rs`, `rmn` K / 16 floats, as scratch. */
INLINE void unpack_tiles(const int fmt, const uint8_t *q, int64_t N, int64_t K, int64_t n, uint8_t *row, float *rs,
                         float *rmn, uint8_t *codes, float *s, float *mn) {
    const int64_t subs = K / SUB(fmt), row_bytes = row_bytes_of(fmt, K);
    for (int64_t l = 0; l < INT8X_TILES * LANES; l++) {
        const int64_t t = l / LANES, r = l % LANES;
        if (n + l < N) {
            row_codes(fmt, q + (n + l) * row_bytes, K, row);
            block_scales(fmt, q + (n + l) * row_bytes, K, rs, rmn);
        } else {
            memset(row, 0, K);
            memset(rs, 0, subs * sizeof(float));
            memset(rmn, 0, subs * sizeof(float));
        }
        for (int64_t k = 0; k < K; k += 4) memcpy(codes + t * K * LANES + k * LANES + 4 * r, row + k, 4);
        for (int64_t j = 0; j < subs; j++) {
            s[(t * subs + j) * LANES + r] = rs[j];
            mn[(t * subs + j) * LANES + r] = rmn[j];
        }
    }
}

/* y[r, 0..kept) for `rows` rows of quantized x (xq, xs, xsum as quantize_x makes them) against unpacked tiles. */
INLINE void int8x_rows(const int8_t *xq, const float *xs, const float *xsum, int64_t K, const uint8_t *codes,
                       const float *s, const float *mn, float *y, int64_t N, int64_t kept, const int rows,
                       const int sub) {
    const int64_t subs = K / sub;
    vec acc[INT8X_TILES][INT8X_ROWS];
    for (int t = 0; t < INT8X_TILES; t++)
        for (int r = 0; r < rows; r++) acc[t][r] = vec_zero();
    for (int64_t j = 0; j < subs; j++) {
        ivec dots[INT8X_TILES][INT8X_ROWS];
        for (int t = 0; t < INT8X_TILES; t++)
            for (int r = 0; r < rows; r++) dots[t][r] = ivec_zero();
        for (int i = 0; i < sub / 4; i++) {
            const int64_t k = j * sub + 4 * i;
            ivec w[INT8X_TILES];
            for (int t = 0; t < INT8X_TILES; t++) w[t] = ivec_load(codes + t * K * LANES + k * LANES);
            for (int r = 0; r < rows; r++) {
                const ivec xb = ivec_set1(four_bytes(xq + r * K + k));
                for (int t = 0; t < INT8X_TILES; t++) dots[t][r] = ivec_dot4(dots[t][r], w[t], xb);
            }
        }
        for (int r = 0; r < rows; r++) {
            const float *sums = xsum + r * (K / 16);
            const vec dx = vec_set1(xs[r * (K / 32) + j * sub / 32]);
            const vec sx = vec_set1(sub == 32 ? sums[2 * j] + sums[2 * j + 1] : sums[j]);
            for (int t = 0; t < INT8X_TILES; t++) {
                const vec scaled = vec_mul(vec_load(s + (t * subs + j) * LANES), dx);
                acc[t][r] = vec_fma(ivec_to_vec(dots[t][r]), scaled, acc[t][r]);
                acc[t][r] = vec_fma(vec_load(mn + (t * subs + j) * LANES), sx, acc[t][r]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < INT8X_TILES; t++) {
            const int64_t valid = kept - t * LANES;
            if (valid >= LANES) {
                vec_store(y + r * N + t * LANES, acc[t][r]);
            } else if (valid > 0) {
                float last[LANES];
                vec_store(last, acc[t][r]);
                for (int64_t l = 0; l < valid; l++) y[r * N + t * LANES + l] = last[l];
            }
        }
}

/* One unit of work: INT8X_TILES tiles of W from row n, unpacked into `scratch`, against every row of x. */
INLINE void int8x_unit(const int fmt, const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K,
                       const uint8_t *q, int64_t N, int64_t n, uint8_t *scratch, float *y) {
    const int64_t tile_bytes = INT8X_TILES * LANES * K, scales = INT8X_TILES * LANES * (K / 16);
    float *s = (float *)(scratch + tile_bytes), *mn = s + scales, *rs = mn + scales, *rmn = rs + K / 16;
    uint8_t *row = (uint8_t *)(rmn + K / 16);
    unpack_tiles(fmt, q, N, K, n, row, rs, rmn, scratch, s, mn);
    const int64_t kept = N - n < INT8X_TILES * LANES ? N - n : INT8X_TILES * LANES;
    const int64_t groups = K / 32, sums = K / 16;
    int64_t m = 0;
    for (; m + INT8X_ROWS <= M; m += INT8X_ROWS)
        int8x_rows(xq + m * K, xs + m * groups, xsum + m * sums, K, scratch, s, mn, y + m * N + n, N, kept,
                   INT8X_ROWS, SUB(fmt));
    for (; m < M; m++)
        int8x_rows(xq + m * K, xs + m * groups, xsum + m * sums, K, scratch, s, mn, y + m * N + n, N, kept, 1,
                   SUB(fmt));
}

/* The scratch of one thread: its tiles' codes, scales and minimums, and one row's. */
#define INT8X_SCRATCH(K) (INT8X_TILES * LANES * (K) + (2 * INT8X_TILES * LANES + 2) * ((K) / 16) * sizeof(float) + (K))

/* y (M, N) = x (M, K) @ W^T, W in a GGUF block format. One function per format, as DEFINE_LINEAR's. */
#define DEFINE_INT8X(NAME, FMT)                                                                                      \
    static int NAME(const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K, const uint8_t *q,   \
                    int64_t N, float *y) {                                                                           \
        const int64_t units = (N + INT8X_TILES * LANES - 1) / (INT8X_TILES * LANES);                                 \
        int failed = 0;                                                                                              \
        _Pragma("omp parallel") {                                                                                    \
            uint8_t *scratch = malloc(INT8X_SCRATCH(K));                                                             \
            if (!scratch) failed = 1;                                                                                \
            _Pragma("omp for schedule(static)") for (int64_t u = 0; u < units; u++) if (scratch)                     \
                int8x_unit(FMT, xq, xs, xsum, M, K, q, N, u * INT8X_TILES * LANES, scratch, y);                      \
            free(scratch);                                                                                           \
        }                                                                                                            \
        return failed ? -1 : 0;                                                                                      \
    }

DEFINE_INT8X(int8x_q4_k, Q4_K)
DEFINE_INT8X(int8x_q5_k, Q5_K)
DEFINE_INT8X(int8x_q6_k, Q6_K)
DEFINE_INT8X(int8x_q5_0, Q5_0)

/* y (M, N) = x (M, K) @ W^T with x in int8 (above), W in the GGUF block format `fmt` (as accessory_linear_gguf).
   Returns 0, -1 for a name it does not know, or -2 without memory. */
int accessory_linear_gguf_int8x(const char *fmt, const float *x, int64_t M, int64_t K, const uint8_t *q, int64_t N,
                                float *y) {
    const int64_t groups = K / 32;
    int8_t *xq = malloc(M * K);
    float *xs = malloc(3 * M * groups * sizeof(float)), *xsum = xs + M * groups;
    int failed = !xq || !xs ? -2 : 0;
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M; m++)
        if (!failed) quantize_x(x + m * K, K, xq + m * K, xs + m * groups, xsum + 2 * m * groups);
    if (!failed) {
        if (!strcmp(fmt, "q4_k")) failed = int8x_q4_k(xq, xs, xsum, M, K, q, N, y) ? -2 : 0;
        else if (!strcmp(fmt, "q5_k")) failed = int8x_q5_k(xq, xs, xsum, M, K, q, N, y) ? -2 : 0;
        else if (!strcmp(fmt, "q6_k")) failed = int8x_q6_k(xq, xs, xsum, M, K, q, N, y) ? -2 : 0;
        else if (!strcmp(fmt, "q5_0")) failed = int8x_q5_0(xq, xs, xsum, M, K, q, N, y) ? -2 : 0;
        else failed = -1;
    }
    free(xq);
    free(xs);
    return failed;
}

/* ---- one row of x against Q5_0, Q4_K and Q6_K with x in int8 (batch-1 decode) ----------------------------

   With one row there is no reuse to unpack tiles for; a Q5_0 row's codes go straight into the integer product, two
   blocks (64 values) a vector: bytes [a 0-15, b 0-15, a 16-31, b 16-31] (the low nibbles of blocks a and b, then
   the high ones, the 5th bits added as 16 where set), x quantized once per call into the same order. Lane l of the
   VNNI product sums 4 of a block's products; per pair y += dot * (d * xs) + (-16 d) * sum(x) lane by lane, with
   d and xs the lane's block's: the prompt kernel's arithmetic, about 1.6x fewer instructions a weight than the
   float one-row kernel (benchmarks/README.md). Q4_K's and Q6_K's codes are already in x's order, 64 a vector (below);
   from memory at 1 thread these stream Q4_K at 15.5 GB/s against the float kernel's 7.7, and Q6_K at 12.1 against
   9.4. */
#if defined(ONE_ROW)
#define INT8X_ONE_ROW 1
/* x (K, a multiple of 64) as the pairs read it: xq (K) int8, per pair 16 lanes of xs (its block's scale) and of the
   float sum of the lane's 4 values. */
static void quantize_x_pairs(const float *x, int64_t K, int8_t *xq, float *xs, float *sums) {
    int8_t q[64];
    float scale[2], half_sums[4];
    for (int64_t p = 0; p < K / 64; p++) {
        quantize_x(x + 64 * p, 64, q, scale, half_sums);
        for (int part = 0; part < 4; part++) /* a low, b low, a high, b high: 16 values each */
            memcpy(xq + 64 * p + 16 * part, q + 32 * (part % 2) + 16 * (part / 2), 16);
        for (int l = 0; l < 16; l++) {
            const int part = l / 4, block = part % 2;
            const float *xv = x + 64 * p + 32 * block + 16 * (part / 2) + 4 * (l % 4);
            xs[16 * p + l] = scale[block];
            sums[16 * p + l] = (xv[0] + xv[1]) + (xv[2] + xv[3]);
        }
    }
}

INLINE float row_q5_0_int8x(const int8_t *xq, const float *xs, const float *sums, int64_t K, const uint8_t *row) {
    const __m512i pattern = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i low4 = _mm256_set1_epi8(15);
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t p = 0; p < K / 64; p++) {
        const uint8_t *a = row + 44 * p, *b = a + 22;
        _mm_prefetch((const char *)a + PREFETCH_BYTES, _MM_HINT_T0); /* as prefetch_block */
        const __m256i qs = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(a + 6))),
                                                   _mm_loadu_si128((const __m128i *)(b + 6)), 1);
        __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(qs, low4)),
                                       _mm256_and_si256(_mm256_srli_epi16(qs, 4), low4), 1);
        uint32_t bits_a, bits_b;
        memcpy(&bits_a, a + 2, sizeof bits_a);
        memcpy(&bits_b, b + 2, sizeof bits_b);
        const uint64_t fifth = (bits_a & 0xffffu) | (uint64_t)(bits_b & 0xffffu) << 16 | (uint64_t)(bits_a >> 16) << 32 |
                               (uint64_t)(bits_b >> 16) << 48;
        w = _mm512_mask_add_epi8(w, (__mmask64)fifth, w, _mm512_set1_epi8(16));
        const __m512i dot = ivec_dot4(_mm512_setzero_si512(), w, _mm512_loadu_si512((const void *)(xq + 64 * p)));
        uint16_t d_a, d_b;
        memcpy(&d_a, a, sizeof d_a);
        memcpy(&d_b, b, sizeof d_b);
        const __m512 d = _mm512_permutexvar_ps(
            pattern, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)(d_a | (uint32_t)d_b << 16)))));
        acc[p % 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_loadu_ps(xs + 16 * p)),
                                     acc[p % 2]);
        acc[p % 2] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(-16.0f)), _mm512_loadu_ps(sums + 16 * p),
                                     acc[p % 2]);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
}

/* y (1, N) = x (1, K) @ W^T for Q5_0 W, K a multiple of 64. Returns 0, or -1 without memory. */
static int one_row_q5_0_int8x(const float *x, int64_t K, const uint8_t *q, int64_t N, float *y) {
    int8_t *xq = malloc(K);
    float *xs = malloc(K / 2 * sizeof(float)), *sums = xs + K / 4;
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -1;
    }
    quantize_x_pairs(x, K, xq, xs, sums);
    ONE_ROW_LOOP(N, N * (K / 32 * 22), y[n] = row_q5_0_int8x(xq, xs, sums, K, q + n * (K / 32 * 22)))
    free(xq);
    free(xs);
    return 0;
}

/* Q4_K: a pair of groups (64 values) is 32 bytes of W, the first group in their low nibbles, so the codes go into
   one VNNI product with x's 64 values in order; lane l's factor is its group's d * sc times x's group scale. The
   minimums add -(dmin * m) * sum(x) per group, once a block. `xsg`: per block, x's 8 group scales, then its 8 group
   sums. */
INLINE float row_q4_k_int8x(const int8_t *xq, const float *xsg, int64_t K, const uint8_t *row) {
    const __m256i low4 = _mm256_set1_epi8(15);
    __m512i pick[4]; /* pair p's lanes: group 2p's factor, then 2p + 1's */
    for (int p = 0; p < 4; p++)
        pick[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(2 * p)), _mm256_set1_epi32(2 * p + 1), 1);
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, minimums = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / 256; b++) {
        const uint8_t *block = row + 144 * b;
        prefetch_block(block, 144);
        const __m512 factors = _mm512_mul_ps(k_scale_vector(block), _mm512_loadu_ps(xsg + 16 * b));
        minimums = _mm512_mask_add_ps(minimums, 0xff00, minimums, factors);
        for (int p = 0; p < 4; p++) {
            const __m256i qs = _mm256_loadu_si256((const __m256i *)(block + 16 + 32 * p));
            const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(qs, low4)),
                                                 _mm256_and_si256(_mm256_srli_epi16(qs, 4), low4), 1);
            const __m512i dot = ivec_dot4(_mm512_setzero_si512(), w,
                                          _mm512_loadu_si512((const void *)(xq + 256 * b + 64 * p)));
            acc[p % 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick[p], factors), acc[p % 2]);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), minimums));
}

/* Q6_K: 64 codes (0..63) a vector in x's order (q6_k_codes), one VNNI product each with x's 64 values; lane l sums
   4 values of the vector's sub-block l / 4 (16 values a scale), its factor d * sc times x's group scale. W's bias
   of 32 adds -32 d * sc * sum(x) per sub-block, once a block. `xs16`, `sums16`: x's group scale and sum for each
   16 values. */
INLINE float row_q6_k_int8x(const int8_t *xq, const float *xs16, const float *sums16, int64_t K, const uint8_t *row) {
    __m512i pick[4]; /* vector v's lanes: the factors of sub-blocks 4v .. 4v + 3, 4 lanes each */
    for (int v = 0; v < 4; v++)
        pick[v] = _mm512_add_epi32(_mm512_set1_epi32(4 * v), _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6,
                                                                                                   7, 8, 9, 10, 11, 12,
                                                                                                   13, 14, 15), 2));
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, biases = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / 256; b++) {
        const uint8_t *block = row + 210 * b;
        prefetch_block(block, 210);
        const __m512 scales = q6_k_scales(block), factors = _mm512_mul_ps(scales, _mm512_loadu_ps(xs16 + 16 * b));
        biases = _mm512_fmadd_ps(scales, _mm512_loadu_ps(sums16 + 16 * b), biases);
        for (int h = 0; h < 2; h++) {
            __m512i v[2];
            q6_k_codes(block, h, v);
            for (int k = 0; k < 2; k++) {
                const __m512i dot = ivec_dot4(_mm512_setzero_si512(), v[k],
                                              _mm512_loadu_si512((const void *)(xq + 256 * b + 128 * h + 64 * k)));
                acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick[2 * h + k], factors),
                                         acc[k]);
            }
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) - 32.0f * _mm512_reduce_add_ps(biases);
}

/* y (1, N) = x (1, K) @ W^T for Q4_K or Q6_K W, x quantized as the prompt kernels quantize it (int8 per 32). Returns
   0, or -1 without memory. */
static int one_row_k_int8x(const int fmt, const float *x, int64_t K, const uint8_t *q, int64_t N, float *y) {
    const int64_t groups = K / 32, row_bytes = row_bytes_of(fmt, K);
    int8_t *xq = malloc(K);
    float *xs = malloc(5 * groups * sizeof(float)), *sums = xs + groups, *per = sums + 2 * groups;
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -1;
    }
    quantize_x(x, K, xq, xs, sums); /* sums: each 16 values' */
    if (fmt == Q4_K) {
        for (int64_t g = 0; g < groups; g++) {
            per[16 * (g / 8) + g % 8] = xs[g];
            per[16 * (g / 8) + 8 + g % 8] = sums[2 * g] + sums[2 * g + 1];
        }
        ONE_ROW_LOOP(N, N * row_bytes, y[n] = row_q4_k_int8x(xq, per, K, q + n * row_bytes))
    } else {
        for (int64_t j = 0; j < 2 * groups; j++) per[j] = xs[j / 2];
        ONE_ROW_LOOP(N, N * row_bytes, y[n] = row_q6_k_int8x(xq, per, sums, K, q + n * row_bytes))
    }
    free(xq);
    free(xs);
    return 0;
}

/* One row of x against `fmt` with x in int8, if that is on (0), else -1 (the exact kernel then). */
static int one_row_with_x_int8(const char *fmt, const float *x, int64_t K, const uint8_t *q, int64_t N, float *y) {
    if (!int8x_one_row) return -1;
    if (!strcmp(fmt, "q4_k")) return one_row_k_int8x(Q4_K, x, K, q, N, y);
    if (!strcmp(fmt, "q6_k")) return one_row_k_int8x(Q6_K, x, K, q, N, y);
    if (!strcmp(fmt, "q5_0") && K % 64 == 0) return one_row_q5_0_int8x(x, K, q, N, y);
    return -1;
}
#endif

#endif

void accessory_set_int8x_one_row(int enabled) { int8x_one_row = enabled; }

/* Whether one row of x against Q5_0 (K a multiple of 64), Q4_K or Q6_K takes x in int8 now: built (AVX-512) and not
   switched off. */
int accessory_int8x_one_row(void) {
#ifdef INT8X_ONE_ROW
    return int8x_one_row;
#else
    return 0;
#endif
}

/* Whether the products with x in int8 (accessory_linear_int4_int8x, accessory_linear_gguf_int8x) are built
   (AVX-512 with VNNI, or AVX2). */
int accessory_int8x(void) {
#ifdef INT8X
    return 1;
#else
    return 0;
#endif
}

/* y (M, N) = x (M, K) @ W^T: tiles of ROWS_OF_W rows of W, then W's last rows one by one, split across threads.
   With one row of x there is nothing to share a weight vector with: W's rows go one by one (measured faster), and
   on AVX-512 one row of quantized W does not come here (one_row_*).
   One function per format: OpenMP moves the loop body into a function of its own, where a `fmt` argument would
   no longer be a constant that the compiler folds. */
#define DEFINE_LINEAR(NAME, FMT)                                                                                     \
    static void NAME(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *scale,                  \
                     const uint16_t *mins, int64_t N, float *y) {                                                    \
        const int64_t groups = K / GROUP, row_bytes = row_bytes_of(FMT, K);                                          \
        const int64_t tiles = M == 1 ? 0 : N / ROWS_OF_W, tiled = tiles * ROWS_OF_W;                                 \
        _Pragma("omp parallel for schedule(static)") for (int64_t unit = 0; unit < tiles + (N - tiled); unit++) {    \
            const int64_t n = unit < tiles ? unit * ROWS_OF_W : tiled + (unit - tiles);                              \
            const uint16_t *scales = scale ? scale + n * groups : NULL, *minimums = mins ? mins + n * groups : NULL;  \
            if (unit < tiles)                                                                                        \
                tile_columns(x, M, K, q + n * row_bytes, row_bytes, scales, minimums, y + n, N, ROWS_OF_W, FMT);     \
            else                                                                                                     \
                tile_columns(x, M, K, q + n * row_bytes, row_bytes, scales, minimums, y + n, N, 1, FMT);             \
        }                                                                                                            \
    }

DEFINE_LINEAR(linear_int4, INT4)
DEFINE_LINEAR(linear_int8, INT8)
DEFINE_LINEAR(linear_f32, F32)
DEFINE_LINEAR(linear_q4_k, Q4_K)
DEFINE_LINEAR(linear_q5_k, Q5_K)
DEFINE_LINEAR(linear_q6_k, Q6_K)
DEFINE_LINEAR(linear_q5_0, Q5_0)

void accessory_linear_int4(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *scale,
                           const uint16_t *mins, int64_t N, float *y) {
#ifdef ONE_ROW
    if (M == 1) return one_row_int4(x, K, q, scale, mins, N, y);
#endif
    linear_int4(x, M, K, q, scale, mins, N, y);
}

void accessory_linear_int8(const float *x, int64_t M, int64_t K, const int8_t *q, const uint16_t *scale, int64_t N,
                           float *y) {
#ifdef ONE_ROW
    if (M == 1) return one_row_int8(x, K, q, scale, N, y);
#endif
    linear_int8(x, M, K, (const uint8_t *)q, scale, NULL, N, y);
}

/* Float32 W (N, K), K a multiple of 32: for a few rows of x, where a GEMM library's blocking does not pay. */
void accessory_linear_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y) {
    linear_f32(x, M, K, (const uint8_t *)w, NULL, NULL, N, y);
}

/* GGUF's block formats: W (N, K) as N rows of K / block blocks, each as the file holds it; K a multiple of the
   block (256 values; 32 for Q5_0). `fmt` is the format's name, as quant/formats.py spells it. Returns 0, or -1 for
   a name it does not know. */
int accessory_linear_gguf(const char *fmt, const float *x, int64_t M, int64_t K, const uint8_t *q, int64_t N,
                          float *y) {
#ifdef ONE_ROW
    if (M == 1) {
        if (!one_row_with_x_int8(fmt, x, K, q, N, y)) return 0;
        /* exact products, a format without it, Q5_0 of an odd number of blocks, or no memory for x in int8 */
        if (!strcmp(fmt, "q4_k")) one_row_q4_k(x, K, q, N, y);
        else if (!strcmp(fmt, "q5_k")) one_row_q5_k(x, K, q, N, y);
        else if (!strcmp(fmt, "q6_k")) one_row_q6_k(x, K, q, N, y);
        else if (!strcmp(fmt, "q5_0")) one_row_q5_0(x, K, q, N, y);
        else return -1;
        return 0;
    }
#endif
    if (!strcmp(fmt, "q4_k")) linear_q4_k(x, M, K, q, NULL, NULL, N, y);
    else if (!strcmp(fmt, "q5_k")) linear_q5_k(x, M, K, q, NULL, NULL, N, y);
    else if (!strcmp(fmt, "q6_k")) linear_q6_k(x, M, K, q, NULL, NULL, N, y);
    else if (!strcmp(fmt, "q5_0")) linear_q5_0(x, M, K, q, NULL, NULL, N, y);
    else return -1;
    return 0;
}

/* W (N, K) in a GGUF block format as float32, each weight as the tile products make it (as the reference
   dequantizes it): for more rows of x than the kernels take, where a GEMM library multiplies the rows so made.
   A function per format, as DEFINE_LINEAR's. */
#define DEFINE_DEQUANTIZE(NAME, FMT)                                                                                 \
    static void NAME(const uint8_t *q, int64_t N, int64_t K, float *out) {                                           \
        const int64_t groups = K / GROUP, row_bytes = row_bytes_of(FMT, K), stride = groups * SCALES_PER_GROUP(FMT);  \
        _Pragma("omp parallel for schedule(static)") for (int64_t n = 0; n < N; n++) {                               \
            float s[stride], mn[stride];                                                                             \
            vec w[VECTORS];                                                                                          \
            const uint8_t *row = q + n * row_bytes;                                                                  \
            block_scales(FMT, row, K, s, mn);                                                                        \
            for (int64_t g = 0; g < groups; g++) {                                                                   \
                group_weights(FMT, row, g, s, mn, w);                                                                \
                for (int v = 0; v < VECTORS; v++) vec_store(out + n * K + g * GROUP + v * LANES, w[v]);              \
            }                                                                                                        \
        }                                                                                                            \
    }

DEFINE_DEQUANTIZE(dequantize_q4_k, Q4_K)
DEFINE_DEQUANTIZE(dequantize_q5_k, Q5_K)
DEFINE_DEQUANTIZE(dequantize_q6_k, Q6_K)
DEFINE_DEQUANTIZE(dequantize_q5_0, Q5_0)

/* Returns 0, or -1 for a name it does not know. */
int accessory_dequantize_gguf(const char *fmt, const uint8_t *q, int64_t N, int64_t K, float *out) {
    if (!strcmp(fmt, "q4_k")) dequantize_q4_k(q, N, K, out);
    else if (!strcmp(fmt, "q5_k")) dequantize_q5_k(q, N, K, out);
    else if (!strcmp(fmt, "q6_k")) dequantize_q6_k(q, N, K, out);
    else if (!strcmp(fmt, "q5_0")) dequantize_q5_0(q, N, K, out);
    else return -1;
    return 0;
}

/* ---- attention of one new token per row, over its own cached positions ------------------------------------- */

/* e^x for x <= 88 (softmax's shifted scores, an activation's exponent), LANES at a time: Cephes' expf (2^n times a
   degree-6 polynomial of the rest; within 2 ulp of expf), so the loop needs no libm call per value. */
INLINE vec vec_exp(vec x) {
    x = vec_max(x, vec_set1(-87.0f)); /* e^-87 is ~1e-38: below that, a score counts as nothing anyway */
    vec n = vec_round(vec_mul(x, vec_set1(1.44269504088896341f))); /* x log2(e) */
    vec r = vec_fma(n, vec_set1(-0.693359375f), x);                /* x - n ln2, in two exact-enough parts */
    r = vec_fma(n, vec_set1(2.12194440e-4f), r);
    vec p = vec_set1(1.9875691500e-4f);
    p = vec_fma(p, r, vec_set1(1.3981999507e-3f));
    p = vec_fma(p, r, vec_set1(8.3334519073e-3f));
    p = vec_fma(p, r, vec_set1(4.1665795894e-2f));
    p = vec_fma(p, r, vec_set1(1.6666665459e-1f));
    p = vec_fma(p, r, vec_set1(5.0000001201e-1f));
    p = vec_fma(p, vec_mul(r, r), vec_add(r, vec_set1(1.0f)));
    return vec_mul(p, vec_exp2_int(n));
}

/* scores[c] = q . k[c] * scale for c < columns; LANES columns at a time, their sums in one vector. */
INLINE void attention_scores(const float *q, const float *k, int64_t columns, int64_t D, float scale, float *scores) {
    int64_t c = 0;
    if (D % LANES == 0 && LANES > 1) {
        for (; c + LANES <= columns; c += LANES) {
            vec each[LANES];
            for (int l = 0; l < LANES; l++) {
                each[l] = vec_zero();
                for (int64_t d = 0; d < D; d += LANES)
                    each[l] = vec_fma(vec_load(q + d), vec_load(k + (c + l) * D + d), each[l]);
            }
            vec_store(scores + c, vec_mul(vec_sum_lanes(each), vec_set1(scale)));
        }
    }
    for (; c < columns; c++) {
        float dot = 0.0f;
        for (int64_t d = 0; d < D; d++) dot += q[d] * k[c * D + d];
        scores[c] = dot * scale;
    }
}

/* out[d] = norm * sum_c weights[c] v[c, d], for c < columns: LANES values of d at a time, in registers. */
INLINE void attention_values(const float *weights, const float *v, int64_t columns, int64_t D, float norm, float *out) {
    if (D % LANES == 0 && D <= 8 * LANES && LANES > 1) {
        vec acc[8];
        for (int64_t i = 0; i < D / LANES; i++) acc[i] = vec_zero();
        for (int64_t c = 0; c < columns; c++) {
            const vec weight = vec_set1(weights[c]);
            for (int64_t i = 0; i < D / LANES; i++) acc[i] = vec_fma(weight, vec_load(v + c * D + i * LANES), acc[i]);
        }
        for (int64_t i = 0; i < D / LANES; i++) vec_store(out + i * LANES, vec_mul(acc[i], vec_set1(norm)));
        return;
    }
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
    for (int64_t c = 0; c < columns; c++)
        for (int64_t d = 0; d < D; d++) out[d] += weights[c] * v[c * D + d];
    for (int64_t d = 0; d < D; d++) out[d] *= norm;
}

/* out (B, L, H, D) = softmax(q . k / sqrt(D)) . v: query l of row b (L per row: one when decoding, a few when
   verifying speculative proposals) over columns 0..positions[b, l] of cache row b, query head h reading KV head
   h / (H / Hkv) (grouped-query attention). q (B, L, H, D); k, v (rows, Hkv, S, D) float32 caches; positions (B, L).
   Columns past a query's position are never read, so one call serves rows at any mix of positions. */
void accessory_decode_attention(const float *q, const float *k, const float *v, const int64_t *positions, int64_t B,
                                int64_t L, int64_t H, int64_t Hkv, int64_t S, int64_t D, float *out) {
    const float scale = 1.0f / sqrtf((float)D);
#pragma omp parallel for collapse(3) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t l = 0; l < L; l++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t query = (b * L + l) * H + h, columns = positions[b * L + l] + 1, head = h / (H / Hkv);
                const int64_t padded = (columns + LANES - 1) / LANES * LANES;
                const float *kh = k + (b * Hkv + head) * S * D, *vh = v + (b * Hkv + head) * S * D;
                float scores[padded], top = -INFINITY, total = 0.0f;
                attention_scores(q + query * D, kh, columns, D, scale, scores);
                for (int64_t c = 0; c < columns; c++) top = scores[c] > top ? scores[c] : top;
                for (int64_t c = columns; c < padded; c++) scores[c] = top; /* read by the last vector, not summed */
                for (int64_t c = 0; c < padded; c += LANES)
                    vec_store(scores + c, vec_exp(vec_add(vec_load(scores + c), vec_set1(-top))));
                for (int64_t c = 0; c < columns; c++) total += scores[c];
                attention_values(scores, vh, columns, D, 1.0f / total, out + query * D);
            }
}

/* ---- the small steps of a layer ---------------------------------------------------------------------------------

   An eager step runs RMSNorm as eight torch operations and a rotary embedding as about fifteen, each one dispatched
   from Python at a few microseconds for a few hundred values: at batch 1 they cost more than their arithmetic. One
   call each does the same sums. (A compiled step does not call these: its compiler fuses the torch expressions.) */

/* y = x / sqrt(mean(x^2) + eps) * (offset + w), each of `rows` rows of `dim` values. The sum of squares in double,
   eight at a time: as exact as float32's own rounding of the result. */
void accessory_rms_norm(const float *x, int64_t rows, int64_t dim, const float *w, float eps, float offset,
                        float *y) {
#pragma omp parallel for schedule(static) if (rows * dim >= (1 << 18))
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        double sums[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8)
            for (int j = 0; j < 8; j++) sums[j] += (double)xr[i + j] * xr[i + j];
        for (; i < dim; i++) sums[0] += (double)xr[i] * xr[i];
        const double sum = ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]));
        const float inverse = (float)(1.0 / sqrt(sum / (double)dim + (double)eps));
        for (i = 0; i < dim; i++) yr[i] = xr[i] * inverse * (offset + w[i]);
    }
}

/* Meta's interleaved rotary embedding: each pair (x[2i], x[2i+1]) of each head of token t turned by its angle,
   (x0 cos - x1 sin, x0 sin + x1 cos). x, y (tokens, heads, D); rotations (tokens, D / 2, 2), each (cos, sin). */
void accessory_rotary(const float *x, int64_t tokens, int64_t heads, int64_t D, const float *rotations, float *y) {
#pragma omp parallel for schedule(static) if (tokens * heads * D >= (1 << 18))
    for (int64_t t = 0; t < tokens; t++) {
        const float *turn = rotations + t * D;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + (t * heads + h) * D;
            float *yh = y + (t * heads + h) * D;
            for (int64_t i = 0; i < D / 2; i++) {
                const float x0 = xh[2 * i], x1 = xh[2 * i + 1], c = turn[2 * i], s = turn[2 * i + 1];
                yh[2 * i] = x0 * c - x1 * s;
                yh[2 * i + 1] = x0 * s + x1 * c;
            }
        }
    }
}

/* A gated MLP's hidden units, act(gate) * up, for `rows` rows of `width` (gate's row r at gate + r * gate_stride,
   up's alike): act SiLU (gelu_tanh 0) or GELU's tanh approximation (gelu_tanh 1). Both are g * sigmoid(k), k = g
   for SiLU and 2 sqrt(2 / pi) (g + 0.044715 g^3) for GELU (0.5 (1 + tanh(z)) = sigmoid(2z)): one vector
   expression, where libm's tanhf per value cost as much as a prompt's attention. */
INLINE vec gated_values(vec g, vec u, const int gelu_tanh) {
    vec k = g;
    if (gelu_tanh) k = vec_mul(vec_set1(1.5957691216f), vec_fma(vec_mul(vec_set1(0.044715f), g), vec_mul(g, g), g));
    const vec e = vec_exp(vec_mul(vec_max(k, vec_set1(-88.0f)), vec_set1(-1.0f))); /* e^-k, at most e^88: finite */
    return vec_div(vec_mul(g, u), vec_add(vec_set1(1.0f), e));
}

void accessory_gated(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, int64_t rows,
                     int64_t width, int gelu_tanh, float *y) {
#pragma omp parallel for schedule(static) if (rows * width >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * gate_stride, *u = up + r * up_stride;
        float *yr = y + r * width;
        int64_t i = 0;
        for (; i + LANES <= width; i += LANES)
            vec_store(yr + i, gelu_tanh ? gated_values(vec_load(g + i), vec_load(u + i), 1)
                                        : gated_values(vec_load(g + i), vec_load(u + i), 0));
        if (i < width) { /* the last few through a padded vector: each value by the same arithmetic wherever it falls,
                            so a rank's slice of the hidden units (another width) gives the values the whole does */
            float gl[LANES] = {0}, ul[LANES] = {0}, out[LANES];
            memcpy(gl, g + i, (width - i) * sizeof(float));
            memcpy(ul, u + i, (width - i) * sizeof(float));
            const vec gv = vec_load(gl), uv = vec_load(ul);
            vec_store(out, gelu_tanh ? gated_values(gv, uv, 1) : gated_values(gv, uv, 0));
            memcpy(yr + i, out, (width - i) * sizeof(float));
        }
    }
}

/* One head's q or k as the attention reads it: normed (qk-norm: `norm` given), scaled, then rotated as above. */
static void prepare_head(const float *x, int64_t D, const float *norm, float eps, float offset, float scale,
                         const float *turn, float *y) {
    if (norm) accessory_rms_norm(x, 1, D, norm, eps, offset, y);
    else for (int64_t d = 0; d < D; d++) y[d] = x[d];
    for (int64_t i = 0; i < D / 2; i++) {
        const float x0 = y[2 * i] * scale, x1 = y[2 * i + 1] * scale, c = turn[2 * i], s = turn[2 * i + 1];
        y[2 * i] = x0 * c - x1 * s;
        y[2 * i + 1] = x0 * s + x1 * c;
    }
}

/* A decode step's attention from its projections, in one call instead of some twenty torch operations: for each of
   the L new tokens of cache rows 0..B-1 (token t = b * L + l at positions[t]), q's and k's heads prepared
   (prepare_head: q_norm / k_norm may be NULL, q alone is scaled), k and v stored in the caches at column
   positions[t] (positions[t] % S on a ring), then every query attends as in accessory_decode_attention, over the
   columns up to its position (on a ring, where L is 1: all that are written). Token t's heads start at
   q + t * q_stride (H of them, D each; k and v alike, Hkv heads); rotations (rotation_rows: 1 or B, L, D / 2, 2);
   caches (rows, Hkv, S, D); out (B, L, H, D), which holds the prepared q until each query overwrites its own. */
void accessory_attend(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                      int64_t v_stride, int64_t B, int64_t L, int64_t H, int64_t Hkv, int64_t D,
                      const float *rotations, int64_t rotation_rows, const int64_t *positions, float *k_cache,
                      float *v_cache, int64_t S, int ring, float q_scale, const float *q_norm, const float *k_norm,
                      float eps, float offset, float *out) {
    int64_t visible[B * L];
    for (int64_t t = 0; t < B * L; t++) {
        const int64_t b = t / L, position = positions[t], column = ring ? position % S : position;
        const float *turn = rotations + ((rotation_rows == 1 ? 0 : b) * L + t % L) * D;
        for (int64_t h = 0; h < H; h++)
            prepare_head(q + t * q_stride + h * D, D, q_norm, eps, offset, q_scale, turn, out + (t * H + h) * D);
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t at = ((b * Hkv + h) * S + column) * D;
            prepare_head(k + t * k_stride + h * D, D, k_norm, eps, offset, 1.0f, turn, k_cache + at);
            for (int64_t d = 0; d < D; d++) v_cache[at + d] = v[t * v_stride + h * D + d];
        }
        visible[t] = ring && position >= S ? S - 1 : position;
    }
    /* each query reads its own prepared q before it writes its output there */
    accessory_decode_attention(out, k_cache, v_cache, visible, B, L, H, Hkv, S, D, out);
}

/* Which instruction set this build uses, for logs and benchmark tables. */
const char *accessory_kernels_isa(void) { return ISA; }
