// bf16 tiles of paged attention on the CPU (AVX-512 BF16), used by paged_prefill.cpp (paged_decode.py says why
// decode keeps float32 products):
// a tile's K transposed into dimension pairs and its V interleaved into token pairs, so that scores and
// values run as vdpbf16ps (two bf16 products a lane, float32 sums), with a vectorized exp.
#pragma once
#include <algorithm>
#include <cstdint>
#include "simd_math.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PREFIXSERVE_BF16 1

namespace prefixserve_bf16 {

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

using prefixserve_simd::exp512;

using prefixserve_simd::transpose16;

// K rows of a tile (n tokens) as dimension pairs: kt[(c * W + w) * 16 + j] = the 32-bit word w (dims 2w,
// 2w + 1) of token 16 c + j; zero past n. W = D / 2.
inline void pack_k(const uint16_t* const* k, int n, int D, uint32_t* kt) {
    const int W = D / 2, chunks = (n + 15) / 16;
    for (int c = 0; c < chunks; ++c) {
        const int m = std::min(16, n - 16 * c);
        for (int w0 = 0; w0 < W; w0 += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; ++j)
                r[j] = j < m ? _mm512_loadu_si512(k[16 * c + j] + 2 * w0) : _mm512_setzero_si512();
            transpose16(r);
            for (int x = 0; x < 16; ++x) _mm512_store_si512(kt + (c * W + w0 + x) * 16, r[x]);
        }
    }
}

// V rows of a tile as token pairs: vt[(i * NV + v) * 16 + d] = (V[2i][16 v + d], V[2i + 1][16 v + d]);
// the second of an odd last pair is zero. NV = D / 16.
inline void pack_v(const uint16_t* const* v, int n, int D, uint32_t* vt) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const int NV = D / 16;
    for (int i = 0; 2 * i < n; ++i) {
        for (int d0 = 0; d0 < D; d0 += 32) {
            const __m512i a = _mm512_loadu_si512(v[2 * i] + d0);
            const __m512i b = 2 * i + 1 < n ? _mm512_loadu_si512(v[2 * i + 1] + d0) : _mm512_setzero_si512();
            _mm512_store_si512(vt + (i * NV + d0 / 16) * 16, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_store_si512(vt + (i * NV + d0 / 16 + 1) * 16, _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}

// Scores of T rows for C chunks of 16 keys: s[t][c] = sum over words w of q_t[w] . kt_c[w] (bf16 pairs).
template <int T, int C>
inline void scores_tile(const uint32_t* const* q, const uint32_t* kt, int W, float* sc, int stride) {
    __m512 s[T][C];
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c) s[t][c] = _mm512_setzero_ps();
    for (int w = 0; w < W; ++w) {
        __m512i k[C];
        for (int c = 0; c < C; ++c) k[c] = _mm512_load_si512(kt + (c * W + w) * 16);
        for (int t = 0; t < T; ++t) {
            const __m512bh qv = as_bh(_mm512_set1_epi32(static_cast<int>(q[t][w])));
            for (int c = 0; c < C; ++c) s[t][c] = _mm512_dpbf16_ps(s[t][c], qv, as_bh(k[c]));
        }
    }
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c) _mm512_store_ps(sc + t * stride + c * 16, s[t][c]);
}

template <int C>
inline void scores_rows(const uint32_t* const* q, int rows, const uint32_t* kt, int W, float* sc, int stride) {
    int x = 0;
    for (; x + 4 <= rows; x += 4) scores_tile<4, C>(q + x, kt, W, sc + x * stride, stride);
    switch (rows - x) {
        case 3: scores_tile<3, C>(q + x, kt, W, sc + x * stride, stride); break;
        case 2: scores_tile<2, C>(q + x, kt, W, sc + x * stride, stride); break;
        case 1: scores_tile<1, C>(q + x, kt, W, sc + x * stride, stride); break;
        default: break;
    }
}

// Scores of `rows` rows over a tile's `chunks` (1 to 4) chunks of 16 keys.
inline void scores_chunks(const uint32_t* const* q, int rows, const uint32_t* kt, int W, int chunks, float* sc,
                          int stride) {
    switch (chunks) {
        case 1: scores_rows<1>(q, rows, kt, W, sc, stride); break;
        case 2: scores_rows<2>(q, rows, kt, W, sc, stride); break;
        case 3: scores_rows<3>(q, rows, kt, W, sc, stride); break;
        default: scores_rows<4>(q, rows, kt, W, sc, stride); break;
    }
}

// acc_t = alpha_t acc_t + sum over token pairs i of p_t[i] . vt[i], T rows, the accumulators in registers.
template <int NV, int T>
inline void values_tile(float* const* acc, const float* alpha, const uint32_t* const* p, const uint32_t* vt,
                        int pairs) {
    __m512 a[T][NV];
    for (int t = 0; t < T; ++t) {
        const __m512 al = _mm512_set1_ps(alpha[t]);
        for (int v = 0; v < NV; ++v) a[t][v] = _mm512_mul_ps(al, _mm512_loadu_ps(acc[t] + 16 * v));
    }
    for (int i = 0; i < pairs; ++i) {
        __m512i vv[NV];
        for (int v = 0; v < NV; ++v) vv[v] = _mm512_load_si512(vt + (i * NV + v) * 16);
        for (int t = 0; t < T; ++t) {
            const __m512bh w = as_bh(_mm512_set1_epi32(static_cast<int>(p[t][i])));
            for (int v = 0; v < NV; ++v) a[t][v] = _mm512_dpbf16_ps(a[t][v], w, as_bh(vv[v]));
        }
    }
    for (int t = 0; t < T; ++t)
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc[t] + 16 * v, a[t][v]);
}

