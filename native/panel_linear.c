/*
 * vmemkv._panel_linear: y = x W^T + b on the CPU, float32 (and bfloat16 with AVX-512 BF16, at the
 * end), over a weight packed in panels.
 *
 * A decode step multiplies a few rows by every weight of the model: the GEMM streams the weight
 * from memory once and does little arithmetic per byte, so its speed is how close the read comes to
 * the memory bandwidth. The weight is packed once into panels of 16 outputs, [ceil(N / 16)][K][16]
 * (N padded with zero rows): the whole weight is one sequential stream, 64 bytes (one cache line,
 * one 16-float vector) per input feature per panel, prefetched ahead of the read. Each row of x is
 * broadcast one feature at a time and multiplied into a panel's 16 accumulators; two panels are
 * walked together (two streams, twice the independent sums in flight), eight rows at a time with
 * AVX-512, else four (their accumulators in registers). More rows read the panels again, from
 * L1/L2: then the kernel is compute-bound, as any GEMM with many rows. That second pass over a
 * pair prefetches the next pair (the thread's next, the pairs split statically), so that memory
 * keeps streaming while it computes and the next first pass finds its panels in cache: at 16 rows,
 * SmolLM2-135M's linears of a decode step took 30.6 ms against 37.6 at one thread (AMD EPYC, Zen 5).
 *
 * Each output is summed in input-feature order, one chain (another order than oneDNN's or
 * F.linear's: results equal up to float rounding). Pairs of panels run on OpenMP threads with the
 * GIL released. The kernel is compiled three times: for AVX-512 (one register per panel row, 8
 * rows at a time), and (target_clones, 4 rows at a time) for AVX2+FMA (two) and the baseline,
 * chosen at load time by the CPU it runs on.
 *
 * The prefetch hint is the CPU's to choose, at run time (prefetch_hint): non-temporal (NTA) keeps
 * the stream out of the caches the other data lives in, and was the faster on an AMD EPYC (Zen 4);
 * on an Intel Xeon (AVX-512) NTA lines are not kept in L2, so the second 8-row pass over a panel
 * reads memory again, and T0 (into every level) is 2x faster at 16 rows. The engine times both.
 * Each hint is its own copy of the loops (the hint a constant in it): read inside the loop, the
 * hint's branches left the loop short of registers, and the kernel was 1.1x (1 row) to about 2x (32
 * rows) slower (SmolLM2-135M's linears, Intel Xeon, 2 threads).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define PANEL 16     /* outputs per panel: one 64-byte line of float32 per input feature */
#define MAX_ROWS 8   /* rows of x whose accumulators are held in registers at once: 8 with
                      * AVX-512's 32 vector registers (16 accumulators), else 4 */
#define AHEAD 4096   /* bytes of the weight stream prefetched ahead of the read: SmolLM2-135M's
                      * linears at 4 / 8 rows, one thread (Zen 5): 20.4-21.8 / 20.7-21.7 ms a step
                      * against 22.9-23.6 / 25.0-25.4 at 1,024 bytes; 8,192 no better */

enum { NO_PREFETCH, PREFETCH_NTA, PREFETCH_T0, PREFETCH_NEXT_PAIR_NTA, PREFETCH_NEXT_PAIR_T0 };
static int prefetch_hint = PREFETCH_NTA; /* for the first pass over a panel; set by prefetch_hint() */

typedef float v16f __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Rows [m0, m0 + R) of y for panels [p, p + P): R x P accumulators of 16 outputs over the K input
 * features. Two panels at once are two streams and twice the independent sums in flight: one
 * panel alone waits on the add's latency each feature. */
static inline __attribute__((always_inline)) void panel_rows(const float *restrict x, const float *restrict packed,
                                                             const float *restrict bias, float *restrict y,
                                                             int64_t m0, int R, int64_t p, int P, int64_t N,
                                                             int64_t K, int prefetch) {
    v16f acc[2][MAX_ROWS] = {{{0}}};
    const float *xr[MAX_ROWS];
    const float *panel = packed + p * K * PANEL;
    for (int r = 0; r < R; r++) xr[r] = x + (m0 + r) * K;
    for (int64_t k = 0; k < K; k++) {
        for (int q = 0; q < P; q++) {
            const float *at = panel + (q * K + k) * PANEL;
            /* near the end this hint points past the weight: a prefetch never faults */
            if (prefetch == PREFETCH_T0)
                __builtin_prefetch((const char *)at + AHEAD, 0, 3);
            else if (prefetch == PREFETCH_NTA)
                __builtin_prefetch((const char *)at + AHEAD, 0, 0);
            else if (prefetch == PREFETCH_NEXT_PAIR_T0)
                __builtin_prefetch(at + 2 * K * PANEL, 0, 3);
            else if (prefetch == PREFETCH_NEXT_PAIR_NTA)
                __builtin_prefetch(at + 2 * K * PANEL, 0, 0);
            const v16f w = load16(at);
            for (int r = 0; r < R; r++) acc[q][r] += w * xr[r][k];
        }
    }
    for (int q = 0; q < P; q++) {
        const int64_t n0 = (p + q) * PANEL, n = N - n0 < PANEL ? N - n0 : PANEL;
        for (int r = 0; r < R; r++) {
            float *out = y + (m0 + r) * N + n0;
            for (int64_t i = 0; i < n; i++) out[i] = acc[q][r][i] + (bias ? bias[n0 + i] : 0.f);
        }
    }
}

