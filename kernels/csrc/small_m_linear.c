/* y[m, n] = sum_k x[m, k] * w[n, k] + bias[n] for a few rows of x (decode steps).
 *
 * With one to a few rows, a linear layer is bound by how fast the weights stream from memory.
 * CPU BLAS reaches about a third of the read bandwidth on this shape (x @ W^T, M = 1); this kernel
 * reads W in its natural [N, K] layout, each thread a contiguous range of rows, so the whole matrix
 * is one sequential stream, and every row is used for all M rows of x while it sits in L1.
 * W is float32 or bfloat16 (widened to float32 on load); x, y and bias are float32.
 *
 * Threads come from OpenMP; the library links the same libgomp as PyTorch (loaded first), so both
 * share one thread pool.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#ifdef HAVE_AVX2
static inline __m256 load8(const void *w, int64_t i, int is_bf16) {
    if (is_bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)w + i);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

static inline float wload(const void *w, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* Two rows of W (n, n + 1) against up to four rows of x (m0 .. m0 + mc - 1). Always inlined
 * with a constant mc (see rows2_mc), so the accumulators live in registers. */
static inline __attribute__((always_inline)) void rows2(float *y, const float *x, const void *w, int is_bf16, int64_t n, int two,
                  int m0, int mc, int64_t N, int64_t K) {
    float acc[2][4] = {{0}};
    int64_t k = 0;
    const int64_t r0 = n * K, r1 = (n + (two ? 1 : 0)) * K;
#ifdef HAVE_AVX2
    __m256 a[2][4];
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
        __m256 w0 = load8(w, r0 + k, is_bf16);
        __m256 w1 = two ? load8(w, r1 + k, is_bf16) : w0;
        for (int j = 0; j < mc; j++) {
            __m256 xv = _mm256_loadu_ps(x + (int64_t)(m0 + j) * K + k);
            a[0][j] = _mm256_fmadd_ps(w0, xv, a[0][j]);
            a[1][j] = _mm256_fmadd_ps(w1, xv, a[1][j]);
        }
    }
    for (int j = 0; j < mc; j++) {
        acc[0][j] = hsum(a[0][j]);
        acc[1][j] = hsum(a[1][j]);
    }
#endif
    for (; k < K; k++) {
        float w0 = wload(w, r0 + k, is_bf16), w1 = wload(w, r1 + k, is_bf16);
        for (int j = 0; j < mc; j++) {
            float xv = x[(int64_t)(m0 + j) * K + k];
            acc[0][j] += w0 * xv;
            acc[1][j] += w1 * xv;
        }
    }
    for (int j = 0; j < mc; j++) {
        y[(int64_t)(m0 + j) * N + n] = acc[0][j];
        if (two) y[(int64_t)(m0 + j) * N + n + 1] = acc[1][j];
    }
}

static void rows2_mc(float *y, const float *x, const void *w, int is_bf16, int64_t n, int two,
                     int m0, int mc, int64_t N, int64_t K) {
    switch (mc) {
    case 1: rows2(y, x, w, is_bf16, n, two, m0, 1, N, K); break;
    case 2: rows2(y, x, w, is_bf16, n, two, m0, 2, N, K); break;
    case 3: rows2(y, x, w, is_bf16, n, two, m0, 3, N, K); break;
    default: rows2(y, x, w, is_bf16, n, two, m0, 4, N, K); break;
    }
}

#ifdef HAVE_AVX2
/* M == 1 (one decode row): four rows of W and two k-chunks in flight, eight independent
 * accumulators, so the loop is bound by memory rather than by FMA latency. Needs K % 16 == 0. */
static inline __attribute__((always_inline)) void gemv4(float *y, const float *x, const void *w,
                                                        const int is_bf16, int64_t n, int64_t K) {
    __m256 a[4][2];
    for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        for (int r = 0; r < 4; r++) {
            a[r][0] = _mm256_fmadd_ps(load8(w, (n + r) * K + k, is_bf16), x0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(load8(w, (n + r) * K + k + 8, is_bf16), x1, a[r][1]);
        }
    }
    for (int r = 0; r < 4; r++) y[n + r] = hsum(_mm256_add_ps(a[r][0], a[r][1]));
}

static void gemv(float *y, const float *x, const void *w, int is_bf16, int64_t N, int64_t K,
                 int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t q = 0; q < N / 4; q++) {
        if (is_bf16) gemv4(y, x, w, 1, 4 * q, K);
        else gemv4(y, x, w, 0, 4 * q, K);
    }
    for (int64_t n = N / 4 * 4; n < N; n++) rows2(y, x, w, is_bf16, n, 0, 0, 1, N, K);
}
#endif

int small_m_linear(float *y, const float *x, const void *w, int is_bf16, const float *bias,
                   int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || N < 1 || K < 1) return 1;
#ifdef HAVE_AVX2
    if (M == 1 && K % 16 == 0 && N >= 4) {
        gemv(y, x, w, is_bf16, N, K, num_threads);
        goto add_bias;
    }
#endif
    const int64_t pairs = (N + 1) / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t n = 2 * p;
        const int two = n + 1 < N;
        for (int m0 = 0; m0 < M; m0 += 4) {
            int mc = (int)(M - m0 < 4 ? M - m0 : 4);
            rows2_mc(y, x, w, is_bf16, n, two, m0, mc, N, K);
        }
    }
add_bias:
    if (bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * N + n] += bias[n];
    return 0;
}
