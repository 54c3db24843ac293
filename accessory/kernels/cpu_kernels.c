/* Matrix products for a few rows of x on the CPU, y (M, N) = x (M, K) @ W^T, with W float32 or quantized in groups
   of 32 along K (and, last, the attention of one new token per row over its cached keys and values).

   float32: W (N, K)

   int8: q (N, K) int8, scale (N, K/32) fp16:                 W[n, k] = scale[n, g] * q[n, k]
   int4: q (N, K/2) uint8, scale and min (N, K/32) fp16:      W[n, k] = scale[n, g] * q4[n, k] + min[n, g]
         in each group's 16 bytes, byte j holds element j in its low nibble and element j + 16 in its high one
         (GGUF's Q4_0 / Q4_1 order, so the file's bits are used as they are).

   x stays float: each group of W is dequantized in registers, exactly as the reference computes it (one rounding of
   scale * q + min), and multiplied with x in float. For float32 W this is the same loop without the dequantizing:
   at decode's few rows it beats a GEMM library, whose blocking and packing pay off only for many rows. Rows of W are split across OpenMP threads (the runtime torch
   itself uses); up to ROWS_AT_ONCE rows of x share each dequantized group. Built at first use with the machine's
   C compiler and -march=native: AVX-512, AVX2 + FMA + F16C, or plain C. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

#define GROUP 32
#define ROWS_AT_ONCE 4
#define PREFETCH_BYTES 2048 /* how far ahead in W to prefetch at least: rows are short, the next ones follow */
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
INLINE vec vec_set1(float a) { return _mm512_set1_ps(a); }
INLINE vec vec_mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
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

/* ---- a tile: tile_n rows of W against tile_m rows of x ------------------------------------------------------- */

/* W's rows are `row_bytes` apart from q; s and mn hold each row's group scales and mins as floats, `groups` apart.
   `tile_m`, `tile_n` and `bits` (4, 8, or 32 for float32 W) are constants at every call (the dispatch below), so
   the branches fold away. */