/* The last `rows` (< RB) rows: each count its own constant, so its loops unroll too (counts of RB
 * or more cannot occur: the compiler drops their copies). */
static inline __attribute__((always_inline)) void panel_remainder(const float *x, const float *packed,
                                                                  const float *bias, float *y, int64_t m0,
                                                                  int64_t rows, int64_t p, int P, int64_t N,
                                                                  int64_t K, int prefetch, const int RB) {
    if (rows >= RB) __builtin_unreachable();
    switch (rows) {
    case 7: panel_rows(x, packed, bias, y, m0, 7, p, P, N, K, prefetch); break;
    case 6: panel_rows(x, packed, bias, y, m0, 6, p, P, N, K, prefetch); break;
    case 5: panel_rows(x, packed, bias, y, m0, 5, p, P, N, K, prefetch); break;
    case 4: panel_rows(x, packed, bias, y, m0, 4, p, P, N, K, prefetch); break;
    case 3: panel_rows(x, packed, bias, y, m0, 3, p, P, N, K, prefetch); break;
    case 2: panel_rows(x, packed, bias, y, m0, 2, p, P, N, K, prefetch); break;
    case 1: panel_rows(x, packed, bias, y, m0, 1, p, P, N, K, prefetch); break;
    }
}

/* Panels [p, p + P) of y, P 1 or 2, rows RB at a time, `prefetch` a constant here (a branch on it
 * in the loop costs registers): the first pass over the panels streams them from memory,
 * prefetched, later whole blocks of rows hit cache, and the second pass prefetches the next pair
 * (near the last pair that points past the weight: a prefetch never faults). */
static inline __attribute__((always_inline)) void run_panels_hint(const float *x, const float *packed,
                                                                  const float *bias, float *y, int64_t M,
                                                                  int64_t N, int64_t K, int64_t p, int P,
                                                                  const int RB, int prefetch) {
    int64_t m0 = 0;
    if (M >= RB) {
        panel_rows(x, packed, bias, y, 0, RB, p, P, N, K, prefetch);
        m0 = RB;
    }
    const int next = prefetch == PREFETCH_T0 ? PREFETCH_NEXT_PAIR_T0 : PREFETCH_NEXT_PAIR_NTA;
    if (m0 + RB <= M) {
        panel_rows(x, packed, bias, y, m0, RB, p, P, N, K, next);
        m0 += RB;
    }
    for (; m0 + RB <= M; m0 += RB) panel_rows(x, packed, bias, y, m0, RB, p, P, N, K, NO_PREFETCH);
    panel_remainder(x, packed, bias, y, m0, M - m0, p, P, N, K, m0 > RB ? NO_PREFETCH : m0 ? next : prefetch, RB);
}

static inline __attribute__((always_inline)) void run_panels_p(const float *x, const float *packed,
                                                               const float *bias, float *y, int64_t M,
                                                               int64_t N, int64_t K, int64_t p, int P,
                                                               const int RB) {
    if (prefetch_hint == PREFETCH_T0)
        run_panels_hint(x, packed, bias, y, M, N, K, p, P, RB, PREFETCH_T0);
    else
        run_panels_hint(x, packed, bias, y, M, N, K, p, P, RB, PREFETCH_NTA);
}

static int wide_registers; /* AVX-512: set at import */

/* 8 rows at a time, AVX-512 only (wide_registers is set only where the CPU has it). */
__attribute__((target("arch=x86-64-v4"))) static void run_pair_wide(const float *x, const float *packed,
                                                                   const float *bias, float *y, int64_t M,
                                                                   int64_t N, int64_t K, int64_t p, int64_t panels) {
    if (p + 1 < panels)
        run_panels_p(x, packed, bias, y, M, N, K, p, 2, 8);
    else /* the last panel may be alone */
        run_panels_p(x, packed, bias, y, M, N, K, p, 1, 8);
}

/* 4 rows at a time: AVX2+FMA, else the baseline (and AVX-512 CPUs told rows_per_block(4)). */
__attribute__((target_clones("arch=x86-64-v3", "default"))) static void run_pair_narrow(
    const float *x, const float *packed, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
    int64_t p, int64_t panels) {
    if (p + 1 < panels)
        run_panels_p(x, packed, bias, y, M, N, K, p, 2, 4);
    else
        run_panels_p(x, packed, bias, y, M, N, K, p, 1, 4);
}

