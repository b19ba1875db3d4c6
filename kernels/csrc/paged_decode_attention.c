/* Paged decode attention on CPU, reading KV blocks in place (no gather copy).
 *
 * kv:  [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]  (float32 or bfloat16)
 * q:   [B, num_kv_heads * group, head_dim] float32;  out: same shape
 * block_tables: [B, max_blocks] int64;  context_lens: [B] int64
 *
 * Work item = (sequence, kv head): all `group` query heads sharing a KV head are processed
 * together so every key/value row is read once. Softmax is online, rescaled once per block.
 * Threads split the work items; the kernel is memory-bound (each KV byte is read once).
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
    int is_bf16, max_blocks, layer, num_layers, bs, hkv, group, dim; float scale;
    int begin, end;
} Args;

static inline float load(const void *base, int64_t i, int is_bf16) {
    if (!is_bf16) return ((const float *)base)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
    float f; memcpy(&f, &bits, 4); return f;
}

/* One (sequence, kv head) item. Always inlined with constant D and is_bf16 (see item_d), so the
 * loops over D have a fixed trip count and the dtype test leaves the inner loops. */
static inline __attribute__((always_inline)) void item_impl(const Args *a, int item, const int D,
                                                            const int is_bf16) {
    const int G = a->group, H = a->hkv, BS = a->bs;
    const int esize = is_bf16 ? 2 : 4;
    const int64_t row = (int64_t)H * D;                   /* one token's K (or V) */
    const int64_t kv_part = (int64_t)BS * row;            /* one block's K (or V) of one layer */
    const int64_t block = (int64_t)a->num_layers * 2 * kv_part;
    float kf[MAX_DIM], vf[MAX_DIM];
    {
        const int b = item / H, h = item % H;
        const int64_t n = a->lens[b];
        const float *qb = a->q + ((int64_t)b * H * G + (int64_t)h * G) * D;
        float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP][MAX_DIM], s[MAX_GROUP][MAX_BS];
        for (int g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.f; memset(acc[g], 0, D * 4); }
        for (int64_t start = 0; start < n; start += BS) {
            const int64_t blk = a->bt[(int64_t)b * a->max_blocks + start / BS];
            const int64_t kbase = blk * block + (int64_t)a->layer * 2 * kv_part + h * D;
            const int cnt = (int)((n - start) < BS ? (n - start) : BS);  /* partial last block */
            if (start + BS < n) {  /* blocks are scattered: fetch the next one's rows early */
                const int64_t nblk = a->bt[(int64_t)b * a->max_blocks + start / BS + 1];
                const char *nk = (const char *)a->kv
                    + (nblk * block + (int64_t)a->layer * 2 * kv_part + h * D) * esize;
                for (int t = 0; t < BS; t++)
                    for (int off = 0; off < D * esize; off += 64) {
                        __builtin_prefetch(nk + t * row * esize + off);
                        __builtin_prefetch(nk + (kv_part + t * row) * esize + off);
                    }
            }
            for (int t = 0; t < cnt; t++) {
                for (int d = 0; d < D; d++) kf[d] = load(a->kv, kbase + t * row + d, is_bf16);
                for (int g = 0; g < G; g++) {
                    float dot = 0.f;
                    #pragma omp simd reduction(+:dot)
                    for (int d = 0; d < D; d++) dot += qb[g * D + d] * kf[d];
                    s[g][t] = dot * a->scale;
                }
            }
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

static void item_d(const Args *a, int item) {
    if (a->dim == 64 && a->is_bf16) item_impl(a, item, 64, 1);
    else if (a->dim == 64) item_impl(a, item, 64, 0);
    else if (a->dim == 128 && a->is_bf16) item_impl(a, item, 128, 1);
    else if (a->dim == 128) item_impl(a, item, 128, 0);
    else item_impl(a, item, a->dim, a->is_bf16);
}

int paged_decode_attention(float *out, const float *q, const void *kv, int is_bf16,
                           const int64_t *block_tables, const int64_t *context_lens, int B,
                           int max_blocks, int layer, int num_layers, int bs, int hkv, int group,
                           int dim, float scale, int num_threads) {
    if (group > MAX_GROUP || dim > MAX_DIM || bs > MAX_BS) return -1;
    const int items = B * hkv;
    int nt = num_threads < 1 ? 1 : num_threads;
    if (nt > items) nt = items;
    const Args a = {out, q, kv, block_tables, context_lens, is_bf16, max_blocks, layer,
                    num_layers, bs, hkv, group, dim, scale, 0, items};
    /* sequences differ in length: hand items out one at a time */
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int i = 0; i < items; i++) item_d(&a, i);
    return 0;
}
