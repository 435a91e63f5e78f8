// int16 tiles of paged prefill attention (paged_prefill.cpp) on AVX-512 VNNI builds without BF16 (an Intel Xeon of
// the Cascade Lake or Ice Lake kind), over bf16 caches: both products as vpdpwssd, 32 products of 16-bit integers an
// instruction into exact 32-bit sums (twice a float32 FMA's at the same rate), each side rounded to integers with
// its own scale:
//     scores  s[row][key] = (qs[row] ks[key]) sum over d of qh[row][d] kh[key][d]      q * scale a row, K a key
//     values  acc[row][d] = alpha acc[row][d] + ps[row] sum over keys of ph[row][key] vh[key][d]
// where vh is a V row rounded with its own scale vs[key], and ph the softmax weights times vs rounded a row of the
// tile at a time. The integers of a product's two sides are at most `limit(n)` in magnitude (n the products a sum
// adds: head_dim for the scores, TILE for the values), so no sum leaves int32 (n limit^2 < 2^31): 5,792 for 64, a
// relative step of 2^-13.5 of the vector's largest, where the bf16 tiles round q and the weights to 2^-9 of each
// value. A row's integers and scale depend on that row only, a key's on that key only, and every sum runs in a fixed
// order: a row's result does not depend on which rows share its item, nor on the chunking (paged_prefill.cpp).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include "simd_math.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(__AVX512BF16__)
#include <immintrin.h>
#define PREFIXSERVE_I16 1

namespace prefixserve_i16 {

constexpr int MAX_D = 256;

// acc += the pairwise products of a and b (vpdpwssd), in place: written as the instruction, because GCC 12 copies
// an array of accumulators in and out of other registers around each intrinsic (twice the instructions)
inline __m512i dot2(__m512i acc, __m512i a, __m512i b) {
    asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

// The largest integer magnitude of both sides of n products whose sum must stay within int32.
inline float limit(int n) { return std::floor(static_cast<float>(std::sqrt(2147483647.0 / n))); }

inline __m512 bf16x16(const uint16_t* p) {           // 16 bf16 values as float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// D values (load(d): 16 floats from d) rounded to integers of magnitude <= lim into dst[D]; returns their scale
// (value ~ scale * integer; 0 for a row of zeros).
template <typename Load>
inline float quantize(Load load, int D, float lim, int16_t* dst) {
    __m512 mx = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load(d)));
    const float m = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(m > 0.f ? lim / m : 0.f);
    for (int d = 0; d < D; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(load(d), inv))));
    return m / lim;
}

// A q row times `scale` as integer dimension pairs dst[D / 2] (words), its scale in *qs.
inline void pack_q(const float* src, float scale, int D, uint32_t* dst, float* qs) {
    const __m512 s = _mm512_set1_ps(scale);
    *qs = quantize([&](int d) { return _mm512_mul_ps(_mm512_loadu_ps(src + d), s); }, D, limit(D),
                   reinterpret_cast<int16_t*>(dst));
}

// K rows of a tile (n tokens, bf16) as integer dimension pairs: kt[(c * W + w) * 16 + j] = the word w (dims 2w,
// 2w + 1) of token 16 c + j, ks[16 c + j] its scale; zero past n. W = D / 2, D a multiple of 32.
inline void pack_k(const uint16_t* const* k, int n, int D, uint32_t* kt, float* ks) {
    alignas(64) int16_t rows[16][MAX_D];
    const int W = D / 2, chunks = (n + 15) / 16;
    const float lim = limit(D);
    for (int c = 0; c < chunks; ++c) {
        const int m = std::min(16, n - 16 * c);
        for (int j = 0; j < 16; ++j) {
            if (j < m) {
                const uint16_t* src = k[16 * c + j];
                ks[16 * c + j] = quantize([&](int d) { return bf16x16(src + d); }, D, lim, rows[j]);
            } else {
                ks[16 * c + j] = 0.f;
                std::fill(rows[j], rows[j] + D, int16_t{0});
            }
        }
        for (int w0 = 0; w0 < W; w0 += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; ++j) r[j] = _mm512_load_si512(rows[j] + 2 * w0);
            prefixserve_simd::transpose16(r);
            for (int x = 0; x < 16; ++x) _mm512_store_si512(kt + (c * W + w0 + x) * 16, r[x]);
        }
    }
}

