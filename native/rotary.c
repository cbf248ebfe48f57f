/* Rotary position embedding of float32 or bfloat16 query and key rows, the way transformers' Llama code
 * computes it: out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) for the halves
 * x1, x2 of each head. One pass over q and k in place of transformers' eight tensor ops each
 * (two slices, a negation, a concatenation, three products and a sum), which at a 2,048-token
 * prefill chunk read and write every element several times.
 *
 * Equal to transformers' result bit for bit: each product and the sum are rounded as the tensor
 * ops round them (built with -ffp-contract=off, so no multiply-add is fused), and
 * x * c + (-y) * s is x * c - y * s exactly in IEEE arithmetic.
 * bfloat16 rows (with bfloat16 cos and sin, as the model's rotary embedding gives them) are
 * rounded where the tensor ops round: each product to bfloat16, then their sum.
 * Tokens on OpenMP threads when there are enough elements to pay for the threads (prefill). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "bf16.h"

#define ELEMENTS_PER_THREAD (1 << 15) /* fewer per thread and the fork costs more than it saves */

/* heads rows of dim floats from src (row stride src_head) to dst (dst_head), one token's cos/sin */
static void rotate_token(const float *restrict src, float *restrict dst, int64_t heads, int64_t src_head,
                         int64_t dst_head, const float *restrict cos, const float *restrict sin, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        const float *x = src + h * src_head;
        float *y = dst + h * dst_head;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float a = x[i] * cos[i], b = x[i + half] * sin[i];
            y[i] = a - b;
        }
#pragma omp simd
        for (int64_t i = half; i < dim; i++) {
            const float a = x[i] * cos[i], b = x[i - half] * sin[i];
            y[i] = a + b;
        }
    }
}

/* AVX-512 where the CPU has it: the conversions and roundings cost more lanes than the math */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
static void rotate_token_bf16(const uint16_t *restrict src, uint16_t *restrict dst, int64_t heads,
                              int64_t src_head, int64_t dst_head, const uint16_t *restrict cos,
                              const uint16_t *restrict sin, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        const uint16_t *x = src + h * src_head;
        uint16_t *y = dst + h * dst_head;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float a = round_bf16(bf16_to_float(x[i]) * bf16_to_float(cos[i]));
            const float b = round_bf16(bf16_to_float(x[i + half]) * bf16_to_float(sin[i]));
            y[i] = float_to_bf16(a - b);
        }
#pragma omp simd
        for (int64_t i = half; i < dim; i++) {
            const float a = round_bf16(bf16_to_float(x[i]) * bf16_to_float(cos[i]));
            const float b = round_bf16(bf16_to_float(x[i - half]) * bf16_to_float(sin[i]));
            y[i] = float_to_bf16(a + b);
        }
    }
}

typedef struct {
    const char *src;
    char *dst;
    int64_t heads, token_stride, head_stride, out_token_stride, out_head_stride;
} Rows;

static PyObject *rotary(PyObject *self, PyObject *args) {
    unsigned long long q, k, q_out, k_out, cos, sin;
    long long tokens, dim, q_heads, q_token, q_head, k_heads, k_token, k_head;
    long long q_out_token, q_out_head, k_out_token, k_out_head;
    int num_threads, bf16 = 0;
    if (!PyArg_ParseTuple(args, "KKKKKKLLLLLLLLLLLLi|p", &q, &k, &q_out, &k_out, &cos, &sin, &tokens, &dim,
                          &q_heads, &q_token, &q_head, &k_heads, &k_token, &k_head, &q_out_token,
                          &q_out_head, &k_out_token, &k_out_head, &num_threads, &bf16))
        return NULL;
    if (tokens < 0 || dim <= 0 || dim % 2 || q_heads < 0 || k_heads < 0) {
        PyErr_SetString(PyExc_ValueError, "rotary: tokens >= 0, an even dim > 0, heads >= 0");
        return NULL;
    }
    const Rows parts[2] = {
        {(const char *)(uintptr_t)q, (char *)(uintptr_t)q_out, q_heads, q_token, q_head, q_out_token, q_out_head},
        {(const char *)(uintptr_t)k, (char *)(uintptr_t)k_out, k_heads, k_token, k_head, k_out_token, k_out_head},
    };
    const char *cp = (const char *)(uintptr_t)cos, *sp = (const char *)(uintptr_t)sin;
    const int64_t size = bf16 ? 2 : 4; /* bytes an element: strides are in elements */
    const int threads = tokens * (q_heads + k_heads) * dim >= 2LL * ELEMENTS_PER_THREAD ? num_threads : 1;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < tokens; t++) {
        for (int p = 0; p < 2; p++) {
            const Rows *r = &parts[p];
            const char *src = r->src + t * r->token_stride * size, *c = cp + t * dim * size, *s = sp + t * dim * size;
            char *dst = r->dst + t * r->out_token_stride * size;
            if (bf16)
                rotate_token_bf16((const uint16_t *)src, (uint16_t *)dst, r->heads, r->head_stride,
                                  r->out_head_stride, (const uint16_t *)c, (const uint16_t *)s, dim);
            else
                rotate_token((const float *)src, (float *)dst, r->heads, r->head_stride, r->out_head_stride,
                             (const float *)c, (const float *)s, dim);
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rotary", rotary, METH_VARARGS,
     "rotary(q, k, q_out, k_out, cos, sin, tokens, dim, q_heads, q_token_stride, q_head_stride, k_heads,\n"
     "       k_token_stride, k_head_stride, q_out_token_stride, q_out_head_stride, k_out_token_stride,\n"
     "       k_out_head_stride, num_threads[, bf16])\n\n"
     "Raw data pointers to float32 (bfloat16 with bf16=True) rows of dim (strides in elements; each head's dim contiguous) and\n"
     "contiguous [tokens, dim] cos and sin; checked by vmemkv.engine.models.native_rotary, not here."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rotary", "Rotary position embedding of float32 or bfloat16 rows.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__rotary(void) { return PyModule_Create(&module); }
