// Per-row reductions over a step's logits [T, V] (V = the vocabulary, 49,152 for SmolLM2) on the CPU, for
// the sampler and the output projection. torch runs each as its own pass and operator (logsumexp 1.8 ms,
// argmax 1.3 ms, topk 1.9 ms at 64 rows here); these read a row twice at most, the second time from cache.
// Launchers and the contract: kernels/cpu/logits.py.
//
//     row_stats   lse[t] = log sum_v exp(x[t, v]) with torch.logsumexp's special values (NaN if the row has
//                 a NaN, +inf if it has a +inf, -inf if every logit is -inf); arg[t] = the first index of
//                 the row's maximum (torch.argmax's choice on rows without NaN)
//     row_topk    the indices of the k largest logits of each row (k <= 64), in no particular order; of
//                 equal values at the boundary, the first in the row
//     refine      logits[t, top[t, j]] = w[top[t, j]] . x[t] in float32: a quantized head's chosen logits
//                 recomputed from the float weight, its rows read in place (torch would gather them first)
//     row_sample  one draw per row from softmax(x[t] / temperature[t]) by inverse CDF with the row's uniform
//                 u[t]: what the sampler's torch path does (softmax, a float64 cumsum, two searchsorted) in
//                 two passes over the row and a scan of one block (256 tokens), no [T, V] temporaries
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <omp.h>
#include "bf16_convert.h"
#include "simd_math.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PREFIXSERVE_AVX2 1
#endif

