/* Causal prefill attention on CPU: a flash-attention kernel (online softmax, no score matrix).
 *
 * q:   [n, num_kv_heads * group, D]            (bfloat16 or float32)
 * k,v: [num_past + n, num_kv_heads, D]        (same dtype as q)
 * out: [n, num_kv_heads * group, D]            (float32 or bfloat16)
 * Query i sits at position num_past + i and sees keys 0 .. num_past + i; with window > 0 (a
 * sliding-window layer) only the last `window` of them: num_past + i - window + 1 .. num_past + i.
 *
 * Work item = (kv head, tile of ROWS query rows). A row is (query i, head g of the group), so the
 * `group` query heads sharing a KV head share every key and value they load. Per 32-key block:
 * scores S = Q K^T (ROWS x 32, float32 accumulators in registers), online-softmax update, then
 * O += P V with O in a per-tile float32 buffer. Keys past a row's position are masked; blocks
 * past the tile's last query are not visited.
 *
 * bfloat16 multiplies with AVX512-BF16 (vdpbf16ps: pairs of bf16 products summed into float32),
 * so K is packed as [block][D/2][32 keys][2] and V as [block][16 key pairs][D][2]; the
 * probabilities are rounded to bf16 for P V, as PyTorch's flash kernel does for bf16 inputs.
 * float32 multiplies with FMA, K packed as [block][D][32 keys], V read in place.
 *
 * Why: PyTorch's CPU flash attention ran at 40-50 GFLOP/s a thread on a Zen 4 against ~200 for
 * a bf16 GEMM, 41% of a one-thread 1,000-token bf16 prefill of SmolLM2.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#define KB 32    /* keys per block: two vectors of 16 */
#define ROWS 12  /* query rows per tile: 24 score accumulators */
#define MAX_D 256
#define LAZY 8.0f /* see the online softmax */

typedef struct {
    const void *q, *k, *v; void *out; const void *kp, *vp;
    int n, num_past, hkv, group, out_bf16, window; float scale;
    int64_t nkb;  /* key blocks */
} Args;

