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
 * so the A/B harness compares addressing, not two kernels. Keys are walked in tiles, in position
 * order, the tokens a few ahead prefetched (one layer's rows of consecutive tokens are a whole
 * model's token stride apart in the token-major layout, which the hardware prefetcher does not
 * follow); within a tile each query head's scores and weighted values are summed with its query
 * and accumulator held in registers. With AVX-512 a kv head's query heads (up to three) go
 * together on 16-float vectors, so each K and V row is loaded once for all of them: SmolLM2-135M's
 * decode attention (16 sequences of ~300 tokens, 30 layers, one thread, AMD EPYC Zen 5) 12.9 ms a
 * step against 14.7 one head at a time on 8-float vectors; 4 of ~2,000 tokens 21 against 24.7.
 *
 * Only positions [start, seq_len) are read (start = seq_len - window for a sliding window), so an
 * unmapped page past a sequence's end, or released behind its window, is never touched. Offsets are
 * int64: the token-major layout's slot strides pass 2^31 elements.
 *
 * Shared prefixes (cascade decoding): sequences whose leading blocks are the same physical blocks
 * (a cached prompt prefix, the forks of parallel sampling) may be passed as groups: prefix_leaders[b]
 * is the group's first sequence and prefix_lens[b] the keys b shares with it. A group's prefix is
 * then read once, from the leader's rows, for every member's queries (a work item per prefix
 * split), and each sequence's own keys after it; the parts meet in `combine` by their log-sum-exp.
 *
 * With new_k/new_v, each sequence's newest token's rows are first written at position seq_lens[b] - 1
 * (the step's cache write, in the same call).
 *
 * Quantized K/V (kv_dtype int8 or fp8 e4m3, vmemkv/memory/quantized_rows.py): one byte a value and a
 * float32 scale per `group` values of a row (token, kv head), the scales in views of their own
 * (k_scale/v_scale, float32 element strides, a row's groups contiguous). The grouped kernels widen
 * the bytes in registers and multiply each 16 of them by their group's scale there; the narrow ones
 * widen and scale each row into the tile buffers. K rows of 64-value blocks are scored with dot
 * products of pairs instead (dot_scores), 32 products an instruction: int8 with AVX-512 VNNI, the
 * query rounded to int16, one scale a head (finer than the bfloat16 a model's query arrives in);
 * fp8 under a bfloat16 query with AVX-512 BF16, the bytes as bfloat16 (exact, but for e4m3
 * subnormals, read as zero). A tile's last n % 16 tokens stay in float arithmetic. Under a
 * bfloat16 query, fp8 V rows are weighted in bfloat16 pairs of tokens too (fp8_pairs: the weights
 * rounded to bfloat16, as FlashAttention's are); int8 V rows stay in float arithmetic (the same
 * pairs, the bytes converted through float32, measured slower). (One build serves both: each row
 * type's code holds only its own extension's instructions, so int8 runs where VNNI comes without
 * BF16.)
 *
 * Types: float32 and bfloat16 Q/out, K/V in those or quantized, float32 arithmetic. The grouped (AVX-512) kernels read
 * bf16 rows where they lie and widen them in registers (SmolLM2-135M's shape, 4 sequences of 2,000
 * tokens, one thread, AMD EPYC with AVX-512: 19.3 ms a step against 27.2 widening each tile into a
 * float32 buffer first); the narrow ones read the widened buffer.
 * The work items (see `plan`) run on OpenMP threads with the GIL released.
 * process_item is compiled three times: for AVX-512 (x86-64-v4, grouped heads), and (target_clones,
 * one head at a time) for AVX2+FMA (x86-64-v3) and the baseline, chosen at load time by the CPU it
 * runs on; each with head sizes 64 and 128 as constants.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp_nonpositive.h"
#include "fp8.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define TILE 64    /* keys per online-softmax step: their scores stay in L1 */
#define PREFETCH 8 /* tokens ahead whose rows are prefetched, into L2 (on ~2,000-token sequences
                      * faster than 4 ahead, 16 ahead, or into L1) */

enum { DT_FLOAT32 = 0, DT_BFLOAT16 = 1, DT_INT8 = 2, DT_FP8 = 3 };

typedef struct {
    const char *q, *k, *v, *sinks;
    char *out;
    const int32_t *index; /* slot ids [B] (vmem) or block tables [B, *] (paged) */
    const int32_t *seq_lens;
    int64_t index_stride_b;
    int64_t batch, num_q_heads, num_kv_heads, head_dim, block_size; /* block_size 0: vmem */
    int64_t q_sb, q_sh, out_sb, out_sh;                              /* strides, in elements */
    int64_t k_so, k_st, k_sh, v_so, v_st, v_sh;
    const char *new_k, *new_v; /* [B, Hk, D] rows written at seq_lens[b] - 1 first, or NULL */
    int64_t new_k_sb, new_k_sh, new_v_sb, new_v_sh;
    float scale, softcap;
    int64_t window; /* 0: none */
    int dtype, num_splits;
    int kv_dtype;                       /* the cache's: dtype, or DT_INT8 / DT_FP8 with scales */
    const float *k_scale, *v_scale;     /* [outer, token, Hk, D / group] float32 views, or NULL */
    int64_t ks_so, ks_st, ks_sh, vs_so, vs_st, vs_sh; /* their strides, in floats */
    int64_t group;                                    /* values one scale covers */
    const int32_t *prefix_leaders, *prefix_lens; /* [B] each, or NULL: see "Shared prefixes" above */
    int64_t num_parts;                            /* partial results a sequence combines: 1 = none */
    float *partial;                               /* [B, Hq, num_parts, D] and [B, Hq, num_parts] */
    float *lse;
} Args;

/* One work item: the queries of `num_members` sequences (members[0..]) over keys [lo, hi) read
 * from sequence `rows_of`'s rows, written to partial `part` of each member (-1: to out directly). */
typedef struct {
    int64_t rows_of, lo, hi, part;
    const int32_t *members;
    int64_t num_members;
} Work;

static inline size_t elem_size(int dtype) { return dtype == DT_FLOAT32 ? 4 : dtype == DT_BFLOAT16 ? 2 : 1; }

static inline int quantized(int dtype) { return dtype >= DT_INT8; }

/* A row of head_dim values as float32: the row itself (float32) or widened into buf (bf16). */
static inline __attribute__((always_inline)) const float *row_f32(const char *p, int dtype, int64_t n,
                                                                 float *buf) {
    if (dtype == DT_FLOAT32) return (const float *)p;
    const uint16_t *h = (const uint16_t *)p;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) buf[i] = bf16_to_float(h[i]);
    return buf;
}

/* A cache row as float32 into buf: row_f32, or quantized bytes times their group's scale
 * (scales[i / group]). */
static inline __attribute__((always_inline)) void kv_row_f32(const char *p, int dtype, int64_t n,
                                                            const float *scales, int64_t group, float *buf) {
    if (dtype == DT_INT8) {
        for (int64_t g = 0; g < n; g += group)
#pragma omp simd
            for (int64_t i = g; i < g + group; i++) buf[i] = (float)((const int8_t *)p)[i] * scales[g / group];
    } else if (dtype == DT_FP8) {
        for (int64_t g = 0; g < n; g += group)
            for (int64_t i = g; i < g + group; i++) buf[i] = fp8_to_float(((const uint8_t *)p)[i]) * scales[g / group];
    } else {
        const float *row = row_f32(p, dtype, n, buf);
        if (row != buf) memcpy(buf, row, (size_t)n * 4);
    }
}

/* Eight lanes of partial sums, added as a tree at the end: one vector FMA per 8 elements, and no
 * lane-by-lane reduction chain (what a simd reduction compiles to). */
static inline __attribute__((always_inline)) float dot(const float *restrict a, const float *restrict b,
                                                       int64_t n) {
    float part[8] = {0.f};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) part[l] += a[i + l] * b[i + l];
    float s = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    for (; i < n; i++) s += a[i] * b[i];
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

/* Every cache line of the `bytes` bytes from p: a row need not start on a line (a quantized
 * layer's values and scales are 216 bytes at SmolLM2's shape), and its last line holds scales. */
static inline __attribute__((always_inline)) void prefetch_row(const char *p, int64_t bytes) {
    const uintptr_t first = (uintptr_t)p & ~(uintptr_t)63, last = ((uintptr_t)p + (uintptr_t)bytes - 1) & ~(uintptr_t)63;
    for (uintptr_t at = first; at <= last; at += 64) __builtin_prefetch((const char *)at, 0, 2);
}

/* Tokens [from, to)'s K and V rows (pf_k[u], pf_v[u]: rows PREFETCH tokens ahead), `bytes` each. */
static inline __attribute__((always_inline)) void prefetch_tokens(const char *const *pf_k, const char *const *pf_v,
                                                                  int64_t from, int64_t to, int64_t bytes) {
    for (int64_t u = from; u < to; u++) {
        prefetch_row(pf_k[u], bytes);
        prefetch_row(pf_v[u], bytes);
    }
}

/* Eight floats: an AVX register in the x86-64-v3 clone, two SSE ones in the baseline. */
typedef float v8f __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* out[j] = q . rows[j][off : off + D] for the tile's n tokens. D a multiple of 8: q is held in
 * registers 64 elements at a time and each row's products summed in 8 lanes; else plain dots. */
static inline __attribute__((always_inline)) void tile_scores(const float *restrict q, const void *const *rows,
                                                              int64_t off, int64_t n, int64_t D,
                                                              float *restrict out, const char *const *pf_k,
                                                              const char *const *pf_v, int64_t pf_bytes) {
    if (D % 8) {
        for (int64_t j = 0; j < n; j++) out[j] = dot(q, (const float *)rows[j] + off, D);
        return;
    }
    for (int64_t c = 0; c < D; c += 64) {
        const int64_t w = D - c < 64 ? D - c : 64;
        v8f qv[8];
        for (int64_t i = 0; i < w / 8; i++) qv[i] = load8(q + c + 8 * i);
        int64_t j = 0;
        /* Four tokens at a time: a token's products are one chain of dependent adds, so one
         * token alone waits on the add's latency; four chains keep the FMA units busy. Each
         * token's sum is formed in the same order as alone. */
        for (; j + 4 <= n; j += 4) {
            if (pf_k) /* the first pass over the tile fetches the tokens PREFETCH ahead */
                prefetch_tokens(pf_k, pf_v, j, j + 4, pf_bytes);
            const float *r0 = (const float *)rows[j] + off + c, *r1 = (const float *)rows[j + 1] + off + c;
            const float *r2 = (const float *)rows[j + 2] + off + c, *r3 = (const float *)rows[j + 3] + off + c;
            v8f p0 = qv[0] * load8(r0), p1 = qv[0] * load8(r1), p2 = qv[0] * load8(r2), p3 = qv[0] * load8(r3);
            for (int64_t i = 1; i < w / 8; i++) {
                p0 += qv[i] * load8(r0 + 8 * i);
                p1 += qv[i] * load8(r1 + 8 * i);
                p2 += qv[i] * load8(r2 + 8 * i);
                p3 += qv[i] * load8(r3 + 8 * i);
            }
            out[j] = (c ? out[j] : 0.f) + hsum8(p0);
            out[j + 1] = (c ? out[j + 1] : 0.f) + hsum8(p1);
            out[j + 2] = (c ? out[j + 2] : 0.f) + hsum8(p2);
            out[j + 3] = (c ? out[j + 3] : 0.f) + hsum8(p3);
        }
        for (; j < n; j++) {
            if (pf_k) prefetch_tokens(pf_k, pf_v, j, j + 1, pf_bytes);
            const float *r = (const float *)rows[j] + off + c;
            v8f part = qv[0] * load8(r);
            for (int64_t i = 1; i < w / 8; i++) part += qv[i] * load8(r + 8 * i);
            out[j] = (c ? out[j] : 0.f) + hsum8(part);
        }
        pf_k = pf_v = NULL;
    }
}

/* acc[0:D] += sum_j p[j] * rows[j][off : off + D], 64 elements of acc in registers at a time. */
static inline __attribute__((always_inline)) void tile_accumulate(float *restrict acc, const float *restrict p,
                                                                  const void *const *rows, int64_t off,
                                                                  int64_t n, int64_t D) {
    if (D % 8) {
        for (int64_t j = 0; j < n; j++) axpy(acc, p[j], (const float *)rows[j] + off, D);
        return;
    }
    for (int64_t c = 0; c < D; c += 64) {
        const int64_t w = D - c < 64 ? D - c : 64;
        v8f av[8];
        for (int64_t i = 0; i < w / 8; i++) av[i] = load8(acc + c + 8 * i);
        for (int64_t j = 0; j < n; j++) {
            const float *r = (const float *)rows[j] + off + c;
            for (int64_t i = 0; i < w / 8; i++) av[i] += p[j] * load8(r + 8 * i);
        }
        for (int64_t i = 0; i < w / 8; i++) memcpy(acc + c + 8 * i, &av[i], sizeof(v8f));
    }
}

static inline __attribute__((always_inline)) v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void store16(float *p, v16f v) { memcpy(p, &v, sizeof v); }

typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

/* 16 int8 values as floats, and 16 bytes zero-extended to 32-bit lanes: one instruction each (and a
 * conversion), where GCC compiles a vector conversion of bytes into scalar code. Not always_inline:
 * the grouped kernels, compiled for AVX-512, inline them; the narrow clones never reach them (they
 * read widened tile buffers). */
__attribute__((target("avx512f"))) static inline v16f int8_to_float16(const int8_t *p) {
    return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* 16 fp8 e4m3 bytes as floats over 256, exactly: sign-extended to 16 bits, the exponent and
 * mantissa bits moved to a half's (exponent bias 15 instead of 7, subnormals to subnormals) and the
 * sign's extra copy masked off, then widened by vcvtph2ps; the shift and mask on 256-bit vectors,
 * half the work of 512-bit ones. */
__attribute__((target("avx512f"))) static inline v16f fp8_to_float16_over256(const uint8_t *p) {
    const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i half = _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16((short)0xbf80));
    return (v16f)_mm512_cvtph_ps(half);
}

/* 16 values of a K or V row from element i, of row type `bf` (a DT_ code): float32 loaded, bfloat16
 * widened in registers (its bits are a float's upper half: a zero-extend and a shift), where
 * widening a tile into a buffer first cost a store and a load more of every value; int8 converted;
 * fp8 e4m3 over 256 (fp8_to_float16_over256). Quantized rows come unscaled: the caller applies
 * their scales, and for fp8 the 256 (process_item_d: on the query and on the output). */
static inline __attribute__((always_inline)) v16f load16_row(const void *row, int64_t i, const int bf) {
    if (bf == DT_FLOAT32) return load16((const float *)row + i);
    if (bf == DT_INT8) return int8_to_float16((const int8_t *)row + i);
    if (bf == DT_FP8) return fp8_to_float16_over256((const uint8_t *)row + i);
    v16f f;
    v16h h;
    memcpy(&h, (const uint16_t *)row + i, sizeof h);
    const v16u wide = __builtin_convertvector(h, v16u) << 16;
    memcpy(&f, &wide, sizeof f);
    return f;
}

/* out[0..3] = the lane sums of a, b, c and d: halves added pairwise, 2 shuffles a sum where one
 * vector's own reduction takes 4. */
static inline __attribute__((always_inline)) void hsum4x16(v16f a, v16f b, v16f c, v16f d, float *out) {
    const v16f ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                    __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const v16f cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                    __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const v16f x = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                   __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const v16f y = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const v16f z = y + __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    out[0] = z[0];
    out[1] = z[4];
    out[2] = z[8];
    out[3] = z[12];
}

static inline __attribute__((always_inline)) float hsum16(v16f v) {
    float out[4];
    hsum4x16(v, v, v, v, out);
    return out[0];
}

/* Query heads of one kv head read its K and V rows together, up to this many at a time: each
 * row is loaded into registers once for all of them (their accumulators then fill the registers). */
#define HEADS_AT_ONCE 3

/* A quantized tile's scales for the grouped kernels, read where they lie (prefetched with the
 * rows): token j's are at rows[j] (head 0's first), the head being read's from rows[j][off], one
 * per `group` values. */
typedef struct {
    const float *const *rows; /* [TILE] */
    int64_t off, group;
} TileScales;

/* Per 16-value vector i of the 64 values from column c: the index of its group's scale. */
static inline __attribute__((always_inline)) void scale_index(const TileScales *sc, int64_t c, int64_t nv,
                                                             int64_t *at) {
    for (int64_t i = 0; i < nv; i++) at[i] = sc->off + (c + 16 * i) / sc->group;
}

/* out[g * TILE + j] = q[g] . rows[j][off : off + D] for G query heads (q[g] = q + g * D) and the
 * tile's n tokens, D a multiple of 16 (other head sizes take one head at a time): the queries held in registers 64 elements at a time, four
 * tokens' products at a time (four chains of dependent adds keep the FMA units busy). */
static inline __attribute__((always_inline)) void scores_heads(const float *restrict q, const int G,
                                                               const void *const *rows, int64_t off, int64_t n,
                                                               const int64_t D, float *restrict out,
                                                               const char *const *pf_k, const char *const *pf_v,
                                                               int64_t pf_bytes, const int bf, const TileScales *sc) {
    for (int64_t c = 0; c < D; c += 64) {
        const int64_t nv = (D - c < 64 ? D - c : 64) / 16;
        int64_t at[4];
        if (quantized(bf)) scale_index(sc, c, nv, at);
        v16f qv[HEADS_AT_ONCE][4];
        for (int g = 0; g < G; g++)
            for (int64_t i = 0; i < nv; i++) qv[g][i] = load16(q + g * D + c + 16 * i);
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) {
            if (pf_k) /* the first pass over the tile fetches the tokens PREFETCH ahead */
                prefetch_tokens(pf_k, pf_v, j, j + 4, pf_bytes);
            v16f s[HEADS_AT_ONCE][4];
            for (int g = 0; g < G; g++)
                for (int t = 0; t < 4; t++) s[g][t] = (v16f){0};
            for (int64_t i = 0; i < nv; i++)
                for (int t = 0; t < 4; t++) {
                    v16f k = load16_row(rows[j + t], off + c + 16 * i, bf);
                    if (quantized(bf)) k *= sc->rows[j + t][at[i]];
                    for (int g = 0; g < G; g++) s[g][t] += qv[g][i] * k;
                }
            for (int g = 0; g < G; g++) {
                float sums[4];
                hsum4x16(s[g][0], s[g][1], s[g][2], s[g][3], sums);
                for (int t = 0; t < 4; t++) out[g * TILE + j + t] = (c ? out[g * TILE + j + t] : 0.f) + sums[t];
            }
        }
        for (; j < n; j++) {
            if (pf_k) prefetch_tokens(pf_k, pf_v, j, j + 1, pf_bytes);
            for (int g = 0; g < G; g++) {
                v16f s = (v16f){0};
                for (int64_t i = 0; i < nv; i++) {
                    v16f k = load16_row(rows[j], off + c + 16 * i, bf);
                    if (quantized(bf)) k *= sc->rows[j][at[i]];
                    s += qv[g][i] * k;
                }
                out[g * TILE + j] = (c ? out[g * TILE + j] : 0.f) + hsum16(s);
            }
        }
        pf_k = pf_v = NULL;
    }
}

