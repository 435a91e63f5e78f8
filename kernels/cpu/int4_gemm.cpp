// A quantized GEMM for narrow steps (1 to ~16 rows) on CPUs whose wide steps are float32 GEMMs (AVX2): the
// weights stay 4-bit in memory (a step reads an eighth of the float32 bytes) and a whole step's rows are
// computed at once, each decoded weight vector used by every row (torch's int4 kernel walks the weights
// once a row). Launcher, layout and contract: kernels/cpu/int4_gemm.py.
//
//     y[t, n] = sum over groups g of  s[n, g] * sum_{k in g} q[n, k] x[t, k]  +  z[n, g] * sum_{k in g} x[t, k]
//
// with q in 0..15 and z the group's offset (W[n, k] = q[n, k] s[n, g] + z[n, g]), float32 products and sums.
// A row's result depends on that row only (the same order of operations for every batch).
#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PREFIXSERVE_AVX2 1
#endif

namespace {

constexpr int GROUP = 32;
constexpr int ROWS = 4;          // rows a pass: 8 accumulators for two blocks of 8 outputs

#if defined(PREFIXSERVE_AVX2)
inline __m256 decode(uint32_t w, __m256i shifts, __m256i mask) {   // 8 nibbles -> 8 floats
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), shifts),
                                               mask));
}

// Rows [t0, t0 + R) of two blocks of 8 outputs (b, b + 1): y += over groups (s * sum q x + z * sum x).
template <int R>
void pass(const float* x, int64_t x_stride, const float* xs, const uint32_t* w0, const uint32_t* w1,
          const float* sz0, const float* sz1, float* y, int64_t y_stride, int K) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), mask = _mm256_set1_epi32(15);
    const int G = K / GROUP;
    __m256 out[R][2];
    for (int r = 0; r < R; ++r) out[r][0] = out[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; ++g) {
        __m256 acc[R][2];
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int k = g * GROUP; k < (g + 1) * GROUP; ++k) {
            const __m256 a = decode(w0[k], shifts, mask), b = decode(w1[k], shifts, mask);
            for (int r = 0; r < R; ++r) {
                const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + k);
                acc[r][0] = _mm256_fmadd_ps(a, xv, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(b, xv, acc[r][1]);
            }
        }
        const __m256 s0 = _mm256_loadu_ps(sz0 + g * 16), z0 = _mm256_loadu_ps(sz0 + g * 16 + 8);
        const __m256 s1 = _mm256_loadu_ps(sz1 + g * 16), z1 = _mm256_loadu_ps(sz1 + g * 16 + 8);
        for (int r = 0; r < R; ++r) {
            const __m256 sx = _mm256_broadcast_ss(xs + r * G + g);
            out[r][0] = _mm256_fmadd_ps(z0, sx, _mm256_fmadd_ps(s0, acc[r][0], out[r][0]));
            out[r][1] = _mm256_fmadd_ps(z1, sx, _mm256_fmadd_ps(s1, acc[r][1], out[r][1]));
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(y + r * y_stride, out[r][0]);
        _mm256_storeu_ps(y + r * y_stride + 8, out[r][1]);
    }
}
#endif

// The same sums one output at a time (builds without AVX2).
void generic(const float* x, int64_t x_stride, const float* xs, const uint32_t* w, const float* sz, float* y,
             int64_t y_stride, int T, int n, int K) {
    const int G = K / GROUP, b = n / 8, j = n % 8;
    for (int t = 0; t < T; ++t) {
        float out = 0.f;
        for (int g = 0; g < G; ++g) {
            float acc = 0.f;
            for (int k = g * GROUP; k < (g + 1) * GROUP; ++k)
                acc += static_cast<float>((w[static_cast<int64_t>(b) * K + k] >> (4 * j)) & 15u) * x[t * x_stride + k];
            const float* s = sz + (static_cast<int64_t>(b) * G + g) * 16;
            out = s[8 + j] * xs[t * G + g] + (s[j] * acc + out);
        }
        y[t * y_stride + n] = out;
    }
}


// -- int4 weights x int8 activations (kernels/cpu/int4_gemm.py pack_u8, gemm_q8) ---------------------------------
// Each row's activations are quantized per group of 32: a = max |x| / 127, h = round(x / a) in -127..127. The
// weights are bytes q in 0..15, four of one output to a 32-bit lane ([N / 8, K / 4, 8, 4]), so one vpmaddubsw
// (u8 q x s8 h) adds 32 products into 16-bit pairs: |q h + q' h'| <= 3,810, and a group's eight stay below 2^15
// (no saturation, unlike oneDNN's u8 activations x s8 weights on AVX2). A group's integer sum is exact; then
//
//     y[t, n] += (s[n, g] a[t, g]) sum_{k in g} q[n, k] h[t, k]  +  z[n, g] sum_{k in g} x[t, k]      (float32)
//
// the same float operations, in the same order, for every row and batch (a row's result is its own).
constexpr int Q8_ROWS = 3;       // rows a pass: 6 16-bit sums and 6 float accumulators, 2 weight vectors, 1 row

#if defined(PREFIXSERVE_AVX2)
template <int R>
void q8_pass(const int8_t* xh, int64_t xq_stride, const float* xa, const float* xs, const uint8_t* w0,
             const uint8_t* w1, const float* sz0, const float* sz1, float* y, int64_t y_stride, int K) {
    const int G = K / GROUP;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 out[R][2];
    for (int r = 0; r < R; ++r) out[r][0] = out[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; ++g) {
        __m256i hs[R][2];
        for (int r = 0; r < R; ++r) hs[r][0] = hs[r][1] = _mm256_setzero_si256();
        const uint8_t* a0 = w0 + static_cast<int64_t>(g) * GROUP * 8;
        const uint8_t* a1 = w1 + static_cast<int64_t>(g) * GROUP * 8;
#pragma GCC unroll 1
        for (int s = 0; s < 8; ++s) {    // not unrolled: g++ would compute all 8 products first and spill them
            const __m256i wa = _mm256_load_si256(reinterpret_cast<const __m256i*>(a0 + 32 * s));
            const __m256i wb = _mm256_load_si256(reinterpret_cast<const __m256i*>(a1 + 32 * s));
            for (int r = 0; r < R; ++r) {
                int32_t v;
                std::memcpy(&v, xh + r * xq_stride + g * GROUP + 4 * s, 4);
                const __m256i xv = _mm256_set1_epi32(v);
                hs[r][0] = _mm256_add_epi16(hs[r][0], _mm256_maddubs_epi16(wa, xv));
                hs[r][1] = _mm256_add_epi16(hs[r][1], _mm256_maddubs_epi16(wb, xv));
            }
        }
        const __m256 s0 = _mm256_loadu_ps(sz0 + g * 16), z0 = _mm256_loadu_ps(sz0 + g * 16 + 8);
        const __m256 s1 = _mm256_loadu_ps(sz1 + g * 16), z1 = _mm256_loadu_ps(sz1 + g * 16 + 8);
        for (int r = 0; r < R; ++r) {
            const __m256 av = _mm256_broadcast_ss(xa + r * G + g), sx = _mm256_broadcast_ss(xs + r * G + g);
            const __m256 d0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(hs[r][0], ones));
            const __m256 d1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(hs[r][1], ones));
            out[r][0] = _mm256_fmadd_ps(z0, sx, _mm256_fmadd_ps(_mm256_mul_ps(s0, av), d0, out[r][0]));
            out[r][1] = _mm256_fmadd_ps(z1, sx, _mm256_fmadd_ps(_mm256_mul_ps(s1, av), d1, out[r][1]));
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(y + r * y_stride, out[r][0]);
        _mm256_storeu_ps(y + r * y_stride + 8, out[r][1]);
    }
}
#endif

