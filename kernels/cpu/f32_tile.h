// float32 tiles of paged prefill attention (paged_prefill.cpp), for every build without the bf16 dot products
// (AVX-512 F, AVX2 + FMA, portable loops) and for float32 caches on every build. A tile's K is transposed once
// into chunks of L keys (L the vector width: kt[(c * D + d) * L + j] = K[c L + j][d]) and its V converted
// once to float32 rows, then, for every row of the item:
//     scores  s[row][key] = sum over d of q[row][d] kt[d][key]   T rows x C chunks of keys in registers
//     values  acc[row][d] = alpha acc[row][d] + sum over keys of p[row][key] V[key][d]
//                                                                 T rows x NVD vectors of dimensions in registers
// with fused multiply-adds. Every sum runs in one lane in a fixed order (over d; over the keys, from the
// first), so a row's result does not depend on which rows share its item nor on how many: the microkernel
// shapes below change the speed only.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include "bf16_convert.h"
#include "simd_math.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace prefixserve_f32 {
using prefixserve_bf16::to_float;

#if defined(__AVX512F__)
using V = __m512;
constexpr int L = 16;
constexpr int S_ROWS = 6, S_CHUNKS = 4;      // scores: 24 accumulators, 4 loads + 6 broadcasts a dimension
constexpr int V_ROWS = 6;                    // values: 6 rows x up to 4 vectors
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset1(float x) { return _mm512_set1_ps(x); }
inline V vload(const float* p) { return _mm512_load_ps(p); }          // 64-byte aligned
inline V vloadu(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_store_ps(p, v); }
inline void vstoreu(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vround(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V vscale2(V p, V n) {       // p 2^n through the exponent bits (n an integer, p 2^n a normal float)
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23)));
}
inline float vhmax(V v) { return _mm512_reduce_max_ps(v); }
inline float vhsum(V v) { return _mm512_reduce_add_ps(v); }
inline __mmask16 lanes(int n) { return static_cast<__mmask16>(n >= 16 ? 0xffff : n > 0 ? (1u << n) - 1 : 0); }
inline V vfirst(V v, int n, V other) { return _mm512_mask_blend_ps(lanes(n), other, v); }   // v on lanes < n
#elif defined(__AVX2__) && defined(__FMA__)
using V = __m256;
constexpr int L = 8;
constexpr int S_ROWS = 6, S_CHUNKS = 2;      // scores: 12 accumulators of the 16 registers
constexpr int V_ROWS = 6;                    // values: 6 rows x 2 vectors
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset1(float x) { return _mm256_set1_ps(x); }
inline V vload(const float* p) { return _mm256_load_ps(p); }
inline V vloadu(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_store_ps(p, v); }
inline void vstoreu(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline V vround(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V vscale2(V p, V n) {
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
}
inline float vhmax(V v) { return prefixserve_simd::hmax256(v); }
inline float vhsum(V v) { return prefixserve_simd::hsum256(v); }
inline V vfirst(V v, int n, V other) { return _mm256_blendv_ps(other, v, prefixserve_simd::first_lanes(n)); }
#else
// Portable: 8 lanes as an array (the compiler vectorizes what its target has), a * b + c for the FMA.
struct V { alignas(32) float x[8]; };
constexpr int L = 8;
constexpr int S_ROWS = 4, S_CHUNKS = 2;
constexpr int V_ROWS = 4;
#define PREFIXSERVE_LANES(expr) V r; for (int i = 0; i < 8; ++i) r.x[i] = (expr); return r
inline V vzero() { PREFIXSERVE_LANES(0.f); }
inline V vset1(float x) { PREFIXSERVE_LANES(x); }
inline V vload(const float* p) { PREFIXSERVE_LANES(p[i]); }
inline V vloadu(const float* p) { PREFIXSERVE_LANES(p[i]); }
inline V vfma(V a, V b, V c) { PREFIXSERVE_LANES(a.x[i] * b.x[i] + c.x[i]); }
inline V vmul(V a, V b) { PREFIXSERVE_LANES(a.x[i] * b.x[i]); }
inline V vadd(V a, V b) { PREFIXSERVE_LANES(a.x[i] + b.x[i]); }
inline V vsub(V a, V b) { PREFIXSERVE_LANES(a.x[i] - b.x[i]); }
inline V vmax(V a, V b) { PREFIXSERVE_LANES(std::max(a.x[i], b.x[i])); }
inline V vround(V a) { PREFIXSERVE_LANES(std::nearbyint(a.x[i])); }
inline V vscale2(V p, V n) { PREFIXSERVE_LANES(std::ldexp(p.x[i], static_cast<int>(n.x[i]))); }
inline V vfirst(V v, int n, V other) { PREFIXSERVE_LANES(i < n ? v.x[i] : other.x[i]); }
#undef PREFIXSERVE_LANES
inline void vstore(float* p, V v) { for (int i = 0; i < 8; ++i) p[i] = v.x[i]; }
inline void vstoreu(float* p, V v) { vstore(p, v); }
inline float vhmax(V v) { float m = v.x[0]; for (int i = 1; i < 8; ++i) m = std::max(m, v.x[i]); return m; }
inline float vhsum(V v) {         // halves, then pairs (as hsum256)
    float h[4];
    for (int i = 0; i < 4; ++i) h[i] = v.x[i] + v.x[4 + i];
    return (h[0] + h[2]) + (h[1] + h[3]);
}
#endif

// The softmax weights 2^x (the scores come in log2 units: q is scaled by log2 e), x <= 0: x = n + r with
// n = round(x), 2^r by Cephes' exp2f polynomial on |r| <= 1/2 (~1 ulp), n added to the exponent bits. x is
// clamped at -126: a key 87 nats below the row's best weighs 2^-126 instead of 0, which no float32 sum of
// weights near 1 can see.
inline V vexp2(V x) {
    x = vmax(x, vset1(-126.f));
    const V n = vround(x), r = vsub(x, n);
    V p = vset1(1.535336188319500e-4f);
    p = vfma(p, r, vset1(1.339887440266574e-3f));
    p = vfma(p, r, vset1(9.618437357674640e-3f));
    p = vfma(p, r, vset1(5.550332471162809e-2f));
    p = vfma(p, r, vset1(2.402264791363012e-1f));
    p = vfma(p, r, vset1(6.931472028550421e-1f));
    return vscale2(vfma(p, r, vset1(1.f)), n);
}

// K rows k[0..n) of a tile transposed into chunks of L keys: kt[(c * D + d) * L + j] = K[c L + j][d] as
// float32, zero for the keys past n up to the chunk's end. kt 64-byte aligned, D a multiple of 16.
template <typename KV>
inline void pack_k(const KV* const* k, int n, int D, float* kt) {
    const int nk = (n + L - 1) / L * L;
#if defined(__AVX2__) && defined(__FMA__)          // AVX-512 builds too: 8 x 8 blocks, two a 16-key chunk
    using prefixserve_bf16::load8;
    for (int j0 = 0; j0 < nk; j0 += 8) {
        float* base = kt + j0 / L * D * L + j0 % L;
        for (int d0 = 0; d0 < D; d0 += 8) {
            __m256 r[8];
            for (int j = 0; j < 8; ++j) r[j] = j0 + j < n ? load8(k[j0 + j] + d0) : _mm256_setzero_ps();
            prefixserve_simd::transpose8(r);
            for (int x = 0; x < 8; ++x) _mm256_store_ps(base + (d0 + x) * L, r[x]);
        }
    }
#else
    for (int j = 0; j < nk; ++j) {
        float* base = kt + j / L * D * L + j % L;
        for (int d = 0; d < D; ++d) base[d * L] = j < n ? to_float(k[j][d]) : 0.f;
    }
#endif
}

// V rows v[0..n) as float32 rows of D: vt[j * D + d] (bf16 caches; a float32 cache's rows are read in place).
inline void pack_v(const uint16_t* const* v, int n, int D, float* vt) {
    for (int j = 0; j < n; ++j) {
#if defined(__AVX2__) && defined(__FMA__)
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(vt + j * D + d, prefixserve_bf16::load8(v[j] + d));
#else
        for (int d = 0; d < D; ++d) vt[j * D + d] = prefixserve_bf16::bf16_to_float(v[j][d]);
#endif
    }
}

// Scores of T rows for C chunks of L keys: sc[t * ld + c L + j] = sum over d of q_t[d] kt_c[d][j]. Each K
// vector is loaded once for the T rows, each query element broadcast once for the C chunks.
template <int T, int C>
inline void scores_tile(const float* const* q, const float* kt, int D, float* sc, int ld) {
    V s[T][C];
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c) s[t][c] = vzero();
    for (int d = 0; d < D; ++d) {
        V k[C];
        for (int c = 0; c < C; ++c) k[c] = vload(kt + (c * D + d) * L);
        for (int t = 0; t < T; ++t) {
            const V qv = vset1(q[t][d]);
            for (int c = 0; c < C; ++c) s[t][c] = vfma(qv, k[c], s[t][c]);
        }
    }
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c) vstore(sc + t * ld + c * L, s[t][c]);
}

