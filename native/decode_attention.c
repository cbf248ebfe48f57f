/*
 * vmemkv._decode_attention: decode attention on the CPU, reading the KV cache in place.
 *
 * One query token per sequence, grouped heads (GQA), online softmax over tiles of TILE keys with
 * float32 accumulation, an optional split of each sequence's keys (flash-decoding) combined at the
 * end. It is the CPU twin of the Triton kernel in vmemkv/attention/triton_decode.py, and like it
 * differs between the two KV addressings only in where a key's row is:
 *
 *   vmem (contiguous):  k + index[b] * stride_outer + t * stride_token + h * stride_head
 *   paged (block table): k + table[b][t / block_size] * stride_outer + (t % block_size) * stride_token + ...
 *
 * so the A/B harness compares addressing, not two kernels. Each K row is read once per tile and
 * used by every query head of its group; the keys of a (sequence, kv head) are walked in position
 * order, so a slot view's token-major rows stream through the cache line by line.
 *
 * Only positions [start, seq_len) are read (start = seq_len - window for a sliding window), so an
 * unmapped page past a sequence's end, or released behind its window, is never touched. Offsets are
 * int64: the token-major layout's slot strides pass 2^31 elements.
 *
 * Types: float32 and bfloat16 K/V/Q/out (bf16 rows are widened to float32 into a row buffer).
 * The work items, (sequence, kv head, split), run on OpenMP threads with the GIL released.
 * process_item is compiled twice (target_clones): for AVX2+FMA (x86-64-v3) and for the baseline,
 * chosen at load time by the CPU it runs on.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define TILE 64 /* keys per online-softmax step: their scores stay in L1 */

enum { DT_FLOAT32 = 0, DT_BFLOAT16 = 1 };

typedef struct {
    const char *q, *k, *v, *sinks;
    char *out;
    const int32_t *index; /* slot ids [B] (vmem) or block tables [B, *] (paged) */
    const int32_t *seq_lens;
    int64_t index_stride_b;
    int64_t batch, num_q_heads, num_kv_heads, head_dim, block_size; /* block_size 0: vmem */
    int64_t q_sb, q_sh, out_sb, out_sh;                              /* strides, in elements */
    int64_t k_so, k_st, k_sh, v_so, v_st, v_sh;
    float scale, softcap;
    int64_t window; /* 0: none */
    int dtype, num_splits;
    float *partial; /* [B, Hq, S, D] and [B, Hq, S] when num_splits > 1 */
    float *lse;
} Args;

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &wide, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline size_t elem_size(int dtype) { return dtype == DT_FLOAT32 ? 4 : 2; }

/* A row of head_dim values as float32: the row itself (float32) or widened into buf (bf16). */
static inline __attribute__((always_inline)) const float *row_f32(const char *p, int dtype, int64_t n,
                                                                 float *buf) {
    if (dtype == DT_FLOAT32) return (const float *)p;
    const uint16_t *h = (const uint16_t *)p;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) buf[i] = bf16_to_float(h[i]);
    return buf;
}

