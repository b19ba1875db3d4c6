/* y[m, n] = sum_k x[m, k] * w[n, k] + bias[n] for a few rows of float32 x, with w read from its
 * GGUF blocks (Q8_0, Q4_0, Q4_1) instead of a float32 copy (kernels/cpu_linear.py).
 *
 * A float32 model converted from a GGUF file has weights that are exactly the blocks'
 * dequantized values. Decode steps are bound by streaming the weights: the blocks are 4.5-8.5
 * bits a weight against 32. Each block is dequantized here with the arithmetic of the gguf
 * package's dequantizer (float32 products and sums, each rounded on its own; this file is
 * compiled with -ffp-contract=off so that no multiply-add fuses), so every weight is bit for bit
 * the float32 weight the model holds, and the products are float32 as in the float32 path.
 *
 * A bf16 engine made from the same file holds those weights rounded to bf16; with ROUND_BF16
 * each dequantized weight is rounded so here too, and with x rounded to bf16 by the caller the
 * products are those of a bf16 GEMM (exact in float32, summed in float32).
 *
 * Each thread takes a contiguous range of rows of w. With AVX-512 each block is dequantized in
 * registers and used by up to 16 rows of x at once; elsewhere a row is dequantized into a float32
 * buffer (dequant_row) and used for every row of x.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define HAVE_AVX512 1
#endif

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };
/* or-ed into the block type: each dequantized weight rounded to bf16 (to nearest even, as
 * torch's .to(torch.bfloat16)), the weights of a bf16 engine made from the same file */
#define ROUND_BF16 0x100
#define MAX_K 16384  /* longest row: 64 KiB of float32 per thread */
#ifndef PREFETCH
#define PREFETCH 4096  /* bytes ahead of the block being read */
#endif

#ifdef __F16C__
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);  /* inf, NaN */
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else {  /* subnormal half: normalize */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#endif

static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;  /* weights are finite */
    memcpy(&f, &u, 4);
    return f;
}

static int64_t block_bytes(int qtype) {
    return qtype == Q8_0 ? 34 : qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : -1;
}

#ifndef HAVE_AVX512
/* Row of K weights (K / 32 blocks) -> float32 out[K] (CPUs without AVX-512). */
static void dequant_row(float *restrict out, const uint8_t *restrict row, int qtype, int bf16,
                        int64_t K) {
    const int64_t bb = block_bytes(qtype);
    for (int64_t b = 0; b < K / 32; b++) {
        const uint8_t *blk = row + b * bb;
        uint16_t dh;
        memcpy(&dh, blk, 2);
        const float d = f16_to_f32(dh);
        float *o = out + b * 32;
        if (qtype == Q8_0) {
            const int8_t *q = (const int8_t *)(blk + 2);
            for (int j = 0; j < 32; j++) o[j] = (float)q[j] * d;
        } else if (qtype == Q4_0) {
            const uint8_t *q = blk + 2;
            for (int j = 0; j < 16; j++) {
                o[j] = (float)((int)(q[j] & 0x0f) - 8) * d;
                o[j + 16] = (float)((int)(q[j] >> 4) - 8) * d;
            }
        } else {
            uint16_t mh;
            memcpy(&mh, blk + 2, 2);
            const float m = f16_to_f32(mh);
            const uint8_t *q = blk + 4;
            for (int j = 0; j < 16; j++) {
                o[j] = d * (float)(q[j] & 0x0f) + m;
                o[j + 16] = d * (float)(q[j] >> 4) + m;
            }
        }
    }
    if (bf16)
        for (int64_t k = 0; k < K; k++) out[k] = round_bf16(out[k]);
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t K) {
    float s = 0.f;
    for (int64_t k = 0; k < K; k++) s += a[k] * b[k];
    return s;
}
#endif

#ifdef HAVE_AVX512
/* The 32 weights of one block as two vectors (elements 0-15, 16-31), with dequant_row's
 * arithmetic (mul, then add: -ffp-contract=off keeps them apart). */
static inline __m512 round_bf16_512(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}

static inline __attribute__((always_inline)) void dequant_block_f32(const uint8_t *blk,
                                                                    int qtype, __m512 *w0,
                                                                    __m512 *w1);

/* dequant_block_f32, rounded to bf16 where ``qtype`` has ROUND_BF16. */
static inline __attribute__((always_inline)) void dequant_block(const uint8_t *blk, int qtype,
                                                                __m512 *w0, __m512 *w1) {
    dequant_block_f32(blk, qtype & 0xff, w0, w1);
    if (qtype & ROUND_BF16) {
        *w0 = round_bf16_512(*w0);
        *w1 = round_bf16_512(*w1);
    }
}

static inline __attribute__((always_inline)) void dequant_block_f32(const uint8_t *blk,
                                                                    int qtype, __m512 *w0,
                                                                    __m512 *w1) {
    uint16_t dh;
    memcpy(&dh, blk, 2);
    const __m512 d = _mm512_set1_ps(f16_to_f32(dh));
    if (qtype == Q8_0) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 2));
        *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), d);
        *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), d);
        return;
    }
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + (qtype == Q4_1 ? 4 : 2)));
    __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(q, mask));
    __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask));
    if (qtype == Q4_0) {
        const __m512i eight = _mm512_set1_epi32(8);
        *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo, eight)), d);
        *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi, eight)), d);
        return;
    }
    uint16_t mh;
    memcpy(&mh, blk + 2, 2);
    const __m512 m = _mm512_set1_ps(f16_to_f32(mh));
    *w0 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), m);
    *w1 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)), m);
}