template <int T>
inline void scores_rows_of(const float* const* q, const float* kt, int D, int chunks, float* sc, int ld) {
    int c = 0;
    for (; c + S_CHUNKS <= chunks; c += S_CHUNKS) scores_tile<T, S_CHUNKS>(q, kt + c * D * L, D, sc + c * L, ld);
    switch (chunks - c) {
        case 0: break;
#define PREFIXSERVE_REST(R) case R: if constexpr (R < S_CHUNKS) scores_tile<T, R>(q, kt + c * D * L, D, sc + c * L, ld); break;
        PREFIXSERVE_REST(1) PREFIXSERVE_REST(2) PREFIXSERVE_REST(3)
#undef PREFIXSERVE_REST
        default: break;
    }
}

// Scores of `rows` rows (q[0..rows)) over `chunks` chunks of kt: sc[x * ld + key].
inline void scores_rows(const float* const* q, int rows, const float* kt, int D, int chunks, float* sc, int ld) {
    int x = 0;
    for (; x + S_ROWS <= rows; x += S_ROWS) scores_rows_of<S_ROWS>(q + x, kt, D, chunks, sc + x * ld, ld);
    switch (rows - x) {
        case 0: break;
#define PREFIXSERVE_REST(R) case R: if constexpr (R < S_ROWS) scores_rows_of<R>(q + x, kt, D, chunks, sc + x * ld, ld); break;
        PREFIXSERVE_REST(1) PREFIXSERVE_REST(2) PREFIXSERVE_REST(3) PREFIXSERVE_REST(4) PREFIXSERVE_REST(5)
#undef PREFIXSERVE_REST
        default: break;
    }
}

