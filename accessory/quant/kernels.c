/* Weight-only quantized matrix products on the CPU: y (M, N) = x (M, K) @ W^T, W stored in groups of 32 along K.

   int8: q (N, K) int8, scale (N, K/32) fp16:                 W[n, k] = scale[n, g] * q[n, k]
   int4: q (N, K/2) uint8, scale and min (N, K/32) fp16:      W[n, k] = scale[n, g] * q4[n, k] + min[n, g]
         in each group's 16 bytes, byte j holds element j in its low nibble and element j + 16 in its high one
         (GGUF's Q4_0 / Q4_1 order, so the file's bits are used as they are).

   x stays float: each group of W is dequantized in registers, exactly as the reference computes it (one rounding of
   scale * q + min), and multiplied with x in float. Rows of W are split across OpenMP threads (the runtime torch
   itself uses); up to ROWS_AT_ONCE rows of x share each dequantized group. Built at first use with the machine's
   C compiler and -march=native: AVX-512, AVX2 + FMA + F16C, or plain C. */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

#define GROUP 32
#define ROWS_AT_ONCE 4
#define PREFETCH_BYTES 2048 /* how far ahead in W to prefetch: rows are short, and the next ones follow */
#define INLINE static inline __attribute__((always_inline))

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

#else
typedef float vec;
#define LANES 1
#define ISA "generic"
INLINE vec vec_zero(void) { return 0.0f; }
INLINE vec vec_load(const float *p) { return *p; }
INLINE vec vec_fma(vec a, vec b, vec c) { return a * b + c; }
INLINE vec vec_add(vec a, vec b) { return a + b; }
INLINE float vec_sum(vec a) { return a; }

INLINE void int4_group(const uint8_t *q, float s, float m, vec w[]) {
    for (int j = 0; j < GROUP / 2; j++) {
        w[j] = s * (float)(q[j] & 15) + m;
        w[j + GROUP / 2] = s * (float)(q[j] >> 4) + m;
    }
}

INLINE void int8_group(const int8_t *q, float s, vec w[]) {
    for (int j = 0; j < GROUP; j++) w[j] = s * (float)q[j];
}
#endif

#define VECTORS (GROUP / LANES)

/* ---- one row of W against `block` rows of x ----------------------------------------------------------------- */

/* `bits` and `block` are constants at every call (the dispatch below), so the branches fold away and the
   accumulators stay in registers. */
INLINE void dot_rows(const float *x, int64_t K, const uint8_t *q, const float *s, const float *mn, float *y,
                     int64_t N, const int block, const int bits) {
    vec acc[ROWS_AT_ONCE][VECTORS], w[VECTORS];
    for (int r = 0; r < block; r++)
        for (int i = 0; i < VECTORS; i++) acc[r][i] = vec_zero();
    const int64_t group_bytes = bits == 4 ? GROUP / 2 : GROUP;
    for (int64_t g = 0; g < K / GROUP; g++) {
        const uint8_t *qg = q + g * group_bytes;
#if LANES > 1
        _mm_prefetch((const char *)qg + PREFETCH_BYTES, _MM_HINT_T0);
#endif
        if (bits == 4)
            int4_group(qg, s[g], mn[g], w);
        else
            int8_group((const int8_t *)qg, s[g], w);
        for (int r = 0; r < block; r++)
            for (int i = 0; i < VECTORS; i++) acc[r][i] = vec_fma(w[i], vec_load(x + r * K + g * GROUP + i * LANES),
                                                                  acc[r][i]);
    }
    for (int r = 0; r < block; r++) {
        vec total = acc[r][0];
        for (int i = 1; i < VECTORS; i++) total = vec_add(total, acc[r][i]);
        y[r * N] = vec_sum(total);
    }
}

/* y[:, n] for one row n of W: its scales (and mins) as floats once, then x in blocks of ROWS_AT_ONCE rows. */
INLINE void linear_row(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *scale,
                       const uint16_t *mins, float *y, int64_t N, const int bits) {
    const int64_t groups = K / GROUP;
    float s[groups], mn[groups];
    for (int64_t g = 0; g < groups; g++) {
        s[g] = half_to_float(scale[g]);
        mn[g] = bits == 4 ? half_to_float(mins[g]) : 0.0f;
    }
    int64_t m = 0;
    for (; m + ROWS_AT_ONCE <= M; m += ROWS_AT_ONCE) dot_rows(x + m * K, K, q, s, mn, y + m * N, N, ROWS_AT_ONCE, bits);
    switch (M - m) {
        case 3: dot_rows(x + m * K, K, q, s, mn, y + m * N, N, 3, bits); break;
        case 2: dot_rows(x + m * K, K, q, s, mn, y + m * N, N, 2, bits); break;
        case 1: dot_rows(x + m * K, K, q, s, mn, y + m * N, N, 1, bits); break;
    }
}

/* y (M, N) = x (M, K) @ W^T; one output column of y per row of W, rows of W split across threads. */
void accessory_linear_int4(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *scale,
                           const uint16_t *mins, int64_t N, float *y) {
    const int64_t groups = K / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        linear_row(x, M, K, q + n * (K / 2), scale + n * groups, mins + n * groups, y + n, N, 4);
}

void accessory_linear_int8(const float *x, int64_t M, int64_t K, const int8_t *q, const uint16_t *scale, int64_t N,
                           float *y) {
    const int64_t groups = K / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        linear_row(x, M, K, (const uint8_t *)(q + n * K), scale + n * groups, NULL, y + n, N, 8);
}

/* Which instruction set this build uses, for logs and benchmark tables. */
const char *accessory_kernels_isa(void) { return ISA; }