// The same sums one output at a time (builds without AVX2): the integer sums exactly, the float steps alike.
void q8_generic(const int8_t* xh, int64_t xq_stride, const float* xa, const float* xs, const uint8_t* w,
                const float* sz, float* y, int64_t y_stride, int T, int n, int K) {
    const int G = K / GROUP, b = n / 8, j = n % 8;
    const uint8_t* wb = w + static_cast<int64_t>(b) * K * 8;
    for (int t = 0; t < T; ++t) {
        float out = 0.f;
        for (int g = 0; g < G; ++g) {
            int32_t h = 0;
            for (int k = g * GROUP; k < (g + 1) * GROUP; ++k)
                h += static_cast<int32_t>(wb[(k / 4) * 32 + 4 * j + k % 4]) * xh[t * xq_stride + k];
            const float* s = sz + (static_cast<int64_t>(b) * G + g) * 16;
            out = std::fma(s[8 + j], xs[t * G + g], std::fma(s[j] * xa[t * G + g], static_cast<float>(h), out));
        }
        y[t * y_stride + n] = out;
    }
}

#if defined(PREFIXSERVE_AVX2)
// -- wide steps (gemm_wide): a float32 GEMM whose weights are decoded from 4 bits a panel at a time ---------------
// A panel is 16 outputs x KC inputs of W decoded to float32 (W = q s + z, 16 KB-20 KB: it stays in L1) once, then
// multiplied by every row of the step: 6 rows x 16 outputs a pass, 12 accumulators, two FMAs per broadcast
// activation (the register blocking of a float32 GEMM's micro-kernel). The step's rows are first packed six at
// a time ([T / 6, K, 6], zero rows padding the last block), so a pass reads its activations in one stream.
// Products are summed in float32 in order of k, a KC block at a time into y: a row's result depends on that
// row only.
constexpr int MR = 6, NR = 16;
constexpr int MB = 24;           // row blocks a pass over the panels: 144 rows

inline int kc_block(int K, int most = 320) {     // KC: K split into equal blocks of at most `most`, multiples of 32
    const int blocks = (K + most - 1) / most;
    return ((K + blocks - 1) / blocks + GROUP - 1) / GROUP * GROUP;
}

// Bp [kc, 16] = the panel's weights k0 .. k0 + kc (a multiple of 32) of the two blocks of 8 outputs w0, w1.
inline void decode_panel(const uint32_t* w0, const uint32_t* w1, const float* sz0, const float* sz1, int k0, int kc,
                         float* bp) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), mask = _mm256_set1_epi32(15);
    for (int g = k0 / GROUP; g < (k0 + kc) / GROUP; ++g) {
        const __m256 s0 = _mm256_loadu_ps(sz0 + g * 16), z0 = _mm256_loadu_ps(sz0 + g * 16 + 8);
        const __m256 s1 = _mm256_loadu_ps(sz1 + g * 16), z1 = _mm256_loadu_ps(sz1 + g * 16 + 8);
        float* out = bp + static_cast<int64_t>(g * GROUP - k0) * NR;
        for (int k = g * GROUP; k < (g + 1) * GROUP; ++k, out += NR) {
            _mm256_store_ps(out, _mm256_fmadd_ps(decode(w0[k], shifts, mask), s0, z0));
            _mm256_store_ps(out + 8, _mm256_fmadd_ps(decode(w1[k], shifts, mask), s1, z1));
        }
    }
}

// y[0 .. rows) x 16 (+)= ap [kc, 6] x bp [kc, 16]; the first K block stores, later ones add. Six rows are
// computed whatever `rows` (the packed rows past T are zeros). The twelve accumulators are named variables:
// GCC keeps an array of them in memory, storing each at every k.
#define PS_ROW(r, c0, c1)                                                              \
    {                                                                                  \
        const __m256 a = _mm256_broadcast_ss(ap + (r));                                \
        c0 = _mm256_fmadd_ps(a, b0, c0);                                               \
        c1 = _mm256_fmadd_ps(a, b1, c1);                                               \
    }
#define PS_STORE(r, c0, c1)                                                            \
    if ((r) < rows) {                                                                  \
        float* yr = y + (r) * y_stride;                                                \
        if (!first) {                                                                  \
            c0 = _mm256_add_ps(_mm256_loadu_ps(yr), c0);                               \
            c1 = _mm256_add_ps(_mm256_loadu_ps(yr + 8), c1);                           \
        }                                                                              \
        _mm256_storeu_ps(yr, c0);                                                      \
        _mm256_storeu_ps(yr + 8, c1);                                                  \
    }
void micro(const float* ap, const float* bp, int kc, float* y, int64_t y_stride, int rows, bool first) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
           c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int k = 0; k < kc; ++k, ap += MR, bp += NR) {
        const __m256 b0 = _mm256_load_ps(bp), b1 = _mm256_load_ps(bp + 8);
        PS_ROW(0, c00, c01) PS_ROW(1, c10, c11) PS_ROW(2, c20, c21) PS_ROW(3, c30, c31) PS_ROW(4, c40, c41)
        PS_ROW(5, c50, c51)
    }
    PS_STORE(0, c00, c01) PS_STORE(1, c10, c11) PS_STORE(2, c20, c21) PS_STORE(3, c30, c31) PS_STORE(4, c40, c41)
    PS_STORE(5, c50, c51)
}
#undef PS_ROW
#undef PS_STORE
#endif


#if defined(PREFIXSERVE_AVX2) && defined(__AVX512F__)
#define PREFIXSERVE_WIDE512 1
// -- wide steps on AVX-512 builds: the same GEMM with 16-float vectors ----------------------------------------------
// A panel is 32 outputs (two vectors of 16: blocks of 8 outputs 4 p .. 4 p + 3) x KC inputs decoded to float32
// (KC <= 192: 24 KB, in L1), then 8 rows x 32 outputs a pass, 16 accumulators, two FMAs per broadcast activation.
// A last panel of 16 outputs (N % 32 == 16) runs with one vector. Rows packed eight at a time ([T / 8, K, 8]).
// The same contract as the AVX2 kernel's: products summed in float32 in order of k, a KC block at a time into y;
// a row's result depends on that row only. On an AVX-512 Xeon without BF16 (Cascade Lake, 2 threads), over
// SmolLM2's projections: the AVX2 kernel ran at 63 / 111 GFLOPS at 32 / 64 rows against oneDNN's float32 GEMM's
// 101 / 137.
namespace w512 {
constexpr int MR = 8, NR = 32;
constexpr int MB = 18;           // row blocks a pass over the panels: 144 rows

// 16 floats: the nibbles of blocks a (outputs 0-7) and b (8-15) at one k
inline __m512 decode16(uint32_t a, uint32_t b, __m512i shifts, __m512i mask) {
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(static_cast<int>(a))),
                                         _mm256_set1_epi32(static_cast<int>(b)), 1);
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(v, shifts), mask));
}