// acc_t[v0 .. v0 + NVD L) = alpha_t acc_t + sum over keys j < n of p_t[j] V[j], T rows in registers.
template <int T, int NVD>
inline void values_tile(float* const* acc, const float* alpha, const float* p, int ld, const float* const* vrow, int n,
                        int v0) {
    V a[T][NVD];
    for (int t = 0; t < T; ++t) {
        const V al = vset1(alpha[t]);
        for (int v = 0; v < NVD; ++v) a[t][v] = vmul(al, vloadu(acc[t] + v0 + v * L));
    }
    for (int j = 0; j < n; ++j) {
        V vv[NVD];
        for (int v = 0; v < NVD; ++v) vv[v] = vloadu(vrow[j] + v0 + v * L);
        for (int t = 0; t < T; ++t) {
            const V w = vset1(p[t * ld + j]);
            for (int v = 0; v < NVD; ++v) a[t][v] = vfma(w, vv[v], a[t][v]);
        }
    }
    for (int t = 0; t < T; ++t)
        for (int v = 0; v < NVD; ++v) vstoreu(acc[t] + v0 + v * L, a[t][v]);
}

template <int NVD>
inline void values_rows_of(float* const* acc, const float* alpha, const float* p, int ld, const float* const* vrow,
                           int n, int D, int rows) {
    for (int v0 = 0; v0 < D; v0 += NVD * L) {
        int x = 0;
        for (; x + V_ROWS <= rows; x += V_ROWS)
            values_tile<V_ROWS, NVD>(acc + x, alpha + x, p + x * ld, ld, vrow, n, v0);
        switch (rows - x) {
            case 0: break;
#define PREFIXSERVE_REST(R) case R: if constexpr (R < V_ROWS) values_tile<R, NVD>(acc + x, alpha + x, p + x * ld, ld, \
                                                                                 vrow, n, v0); break;
            PREFIXSERVE_REST(1) PREFIXSERVE_REST(2) PREFIXSERVE_REST(3) PREFIXSERVE_REST(4) PREFIXSERVE_REST(5)
#undef PREFIXSERVE_REST
            default: break;
        }
    }
}

// Values of `rows` rows over the n keys of a tile; D a multiple of 16.
inline void values_rows(float* const* acc, const float* alpha, const float* p, int ld, const float* const* vrow, int n,
                        int D, int rows) {
    const int vecs = D / L;
    if (L == 16 && vecs % 4 == 0) values_rows_of<4>(acc, alpha, p, ld, vrow, n, D, rows);
    else if (L == 16 && vecs % 3 == 0) values_rows_of<3>(acc, alpha, p, ld, vrow, n, D, rows);
    else if (vecs % 2 == 0) values_rows_of<2>(acc, alpha, p, ld, vrow, n, D, rows);
    else values_rows_of<1>(acc, alpha, p, ld, vrow, n, D, rows);
}

}  // namespace prefixserve_f32
