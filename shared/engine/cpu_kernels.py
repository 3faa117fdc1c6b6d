"""Compiled CPU kernels for float32 inference: a GEMM over weights stored as column panels.

Why a kernel of our own: the weights live in the unified memory pool and the engine computes on views of
its pages, so a GEMM library that wants its own pre-packed copy (oneDNN's packed weights, MKL's packed
GEMM) would need a second copy of every weight outside the pool. Unpacked, oneDNN re-lays out the whole
weight matrix on every call and MKL takes a slow path on AMD CPUs: a decode step then spends 40-60% more
time in its linear layers than with packed weights. This kernel reads the layout it wants straight from
the pool's pages.

The panel layout: a weight W [N, K] (nn.Linear's [out, in]) is stored as ``[ceil(N/64), K, 64]`` float32,
panel j holding W[64j : 64j+64, :]^T (the last panel zero-padded). `to_panels` / `from_panels` convert.
``linear(x, panels, n)`` computes x @ W^T for x [M, K]. Every output element is summed over K in the
same order whatever M is, so a row's result does not depend on the batch it runs in.

The C source below is compiled once per machine with the system's C compiler (`cc`, `-O3 -march=native
-fopenmp`) into ``$KUNSERVE_KERNEL_CACHE`` (default ``~/.cache/kunserve/kernels``) and loaded with ctypes;
the OpenMP runtime is the one torch already loaded (same soname), and the thread count is torch's. Where
that cannot happen (no compiler, no AVX-512 on the CPU, ``KUNSERVE_CPU_KERNELS=0``) `linear` computes the
same product with a batched torch matmul over the panels: correct everywhere, slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading

import torch

PANEL = 64  # output columns per panel: four 16-float AVX-512 vectors

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NR 64
#define MR 6
#define KC 256
/* Below this many multiply-adds a call runs on one thread: a parallel region's start and barrier cost more than
   the split saves, and an engine sharing the cores with others would wait on descheduled team threads. */
#define PARALLEL_MIN_WORK (1L << 22)

/* C[0:mr, 0:64] (+)= A[0:mr, 0:kc] @ Bp[0:kc, 0:64]; Bp rows are 64 contiguous floats. */
static inline void tile(int mr, int kc, const float *a, long lda, const float *b, float *c, long ldc,
                        int accumulate, __mmask16 m0, __mmask16 m1, __mmask16 m2, __mmask16 m3) {
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00,
           c20 = c00, c21 = c00, c22 = c00, c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00,
           c40 = c00, c41 = c00, c42 = c00, c43 = c00, c50 = c00, c51 = c00, c52 = c00, c53 = c00;
    const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda, *a4 = a + 4 * lda, *a5 = a + 5 * lda;
#define ROW(i) { __m512 x = _mm512_set1_ps(a##i[k]); \
    c##i##0 = _mm512_fmadd_ps(x, b0, c##i##0); c##i##1 = _mm512_fmadd_ps(x, b1, c##i##1); \
    c##i##2 = _mm512_fmadd_ps(x, b2, c##i##2); c##i##3 = _mm512_fmadd_ps(x, b3, c##i##3); }
#define LOADB const float *bk = b + (long)k * NR; \
    __m512 b0 = _mm512_loadu_ps(bk), b1 = _mm512_loadu_ps(bk + 16), b2 = _mm512_loadu_ps(bk + 32), \
           b3 = _mm512_loadu_ps(bk + 48);
    switch (mr) {
    case 6: for (int k = 0; k < kc; k++) { LOADB ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) } break;
    case 5: for (int k = 0; k < kc; k++) { LOADB ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) } break;
    case 4: for (int k = 0; k < kc; k++) { LOADB ROW(0) ROW(1) ROW(2) ROW(3) } break;
    case 3: for (int k = 0; k < kc; k++) { LOADB ROW(0) ROW(1) ROW(2) } break;
    case 2: for (int k = 0; k < kc; k++) { LOADB ROW(0) ROW(1) } break;
    default: for (int k = 0; k < kc; k++) { LOADB ROW(0) } break;
    }
#define STORE(i) if (mr > i) { float *ci = c + i * ldc; \
    if (accumulate) { \
        c##i##0 = _mm512_add_ps(c##i##0, _mm512_maskz_loadu_ps(m0, ci)); \
        c##i##1 = _mm512_add_ps(c##i##1, _mm512_maskz_loadu_ps(m1, ci + 16)); \
        c##i##2 = _mm512_add_ps(c##i##2, _mm512_maskz_loadu_ps(m2, ci + 32)); \
        c##i##3 = _mm512_add_ps(c##i##3, _mm512_maskz_loadu_ps(m3, ci + 48)); } \
    _mm512_mask_storeu_ps(ci, m0, c##i##0); _mm512_mask_storeu_ps(ci + 16, m1, c##i##1); \
    _mm512_mask_storeu_ps(ci + 32, m2, c##i##2); _mm512_mask_storeu_ps(ci + 48, m3, c##i##3); }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
}

static inline __mmask16 lanes(int n) { return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

/* C [M, N] (row stride ldc) = A [M, K] (row stride lda) @ W^T, W given as panels [ceil(N/64), K, 64]. */
void kunserve_linear_panels(int M, int N, int K, const float *A, long lda, const float *B, float *C, long ldc,
                            int nthreads) {
    int npanels = (N + NR - 1) / NR;
    if ((long)M * N * K < PARALLEL_MIN_WORK) nthreads = 1;
    /* dynamic: a team thread the OS has descheduled (cores shared with other processes) holds up one panel,
       not a static half of them */
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (nthreads > 1)
    for (int jp = 0; jp < npanels; jp++) {
        const float *bp = B + (long)jp * K * NR;
        int nv = N - jp * NR < NR ? N - jp * NR : NR;
        __mmask16 m0 = lanes(nv), m1 = lanes(nv - 16), m2 = lanes(nv - 32), m3 = lanes(nv - 48);
        for (int kb = 0; kb < K; kb += KC) {
            int kc = K - kb < KC ? K - kb : KC;
            for (int i = 0; i < M; i += MR) {
                int mr = M - i < MR ? M - i : MR;
                tile(mr, kc, A + (long)i * lda + kb, lda, bp + (long)kb * NR, C + (long)i * ldc + (long)jp * NR, ldc,
                     kb > 0, m0, m1, m2, m3);
            }
        }
    }
}
/* e^x for x <= 0 (softmax after subtracting the maximum): 2^n * p(r), |r| <= ln2/2, Taylor to r^7
   (relative error below 1e-8, under float32's 6e-8 step). */
static inline __m512 exp_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The 16 horizontal sums of a[0..15] as one vector (lane j = sum of a[j]'s lanes): a transpose-and-add tree,
   45 instructions instead of 16 separate reductions. */
static inline __m512 sum16(const __m512 *a) {
    __m512 r[8], q[4];
    for (int j = 0; j < 8; j++)
        r[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
    for (int j = 0; j < 4; j++) {
        __m512d x = _mm512_castps_pd(r[2 * j]), y = _mm512_castps_pd(r[2 * j + 1]);
        q[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* q[j]: 128-bit chunk c holds tokens 4j..4j+3 summed over lanes 4c..4c+3 of their vectors */
    __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(q[0], q[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(q[0], q[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(q[2], q[3], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(q[2], q[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Decode attention straight over the paged cache (no gather): for every sequence b and query head
   i = h * G + g (G = H / KVH query heads per KV head h), out[b, i] = softmax(scale * q[b, i] . K_t) V_t over
   the first ctx[b] tokens t of the sequence, token t living in block tables[b, t / bs] at offset t % bs.
   cache: [blocks, 2, KVH, bs, D] (K then V) by its strides in floats: block_stride, kv_stride (K to V),
   head_stride, tokens D apart (any physical order of block, K/V and head: the pool's is header-centric);
   q rows b at q + b * q_stride, heads D apart; D % 16 == 0, D <= 256. Scores go through a per-thread buffer;
   V is accumulated four query heads at a time in registers. */
int kunserve_decode_attention(int B, int H, int KVH, int D, int bs, const float *q, long q_stride,
                              const float *cache, long num_blocks, long block_stride, long kv_stride,
                              long head_stride, const int64_t *tables, int table_width, const int64_t *ctx,
                              float *out, float scale, int nthreads) {
    int G = H / KVH, nv = D / 16;
    int max_ctx = 1;
    long work = 0;
    for (int b = 0; b < B; b++) {
        if (ctx[b] < 1 || ctx[b] > (long)table_width * bs) return -1;
        for (long j = 0; j < (ctx[b] + bs - 1) / bs; j++)
            if (tables[(long)b * table_width + j] < 0 || tables[(long)b * table_width + j] >= num_blocks) return -2;
        if (ctx[b] > max_ctx) max_ctx = (int)ctx[b];
        work += ctx[b];
    }
    if (work * H * D < PARALLEL_MIN_WORK) nthreads = 1;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        long stride_s = max_ctx + 16;
        float *s = (float *)malloc(sizeof(float) * (size_t)G * stride_s);
        const float **rows = (const float **)malloc(sizeof(float *) * (size_t)stride_s);
        #pragma omp for schedule(dynamic, 1)
        for (int bh = 0; bh < B * KVH; bh++) {
            int b = bh / KVH, h = bh % KVH, n = (int)ctx[b];
            const float *qb = q + (long)b * q_stride + (long)h * G * D;
            const int64_t *table = tables + (long)b * table_width;
            for (int t = 0, o = 0, j = 0; t < n; t++) {  /* where each token's K row is (its V row: + kv_stride) */
                rows[t] = cache + table[j] * block_stride + (long)h * head_stride + (long)o * D;
                if (++o == bs) { o = 0; j++; }
            }
            for (int g = 0; g < G; g++) {
                const float *qg = qb + (long)g * D;
                float *sg = s + g * stride_s;
                __m512 qv[16];
                for (int v = 0; v < nv; v++) qv[v] = _mm512_loadu_ps(qg + 16 * v);
                for (int t0 = 0; t0 < n; t0 += 16) {
                    __m512 a[16];
                    for (int j = 0; j < 16; j++) {
                        if (t0 + j < n) {
                            const float *k = rows[t0 + j];
                            __m512 x = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
                            for (int v = 1; v < nv; v++) x = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(k + 16 * v), x);
                            a[j] = x;
                        } else {
                            a[j] = _mm512_setzero_ps();
                        }
                    }
                    _mm512_storeu_ps(sg + t0, _mm512_mul_ps(sum16(a), _mm512_set1_ps(scale)));
                }
                __m512 mx = _mm512_set1_ps(-INFINITY);
                int t = 0;
                for (; t + 16 <= n; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + t));
                if (t < n)
                    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY),
                                                                (__mmask16)((1u << (n - t)) - 1), sg + t));
                __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
                __m512 sum = _mm512_setzero_ps();
                for (t = 0; t < n; t += 16) {
                    __mmask16 mk = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1);
                    __m512 e = _mm512_maskz_mov_ps(mk, exp_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sg + t), m)));
                    _mm512_mask_storeu_ps(sg + t, mk, e);
                    sum = _mm512_add_ps(sum, e);
                }
                __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
                for (t = 0; t < n; t += 16) _mm512_storeu_ps(sg + t, _mm512_mul_ps(_mm512_loadu_ps(sg + t), inv));
            }
            long v_off = kv_stride;
            for (int g0 = 0; g0 < G; g0 += 4) {
                int gn = G - g0 < 4 ? G - g0 : 4;
                for (int v0 = 0; v0 < nv; v0 += 4) {
                    int vn = nv - v0 < 4 ? nv - v0 : 4;
                    __m512 acc[4][4];
                    for (int g = 0; g < 4; g++)
                        for (int v = 0; v < 4; v++) acc[g][v] = _mm512_setzero_ps();
                    for (int t = 0; t < n; t++) {
                        const float *vt = rows[t] + v_off + 16 * v0;
                        __m512 x0 = _mm512_loadu_ps(vt), x1 = vn > 1 ? _mm512_loadu_ps(vt + 16) : x0,
                               x2 = vn > 2 ? _mm512_loadu_ps(vt + 32) : x0, x3 = vn > 3 ? _mm512_loadu_ps(vt + 48) : x0;
                        for (int g = 0; g < 4; g++) {
                            if (g < gn) {
                                __m512 p = _mm512_set1_ps(s[(g0 + g) * stride_s + t]);
                                acc[g][0] = _mm512_fmadd_ps(p, x0, acc[g][0]);
                                acc[g][1] = _mm512_fmadd_ps(p, x1, acc[g][1]);
                                acc[g][2] = _mm512_fmadd_ps(p, x2, acc[g][2]);
                                acc[g][3] = _mm512_fmadd_ps(p, x3, acc[g][3]);
                            }
                        }
                    }
                    for (int g = 0; g < gn; g++) {
                        float *o = out + ((long)b * H + (long)h * G + g0 + g) * D + 16 * v0;
                        for (int v = 0; v < vn; v++) _mm512_storeu_ps(o + 16 * v, acc[g][v]);
                    }
                }
            }
        }
        free(rows);
        free(s);
    }
    return 0;
}


/* e^x over the float range (silu): the same polynomial, clamped at both ends. */
static inline __m512 exp_any(__m512 x) {
    return exp_nonpos(_mm512_min_ps(x, _mm512_set1_ps(88.0f)));
}

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i] for gu [T, 2I] (row stride ld), out [T, I] contiguous. */
void kunserve_silu_mul(int T, int I, const float *gu, long ld, float *out) {
    for (int t = 0; t < T; t++) {
        const float *g = gu + (long)t * ld, *u = g + I;
        float *o = out + (long)t * I;
        for (int i = 0; i < I; i += 16) {
            __mmask16 mk = I - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (I - i)) - 1);
            __m512 x = _mm512_maskz_loadu_ps(mk, g + i);
            __m512 sig = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_any(_mm512_sub_ps(_mm512_setzero_ps(), x))));
            _mm512_mask_storeu_ps(o + i, mk, _mm512_mul_ps(sig, _mm512_maskz_loadu_ps(mk, u + i)));
        }
    }
}

/* RoPE on the q and k heads of each row of qkv [T, (H + 2 KVH) * D] in place (x * cos + rotate_half(x) * sin,
   two products and a sum, as transformers computes it; cos / sin rows [D] of the token's position), then the
   token's k and v heads into its cache slot: cache[blk, 0, h, off] = k_h, cache[blk, 1, h, off] = v_h, the cache
   addressed by its strides in floats as in kunserve_decode_attention. D % 32 == 0. */
int kunserve_rope_store(int T, int H, int KVH, int D, const float *cos_tab, const float *sin_tab, long max_pos,
                        const int64_t *positions, float *qkv, long ld, float *cache, long num_blocks, int bs,
                        long block_stride, long kv_stride, long head_stride, const int64_t *slot_blocks,
                        const int64_t *slot_offsets) {
    for (int t = 0; t < T; t++) {
        if (positions[t] < 0 || positions[t] >= max_pos) return -1;
        if (slot_blocks[t] < 0 || slot_blocks[t] >= num_blocks || slot_offsets[t] < 0 || slot_offsets[t] >= bs)
            return -2;
    }
    int half = D / 2;
    for (int t = 0; t < T; t++) {
        const float *c = cos_tab + positions[t] * D, *sn = sin_tab + positions[t] * D;
        float *row = qkv + (long)t * ld;
        for (int hh = 0; hh < H + KVH; hh++) {
            float *x = row + (long)hh * D;
            for (int i = 0; i < half; i += 16) {
                __m512 x1 = _mm512_loadu_ps(x + i), x2 = _mm512_loadu_ps(x + half + i);
                __m512 o1 = _mm512_add_ps(_mm512_mul_ps(x1, _mm512_loadu_ps(c + i)),
                                          _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), _mm512_loadu_ps(sn + i)));
                __m512 o2 = _mm512_add_ps(_mm512_mul_ps(x2, _mm512_loadu_ps(c + half + i)),
                                          _mm512_mul_ps(x1, _mm512_loadu_ps(sn + half + i)));
                _mm512_storeu_ps(x + i, o1);
                _mm512_storeu_ps(x + half + i, o2);
            }
        }
        float *dst = cache + slot_blocks[t] * block_stride + slot_offsets[t] * D;
        for (int h = 0; h < KVH; h++) {
            memcpy(dst + (long)h * head_stride, row + (long)(H + h) * D, sizeof(float) * D);
            memcpy(dst + kv_stride + (long)h * head_stride, row + (long)(H + KVH + h) * D, sizeof(float) * D);
        }
    }
    return 0;
}

/* x += d in place, then h = x / sqrt(mean(x^2) + eps) * w, for rows of length N (x, d, h contiguous [T, N]). */
void kunserve_add_rms_norm(int T, int N, float *x, const float *d, const float *w, float eps, float *h) {
    for (int t = 0; t < T; t++) {
        float *xr = x + (long)t * N, *hr = h + (long)t * N;
        const float *dr = d + (long)t * N;
        __m512 ss = _mm512_setzero_ps();
        for (int i = 0; i < N; i += 16) {
            __mmask16 mk = N - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - i)) - 1);
            __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(mk, xr + i), _mm512_maskz_loadu_ps(mk, dr + i));
            _mm512_mask_storeu_ps(xr + i, mk, v);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / N + eps));
        for (int i = 0; i < N; i += 16) {
            __mmask16 mk = N - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - i)) - 1);
            __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, xr + i), r);
            _mm512_mask_storeu_ps(hr + i, mk, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mk, w + i)));
        }
    }
}
"""

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why_not = ""