// Bp [kc, 32] (its first 16 columns where nc == 1) = weights k0 .. k0 + kc of blocks blk .. blk + 2 nc - 1.
inline void decode_panel(const uint32_t* w, const float* sz, int K, int blk, int nc, int k0, int kc, float* bp) {
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i mask = _mm512_set1_epi32(15);
    const int G = K / GROUP;
    for (int c = 0; c < nc; ++c) {
        const uint32_t* wa = w + static_cast<int64_t>(blk + 2 * c) * K;
        const uint32_t* wb = wa + K;
        const float* sa = sz + static_cast<int64_t>(blk + 2 * c) * G * 16;
        const float* sb = sa + G * 16;
        for (int g = k0 / GROUP; g < (k0 + kc) / GROUP; ++g) {
            const __m512 s = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(sa + g * 16)),
                                                _mm256_loadu_ps(sb + g * 16), 1);
            const __m512 z = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(sa + g * 16 + 8)),
                                                _mm256_loadu_ps(sb + g * 16 + 8), 1);
            float* out = bp + static_cast<int64_t>(g * GROUP - k0) * NR + 16 * c;
            for (int k = g * GROUP; k < (g + 1) * GROUP; ++k, out += NR)
                _mm512_store_ps(out, _mm512_fmadd_ps(decode16(wa[k], wb[k], shifts, mask), s, z));
        }
    }
}

// y[0 .. rows) x 16 NC (+)= ap [kc, 8] x bp [kc, 32]; the first K block stores, later ones add. Named accumulators
// (GCC keeps an array of them in memory).
#define W5_ROW2(r, c0, c1)                                                             \
    {                                                                                  \
        const __m512 a = _mm512_set1_ps(ap[r]);                                        \
        c0 = _mm512_fmadd_ps(a, b0, c0);                                               \
        c1 = _mm512_fmadd_ps(a, b1, c1);                                               \
    }
#define W5_ROW1(r, c0) c0 = _mm512_fmadd_ps(_mm512_set1_ps(ap[r]), b0, c0);
#define W5_STORE(r, c, col)                                                            \
    if ((r) < rows) {                                                                  \
        float* yr = y + (r) * y_stride + 16 * (col);                                   \
        _mm512_storeu_ps(yr, first ? c : _mm512_add_ps(_mm512_loadu_ps(yr), c));       \
    }
void micro2(const float* ap, const float* bp, int kc, float* y, int64_t y_stride, int rows, bool first) {
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
           c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00, c71 = c00;
    for (int k = 0; k < kc; ++k, ap += MR, bp += NR) {
        const __m512 b0 = _mm512_load_ps(bp), b1 = _mm512_load_ps(bp + 16);
        W5_ROW2(0, c00, c01) W5_ROW2(1, c10, c11) W5_ROW2(2, c20, c21) W5_ROW2(3, c30, c31)
        W5_ROW2(4, c40, c41) W5_ROW2(5, c50, c51) W5_ROW2(6, c60, c61) W5_ROW2(7, c70, c71)
    }
    W5_STORE(0, c00, 0) W5_STORE(0, c01, 1) W5_STORE(1, c10, 0) W5_STORE(1, c11, 1) W5_STORE(2, c20, 0)
    W5_STORE(2, c21, 1) W5_STORE(3, c30, 0) W5_STORE(3, c31, 1) W5_STORE(4, c40, 0) W5_STORE(4, c41, 1)
    W5_STORE(5, c50, 0) W5_STORE(5, c51, 1) W5_STORE(6, c60, 0) W5_STORE(6, c61, 1) W5_STORE(7, c70, 0)
    W5_STORE(7, c71, 1)
}
void micro1(const float* ap, const float* bp, int kc, float* y, int64_t y_stride, int rows, bool first) {
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    for (int k = 0; k < kc; ++k, ap += MR, bp += NR) {
        const __m512 b0 = _mm512_load_ps(bp);
        W5_ROW1(0, c0) W5_ROW1(1, c1) W5_ROW1(2, c2) W5_ROW1(3, c3) W5_ROW1(4, c4) W5_ROW1(5, c5) W5_ROW1(6, c6)
        W5_ROW1(7, c7)
    }
    W5_STORE(0, c0, 0) W5_STORE(1, c1, 0) W5_STORE(2, c2, 0) W5_STORE(3, c3, 0) W5_STORE(4, c4, 0)
    W5_STORE(5, c5, 0) W5_STORE(6, c6, 0) W5_STORE(7, c7, 0)
}
#undef W5_ROW2
#undef W5_ROW1
#undef W5_STORE
}  // namespace w512
#endif