// V rows of a tile (n tokens, bf16), each rounded with its own scale vs[j], as integer token pairs:
// vt[(i * NV + v) * 16 + d] = (vh[2i][16 v + d], vh[2i + 1][16 v + d]); zero past n (vs too, to TILE keys).
inline void pack_v(const uint16_t* const* v, int n, int D, int tile, uint32_t* vt, float* vs) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    alignas(64) int16_t a[MAX_D], b[MAX_D];
    const int NV = D / 16;
    const float lim = limit(tile);
    for (int j = n; j < tile; ++j) vs[j] = 0.f;
    for (int i = 0; 2 * i < n; ++i) {
        const uint16_t* r0 = v[2 * i];
        vs[2 * i] = quantize([&](int d) { return bf16x16(r0 + d); }, D, lim, a);
        if (2 * i + 1 < n) {
            const uint16_t* r1 = v[2 * i + 1];
            vs[2 * i + 1] = quantize([&](int d) { return bf16x16(r1 + d); }, D, lim, b);
        } else {
            std::fill(b, b + D, int16_t{0});
        }
        for (int d0 = 0; d0 < D; d0 += 32) {
            const __m512i x = _mm512_load_si512(a + d0), y = _mm512_load_si512(b + d0);
            _mm512_store_si512(vt + (i * NV + d0 / 16) * 16, _mm512_permutex2var_epi16(x, lo, y));
            _mm512_store_si512(vt + (i * NV + d0 / 16 + 1) * 16, _mm512_permutex2var_epi16(x, hi, y));
        }
    }
}

// Scores of T rows for C chunks of 16 keys: sc[t][16 c + j] = qs_t ks[16 c + j] sum over words w of q_t[w] . kt_c[w].
template <int T, int C>
inline void scores_tile(const uint32_t* const* q, const float* qs, const uint32_t* kt, const float* ks, int W,
                        float* sc, int stride) {
    __m512i s[T][C];
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c) s[t][c] = _mm512_setzero_si512();
    for (int w = 0; w < W; ++w) {
        __m512i k[C];
        for (int c = 0; c < C; ++c) k[c] = _mm512_load_si512(kt + (c * W + w) * 16);
        for (int t = 0; t < T; ++t) {
            const __m512i qv = _mm512_set1_epi32(static_cast<int>(q[t][w]));
            for (int c = 0; c < C; ++c) s[t][c] = dot2(s[t][c], qv, k[c]);
        }
    }
    for (int t = 0; t < T; ++t) {
        const __m512 a = _mm512_set1_ps(qs[t]);
        for (int c = 0; c < C; ++c)
            _mm512_store_ps(sc + t * stride + c * 16,
                            _mm512_mul_ps(_mm512_cvtepi32_ps(s[t][c]), _mm512_mul_ps(a, _mm512_load_ps(ks + 16 * c))));
    }
}

// A row's word broadcast and its products with the four chunks' K words, as one asm statement: written as dot2 calls
// GCC 12 moved accumulators between registers inside the word loop (7 moves a word for 16 products).
#define PREFIXSERVE_I16_ROW4(word, a, b, c, d)                                                                       \
    asm("vpbroadcastd %[w], %%zmm31\n\t"                                                                            \
        "vpdpwssd %[k0], %%zmm31, %[s0]\n\t"                                                                        \
        "vpdpwssd %[k1], %%zmm31, %[s1]\n\t"                                                                        \
        "vpdpwssd %[k2], %%zmm31, %[s2]\n\t"                                                                        \
        "vpdpwssd %[k3], %%zmm31, %[s3]"                                                                            \
        : [s0] "+v"(a), [s1] "+v"(b), [s2] "+v"(c), [s3] "+v"(d)                                                   \
        : [k0] "v"(k0), [k1] "v"(k1), [k2] "v"(k2), [k3] "v"(k3), [w] "m"(word)                                    \
        : "xmm31")

