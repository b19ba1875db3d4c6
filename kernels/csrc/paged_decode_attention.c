/* Paged decode attention on CPU, reading KV blocks in place (no gather copy).
 *
 * kv:  [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]  (float32 or bfloat16),
 *      any strides with head_dim contiguous: sb, sl, skv, st, sh (in elements) step a block, a
 *      layer, keys to values, a token and a KV head (a KV-head-major pool is a permuted view)
 * q:   [B, num_kv_heads * group, head_dim] float32;  out: same shape
 * block_tables: [B, max_blocks] int64;  context_lens: [B] int64
 *
 * Work item = (sequence, kv head): all `group` query heads sharing a KV head are processed
 * together so every key/value row is read once. Softmax is online, rescaled once per block.
 * Threads split the work items; the kernel is memory-bound (each KV byte is read once).
 * window > 0: a sequence's query sees only its last `window` keys (a sliding-window layer): the
 * blocks before them are skipped and the keys before them in the first block masked.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_BS 128

typedef struct {
    float *out; const float *q; const void *kv; const int64_t *bt; const int64_t *lens;
    int is_bf16, max_blocks, layer; int64_t sb, sl, skv, st, sh; int bs, hkv, group, dim;
    float scale; int window, begin, end;
} Args;

static inline float load(const void *base, int64_t i, int is_bf16) {
    if (!is_bf16) return ((const float *)base)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
    float f; memcpy(&f, &bits, 4); return f;
}

/* Every 64-byte line of ``nbytes`` from ``p``, into L2 (prefetcht1), not L1: on a 2-vCPU Zen 4
 * prefetches into L1 hold the L1's few miss buffers that the current block's loads wait on, and
 * a 500-token, 32-sequence decode step's attention read 7.6 GB/s a thread that way, 10.7 into L2
 * (2 threads: 14.9 -> 20.5 GB/s). */