/* 2^x for x <= 0: 2^round(x) times exp((x - round(x)) ln 2) by the Cephes expf polynomial;
 * about 1 ulp. */
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.693147180559945f));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Round-to-nearest-even float32 -> bf16 (NaN stays NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* Pack K (and for bf16, V) of kv head h into the layouts the tile loops read (zero padded). */
static void pack_head(const Args *a, int h, const int D, const int bf16) {
    const int64_t L = (int64_t)a->num_past + a->n, row = (int64_t)a->hkv * D;
    const int64_t blk_elems = (int64_t)KB * D;
    if (bf16) {
        const uint16_t *k = a->k, *v = a->v;
        uint16_t *kp = (uint16_t *)a->kp + h * a->nkb * blk_elems;
        uint16_t *vp = (uint16_t *)a->vp + h * a->nkb * blk_elems;
        for (int64_t b = 0; b < a->nkb; b++) {
            uint16_t *kb = kp + b * blk_elems, *vb = vp + b * blk_elems;
            for (int t = 0; t < KB; t++) {
                const int64_t j = b * KB + t;
                const uint16_t *kr = k + j * row + (int64_t)h * D, *vr = v + j * row + (int64_t)h * D;
                for (int d = 0; d < D; d++) {
                    /* K: [D/2][KB][2];  V: [KB/2][D][2] */
                    kb[((d >> 1) * KB + t) * 2 + (d & 1)] = j < L ? kr[d] : 0;
                    vb[((t >> 1) * D + d) * 2 + (t & 1)] = j < L ? vr[d] : 0;
                }
            }
        }
    } else {
        const float *k = a->k;
        float *kp = (float *)a->kp + h * a->nkb * blk_elems;
        for (int64_t b = 0; b < a->nkb; b++) {
            float *kb = kp + b * blk_elems;
            for (int t = 0; t < KB; t++) {
                const int64_t j = b * KB + t;
                const float *kr = k + j * row + (int64_t)h * D;
                for (int d = 0; d < D; d++) kb[d * KB + t] = j < L ? kr[d] : 0.0f;  /* [D][KB] */
            }
        }
    }
}

/* One tile: rows r0 .. r0 + nrows - 1 of kv head h. Always inlined with constant D and dtype. */
static inline __attribute__((always_inline)) void tile_impl(const Args *a, int h, int r0,
                                                            int nrows, const int D, const int bf16) {
    const int G = a->group, HQ = a->hkv * G;
    const int64_t blk_elems = (int64_t)KB * D;
    const void *qrow[ROWS];
    int limit[ROWS], first[ROWS];  /* last and first visible key of each row */
    for (int r = 0; r < ROWS; r++) {
        const int rr = r0 + (r < nrows ? r : nrows - 1);  /* tail rows repeat the last one */
        const int i = rr / G, g = rr % G;
        qrow[r] = (const char *)a->q + ((int64_t)i * HQ + h * G + g) * D * (bf16 ? 2 : 4);
        limit[r] = a->num_past + i;
        first[r] = a->window > 0 && limit[r] >= a->window ? limit[r] - a->window + 1 : 0;
    }
    const int last_key = limit[ROWS - 1];
    const int64_t nblocks = last_key / KB + 1;
    float o[ROWS][MAX_D] __attribute__((aligned(64)));
    float m[ROWS], lv[ROWS][16] __attribute__((aligned(64)));  /* max (base 2), sum of p */
    for (int r = 0; r < ROWS; r++) {
        m[r] = -INFINITY;
        for (int d = 0; d < 16; d++) lv[r][d] = 0.0f;
        for (int d = 0; d < D; d++) o[r][d] = 0.0f;
    }
    float p32[ROWS][KB] __attribute__((aligned(64)));
    uint32_t pb[ROWS][KB / 2] __attribute__((aligned(64)));
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 vscale = _mm512_set1_ps(a->scale * 1.44269504088896341f);  /* log2 e */

    for (int64_t b = first[0] / KB; b < nblocks; b++) {  /* row 0's window starts first */
        /* S = Q K^T for 32 keys */
        __m512 s[ROWS][2];
        for (int r = 0; r < ROWS; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();
        if (bf16) {
#if defined(__AVX512BF16__)
            const uint16_t *kb = (const uint16_t *)a->kp + (h * a->nkb + b) * blk_elems;
            for (int p = 0; p < D / 2; p++) {
                const __m512bh k0 = (__m512bh)_mm512_load_si512(kb + p * 2 * KB);
                const __m512bh k1 = (__m512bh)_mm512_load_si512(kb + p * 2 * KB + 32);
                for (int r = 0; r < ROWS; r++) {
                    int32_t pair;
                    memcpy(&pair, (const uint16_t *)qrow[r] + 2 * p, 4);
                    const __m512bh qq = (__m512bh)_mm512_set1_epi32(pair);
                    s[r][0] = _mm512_dpbf16_ps(s[r][0], qq, k0);
                    s[r][1] = _mm512_dpbf16_ps(s[r][1], qq, k1);
                }
            }
#endif
        } else {
            const float *kb = (const float *)a->kp + (h * a->nkb + b) * blk_elems;
            for (int d = 0; d < D; d++) {
                const __m512 k0 = _mm512_load_ps(kb + d * KB), k1 = _mm512_load_ps(kb + d * KB + 16);
                for (int r = 0; r < ROWS; r++) {
                    const __m512 qq = _mm512_set1_ps(((const float *)qrow[r])[d]);
                    s[r][0] = _mm512_fmadd_ps(qq, k0, s[r][0]);
                    s[r][1] = _mm512_fmadd_ps(qq, k1, s[r][1]);
                }
            }
        }
        /* online softmax in base 2: mask keys past each row's position. The running max m is
         * raised (and O and l rescaled) only when a score passes it by LAZY (2^8): the
         * probabilities stay <= 256, exact enough in float32, and most blocks skip the
         * horizontal max and the rescale. */
        const int key0 = (int)(b * KB);
        const int nk = last_key - key0 + 1 < KB ? last_key - key0 + 1 : KB;  /* keys to read */
        for (int r = 0; r < ROWS; r++) {
            const __m512i lim = _mm512_set1_epi32(limit[r] - key0);
            const __m512i fst = _mm512_set1_epi32(first[r] - key0);
            const __m512i lane16 = _mm512_add_epi32(lane, _mm512_set1_epi32(16));
            const __mmask16 v0 = _mm512_cmple_epi32_mask(lane, lim) & _mm512_cmpge_epi32_mask(lane, fst);
            const __mmask16 v1 = _mm512_cmple_epi32_mask(lane16, lim) & _mm512_cmpge_epi32_mask(lane16, fst);
            const __m512 ninf = _mm512_set1_ps(-INFINITY);
            const __m512 x0 = _mm512_mask_mul_ps(ninf, v0, s[r][0], vscale);
            const __m512 x1 = _mm512_mask_mul_ps(ninf, v1, s[r][1], vscale);
            const __m512 top = _mm512_set1_ps(m[r] + LAZY);
            if (_mm512_cmp_ps_mask(x0, top, _CMP_GT_OQ) | _mm512_cmp_ps_mask(x1, top, _CMP_GT_OQ)) {
                const float mnew = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
                const __m512 va = _mm512_set1_ps(exp2f(m[r] - mnew));
                for (int d = 0; d < D; d += 16)
                    _mm512_store_ps(&o[r][d], _mm512_mul_ps(_mm512_load_ps(&o[r][d]), va));
                _mm512_store_ps(lv[r], _mm512_mul_ps(_mm512_load_ps(lv[r]), va));
                m[r] = mnew;
            }
            const __m512 vm = _mm512_set1_ps(m[r]);
            const __m512 e0 = _mm512_maskz_mov_ps(v0, exp2_ps(_mm512_sub_ps(x0, vm)));
            const __m512 e1 = _mm512_maskz_mov_ps(v1, exp2_ps(_mm512_sub_ps(x1, vm)));
            __m512 sum;
            if (bf16) {
#if defined(__AVX512BF16__)
                /* the sum uses the rounded probabilities that multiply V */
                const __m512bh pp = _mm512_cvtne2ps_pbh(e1, e0);
                _mm512_store_si512(pb[r], (__m512i)pp);
                const __m512i lo = _mm512_slli_epi32((__m512i)pp, 16);
                const __m512i hi = _mm512_and_si512((__m512i)pp, _mm512_set1_epi32((int)0xffff0000));
                sum = _mm512_add_ps(_mm512_castsi512_ps(lo), _mm512_castsi512_ps(hi));
#else
                sum = _mm512_setzero_ps();
#endif
            } else {
                _mm512_store_ps(p32[r], e0);
                _mm512_store_ps(p32[r] + 16, e1);
                sum = _mm512_add_ps(e0, e1);
            }
            _mm512_store_ps(lv[r], _mm512_add_ps(_mm512_load_ps(lv[r]), sum));
        }
        /* O += P V, a few rows at a time so their accumulators stay in registers */
#define RO (D <= 64 ? 6 : D <= 128 ? 3 : 1)
        for (int r0_ = 0; r0_ < ROWS; r0_ += RO) {
            const int rn = RO;  /* divides ROWS: a constant trip count keeps acc in registers */
            __m512 acc[6][MAX_D / 16];  /* fixed sizes: arrays sized by D would be VLAs on the stack */
            for (int r = 0; r < rn; r++)
                for (int c = 0; c < D / 16; c++) acc[r][c] = _mm512_load_ps(&o[r0_ + r][c * 16]);
            if (bf16) {
#if defined(__AVX512BF16__)
                const uint16_t *vb = (const uint16_t *)a->vp + (h * a->nkb + b) * blk_elems;
                for (int t = 0; t < (nk + 1) / 2; t++) {
                    __m512bh vv[MAX_D / 16];
                    for (int c = 0; c < D / 16; c++)
                        vv[c] = (__m512bh)_mm512_load_si512(vb + (t * D + c * 16) * 2);
                    for (int r = 0; r < rn; r++) {
                        const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pb[r0_ + r][t]);
                        for (int c = 0; c < D / 16; c++)
                            acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pp, vv[c]);
                    }
                }
#endif
            } else {
                const float *v = (const float *)a->v;
                const int64_t row = (int64_t)a->hkv * D;
                for (int t = 0; t < nk; t++) {
                    const float *vr = v + (key0 + t) * row + (int64_t)h * D;
                    __m512 vv[MAX_D / 16];
                    for (int c = 0; c < D / 16; c++) vv[c] = _mm512_loadu_ps(vr + c * 16);
                    for (int r = 0; r < rn; r++) {
                        const __m512 pp = _mm512_set1_ps(p32[r0_ + r][t]);
                        for (int c = 0; c < D / 16; c++)
                            acc[r][c] = _mm512_fmadd_ps(pp, vv[c], acc[r][c]);
                    }
                }
            }
            for (int r = 0; r < rn; r++)
                for (int c = 0; c < D / 16; c++) _mm512_store_ps(&o[r0_ + r][c * 16], acc[r][c]);
        }
#undef RO
    }
    /* O / l, into the output rows */
    for (int r = 0; r < nrows; r++) {
        const int rr = r0 + r, i = rr / G, g = rr % G;
        const int64_t off = ((int64_t)i * HQ + h * G + g) * D;
        const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_load_ps(lv[r]));
        if (a->out_bf16) {
            uint16_t *dst = (uint16_t *)a->out + off;
            for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(o[r][d] * inv);
        } else {
            float *dst = (float *)a->out + off;
            for (int d = 0; d < D; d++) dst[d] = o[r][d] * inv;
        }
    }
}