/* acc[g][0:D] += sum_j p[g * TILE + j] * rows[j][off : off + D] for G query heads (acc[g] = acc + g * D),
 * D a multiple of 16, 64 elements of each accumulator in registers at a time. */
static inline __attribute__((always_inline)) void accumulate_heads(float *restrict acc, const int G,
                                                                   const float *restrict p,
                                                                   const void *const *rows, int64_t off,
                                                                   int64_t n, const int64_t D, const int bf,
                                                                   const TileScales *sc) {
    for (int64_t c = 0; c < D; c += 64) {
        const int64_t nv = (D - c < 64 ? D - c : 64) / 16;
        int64_t at[4];
        if (quantized(bf)) scale_index(sc, c, nv, at);
        v16f av[HEADS_AT_ONCE][4];
        for (int g = 0; g < G; g++)
            for (int64_t i = 0; i < nv; i++) av[g][i] = load16(acc + g * D + c + 16 * i);
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < nv; i++) {
                v16f v = load16_row(rows[j], off + c + 16 * i, bf);
                if (quantized(bf)) v *= sc->rows[j][at[i]];
                for (int g = 0; g < G; g++) av[g][i] += p[g * TILE + j] * v;
            }
        for (int g = 0; g < G; g++)
            for (int64_t i = 0; i < nv; i++) store16(acc + g * D + c + 16 * i, av[g][i]);
    }
}

