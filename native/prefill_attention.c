/*
 * vmemkv._prefill_attention: causal attention of a step's prompt chunks on the CPU, float32 or
 * bfloat16 (float32 arithmetic), reading the KV cache in place.
 *
 * Each sequence brings num_queries new tokens after num_cached cached ones (their K/V already
 * written); query i sits at position num_cached + i and attends keys [0, num_cached + i]. PyTorch's
 * SDPA runs this one sequence per call, over a strided view whose consecutive keys sit a whole
 * model's token stride apart; at a 2,048-token chunk of SmolLM2-135M that was a fifth of the step.
 * Here every sequence of the step is one call, and its work items run on OpenMP threads with the
 * GIL released.
 *
 * A work item is one sequence, one KV head and a block of query tokens: the G = Hq / Hk query heads
 * that share the KV head stacked, ROWS rows in all (G x tokens), so each key row is read once for
 * all of them. The rows are the vector lanes: the queries are transposed once per item into
 * QT[d][row], the scores of KEYS keys computed as S[key][row] = sum_d K[key][d] QT[d][row]
 * (a key element broadcast against row vectors; keys read where they lie, no transpose), the
 * online softmax's maxima and sums are vectors over rows, and the output is accumulated transposed,
 * OT[d][row] += V[key][d] S[key][row]. Keys wholly after an item's last query are not read.
 *
 * Addressing as the decode routine (decode_attention.c): vmem (block_size 0) reads sequence b's
 * token t at k + index[b] * so + t * st; block tables at k + table[b][t / block_size] * so +
 * (t % block_size) * st: the A/B compares addressing, not two kernels.
 *
 * bfloat16 rows are read where they lie, each value widened as it is broadcast (exact: a bf16 is a
 * float's upper half), and the output rounded to bfloat16 once, as torch rounds an op's result.
 * Quantized K/V (kv_type int8 or fp8 e4m3, vmemkv/memory/quantized_rows.py) likewise: each byte
 * widened and multiplied by its group's scale as it is broadcast, the value dequantize gives, so the
 * result is the float32 routine's over the dequantized rows, bit for bit.
 *
 * Sums run in another order than SDPA's: results equal it up to float rounding. Compiled for
 * AVX-512 only (x86-64-v4: its 32 registers hold a key tile's 24 accumulators of 16 floats); the
 * same code for AVX2 spills and was 3x slower than SDPA (SmolLM2-135M, 8 x 256 tokens, 30 layers,
 * one thread: 2.9 s against 0.95; 0.12 with AVX-512), so elsewhere `prefill` refuses and the
 * caller runs SDPA (`wide_vectors()` says which).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp_nonpositive.h"
#include "fp8.h"

#define ROWS 96 /* query rows of a work item (G heads x tokens): six 16-float vectors */
#define VECS (ROWS / 16)
#define KEYS 64 /* keys per online-softmax step: their scores, KEYS x ROWS floats, stay in L1/L2 */
#define KEY_TILE 4 /* keys whose scores are summed at once (4 x VECS accumulators) */
#define DIM_TILE 4 /* output dims accumulated at once (4 x VECS accumulators) */

static inline __attribute__((always_inline)) v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void store16(float *p, v16f v) { memcpy(p, &v, sizeof v); }

typedef struct {
    const char *q, *k, *v; /* float32 or bfloat16 (bf) data */
    char *out;
    const int32_t *index; /* slot ids [B] (vmem) or block tables [B, *] (paged) */
    const int32_t *query_start, *num_queries, *num_cached; /* [B] each */
    int64_t index_stride_b, batch, num_q_heads, num_kv_heads, head_dim, block_size;
    int64_t q_st, q_sh, out_st, out_sh, k_so, k_st, k_sh, v_so, v_st, v_sh; /* element strides */
    float scale;
    int bf;      /* 1: q and out are bfloat16 (and k, v unless quantized) */
    int kv_type; /* KV_AS_Q, or KV_INT8 / KV_FP8: one byte a value, a float32 scale per `group` */
    const float *k_scale, *v_scale;                   /* [outer, tokens, Hk, D / group], or NULL */
    int64_t ks_so, ks_st, ks_sh, vs_so, vs_st, vs_sh; /* their strides, in floats */
    int64_t group;
} Args;

