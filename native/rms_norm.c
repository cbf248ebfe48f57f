/* RMS norm of float32 or bfloat16 rows, the way Llama's RMSNorm computes it:
 * y = w * (x / sqrt(mean(x^2) + eps)). One native call in place of the six tensor ops (and their
 * dispatch) of the Python module, which a decode step runs twice per layer on a few rows.
 * bfloat16 rows are normed in float32 and rounded where the module's tensor ops round: the
 * normed row to bfloat16 (its `.to(input_dtype)`), then its product with the bfloat16 weight.
 * Rows on OpenMP threads when there are enough of them to pay for the threads (prefill). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define ELEMENTS_PER_THREAD (1 << 15) /* fewer per thread and the fork costs more than it saves */

static void norm_row(const float *restrict x, const float *restrict w, float *restrict y, int64_t n,
                     float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float r = 1.0f / sqrtf(sum / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

/* AVX-512 where the CPU has it: the conversions and roundings cost more lanes than the math */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
static void norm_row_bf16(const uint16_t *restrict x, const uint16_t *restrict w, uint16_t *restrict y,
                          int64_t n, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) {
        const float v = bf16_to_float(x[i]);
        sum += v * v;
    }
    const float r = 1.0f / sqrtf(sum / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float normed = round_bf16(bf16_to_float(x[i]) * r);
        y[i] = float_to_bf16(bf16_to_float(w[i]) * normed);
    }
}

static PyObject *rms_norm(PyObject *self, PyObject *args) {
    unsigned long long x, w, y;
    long long rows, n;
    float eps;
    int num_threads, bf16 = 0;
    if (!PyArg_ParseTuple(args, "KKKLLfi|p", &x, &w, &y, &rows, &n, &eps, &num_threads, &bf16)) return NULL;
    if (rows < 0 || n <= 0) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: rows >= 0 and n > 0");
        return NULL;
    }
    const int threads = rows * n >= 2LL * ELEMENTS_PER_THREAD ? num_threads : 1;
    Py_BEGIN_ALLOW_THREADS
    if (bf16) {
        const uint16_t *xp = (const uint16_t *)(uintptr_t)x, *wp = (const uint16_t *)(uintptr_t)w;
        uint16_t *yp = (uint16_t *)(uintptr_t)y;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t row = 0; row < rows; row++) norm_row_bf16(xp + row * n, wp, yp + row * n, n, eps);
    } else {
        const float *xp = (const float *)(uintptr_t)x, *wp = (const float *)(uintptr_t)w;
        float *yp = (float *)(uintptr_t)y;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t row = 0; row < rows; row++) norm_row(xp + row * n, wp, yp + row * n, n, eps);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", rms_norm, METH_VARARGS,
     "rms_norm(x, w, y, rows, n, eps, num_threads[, bf16])\n\nRaw data pointers to contiguous rows of n "
     "(x, y) and n weights, float32 (or bfloat16 with bf16=True); checked by "
     "vmemkv.engine.models.native_norm, not here."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rms_norm", "RMS norm of float32 or bfloat16 rows.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__rms_norm(void) { return PyModule_Create(&module); }
