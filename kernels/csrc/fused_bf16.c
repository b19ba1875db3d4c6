/* The elementwise work between a layer's bf16 GEMMs, one pass each (kernels/cpu_fused.py).
 *
 * With bf16 GEMMs and a float32 residual, every GEMM input was a float32 tensor rounded to bf16
 * in a separate copy and every GEMM output widened back to float32 in another; RoPE took five
 * torch ops and SiLU-and-multiply three. In a 1,024-token prefill on one thread of a 2-vCPU AMX
 * Xeon those copies and small ops took more time than the GEMMs themselves. Each function here
 * reads its input once and writes bf16 once, with the same float32 arithmetic as the torch code
 * it replaces (one rounding to bf16 at the end).
 *
 * bf16 values are uint16_t; rounding is to nearest even, NaN kept a (quiet) NaN, as torch's.
 * Rows are split over OpenMP threads (the same libgomp as PyTorch: see kernels/native.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(nan ? ((u >> 16) | 0x40u) : r);
}

/* out[t, :] = bf16(x[t, :] * rsqrt(mean(x[t, :]^2) + eps) * w), x and w float32 [T, H], [H]. */
int rms_norm_bf16(uint16_t *restrict out, const float *restrict x, const float *restrict w, int64_t T, int64_t H, float eps,
                  int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * H;
        uint16_t *o = out + t * H;
        float ss = 0.f;
        for (int64_t i = 0; i < H; i++) ss += xr[i] * xr[i];
        const float r = 1.f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) o[i] = f32_to_bf16(xr[i] * r * w[i]);
    }
    return 0;
}

/* out[t, i] = bf16(silu(g) * u) with g = gu[t, i], u = gu[t, I + i]: the gate and up halves of
 * one fused GEMM's bf16 output [T, 2I]. */
int silu_mul_bf16(uint16_t *restrict out, const uint16_t *restrict gu, int64_t T, int64_t I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *restrict g = gu + t * 2 * I, *restrict u = g + I;
        uint16_t *restrict o = out + t * I;
        for (int64_t i = 0; i < I; i++) {
            const float a = bf16_to_f32(g[i]);
            /* exp's argument capped where it would overflow: fast-math's vector division
             * (reciprocal and a Newton step) turns x / inf into NaN */
            o[i] = f32_to_bf16(a / (1.f + expf(fminf(-a, 88.f))) * bf16_to_f32(u[i]));
        }
    }
    return 0;
}

/* qkv bf16 [T, (Hr + Hv) * D] (+ bias float32 [(Hr + Hv) * D], or NULL) -> out bf16, same shape:
 * the first Hr heads (queries, then keys) rotated by the rotate-half rule at their positions,
 * the last Hv heads (values) copied. cos, sin: float32 [max_position, D], halves duplicated.
 * With qf, the first Hq rotated heads (the queries) also go there in float32 [T, Hq, D], before
 * rounding: decode attention takes its queries in float32. */
int rope_bf16(uint16_t *restrict out, float *restrict qf, int64_t Hq,
              const uint16_t *restrict qkv, const float *restrict bias,
              const float *restrict cos, const float *restrict sin, const int64_t *pos, int64_t T, int64_t Hr, int64_t Hv, int64_t D,
              int nthreads) {
    const int64_t W = (Hr + Hv) * D, half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *in = qkv + t * W;
        uint16_t *o = out + t * W;
        const float *c = cos + pos[t] * D, *s = sin + pos[t] * D;
        float x[512];  /* one head, bias added; D <= 512 (checked by the caller) */
        for (int64_t h = 0; h < Hr; h++) {
            const int64_t base = h * D;
            for (int64_t j = 0; j < D; j++)
                x[j] = bf16_to_f32(in[base + j]) + (bias ? bias[base + j] : 0.f);
            float y[512];
            for (int64_t j = 0; j < half; j++) y[j] = x[j] * c[j] + (-x[j + half]) * s[j];
            for (int64_t j = half; j < D; j++) y[j] = x[j] * c[j] + x[j - half] * s[j];
            for (int64_t j = 0; j < D; j++) o[base + j] = f32_to_bf16(y[j]);
            if (qf && h < Hq) memcpy(qf + (t * Hq + h) * D, y, D * sizeof(float));
        }
        for (int64_t j = Hr * D; j < W; j++)
            o[j] = bias ? f32_to_bf16(bf16_to_f32(in[j]) + bias[j]) : in[j];
    }
    return 0;
}
