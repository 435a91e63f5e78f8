// Fused elementwise work of a Llama decoder layer on the CPU, for the quantized fast path: what torch runs
// as 5-10 small operators (each a pass over memory and a dispatch) in one pass per row. Launchers and the
// layout: kernels/cpu/fused.py.
//
//     rms_norm          y = act(w * x * rsqrt(mean(x^2) + eps))                      (the matmul input)
//     add_rms_norm      x += f32(r); y = act(w * x * rsqrt(mean(x^2) + eps))          (residual, then norm)
//     qkv_rope          q, k, v = split(f32(qkv)); q, k rotated (NeoX halves) by the step's cos / sin
//     silu_mul          y = act(silu(gate) * up) of a [gate | up] projection
//
// act, the activations between the matmuls (r, qkv, gate_up and y): bfloat16 (`act` 0), or float32 (`act` 1:
// a step whose matmuls are float32 GEMMs, where a bfloat16 round trip would only cost passes over memory).
// Rows are independent (a row's result never depends on the others): what keeps a prompt's tokens equal
// however they are batched or chunked. bfloat16 rounding is to nearest even, as torch's .to(bfloat16).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include "bf16_convert.h"
#include "simd_math.h"
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PREFIXSERVE_BF16 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PREFIXSERVE_AVX2 1
#endif

namespace {
using namespace prefixserve_bf16;



inline bool parallel(int64_t rows, int64_t width) { return rows * width >= 32768; }

#if defined(PREFIXSERVE_BF16)
using prefixserve_simd::exp512;

inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
#elif defined(PREFIXSERVE_AVX2)
// 8 float32 -> 8 bfloat16, rounded to nearest even (NaN -> 0x7fc0), as float_to_bf16 does one at a time
inline __m128i to_bf16x8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
#endif

inline void store(uint16_t* y, float v) { *y = float_to_bf16(v); }
inline void store(float* y, float v) { *y = v; }

template <typename A>
void rms_norm(const float* x, int64_t x_stride, const float* w, float eps, A* y, int64_t y_stride, int T, int H) {
    #pragma omp parallel for if (parallel(T, H))
    for (int t = 0; t < T; ++t) {
        const float* xr = x + t * x_stride;
        float ss = 0.f;
        #pragma omp simd reduction(+ : ss)
        for (int i = 0; i < H; ++i) ss += xr[i] * xr[i];
        const float r = 1.f / std::sqrt(ss / H + eps);
        A* yr = y + t * y_stride;
        for (int i = 0; i < H; ++i) store(yr + i, w[i] * (xr[i] * r));
    }
}

template <typename A>
void add_rms_norm(float* x, int64_t x_stride, const A* r, int64_t r_stride, const float* w, float eps, A* y,
                  int64_t y_stride, int T, int H) {
    #pragma omp parallel for if (parallel(T, H))
    for (int t = 0; t < T; ++t) {
        float* xr = x + t * x_stride;
        const A* rr = r + t * r_stride;
        float ss = 0.f;
        #pragma omp simd reduction(+ : ss)
        for (int i = 0; i < H; ++i) {
            const float v = xr[i] + to_float(rr[i]);
            xr[i] = v;
            ss += v * v;
        }
        const float inv = 1.f / std::sqrt(ss / H + eps);
        A* yr = y + t * y_stride;
        for (int i = 0; i < H; ++i) store(yr + i, w[i] * (xr[i] * inv));
    }
}

template <typename A>
void qkv_rope(const A* qkv, int64_t qkv_stride, const float* cos, const float* sin, float* q, float* k, float* v,
              int T, int H, int Hkv, int D) {
    const int half = D / 2;
    #pragma omp parallel for if (parallel(T, (H + 2 * Hkv) * D))
    for (int t = 0; t < T; ++t) {
        const A* src = qkv + t * qkv_stride;
        const float* c = cos + static_cast<int64_t>(t) * D;
        const float* s = sin + static_cast<int64_t>(t) * D;
        for (int h = 0; h < H + Hkv; ++h) {
            const A* x = src + h * D;
            float* dst = h < H ? q + (static_cast<int64_t>(t) * H + h) * D : k + (static_cast<int64_t>(t) * Hkv + h - H) * D;
            for (int i = 0; i < half; ++i) {       // x * cos + rotate_half(x) * sin, rotate_half = (-x2, x1)
                const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
                dst[i] = x1 * c[i] + (-x2) * s[i];
                dst[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
        const A* vs = src + (H + Hkv) * D;
        float* vd = v + static_cast<int64_t>(t) * Hkv * D;
        for (int i = 0; i < Hkv * D; ++i) vd[i] = to_float(vs[i]);
    }
}

#if defined(PREFIXSERVE_AVX2)
inline void store8(uint16_t* y, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(y), to_bf16x8(v)); }
inline void store8(float* y, __m256 v) { _mm256_storeu_ps(y, v); }
#endif

inline float from_float(float x, float) { return x; }
inline uint16_t from_float(float x, uint16_t) { return float_to_bf16(x); }

#if defined(PREFIXSERVE_AVX2)
// One row of silu_mul on AVX2, float32 or bfloat16 activations (A): 8 at a time, the exp in registers.
template <typename A>
inline void silu_mul_row_avx2(const A* g, const A* u, A* yr, int I) {
    int i = 0;
    for (; i + 8 <= I; i += 8) {
        const __m256 a = load8(g + i);
        const __m256 e = prefixserve_simd::exp256(_mm256_sub_ps(_mm256_setzero_ps(), a));
        store8(yr + i, _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.f), e)), load8(u + i)));
    }
    for (; i < I; ++i) {
        const float a = to_float(g[i]);
        yr[i] = from_float(a / (1.f + std::exp(-a)) * to_float(u[i]), A{});
    }
}
#endif