static void tile(const Args *a, int h, int r0, int nrows, int D, int bf16) {
    if (D == 64) {
        if (bf16) tile_impl(a, h, r0, nrows, 64, 1); else tile_impl(a, h, r0, nrows, 64, 0);
    } else if (D == 256) {
        if (bf16) tile_impl(a, h, r0, nrows, 256, 1); else tile_impl(a, h, r0, nrows, 256, 0);
    } else {
        if (bf16) tile_impl(a, h, r0, nrows, 128, 1); else tile_impl(a, h, r0, nrows, 128, 0);
    }
}
#endif

/* Whether this build runs the kernel for bf16 (1) or float32 (0) inputs of head_dim ``dim``. */
int prefill_attention_supported(int bf16, int dim) {
    (void)bf16;
    if (dim != 64 && dim != 128 && dim != 256) return 0;
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
    return 1;
#else
    return !bf16;
#endif
#else
    return 0;
#endif
}

/* Returns 0 on success; 1: unsupported (see prefill_attention_supported); 3: out of memory. */
int prefill_attention(void *out, const void *q, const void *k, const void *v, int bf16,
                      int out_bf16, int n, int num_past, int hkv, int group, int dim, float scale,
                      int window, int nthreads) {
    if (!prefill_attention_supported(bf16, dim)) return 1;
#if defined(__AVX512F__)
    const int64_t L = (int64_t)num_past + n, nkb = (L + KB - 1) / KB;
    const size_t esize = bf16 ? 2 : 4;
    const size_t bytes = (size_t)hkv * nkb * KB * dim * esize;
    void *kp = aligned_alloc(64, bytes);
    void *vp = bf16 ? aligned_alloc(64, bytes) : NULL;
    if (kp == NULL || (bf16 && vp == NULL)) { free(kp); free(vp); return 3; }
    Args a = {q, k, v, out, kp, vp, n, num_past, hkv, group, out_bf16, window, scale, nkb};
    const int rows = n * group, tiles = (rows + ROWS - 1) / ROWS, items = hkv * tiles;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int h = 0; h < hkv; h++) pack_head(&a, h, dim, bf16);
        /* later tiles see more keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
        for (int it = items - 1; it >= 0; it--) {
            const int h = it % hkv, t = it / hkv, r0 = t * ROWS;
            tile(&a, h, r0, rows - r0 < ROWS ? rows - r0 : ROWS, dim, bf16);
        }
    }
    free(kp); free(vp);
    return 0;
#else
    (void)out; (void)q; (void)k; (void)v; (void)out_bf16; (void)n; (void)num_past; (void)hkv;
    (void)group; (void)scale; (void)window; (void)nthreads;
    return 1;
#endif
}