enum { KV_AS_Q = 0, KV_INT8 = 2, KV_FP8 = 3 }; /* the decode routine's codes for the quantized ones */

typedef struct {
    int64_t seq, head, first, count; /* kv head; query tokens [first, first + count) of the sequence */
} Work;

/* Element d of a row as float32: bf selects the row's type (a constant where inlined). */
static inline __attribute__((always_inline)) float elem(const void *row, int64_t d, const int bf) {
    return bf ? bf16_to_float(((const uint16_t *)row)[d]) : ((const float *)row)[d];
}

/* Element d of a K or V row, unscaled: of q's type (bf), or a quantized byte (kt, a constant where
 * inlined); the caller multiplies a quantized one by its group's scale. */
static inline __attribute__((always_inline)) float kv_elem(const void *row, int64_t d, const int bf, const int kt) {
    if (kt == KV_INT8) return (float)((const int8_t *)row)[d];
    if (kt == KV_FP8) return fp8_to_float(((const uint8_t *)row)[d]);
    return elem(row, d, bf);
}

/* Sequence b's token t of base (element strides so, st; es bytes an element). */
static inline const char *row_at(const Args *a, const char *base, int64_t b, int64_t t, int64_t so, int64_t st,
                                 int64_t es) {
    const int32_t *index = a->index + b * a->index_stride_b;
    if (a->block_size == 0) return base + ((int64_t)index[0] * so + t * st) * es;
    return base + ((int64_t)index[t / a->block_size] * so + (t % a->block_size) * st) * es;
}

/* scores[j][r] = sum_d keys[j][d] qt[d][r] for KEY_TILE keys; keys past n are the last one again
 * (their scores are masked). Quantized keys (kt): each value times its group's scale, scales[j][d /
 * group], as quantized_rows.dequantize gives it. */
static inline __attribute__((always_inline)) void key_tile_scores(const void *const *keys, const float *const *scales,
                                                                  int64_t group, const float *restrict qt, int64_t D,
                                                                  float *restrict scores, const int bf, const int kt) {
    v16f acc[KEY_TILE][VECS];
    for (int i = 0; i < KEY_TILE; i++)
        for (int c = 0; c < VECS; c++) acc[i][c] = (v16f){0};
    for (int64_t g0 = 0; g0 < D; g0 += group) {
        float ks[KEY_TILE];
        for (int i = 0; i < KEY_TILE; i++) ks[i] = kt != KV_AS_Q ? scales[i][g0 / group] : 1.f;
        for (int64_t d = g0; d < g0 + group; d++) {
            v16f qv[VECS];
            for (int c = 0; c < VECS; c++) qv[c] = load16(qt + d * ROWS + 16 * c);
            for (int i = 0; i < KEY_TILE; i++) {
                const float kd = kt != KV_AS_Q ? kv_elem(keys[i], d, bf, kt) * ks[i] : elem(keys[i], d, bf);
                for (int c = 0; c < VECS; c++) acc[i][c] += kd * qv[c];
            }
        }
    }
    for (int i = 0; i < KEY_TILE; i++)
        for (int c = 0; c < VECS; c++) store16(scores + i * ROWS + 16 * c, acc[i][c]);
}

/* ot[d][r] += sum_j values[j][d] p[j][r] for dims [d0, d0 + DIM_TILE) over n keys (one scale group:
 * group is a multiple of DIM_TILE) */
static inline __attribute__((always_inline)) void dim_tile_update(const void *const *values, const float *const *scales,
                                                                  int64_t group, const float *restrict p, int64_t n,
                                                                  int64_t d0, float *restrict ot, const int bf,
                                                                  const int kt) {
    v16f acc[DIM_TILE][VECS];
    const int64_t at = d0 / group; /* the dims' scale */
    for (int i = 0; i < DIM_TILE; i++)
        for (int c = 0; c < VECS; c++) acc[i][c] = load16(ot + (d0 + i) * ROWS + 16 * c);
    for (int64_t j = 0; j < n; j++) {
        v16f pv[VECS];
        for (int c = 0; c < VECS; c++) pv[c] = load16(p + j * ROWS + 16 * c);
        const float vs = kt != KV_AS_Q ? scales[j][at] : 1.f;
        for (int i = 0; i < DIM_TILE; i++) {
            const float vd = kt != KV_AS_Q ? kv_elem(values[j], d0 + i, bf, kt) * vs : elem(values[j], d0 + i, bf);
            for (int c = 0; c < VECS; c++) acc[i][c] += vd * pv[c];
        }
    }
    for (int i = 0; i < DIM_TILE; i++)
        for (int c = 0; c < VECS; c++) store16(ot + (d0 + i) * ROWS + 16 * c, acc[i][c]);
}