#if defined(PREFIXSERVE_WIDE512) && defined(__AVX512VNNI__)
#define PREFIXSERVE_Q16 1
// -- wide steps on AVX-512 VNNI without BF16 (gemm_q16): 4-bit weights x 16-bit activations, integer dot products --
// Each row's activations are rounded per group of 32 to 16-bit integers (a = max |x| / 32767, h = round(x / a)),
// the weights stay their 4-bit values q (0..15) decoded to 16-bit lanes: one vpdpwssd adds 32 products q h into
// 16 exact 32-bit sums (a group's |sum| < 2^24), twice the products of a float32 FMA, at the same rate (measured
// on an AVX-512 Xeon without BF16, Cascade Lake: 98 against 54 G multiply-adds a second a thread). Then
//
//     y[t, n] += (s[n, g] a[t, g]) sum_{k in g} q[n, k] h[t, k]  +  z[n, g] sum_{k in g} x[t, k]      (float32)
//
// a group at a time, in order of g, a KC block at a time into y: a row's result depends on that row only, and
// the weights are exactly the 4-bit ones (W = q s + z); the activations carry a relative rounding of 2^-16 of their
// group's largest (bfloat16's is 2^-9 of each value). A panel is 32 outputs x KC inputs as 16-bit pairs (KC x 64
// bytes) with its groups' s and z, then 6 rows x 32 outputs a pass: 12 integer sums a group, 12 float accumulators.
namespace q16 {
constexpr int MR = 6, NR = 32;
constexpr int MB = 24;           // row blocks a pass over the panels: 144 rows

// A block of MR packed rows: [K / 2, MR] int32 words (h[2 p], h[2 p + 1]), then [G, MR] float a, then [G, MR]
// float sum of x.
inline int64_t block_elems(int K) { return static_cast<int64_t>(K / 2) * MR + 2LL * (K / GROUP) * MR; }

inline void pack_block(const float* x, int64_t x_stride, int T, int K, int b, int32_t* dst) {
    const int G = K / GROUP;
    float* as = reinterpret_cast<float*>(dst + static_cast<int64_t>(K / 2) * MR);
    float* ss = as + static_cast<int64_t>(G) * MR;
    const __m512 sign = _mm512_set1_ps(-0.f);
    alignas(64) int32_t words[GROUP / 2];
    for (int r = 0; r < MR; ++r) {
        const int t = b * MR + r;
        for (int g = 0; g < G; ++g) {
            float mx = 0.f, sum = 0.f;
            if (t < T) {
                const float* xr = x + t * x_stride + g * GROUP;
                const __m512 v0 = _mm512_loadu_ps(xr), v1 = _mm512_loadu_ps(xr + 16);
                mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
                sum = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
                const __m512 inv = _mm512_set1_ps(mx > 0.f ? 32767.f / mx : 0.f);
                const __m256i h0 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)));
                const __m256i h1 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)));
                _mm256_store_si256(reinterpret_cast<__m256i*>(words), h0);
                _mm256_store_si256(reinterpret_cast<__m256i*>(words + 8), h1);
            } else {
                std::memset(words, 0, sizeof(words));
            }
            as[g * MR + r] = mx / 32767.f;
            ss[g * MR + r] = sum;
            int32_t* d = dst + static_cast<int64_t>(g) * (GROUP / 2) * MR + r;
            for (int p = 0; p < GROUP / 2; ++p) d[p * MR] = words[p];
        }
    }
}

// 16 lanes of q (0..15): the nibbles of blocks a (outputs 0-7) and b (8-15) at one k
inline __m512i decode16i(uint32_t a, uint32_t b, __m512i shifts, __m512i mask) {
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(static_cast<int>(a))),
                                         _mm256_set1_epi32(static_cast<int>(b)), 1);
    return _mm512_and_si512(_mm512_srlv_epi32(v, shifts), mask);
}

// bp [kc / 2, 32] int32 words (q[n, 2 p], q[n, 2 p + 1]) and sp [kc / 32, 2, 32] (s, then z) of blocks blk .. blk +
// 2 nc - 1 (its first 16 columns where nc == 1), inputs k0 .. k0 + kc.
inline void decode_panel(const uint32_t* w, const float* sz, int K, int blk, int nc, int k0, int kc, int32_t* bp,
                         float* sp) {
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i mask = _mm512_set1_epi32(15);
    const int G = K / GROUP, g0 = k0 / GROUP;
    for (int c = 0; c < nc; ++c) {
        const uint32_t* wa = w + static_cast<int64_t>(blk + 2 * c) * K;
        const uint32_t* wb = wa + K;
        const float* sa = sz + static_cast<int64_t>(blk + 2 * c) * G * 16;
        const float* sb = sa + G * 16;
        for (int g = g0; g < (k0 + kc) / GROUP; ++g) {
            float* s = sp + (g - g0) * 2 * NR + 16 * c;
            _mm256_store_ps(s, _mm256_loadu_ps(sa + g * 16));
            _mm256_store_ps(s + 8, _mm256_loadu_ps(sb + g * 16));
            _mm256_store_ps(s + NR, _mm256_loadu_ps(sa + g * 16 + 8));
            _mm256_store_ps(s + NR + 8, _mm256_loadu_ps(sb + g * 16 + 8));
            int32_t* out = bp + static_cast<int64_t>(g * GROUP - k0) / 2 * NR + 16 * c;
            for (int k = g * GROUP; k < (g + 1) * GROUP; k += 2, out += NR)
                _mm512_store_si512(out, _mm512_or_si512(decode16i(wa[k], wb[k], shifts, mask),
                                                        _mm512_slli_epi32(decode16i(wa[k + 1], wb[k + 1], shifts, mask), 16)));
        }
    }
}

// y[0 .. rows) x 16 NC (+)= the block's rows (ap words, as scales, ss sums from input k0) x the panel; the first K
// block stores, later ones add. Named accumulators (GCC keeps an array of them in memory).
#define Q16_DOT2(r, i0, i1)                                                            \
    {                                                                                  \
        const __m512i a = _mm512_set1_epi32(ap[r]);                                    \
        i0 = _mm512_dpwssd_epi32(i0, a, b0);                                           \
        i1 = _mm512_dpwssd_epi32(i1, a, b1);                                           \
    }
#define Q16_DOT1(r, i0) i0 = _mm512_dpwssd_epi32(i0, _mm512_set1_epi32(ap[r]), b0);
#define Q16_SCALE(r, i, c, s, z)                                                       \
    c = _mm512_fmadd_ps(z, _mm512_set1_ps(ss[r]),                                      \
                        _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(as[r])), _mm512_cvtepi32_ps(i), c));
#define Q16_STORE(r, c, col)                                                           \
    if ((r) < rows) {                                                                  \
        float* yr = y + (r) * y_stride + 16 * (col);                                   \
        _mm512_storeu_ps(yr, first ? c : _mm512_add_ps(_mm512_loadu_ps(yr), c));       \
    }