def to_panels(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> panels [ceil(N/64), K, 64] (a new tensor; the tail panel's padding columns are zero)."""
    n, k = w.shape
    npan = -(-n // PANEL)
    if npan * PANEL != n:
        w = torch.cat([w, w.new_zeros(npan * PANEL - n, k)])
    return w.reshape(npan, PANEL, k).transpose(1, 2).contiguous()


def from_panels(p: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `to_panels`: W [n, K]."""
    npan, k, _ = p.shape
    return p.transpose(1, 2).reshape(npan * PANEL, k)[:n]


def panels_shape(n: int, k: int) -> tuple[int, int, int]:
    return (-(-n // PANEL), k, PANEL)


def _cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("KUNSERVE_KERNEL_CACHE", "~/.cache/kunserve/kernels")).expanduser()


def _cpu_flags() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build() -> ctypes.CDLL:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc / gcc) on PATH")
    if "avx512f" not in _cpu_flags():
        raise RuntimeError("the CPU has no AVX-512F")
    flags = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join([_SOURCE, cc, version, *flags, _cpu_flags()]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_kernels-{key}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            src = pathlib.Path(tmp) / "cpu_kernels.c"
            src.write_text(_SOURCE)
            so = pathlib.Path(tmp) / "cpu_kernels.so"
            res = subprocess.run([cc, *flags, "-o", str(so), str(src)], capture_output=True, text=True, check=False)
            if res.returncode != 0:
                raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-400:]}")
            os.replace(so, out)  # atomic: processes compiling at once each install a whole file
    lib = ctypes.CDLL(str(out))
    fn = lib.kunserve_linear_panels
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    fn.restype = None
    att = lib.kunserve_decode_attention
    att.argtypes = [ctypes.c_int] * 5 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                         ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                         ctypes.c_void_p, ctypes.c_float, ctypes.c_int]
    att.restype = ctypes.c_int
    lib.kunserve_silu_mul.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    lib.kunserve_silu_mul.restype = None
    lib.kunserve_rope_store.argtypes = ([ctypes.c_int] * 4 + [ctypes.c_void_p] * 2 + [ctypes.c_long]
                                        + [ctypes.c_void_p] * 2 + [ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                                                                   ctypes.c_int] + [ctypes.c_long] * 3
                                        + [ctypes.c_void_p, ctypes.c_void_p])
    lib.kunserve_rope_store.restype = ctypes.c_int
    lib.kunserve_add_rms_norm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p]
    lib.kunserve_add_rms_norm.restype = None
    return lib


def _library() -> ctypes.CDLL | None:
    global _lib, _tried, _why_not
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("KUNSERVE_CPU_KERNELS", "1") == "0":
                _why_not = "disabled by KUNSERVE_CPU_KERNELS=0"
            else:
                try:
                    _lib = _build()
                except (OSError, RuntimeError) as exc:
                    _why_not = str(exc)
            _tried = True
    return _lib


def available() -> bool:
    """Whether the compiled kernel runs here (else `linear` uses the torch fallback)."""
    return _library() is not None


def unavailable_reason() -> str:
    _library()
    return _why_not


def linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 @ W^T (+ bias) for W [n, K] stored as `panels` [ceil(n/64), K, 64]: [M, n]."""
    m, k = x.shape
    if panels.dim() != 3 or panels.shape[1] != k or panels.shape[2] != PANEL or panels.shape[0] * PANEL < n:
        raise ValueError(f"panels {tuple(panels.shape)} do not hold a [{n}, {k}] weight")
    if x.stride(1) != 1:
        x = x.contiguous()
    lib = _library()
    if lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or not panels.is_contiguous():
        return linear_torch(x, panels, n, bias)
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        lib.kunserve_linear_panels(m, n, k, x.data_ptr(), x.stride(0), panels.data_ptr(), y.data_ptr(), n,
                                   torch.get_num_threads())
    if bias is not None:
        y += bias
    return y


def linear_torch(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` as one batched torch matmul over the panels: the fallback (any device, any dtype)."""
    y = torch.matmul(x.unsqueeze(0), panels)  # [P, M, 64]
    y = y.transpose(0, 1).reshape(x.shape[0], panels.shape[0] * PANEL)[:, :n]
    if bias is not None:
        y = y + bias
    return y.contiguous()


def _token_rows_contiguous(cache: torch.Tensor) -> bool:
    """Whether a cache view `[blocks, 2, heads, block_size, head_dim]` has each block's tokens of one head as
    contiguous rows (what the kernels' address math assumes; block, K/V and head strides are passed)."""
    return cache.dim() == 5 and cache.stride(4) == 1 and cache.stride(3) == cache.shape[4]


def _cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    """(block, K-to-V, head) strides of a cache view, in elements."""
    return cache.stride(0), cache.stride(1), cache.stride(2)


def decode_attention_supported(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether `decode_attention` runs the compiled kernel for these tensors (float32 CPU, head_dim a multiple
    of 16 up to 256)."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and cache.dtype == torch.float32
            and _token_rows_contiguous(cache) and q.shape[-1] % 16 == 0 and q.shape[-1] <= 256 and q.stride(-1) == 1
            and q.stride(-2) == q.shape[-1] and _library() is not None)


def decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query token per sequence over the paged cache, read in place: q [B, H, D] (rows may be strided, heads
    contiguous), cache [blocks, 2, KVH, block_size, D] (any block / K-V / head strides, e.g. the header-centric
    pool's view), block_tables [B, width] int64, context_lens [B] int64 (>= 1). Returns [B, H, D]. Callers check
    `decode_attention_supported` first."""
    lib = _library()
    assert lib is not None
    b, h, d = q.shape
    kvh, bs = cache.shape[2], cache.shape[3]
    if cache.shape[4] != d or h % kvh:
        raise ValueError(f"decode attention: {h} query heads of {d} over a cache of {kvh} KV heads of {cache.shape[4]}")
    tables = block_tables.contiguous()
    lens = context_lens.contiguous()
    out = torch.empty(b, h, d, dtype=torch.float32)
    if b:
        rc = lib.kunserve_decode_attention(b, h, kvh, d, bs, q.data_ptr(), q.stride(0), cache.data_ptr(), cache.shape[0],
                                           *_cache_strides(cache), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
                                           out.data_ptr(), scale, torch.get_num_threads())
        if rc == -1:
            raise IndexError(f"a context length is outside [1, {tables.shape[1] * bs}] (the block table's width)")
        if rc:
            raise IndexError(f"a block table names a block outside the cache's {cache.shape[0]}")
    return out


def fused_layer_ops_supported(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether `silu_mul`, `rope_store` and `add_rms_norm` run here (float32 CPU, head_dim % 32 == 0)."""
    return device.type == "cpu" and dtype == torch.float32 and head_dim % 32 == 0 and _library() is not None


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gu[:, :I]) * gu[:, I:] for gu [T, 2I] (rows contiguous): [T, I]."""
    lib = _library()
    assert lib is not None and gu.stride(1) == 1
    t, two_i = gu.shape
    out = torch.empty(t, two_i // 2, dtype=torch.float32)
    lib.kunserve_silu_mul(t, two_i // 2, gu.data_ptr(), gu.stride(0), out.data_ptr())
    return out


def rope_store(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor, cache: torch.Tensor, slot_blocks: torch.Tensor,
               slot_offsets: torch.Tensor) -> None:
    """In place on qkv [T, (heads + 2 kv_heads) * head_dim]: RoPE on the q and k heads (cos / sin [max_pos, head_dim]
    tables, positions [T] int64), then each token's k and v heads into cache [blocks, 2, kv_heads, bs, head_dim] (any
    block / K-V / head strides) at (slot_blocks[t], slot_offsets[t])."""
    lib = _library()
    assert lib is not None and qkv.stride(1) == 1 and _token_rows_contiguous(cache) and cos.is_contiguous()
    if cache.shape[2] != kv_heads or cache.shape[4] != head_dim or qkv.shape[1] != (heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"rope_store: {kv_heads} KV heads of {head_dim} for a cache of {cache.shape[2]} of "
                         f"{cache.shape[4]} and qkv rows of {qkv.shape[1]}")
    blocks, offsets = slot_blocks.contiguous(), slot_offsets.contiguous()
    rc = lib.kunserve_rope_store(qkv.shape[0], heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(), cos.shape[0],
                                 positions.data_ptr(), qkv.data_ptr(), qkv.stride(0), cache.data_ptr(), cache.shape[0],
                                 cache.shape[3], *_cache_strides(cache), blocks.data_ptr(), offsets.data_ptr())
    if rc == -1:
        raise IndexError(f"a position is outside the RoPE tables' {cos.shape[0]} positions")
    if rc:
        raise IndexError(f"a KV slot is outside the cache's {cache.shape[0]} blocks of {cache.shape[3]} tokens")


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta (in place), and returns RMSNorm(x) * weight; x, delta [T, N] contiguous."""
    lib = _library()
    assert lib is not None and x.is_contiguous() and delta.is_contiguous() and weight.is_contiguous()
    h = torch.empty_like(x)
    lib.kunserve_add_rms_norm(x.shape[0], x.shape[1], x.data_ptr(), delta.data_ptr(), weight.data_ptr(), eps,
                              h.data_ptr())
    return h