/* scratch: qt [D][ROWS], ot [D][ROWS], scores [KEYS][ROWS], then max, sum, pos [ROWS] each */
static inline __attribute__((always_inline)) void process_item_typed(const Args *a, const Work *w, float *scratch,
                                                                    const int bf, const int kt) {
    const int64_t es = bf ? 2 : 4, kes = kt != KV_AS_Q ? 1 : es; /* bytes a q / a K or V element */
    const int64_t D = a->head_dim, G = a->num_q_heads / a->num_kv_heads, n = w->count, rows = G * n;
    const int64_t cached = a->num_cached[w->seq], start = a->query_start[w->seq];
    float *qt = scratch, *ot = qt + D * ROWS, *scores = ot + D * ROWS, *row_max = scores + KEYS * ROWS;
    float *row_sum = row_max + ROWS, *pos = row_sum + ROWS; /* positions as floats: exact below 2^24 */
    memset(qt, 0, sizeof(float) * (size_t)(2 * D * ROWS));
    for (int64_t r = 0; r < ROWS; r++) { /* row r = g * n + i: query head head * G + g, token first + i */
        const int64_t g = r < rows ? r / n : 0, i = r < rows ? r % n : 0;
        row_max[r] = -INFINITY;
        row_sum[r] = 0.f;
        pos[r] = (float)(cached + w->first + i);
        if (r >= rows) continue; /* padding: computed (as token first) and never written */
        const char *src = a->q + ((start + w->first + i) * a->q_st + (w->head * G + g) * a->q_sh) * es;
        for (int64_t d = 0; d < D; d++) qt[d * ROWS + r] = elem(src, d, bf);
    }
    const int64_t end = cached + w->first + n; /* keys [0, end): up to the item's last query */
    const int64_t lowest = cached + w->first;  /* keys up to here are seen by every row */
    const void *keys[KEYS], *values[KEYS];
    const float *k_scales[KEYS] = {0}, *v_scales[KEYS] = {0}; /* quantized rows' */
    const int64_t group = kt != KV_AS_Q ? a->group : D;
    for (int64_t kb = 0; kb < end; kb += KEYS) {
        const int64_t nk = end - kb < KEYS ? end - kb : KEYS;
        for (int64_t j = 0; j < nk; j++) {
            keys[j] = row_at(a, a->k, w->seq, kb + j, a->k_so, a->k_st, kes) + w->head * a->k_sh * kes;
            values[j] = row_at(a, a->v, w->seq, kb + j, a->v_so, a->v_st, kes) + w->head * a->v_sh * kes;
            if (kt == KV_AS_Q) continue;
            k_scales[j] = (const float *)row_at(a, (const char *)a->k_scale, w->seq, kb + j, a->ks_so, a->ks_st, 4) +
                          w->head * a->ks_sh;
            v_scales[j] = (const float *)row_at(a, (const char *)a->v_scale, w->seq, kb + j, a->vs_so, a->vs_st, 4) +
                          w->head * a->vs_sh;
        }
        for (int64_t j = nk; j < KEYS; j++) keys[j] = keys[nk - 1], k_scales[j] = k_scales[nk - 1];
        for (int64_t j = 0; j < nk; j += KEY_TILE)
            key_tile_scores(keys + j, k_scales + j, group, qt, D, scores + j * ROWS, bf, kt);
        /* scale, mask keys after a row's position, and the running maxima */
        const int masked = kb + nk - 1 > lowest;
        const v16f minus_inf = (v16f){0} - INFINITY;
        v16f new_max[VECS], alpha[VECS];
        for (int c = 0; c < VECS; c++) new_max[c] = load16(row_max + 16 * c);
        for (int64_t j = 0; j < nk; j++) {
            const float key_pos = (float)(kb + j);
            for (int c = 0; c < VECS; c++) {
                v16f s = load16(scores + j * ROWS + 16 * c) * a->scale;
                if (masked) s = select16(load16(pos + 16 * c) >= key_pos, s, minus_inf);
                store16(scores + j * ROWS + 16 * c, s);
                new_max[c] = select16(s > new_max[c], s, new_max[c]);
            }
        }
        /* p = exp(s - max) (0 where masked), rescale what was summed before by exp(old - new) */
        for (int c = 0; c < VECS; c++) { /* first block: old is -inf, and what it scales is 0 */
            alpha[c] = exp16(load16(row_max + 16 * c) - new_max[c]);
            store16(row_max + 16 * c, new_max[c]);
        }
        v16f sum[VECS];
        for (int c = 0; c < VECS; c++) sum[c] = load16(row_sum + 16 * c) * alpha[c];
        for (int64_t j = 0; j < nk; j++)
            for (int c = 0; c < VECS; c++) {
                const v16f s = load16(scores + j * ROWS + 16 * c);
                const v16f p = select16(s == minus_inf, (v16f){0}, exp16(s - new_max[c]));
                sum[c] += p;
                store16(scores + j * ROWS + 16 * c, p);
            }
        for (int c = 0; c < VECS; c++) store16(row_sum + 16 * c, sum[c]);
        if (kb > 0)
            for (int64_t d = 0; d < D; d++)
                for (int c = 0; c < VECS; c++) store16(ot + d * ROWS + 16 * c, load16(ot + d * ROWS + 16 * c) * alpha[c]);
        for (int64_t d0 = 0; d0 < D; d0 += DIM_TILE) dim_tile_update(values, v_scales, group, scores, nk, d0, ot, bf, kt);
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t g = r / n, i = r % n;
        char *dst = a->out + ((start + w->first + i) * a->out_st + (w->head * G + g) * a->out_sh) * es;
        const float inv = 1.f / row_sum[r];
        for (int64_t d = 0; d < D; d++) {
            const float o = ot[d * ROWS + r] * inv;
            if (bf)
                ((uint16_t *)dst)[d] = float_to_bf16(o);
            else
                ((float *)dst)[d] = o;
        }
    }
}

