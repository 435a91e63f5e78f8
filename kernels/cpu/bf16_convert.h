// bfloat16 <-> float32 conversions shared by the CPU kernels (a bf16 is the top half of a float32).
#pragma once
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace prefixserve_bf16 {

inline float bf16_to_float(uint16_t x) {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline uint16_t float_to_bf16(float f) {     // round to nearest even, as torch's .to(torch.bfloat16)
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;   // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) { return bf16_to_float(x); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {   // 16 bfloat16 -> 16 float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {    // 8 bfloat16 -> 8 float32
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(p))), 16));
}
#endif

}  // namespace prefixserve_bf16
