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

static void *work(void *p) {
    const Args *a = (const Args *)p;
    const int D = a->dim, G = a->group, H = a->hkv, BS = a->bs;
    const int64_t row = (int64_t)H * D;                   /* one token's K (or V) */
    const int64_t kv_part = (int64_t)BS * row;            /* one block's K (or V) of one layer */
    const int64_t block = (int64_t)a->num_layers * 2 * kv_part;
    float kf[MAX_DIM], vf[MAX_DIM];
    for (int item = a->begin; item < a->end; item++) {
        const int b = item / H, h = item % H;
        const int64_t n = a->lens[b];
        const float *qb = a->q + ((int64_t)b * H * G + (int64_t)h * G) * D;
        float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP][MAX_DIM], s[MAX_GROUP][MAX_BS];
        for (int g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.f; memset(acc[g], 0, D * 4); }
        for (int64_t start = 0; start < n; start += BS) {
            const int64_t blk = a->bt[(int64_t)b * a->max_blocks + start / BS];
            const int64_t kbase = blk * block + (int64_t)a->layer * 2 * kv_part + h * D;
            const int cnt = (int)((n - start) < BS ? (n - start) : BS);  /* partial last block */
            for (int t = 0; t < cnt; t++) {
                for (int d = 0; d < D; d++) kf[d] = load(a->kv, kbase + t * row + d, a->is_bf16);
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
                for (int d = 0; d < D; d++) vf[d] = load(a->kv, vb + d, a->is_bf16);
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
    return NULL;
}

int paged_decode_attention(float *out, const float *q, const void *kv, int is_bf16,
                           const int64_t *block_tables, const int64_t *context_lens, int B,
                           int max_blocks, int layer, int num_layers, int bs, int hkv, int group,
                           int dim, float scale, int num_threads) {
    if (group > MAX_GROUP || dim > MAX_DIM || bs > MAX_BS) return -1;
    const int items = B * hkv;
    int nt = num_threads < 1 ? 1 : num_threads;
    if (nt > items) nt = items;
#pragma omp parallel num_threads(nt)
    {
        const int i = omp_get_thread_num(), n = omp_get_num_threads();
        Args a = {out, q, kv, block_tables, context_lens, is_bf16, max_blocks, layer, num_layers,
                  bs, hkv, group, dim, scale, (int)((int64_t)items * i / n),
                  (int)((int64_t)items * (i + 1) / n)};
        work(&a);
    }
    return 0;
}