static inline void prefetch_row(const char *p, int nbytes) {
    for (int off = 0; off < nbytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

/* Prefetch head h's K and V rows of KV block `blk` (this layer): the next block of a sequence,
 * while the current one is computed. */
static inline void prefetch_block(const Args *a, int64_t blk, int h, int D, int esize) {
    const char *nk = (const char *)a->kv + (blk * a->sb + a->layer * a->sl + h * a->sh) * esize;
    for (int t = 0; t < a->bs; t++) {
        prefetch_row(nk + t * a->st * esize, D * esize);
        prefetch_row(nk + (a->skv + t * a->st) * esize, D * esize);
    }
}

/* One (sequence, kv head) item. Always inlined with constant D and is_bf16 (see item_d), so the
 * loops over D have a fixed trip count and the dtype test leaves the inner loops. */
static inline __attribute__((always_inline)) void item_impl(const Args *a, int item, const int D,
                                                            const int is_bf16) {
    const int G = a->group, H = a->hkv, BS = a->bs;
    const int esize = is_bf16 ? 2 : 4;
    const int64_t row = a->st, kv_part = a->skv;          /* next token; keys -> values */
    float kf[MAX_DIM], vf[MAX_DIM];
    {
        const int b = item / H, h = item % H;
        const int64_t n = a->lens[b];
        const int64_t lo = a->window > 0 && n > a->window ? n - a->window : 0;  /* first key */
        const float *qb = a->q + ((int64_t)b * H * G + (int64_t)h * G) * D;
        float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP][MAX_DIM], s[MAX_GROUP][MAX_BS];
        for (int g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.f; memset(acc[g], 0, D * 4); }
        for (int64_t start = lo / BS * BS; start < n; start += BS) {
            const int64_t blk = a->bt[(int64_t)b * a->max_blocks + start / BS];
            const int64_t kbase = blk * a->sb + a->layer * a->sl + h * a->sh;
            const int cnt = (int)((n - start) < BS ? (n - start) : BS);  /* partial last block */
            if (start + BS < n)  /* blocks are scattered: fetch the next one's rows early */
                prefetch_block(a, a->bt[(int64_t)b * a->max_blocks + start / BS + 1], h, D,
                               esize);
            for (int t = 0; t < cnt; t++) {
                for (int d = 0; d < D; d++) kf[d] = load(a->kv, kbase + t * row + d, is_bf16);
                for (int g = 0; g < G; g++) {
                    float dot = 0.f;
                    #pragma omp simd reduction(+:dot)
                    for (int d = 0; d < D; d++) dot += qb[g * D + d] * kf[d];
                    s[g][t] = dot * a->scale;
                }
            }
            for (int g = 0; g < G; g++)  /* keys before the window */
                for (int t = 0; t < lo - start; t++) s[g][t] = -INFINITY;
            for (int g = 0; g < G; g++) {
                float mx = m[g];
                for (int t = 0; t < cnt; t++) mx = s[g][t] > mx ? s[g][t] : mx;
                const float corr = expf(m[g] - mx);
                l[g] *= corr;
                for (int d = 0; d < D; d++) acc[g][d] *= corr;
                for (int t = 0; t < cnt; t++) { s[g][t] = expf(s[g][t] - mx); l[g] += s[g][t]; }
                m[g] = mx;
            }
            for (int t = 0; t < cnt; t++) {
                const int64_t vb = kbase + kv_part + t * row;
                for (int d = 0; d < D; d++) vf[d] = load(a->kv, vb + d, is_bf16);
                for (int g = 0; g < G; g++) {
                    const float w = s[g][t];
                    #pragma omp simd
                    for (int d = 0; d < D; d++) acc[g][d] += w * vf[d];
                }
            }
        }
        float *ob = a->out + ((int64_t)b * H * G + (int64_t)h * G) * D;
        for (int g = 0; g < G; g++)
            for (int d = 0; d < D; d++) ob[g * D + d] = acc[g][d] / l[g];
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
__m512 _ZGVeN16v_expf(__m512);  /* glibc's libmvec (linked with -lmvec) */

/* 16 elements of row `base + i` as float32 (bf16 widened by a shift). */
static inline __m512 load16(const void *kv, int64_t i, const int is_bf16) {
    if (is_bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)kv + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)kv + i);
}

/* r[i] = the sum of v[i]'s 16 elements, for 16 vectors: pairs interleaved and added within
 * 128-bit lanes (unpack ps, then pd), then the 4x4 matrix of lane sums transposed and added. */
static inline __m512 hsum16(const __m512 v[16]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++)  /* lane k: [v2i, v2i+1, v2i, v2i+1] partial sums */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int j = 0; j < 4; j++) {  /* lane k: partial sums of v4j .. v4j+3 over lane k */
        const __m512d p = _mm512_castps_pd(a[2 * j]), q = _mm512_castps_pd(a[2 * j + 1]);
        b[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
    }
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* item_impl for head_dim 64 and G query heads per KV head with AVX-512: the G queries and G
 * accumulators (4 vectors each) stay in registers for the whole sequence instead of being
 * reloaded from memory for every key and value row. A score's products are summed in another
 * order than item_impl's (16 keys per transposing sum); the test compares both paths with the
 * torch reference. */
static inline __attribute__((always_inline)) void item64(const Args *a, int item, const int G,
                                                         const int is_bf16) {
    const int H = a->hkv, BS = a->bs, D = 64;
    const int esize = is_bf16 ? 2 : 4;
    const int64_t row = a->st, kv_part = a->skv;
    const int b = item / H, h = item % H;
    const int64_t n = a->lens[b];
        const int64_t lo = a->window > 0 && n > a->window ? n - a->window : 0;  /* first key */
    const float *qb = a->q + ((int64_t)b * H * G + (int64_t)h * G) * D;
    __m512 q[4][4], acc[4][4];
    float m[4], l[4], s[4][MAX_BS];
    const __m512 scale = _mm512_set1_ps(a->scale);
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY; l[g] = 0.f;
        for (int j = 0; j < 4; j++) {
            q[g][j] = _mm512_loadu_ps(qb + g * D + 16 * j);
            acc[g][j] = _mm512_setzero_ps();
        }
    }
    for (int64_t start = lo / BS * BS; start < n; start += BS) {
        const int64_t blk = a->bt[(int64_t)b * a->max_blocks + start / BS];
        const int64_t kbase = blk * a->sb + a->layer * a->sl + h * a->sh;
        const int cnt = (int)((n - start) < BS ? (n - start) : BS);
        /* the next block's rows are fetched a row at a time, as this block's are used: a burst
         * of all of them at the block's start queues more misses than the core tracks */
        const char *nk = NULL;
        if (start + BS < n)
            nk = (const char *)a->kv + (a->bt[(int64_t)b * a->max_blocks + start / BS + 1] * a->sb
                                        + a->layer * a->sl + h * a->sh) * esize;
        /* scores 16 keys at a time: each key's products stay a vector, and one transposing
         * sum turns 16 of them into 16 scores (a horizontal sum per key cost ~3x the ops) */
        for (int t0 = 0; t0 < cnt; t0 += 16) {
            const int n16 = cnt - t0 < 16 ? cnt - t0 : 16;
            __m512 dv[4][16];
            for (int t = 0; t < 16; t++) {
                if (t >= n16) {
                    for (int g = 0; g < G; g++) dv[g][t] = _mm512_setzero_ps();
                    continue;
                }
                const int64_t kr = kbase + (t0 + t) * row;
                if (nk) prefetch_row(nk + (t0 + t) * row * esize, D * esize);
                const __m512 k0 = load16(a->kv, kr, is_bf16), k1 = load16(a->kv, kr + 16, is_bf16);
                const __m512 k2 = load16(a->kv, kr + 32, is_bf16);
                const __m512 k3 = load16(a->kv, kr + 48, is_bf16);
                for (int g = 0; g < G; g++) {
                    __m512 d0 = _mm512_mul_ps(q[g][0], k0), d1 = _mm512_mul_ps(q[g][1], k1);
                    d0 = _mm512_fmadd_ps(q[g][2], k2, d0);
                    d1 = _mm512_fmadd_ps(q[g][3], k3, d1);
                    dv[g][t] = _mm512_add_ps(d0, d1);
                }
            }
            for (int g = 0; g < G; g++)  /* s has room: t0 + 16 <= MAX_BS */
                _mm512_storeu_ps(&s[g][t0], _mm512_mul_ps(hsum16(dv[g]), scale));
        }
        for (int g = 0; g < G; g++)  /* keys before the window */
            for (int t = 0; t < lo - start; t++) s[g][t] = -INFINITY;
        for (int g = 0; g < G; g++) {
            float mx = m[g];
            float *sg = s[g];
            #pragma omp simd reduction(max:mx)
            for (int t = 0; t < cnt; t++) mx = sg[t] > mx ? sg[t] : mx;
            const float corr = expf(m[g] - mx);
            const __m512 c = _mm512_set1_ps(corr);
            for (int j = 0; j < 4; j++) acc[g][j] = _mm512_mul_ps(acc[g][j], c);
            /* the exponentials 16 at a time through libmvec's AVX-512 expf, called by name:
             * GCC vectorizes expf only under -ffinite-math-only, which this file cannot use
             * (the running maximum starts at -inf), and a scalar expf per score was most of a
             * bf16 decode step's attention time */
            const __m512 vmx = _mm512_set1_ps(mx);
            __m512 vsum = _mm512_setzero_ps();
            for (int t = 0; t < cnt; t += 16) {
                const __mmask16 k = cnt - t >= 16 ? (__mmask16)0xffff
                                                  : (__mmask16)((1u << (cnt - t)) - 1);
                const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(
                    _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, sg + t), vmx));
                _mm512_mask_storeu_ps(sg + t, k, e);
                vsum = _mm512_add_ps(vsum, e);  /* masked lanes are exp(-inf) = 0 */
            }
            l[g] = l[g] * corr + _mm512_reduce_add_ps(vsum);
            m[g] = mx;
        }
        for (int t = 0; t < cnt; t++) {
            const int64_t vr = kbase + kv_part + t * row;
            if (nk) prefetch_row(nk + (kv_part + t * row) * esize, D * esize);
            const __m512 v0 = load16(a->kv, vr, is_bf16), v1 = load16(a->kv, vr + 16, is_bf16);
            const __m512 v2 = load16(a->kv, vr + 32, is_bf16), v3 = load16(a->kv, vr + 48, is_bf16);
            for (int g = 0; g < G; g++) {
                const __m512 w = _mm512_set1_ps(s[g][t]);
                acc[g][0] = _mm512_fmadd_ps(w, v0, acc[g][0]);
                acc[g][1] = _mm512_fmadd_ps(w, v1, acc[g][1]);
                acc[g][2] = _mm512_fmadd_ps(w, v2, acc[g][2]);
                acc[g][3] = _mm512_fmadd_ps(w, v3, acc[g][3]);
            }
        }
    }
    float *ob = a->out + ((int64_t)b * H * G + (int64_t)h * G) * D;
    for (int g = 0; g < G; g++) {
        const __m512 inv = _mm512_set1_ps(1.f / l[g]);
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(ob + g * D + 16 * j, _mm512_mul_ps(acc[g][j], inv));
    }
}

