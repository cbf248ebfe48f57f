/* RMS norm of float32 rows, the way Llama's RMSNorm computes it in float32:
 * y = w * (x / sqrt(mean(x^2) + eps)). One native call in place of the six tensor ops (and their
 * dispatch) of the Python module, which a decode step runs twice per layer on a few rows.
 * Rows on OpenMP threads when there are enough of them to pay for the threads (prefill). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

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

static PyObject *rms_norm(PyObject *self, PyObject *args) {
    unsigned long long x, w, y;
    long long rows, n;
    float eps;
    int num_threads;
    if (!PyArg_ParseTuple(args, "KKKLLfi", &x, &w, &y, &rows, &n, &eps, &num_threads)) return NULL;
    if (rows < 0 || n <= 0) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: rows >= 0 and n > 0");
        return NULL;
    }
    const float *xp = (const float *)(uintptr_t)x, *wp = (const float *)(uintptr_t)w;
    float *yp = (float *)(uintptr_t)y;
    const int threads = rows * n >= 2LL * ELEMENTS_PER_THREAD ? num_threads : 1;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t row = 0; row < rows; row++) norm_row(xp + row * n, wp, yp + row * n, n, eps);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", rms_norm, METH_VARARGS,
     "rms_norm(x, w, y, rows, n, eps, num_threads)\n\nRaw data pointers to contiguous float32 rows of n "
     "(x, y) and n weights; checked by vmemkv.engine.models.native_norm, not here."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rms_norm", "RMS norm of float32 rows.", -1, methods};

PyMODINIT_FUNC PyInit__rms_norm(void) { return PyModule_Create(&module); }