static void run_pair(const float *x, const float *packed, const float *bias, float *y, int64_t M, int64_t N,
                     int64_t K, int64_t p, int64_t panels) {
    if (wide_registers)
        run_pair_wide(x, packed, bias, y, M, N, K, p, panels);
    else
        run_pair_narrow(x, packed, bias, y, M, N, K, p, panels);
}

/* --- bfloat16, with AVX-512 BF16 ---------------------------------------------------------------------
 * The weight packed as [ceil(N / 16)][K / 2][16][2]: a panel's 16 outputs for a pair of input
 * features, one 64-byte line. vdpbf16ps multiplies a line by a broadcast pair of x (the two bf16
 * features as one 32-bit lane) and adds both products to 16 float32 sums: each product exact, the
 * sums float32, the output rounded to bfloat16 once. Rows 8 at a time, two panels at once,
 * non-temporal prefetch ahead, as the float32 kernel. At 4 rows of SmolLM2-135M's linears (269 MB,
 * AMD EPYC without AMX) 22.6-24.5 GB/s at two threads where oneDNN's bf16 path reads 15.8-18.1. */
static int bf16_dots_here; /* AVX-512 BF16: set at import */

__attribute__((target("arch=x86-64-v4,avx512bf16"))) static inline __attribute__((always_inline)) void
bf16_panel_rows(const uint16_t *restrict x, const uint16_t *restrict packed, const uint16_t *restrict bias,
                uint16_t *restrict y, int64_t m0, const int R, int64_t p, const int P, int64_t N, int64_t K2) {
    __m512 acc[2][MAX_ROWS];
    for (int q = 0; q < 2; q++)
        for (int r = 0; r < MAX_ROWS; r++) acc[q][r] = _mm512_setzero_ps();
    const uint16_t *panel = packed + p * K2 * 2 * PANEL;
    const int32_t *xr[MAX_ROWS]; /* a row's features in pairs */
    for (int r = 0; r < R; r++) xr[r] = (const int32_t *)(x + (m0 + r) * 2 * K2);
    for (int64_t k = 0; k < K2; k++)
        for (int q = 0; q < P; q++) {
            const uint16_t *at = panel + (q * K2 + k) * 2 * PANEL;
            __builtin_prefetch((const char *)at + AHEAD, 0, 0); /* never faults past the end */
            const __m512bh w = (__m512bh)_mm512_loadu_si512(at);
            for (int r = 0; r < R; r++)
                acc[q][r] = _mm512_dpbf16_ps(acc[q][r], (__m512bh)_mm512_set1_epi32(xr[r][k]), w);
        }
    for (int q = 0; q < P; q++) {
        const int64_t n0 = (p + q) * PANEL, n = N - n0 < PANEL ? N - n0 : PANEL;
        for (int r = 0; r < R; r++) {
            float sums[PANEL];
            _mm512_storeu_ps(sums, acc[q][r]);
            uint16_t *out = y + (m0 + r) * N + n0;
            for (int64_t i = 0; i < n; i++) out[i] = float_to_bf16(sums[i] + (bias ? bf16_to_float(bias[n0 + i]) : 0.f));
        }
    }
}

/* Panels [p, p + 1 or 2) of y for every row, 8 at a time, each row count its own constant. */
__attribute__((target("arch=x86-64-v4,avx512bf16"))) static void bf16_pair(const uint16_t *x, const uint16_t *packed,
                                                                          const uint16_t *bias, uint16_t *y,
                                                                          int64_t M, int64_t N, int64_t K2, int64_t p,
                                                                          int64_t panels) {
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int64_t rows = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
#define BF16_ROWS(R)                                                                                        \
    case R:                                                                                                 \
        if (p + 1 < panels)                                                                                 \
            bf16_panel_rows(x, packed, bias, y, m0, R, p, 2, N, K2);                                        \
        else                                                                                                \
            bf16_panel_rows(x, packed, bias, y, m0, R, p, 1, N, K2);                                        \
        break;
        switch (rows) { BF16_ROWS(1) BF16_ROWS(2) BF16_ROWS(3) BF16_ROWS(4) BF16_ROWS(5) BF16_ROWS(6)
                        BF16_ROWS(7) BF16_ROWS(8) }
#undef BF16_ROWS
    }
}