void micro2(const int32_t* ap, const float* as, const float* ss, const int32_t* bp, const float* sp, int kc,
                    float* y, int64_t y_stride, int rows, bool first) {
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
           c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int g = 0; g < kc / GROUP; ++g, as += MR, ss += MR, sp += 2 * NR) {
        __m512i i00 = _mm512_setzero_si512(), i01 = i00, i10 = i00, i11 = i00, i20 = i00, i21 = i00, i30 = i00,
                i31 = i00, i40 = i00, i41 = i00, i50 = i00, i51 = i00;
#pragma GCC unroll 16
        for (int p = 0; p < GROUP / 2; ++p, ap += MR, bp += NR) {
            const __m512i b0 = _mm512_load_si512(bp), b1 = _mm512_load_si512(bp + 16);
            Q16_DOT2(0, i00, i01) Q16_DOT2(1, i10, i11) Q16_DOT2(2, i20, i21) Q16_DOT2(3, i30, i31)
            Q16_DOT2(4, i40, i41) Q16_DOT2(5, i50, i51)
        }
        const __m512 s0 = _mm512_load_ps(sp), s1 = _mm512_load_ps(sp + 16);
        const __m512 z0 = _mm512_load_ps(sp + NR), z1 = _mm512_load_ps(sp + NR + 16);
        Q16_SCALE(0, i00, c00, s0, z0) Q16_SCALE(0, i01, c01, s1, z1) Q16_SCALE(1, i10, c10, s0, z0)
        Q16_SCALE(1, i11, c11, s1, z1) Q16_SCALE(2, i20, c20, s0, z0) Q16_SCALE(2, i21, c21, s1, z1)
        Q16_SCALE(3, i30, c30, s0, z0) Q16_SCALE(3, i31, c31, s1, z1) Q16_SCALE(4, i40, c40, s0, z0)
        Q16_SCALE(4, i41, c41, s1, z1) Q16_SCALE(5, i50, c50, s0, z0) Q16_SCALE(5, i51, c51, s1, z1)
    }
    Q16_STORE(0, c00, 0) Q16_STORE(0, c01, 1) Q16_STORE(1, c10, 0) Q16_STORE(1, c11, 1) Q16_STORE(2, c20, 0)
    Q16_STORE(2, c21, 1) Q16_STORE(3, c30, 0) Q16_STORE(3, c31, 1) Q16_STORE(4, c40, 0) Q16_STORE(4, c41, 1)
    Q16_STORE(5, c50, 0) Q16_STORE(5, c51, 1)
}
void micro1(const int32_t* ap, const float* as, const float* ss, const int32_t* bp, const float* sp, int kc,
                    float* y, int64_t y_stride, int rows, bool first) {
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
    for (int g = 0; g < kc / GROUP; ++g, as += MR, ss += MR, sp += 2 * NR) {
        __m512i i0 = _mm512_setzero_si512(), i1 = i0, i2 = i0, i3 = i0, i4 = i0, i5 = i0;
        for (int p = 0; p < GROUP / 2; ++p, ap += MR, bp += NR) {
            const __m512i b0 = _mm512_load_si512(bp);
            Q16_DOT1(0, i0) Q16_DOT1(1, i1) Q16_DOT1(2, i2) Q16_DOT1(3, i3) Q16_DOT1(4, i4) Q16_DOT1(5, i5)
        }
        const __m512 s0 = _mm512_load_ps(sp), z0 = _mm512_load_ps(sp + NR);
        Q16_SCALE(0, i0, c0, s0, z0) Q16_SCALE(1, i1, c1, s0, z0) Q16_SCALE(2, i2, c2, s0, z0)
        Q16_SCALE(3, i3, c3, s0, z0) Q16_SCALE(4, i4, c4, s0, z0) Q16_SCALE(5, i5, c5, s0, z0)
    }
    Q16_STORE(0, c0, 0) Q16_STORE(1, c1, 0) Q16_STORE(2, c2, 0) Q16_STORE(3, c3, 0) Q16_STORE(4, c4, 0)
    Q16_STORE(5, c5, 0)
}
#undef Q16_DOT2
#undef Q16_DOT1
#undef Q16_SCALE
#undef Q16_STORE
}  // namespace q16
#endif


#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PREFIXSERVE_BF16 1
// -- wide decode steps on AVX-512 BF16 (gemm_bf16): bfloat16 dot products over 4-bit weights ----------------------
// A block of 32 outputs (two panels of 16) is decoded, over the whole K, into the bfloat16 weights the dense GEMM
// reads (W = (q - 8) s + z in float32, a product then a sum, rounded to nearest even: torch's dequantization in
// engine/models/quant.py, so the same bits as the dense copy), as dimension pairs: bp[(w * 2 + c) * 16 + j] = the
// 32-bit word (W[n, 2 w], W[n, 2 w + 1]) of output n = 32 b + 16 c + j. The step's rows then run over it 8 at a
// time: each row's word w broadcast, two vdpbf16ps a row (16 accumulators), float32 sums in order of w, each
// output rounded once to bfloat16. The block (K x 32 bfloat16: 96 KB at K = 1,536) stays in L2 for all the rows;
// the weights come from memory as 4-bit values and bfloat16 scales (a third of the dense copy's bytes).
constexpr int BR = 8;            // rows a pass
constexpr int BC = 2;            // panels of 16 outputs a block

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// Bp for the block's two panels (w4 and sz at panel 2 b), words [0, K / 2). A panel's 16 bytes of word w widen to
// 16 lanes: the low nibbles are the first 8 outputs' pairs (q[j, 2 w], q[j, 2 w + 1]) in lanes 2 j, 2 j + 1, the
// high nibbles the last 8's, so the two halves converted to bfloat16 side by side are the words vdpbf16ps reads.
// (q - 8) s is exact in float32 (a 4-bit integer times an 8-bit significand), so one FMA rounds as the product
// then the sum do.
// prefetch_next: the next block (right after this one in w4 and sz, the one this thread decodes next) is prefetched
// into L2 as this one is decoded (its 4-bit weights arrive from memory while this one's rows run, not when its
// decode starts).
inline void decode_block_bf16(const uint8_t* w4, const uint16_t* sz, int K, uint32_t* bp, bool prefetch_next) {
    const int G = K / GROUP, W = K / 2;                                                      // BC panels
    const uint8_t* next_w4 = w4 + static_cast<int64_t>(BC) * W * 16;
    const uint16_t* next_sz = sz + static_cast<int64_t>(BC) * G * 32;
    const __m512i first = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i last = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    const __m512 lut = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    for (int c = 0; c < BC; ++c) {
        const uint8_t* wp = w4 + static_cast<int64_t>(c) * W * 16;
        const uint16_t* zp = sz + static_cast<int64_t>(c) * G * 32;
        for (int g = 0; g < G; ++g) {
            const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(zp + g * 32))), 16));
            const __m512 z = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(zp + g * 32 + 16))), 16));
            const __m512 s_lo = _mm512_permutexvar_ps(first, s), z_lo = _mm512_permutexvar_ps(first, z);
            const __m512 s_hi = _mm512_permutexvar_ps(last, s), z_hi = _mm512_permutexvar_ps(last, z);
            if (prefetch_next) {                 // the next block's bytes at the same place: a group's 256 B
                const uint8_t* nw = next_w4 + static_cast<int64_t>(c) * W * 16 + g * (GROUP / 2) * 16;
                for (int line = 0; line < GROUP / 2 * 16; line += 64) _mm_prefetch(reinterpret_cast<const char*>(nw + line), _MM_HINT_T1);
                _mm_prefetch(reinterpret_cast<const char*>(next_sz + static_cast<int64_t>(c) * G * 32 + g * 32), _MM_HINT_T1);
            }
            for (int w = g * (GROUP / 2); w < (g + 1) * (GROUP / 2); ++w) {
                const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + w * 16)));
                const __m512 lo = _mm512_permutexvar_ps(b, lut);                      // q - 8 (an index's low 4 bits)
                const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);
                const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, s_hi, z_hi), _mm512_fmadd_ps(lo, s_lo, z_lo));
                _mm512_store_si512(bp + (w * BC + c) * 16, reinterpret_cast<const __m512i&>(pair));
            }
        }
    }
}