/* The tile's scores of G consecutive query heads (q, out as scores_heads), HEADS_AT_ONCE at a time. */
static inline __attribute__((always_inline)) void group_scores(const float *restrict q, int64_t G,
                                                              const void *const *rows, int64_t off, int64_t n,
                                                              const int64_t D, float *restrict out,
                                                              const char *const *pf_k, const char *const *pf_v,
                                                              int64_t pf_bytes, const int bf, const TileScales *sc) {
    for (int64_t g0 = 0; g0 < G; g0 += HEADS_AT_ONCE) {
        const float *qg = q + g0 * D;
        float *og = out + g0 * TILE;
        if (G - g0 >= 3)
            scores_heads(qg, 3, rows, off, n, D, og, pf_k, pf_v, pf_bytes, bf, sc);
        else if (G - g0 == 2)
            scores_heads(qg, 2, rows, off, n, D, og, pf_k, pf_v, pf_bytes, bf, sc);
        else
            scores_heads(qg, 1, rows, off, n, D, og, pf_k, pf_v, pf_bytes, bf, sc);
        pf_k = pf_v = NULL;
    }
}

/* The tile's weighted V rows into the accumulators of G consecutive query heads (as
 * accumulate_heads), HEADS_AT_ONCE at a time. */
static inline __attribute__((always_inline)) void group_accumulate(float *restrict acc, int64_t G,
                                                                  const float *restrict p,
                                                                  const void *const *rows, int64_t off,
                                                                  int64_t n, const int64_t D, const int bf,
                                                                  const TileScales *sc) {
    for (int64_t g0 = 0; g0 < G; g0 += HEADS_AT_ONCE) {
        float *ag = acc + g0 * D;
        const float *pg = p + g0 * TILE;
        if (G - g0 >= 3)
            accumulate_heads(ag, 3, pg, rows, off, n, D, bf, sc);
        else if (G - g0 == 2)
            accumulate_heads(ag, 2, pg, rows, off, n, D, bf, sc);
        else
            accumulate_heads(ag, 1, pg, rows, off, n, D, bf, sc);
    }
}

static int int8_dot_products; /* AVX-512 VNNI: set at import */
static int fp8_dot_products;  /* AVX-512 BF16: set at import */

/* Two whole numbers of int16's range as a dword's low and high int16. */
static inline int32_t int16_pair(float low, float high) {
    return (int32_t)((uint32_t)(uint16_t)(int16_t)low | (uint32_t)(uint16_t)(int16_t)high << 16);
}

/* Two bfloat16 values (exact: taken from a bfloat16 query) as a dword's low and high half. */
static inline int32_t bf16_pair(float low, float high) {
    return (int32_t)((uint32_t)float_to_bf16(low) | (uint32_t)float_to_bf16(high) << 16);
}

/* A query head's values q as pairs for dot_scores: per 64 values (a block of 16 dwords, 4 bytes
 * each) and per k < 4, two vectors whose 128-bit lane L holds, four times, the pair of values
 * dword 4L + k's bytes 0 and 2 (lo) and 1 and 3 (hi) meet; int16 pairs of whole numbers for int8
 * rows, bfloat16 pairs for fp8 rows. */
static inline __attribute__((always_inline)) void query_pairs(const float *restrict q, int64_t D,
                                                             int32_t *restrict out, const int bf) {
    for (int64_t c = 0; c < D; c += 64)
        for (int64_t k = 0; k < 4; k++)
            for (int64_t L = 0; L < 4; L++) {
                const float *d = q + c + 4 * (4 * L + k);
                const int32_t lo = bf == DT_INT8 ? int16_pair(d[0], d[2]) : bf16_pair(d[0], d[2]);
                const int32_t hi = bf == DT_INT8 ? int16_pair(d[1], d[3]) : bf16_pair(d[1], d[3]);
                int32_t *v = out + (c / 64 * 4 + k) * 32 + 4 * L;
                for (int e = 0; e < 4; e++) v[e] = lo, v[16 + e] = hi;
            }
}

/* A query head as int16 pairs for the int8 dot products: one scale for the head (its largest value
 * maps to 32767, finer than the bfloat16 a model's query comes in). q is replaced by the values
 * the pairs stand for, so tokens the float kernel reads (a tile's last n % 16) see the same query.
 * Returns the scale. */
static inline __attribute__((always_inline)) float int16_query(float *restrict q, int64_t D, int32_t *restrict out) {
    float largest = 0.f;
    for (int64_t i = 0; i < D; i++) largest = fabsf(q[i]) > largest ? fabsf(q[i]) : largest;
    const float scale = largest / 32767.f, inverse = largest > 0.f ? 32767.f / largest : 0.f;
    for (int64_t i = 0; i < D; i++) q[i] = (float)lrintf(q[i] * inverse);
    query_pairs(q, D, out, DT_INT8);
    for (int64_t i = 0; i < D; i++) q[i] *= scale;
    return scale;
}

/* A bfloat16 query head (its values, widened: qf) as bfloat16 pairs for the fp8 dot products,
 * times 2^100 (exact), so that its products with fp8 values read as bfloat16 times 2^-120 stay far
 * from float32's subnormals. Returns what scores are multiplied by after: scale times 2^20. */
static inline __attribute__((always_inline)) float bf16_query(const float *restrict qf, int64_t D, float scale,
                                                             float *restrict buf, int32_t *restrict out) {
    for (int64_t i = 0; i < D; i++) buf[i] = qf[i] * 0x1p100f;
    query_pairs(buf, D, out, DT_FP8);
    return scale * 0x1p20f;
}