static PyObject *linear_bf16(PyObject *self, PyObject *args) {
    unsigned long long x, packed, bias, y;
    long long M, N, K2;
    int num_threads;
    if (!PyArg_ParseTuple(args, "KKKKLLLi", &x, &packed, &bias, &y, &M, &N, &K2, &num_threads)) return NULL;
    if (M < 0 || N < 0 || K2 < 0) {
        PyErr_SetString(PyExc_ValueError, "negative shape");
        return NULL;
    }
    if (!bf16_dots_here) {
        PyErr_SetString(PyExc_ValueError, "the bfloat16 panel linear needs AVX-512 BF16, which this CPU lacks");
        return NULL;
    }
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const uint16_t *xp = (const uint16_t *)(uintptr_t)x, *wp = (const uint16_t *)(uintptr_t)packed;
    const uint16_t *bp = (const uint16_t *)(uintptr_t)bias;
    uint16_t *yp = (uint16_t *)(uintptr_t)y;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t pair = 0; pair < (panels + 1) / 2; pair++) bf16_pair(xp, wp, bp, yp, M, N, K2, 2 * pair, panels);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *bf16_dots(PyObject *self, PyObject *unused) { return PyBool_FromLong(bf16_dots_here); }

static PyObject *linear(PyObject *self, PyObject *args) {
    unsigned long long x, packed, bias, y;
    long long M, N, K;
    int num_threads;
    if (!PyArg_ParseTuple(args, "KKKKLLLi", &x, &packed, &bias, &y, &M, &N, &K, &num_threads)) return NULL;
    if (M < 0 || N < 0 || K < 0) {
        PyErr_SetString(PyExc_ValueError, "negative shape");
        return NULL;
    }
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const float *xp = (const float *)(uintptr_t)x, *wp = (const float *)(uintptr_t)packed;
    const float *bp = (const float *)(uintptr_t)bias;
    float *yp = (float *)(uintptr_t)y;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t pair = 0; pair < (panels + 1) / 2; pair++) run_pair(xp, wp, bp, yp, M, N, K, 2 * pair, panels);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(linear_doc, "linear(x, packed, bias, y, M, N, K, num_threads)\n\n"
                         "Raw data pointers (bias 0: none), contiguous float32; checked by "
                         "vmemkv.engine.models.panel_linear, not here.");

static PyObject *rows_per_block(PyObject *self, PyObject *args) {
    int rows = 0;
    if (!PyArg_ParseTuple(args, "|i", &rows)) return NULL;
    const int before = wide_registers ? 8 : 4;
    if (rows == 4 || (rows == 8 && __builtin_cpu_supports("avx512f")))
        wide_registers = rows == 8;
    else if (rows) {
        PyErr_Format(PyExc_ValueError, "%d rows per block: 4, or 8 with AVX-512", rows);
        return NULL;
    }
    return PyLong_FromLong(before);
}

static PyObject *prefetch_hint_(PyObject *self, PyObject *args) {
    const char *hint = NULL;
    if (!PyArg_ParseTuple(args, "|s", &hint)) return NULL;
    const char *before = prefetch_hint == PREFETCH_T0 ? "t0" : "nta";
    if (hint && (strcmp(hint, "t0") == 0 || strcmp(hint, "nta") == 0))
        prefetch_hint = hint[0] == 't' ? PREFETCH_T0 : PREFETCH_NTA;
    else if (hint) {
        PyErr_Format(PyExc_ValueError, "prefetch hint %R: 'nta' or 't0'", PyTuple_GET_ITEM(args, 0));
        return NULL;
    }
    return PyUnicode_FromString(before);
}

static PyMethodDef methods[] = {
    {"linear", linear, METH_VARARGS, linear_doc},
    {"linear_bf16", linear_bf16, METH_VARARGS,
     "linear_bf16(x, packed, bias, y, M, N, K2, num_threads): bfloat16 data (x [M, 2 K2], the weight\n"
     "packed in pairs of features, bias [N] or 0, y [M, N]); checked by vmemkv.engine.models.panel_linear."},
    {"bf16_dots", bf16_dots, METH_NOARGS, "Whether this CPU has AVX-512 BF16, which `linear_bf16` needs."},
    {"rows_per_block", rows_per_block, METH_VARARGS,
     "rows_per_block([rows]): the rows of x taken at a time (8 with AVX-512, else 4); with rows (4, or 8\n"
     "where AVX-512 is), set it (for tests of the other path); returns the value before."},
    {"prefetch_hint", prefetch_hint_, METH_VARARGS,
     "prefetch_hint([hint]): how the first pass over a panel prefetches the weight stream, 'nta'\n"
     "(non-temporal, the default) or 't0' (into every cache level); with hint, set it; returns the\n"
     "value before."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_panel_linear",
                                    "Float32 and bfloat16 linear layers over weights packed in panels of 16 outputs.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__panel_linear(void) {
    __builtin_cpu_init();
    wide_registers = __builtin_cpu_supports("avx512f");
    bf16_dots_here = wide_registers && __builtin_cpu_supports("avx512bf16");
    return PyModule_Create(&module);
}