template <int NV>
constexpr int v_rows() { return std::max(1, 24 / NV); }

template <int NV>
inline void values_rows(float* const* acc, const float* alpha, const uint32_t* const* p, const uint32_t* vt,
                        int pairs, int rows) {
    constexpr int T = std::min(8, v_rows<NV>());
    int x = 0;
    for (; x + T <= rows; x += T) values_tile<NV, T>(acc + x, alpha + x, p + x, vt, pairs);
    switch (rows - x) {
        case 0: break;
#define PREFIXSERVE_REST(R) case R: if constexpr (R < T) values_tile<NV, R>(acc + x, alpha + x, p + x, vt, pairs); break;
        PREFIXSERVE_REST(1) PREFIXSERVE_REST(2) PREFIXSERVE_REST(3) PREFIXSERVE_REST(4) PREFIXSERVE_REST(5)
        PREFIXSERVE_REST(6) PREFIXSERVE_REST(7)
#undef PREFIXSERVE_REST
        default: break;
    }
}


using prefixserve_simd::exp2_weight;

// q rows (float32, D of them) times `scale`, as bf16 dimension pairs: dst[w] = (bf16(q[2w]), bf16(q[2w + 1])).
inline void pack_q(const float* src, float scale, int D, uint32_t* dst) {
    for (int d = 0; d < D; d += 32) {
        const __m512bh p = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + d + 16), _mm512_set1_ps(scale)),
                                                _mm512_mul_ps(_mm512_loadu_ps(src + d), _mm512_set1_ps(scale)));
        _mm512_storeu_si512(dst + d / 2, reinterpret_cast<const __m512i&>(p));
    }
}

// 16 float32 weights a, b (32 in all) as bf16 token pairs at dst[0..16).
inline void pack_p(__m512 lo, __m512 hi, uint32_t* dst) {
    const __m512bh p = _mm512_cvtne2ps_pbh(hi, lo);
    _mm512_storeu_si512(dst, reinterpret_cast<const __m512i&>(p));
}

}  // namespace prefixserve_bf16
#endif