/* out[g * TILE + j] = q[g] . rows[j][off : off + D] for G query heads over int8 or fp8 rows whose
 * scales are one per 32 values, n a multiple of 16, D of 64: dot products of pairs, 32 products an
 * instruction, where the float kernel widens, scales and multiplies 16 values at a time. int8:
 * vpdpwssd on the bytes as int16 against the query rounded to int16; fp8: vdpbf16ps on the bytes
 * as bfloat16 (a shift and a mask: the e4m3 value times 2^-120; a subnormal e4m3 value, below
 * 2^-6 of the format's unit (1/28,672 of its group's largest), is then a bfloat16 subnormal, which
 * the instruction reads as zero) against the bfloat16 query. Four tokens' 64-byte blocks are
 * transposed within 128-bit lanes (two unpack stages), so lane (L, i) of a vector holds token
 * i's dword 4L + k: a query pair broadcast per 128-bit lane (query_pairs) meets it, and each
 * token's 16 partial sums a lane land in 4 lanes, reduced across lanes once per 16 tokens instead
 * of once a token and head. qv: the G heads' query pairs (2 D int32s a head), qscale what their
 * scores are multiplied by. */
static inline __attribute__((always_inline, target("arch=x86-64-v4,avx512vnni,avx512bf16"))) void dot_scores_heads(
        const int32_t *qv, const float *qscale, const int G, const void *const *rows, int64_t off, int64_t n,
        const int64_t D, const TileScales *sc, float *restrict out, const char *const *pf_k,
        const char *const *pf_v, int64_t pf_bytes, const int bf) {
    const __m512i fp8_bits = _mm512_set1_epi16((short)0x87f0); /* sign, exponent, mantissa */
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        if (pf_k) prefetch_tokens(pf_k, pf_v, j0, j0 + 16, pf_bytes);
        __m512 score[HEADS_AT_ONCE];
        for (int g = 0; g < G; g++) score[g] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D; c += 64) {
            __m512i acc[HEADS_AT_ONCE][4]; /* int32 sums (int8) or float32 bits (fp8) */
            for (int four = 0; four < 4; four++) {
                const int8_t *const *r = (const int8_t *const *)rows + j0 + 4 * four;
                const __m512i a = _mm512_loadu_si512(r[0] + off + c), b = _mm512_loadu_si512(r[1] + off + c);
                const __m512i x = _mm512_loadu_si512(r[2] + off + c), y = _mm512_loadu_si512(r[3] + off + c);
                const __m512i ab0 = _mm512_unpacklo_epi32(a, b), ab1 = _mm512_unpackhi_epi32(a, b);
                const __m512i xy0 = _mm512_unpacklo_epi32(x, y), xy1 = _mm512_unpackhi_epi32(x, y);
                const __m512i u[4] = {_mm512_unpacklo_epi64(ab0, xy0), _mm512_unpackhi_epi64(ab0, xy0),
                                      _mm512_unpacklo_epi64(ab1, xy1), _mm512_unpackhi_epi64(ab1, xy1)};
                for (int g = 0; g < G; g++) acc[g][four] = _mm512_setzero_si512();
                for (int k = 0; k < 4; k++) {
                    /* bytes 0 and 2 of each dword, and 1 and 3, as pairs of int16 or of bfloat16 */
                    __m512i lo, hi;
                    if (bf == DT_INT8) {
                        lo = _mm512_srai_epi16(_mm512_slli_epi16(u[k], 8), 8);
                        hi = _mm512_srai_epi16(u[k], 8);
                    } else {
                        lo = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(u[k], 8), 4), fp8_bits);
                        hi = _mm512_and_si512(_mm512_srai_epi16(u[k], 4), fp8_bits);
                    }
                    for (int g = 0; g < G; g++) {
                        const int32_t *qk = qv + g * 2 * D + (c / 64 * 4 + k) * 32;
                        const __m512i qlo = _mm512_loadu_si512(qk), qhi = _mm512_loadu_si512(qk + 16);
                        if (bf == DT_INT8) {
                            acc[g][four] = _mm512_dpwssd_epi32(acc[g][four], lo, qlo);
                            acc[g][four] = _mm512_dpwssd_epi32(acc[g][four], hi, qhi);
                        } else {
                            __m512 f = _mm512_castsi512_ps(acc[g][four]);
                            f = _mm512_dpbf16_ps(f, (__m512bh)lo, (__m512bh)qlo);
                            f = _mm512_dpbf16_ps(f, (__m512bh)hi, (__m512bh)qhi);
                            acc[g][four] = _mm512_castps_si512(f);
                        }
                    }
                }
            }
            float s0[16], s1[16]; /* the 16 tokens' scales of values [c, c + 32) and [c + 32, c + 64) */
            for (int t = 0; t < 16; t++) {
                const float *s = sc->rows[j0 + t] + sc->off + c / 32;
                s0[t] = s[0];
                s1[t] = s[1];
            }
            const __m512 scale0 = _mm512_loadu_ps(s0), scale1 = _mm512_loadu_ps(s1);
            for (int g = 0; g < G; g++) {
                /* lanes L 0-1 hold values [c, c + 32), 2-3 the rest: per token, the two halves' sums */
                const __m512i *v = acc[g];
                __m512 first, second;
                if (bf == DT_INT8) {
                    const __m512i ab = _mm512_add_epi32(_mm512_shuffle_i32x4(v[0], v[1], 0x88),
                                                        _mm512_shuffle_i32x4(v[0], v[1], 0xdd));
                    const __m512i xy = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2], v[3], 0x88),
                                                        _mm512_shuffle_i32x4(v[2], v[3], 0xdd));
                    first = _mm512_cvtepi32_ps(_mm512_shuffle_i32x4(ab, xy, 0x88));
                    second = _mm512_cvtepi32_ps(_mm512_shuffle_i32x4(ab, xy, 0xdd));
                } else {
                    const __m512 *f = (const __m512 *)v;
                    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(f[0], f[1], 0x88),
                                                    _mm512_shuffle_f32x4(f[0], f[1], 0xdd));
                    const __m512 xy = _mm512_add_ps(_mm512_shuffle_f32x4(f[2], f[3], 0x88),
                                                    _mm512_shuffle_f32x4(f[2], f[3], 0xdd));
                    first = _mm512_shuffle_f32x4(ab, xy, 0x88);
                    second = _mm512_shuffle_f32x4(ab, xy, 0xdd);
                }
                score[g] = _mm512_fmadd_ps(first, scale0, _mm512_fmadd_ps(second, scale1, score[g]));
            }
        }
        for (int g = 0; g < G; g++)
            _mm512_storeu_ps(out + g * TILE + j0, _mm512_mul_ps(score[g], _mm512_set1_ps(qscale[g])));
    }
}

/* dot_scores_heads for G consecutive query heads, HEADS_AT_ONCE at a time (each count a constant,
 * so the accumulators stay in registers). */
static inline __attribute__((always_inline, target("arch=x86-64-v4,avx512vnni,avx512bf16"))) void dot_scores_of(
        const int32_t *qv, const float *qscale, int64_t G, const void *const *rows, int64_t off, int64_t n,
        const int64_t D, const TileScales *sc, float *restrict out, const char *const *pf_k,
        const char *const *pf_v, int64_t pf_bytes, const int bf) {
    for (int64_t g0 = 0; g0 < G; g0 += HEADS_AT_ONCE) {
        const int32_t *qg = qv + g0 * 2 * D;
        if (G - g0 >= 3)
            dot_scores_heads(qg, qscale + g0, 3, rows, off, n, D, sc, out + g0 * TILE, pf_k, pf_v, pf_bytes, bf);
        else if (G - g0 == 2)
            dot_scores_heads(qg, qscale + g0, 2, rows, off, n, D, sc, out + g0 * TILE, pf_k, pf_v, pf_bytes, bf);
        else
            dot_scores_heads(qg, qscale + g0, 1, rows, off, n, D, sc, out + g0 * TILE, pf_k, pf_v, pf_bytes, bf);
        pf_k = pf_v = NULL;
    }
}

/* ... with the row type as a constant. */
__attribute__((target("arch=x86-64-v4,avx512vnni,avx512bf16"))) static void dot_scores(
        const int32_t *qv, const float *qscale, int64_t G, const void *const *rows, int64_t off, int64_t n,
        const int64_t D, const TileScales *sc, float *restrict out, const char *const *pf_k,
        const char *const *pf_v, int64_t pf_bytes, const int bf) {
    if (bf == DT_INT8)
        dot_scores_of(qv, qscale, G, rows, off, n, D, sc, out, pf_k, pf_v, pf_bytes, DT_INT8);
    else
        dot_scores_of(qv, qscale, G, rows, off, n, D, sc, out, pf_k, pf_v, pf_bytes, DT_FP8);
}