namespace {
using namespace prefixserve_bf16;

constexpr int MAX_K = 64;



// One row: (max, first index of the max, any NaN).
void row_max(const float* x, int V, float* mx, int64_t* arg, bool* nan) {
    int v = 0;
    float best = -std::numeric_limits<float>::infinity();
    int64_t at = 0;
    bool has_nan = false;
#if defined(__AVX512F__)
    if (V >= 16) {
        __m512 m = _mm512_set1_ps(-INFINITY);
        __m512i idx = _mm512_setzero_si512();
        __m512i cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 unord = 0;
        for (; v + 16 <= V; v += 16) {
            const __m512 a = _mm512_loadu_ps(x + v);
            unord |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
            const __mmask16 gt = _mm512_cmp_ps_mask(a, m, _CMP_GT_OQ);      // strictly: each lane keeps its first
            m = _mm512_mask_mov_ps(m, gt, a);
            idx = _mm512_mask_mov_epi32(idx, gt, cur);
            cur = _mm512_add_epi32(cur, step);
        }
        alignas(64) float mv[16];
        alignas(64) int32_t iv[16];
        _mm512_store_ps(mv, m);
        _mm512_store_si512(iv, idx);
        has_nan = unord != 0;
        for (int l = 0; l < 16; ++l)                         // the row's max; of equal ones the first index
            if (mv[l] > best || (mv[l] == best && iv[l] < at)) { best = mv[l]; at = iv[l]; }
    }
#elif defined(PREFIXSERVE_AVX2)
    if (V >= 8) {
        __m256 m = _mm256_set1_ps(-INFINITY);
        __m256i idx = _mm256_setzero_si256();
        __m256i cur = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i step = _mm256_set1_epi32(8);
        __m256 unord = _mm256_setzero_ps();
        for (; v + 8 <= V; v += 8) {
            const __m256 a = _mm256_loadu_ps(x + v);
            unord = _mm256_or_ps(unord, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
            const __m256 gt = _mm256_cmp_ps(a, m, _CMP_GT_OQ);           // strictly: each lane keeps its first
            m = _mm256_blendv_ps(m, a, gt);
            idx = _mm256_blendv_epi8(idx, cur, _mm256_castps_si256(gt));
            cur = _mm256_add_epi32(cur, step);
        }
        alignas(32) float mv[8];
        alignas(32) int32_t iv[8];
        _mm256_store_ps(mv, m);
        _mm256_store_si256(reinterpret_cast<__m256i*>(iv), idx);
        has_nan = _mm256_movemask_ps(unord) != 0;
        for (int l = 0; l < 8; ++l)                          // the row's max; of equal ones the first index
            if (mv[l] > best || (mv[l] == best && iv[l] < at)) { best = mv[l]; at = iv[l]; }
    }
#endif
    for (; v < V; ++v) {
        const float a = x[v];
        if (std::isnan(a)) has_nan = true;
        else if (a > best) { best = a; at = v; }
    }
    *mx = best;
    *arg = at;
    *nan = has_nan;
}

// sum_v exp(x[v] - shift) (float32 lanes, summed in double at the end)
double row_sum_exp(const float* x, int V, float shift) {
    int v = 0;
    double total = 0.0;
#if defined(__AVX512F__)
    {
        const __m512 s = _mm512_set1_ps(shift);
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        for (; v + 32 <= V; v += 32) {
            acc0 = _mm512_add_ps(acc0, prefixserve_simd::exp512(_mm512_sub_ps(_mm512_loadu_ps(x + v), s)));
            acc1 = _mm512_add_ps(acc1, prefixserve_simd::exp512(_mm512_sub_ps(_mm512_loadu_ps(x + v + 16), s)));
        }
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, _mm512_add_ps(acc0, acc1));
        for (float l : lanes) total += l;
    }
#elif defined(PREFIXSERVE_AVX2)
    {
        const __m256 s = _mm256_set1_ps(shift);
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (; v + 16 <= V; v += 16) {
            acc0 = _mm256_add_ps(acc0, prefixserve_simd::exp256(_mm256_sub_ps(_mm256_loadu_ps(x + v), s)));
            acc1 = _mm256_add_ps(acc1, prefixserve_simd::exp256(_mm256_sub_ps(_mm256_loadu_ps(x + v + 8), s)));
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, _mm256_add_ps(acc0, acc1));
        for (float l : lanes) total += l;
    }
#endif
    for (; v < V; ++v) total += std::exp(static_cast<double>(x[v]) - shift);
    return total;
}

template <typename X>
void row_topk(const X* x, int V, int k, int64_t* out) {
    float val[MAX_K];
    int64_t idx[MAX_K];
    int n = std::min(k, V);
    for (int i = 0; i < n; ++i) { val[i] = to_float(x[i]); idx[i] = i; }
    // NaN counts as nothing here: it never displaces a number (the sampler reports NaN rows as failed)
    for (int i = 0; i < n; ++i) if (std::isnan(val[i])) val[i] = -std::numeric_limits<float>::infinity();
    int lo = 0;                                               // the slot of the smallest kept value
    auto find_lo = [&] {
        lo = 0;
        for (int i = 1; i < n; ++i) if (val[i] < val[lo] || (val[i] == val[lo] && idx[i] > idx[lo])) lo = i;
    };
    find_lo();
    auto offer = [&](int v, float a) {                        // strictly larger only: earlier ties stay
        if (a > val[lo]) { val[lo] = a; idx[lo] = v; find_lo(); }
    };
    int v = n;
#if defined(__AVX512F__)
    {
        for (; v + 16 <= V; v += 16) {
            const __m512 a = load16(x + v);
            __mmask16 gt = _mm512_cmp_ps_mask(a, _mm512_set1_ps(val[lo]), _CMP_GT_OQ);
            while (gt) {
                const int l = __builtin_ctz(gt);
                gt &= gt - 1;
                offer(v + l, to_float(x[v + l]));
            }
        }
    }
#elif defined(PREFIXSERVE_AVX2)
    {
        for (; v + 8 <= V; v += 8) {
            const __m256 a = load8(x + v);
            unsigned gt = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(val[lo]), _CMP_GT_OQ)));
            while (gt) {
                const int l = __builtin_ctz(gt);
                gt &= gt - 1;
                offer(v + l, to_float(x[v + l]));
            }
        }
    }
#endif
    for (; v < V; ++v) offer(v, to_float(x[v]));
    for (int i = 0; i < n; ++i) out[i] = idx[i];
}