static inline __attribute__((always_inline)) float dot(const float *restrict a, const float *restrict b,
                                                       int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline __attribute__((always_inline)) void axpy(float *restrict y, float a, const float *restrict x,
                                                       int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* Byte offset of token t's row (kv head 0) for sequence b, in a cache with these strides. */
static inline int64_t row_offset(const Args *a, int64_t b, int64_t t, int64_t so, int64_t st) {
    const int32_t *index = a->index + b * a->index_stride_b;
    if (a->block_size == 0) return ((int64_t)index[0] * so + t * st);
    return (int64_t)index[t / a->block_size] * so + (t % a->block_size) * st;
}

static void write_out(const Args *a, int64_t b, int64_t h, const float *acc) {
    int64_t D = a->head_dim;
    char *dst = a->out + (b * a->out_sb + h * a->out_sh) * (int64_t)elem_size(a->dtype);
    if (a->dtype == DT_FLOAT32) {
        memcpy(dst, acc, (size_t)D * 4);
    } else {
        uint16_t *o = (uint16_t *)dst;
        for (int64_t i = 0; i < D; i++) o[i] = float_to_bf16(acc[i]);
    }
}

static inline float sink_of(const Args *a, int64_t h) { return ((const float *)a->sinks)[h]; }

/* One (sequence b, kv head hk, split s): its query heads' softmax over keys [lo, hi).
 * scratch: G*D (q) + G*D (acc) + G*TILE (scores) + 2*G (max, sum) + 2*D (row buffers) floats. */
__attribute__((target_clones("arch=x86-64-v3", "default"))) static void process_item(const Args *a, int64_t item,
                                                                                   float *scratch) {
    const int64_t D = a->head_dim, Hk = a->num_kv_heads, G = a->num_q_heads / Hk, S = a->num_splits;
    const int64_t b = item / (Hk * S), hk = (item / S) % Hk, s = item % S;
    const size_t es = elem_size(a->dtype);
    float *q = scratch, *acc = q + G * D, *sc = acc + G * D, *mx = sc + G * TILE, *sum = mx + G;
    float *kbuf = sum + G, *vbuf = kbuf + D;

    int64_t len = a->seq_lens[b];
    int64_t start = (a->window > 0 && len > a->window) ? len - a->window : 0;
    int64_t per = (len - start + S - 1) / S;
    int64_t lo = start + s * per, hi = lo + per < len ? lo + per : len;

    for (int64_t g = 0; g < G; g++) {
        const char *qp = a->q + (b * a->q_sb + (hk * G + g) * a->q_sh) * (int64_t)es;
        const float *qf = row_f32(qp, a->dtype, D, kbuf);
        for (int64_t i = 0; i < D; i++) q[g * D + i] = qf[i] * a->scale;
        memset(acc + g * D, 0, (size_t)D * 4);
        mx[g] = -INFINITY;
        sum[g] = 0.f;
    }
    const char *k_head = a->k + hk * a->k_sh * (int64_t)es, *v_head = a->v + hk * a->v_sh * (int64_t)es;
    for (int64_t t0 = lo; t0 < hi; t0 += TILE) {
        int64_t n = hi - t0 < TILE ? hi - t0 : TILE;
        for (int64_t j = 0; j < n; j++) {
            const float *kr = row_f32(k_head + row_offset(a, b, t0 + j, a->k_so, a->k_st) * (int64_t)es,
                                      a->dtype, D, kbuf);
            for (int64_t g = 0; g < G; g++) sc[g * TILE + j] = dot(q + g * D, kr, D);
        }
        for (int64_t g = 0; g < G; g++) {
            float *row = sc + g * TILE, m = mx[g];
            if (a->softcap > 0.f)
                for (int64_t j = 0; j < n; j++) row[j] = a->softcap * tanhf(row[j] / a->softcap);
            for (int64_t j = 0; j < n; j++) m = row[j] > m ? row[j] : m;
            float alpha = expf(mx[g] - m), total = 0.f; /* exp(-inf) = 0 on the first tile */
            for (int64_t j = 0; j < n; j++) {
                row[j] = expf(row[j] - m);
                total += row[j];
            }
            if (alpha != 1.f)
                for (int64_t i = 0; i < D; i++) acc[g * D + i] *= alpha;
            sum[g] = sum[g] * alpha + total;
            mx[g] = m;
        }
        for (int64_t j = 0; j < n; j++) {
            const float *vr = row_f32(v_head + row_offset(a, b, t0 + j, a->v_so, a->v_st) * (int64_t)es,
                                      a->dtype, D, vbuf);
            for (int64_t g = 0; g < G; g++) axpy(acc + g * D, sc[g * TILE + j], vr, D);
        }
    }
    for (int64_t g = 0; g < G; g++) {
        int64_t h = hk * G + g;
        float *o = acc + g * D;
        if (S > 1) { /* partial output, normalized, and its log-sum-exp: combined below */
            int64_t at = (b * a->num_q_heads + h) * S + s;
            float inv = sum[g] > 0.f ? 1.f / sum[g] : 0.f;
            for (int64_t i = 0; i < D; i++) a->partial[at * D + i] = o[i] * inv;
            a->lse[at] = sum[g] > 0.f ? mx[g] + logf(sum[g]) : -INFINITY;
            continue;
        }
        float total = sum[g];
        if (a->sinks) total += expf(sink_of(a, h) - mx[g]); /* exp(-inf) when nothing was read */
        float inv = total > 0.f && sum[g] > 0.f ? 1.f / total : 0.f;
        for (int64_t i = 0; i < D; i++) o[i] *= inv;
        write_out(a, b, h, o);
    }
}

/* The splits of (sequence b, query head h), weighted by their exp(lse), into out. */
static void combine(const Args *a, int64_t bh, float *buf) {
    const int64_t D = a->head_dim, S = a->num_splits, h = bh % a->num_q_heads, b = bh / a->num_q_heads;
    const float *lse = a->lse + bh * S, *part = a->partial + bh * S * D;
    float m = -INFINITY, total = 0.f;
    for (int64_t s = 0; s < S; s++) m = lse[s] > m ? lse[s] : m;
    memset(buf, 0, (size_t)D * 4);
    if (m > -INFINITY) {
        for (int64_t s = 0; s < S; s++) {
            float w = expf(lse[s] - m);
            total += w;
            for (int64_t i = 0; i < D; i++) buf[i] += w * part[s * D + i];
        }
        if (a->sinks) total += expf(sink_of(a, h) - m);
        for (int64_t i = 0; i < D; i++) buf[i] /= total;
    }
    write_out(a, b, h, buf);
}

static int run(Args *a, int num_threads) {
    const int64_t G = a->num_q_heads / a->num_kv_heads, D = a->head_dim;
    const int64_t items = a->batch * a->num_kv_heads * a->num_splits;
    const size_t scratch_floats = (size_t)(2 * G * D + G * TILE + 2 * G + 2 * D);
    if (a->num_splits > 1) {
        a->partial = malloc(sizeof(float) * (size_t)(a->batch * a->num_q_heads * a->num_splits * D));
        a->lse = malloc(sizeof(float) * (size_t)(a->batch * a->num_q_heads * a->num_splits));
        if (!a->partial || !a->lse) return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && items > 1)
    {
        float *scratch = malloc(sizeof(float) * scratch_floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++)
            if (scratch) process_item(a, item, scratch);
        if (a->num_splits > 1) {
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < a->batch * a->num_q_heads; bh++)
                if (scratch) combine(a, bh, scratch);
        }
        free(scratch);
    }
    free(a->partial);
    free(a->lse);
    return failed ? -1 : 0;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    unsigned long long q, out, k, v, index, seq_lens, sinks;
    Args a = {0};
    double scale, softcap;
    int num_threads;
    if (!PyArg_ParseTuple(args, "KKKKKKK" "LLLLLLLLLLLLLLLL" "dLdiii", &q, &out, &k, &v, &index, &seq_lens, &sinks,
                          &a.index_stride_b, &a.batch, &a.num_q_heads, &a.num_kv_heads, &a.head_dim,
                          &a.block_size, &a.q_sb, &a.q_sh, &a.out_sb, &a.out_sh, &a.k_so, &a.k_st, &a.k_sh,
                          &a.v_so, &a.v_st, &a.v_sh, &scale, &a.window, &softcap, &a.dtype, &a.num_splits,
                          &num_threads))
        return NULL;
    if (a.dtype != DT_FLOAT32 && a.dtype != DT_BFLOAT16) {
        PyErr_Format(PyExc_ValueError, "dtype code %d is not float32 (0) or bfloat16 (1)", a.dtype);
        return NULL;
    }
    if (a.num_kv_heads <= 0 || a.num_q_heads % a.num_kv_heads || a.head_dim <= 0 || a.num_splits < 1 ||
        a.batch < 0 || a.block_size < 0) {
        PyErr_SetString(PyExc_ValueError, "bad shapes: heads, head_dim, splits or block_size");
        return NULL;
    }
    a.q = (const char *)(uintptr_t)q;
    a.out = (char *)(uintptr_t)out;
    a.k = (const char *)(uintptr_t)k;
    a.v = (const char *)(uintptr_t)v;
    a.index = (const int32_t *)(uintptr_t)index;
    a.seq_lens = (const int32_t *)(uintptr_t)seq_lens;
    a.sinks = (const char *)(uintptr_t)sinks; /* float32 [Hq], or NULL */
    a.scale = (float)scale;
    a.softcap = (float)softcap;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = run(&a, num_threads < 1 ? 1 : num_threads);
    Py_END_ALLOW_THREADS if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *has_openmp(PyObject *self, PyObject *unused) {
#ifdef _OPENMP
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

PyDoc_STRVAR(decode_doc,
             "decode(q, out, k, v, index, seq_lens, sinks, index_stride_b, batch, num_q_heads, num_kv_heads,\n"
             "       head_dim, block_size, q_sb, q_sh, out_sb, out_sh, k_so, k_st, k_sh, v_so, v_st, v_sh,\n"
             "       scale, window, softcap, dtype, num_splits, num_threads)\n\n"
             "Raw data pointers and element strides; checked by vmemkv.attention.cpu_decode, not here.");

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, decode_doc},
    {"has_openmp", has_openmp, METH_NOARGS, "Whether this build runs work items on OpenMP threads."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_decode_attention",
                                    "CPU decode attention over slot views and block tables.", -1, methods};

PyMODINIT_FUNC PyInit__decode_attention(void) { return PyModule_Create(&module); }