/* acc[g] += sum_j p[g * TILE + j] * rows[j][off : off + D] for G query heads over fp8 rows whose
 * scales are one per 32 values, D a multiple of 64: the weighted rows summed in bfloat16 pairs of
 * tokens (vdpbf16ps, 32 products an instruction), as FlashAttention weighs V rows in the model's
 * dtype on GPUs, where the float kernel widens, scales and multiplies 16 values at a time. Two
 * tokens' 64-byte blocks are interleaved byte by byte (within 128-bit lanes) and sign-extended, so
 * each dword holds one value of both as bfloat16 times 2^-120 (a shift and a mask; an e4m3
 * subnormal reads as zero); the weights, p times the token's group scale times 2^100, rounded to
 * bfloat16 (8 bits: the approximation this path makes), meet them as broadcast pairs. acc holds
 * the sums times 2^-20, each 64-value block in the lane order of the interleave (pair_order_undone). */
static inline __attribute__((always_inline, target("arch=x86-64-v4,avx512vnni,avx512bf16"))) void
fp8_pairs_heads(float *restrict acc, const int G, const float *restrict p, const void *const *rows, int64_t off,
                int64_t n, const int64_t D, const TileScales *sc) {
    const __m512i bits = _mm512_set1_epi16((short)0x87f0);
    for (int64_t c = 0; c < D; c += 64) {
        __m512 av[HEADS_AT_ONCE][4];
        for (int g = 0; g < G; g++)
            for (int v = 0; v < 4; v++) av[g][v] = _mm512_loadu_ps(acc + g * D + c + 16 * v);
        for (int64_t j0 = 0; j0 < n; j0 += 32) {
            const int64_t m = n - j0 < 32 ? n - j0 : 32;
            float s[2][32]; /* the block's tokens' scales of values [c, c + 32) and [c + 32, c + 64) */
            for (int64_t t = 0; t < 32; t++) {
                const float *row = t < m ? sc->rows[j0 + t] + sc->off + c / 32 : NULL;
                s[0][t] = row ? row[0] * 0x1p100f : 0.f;
                s[1][t] = row ? row[1] * 0x1p100f : 0.f;
            }
            const __mmask16 low = m >= 16 ? 0xffff : (__mmask16)((1u << m) - 1);
            const __mmask16 high = m >= 32 ? 0xffff : m <= 16 ? 0 : (__mmask16)((1u << (m - 16)) - 1);
            int32_t w[HEADS_AT_ONCE][2][16]; /* per head and group: token pairs' weights as bfloat16 pairs */
            for (int g = 0; g < G; g++)
                for (int gr = 0; gr < 2; gr++) {
                    const float *pg = p + g * TILE + j0;
                    const __m512 first = _mm512_maskz_mul_ps(low, _mm512_maskz_loadu_ps(low, pg), _mm512_loadu_ps(s[gr]));
                    const __m512 second = _mm512_maskz_mul_ps(high, _mm512_maskz_loadu_ps(high, pg + 16),
                                                              _mm512_loadu_ps(s[gr] + 16));
                    _mm512_storeu_si512(w[g][gr], (__m512i)_mm512_cvtne2ps_pbh(second, first));
                }
            for (int64_t i = 0; 2 * i < m; i++) {
                const int8_t *ra = (const int8_t *)rows[j0 + 2 * i] + off + c;
                const int8_t *rb = 2 * i + 1 < m ? (const int8_t *)rows[j0 + 2 * i + 1] + off + c : ra;
                const __m512i a = _mm512_loadu_si512(ra), b = _mm512_loadu_si512(rb);
                const __m512i lo = _mm512_unpacklo_epi8(a, b), hi = _mm512_unpackhi_epi8(a, b);
                const __m256i half[4] = {_mm512_castsi512_si256(lo), _mm512_extracti64x4_epi64(lo, 1),
                                         _mm512_castsi512_si256(hi), _mm512_extracti64x4_epi64(hi, 1)};
                for (int v = 0; v < 4; v++) {
                    const __m512i pair = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(half[v]), 4), bits);
                    for (int g = 0; g < G; g++)
                        av[g][v] = _mm512_dpbf16_ps(av[g][v], (__m512bh)pair,
                                                    (__m512bh)_mm512_set1_epi32(w[g][v & 1][i]));
                }
            }
        }
        for (int g = 0; g < G; g++)
            for (int v = 0; v < 4; v++) _mm512_storeu_ps(acc + g * D + c + 16 * v, av[g][v]);
    }
}

/* fp8_pairs_heads for G consecutive query heads, HEADS_AT_ONCE at a time. */
__attribute__((target("arch=x86-64-v4,avx512vnni,avx512bf16"))) static void fp8_pairs(
        float *restrict acc, int64_t G, const float *restrict p, const void *const *rows, int64_t off, int64_t n,
        const int64_t D, const TileScales *sc) {
    for (int64_t g0 = 0; g0 < G; g0 += HEADS_AT_ONCE) {
        float *ag = acc + g0 * D;
        const float *pg = p + g0 * TILE;
        if (G - g0 >= 3)
            fp8_pairs_heads(ag, 3, pg, rows, off, n, D, sc);
        else if (G - g0 == 2)
            fp8_pairs_heads(ag, 2, pg, rows, off, n, D, sc);
        else
            fp8_pairs_heads(ag, 1, pg, rows, off, n, D, sc);
    }
}

/* acc's values in fp8_pairs_heads's order put back in place (D a multiple of 64, tmp D floats):
 * per 64-value block, vector v's lane k holds value {0, 32, 8, 40}[v] + k + (k < 8 ? 0 : 8). */
static void pair_order_undone(float *restrict acc, int64_t D, float *restrict tmp) {
    static const int base[4] = {0, 32, 8, 40};
    for (int64_t c = 0; c < D; c += 64)
        for (int v = 0; v < 4; v++)
            for (int k = 0; k < 16; k++) tmp[c + base[v] + k + (k < 8 ? 0 : 8)] = acc[c + 16 * v + k];
    memcpy(acc, tmp, (size_t)D * 4);
}

/* One work item: every member's query heads' softmax over keys [lo, hi) of sequence rows_of. A
 * token's K (and V) rows of all kv heads are read together, the next tokens' prefetched: in the
 * token-major layout one layer's rows of consecutive tokens lie a whole model's token stride apart
 * (a new 4 KiB page each), which the hardware prefetcher does not follow.
 * Per tile: the scores of every (kv head, member, query head of that kv head) in that order, so a
 * kv head's rows are read from memory once and then from L1 by all members' heads of its group
 * (K rows read through pointers gathered once); the online softmax; then the weighted V rows,
 * accumulated in registers, in the same order.
 * scratch: M*Hq*D (q) + M*Hq*D (acc) + M*Hq*TILE (scores) + 2*M*Hq (max, sum) + 2*TILE*Hk*D (widened
 * rows) + M*Hq*(2*D + 1) (query pairs and their scales). */