// scores_tile<4, 4>, the tile of every full block of rows: the same products in the same order as the template
// (the same sums bit for bit).
template <>
inline void scores_tile<4, 4>(const uint32_t* const* q, const float* qs, const uint32_t* kt, const float* ks, int W,
                              float* sc, int stride) {
    __m512i s00 = _mm512_setzero_si512(), s01 = s00, s02 = s00, s03 = s00, s10 = s00, s11 = s00, s12 = s00,
            s13 = s00, s20 = s00, s21 = s00, s22 = s00, s23 = s00, s30 = s00, s31 = s00, s32 = s00, s33 = s00;
    const uint32_t *q0 = q[0], *q1 = q[1], *q2 = q[2], *q3 = q[3];
    for (int w = 0; w < W; ++w) {
        const __m512i k0 = _mm512_load_si512(kt + w * 16), k1 = _mm512_load_si512(kt + (W + w) * 16),
                      k2 = _mm512_load_si512(kt + (2 * W + w) * 16), k3 = _mm512_load_si512(kt + (3 * W + w) * 16);
        PREFIXSERVE_I16_ROW4(q0[w], s00, s01, s02, s03);
        PREFIXSERVE_I16_ROW4(q1[w], s10, s11, s12, s13);
        PREFIXSERVE_I16_ROW4(q2[w], s20, s21, s22, s23);
        PREFIXSERVE_I16_ROW4(q3[w], s30, s31, s32, s33);
    }
    const __m512i s[4][4] = {{s00, s01, s02, s03}, {s10, s11, s12, s13}, {s20, s21, s22, s23}, {s30, s31, s32, s33}};
    for (int t = 0; t < 4; ++t) {
        const __m512 a = _mm512_set1_ps(qs[t]);
        for (int c = 0; c < 4; ++c)
            _mm512_store_ps(sc + t * stride + c * 16,
                            _mm512_mul_ps(_mm512_cvtepi32_ps(s[t][c]), _mm512_mul_ps(a, _mm512_load_ps(ks + 16 * c))));
    }
}
#undef PREFIXSERVE_I16_ROW4

template <int C>
inline void scores_rows(const uint32_t* const* q, const float* qs, int rows, const uint32_t* kt, const float* ks,
                        int W, float* sc, int stride) {
    int x = 0;
    for (; x + 4 <= rows; x += 4) scores_tile<4, C>(q + x, qs + x, kt, ks, W, sc + x * stride, stride);
    switch (rows - x) {
        case 3: scores_tile<3, C>(q + x, qs + x, kt, ks, W, sc + x * stride, stride); break;
        case 2: scores_tile<2, C>(q + x, qs + x, kt, ks, W, sc + x * stride, stride); break;
        case 1: scores_tile<1, C>(q + x, qs + x, kt, ks, W, sc + x * stride, stride); break;
        default: break;
    }
}

// Scores of `rows` rows over a tile's `chunks` (1 to 4) chunks of 16 keys.
inline void scores_chunks(const uint32_t* const* q, const float* qs, int rows, const uint32_t* kt, const float* ks,
                          int W, int chunks, float* sc, int stride) {
    switch (chunks) {
        case 1: scores_rows<1>(q, qs, rows, kt, ks, W, sc, stride); break;
        case 2: scores_rows<2>(q, qs, rows, kt, ks, W, sc, stride); break;
        case 3: scores_rows<3>(q, qs, rows, kt, ks, W, sc, stride); break;
        default: scores_rows<4>(q, qs, rows, kt, ks, W, sc, stride); break;
    }
}