/* process_item_typed with the row types as constants: float32 loads stay plain loads */
static inline __attribute__((always_inline)) void process_item_kv(const Args *a, const Work *w, float *scratch,
                                                                 const int bf) {
    switch (a->kv_type) {
    case KV_INT8: process_item_typed(a, w, scratch, bf, KV_INT8); break;
    case KV_FP8: process_item_typed(a, w, scratch, bf, KV_FP8); break;
    default: process_item_typed(a, w, scratch, bf, KV_AS_Q);
    }
}

__attribute__((target("arch=x86-64-v4"))) static void process_item(const Args *a, const Work *w, float *scratch) {
    if (a->bf)
        process_item_kv(a, w, scratch, 1);
    else
        process_item_kv(a, w, scratch, 0);
}

static int run(const Args *a, int num_threads) {
    const int64_t G = a->num_q_heads / a->num_kv_heads, per_item = ROWS / G;
    int64_t items = 0;
    for (int64_t b = 0; b < a->batch; b++) items += a->num_kv_heads * ((a->num_queries[b] + per_item - 1) / per_item);
    Work *work = malloc(sizeof(Work) * (size_t)(items ? items : 1));
    if (!work) return -1;
    /* items in sequence and token order; they run from the last (see below) */
    int64_t at = 0;
    for (int64_t b = 0; b < a->batch; b++)
        for (int64_t first = 0; first < a->num_queries[b]; first += per_item)
            for (int64_t h = 0; h < a->num_kv_heads; h++) {
                const int64_t left = a->num_queries[b] - first;
                work[at++] = (Work){b, h, first, left < per_item ? left : per_item};
            }
    const size_t scratch_floats = (size_t)((2 * a->head_dim + KEYS + 3) * ROWS);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && items > 1)
    {
        float *scratch = aligned_alloc(64, sizeof(float) * scratch_floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = items - 1; item >= 0; item--) /* later tokens see more keys: start there */
            if (scratch) process_item(a, &work[item], scratch);
        free(scratch);
    }
    free(work);
    return failed ? -1 : 0;
}

static int wide_vectors_here; /* AVX-512: set at import */