static inline __attribute__((always_inline)) void process_item_d(const Args *a, const Work *w, float *scratch,
                                                                const int64_t D, const int wide, const int bf) {
    const int64_t Hq = a->num_q_heads, Hk = a->num_kv_heads, G = Hq / Hk, M = w->num_members;
    const int64_t QH = M * Hq; /* the item's query heads: member m's head h is m * Hq + h */
    const int64_t es = (int64_t)elem_size(a->dtype), b = w->rows_of, lo = w->lo, hi = w->hi;
    const int64_t kes = (int64_t)elem_size(bf); /* bf: the cache's row type (a DT_ code) */
    float *q = scratch, *acc = q + QH * D, *sc = acc + QH * D, *mx = sc + QH * TILE, *sum = mx + QH;
    float *ktile = sum + QH, *vtile = ktile + TILE * Hk * D; /* rows widened (narrow path) */
    int32_t *qv = (int32_t *)(vtile + TILE * Hk * D);        /* query pairs, 2 D a head (dot_scores) */
    float *qscale = (float *)(qv + QH * 2 * D);
    const int64_t groups = quantized(bf) ? D / a->group : 0; /* scales a quantized row carries */
    const float *kscales[TILE], *vscales[TILE];
    TileScales ks = {kscales, 0, a->group}, vs = {vscales, 0, a->group}; /* quantized rows' scales */
    const void *krow[TILE], *vrow[TILE];                     /* the tile's rows */
    const char *pf_k[TILE], *pf_v[TILE];                     /* rows PREFETCH tokens ahead */

    /* The grouped kernels read rows where they lie (widened in registers); the narrow ones read
     * float32, other rows widened (and scaled) into the tile buffers first. */
    const int grouped = wide && D % 16 == 0, in_place = bf == DT_FLOAT32 || grouped;
    /* int8 rows, or fp8 rows with a bfloat16 query, 32 values a scale: scores of 16 tokens at a
     * time from dot products of pairs (dot_scores) */
    const int dot_products = grouped && D % 64 == 0 && a->group == 32 &&
                             ((bf == DT_INT8 && int8_dot_products) ||
                              (bf == DT_FP8 && a->dtype == DT_BFLOAT16 && fp8_dot_products));
    /* The grouped kernels read fp8 values over 256 (load16_row): the query times 256 gives the
     * scores, the output times 256 the weighted rows (powers of two: exact). */
    const float fp8_unit = bf == DT_FP8 && grouped ? 256.f : 1.f;
    /* fp8 rows under a bfloat16 query: the V rows weighted in bfloat16 pairs (fp8_pairs), the
     * sums then 2^-20 of the values, in pair order */
    const int pairs = dot_products && bf == DT_FP8;
    const float out_unit = pairs ? 0x1p20f : fp8_unit;
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < Hq; h++) {
            const int64_t qh = m * Hq + h, member = w->members[m];
            const float *qf = row_f32(a->q + (member * a->q_sb + h * a->q_sh) * es, a->dtype, D, ktile);
            for (int64_t i = 0; i < D; i++) q[qh * D + i] = qf[i] * a->scale * fp8_unit;
            if (dot_products && bf == DT_INT8) qscale[qh] = int16_query(q + qh * D, D, qv + qh * 2 * D);
            if (dot_products && bf == DT_FP8) qscale[qh] = bf16_query(qf, D, a->scale, vtile, qv + qh * 2 * D);
            memset(acc + qh * D, 0, (size_t)D * 4);
            mx[qh] = -INFINITY;
            sum[qh] = 0.f;
        }
    /* the bytes from a token's first kv head to the end of its last: prefetched as one range */
    /* (quantized: and the scales, which follow the last head's values) */
    const int64_t scales = Hk * groups * 4;
    const int64_t k_span = ((Hk - 1) * a->k_sh + D) * kes + scales, v_span = ((Hk - 1) * a->v_sh + D) * kes + scales;
    const int64_t span = k_span > v_span ? k_span : v_span;
    /* head strides of the rows the tile kernels read: the cache's, or the widened tile's */
    const int64_t k_head = in_place ? a->k_sh : D, v_head = in_place ? a->v_sh : D;
    for (int64_t t0 = lo; t0 < hi; t0 += TILE) {
        int64_t n = hi - t0 < TILE ? hi - t0 : TILE;
        for (int64_t j = 0; j < n; j++) {
            const int64_t ahead = t0 + j + PREFETCH < hi ? t0 + j + PREFETCH : t0 + j;
            pf_k[j] = a->k + row_offset(a, b, ahead, a->k_so, a->k_st) * kes;
            pf_v[j] = a->v + row_offset(a, b, ahead, a->v_so, a->v_st) * kes;
            const char *k = a->k + row_offset(a, b, t0 + j, a->k_so, a->k_st) * kes;
            const char *v = a->v + row_offset(a, b, t0 + j, a->v_so, a->v_st) * kes;
            if (quantized(bf)) {
                kscales[j] = a->k_scale + row_offset(a, b, t0 + j, a->ks_so, a->ks_st);
                vscales[j] = a->v_scale + row_offset(a, b, t0 + j, a->vs_so, a->vs_st);
            }
            if (in_place) {
                krow[j] = k;
                vrow[j] = v;
                continue;
            }
            prefetch_row(pf_k[j], span); /* widened now: fetched now */
            prefetch_row(pf_v[j], span);
            float *kw = ktile + j * Hk * D, *vw = vtile + j * Hk * D;
            for (int64_t hk = 0; hk < Hk; hk++) {
                const int q8 = quantized(bf);
                kv_row_f32(k + hk * a->k_sh * kes, bf, D, q8 ? kscales[j] + hk * a->ks_sh : NULL, a->group, kw + hk * D);
                kv_row_f32(v + hk * a->v_sh * kes, bf, D, q8 ? vscales[j] + hk * a->vs_sh : NULL, a->group, vw + hk * D);
            }
            krow[j] = kw;
            vrow[j] = vw;
        }
        const int prefetching = in_place;
        for (int64_t hk = 0; hk < Hk; hk++)
            for (int64_t m = 0; m < M; m++) {
                const int64_t first = m * Hq + hk * G; /* the group's first query head */
                if (grouped) {
                    ks.off = hk * a->ks_sh;
                    const char *const *pk = prefetching && first == 0 ? pf_k : NULL;
                    const int64_t done = dot_products ? n / 16 * 16 : 0; /* the rest: the float kernel */
                    if (done)
                        dot_scores(qv + first * 2 * D, qscale + first, G, krow, hk * k_head, done, D, &ks,
                                   sc + first * TILE, pk, pf_v, span, bf);
                    TileScales rest = ks;
                    rest.rows += done;
                    group_scores(q + first * D, G, krow + done, hk * k_head, n - done, D, sc + first * TILE + done,
                                 pk ? pk + done : NULL, pf_v + done, span, bf, &rest);
                    continue;
                }
                for (int64_t qh = first; qh < first + G; qh++)
                    tile_scores(q + qh * D, krow, hk * k_head, n, D, sc + qh * TILE,
                                prefetching && qh == 0 ? pf_k : NULL, pf_v, span);
            }
        for (int64_t qh = 0; qh < QH; qh++) {
            float *row = sc + qh * TILE, m = mx[qh];
            if (a->softcap > 0.f)
                for (int64_t j = 0; j < n; j++) row[j] = a->softcap * tanhf(row[j] / a->softcap);
#pragma omp simd reduction(max : m)
            for (int64_t j = 0; j < n; j++) m = row[j] > m ? row[j] : m;
            float alpha = expf(mx[qh] - m), total = 0.f; /* exp(-inf) = 0 on the first tile */
#pragma omp simd reduction(+ : total)
            for (int64_t j = 0; j < n; j++) {
                row[j] = exp_nonpositive(row[j] - m);
                total += row[j];
            }
            if (alpha != 1.f)
                for (int64_t i = 0; i < D; i++) acc[qh * D + i] *= alpha;
            sum[qh] = sum[qh] * alpha + total;
            mx[qh] = m;
        }
        for (int64_t hk = 0; hk < Hk; hk++)
            for (int64_t m = 0; m < M; m++) {
                const int64_t first = m * Hq + hk * G;
                if (grouped) {
                    vs.off = hk * a->vs_sh;
                    if (pairs)
                        fp8_pairs(acc + first * D, G, sc + first * TILE, vrow, hk * v_head, n, D, &vs);
                    else
                        group_accumulate(acc + first * D, G, sc + first * TILE, vrow, hk * v_head, n, D, bf, &vs);
                    continue;
                }
                for (int64_t qh = first; qh < first + G; qh++)
                    tile_accumulate(acc + qh * D, sc + qh * TILE, vrow, hk * v_head, n, D);
            }
    }
    for (int64_t qh = 0; qh < QH; qh++) {
        const int64_t member = w->members[qh / Hq], h = qh % Hq;
        float *o = acc + qh * D;
        if (pairs) pair_order_undone(o, D, ktile);
        if (w->part >= 0) { /* partial output, normalized, and its log-sum-exp: combined below */
            int64_t at = (member * Hq + h) * a->num_parts + w->part;
            float inv = sum[qh] > 0.f ? 1.f / sum[qh] : 0.f;
            for (int64_t i = 0; i < D; i++) a->partial[at * D + i] = o[i] * out_unit * inv;
            a->lse[at] = sum[qh] > 0.f ? mx[qh] + logf(sum[qh]) : -INFINITY;
            continue;
        }
        float total = sum[qh];
        if (a->sinks) total += expf(sink_of(a, h) - mx[qh]); /* exp(-inf) when nothing was read */
        float inv = total > 0.f && sum[qh] > 0.f ? 1.f / total : 0.f;
        for (int64_t i = 0; i < D; i++) o[i] *= out_unit * inv;
        write_out(a, member, h, o);
    }
}

/* process_item_d with the common head sizes as constants: the tile loops then unroll fully and keep
 * the query and accumulator vectors in registers, where a runtime size leaves a bound check per
 * vector and the arrays on the stack. */
static inline __attribute__((always_inline)) void process_item_dtype(const Args *a, const Work *w, float *scratch,
                                                                    const int wide, const int bf) {
    if (a->head_dim == 64)
        process_item_d(a, w, scratch, 64, wide, bf);
    else if (a->head_dim == 128)
        process_item_d(a, w, scratch, 128, wide, bf);
    else
        process_item_d(a, w, scratch, a->head_dim, wide, bf);
}

/* ... and with the row type as a constant: the bf16, int8 and fp8 loads widen in registers, the
 * float32 ones stay plain loads. */
static inline __attribute__((always_inline)) void process_item_sizes(const Args *a, const Work *w, float *scratch,
                                                                    const int wide) {
    switch (a->kv_dtype) {
    case DT_BFLOAT16: process_item_dtype(a, w, scratch, wide, DT_BFLOAT16); break;
    case DT_INT8: process_item_dtype(a, w, scratch, wide, DT_INT8); break;
    case DT_FP8: process_item_dtype(a, w, scratch, wide, DT_FP8); break;
    default: process_item_dtype(a, w, scratch, wide, DT_FLOAT32);
    }
}