/* One row of w (n) against rows m0 .. m0 + MC - 1 of x, dequantizing in registers. Up to 8
 * rows keep two accumulators each (two FMA chains per row hide the FMA latency at one row);
 * 9-16 rows, one each (32 accumulators would not fit the 32 vector registers). */
#define ROW_CHUNK(MC, TWO)                                                                    \
    static void row_chunk_##MC(float *y, const float *x, const uint8_t *row, int qtype,       \
                               int64_t bb, int64_t n, int64_t m0, int64_t N, int64_t K,       \
                               float b) {                                                      \
        __m512 a0[MC], a1[MC];                                                                 \
        for (int i = 0; i < MC; i++) a0[i] = a1[i] = _mm512_setzero_ps();                    \
        for (int64_t k = 0; k < K; k += 32) {                                                  \
            __m512 w0, w1;                                                                     \
            _mm_prefetch((const char *)(row + k / 32 * bb) + PREFETCH, _MM_HINT_T0);           \
            dequant_block(row + k / 32 * bb, qtype, &w0, &w1);                                 \
            for (int i = 0; i < MC; i++) {                                                     \
                const float *xr = x + (m0 + i) * K + k;                                        \
                a0[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), w0, a0[i]);                       \
                if (TWO)                                                                       \
                    a1[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w1, a1[i]);              \
                else                                                                           \
                    a0[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w1, a0[i]);              \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < MC; i++)                                                           \
            y[(m0 + i) * N + n] = _mm512_reduce_add_ps(TWO ? _mm512_add_ps(a0[i], a1[i])      \
                                                           : a0[i]) + b;                       \
    }
ROW_CHUNK(1, 1)
ROW_CHUNK(2, 1)
ROW_CHUNK(3, 1)
ROW_CHUNK(4, 1)
ROW_CHUNK(5, 1)
ROW_CHUNK(6, 1)
ROW_CHUNK(7, 1)
ROW_CHUNK(8, 1)
ROW_CHUNK(9, 0)
ROW_CHUNK(10, 0)
ROW_CHUNK(11, 0)
ROW_CHUNK(12, 0)
ROW_CHUNK(13, 0)
ROW_CHUNK(14, 0)
ROW_CHUNK(15, 0)
ROW_CHUNK(16, 0)
typedef void (*row_chunk_fn)(float *, const float *, const uint8_t *, int, int64_t, int64_t,
                             int64_t, int64_t, int64_t, float);
static const row_chunk_fn ROW_CHUNKS[17] = {
    0, row_chunk_1, row_chunk_2, row_chunk_3, row_chunk_4, row_chunk_5, row_chunk_6,
    row_chunk_7, row_chunk_8, row_chunk_9, row_chunk_10, row_chunk_11, row_chunk_12,
    row_chunk_13, row_chunk_14, row_chunk_15, row_chunk_16};
#endif

/* 1 when blocks are dequantized in registers (AVX-512), the only build faster than reading the
 * float32 weights: the other one's serial float32 sums are an order of magnitude slower. */
int quant_in_registers(void) {
#ifdef HAVE_AVX512
    return 1;
#else
    return 0;
#endif
}

/* Returns 0, or -1 for an unknown block type or a K that is not a multiple of 32 (or too big). */
int quant_linear(float *y, const float *x, const uint8_t *w, int qtype, const float *bias,
                 int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t bb = block_bytes(qtype & 0xff);
    if (bb < 0 || K % 32 != 0 || K > MAX_K) return -1;
    const int64_t row_bytes = K / 32 * bb;
#ifdef HAVE_AVX512
    /* up to 16 rows of x share each dequantized block; more rows take the block again */
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float b = bias ? bias[n] : 0.f;
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
            const int64_t mc = M - m0 < 16 ? M - m0 : 16;
            ROW_CHUNKS[mc](y, x, w + n * row_bytes, qtype, bb, n, m0, N, K, b);
        }
    }
#else
#pragma omp parallel num_threads(nthreads)
    {
        float wrow[MAX_K] __attribute__((aligned(64)));  /* on each thread's stack */
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            dequant_row(wrow, w + n * row_bytes, qtype & 0xff, qtype & ROUND_BF16, K);
            const float b = bias ? bias[n] : 0.f;
            for (int64_t m = 0; m < M; m++) y[m * N + n] = dot(x + m * K, wrow, K) + b;
        }
    }
#endif
    return 0;
}

/* The float32 weights themselves, through the dequantization quant_linear uses on this CPU (the
 * test checks them bit for bit against the gguf package's). */
int quant_dequantize(float *out, const uint8_t *w, int qtype, int64_t N, int64_t K) {
    const int64_t bb = block_bytes(qtype & 0xff);
    if (bb < 0 || K % 32 != 0) return -1;
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * (K / 32 * bb);
#ifdef HAVE_AVX512
        for (int64_t k = 0; k < K; k += 32) {
            __m512 w0, w1;
            dequant_block(row + k / 32 * bb, qtype, &w0, &w1);
            _mm512_storeu_ps(out + n * K + k, w0);
            _mm512_storeu_ps(out + n * K + k + 16, w1);
        }
#else
        dequant_row(out + n * K, row, qtype & 0xff, qtype & ROUND_BF16, K);
#endif
    }
    return 0;
}