static PyObject *prefill(PyObject *self, PyObject *args) {
    unsigned long long q, out, k, v, index, query_start, num_queries, num_cached, k_scale = 0, v_scale = 0;
    Args a = {0};
    double scale;
    int num_threads;
    if (!PyArg_ParseTuple(args, "KKKKKKKK" "LLLLLL" "LLLLLLLLLL" "dip" "|iKKLLLLLLL", &q, &out, &k, &v, &index,
                          &query_start, &num_queries, &num_cached, &a.index_stride_b, &a.batch, &a.num_q_heads,
                          &a.num_kv_heads, &a.head_dim, &a.block_size, &a.q_st, &a.q_sh, &a.out_st, &a.out_sh,
                          &a.k_so, &a.k_st, &a.k_sh, &a.v_so, &a.v_st, &a.v_sh, &scale, &num_threads, &a.bf,
                          &a.kv_type, &k_scale, &v_scale, &a.ks_so, &a.ks_st, &a.ks_sh, &a.vs_so, &a.vs_st,
                          &a.vs_sh, &a.group))
        return NULL;
    if (a.num_kv_heads <= 0 || a.num_q_heads % a.num_kv_heads || a.num_q_heads / a.num_kv_heads > ROWS ||
        a.head_dim <= 0 || a.head_dim % DIM_TILE || a.batch < 0 || a.block_size < 0) {
        PyErr_Format(PyExc_ValueError, "bad shapes: query heads a multiple of the KV heads, at most %d per KV "
                     "head; head_dim a multiple of %d; block_size >= 0", ROWS, DIM_TILE);
        return NULL;
    }
    if (a.kv_type != KV_AS_Q && ((a.kv_type != KV_INT8 && a.kv_type != KV_FP8) || !k_scale || !v_scale ||
                                 a.group <= 0 || a.group % DIM_TILE || a.head_dim % a.group)) {
        PyErr_Format(PyExc_ValueError, "quantized K/V: kv_type %d or %d with both scale views and a group that "
                     "divides head_dim and is a multiple of %d", KV_INT8, KV_FP8, DIM_TILE);
        return NULL;
    }
    a.k_scale = (const float *)(uintptr_t)k_scale;
    a.v_scale = (const float *)(uintptr_t)v_scale;
    if (!wide_vectors_here) {
        PyErr_SetString(PyExc_ValueError, "the native prefill attention needs AVX-512, which this CPU lacks");
        return NULL;
    }
    a.q = (const char *)(uintptr_t)q;
    a.out = (char *)(uintptr_t)out;
    a.k = (const char *)(uintptr_t)k;
    a.v = (const char *)(uintptr_t)v;
    a.index = (const int32_t *)(uintptr_t)index;
    a.query_start = (const int32_t *)(uintptr_t)query_start;
    a.num_queries = (const int32_t *)(uintptr_t)num_queries;
    a.num_cached = (const int32_t *)(uintptr_t)num_cached;
    a.scale = (float)scale;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = run(&a, num_threads < 1 ? 1 : num_threads);
    Py_END_ALLOW_THREADS if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(prefill_doc,
             "prefill(q, out, k, v, index, query_start, num_queries, num_cached, index_stride_b, batch,\n"
             "        num_q_heads, num_kv_heads, head_dim, block_size, q_st, q_sh, out_st, out_sh,\n"
             "        k_so, k_st, k_sh, v_so, v_st, v_sh, scale, num_threads, bfloat16[, kv_type, k_scale,\n"
             "        v_scale, ks_so, ks_st, ks_sh, vs_so, vs_st, vs_sh, group])\n\n"
             "Raw data pointers (float32 data, or bfloat16 where bfloat16 is true; K/V int8 or fp8 e4m3\n"
             "with float32 scale views for kv_type 2 or 3; int32 indices) and element strides; checked by\n"
             "vmemkv.attention.cpu_prefill, not here.");

static PyObject *wide_vectors(PyObject *self, PyObject *unused) { return PyBool_FromLong(wide_vectors_here); }

static PyMethodDef methods[] = {
    {"prefill", prefill, METH_VARARGS, prefill_doc},
    {"wide_vectors", wide_vectors, METH_NOARGS, "Whether this CPU has AVX-512, which `prefill` needs."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_prefill_attention",
                                    "CPU causal attention of prompt chunks over slot views and block tables.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__prefill_attention(void) {
    __builtin_cpu_init();
    wide_vectors_here = __builtin_cpu_supports("avx512f");
    return PyModule_Create(&module);
}