INLINE void dot_tile(const float *x, int64_t K, const uint8_t *q, int64_t row_bytes, const float *s, const float *mn,
                     float *y, int64_t N, const int tile_m, const int tile_n, const int bits, const int prefetch) {
    const int64_t groups = K / GROUP, group_bytes = GROUP * bits / 8;
    /* Prefetch the next tile's rows (a tile of float32 rows is longer than PREFETCH_BYTES). */
    const int64_t ahead = tile_n * row_bytes > PREFETCH_BYTES ? tile_n * row_bytes : PREFETCH_BYTES;
    /* A small tile has too few accumulators to hide the FMAs' latency: give each two, for alternate vectors. */
    const int split = tile_m * tile_n < 8 ? 2 : 1;
    vec acc[ROWS_OF_W][ROWS_AT_ONCE][2], w[ROWS_OF_W][VECTORS];
    for (int j = 0; j < tile_n; j++)
        for (int r = 0; r < tile_m; r++) acc[j][r][0] = acc[j][r][1] = vec_zero();
    for (int64_t g = 0; g < groups; g++) {
        for (int j = 0; j < tile_n; j++) {
            const uint8_t *qg = q + j * row_bytes + g * group_bytes;
#if LANES > 1
            if (prefetch) {
                _mm_prefetch((const char *)qg + ahead, _MM_HINT_T0);
                if (bits == 32) _mm_prefetch((const char *)qg + ahead + 64, _MM_HINT_T0);
            }
#endif
            if (bits == 4)
                int4_group(qg, s[j * groups + g], mn[j * groups + g], w[j]);
            else if (bits == 8)
                int8_group((const int8_t *)qg, s[j * groups + g], w[j]);
            else
                for (int i = 0; i < VECTORS; i++) w[j][i] = vec_load((const float *)qg + i * LANES);
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
                         const int bits) {
    const int64_t groups = K / GROUP;
    float s[ROWS_OF_W * groups], mn[ROWS_OF_W * groups];
    for (int64_t i = 0; i < tile_n * groups && bits != 32; i++) {
        s[i] = half_to_float(scale[i]);
        mn[i] = bits == 4 ? half_to_float(mins[i]) : 0.0f;
    }
    /* The first pass over the tile prefetches the next one; the others find this one in the cache. */
    int64_t m = 0;
    if (M >= ROWS_AT_ONCE) {
        dot_tile(x, K, q, row_bytes, s, mn, y, N, ROWS_AT_ONCE, tile_n, bits, 1);
        for (m = ROWS_AT_ONCE; m + ROWS_AT_ONCE <= M; m += ROWS_AT_ONCE)
            dot_tile(x + m * K, K, q, row_bytes, s, mn, y + m * N, N, ROWS_AT_ONCE, tile_n, bits, 0);
    }
    const int first = m == 0;
    _Static_assert(ROWS_AT_ONCE == 4, "the rows of x left over are 1, 2 or 3");
    switch (M - m) {
        case 3: dot_tile(x + m * K, K, q, row_bytes, s, mn, y + m * N, N, 3, tile_n, bits, first); break;
        case 2: dot_tile(x + m * K, K, q, row_bytes, s, mn, y + m * N, N, 2, tile_n, bits, first); break;
        case 1: dot_tile(x + m * K, K, q, row_bytes, s, mn, y + m * N, N, 1, tile_n, bits, first); break;
    }
}

/* y (M, N) = x (M, K) @ W^T: tiles of ROWS_OF_W rows of W, then W's last rows one by one, split across threads.
   With one row of x there is nothing to share a weight vector with: W's rows go one by one (measured faster).
   One function per format: OpenMP moves the loop body into a function of its own, where a `bits` argument would
   no longer be a constant that the compiler folds. */
#define DEFINE_LINEAR(NAME, BITS)                                                                                    \
    static void NAME(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *scale,                  \
                     const uint16_t *mins, int64_t N, float *y) {                                                    \
        const int64_t groups = K / GROUP, row_bytes = K * BITS / 8;                                                  \
        const int64_t tiles = M == 1 ? 0 : N / ROWS_OF_W, tiled = tiles * ROWS_OF_W;                                 \
        _Pragma("omp parallel for schedule(static)") for (int64_t unit = 0; unit < tiles + (N - tiled); unit++) {    \
            const int64_t n = unit < tiles ? unit * ROWS_OF_W : tiled + (unit - tiles);                              \
            const uint16_t *scales = scale ? scale + n * groups : NULL, *minimums = mins ? mins + n * groups : NULL;  \
            if (unit < tiles)                                                                                        \
                tile_columns(x, M, K, q + n * row_bytes, row_bytes, scales, minimums, y + n, N, ROWS_OF_W, BITS);    \
            else                                                                                                     \
                tile_columns(x, M, K, q + n * row_bytes, row_bytes, scales, minimums, y + n, N, 1, BITS);            \
        }                                                                                                            \
    }

DEFINE_LINEAR(linear_int4, 4)
DEFINE_LINEAR(linear_int8, 8)
DEFINE_LINEAR(linear_f32, 32)

void accessory_linear_int4(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *scale,
                           const uint16_t *mins, int64_t N, float *y) {
    linear_int4(x, M, K, q, scale, mins, N, y);
}

void accessory_linear_int8(const float *x, int64_t M, int64_t K, const int8_t *q, const uint16_t *scale, int64_t N,
                           float *y) {
    linear_int8(x, M, K, (const uint8_t *)q, scale, NULL, N, y);
}

/* Float32 W (N, K), K a multiple of 32: for a few rows of x, where a GEMM library's blocking does not pay. */
void accessory_linear_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y) {
    linear_f32(x, M, K, (const uint8_t *)w, NULL, NULL, N, y);
}

/* ---- attention of one new token per row, over its own cached positions ------------------------------------- */

/* e^x for x <= 0 (softmax's shifted scores), LANES at a time: Cephes' expf (2^n times a degree-6 polynomial of the
   rest; within 2 ulp of expf), so the loop needs no libm call per score. */
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

/* out (B, H, D) = softmax(q . k / sqrt(D)) . v over cache columns 0..positions[b] of cache row b, query head h
   reading KV head h / (H / Hkv) (grouped-query attention). q (B, H, D); k, v (rows, Hkv, S, D) float32 caches.
   Columns past a row's position are never read, so one call serves rows at any mix of positions. */
void accessory_decode_attention(const float *q, const float *k, const float *v, const int64_t *positions, int64_t B,
                                int64_t H, int64_t Hkv, int64_t S, int64_t D, float *out) {
    const float scale = 1.0f / sqrtf((float)D);
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t columns = positions[b] + 1, head = h / (H / Hkv), padded = (columns + LANES - 1) / LANES * LANES;
            const float *kh = k + (b * Hkv + head) * S * D, *vh = v + (b * Hkv + head) * S * D;
            float *oh = out + (b * H + h) * D, scores[padded], top = -INFINITY, total = 0.0f;
            attention_scores(q + (b * H + h) * D, kh, columns, D, scale, scores);
            for (int64_t c = 0; c < columns; c++) top = scores[c] > top ? scores[c] : top;
            for (int64_t c = columns; c < padded; c++) scores[c] = top; /* read by the last vector, not summed */
            for (int64_t c = 0; c < padded; c += LANES)
                vec_store(scores + c, vec_exp(vec_add(vec_load(scores + c), vec_set1(-top))));
            for (int64_t c = 0; c < columns; c++) total += scores[c];
            attention_values(scores, vh, columns, D, 1.0f / total, oh);
        }
}

/* Which instruction set this build uses, for logs and benchmark tables. */
const char *accessory_kernels_isa(void) { return ISA; }