template <typename W>
float row_dot(const W* w, const float* x, int H) {
    int h = 0;
    float total = 0.f;
#if defined(__AVX512F__)
    {
        __m512 acc = _mm512_setzero_ps();
        for (; h + 16 <= H; h += 16) acc = _mm512_fmadd_ps(load16(w + h), _mm512_loadu_ps(x + h), acc);
        total = _mm512_reduce_add_ps(acc);
    }
#elif defined(PREFIXSERVE_AVX2)
    {
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (; h + 16 <= H; h += 16) {
            acc0 = _mm256_fmadd_ps(load8(w + h), _mm256_loadu_ps(x + h), acc0);
            acc1 = _mm256_fmadd_ps(load8(w + h + 8), _mm256_loadu_ps(x + h + 8), acc1);
        }
        total = prefixserve_simd::hsum256(_mm256_add_ps(acc0, acc1));
    }
#endif
    for (; h < H; ++h) total += to_float(w[h]) * x[h];
    return total;
}

// Sum of e[0, n) in double (each float widened exactly; vector lanes, then their sum).
double sum_double(const float* e, int n) {
    int v = 0;
    double total = 0.0;
#if defined(__AVX512F__)
    {
        __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
        for (; v + 16 <= n; v += 16) {
            const __m512 f = _mm512_loadu_ps(e + v);
            a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(f)));
            a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1))));
        }
        total = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
    }
#elif defined(PREFIXSERVE_AVX2)
    {
        __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
        for (; v + 8 <= n; v += 8) {
            const __m256 f = _mm256_loadu_ps(e + v);
            a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(f)));
            a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
        }
        alignas(32) double lanes[4];
        _mm256_store_pd(lanes, _mm256_add_pd(a0, a1));
        total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    }
#endif
    for (; v < n; ++v) total += e[v];
    return total;
}

constexpr int SAMPLE_BLOCKS = 256;  // row_sample's blocks at most: their sums find the draw's block, then its scan

// One draw from softmax(x / temperature) by inverse CDF: e_v = exp(x_v / temperature - shift) in float32
// (shift: the row's largest scaled logit), summed in double; the token is the first v with e_v > 0 whose
// running sum exceeds u * total, else (rounding) the last v with e_v > 0. The sums run a block of 256 tokens at
// a time (more where V > 65,536: 256 blocks at most; each block's in vector lanes, then the blocks in order), and
// only the block where the running sum
// crosses u * total is scanned token by token: the order of additions differs from a plain cumsum by rounding
// only. A row without a finite maximum (NaN, +inf, every logit -inf) gives its argmax: the sampler reports or
// masks those rows. e: V floats of scratch.
int64_t row_sample(const float* x, int V, float temperature, double u, float* e) {
    float mx;
    int64_t arg;
    bool nan;
    row_max(x, V, &mx, &arg, &nan);
    if (nan || !std::isfinite(mx)) return arg;
    const float shift = mx / temperature;                 // = max_v (x_v / temperature): division is monotonic
    int v = 0;
#if defined(__AVX512F__)
    {
        const __m512 t = _mm512_set1_ps(temperature), s = _mm512_set1_ps(shift);
        for (; v + 16 <= V; v += 16)
            _mm512_storeu_ps(e + v, prefixserve_simd::exp512(_mm512_sub_ps(_mm512_div_ps(_mm512_loadu_ps(x + v), t), s)));
    }
#elif defined(PREFIXSERVE_AVX2)
    {
        const __m256 t = _mm256_set1_ps(temperature), s = _mm256_set1_ps(shift);
        for (; v + 8 <= V; v += 8)
            _mm256_storeu_ps(e + v, prefixserve_simd::exp256(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + v), t), s)));
    }
#endif
    for (; v < V; ++v) e[v] = std::exp(x[v] / temperature - shift);
    const int block = std::max(256, (V + SAMPLE_BLOCKS - 1) / SAMPLE_BLOCKS), blocks = (V + block - 1) / block;
    double sums[SAMPLE_BLOCKS];
    double total = 0.0;
    for (int b = 0; b < blocks; ++b) {
        sums[b] = sum_double(e + b * block, std::min(block, V - b * block));
        total += sums[b];
    }
    const double target = u * total;
    double cum = 0.0;
    int b = 0;
    for (; b < blocks && !(cum + sums[b] > target); ++b) cum += sums[b];
    for (v = b * block; v < V; ++v) {               // the crossing's block (and past it, should rounding say so)
        if (e[v] > 0.f) {
            cum += e[v];
            if (cum > target) return v;
        }
    }
    for (v = V - 1; v >= 0; --v)
        if (e[v] > 0.f) return v;
    return arg;
}

}  // namespace