static int wide_registers; /* AVX-512: set at import */

/* AVX-512: a kv head's query heads together on 16-float vectors (32 registers hold them). */
__attribute__((target("arch=x86-64-v4"))) static void process_item_wide(const Args *a, const Work *w,
                                                                       float *scratch) {
    process_item_sizes(a, w, scratch, 1);
}

/* AVX2+FMA and the baseline: one query head at a time on 8-float vectors (with 16 registers the
 * grouped form spills, and its 16-float shuffles split across AVX lanes: 2.7x slower there). */
__attribute__((target_clones("arch=x86-64-v3", "default"))) static void process_item_narrow(const Args *a,
                                                                                          const Work *w,
                                                                                          float *scratch) {
    process_item_sizes(a, w, scratch, 0);
}

static void process_item(const Args *a, const Work *w, float *scratch) {
    if (wide_registers)
        process_item_wide(a, w, scratch);
    else
        process_item_narrow(a, w, scratch);
}

/* The parts of (sequence b, query head h), weighted by their exp(lse), into out. A part nothing
 * was written to (a prefix part of a sequence in no group) has lse -inf and is skipped. */
static void combine(const Args *a, int64_t bh, float *buf) {
    const int64_t D = a->head_dim, S = a->num_parts, h = bh % a->num_q_heads, b = bh / a->num_q_heads;
    const float *lse = a->lse + bh * S, *part = a->partial + bh * S * D;
    float m = -INFINITY, total = 0.f;
    for (int64_t s = 0; s < S; s++) m = lse[s] > m ? lse[s] : m;
    memset(buf, 0, (size_t)D * 4);
    if (m > -INFINITY) {
        for (int64_t s = 0; s < S; s++) {
            if (lse[s] == -INFINITY) continue;
            float w = expf(lse[s] - m);
            total += w;
            for (int64_t i = 0; i < D; i++) buf[i] += w * part[s * D + i];
        }
        if (a->sinks) total += expf(sink_of(a, h) - m);
        for (int64_t i = 0; i < D; i++) buf[i] /= total;
    }
    write_out(a, b, h, buf);
}

/* Whether the shared-prefix arrays describe groups: every leader in range and its own leader,
 * every member's prefix length its leader's and within its own length. */
static int prefixes_valid(const Args *a) {
    for (int64_t b = 0; b < a->batch; b++) {
        int32_t leader = a->prefix_leaders[b], len = a->prefix_lens[b];
        if (leader < 0 || leader >= a->batch || a->prefix_leaders[leader] != leader ||
            len != a->prefix_lens[leader] || len < 0 || len > a->seq_lens[b])
            return 0;
    }
    return 1;
}

/* The step's work items, largest first: per group of sequences sharing a prefix, the prefix in
 * up to `threads` splits of at least MIN_PREFIX_SPLIT keys (each read once for all members, into
 * parts 0..); then per sequence its own keys (past its prefix, or from its window start) in
 * num_splits splits (parts after the prefix's). members: 2 * B entries, the groups' member lists
 * then the identity. Sets a->num_parts; returns the number of items and the largest group. */
#define MIN_PREFIX_SPLIT 256
static int64_t plan(Args *a, int threads, Work *work, int32_t *members, int64_t *largest) {
    const int64_t B = a->batch, S = a->num_splits;
    int64_t n = 0, used = 0, prefix_parts = 0;
    *largest = 1;
    for (int64_t leader = 0; a->prefix_leaders && leader < B; leader++) {
        const int64_t len = a->prefix_lens[leader];
        if (a->prefix_leaders[leader] != leader || len == 0) continue;
        int32_t *group = members + used;
        int64_t size = 0;
        for (int64_t b = 0; b < B; b++)
            if (a->prefix_leaders[b] == leader) group[size++] = (int32_t)b;
        used += size;
        *largest = size > *largest ? size : *largest;
        int64_t parts = len / MIN_PREFIX_SPLIT < threads ? len / MIN_PREFIX_SPLIT : threads;
        parts = parts < 1 ? 1 : parts;
        const int64_t per = (len + parts - 1) / parts;
        for (int64_t p = 0; p < parts; p++)
            work[n++] = (Work){leader, p * per, (p + 1) * per < len ? (p + 1) * per : len, p, group, size};
        prefix_parts = parts > prefix_parts ? parts : prefix_parts;
    }
    a->num_parts = prefix_parts + S;
    for (int64_t b = 0; b < B; b++) {
        members[B + b] = (int32_t)b;
        const int64_t len = a->seq_lens[b];
        int64_t start = (a->window > 0 && len > a->window) ? len - a->window : 0;
        if (a->prefix_leaders) start = a->prefix_lens[b]; /* no window with a prefix */
        const int64_t per = (len - start + S - 1) / S;
        for (int64_t s = 0; s < S; s++) {
            const int64_t lo = start + s * per < len ? start + s * per : len;
            const int64_t hi = lo + per < len ? lo + per : len;
            work[n++] = (Work){b, lo, hi, a->num_parts > 1 ? prefix_parts + s : -1, members + B + b, 1};
        }
    }
    return n;
}

/* A float as an fp8 e4m3 byte, |x| <= 448, rounded to nearest even (as torch converts). */
static inline uint8_t float_to_fp8(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    const float mag = fabsf(x);
    if (mag < 0x1p-6f) /* subnormal: a multiple of 2^-9 (8 of them is the smallest normal, 0x08) */
        return sign | (uint8_t)nearbyintf(mag * 512.f);
    uint32_t bits = u & 0x7fffffffu;
    bits += 0x7ffffu + ((bits >> 20) & 1u); /* round the mantissa to 3 bits, ties to even */
    return sign | (uint8_t)((((bits >> 23) - 127 + 7) << 3) | ((bits >> 20) & 7u));
}

/* One group of n values (in the query's dtype) quantized as quantized_rows.quantize does:
 * scale = max|x| / QMAX (1 for a zero group), bytes = x / scale rounded (int8: to nearest even,
 * clamped to +-127; fp8: clamped to +-448, then rounded). */