static void item64_g(const Args *a, int item) {
    switch (a->group * 2 + a->is_bf16) {
    case 2: item64(a, item, 1, 0); break;
    case 3: item64(a, item, 1, 1); break;
    case 4: item64(a, item, 2, 0); break;
    case 5: item64(a, item, 2, 1); break;
    case 6: item64(a, item, 3, 0); break;
    case 7: item64(a, item, 3, 1); break;
    case 8: item64(a, item, 4, 0); break;
    default: item64(a, item, 4, 1); break;
    }
}
#define HAVE_ITEM64 1
#endif

static void item_d(const Args *a, int item) {
#ifdef HAVE_ITEM64
    if (a->dim == 64 && a->group <= 4) { item64_g(a, item); return; }
#endif
    if (a->dim == 64 && a->is_bf16) item_impl(a, item, 64, 1);
    else if (a->dim == 64) item_impl(a, item, 64, 0);
    else if (a->dim == 128 && a->is_bf16) item_impl(a, item, 128, 1);
    else if (a->dim == 128) item_impl(a, item, 128, 0);
    else item_impl(a, item, a->dim, a->is_bf16);
}

int paged_decode_attention(float *out, const float *q, const void *kv, int is_bf16,
                           const int64_t *block_tables, const int64_t *context_lens, int B,
                           int max_blocks, int layer, int64_t sb, int64_t sl, int64_t skv,
                           int64_t st, int64_t sh, int bs, int hkv, int group, int dim,
                           float scale, int window, int num_threads) {
    if (group > MAX_GROUP || dim > MAX_DIM || bs > MAX_BS) return -1;
    const int items = B * hkv;
    int nt = num_threads < 1 ? 1 : num_threads;
    if (nt > items) nt = items;
    const Args a = {out, q, kv, block_tables, context_lens, is_bf16, max_blocks, layer,
                    sb, sl, skv, st, sh, bs, hkv, group, dim, scale, window, 0, items};
    if (B >= 2 * nt) {
        /* sequences differ in length: hand them out one at a time, all KV heads of a sequence
         * to one thread in a row (in a block-major pool a block's K or V rows interleave the
         * heads: the next head's rows are then already in this core's cache) */
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < hkv; h++) item_d(&a, b * hkv + h);
    } else {  /* too few sequences to keep every thread busy: one (sequence, head) at a time */
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int i = 0; i < items; i++) item_d(&a, i);
    }
    return 0;
}