// One row of silu_mul, float32 activations (the bfloat16 row has its own loops below).
inline void silu_mul_row(const float* g, const float* u, float* yr, int I) {
#if defined(PREFIXSERVE_BF16)
    int i = 0;
    for (; i + 16 <= I; i += 16) {
        const __m512 a = _mm512_loadu_ps(g + i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), a));
        _mm512_storeu_ps(yr + i, _mm512_mul_ps(_mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                                 _mm512_loadu_ps(u + i)));
    }
    for (; i < I; ++i) yr[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
#elif defined(PREFIXSERVE_AVX2)
    silu_mul_row_avx2(g, u, yr, I);
#else
    for (int i = 0; i < I; ++i) yr[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
#endif
}

}  // namespace

extern "C" {

// act: 0 bfloat16, 1 float32 (y, and r / qkv / gu where the kernel reads activations).
void prefixserve_rms_norm(const float* x, int64_t x_stride, const float* w, float eps, void* y, int64_t y_stride,
                          int T, int H, int act) {
    if (act) rms_norm(x, x_stride, w, eps, static_cast<float*>(y), y_stride, T, H);
    else rms_norm(x, x_stride, w, eps, static_cast<uint16_t*>(y), y_stride, T, H);
}

void prefixserve_add_rms_norm(float* x, int64_t x_stride, const void* r, int64_t r_stride, const float* w,
                              float eps, void* y, int64_t y_stride, int T, int H, int act) {
    if (act) add_rms_norm(x, x_stride, static_cast<const float*>(r), r_stride, w, eps, static_cast<float*>(y), y_stride, T, H);
    else add_rms_norm(x, x_stride, static_cast<const uint16_t*>(r), r_stride, w, eps, static_cast<uint16_t*>(y), y_stride, T, H);
}

// qkv: [T, (H + 2 Hkv) D] act (bias already added, or none); cos, sin: [T, D] f32 (the halves repeated, as
// the model's rotary gives them); q: [T, H, D], k, v: [T, Hkv, D] f32, contiguous.
void prefixserve_qkv_rope(const void* qkv, int64_t qkv_stride, const float* cos, const float* sin, float* q,
                          float* k, float* v, int T, int H, int Hkv, int D, int act) {
    if (act) qkv_rope(static_cast<const float*>(qkv), qkv_stride, cos, sin, q, k, v, T, H, Hkv, D);
    else qkv_rope(static_cast<const uint16_t*>(qkv), qkv_stride, cos, sin, q, k, v, T, H, Hkv, D);
}

void prefixserve_silu_mul(const void* gu_, int64_t gu_stride, void* y_, int64_t y_stride, int T, int I, int act) {
    if (act) {
        const float* gu = static_cast<const float*>(gu_);
        float* y = static_cast<float*>(y_);
        #pragma omp parallel for if (parallel(T, I))
        for (int t = 0; t < T; ++t) silu_mul_row(gu + t * gu_stride, gu + t * gu_stride + I, y + t * y_stride, I);
        return;
    }
    const uint16_t* gu = static_cast<const uint16_t*>(gu_);
    uint16_t* y = static_cast<uint16_t*>(y_);
    #pragma omp parallel for if (parallel(T, I))
    for (int t = 0; t < T; ++t) {
        const uint16_t* g = gu + t * gu_stride;
        const uint16_t* u = g + I;
        uint16_t* yr = y + t * y_stride;
#if defined(PREFIXSERVE_BF16)
        for (int i = 0; i < I; i += 16) {                  // 16 at a time, the exp in registers
            const __mmask16 m = static_cast<__mmask16>(I - i >= 16 ? 0xffff : (1u << (I - i)) - 1);
            const __m512 a = load_bf16(g + i, m);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), a));
            const __m512 out = _mm512_mul_ps(_mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.f), e)), load_bf16(u + i, m));
            const __m256bh b = _mm512_cvtneps_pbh(out);       // round to nearest even
            __m256i bits;
            std::memcpy(&bits, &b, sizeof bits);
            _mm256_mask_storeu_epi16(yr + i, m, bits);
        }
#elif defined(PREFIXSERVE_AVX2)
        silu_mul_row_avx2(g, u, yr, I);
#else
        #pragma omp simd
        for (int i = 0; i < I; ++i) {                      // vectorized expf (libmvec: -fno-math-errno)
            const float a = bf16_to_float(g[i]);
            yr[i] = float_to_bf16(a / (1.f + std::exp(-a)) * bf16_to_float(u[i]));
        }
#endif
    }
}

// The loops this build runs for silu_mul: "avx512_bf16", "avx2", else "vectorized" (the compiler's, libmvec's).
const char* prefixserve_fused_path() {
#if defined(PREFIXSERVE_BF16)
    return "avx512_bf16";
#elif defined(PREFIXSERVE_AVX2)
    return "avx2";
#else
    return "vectorized";
#endif
}

}  // extern "C"