// The largest of a tile's first j + 1 V scales, vtop[j], and lim over it, vinv[j] (0 where they are all 0), for
// j < n.
inline void top_scales(const float* vs, int n, float lim, float* vtop, float* vinv) {
    float m = 0.f;
    for (int j = 0; j < n; ++j) vtop[j] = m = std::max(m, vs[j]);
    for (int j = 0; j < n; j += 16) {
        const __mmask16 ok = static_cast<__mmask16>(n - j >= 16 ? 0xffff : (1u << (n - j)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(ok, vtop + j);
        _mm512_mask_storeu_ps(vinv + j, ok, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ),
                                                                 _mm512_set1_ps(lim), v));
    }
}

// A row's weights e[CH] (16 keys a vector, zero past its keys) times the keys' V scales vs, rounded to integers
// e vs inv into dst[CH * 8] words (token pairs). inv = lim / (the row's largest weight x the largest V scale of its
// keys), a bound of every e vs known before the weights (tile_weights' wtop, top_scales): each integer is at most
// lim, or lim + 1 where the exponential's polynomial puts a weight a rounding above the largest score's, and
// n (lim + 1) lim < 2^31 still (64 keys: 2,147,395,584). Against rounding with the row's own largest e vs, the
// integers lose the ratio of that V scale to the one of the key with the row's largest weight (a bit or two).
template <int CH>
inline void pack_p(const __m512* e, const float* vs, __m512 inv, uint32_t* dst) {
    int16_t* out = reinterpret_cast<int16_t*>(dst);
    for (int c = 0; c < CH; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * c), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(
            _mm512_mul_ps(_mm512_mul_ps(e[c], _mm512_load_ps(vs + 16 * c)), inv))));
}

// acc_t = alpha_t acc_t + ps_t sum over token pairs i of p_t[i] . vt[i], T rows, the integer sums in registers.
template <int NV, int T>
inline void values_tile(float* const* acc, const float* alpha, const uint32_t* const* p, const float* ps,
                        const uint32_t* vt, int pairs) {
    __m512i a[T][NV];
    for (int t = 0; t < T; ++t)
        for (int v = 0; v < NV; ++v) a[t][v] = _mm512_setzero_si512();
    for (int i = 0; i < pairs; ++i) {
        __m512i vv[NV];
        for (int v = 0; v < NV; ++v) vv[v] = _mm512_load_si512(vt + (i * NV + v) * 16);
        for (int t = 0; t < T; ++t) {
            const __m512i w = _mm512_set1_epi32(static_cast<int>(p[t][i]));
            for (int v = 0; v < NV; ++v) a[t][v] = dot2(a[t][v], w, vv[v]);
        }
    }
    for (int t = 0; t < T; ++t) {
        const __m512 al = _mm512_set1_ps(alpha[t]), s = _mm512_set1_ps(ps[t]);
        for (int v = 0; v < NV; ++v)
            _mm512_storeu_ps(acc[t] + 16 * v, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[t][v]), s,
                                                              _mm512_mul_ps(al, _mm512_loadu_ps(acc[t] + 16 * v))));
    }
}

template <int NV>
constexpr int v_rows() { return std::max(1, 24 / NV); }

template <int NV>
inline void values_rows(float* const* acc, const float* alpha, const uint32_t* const* p, const float* ps,
                        const uint32_t* vt, int pairs, int rows) {
    constexpr int T = std::min(6, v_rows<NV>());
    int x = 0;
    for (; x + T <= rows; x += T) values_tile<NV, T>(acc + x, alpha + x, p + x, ps + x, vt, pairs);
    switch (rows - x) {
        case 0: break;
#define PREFIXSERVE_REST(R) case R: if constexpr (R < T) values_tile<NV, R>(acc + x, alpha + x, p + x, ps + x, vt, pairs); break;
        PREFIXSERVE_REST(1) PREFIXSERVE_REST(2) PREFIXSERVE_REST(3) PREFIXSERVE_REST(4) PREFIXSERVE_REST(5)
#undef PREFIXSERVE_REST
        default: break;
    }
}

}  // namespace prefixserve_i16
#endif