// y rows [0, R) x 16 BC outputs = x rows x the block bp (W words): bfloat16 out.
template <int R>
void micro_bf16(const uint16_t* x, int64_t x_stride, const uint32_t* bp, int W, uint16_t* y, int64_t y_stride) {
    __m512 acc[R][BC];
    for (int r = 0; r < R; ++r) for (int c = 0; c < BC; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int w = 0; w < W; ++w) {
        __m512i b[BC];
        for (int c = 0; c < BC; ++c) b[c] = _mm512_load_si512(bp + (w * BC + c) * 16);
        for (int r = 0; r < R; ++r) {
            int32_t word;
            std::memcpy(&word, x + r * x_stride + 2 * w, 4);
            const __m512bh a = as_bh(_mm512_set1_epi32(word));
            for (int c = 0; c < BC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, as_bh(b[c]));
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < BC; c += 2) {
            const __m512bh out = _mm512_cvtne2ps_pbh(acc[r][c + 1], acc[r][c]);
            _mm512_storeu_si512(y + r * y_stride + 16 * c, reinterpret_cast<const __m512i&>(out));
        }
}
#endif


#if defined(PREFIXSERVE_AVX2)
// Rows R b .. R b + R - 1 of x as [K, R] floats (zero rows past T): gemm_wide's packed rows.
template <int R>
void pack_rows(const float* x, int64_t x_stride, int T, int K, int b, float* dst) {
    for (int r = 0; r < R; ++r) {
        const int t = b * R + r;
        if (t < T)
            for (int k = 0; k < K; ++k) dst[k * R + r] = x[t * x_stride + k];
        else
            for (int k = 0; k < K; ++k) dst[k * R + r] = 0.f;
    }
}

// gemm_wide's panels on AVX2 builds: 16 outputs (blocks 2 p, 2 p + 1), micro-kernel 6 x 16.
struct Panels256 {
    using A = float;
    static constexpr int MR_ = MR, NR_ = NR, MB_ = MB;
    static int kc(int K) { return kc_block(K); }
    static int64_t block_elems(int K) { return static_cast<int64_t>(K) * MR; }
    static size_t panel_bytes(int kc) { return sizeof(float) * static_cast<size_t>(kc) * NR; }
    static void pack(const float* x, int64_t x_stride, int T, int K, int b, float* dst) {
        pack_rows<MR>(x, x_stride, T, K, b, dst);
    }
    static void run(const uint32_t* w, const float* sz, int K, int N, int p, int k0, int kc, void* scratch,
                    const float* ap, int64_t blocks_from, int64_t blocks_to, float* y, int64_t y_stride, int T) {
        (void)N;
        const int G = K / GROUP;
        float* bp = static_cast<float*>(scratch);
        const uint32_t* w0 = w + static_cast<int64_t>(2 * p) * K;
        const float* sz0 = sz + static_cast<int64_t>(2 * p) * G * 16;
        decode_panel(w0, w0 + K, sz0, sz0 + G * 16, k0, kc, bp);
        for (int64_t b = blocks_from; b < blocks_to; ++b)
            micro(ap + (b * K + k0) * MR, bp, kc, y + b * MR * y_stride + NR * p, y_stride,
                  std::min<int64_t>(MR, T - b * MR), k0 == 0);
    }
};
#endif

#if defined(PREFIXSERVE_WIDE512)
namespace w512 {
// gemm_wide's panels on AVX-512 builds: 32 outputs (blocks 4 p .. 4 p + 3; 16 for a last half panel), 8 x 32.
struct Panels {
    using A = float;
    static constexpr int MR_ = MR, NR_ = NR, MB_ = MB;
    static int kc(int K) { return kc_block(K, 192); }    // a 32 x 192 panel: 24 KB, in L1
    static int64_t block_elems(int K) { return static_cast<int64_t>(K) * MR; }
    static size_t panel_bytes(int kc) { return sizeof(float) * static_cast<size_t>(kc) * NR; }
    static void pack(const float* x, int64_t x_stride, int T, int K, int b, float* dst) {
        pack_rows<MR>(x, x_stride, T, K, b, dst);
    }
    static void run(const uint32_t* w, const float* sz, int K, int N, int p, int k0, int kc, void* scratch,
                    const float* ap, int64_t blocks_from, int64_t blocks_to, float* y, int64_t y_stride, int T) {
        const int nc = std::min(2, (N - NR * p) / 16);
        float* bp = static_cast<float*>(scratch);
        decode_panel(w, sz, K, 4 * p, nc, k0, kc, bp);
        for (int64_t b = blocks_from; b < blocks_to; ++b) {
            const float* a = ap + (b * K + k0) * MR;
            float* yb = y + b * MR * y_stride + NR * p;
            const int rows = static_cast<int>(std::min<int64_t>(MR, T - b * MR));
            if (nc == 2)
                micro2(a, bp, kc, yb, y_stride, rows, k0 == 0);
            else
                micro1(a, bp, kc, yb, y_stride, rows, k0 == 0);
        }
    }
};
}  // namespace w512
#endif

#if defined(PREFIXSERVE_Q16)
namespace q16 {
// gemm_q16's panels: 32 outputs (16 for a last half panel) x KC inputs as 16-bit pairs, 6 x 32.
struct Panels {
    using A = int32_t;
    static constexpr int MR_ = MR, NR_ = NR, MB_ = MB;
    static int kc(int K) { return kc_block(K, 256); }    // a 32 x 256 panel: 16 KB and its scales, in L1
    static int64_t block_elems(int K) { return q16::block_elems(K); }
    static size_t panel_bytes(int kc) { return sizeof(int32_t) * static_cast<size_t>(kc) / 2 * NR + sizeof(float) * static_cast<size_t>(kc) / GROUP * 2 * NR; }
    static void pack(const float* x, int64_t x_stride, int T, int K, int b, int32_t* dst) {
        pack_block(x, x_stride, T, K, b, dst);
    }
    static void run(const uint32_t* w, const float* sz, int K, int N, int p, int k0, int kc, void* scratch,
                            const int32_t* ap, int64_t blocks_from, int64_t blocks_to, float* y, int64_t y_stride, int T) {
        const int nc = std::min(2, (N - NR * p) / 16), G = K / GROUP;
        int32_t* bp = static_cast<int32_t*>(scratch);
        float* sp = reinterpret_cast<float*>(bp + static_cast<int64_t>(kc) / 2 * NR);
        decode_panel(w, sz, K, 4 * p, nc, k0, kc, bp, sp);
        for (int64_t b = blocks_from; b < blocks_to; ++b) {
            const int32_t* blk = ap + b * block_elems(K);
            const float* as = reinterpret_cast<const float*>(blk + static_cast<int64_t>(K / 2) * MR) + (k0 / GROUP) * MR;
            const float* ss = as + static_cast<int64_t>(G) * MR;
            const int32_t* a = blk + static_cast<int64_t>(k0 / 2) * MR;
            float* yb = y + b * MR * y_stride + NR * p;
            const int rows = static_cast<int>(std::min<int64_t>(MR, T - b * MR));
            if (nc == 2)
                micro2(a, as, ss, bp, sp, kc, yb, y_stride, rows, k0 == 0);
            else
                micro1(a, as, ss, bp, sp, kc, yb, y_stride, rows, k0 == 0);
        }
    }
};
}  // namespace q16
#endif

#if defined(PREFIXSERVE_AVX2)
// The wide GEMMs' driver: the step's rows packed P::MR_ at a time (P::pack: zero rows padding the last block), then
// for each group of MB row blocks the threads deal the panels, each decoding its panel a KC block at a time and
// running every row block over it.
template <class P>
int wide_driver(const float* x, int64_t x_stride, const uint32_t* w, const float* sz, float* y, int64_t y_stride,
                int T, int N, int K) {
    using A = typename P::A;
    constexpr int R = P::MR_;
    const int blocks = (T + R - 1) / R, KC = P::kc(K), panels = (N + P::NR_ - 1) / P::NR_;
    const int64_t per_block = P::block_elems(K);
    A* ap = static_cast<A*>(std::aligned_alloc(64, (sizeof(A) * static_cast<size_t>(blocks * per_block) + 63) / 64 * 64));
    if (ap == nullptr) return -1;
    int failed = 0;
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int b = 0; b < blocks; ++b) P::pack(x, x_stride, T, K, b, ap + b * per_block);
        void* bp = std::aligned_alloc(64, (P::panel_bytes(KC) + 63) / 64 * 64);
        if (bp == nullptr) {
            #pragma omp atomic write
            failed = 1;
        }
        for (int b0 = 0; b0 < blocks; b0 += P::MB_) {        // MB row blocks at a time: their rows stay in L2
            const int b1 = std::min(blocks, b0 + P::MB_);
            #pragma omp for schedule(static)
            for (int p = 0; p < panels; ++p) {
                if (bp == nullptr) continue;
                for (int k0 = 0; k0 < K; k0 += KC)
                    P::run(w, sz, K, N, p, k0, std::min(KC, K - k0), bp, ap, b0, b1, y, y_stride, T);
            }
        }
        std::free(bp);
    }
    std::free(ap);
    return failed ? -1 : 0;
}
#endif

}  // namespace