static void quantize_row(const char *src, int dtype, int kv_dtype, int64_t n, char *dst, float *scale_out,
                         float *buf) {
    const float *x = row_f32(src, dtype, n, buf);
    float amax = 0.f;
    for (int64_t i = 0; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float qmax = kv_dtype == DT_INT8 ? 127.f : 448.f, scale = amax / qmax > 0.f ? amax / qmax : 1.f;
    for (int64_t i = 0; i < n; i++) {
        const float q = x[i] / scale;
        if (kv_dtype == DT_INT8)
            ((int8_t *)dst)[i] = (int8_t)fminf(fmaxf(nearbyintf(q), -127.f), 127.f);
        else
            ((uint8_t *)dst)[i] = float_to_fp8(fminf(fmaxf(q, -448.f), 448.f));
    }
    *scale_out = scale;
}

/* Each sequence's newest token's K and V rows into its own rows at seq_lens[b] - 1: the step's
 * cache write, done here before any read rather than as two indexed copies a layer in torch
 * (quantized rows: quantized here, with their scales). */
static void write_new_rows(const Args *a) {
    const int64_t es = (int64_t)elem_size(a->dtype), bytes = a->head_dim * es;
    float buf[512];
    for (int64_t b = 0; b < a->batch; b++) {
        const int64_t t = a->seq_lens[b] - 1;
        if (t < 0) continue;
        if (quantized(a->kv_dtype)) {
            char *k = (char *)a->k + row_offset(a, b, t, a->k_so, a->k_st);
            char *v = (char *)a->v + row_offset(a, b, t, a->v_so, a->v_st);
            float *ks = (float *)a->k_scale + row_offset(a, b, t, a->ks_so, a->ks_st);
            float *vs = (float *)a->v_scale + row_offset(a, b, t, a->vs_so, a->vs_st);
            for (int64_t hk = 0; hk < a->num_kv_heads; hk++)
                for (int64_t g = 0; g * a->group < a->head_dim; g++) {
                    const int64_t at = g * a->group;
                    quantize_row(a->new_k + (b * a->new_k_sb + hk * a->new_k_sh + at) * es, a->dtype, a->kv_dtype,
                                 a->group, k + hk * a->k_sh + at, ks + hk * a->ks_sh + g, buf);
                    quantize_row(a->new_v + (b * a->new_v_sb + hk * a->new_v_sh + at) * es, a->dtype, a->kv_dtype,
                                 a->group, v + hk * a->v_sh + at, vs + hk * a->vs_sh + g, buf);
                }
            continue;
        }
        char *k = (char *)a->k + row_offset(a, b, t, a->k_so, a->k_st) * es;
        char *v = (char *)a->v + row_offset(a, b, t, a->v_so, a->v_st) * es;
        for (int64_t hk = 0; hk < a->num_kv_heads; hk++) {
            memcpy(k + hk * a->k_sh * es, a->new_k + (b * a->new_k_sb + hk * a->new_k_sh) * es, (size_t)bytes);
            memcpy(v + hk * a->v_sh * es, a->new_v + (b * a->new_v_sb + hk * a->new_v_sh) * es, (size_t)bytes);
        }
    }
}

static int run(Args *a, int num_threads) {
    const int64_t B = a->batch, Hq = a->num_q_heads, D = a->head_dim;
    Work *work = malloc(sizeof(Work) * (size_t)(B * (a->num_splits + num_threads) + 1));
    int32_t *members = malloc(sizeof(int32_t) * (size_t)(2 * B + 1));
    int failed = !work || !members;
    int64_t items = 0, largest = 1;
    if (!failed) items = plan(a, num_threads, work, members, &largest);
    const int64_t parts = a->num_parts;
    const size_t scratch_floats = (size_t)(largest * (4 * Hq * D + Hq * TILE + 3 * Hq) +
                                           2 * TILE * a->num_kv_heads * D);
    if (!failed && parts > 1) {
        a->partial = malloc(sizeof(float) * (size_t)(B * Hq * parts * D));
        a->lse = malloc(sizeof(float) * (size_t)(B * Hq * parts));
        failed = !a->partial || !a->lse;
        for (int64_t i = 0; !failed && i < B * Hq * parts; i++) a->lse[i] = -INFINITY;
    }
    if (!failed && a->new_k) write_new_rows(a);
#pragma omp parallel num_threads(num_threads) if (!failed && num_threads > 1 && items > 1)
    {
        float *scratch = failed ? NULL : malloc(sizeof(float) * scratch_floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++)
            if (scratch) process_item(a, &work[item], scratch);
        if (parts > 1) {
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * Hq; bh++)
                if (scratch) combine(a, bh, scratch);
        }
        free(scratch);
    }
    free(a->partial);
    free(a->lse);
    free(work);
    free(members);
    return failed ? -1 : 0;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    unsigned long long q, out, k, v, index, seq_lens, sinks, prefix_leaders, prefix_lens, new_k = 0, new_v = 0;
    unsigned long long k_scale = 0, v_scale = 0;
    Args a = {0};
    double scale, softcap;
    int num_threads;
    a.kv_dtype = -1;
    if (!PyArg_ParseTuple(args, "KKKKKKKKK" "LLLLLLLLLLLLLLLL" "dLdiii" "|KKLLLL" "iKKLLLLLLL", &q, &out, &k, &v,
                          &index, &seq_lens, &sinks, &prefix_leaders, &prefix_lens,
                          &a.index_stride_b, &a.batch, &a.num_q_heads, &a.num_kv_heads, &a.head_dim,
                          &a.block_size, &a.q_sb, &a.q_sh, &a.out_sb, &a.out_sh, &a.k_so, &a.k_st, &a.k_sh,
                          &a.v_so, &a.v_st, &a.v_sh, &scale, &a.window, &softcap, &a.dtype, &a.num_splits,
                          &num_threads, &new_k, &new_v, &a.new_k_sb, &a.new_k_sh, &a.new_v_sb, &a.new_v_sh,
                          &a.kv_dtype, &k_scale, &v_scale, &a.ks_so, &a.ks_st, &a.ks_sh, &a.vs_so, &a.vs_st,
                          &a.vs_sh, &a.group))
        return NULL;
    if (a.kv_dtype < 0) a.kv_dtype = a.dtype; /* not given: the cache is in q's dtype */
    if (a.dtype != DT_FLOAT32 && a.dtype != DT_BFLOAT16) {
        PyErr_Format(PyExc_ValueError, "dtype code %d is not float32 (0) or bfloat16 (1)", a.dtype);
        return NULL;
    }
    if (a.kv_dtype < DT_FLOAT32 || a.kv_dtype > DT_FP8 || (!quantized(a.kv_dtype) && a.kv_dtype != a.dtype) ||
        (quantized(a.kv_dtype) && (!k_scale || !v_scale || a.head_dim > 512 || a.group < 1 ||
                                   a.head_dim % a.group))) {
        PyErr_Format(PyExc_ValueError, "kv dtype code %d: the query's (%d), or int8 (2) / fp8 (3) with both "
                     "scale views, head_dim <= 512 and a group dividing it", a.kv_dtype, a.dtype);
        return NULL;
    }
    a.k_scale = (const float *)(uintptr_t)k_scale;
    a.v_scale = (const float *)(uintptr_t)v_scale;
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
    a.prefix_leaders = (const int32_t *)(uintptr_t)prefix_leaders; /* int32 [B] each, or NULL */
    a.prefix_lens = (const int32_t *)(uintptr_t)prefix_lens;
    a.new_k = (const char *)(uintptr_t)new_k; /* both or neither: checked by cpu_decode */
    a.new_v = (const char *)(uintptr_t)new_v;
    if (!a.prefix_leaders != !a.prefix_lens || (a.prefix_leaders && (a.window > 0 || !prefixes_valid(&a)))) {
        PyErr_SetString(PyExc_ValueError, "shared prefixes: leaders and lengths come together, with no window; "
                        "every leader leads itself, and a member's prefix length is its leader's and "
                        "at most its own length");
        return NULL;
    }
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
             "decode(q, out, k, v, index, seq_lens, sinks, prefix_leaders, prefix_lens, index_stride_b, batch, num_q_heads, num_kv_heads,\n"
             "       head_dim, block_size, q_sb, q_sh, out_sb, out_sh, k_so, k_st, k_sh, v_so, v_st, v_sh,\n"
             "       scale, window, softcap, dtype, num_splits, num_threads[, new_k, new_v, new_k_sb, new_k_sh,\n"
             "       new_v_sb, new_v_sh[, kv_dtype, k_scale, v_scale, ks_so, ks_st, ks_sh, vs_so, vs_st, vs_sh, group]])\n\n"
             "Raw data pointers and element strides; checked by vmemkv.attention.cpu_decode, not here.");

/* A kernel switch's value, set to the optional flag in args first (refused with `missing` where
 * the CPU lacks what the path needs); returns the value before. */
static PyObject *kernel_switch(PyObject *args, int *value, int supported, const char *missing) {
    int flag = -1;
    if (!PyArg_ParseTuple(args, "|p", &flag)) return NULL;
    const int before = *value;
    if (flag == 1 && !supported) {
        PyErr_SetString(PyExc_ValueError, missing);
        return NULL;
    }
    if (flag >= 0) *value = flag;
    return PyBool_FromLong(before);
}

static PyObject *grouped_heads(PyObject *self, PyObject *args) {
    return kernel_switch(args, &wide_registers, __builtin_cpu_supports("avx512f"),
                         "grouped heads need AVX-512, which this CPU lacks");
}

static PyObject *integer_dot_products(PyObject *self, PyObject *args) {
    return kernel_switch(args, &int8_dot_products,
                         __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni"),
                         "integer dot products need AVX-512 VNNI, which this CPU lacks");
}

static PyObject *bf16_dot_products(PyObject *self, PyObject *args) {
    return kernel_switch(args, &fp8_dot_products,
                         __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16"),
                         "bfloat16 dot products need AVX-512 BF16, which this CPU lacks");
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, decode_doc},
    {"grouped_heads", grouped_heads, METH_VARARGS,
     "grouped_heads([flag]): whether a kv head's query heads are read together on 16-float vectors\n"
     "(AVX-512; else one head at a time on 8-float ones); with flag, set it (for tests of the other\n"
     "path); returns the value before."},
    {"integer_dot_products", integer_dot_products, METH_VARARGS,
     "integer_dot_products([flag]): whether the grouped kernel scores int8 rows (64-value blocks) with\n"
     "AVX-512 VNNI dot products of the query rounded to int16; with flag, set it (for tests of the\n"
     "other path); returns the value before."},
    {"bf16_dot_products", bf16_dot_products, METH_VARARGS,
     "bf16_dot_products([flag]): whether the grouped kernel reads fp8 rows (64-value blocks) under a\n"
     "bfloat16 query with AVX-512 BF16 dot products (keys' scores, and V rows weighted in bfloat16);\n"
     "with flag, set it (for tests of the other path); returns the value before."},
    {"has_openmp", has_openmp, METH_NOARGS, "Whether this build runs work items on OpenMP threads."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_decode_attention",
                                    "CPU decode attention over slot views and block tables.", -1, methods};

PyMODINIT_FUNC PyInit__decode_attention(void) {
    __builtin_cpu_init();
    wide_registers = __builtin_cpu_supports("avx512f");
    int8_dot_products = wide_registers && __builtin_cpu_supports("avx512vnni");
    fp8_dot_products = wide_registers && __builtin_cpu_supports("avx512bf16");
    return PyModule_Create(&module);
}