extern "C" {

// x: [T, V] float32, row stride x_stride; lse: [T] float32; arg: [T] int64.
void prefixserve_row_stats(const float* x, int64_t x_stride, int T, int V, float* lse, int64_t* arg) {
    #pragma omp parallel for schedule(static) if (static_cast<int64_t>(T) * V >= 65536)
    for (int t = 0; t < T; ++t) {
        const float* row = x + t * x_stride;
        float mx;
        bool nan;
        row_max(row, V, &mx, arg + t, &nan);
        if (nan) lse[t] = std::numeric_limits<float>::quiet_NaN();
        else if (std::isinf(mx)) lse[t] = mx;                // +inf: inf; every logit -inf: -inf
        else lse[t] = mx + static_cast<float>(std::log(row_sum_exp(row, V, mx)));
    }
}

// x: [T, V] (dtype 0 float32, 1 bfloat16), row stride x_stride; out: [T, k] int64. Returns 0, or -1 for k
// out of range.
int prefixserve_row_topk(const void* x, int dtype, int64_t x_stride, int T, int V, int k, int64_t* out) {
    if (k < 1 || k > MAX_K || k > V) return -1;
    #pragma omp parallel for schedule(static) if (static_cast<int64_t>(T) * V >= 65536)
    for (int t = 0; t < T; ++t) {
        if (dtype == 1) row_topk(static_cast<const uint16_t*>(x) + t * x_stride, V, k, out + t * k);
        else row_topk(static_cast<const float*>(x) + t * x_stride, V, k, out + t * k);
    }
    return 0;
}

// x: [T, H] float32 (row stride x_stride); w: [V, H] (dtype 0 float32, 1 bfloat16; row stride w_stride);
// top: [T, k] int64 in [0, V); logits: [T, V] float32 (row stride l_stride), written at the top entries only.
void prefixserve_refine(const float* x, int64_t x_stride, const void* w, int dtype, int64_t w_stride,
                        const int64_t* top, int T, int k, int H, float* logits, int64_t l_stride) {
    #pragma omp parallel for schedule(static) if (static_cast<int64_t>(T) * k * H >= 65536)
    for (int t = 0; t < T; ++t) {
        const float* xr = x + t * x_stride;
        for (int j = 0; j < k; ++j) {
            const int64_t v = top[static_cast<int64_t>(t) * k + j];
            logits[t * l_stride + v] = dtype == 1
                ? row_dot(static_cast<const uint16_t*>(w) + v * w_stride, xr, H)
                : row_dot(static_cast<const float*>(w) + v * w_stride, xr, H);
        }
    }
}

// x: [T, V] float32 (row stride x_stride); temperature: [T] float32 > 0; u: [T] float64 in [0, 1);
// out: [T] int64. Returns 0, or -1 when the scratch cannot be allocated.
int prefixserve_row_sample(const float* x, int64_t x_stride, int T, int V, const float* temperature,
                           const double* u, int64_t* out) {
    const bool parallel = static_cast<int64_t>(T) * V >= 65536;
    const int threads = parallel ? omp_get_max_threads() : 1;
    float* scratch = static_cast<float*>(std::malloc(sizeof(float) * static_cast<size_t>(V) * threads));
    if (scratch == nullptr) return -1;
    #pragma omp parallel for schedule(static) if (parallel) num_threads(threads)
    for (int t = 0; t < T; ++t)
        out[t] = row_sample(x + t * x_stride, V, temperature[t], u[t],
                            scratch + static_cast<size_t>(V) * omp_get_thread_num());
    std::free(scratch);
    return 0;
}

// The loops this build runs: "avx512", "avx2" or "generic".
const char* prefixserve_logits_path() {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(PREFIXSERVE_AVX2)
    return "avx2";
#else
    return "generic";
#endif
}

}  // extern "C"