extern "C" {

// x: [T, K] float32 (row stride x_stride); w: [N / 8, K] uint32 (nibble j of w[b, k] = q[8 b + j, k]);
// sz: [N / 8, K / 32, 2, 8] float32 (s, then z, for the block's 8 outputs); y: [T, N] float32 (row stride
// y_stride). Returns 0, or -1 for shapes it does not take (N % 16, K % 32) or no memory for the scratch.
int prefixserve_int4_gemm(const float* x, int64_t x_stride, const uint32_t* w, const float* sz, float* y,
                          int64_t y_stride, int T, int N, int K) {
    if (N % 16 != 0 || K % GROUP != 0 || T < 0) return -1;
    const int G = K / GROUP;
    float* xs = static_cast<float*>(std::malloc(sizeof(float) * static_cast<size_t>(std::max(1, T * G))));
    if (xs == nullptr) return -1;
    for (int t = 0; t < T; ++t)                              // each row's sum over each group
        for (int g = 0; g < G; ++g) {
            float sum = 0.f;
            for (int k = g * GROUP; k < (g + 1) * GROUP; ++k) sum += x[t * x_stride + k];
            xs[t * G + g] = sum;
        }
    const int pairs = N / 16;
    #pragma omp parallel for schedule(static) if (static_cast<int64_t>(N) * K >= 65536)
    for (int p = 0; p < pairs; ++p) {
        const int b = 2 * p;
#if defined(PREFIXSERVE_AVX2)
        const uint32_t* w0 = w + static_cast<int64_t>(b) * K;
        const uint32_t* w1 = w0 + K;
        const float* sz0 = sz + static_cast<int64_t>(b) * G * 16;
        const float* sz1 = sz0 + G * 16;
        int t = 0;
        for (; t + ROWS <= T; t += ROWS)
            pass<ROWS>(x + t * x_stride, x_stride, xs + t * G, w0, w1, sz0, sz1, y + t * y_stride + 8 * b, y_stride, K);
        switch (T - t) {
            case 3: pass<3>(x + t * x_stride, x_stride, xs + t * G, w0, w1, sz0, sz1, y + t * y_stride + 8 * b, y_stride, K); break;
            case 2: pass<2>(x + t * x_stride, x_stride, xs + t * G, w0, w1, sz0, sz1, y + t * y_stride + 8 * b, y_stride, K); break;
            case 1: pass<1>(x + t * x_stride, x_stride, xs + t * G, w0, w1, sz0, sz1, y + t * y_stride + 8 * b, y_stride, K); break;
            default: break;
        }
#else
        for (int n = 8 * b; n < 8 * b + 16; ++n) generic(x, x_stride, xs, w, sz, y, y_stride, T, n, K);
#endif
    }
    std::free(xs);
    return 0;
}

// x: [T, K] float32 (row stride x_stride); w: [N / 8, K / 4, 8, 4] bytes q in 0..15 (32-byte aligned); sz as
// prefixserve_int4_gemm's; y: [T, N] float32 (row stride y_stride). Returns 0, or -1 for shapes it does not take
// (N % 16, K % 32) or no memory for the scratch.
int prefixserve_int4_gemm_q8(const float* x, int64_t x_stride, const uint8_t* w, const float* sz, float* y,
                             int64_t y_stride, int T, int N, int K) {
    if (N % 16 != 0 || K % GROUP != 0 || T < 0) return -1;
    if (T == 0) return 0;
    const int G = K / GROUP;
    const int64_t xq_stride = K;
    int8_t* xh = static_cast<int8_t*>(std::malloc(static_cast<size_t>(T) * K));
    float* xa = static_cast<float*>(std::malloc(sizeof(float) * static_cast<size_t>(T) * G * 2));
    if (xh == nullptr || xa == nullptr) { std::free(xh); std::free(xa); return -1; }
    float* xs = xa + static_cast<int64_t>(T) * G;
    #pragma omp parallel for schedule(static) if (static_cast<int64_t>(T) * K >= 65536)
    for (int t = 0; t < T; ++t)                              // each row's groups: scale, bytes, float sum
        for (int g = 0; g < G; ++g) {
            const float* xr = x + t * x_stride + g * GROUP;
            float mx = 0.f, sum = 0.f;
            for (int k = 0; k < GROUP; ++k) { mx = std::max(mx, std::fabs(xr[k])); sum += xr[k]; }
            const float inv = mx > 0.f ? 127.f / mx : 0.f;
            for (int k = 0; k < GROUP; ++k) xh[t * xq_stride + g * GROUP + k] = static_cast<int8_t>(std::nearbyint(xr[k] * inv));
            xa[t * G + g] = mx / 127.f;
            xs[t * G + g] = sum;
        }
    const int pairs = N / 16;
    #pragma omp parallel for schedule(static) if (static_cast<int64_t>(N) * K * T >= 262144)
    for (int p = 0; p < pairs; ++p) {
        const int b = 2 * p;
#if defined(PREFIXSERVE_AVX2)
        const uint8_t* w0 = w + static_cast<int64_t>(b) * K * 8;
        const uint8_t* w1 = w0 + static_cast<int64_t>(K) * 8;
        const float* sz0 = sz + static_cast<int64_t>(b) * G * 16;
        const float* sz1 = sz0 + G * 16;
        int t = 0;
        for (; t + Q8_ROWS <= T; t += Q8_ROWS)
            q8_pass<Q8_ROWS>(xh + t * xq_stride, xq_stride, xa + t * G, xs + t * G, w0, w1, sz0, sz1, y + t * y_stride + 8 * b,
                             y_stride, K);
        for (; t < T; ++t)
            q8_pass<1>(xh + t * xq_stride, xq_stride, xa + t * G, xs + t * G, w0, w1, sz0, sz1, y + t * y_stride + 8 * b,
                       y_stride, K);
#else
        for (int n = 8 * b; n < 8 * b + 16; ++n) q8_generic(xh, xq_stride, xa, xs, w, sz, y, y_stride, T, n, K);
#endif
    }
    std::free(xh);
    std::free(xa);
    return 0;
}

// x: [T, K] float32 (row stride x_stride); w, sz: as prefixserve_int4_gemm's; y: [T, N] float32 (row stride
// y_stride). The same product for wide steps: each 16 x KC panel of W (32 x KC on AVX-512 builds: w512) decoded
// to float32 once and multiplied by all T rows. Returns 0, or -1 for shapes it does not take (N % 16, K % 32) or no memory for the scratch.
int prefixserve_int4_gemm_wide(const float* x, int64_t x_stride, const uint32_t* w, const float* sz, float* y,
                               int64_t y_stride, int T, int N, int K) {
#if defined(PREFIXSERVE_AVX2)
    if (N % 16 != 0 || K % GROUP != 0 || T < 0) return -1;
    if (T == 0) return 0;
#if defined(PREFIXSERVE_WIDE512)
    return wide_driver<w512::Panels>(x, x_stride, w, sz, y, y_stride, T, N, K);
#else
    return wide_driver<Panels256>(x, x_stride, w, sz, y, y_stride, T, N, K);
#endif
#else
    return prefixserve_int4_gemm(x, x_stride, w, sz, y, y_stride, T, N, K);
#endif
}

// x: [T, K] float32 (row stride x_stride); w, sz: as prefixserve_int4_gemm's; y: [T, N] float32 (row stride
// y_stride). The same product with each group of 32 of a row rounded to 16-bit integers (gemm_q16, above). Returns
// 0; -1 for shapes it does not take (N % 16, K % 32) or no memory for the scratch; -2 on a build without AVX-512
// VNNI (prefixserve_int4_gemm_has_q16).
int prefixserve_int4_gemm_q16(const float* x, int64_t x_stride, const uint32_t* w, const float* sz, float* y,
                              int64_t y_stride, int T, int N, int K) {
#if defined(PREFIXSERVE_Q16)
    if (N % 16 != 0 || K % GROUP != 0 || T < 0) return -1;
    if (T == 0) return 0;
    return wide_driver<q16::Panels>(x, x_stride, w, sz, y, y_stride, T, N, K);
#else
    (void)x; (void)x_stride; (void)w; (void)sz; (void)y; (void)y_stride; (void)T; (void)N; (void)K;
    return -2;
#endif
}

// Whether this build has gemm_q16 (AVX-512 VNNI builds).
int prefixserve_int4_gemm_has_q16() {
#if defined(PREFIXSERVE_Q16)
    return 1;
#else
    return 0;
#endif
}

// x: [T, K] bfloat16 (row stride x_stride); w4: [N / 16, K / 2, 16] bytes (byte (p, w, 2 j + c) =
// q[16 p + j, 2 w + c] | q[16 p + 8 + j, 2 w + c] << 4); sz: [N / 16, K / 32, 2, 16] bfloat16 (s, then z, of the panel's
// 16 outputs); y: [T, N] bfloat16 (row stride y_stride). Returns 0; -1 for shapes it does not take (N % 32,
// K % 32) or no memory for the scratch; -2 on a build without AVX-512 BF16.
int prefixserve_int4_gemm_bf16(const uint16_t* x, int64_t x_stride, const uint8_t* w4, const uint16_t* sz,
                               uint16_t* y, int64_t y_stride, int T, int N, int K) {
#if defined(PREFIXSERVE_BF16)
    if (N % (16 * BC) != 0 || K % GROUP != 0 || T < 0) return -1;
    if (T == 0) return 0;
    const int W = K / 2, G = K / GROUP;
    int failed = 0;
    #pragma omp parallel
    {
        uint32_t* bp = static_cast<uint32_t*>(std::aligned_alloc(64, sizeof(uint32_t) * static_cast<size_t>(W) * 16 * BC));
        if (bp == nullptr) {
            #pragma omp atomic write
            failed = 1;
        }
        const int blocks = N / (16 * BC);
        #pragma omp for schedule(static)
        for (int b = 0; b < blocks; ++b) {           // static: a thread's blocks are consecutive, b + 1 its next
            if (bp == nullptr) continue;
            decode_block_bf16(w4 + static_cast<int64_t>(BC * b) * W * 16, sz + static_cast<int64_t>(BC * b) * G * 32, K,
                              bp, b + 1 < blocks);
            int t = 0;
            for (; t + BR <= T; t += BR)
                micro_bf16<BR>(x + t * x_stride, x_stride, bp, W, y + t * y_stride + 16 * BC * b, y_stride);
            switch (T - t) {
#define PREFIXSERVE_REST(R) case R: micro_bf16<R>(x + t * x_stride, x_stride, bp, W, y + t * y_stride + 16 * BC * b, y_stride); break;
                PREFIXSERVE_REST(1) PREFIXSERVE_REST(2) PREFIXSERVE_REST(3) PREFIXSERVE_REST(4) PREFIXSERVE_REST(5)
                PREFIXSERVE_REST(6) PREFIXSERVE_REST(7)
#undef PREFIXSERVE_REST
                default: break;
            }
        }
        std::free(bp);
    }
    return failed ? -1 : 0;
#else
    (void)x; (void)x_stride; (void)w4; (void)sz; (void)y; (void)y_stride; (void)T; (void)N; (void)K;
    return -2;
#endif
}

// Whether this build has gemm_bf16 (AVX-512 BF16).
int prefixserve_int4_gemm_has_bf16() {
#if defined(PREFIXSERVE_BF16)
    return 1;
#else
    return 0;
#endif
}

// The loops this build runs: "avx2" or "generic".
const char* prefixserve_int4_gemm_path() {
#if defined(PREFIXSERVE_AVX2)
    return "avx2";
#else
    return "generic";
#endif
}

const char* prefixserve_int4_gemm_wide_path() {      // gemm_wide's loops: avx512 (w512), avx2, generic (gemm's)
#if defined(PREFIXSERVE_WIDE512)
    return "avx512";
#elif defined(PREFIXSERVE_AVX2)
    return "avx2";
#else
    return "generic";
#endif
}

}  // extern "C"
