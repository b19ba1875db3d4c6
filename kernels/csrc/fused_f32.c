/* The elementwise work between a float32 engine's GEMMs, one pass each (kernels/cpu_fused.py).
 *
 * In torch, RMSNorm is five ops (pow, mean, add, rsqrt, two multiplies), RoPE five (two slices
 * negated and concatenated, two multiplies, an add) and SiLU-and-multiply two: in a 1,000-token
 * float32 prefill on a 2-vCPU Zen 4 they took ~8% of the time, each op a pass over memory.
 *
 * Compiled without -ffast-math: RoPE computes x * cos + rotated * sin with the same three
 * roundings as torch (no fused multiply-add), so its result is torch's bit for bit. RMSNorm's
 * sum of squares is vectorized (another summation order than torch's) and SiLU's exp is
 * libmvec's: both within float32 rounding of torch, not equal to it.
 * Rows are split over OpenMP threads (the same libgomp as PyTorch: see kernels/native.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
__m512 _ZGVeN16v_expf(__m512);  /* glibc's libmvec (linked with -lmvec) */
#endif

/* out[t, :] = (x[t, :] * rsqrt(mean(x[t, :]^2) + eps)) * w, x and w float32 [T, H], [H]. */
int rms_norm_f32(float *restrict out, const float *restrict x, const float *restrict w,
                 int64_t T, int64_t H, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * H;
        float *o = out + t * H;
        float ss = 0.f;
#pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < H; i++) ss += xr[i] * xr[i];
        const float r = 1.f / sqrtf(ss / (float)H + eps);
#pragma omp simd
        for (int64_t i = 0; i < H; i++) o[i] = xr[i] * r * w[i];
    }
    return 0;
}

/* out[t, i] = silu(g) * u with g = gu[t, i], u = gu[t, I + i]: the gate and up halves of one
 * fused GEMM's output [T, 2I]. silu(g) = g / (1 + exp(-g)), as torch computes it. */
int silu_mul_f32(float *restrict out, const float *restrict gu, int64_t T, int64_t I,
                 int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *restrict g = gu + t * 2 * I, *restrict u = g + I;
        float *restrict o = out + t * I;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.f);
        for (; i < I; i += 16) {
            const __mmask16 k = I - i >= 16 ? (__mmask16)0xffff
                                            : (__mmask16)((1u << (I - i)) - 1);
            const __m512 a = _mm512_maskz_loadu_ps(k, g + i);
            const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_setzero_ps(), a));
            const __m512 s = _mm512_div_ps(a, _mm512_add_ps(one, e));
            _mm512_mask_storeu_ps(o + i, k, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(k, u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
    return 0;
}

/* qkv float32 [T, W], in place: the first Hr heads of D (queries, then keys) of each row rotated
 * by the rotate-half rule at the row's position; the rest (values) untouched. cos, sin: float32
 * [max_position, D], halves duplicated. */
int rope_f32(float *restrict qkv, const float *restrict cos, const float *restrict sin,
             const int64_t *pos, int64_t T, int64_t W, int64_t Hr, int64_t D, int nthreads) {
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + pos[t] * D, *s = sin + pos[t] * D;
        for (int64_t h = 0; h < Hr; h++) {
            float *x = qkv + t * W + h * D;
            float lo[256];  /* the first half, before it is overwritten; D <= 512 (caller) */
            memcpy(lo, x, half * sizeof(float));
            for (int64_t j = 0; j < half; j++) {
                const float a = lo[j] * c[j], b = -x[j + half] * s[j];
                x[j] = a + b;
            }
            for (int64_t j = half; j < D; j++) {
                const float a = x[j] * c[j], b = lo[j - half] * s[j];
                x[j] = a + b;
            }
        }
    }
    return 0;
}
