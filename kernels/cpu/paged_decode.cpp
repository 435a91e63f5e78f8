// Paged decode attention on the CPU: one query token per sequence, K and V read in place through the
// block table (no gather, no padding), GQA-aware, split-KV and cascade. Launcher, layout and the work plan:
// kernels/cpu/paged_decode.py.
//
// The launcher hands a plan of work items: (members, blocks [b0, b1)). An item reads blocks b0..b1 of its
// first member's table once and attends every member's queries over them: one member is a split of one
// sequence's context; several are the sequences of a cascade group, whose tables start with the same
// blocks (a shared prefix), so the prefix is read once for all of them instead of once each. Per block and
// per KV head an item computes the scores of the queries sharing that KV head (GQA), rescales their running
// max / sum / accumulator once (online softmax, fp32) and adds the block's V rows. Every item writes
// partial results (max, sum, unnormalized accumulator) per (member, head); a second pass merges each
// sequence's partials; an empty one (max = -inf) weighs nothing.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <omp.h>
#include "amx_tile.h"
#include "bf16_convert.h"
#include "bf16_tile.h"
#include "simd_math.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {
using namespace prefixserve_bf16;

constexpr int MAX_GROUP = 16;
constexpr int MAX_HEADS = 64;
constexpr int MAX_BLOCK = 256;
constexpr int MAX_MEMBERS = 16;
constexpr int TILE = 64;          // keys a tile



struct Args {
    const float* q; const void* kc; const void* vc; const int32_t* bt; int64_t bt_stride; const int32_t* lens;
    float* out; int S, H, Hkv, D, B; float scale;
    int64_t kc_blk, kc_tok, kc_head, vc_blk, vc_tok, vc_head;
};

// An item's query rows for one KV head: row x is member x / G's head h * G + x % G. Its running state lives
// in the item's partials: st = part + (member * H + head) * (D + 2) = {max, sum, accumulator[D]}.
struct Rows {
    const float* q[MAX_MEMBERS * MAX_GROUP];
    float* st[MAX_MEMBERS * MAX_GROUP];
    int n;
};

inline Rows rows_of(const float* qs, float* part, int nmem, int h, int H, int G, int D) {
    Rows r;
    r.n = nmem * G;
    for (int x = 0; x < r.n; ++x) {
        const int head = h * G + x % G, i = x / G;
        r.q[x] = qs + (static_cast<int64_t>(i) * H + head) * D;
        r.st[x] = part + (static_cast<int64_t>(i) * H + head) * (D + 2);
    }
    return r;
}

// The portable loops (a CPU without AVX2): token by token, row by row.
template <typename KV>
void tile_generic(const Rows& r, const KV* const* krow, const KV* const* vrow, int n, int D, float* sc,
                  int sc_stride) {
    for (int x = 0; x < r.n; ++x) {
        float* s = sc + static_cast<int64_t>(x) * sc_stride;
        float* st = r.st[x];
        float mx = st[0];
        for (int j = 0; j < n; ++j) {
            float dot = 0.f;
            for (int d = 0; d < D; ++d) dot += r.q[x][d] * to_float(krow[j][d]);
            s[j] = dot;
            mx = std::max(mx, dot);
        }
        const float alpha = std::exp(st[0] - mx);
        float sum = 0.f;
        for (int j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
        st[0] = mx;
        st[1] = st[1] * alpha + sum;
        float* acc = st + 2;
        for (int d = 0; d < D; ++d) acc[d] *= alpha;
        for (int j = 0; j < n; ++j)
            for (int d = 0; d < D; ++d) acc[d] += s[j] * to_float(vrow[j][d]);
    }
}

#if defined(__AVX512F__)
using prefixserve_simd::exp512;

inline void transpose16(__m512* r) {      // 16 x 16 32-bit words, in place: the integer words' shuffles
    __m512i w[16];
    for (int i = 0; i < 16; ++i) w[i] = _mm512_castps_si512(r[i]);
    prefixserve_simd::transpose16(w);
    for (int i = 0; i < 16; ++i) r[i] = _mm512_castsi512_ps(w[i]);
}

// K rows k[0..m) (m <= 16, one pointer a token), transposed to float32: kt[d * 16 + j] = k[j][d], zero past m.
// bfloat16: a 32-bit word holds the pair (d, d + 1), so one word transpose serves 32 dimensions, split after.
inline void transpose_k(const uint16_t* const* k, int m, int D, float* kt) {
    for (int d0 = 0; d0 < D; d0 += 32) {
        const int w = std::min(32, D - d0) / 2;                  // words of this slice (16, or 8 at D % 32 == 16)
        const __mmask16 lanes = static_cast<__mmask16>((1u << w) - 1);
        __m512 r[16];
        for (int j = 0; j < 16; ++j)
            r[j] = j < m ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(lanes, k[j] + d0)) : _mm512_setzero_ps();
        transpose16(r);
        for (int x = 0; x < w; ++x) {
            const __m512i u = _mm512_castps_si512(r[x]);
            _mm512_store_ps(kt + (d0 + 2 * x) * 16, _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
            _mm512_store_ps(kt + (d0 + 2 * x + 1) * 16,
                            _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))));
        }
    }
}
inline void transpose_k(const float* const* k, int m, int D, float* kt) {
    for (int d0 = 0; d0 < D; d0 += 16) {
        __m512 r[16];
        for (int j = 0; j < 16; ++j) r[j] = j < m ? _mm512_loadu_ps(k[j] + d0) : _mm512_setzero_ps();
        transpose16(r);
        for (int x = 0; x < 16; ++x) _mm512_store_ps(kt + (d0 + x) * 16, r[x]);
    }
}

// Scores of T rows for C chunks of 16 tokens: s[t][c] = sum_d q_t[d] kt_c[d]; each K column is loaded once
// for the rows, each query element broadcast once for the chunks; T * C independent sums hide the FMA latency.
template <int T, int C>
inline void scores_tile(const float* const* q, const float* kt, int D, float* sc, int sc_stride) {
    __m512 s[T][C];
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c) s[t][c] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) {
        __m512 k[C];
        for (int c = 0; c < C; ++c) k[c] = _mm512_load_ps(kt + (c * D + d) * 16);
        for (int t = 0; t < T; ++t) {
            const __m512 qv = _mm512_set1_ps(q[t][d]);
            for (int c = 0; c < C; ++c) s[t][c] = _mm512_fmadd_ps(qv, k[c], s[t][c]);
        }
    }
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c) _mm512_store_ps(sc + t * sc_stride + c * 16, s[t][c]);
}

template <int T>
inline void scores_rows(const float* const* q, const float* kt, int D, int chunks, float* sc, int sc_stride) {
    int c = 0;
    for (; c + 2 <= chunks; c += 2) scores_tile<T, 2>(q, kt + c * D * 16, D, sc + c * 16, sc_stride);
    if (c < chunks) scores_tile<T, 1>(q, kt + c * D * 16, D, sc + c * 16, sc_stride);
}

// acc_x = alpha_x acc_x + sum_j p_x[j] V[j] for T rows, the accumulators in registers over the block's tokens.
template <typename KV, int NV, int T>
inline void values_tile(float* const* st, const float* alpha, const float* p, int p_stride, const KV* const* vrow,
                        int n) {
    __m512 acc[T][NV];
    for (int t = 0; t < T; ++t) {
        const __m512 a = _mm512_set1_ps(alpha[t]);
        for (int v = 0; v < NV; ++v) acc[t][v] = _mm512_mul_ps(a, _mm512_loadu_ps(st[t] + 2 + 16 * v));
    }
    for (int j = 0; j < n; ++j) {
        __m512 vr[NV];
        for (int v = 0; v < NV; ++v) vr[v] = load16(vrow[j] + 16 * v);
        for (int t = 0; t < T; ++t) {
            const __m512 w = _mm512_set1_ps(p[t * p_stride + j]);
            for (int v = 0; v < NV; ++v) acc[t][v] = _mm512_fmadd_ps(w, vr[v], acc[t][v]);
        }
    }
    for (int t = 0; t < T; ++t)
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(st[t] + 2 + 16 * v, acc[t][v]);
}

// rows at a time whose accumulators stay in registers (T * NV <= 24 of the 32)
template <int NV>
constexpr int v_rows() { return NV <= 3 ? 8 / (NV == 3 ? 2 : 1) : 24 / NV; }

template <typename KV, int NV>
inline void values_rows(float* const* st, const float* alpha, const float* p, int p_stride, const KV* const* vrow,
                        int n, int rows) {
    constexpr int T = v_rows<NV>();
    int x = 0;
    for (; x + T <= rows; x += T) values_tile<KV, NV, T>(st + x, alpha + x, p + x * p_stride, p_stride, vrow, n);
    switch (rows - x) {      // the rest in one tile too (the V rows are converted once a tile)
        case 0: break;
#define PREFIXSERVE_REST(R) case R: if constexpr (R < T) values_tile<KV, NV, R>(st + x, alpha + x, p + x * p_stride, \
                                                                               p_stride, vrow, n); break;
        PREFIXSERVE_REST(1) PREFIXSERVE_REST(2) PREFIXSERVE_REST(3) PREFIXSERVE_REST(4) PREFIXSERVE_REST(5)
        PREFIXSERVE_REST(6) PREFIXSERVE_REST(7)
#undef PREFIXSERVE_REST
        default: break;
    }
}

// One row's online-softmax update over its scores s[0, n) of a tile (chunks of 16): the weights e^(s - max) replace
// the scores (zero past n to the chunks' end), the running max and sum st[0], st[1] move on; returns the factor
// e^(old max - new max) its accumulator takes.
inline float row_weights(float* s, float* st, int n, int chunks) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < chunks; ++c) {
        const __mmask16 valid = static_cast<__mmask16>(n - 16 * c >= 16 ? 0xffff : (1u << (n - 16 * c)) - 1);
        m = _mm512_mask_max_ps(m, valid, m, _mm512_load_ps(s + c * 16));
    }
    const float mx = std::max(st[0], _mm512_reduce_max_ps(m));
    const float alpha = std::exp(st[0] - mx);
    __m512 sum = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(mx);
    for (int c = 0; c < chunks; ++c) {
        const __mmask16 valid = static_cast<__mmask16>(n - 16 * c >= 16 ? 0xffff : (1u << (n - 16 * c)) - 1);
        const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(_mm512_load_ps(s + c * 16), mv)));
        _mm512_store_ps(s + c * 16, p);
        sum = _mm512_add_ps(sum, p);
    }
    st[0] = mx;
    st[1] = st[1] * alpha + _mm512_reduce_add_ps(sum);
    return alpha;
}

// A tile of up to TILE tokens of one KV head, for every row: K transposed once, scores a few rows at a time,
// one online-softmax update per row for the whole tile, then the V rows into register accumulators.
template <typename KV, int NV>
void tile_avx512(const Rows& r, const KV* const* krow, const KV* const* vrow, int n, float* kt, float* sc,
                 int sc_stride) {
    constexpr int D = 16 * NV;
    const int chunks = (n + 15) / 16;
    for (int c = 0; c < chunks; ++c) transpose_k(krow + 16 * c, std::min(16, n - 16 * c), D, kt + c * D * 16);
    float alpha[MAX_MEMBERS * MAX_GROUP];
    int x = 0;
    for (; x + 4 <= r.n; x += 4) scores_rows<4>(r.q + x, kt, D, chunks, sc + x * sc_stride, sc_stride);
    switch (r.n - x) {
        case 3: scores_rows<3>(r.q + x, kt, D, chunks, sc + x * sc_stride, sc_stride); break;
        case 2: scores_rows<2>(r.q + x, kt, D, chunks, sc + x * sc_stride, sc_stride); break;
        case 1: scores_rows<1>(r.q + x, kt, D, chunks, sc + x * sc_stride, sc_stride); break;
        default: break;
    }
    for (int x = 0; x < r.n; ++x) alpha[x] = row_weights(sc + x * sc_stride, r.st[x], n, chunks);
    values_rows<KV, NV>(r.st, alpha, sc, sc_stride, vrow, n, r.n);
}

#if defined(PREFIXSERVE_BF16)
// Each row's online-softmax update over its scores of a tile (row_weights), then its weights as bf16 key pairs in
// pw (TILE / 2 words a row, zero past the tile's keys); alpha: each row's rescale factor. For tile_bf16 and tile_amx.
inline void bf16_weights(const Rows& r, float* sc, int sc_stride, int n, uint32_t* pw, float* alpha) {
    const int chunks = (n + 15) / 16;
    for (int x = 0; x < r.n; ++x) {
        float* s = sc + x * sc_stride;
        alpha[x] = row_weights(s, r.st[x], n, chunks);
        uint32_t* pr = pw + x * (TILE / 2);
        for (int c = 0; c < TILE / 16; c += 2)
            prefixserve_bf16::pack_p(c < chunks ? _mm512_load_ps(s + c * 16) : _mm512_setzero_ps(),
                                     c + 1 < chunks ? _mm512_load_ps(s + c * 16 + 16) : _mm512_setzero_ps(), pr + c * 8);
    }
}

// The same tile over a bf16 cache with bf16 dot products (vdpbf16ps, float32 sums), as the prefill kernel's tiles
// (bf16_tile.h): K transposed into dimension pairs, V interleaved into token pairs, the rows' queries (qw, q * scale
// as bf16 pairs) and softmax weights rounded to bf16; the running max, sum and accumulators float32.
template <int NV>
void tile_bf16(const Rows& r, const uint32_t* const* qw, const uint16_t* const* krow, const uint16_t* const* vrow,
               int n, uint32_t* kt, uint32_t* vt, uint32_t* pw, float* sc, int sc_stride) {
    constexpr int D = 16 * NV, W = 8 * NV, PAIRS = TILE / 2;
    const int chunks = (n + 15) / 16;
    prefixserve_bf16::pack_k(krow, n, D, kt);
    prefixserve_bf16::pack_v(vrow, n, D, vt);
    prefixserve_bf16::scores_chunks(qw, r.n, kt, W, chunks, sc, sc_stride);
    float alpha[MAX_MEMBERS * MAX_GROUP];
    const uint32_t* prow[MAX_MEMBERS * MAX_GROUP];
    float* acc[MAX_MEMBERS * MAX_GROUP];
    bf16_weights(r, sc, sc_stride, n, pw, alpha);
    for (int x = 0; x < r.n; ++x) {
        prow[x] = pw + x * PAIRS;
        acc[x] = r.st[x] + 2;
    }
    prefixserve_bf16::values_rows<NV>(acc, alpha, prow, vt, (n + 1) / 2, r.n);
}

// tile_bf16's AMX form, for an item of 16 rows or more (a cascade group: its members' query rows over their shared
// prefix; a lone sequence has only its G): the same packing, softmax and rounding, the two products as AMX tiles on
// blocks of 16 rows (amx_tile.h scores_block, values_block; emulated on a build without AMX, for the tests). qa: the
// rows' q * scale as bf16 pairs, W words a row, zero rows to a whole block; pw: the weights, zero there too. Differs
// from tile_bf16 only in the order of the float32 sums (a row's result is its own either way).
template <int NV>
void tile_amx(const Rows& r, const uint32_t* qa, const uint16_t* const* krow, const uint16_t* const* vrow, int n,
              uint32_t* kt, uint32_t* vt, uint32_t* pw, float* sc, float* ot) {
    constexpr int D = 16 * NV, W = 8 * NV, PAIRS = TILE / 2;
    const int chunks = (n + 15) / 16, pairs = (n + 1) / 2, blocks = (pairs + 15) / 16;
    prefixserve_bf16::pack_k(krow, n, D, kt);
    prefixserve_bf16::pack_v(vrow, n, D, vt);
    if (pairs < 16 * blocks)      // the last V block's rows past the tile's pairs: zero, not stale (0 x NaN)
        std::memset(vt + static_cast<int64_t>(pairs) * D, 0, sizeof(uint32_t) * (16 * blocks - pairs) * D);
    for (int r0 = 0; r0 < r.n; r0 += 16)
        prefixserve_amx::scores_block(qa + static_cast<int64_t>(r0) * W, W, kt, W, chunks, sc + r0 * TILE, TILE);
    float alpha[MAX_MEMBERS * MAX_GROUP];
    bf16_weights(r, sc, TILE, n, pw, alpha);
    for (int r0 = 0; r0 < r.n; r0 += 16) {
        prefixserve_amx::values_block(pw + r0 * PAIRS, PAIRS, vt, NV, blocks, ot);
        for (int x = r0; x < std::min(r0 + 16, r.n); ++x) {
            float* acc = r.st[x] + 2;
            const __m512 a = _mm512_set1_ps(alpha[x]);
            for (int v = 0; v < NV; ++v)
                _mm512_storeu_ps(acc + 16 * v, _mm512_fmadd_ps(a, _mm512_loadu_ps(acc + 16 * v),
                                                               _mm512_load_ps(ot + (x - r0) * D + 16 * v)));
        }
    }
}
#endif
#endif

// Which tiles a bf16 cache's items take (prefixserve_paged_decode_set_tiles): 0 the build's best (the AMX tiles for
// items of 16 rows or more on an AMX build where Linux grants the tile state), 1 the vector tiles, 2 the AMX tiles
// for such items on any build with AVX-512 BF16 (emulated without AMX: a test hook). Process-wide for this build.
std::atomic<int> tiles_mode{0};

inline bool amx_items() {
#if defined(PREFIXSERVE_AMX)
    return tiles_mode.load(std::memory_order_relaxed) != 1 && prefixserve_amx::available();
#elif defined(PREFIXSERVE_BF16)
    return tiles_mode.load(std::memory_order_relaxed) == 2;
#else
    return false;
#endif
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PREFIXSERVE_AVX2 1
using prefixserve_simd::exp256;
using prefixserve_simd::first_lanes;
using prefixserve_simd::hmax256;
using prefixserve_simd::hsum256;

// 16 dimensions of a K or V row as two float32 vectors, in the order the AVX2 loops keep queries and
// accumulators in (`slot`): a bfloat16 row's 256-bit load splits into its even dimensions (each 32-bit word's
// low half, shifted up) and its odd ones (the high half, masked), with no shuffle; float32 is two loads, dims
// 0-7 then 8-15.
inline void load_pair(const uint16_t* p, __m256& a, __m256& b) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    b = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void load_pair(const float* p, __m256& a, __m256& b) {
    a = _mm256_loadu_ps(p);
    b = _mm256_loadu_ps(p + 8);
}

// Where dimension d of 16 sits in that order: bfloat16 [0, 2, .., 14, 1, 3, .., 15], float32 as it is.
template <typename KV>
constexpr int slot(int d) { return sizeof(KV) == 2 ? (d % 2 ? 8 + d / 2 : d / 2) : d; }

// v[j]'s lane sum in lane j, eight vectors at once.
inline __m256 hsum8(const float* v) {
    const __m256 a = _mm256_hadd_ps(_mm256_load_ps(v), _mm256_load_ps(v + 8));
    const __m256 b = _mm256_hadd_ps(_mm256_load_ps(v + 16), _mm256_load_ps(v + 24));
    const __m256 c = _mm256_hadd_ps(_mm256_load_ps(v + 32), _mm256_load_ps(v + 40));
    const __m256 d = _mm256_hadd_ps(_mm256_load_ps(v + 48), _mm256_load_ps(v + 56));
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);      // low halves' sums | high halves'
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// Scores of T rows (q in `slot` order) for tokens [0, n): each K row is loaded and widened once for the T rows,
// which multiply it with their queries as memory operands into two partial-sum vectors a row; the vectors are
// stored (part[(t * TILE + j) * 8], TILE >= n) and eight tokens' reduce into one vector of their scores.
template <typename KV, int T, int TILE>
inline void scores_dot(const float* const* q, const KV* const* krow, int n, int D, float* part, float* sc,
                       int sc_stride) {
    for (int j = 0; j < n; ++j) {
        __m256 acc[T][2];
        for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        for (int c = 0; c < D; c += 16) {
            __m256 a, b;
            load_pair(krow[j] + c, a, b);
            for (int t = 0; t < T; ++t) {
                acc[t][0] = _mm256_fmadd_ps(a, _mm256_loadu_ps(q[t] + c), acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(b, _mm256_loadu_ps(q[t] + c + 8), acc[t][1]);
            }
        }
        for (int t = 0; t < T; ++t) _mm256_store_ps(part + (t * TILE + j) * 8, _mm256_add_ps(acc[t][0], acc[t][1]));
    }
    for (int j = n; j % 8; ++j)
        for (int t = 0; t < T; ++t) _mm256_store_ps(part + (t * TILE + j) * 8, _mm256_setzero_ps());
    for (int t = 0; t < T; ++t)
        for (int j0 = 0; j0 < n; j0 += 8) _mm256_store_ps(sc + t * sc_stride + j0, hsum8(part + (t * TILE + j0) * 8));
}

// acc_x = alpha_x acc_x + sum_j p_x[j] V[j] for T rows, 16 dimensions at a time in registers (8 of the 16), in
// `slot` order.
template <typename KV, int T>
inline void values_tile8(float* const* st, const float* alpha, const float* p, int p_stride, const KV* const* vrow,
                         int n, int D) {
    for (int v0 = 0; v0 < D; v0 += 16) {
        __m256 acc[T][2];
        for (int t = 0; t < T; ++t) {
            const __m256 a = _mm256_set1_ps(alpha[t]);
            acc[t][0] = _mm256_mul_ps(a, _mm256_loadu_ps(st[t] + 2 + v0));
            acc[t][1] = _mm256_mul_ps(a, _mm256_loadu_ps(st[t] + 2 + v0 + 8));
        }
        for (int j = 0; j < n; ++j) {
            __m256 lo, hi;
            load_pair(vrow[j] + v0, lo, hi);
            for (int t = 0; t < T; ++t) {
                const __m256 w = _mm256_broadcast_ss(p + t * p_stride + j);
                acc[t][0] = _mm256_fmadd_ps(w, lo, acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(w, hi, acc[t][1]);
            }
        }
        for (int t = 0; t < T; ++t) {
            _mm256_storeu_ps(st[t] + 2 + v0, acc[t][0]);
            _mm256_storeu_ps(st[t] + 2 + v0 + 8, acc[t][1]);
        }
    }
}

// A tile of up to TILE tokens of one KV head, for every row: scores four rows at a time (row by row, no K
// transpose), one online-softmax update per row for the whole tile, then the V rows into register accumulators.
// Queries and accumulators are in `slot` order (run_item puts them in and takes them out).
template <typename KV, int TILE>
void tile_avx2(const Rows& r, const KV* const* krow, const KV* const* vrow, int n, int D, float* part, float* sc,
               int sc_stride) {
    const int chunks = (n + 7) / 8;
    for (int x = 0; x < r.n; x += 4) {
        switch (std::min(4, r.n - x)) {
            case 4: scores_dot<KV, 4, TILE>(r.q + x, krow, n, D, part, sc + x * sc_stride, sc_stride); break;
            case 3: scores_dot<KV, 3, TILE>(r.q + x, krow, n, D, part, sc + x * sc_stride, sc_stride); break;
            case 2: scores_dot<KV, 2, TILE>(r.q + x, krow, n, D, part, sc + x * sc_stride, sc_stride); break;
            default: scores_dot<KV, 1, TILE>(r.q + x, krow, n, D, part, sc + x * sc_stride, sc_stride); break;
        }
    }
    float alpha[MAX_MEMBERS * MAX_GROUP];
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    for (int x = 0; x < r.n; ++x) {
        float* s = sc + x * sc_stride;
        float* st = r.st[x];
        __m256 m = neg_inf;
        for (int c = 0; c < chunks; ++c)
            m = _mm256_max_ps(m, _mm256_blendv_ps(neg_inf, _mm256_load_ps(s + c * 8), first_lanes(n - 8 * c)));
        const float mx = std::max(st[0], hmax256(m));
        alpha[x] = std::exp(st[0] - mx);
        __m256 sum = _mm256_setzero_ps();
        const __m256 mv = _mm256_set1_ps(mx);
        for (int c = 0; c < chunks; ++c) {
            const __m256 p = _mm256_and_ps(first_lanes(n - 8 * c), exp256(_mm256_sub_ps(_mm256_load_ps(s + c * 8), mv)));
            _mm256_store_ps(s + c * 8, p);
            sum = _mm256_add_ps(sum, p);
        }
        st[0] = mx;
        st[1] = st[1] * alpha[x] + hsum256(sum);
    }
    int y = 0;
    for (; y + 4 <= r.n; y += 4) values_tile8<KV, 4>(r.st + y, alpha + y, sc + y * sc_stride, sc_stride, vrow, n, D);
    switch (r.n - y) {
        case 3: values_tile8<KV, 3>(r.st + y, alpha + y, sc + y * sc_stride, sc_stride, vrow, n, D); break;
        case 2: values_tile8<KV, 2>(r.st + y, alpha + y, sc + y * sc_stride, sc_stride, vrow, n, D); break;
        case 1: values_tile8<KV, 1>(r.st + y, alpha + y, sc + y * sc_stride, sc_stride, vrow, n, D); break;
        default: break;
    }
}
#endif


// Where tokens t..t + m of a table start in the caches (every KV head of a token follows from there).
inline void rows_at(const Args& a, const int32_t* table, int t, int m, int64_t* kb, int64_t* vb) {
    int bi = t / a.B, off = t % a.B;
    for (int j = 0; j < m; ++j) {
        const int64_t blk = table[bi];
        kb[j] = blk * a.kc_blk + off * a.kc_tok;
        vb[j] = blk * a.vc_blk + off * a.vc_tok;
        if (++off == a.B) { off = 0; ++bi; }
    }
}

// Those rows' K and V, every KV head, read once (a byte a cache line) a tile ahead of their use (run_item, and
// decode for an item's first tile), so that the reads of a cache far larger than L3 overlap the arithmetic.
// Plain loads, not prefetch instructions: paged_decode.py has the measurements.
template <typename KV>
void touch_rows(const Args& a, const int64_t* kb, const int64_t* vb, int m) {
    const int64_t kbytes = ((a.Hkv - 1) * a.kc_head + a.D) * static_cast<int64_t>(sizeof(KV));
    const int64_t vbytes = ((a.Hkv - 1) * a.vc_head + a.D) * static_cast<int64_t>(sizeof(KV));
    const unsigned char* kc = static_cast<const unsigned char*>(a.kc);
    const unsigned char* vc = static_cast<const unsigned char*>(a.vc);
    unsigned sum = 0;
    for (int j = 0; j < m; ++j) {
        const unsigned char* k = kc + kb[j] * static_cast<int64_t>(sizeof(KV));
        const unsigned char* v = vc + vb[j] * static_cast<int64_t>(sizeof(KV));
        for (int64_t x = 0; x < kbytes; x += 64) sum += k[x];
        for (int64_t x = 0; x < vbytes; x += 64) sum += v[x];
    }
    asm volatile("" : : "r"(sum));                            // the loads are the point: keep them
}

// An item's first tile (decode runs it a step ahead of the item).
template <typename KV>
void touch_item(const Args& a, const int32_t* item, const int32_t* members) {
    const int s0 = members[item[0]], t = item[2] * a.B, m = std::min(TILE, std::min(item[3] * a.B, a.lens[s0]) - t);
    if (m <= 0) return;
    int64_t kb[TILE], vb[TILE];
    rows_at(a, a.bt + static_cast<int64_t>(s0) * a.bt_stride, t, m, kb, vb);
    touch_rows<KV>(a, kb, vb, m);
}

// One item: blocks [b0, b1) of members[0]'s table, attended by every member's queries. Writes, per member i
// and head, part[(i * H + head) * (D + 2) + {0, 1, 2..}] = max, sum, unnormalized accumulator. Tile by
// tile (TILE tokens, whatever the block size), KV head after KV head: a tile's K and V rows are read once
// into cache and used there by every member and every query head of the group.
template <typename KV, int NV>
void run_item(const Args& a, const int32_t* members, int nmem, int b0, int b1, float* part) {
    const int H = a.H, G = a.H / a.Hkv, D = a.D, B = a.B, PS = a.D + 2;
    const int s0 = members[0], L = a.lens[s0];
    thread_local std::vector<float> qbuf, sbuf, kbuf;        // the scaled queries; scores; a transposed K tile
                                                            // (AVX2: the scores' partial sums)
    qbuf.resize(static_cast<size_t>(nmem) * H * D);
    bool amx = false;                                        // the item's tiles are AMX ones (tile_amx)
    int np = nmem * G;                                       // its rows (AMX: in whole blocks of 16)
#if defined(PREFIXSERVE_BF16)
    // bf16 caches of whole bf16 pair vectors (head_dim % 32 == 0) take tile_bf16: the queries as bf16 pairs, V
    // interleaved, the weights as bf16 pairs
    constexpr bool bf16_tiles = sizeof(KV) == 2 && NV % 2 == 0;
    amx = bf16_tiles && nmem * G >= 16 && amx_items();                 // tile_amx: rows in whole blocks of 16
    np = amx ? (nmem * G + 15) / 16 * 16 : nmem * G;
    thread_local std::vector<uint32_t> qwbuf, vbuf, pbuf, qabuf;
    thread_local std::vector<float> obuf;
    uint32_t *qw = nullptr, *vt = nullptr, *pw = nullptr, *qa = nullptr;
    float* ot = nullptr;
    if constexpr (bf16_tiles) {
        qwbuf.resize(static_cast<size_t>(nmem) * H * D / 2);
        vbuf.resize(static_cast<size_t>(TILE / 2) * D + 16);
        pbuf.resize(static_cast<size_t>(np) * TILE / 2);
        qw = qwbuf.data();
        vt = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(vbuf.data()) + 63) & ~uintptr_t{63});
        pw = pbuf.data();
        if (amx) {         // the rows past the item's (to a whole block): zero q and weights
            std::fill(pbuf.begin() + static_cast<int64_t>(nmem) * G * TILE / 2, pbuf.end(), 0u);
            qabuf.assign(static_cast<size_t>(a.Hkv) * np * D / 2, 0u);
            obuf.resize(static_cast<size_t>(16) * D + 16);
            qa = qabuf.data();
            ot = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(obuf.data()) + 63) & ~uintptr_t{63});
        }
    }
#endif
    sbuf.resize(static_cast<size_t>(np) * TILE + 16);
    kbuf.resize(static_cast<size_t>(TILE) * std::max(D, 32) + 16);
    float* qs = qbuf.data();
    float* sc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sbuf.data()) + 63) & ~uintptr_t{63});
    float* kt = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(kbuf.data()) + 63) & ~uintptr_t{63});
    for (int i = 0; i < nmem; ++i) {
        const float* qp = a.q + static_cast<int64_t>(members[i]) * H * D;
#if defined(PREFIXSERVE_AVX2)
        for (int x = 0; x < H * D; ++x) qs[i * H * D + x - x % 16 + slot<KV>(x % 16)] = qp[x] * a.scale;
#else
        for (int x = 0; x < H * D; ++x) qs[i * H * D + x] = qp[x] * a.scale;
#endif
    }
#if defined(PREFIXSERVE_BF16)
    if constexpr (bf16_tiles) {
        for (int i = 0; i < nmem * H; ++i) prefixserve_bf16::pack_q(qs + i * D, 1.f, D, qw + i * (D / 2));
        if (amx) {         // KV head h's rows (member x / G, head h G + x % G) side by side, a block of rows a tile
            for (int h = 0; h < a.Hkv; ++h)
                for (int x = 0; x < nmem * G; ++x)
                    std::memcpy(qa + (static_cast<int64_t>(h) * np + x) * (D / 2),
                                qw + ((x / G) * H + h * G + x % G) * (D / 2), sizeof(uint32_t) * (D / 2));
            prefixserve_amx::configure();
        }
    }
#endif
    for (int i = 0; i < nmem * H; ++i) {
        part[i * PS] = -INFINITY;
        part[i * PS + 1] = 0.f;
        for (int d = 0; d < D; ++d) part[i * PS + 2 + d] = 0.f;
    }
    const KV* kc = static_cast<const KV*>(a.kc);
    const KV* vc = static_cast<const KV*>(a.vc);
    const int32_t* table = a.bt + static_cast<int64_t>(s0) * a.bt_stride;
    const int end = std::min(b1 * B, L);                      // shared blocks are full for every member
    int64_t kbase[2][TILE], vbase[2][TILE];                   // this tile's rows (where each token's heads start)
    const KV* krow[TILE];                                     // and the next one's
    const KV* vrow[TILE];
    rows_at(a, table, b0 * B, std::min(TILE, end - b0 * B), kbase[0], vbase[0]);
    for (int t0 = b0 * B, cur = 0; t0 < end; t0 += TILE, cur ^= 1) {
        const int n = std::min(TILE, end - t0), n1 = std::min(TILE, end - t0 - TILE);
        if (n1 > 0) {     // the next tile's rows (every KV head) on their way into the cache
            rows_at(a, table, t0 + TILE, n1, kbase[cur ^ 1], vbase[cur ^ 1]);
            touch_rows<KV>(a, kbase[cur ^ 1], vbase[cur ^ 1], n1);
        }
        const int64_t* kb = kbase[cur];
        const int64_t* vb = vbase[cur];
        for (int h = 0; h < a.Hkv; ++h) {
            const Rows r = rows_of(qs, part, nmem, h, H, G, D);
            for (int j = 0; j < n; ++j) {
                krow[j] = kc + kb[j] + h * a.kc_head;
                vrow[j] = vc + vb[j] + h * a.vc_head;
            }
#if defined(PREFIXSERVE_BF16)
            if constexpr (bf16_tiles) {
                if (amx) {
                    tile_amx<NV>(r, qa + static_cast<int64_t>(h) * np * (D / 2), krow, vrow, n,
                                 reinterpret_cast<uint32_t*>(kt), vt, pw, sc, ot);
                } else {
                    const uint32_t* qrow[MAX_MEMBERS * MAX_GROUP];
                    for (int x = 0; x < r.n; ++x) qrow[x] = qw + ((x / G) * H + h * G + x % G) * (D / 2);
                    tile_bf16<NV>(r, qrow, krow, vrow, n, reinterpret_cast<uint32_t*>(kt), vt, pw, sc, TILE);
                }
            } else {
                tile_avx512<KV, NV>(r, krow, vrow, n, kt, sc, TILE);
            }
#elif defined(__AVX512F__)
            tile_avx512<KV, NV>(r, krow, vrow, n, kt, sc, TILE);
#elif defined(PREFIXSERVE_AVX2)
            tile_avx2<KV, TILE>(r, krow, vrow, n, D, kt, sc, TILE);
#else
            tile_generic<KV>(r, krow, vrow, n, D, sc, TILE);
#endif
        }
    }
    if (amx) prefixserve_amx::release();
#if defined(PREFIXSERVE_AVX2)
    if constexpr (slot<KV>(1) != 1) {                         // the accumulators back in dimension order
        float tmp[16];
        for (int i = 0; i < nmem * H; ++i)
            for (int c = 0; c < D; c += 16) {
                float* acc = part + i * PS + 2 + c;
                for (int d = 0; d < 16; ++d) tmp[d] = acc[slot<KV>(d)];
                std::memcpy(acc, tmp, sizeof tmp);
            }
    }
#endif
}

// items: [n_items, 4] int32 = (first member in `members`, member count, b0, b1).
template <typename KV, int NV>
void decode(const Args& a, const int32_t* items, int n_items, const int32_t* members) {
    const int H = a.H, D = a.D, PS = a.D + 2;
    std::vector<int64_t> offset(n_items + 1, 0);            // each item's partials
    for (int it = 0; it < n_items; ++it) offset[it + 1] = offset[it] + static_cast<int64_t>(items[4 * it + 1]) * H * PS;
    std::vector<float> part(offset[n_items]);
    std::atomic<int> next_item{0};
    #pragma omp parallel
    {   // items taken one at a time (dynamic), each thread a step ahead: its next item's first tile is read meanwhile
        int it = next_item.fetch_add(1, std::memory_order_relaxed);
        while (it < n_items) {
            const int following = next_item.fetch_add(1, std::memory_order_relaxed);
            if (following < n_items) touch_item<KV>(a, items + 4 * following, members);
            const int32_t* item = items + 4 * it;
            run_item<KV, NV>(a, members + item[0], item[1], item[2], item[3], part.data() + offset[it]);
            it = following;
        }
    }
    std::vector<std::vector<int64_t>> of_seq(a.S);           // where each sequence's partials are
    for (int it = 0; it < n_items; ++it)
        for (int i = 0; i < items[4 * it + 1]; ++i)
            of_seq[members[items[4 * it] + i]].push_back(offset[it] + static_cast<int64_t>(i) * H * PS);
    #pragma omp parallel for
    for (int sr = 0; sr < a.S * H; ++sr) {
        const int s = sr / H, r = sr % H;
        float mx = -INFINITY;
        for (int64_t o : of_seq[s]) mx = std::max(mx, part[o + r * PS]);
        float* out = a.out + (static_cast<int64_t>(s) * H + r) * D;
        for (int d = 0; d < D; ++d) out[d] = 0.f;
        float sum = 0.f;
        for (int64_t o : of_seq[s]) {
            const float* pr = part.data() + o + r * PS;
            if (pr[0] == -INFINITY) continue;                // an empty partial weighs nothing
            const float w = std::exp(pr[0] - mx);
            sum += pr[1] * w;
            for (int d = 0; d < D; ++d) out[d] += pr[2 + d] * w;
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int d = 0; d < D; ++d) out[d] *= inv;
    }
}

template <typename KV>
int dispatch(const Args& a, const int32_t* items, int n_items, const int32_t* members) {
    switch (a.D / 16) {
        case 1: decode<KV, 1>(a, items, n_items, members); return 0;
        case 2: decode<KV, 2>(a, items, n_items, members); return 0;
        case 3: decode<KV, 3>(a, items, n_items, members); return 0;
        case 4: decode<KV, 4>(a, items, n_items, members); return 0;
        case 5: decode<KV, 5>(a, items, n_items, members); return 0;
        case 6: decode<KV, 6>(a, items, n_items, members); return 0;
        case 8: decode<KV, 8>(a, items, n_items, members); return 0;
        case 16: decode<KV, 16>(a, items, n_items, members); return 0;
        default: return -2;
    }
}


// The step's new K and V rows into the cache: token i's [Hkv, D] at cache row rows[i] (block * B + offset).
template <typename KV>
void write_rows(const float* k, const float* v, int64_t k_tok, int64_t k_head, int64_t v_tok, int64_t v_head,
                const int64_t* rows, int n, KV* kc, KV* vc, int Hkv, int D, int B, int64_t kc_blk, int64_t kc_tok,
                int64_t kc_head, int64_t vc_blk, int64_t vc_tok, int64_t vc_head) {
    #pragma omp parallel for collapse(2) if (n * Hkv >= 8)
    for (int i = 0; i < n; ++i) {
        for (int h = 0; h < Hkv; ++h) {
            const int64_t blk = rows[i] / B, off = rows[i] % B;
            KV* kd = kc + blk * kc_blk + off * kc_tok + h * kc_head;
            KV* vd = vc + blk * vc_blk + off * vc_tok + h * vc_head;
            const float* ks = k + i * k_tok + h * k_head;
            const float* vs = v + i * v_tok + h * v_head;
            for (int d = 0; d < D; ++d) {
                if constexpr (sizeof(KV) == 2) { kd[d] = float_to_bf16(ks[d]); vd[d] = float_to_bf16(vs[d]); }
                else { kd[d] = ks[d]; vd[d] = vs[d]; }
            }
        }
    }
}

}  // namespace

extern "C" {

// kv_dtype: 0 float32, 1 bfloat16. k, v (float32 [S, Hkv, D], strides given) are first written into the
// cache at rows[s] unless k is null; with q null, that is all. Returns 0, or < 0 for shapes this kernel does not
// take.
int prefixserve_paged_decode(const float* q, const float* k, const float* v, int64_t k_tok, int64_t k_head,
                             int64_t v_tok, int64_t v_head, const int64_t* rows, void* kc, void* vc, const int32_t* bt,
                             int64_t bt_stride, const int32_t* lens, float* out, int S, int H, int Hkv, int D, int B,
                             float scale, int64_t kc_blk, int64_t kc_tok, int64_t kc_head, int64_t vc_blk,
                             int64_t vc_tok, int64_t vc_head, int kv_dtype, const int32_t* items, int n_items,
                             const int32_t* members) {
    if (S <= 0) return 0;
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAX_GROUP || H > MAX_HEADS || B <= 0 || B > MAX_BLOCK || D % 16 != 0)
        return -1;
    for (int it = 0; it < n_items; ++it)
        if (items[4 * it + 1] < 1 || items[4 * it + 1] > MAX_MEMBERS) return -3;
    if (k != nullptr) {
        if (kv_dtype == 1)
            write_rows<uint16_t>(k, v, k_tok, k_head, v_tok, v_head, rows, S, static_cast<uint16_t*>(kc),
                                 static_cast<uint16_t*>(vc), Hkv, D, B, kc_blk, kc_tok, kc_head, vc_blk, vc_tok, vc_head);
        else
            write_rows<float>(k, v, k_tok, k_head, v_tok, v_head, rows, S, static_cast<float*>(kc),
                              static_cast<float*>(vc), Hkv, D, B, kc_blk, kc_tok, kc_head, vc_blk, vc_tok, vc_head);
    }
    if (q == nullptr) return 0;               // a write only (PagedDecode.write: a mixed step's rows)
    const Args a{q, kc, vc, bt, bt_stride, lens, out, S, H, Hkv, D, B, scale, kc_blk, kc_tok, kc_head,
                 vc_blk, vc_tok, vc_head};
    return kv_dtype == 1 ? dispatch<uint16_t>(a, items, n_items, members) : dispatch<float>(a, items, n_items, members);
}

int prefixserve_num_threads() { return omp_get_max_threads(); }

// Which tiles a bf16 cache's items take from now on, process-wide for this build (tiles_mode above: 0 the build's
// best, 1 the vector tiles, 2 the AMX tiles for items of 16 rows or more, emulated without AMX); returns the previous
// setting, or -1 (nothing changed) for another value.
int prefixserve_paged_decode_set_tiles(int tiles) {
    if (tiles < 0 || tiles > 2) return -1;
    return tiles_mode.exchange(tiles);
}

// The loops this build runs: "amx" (as avx512_bf16, and a cascade group's items of 16 rows or more as AMX tiles),
// "avx512_bf16" (bf16 products over bf16 caches of a head_dim that is a multiple of 32, float32 ones otherwise),
// "avx512", "avx2" or "generic".
const char* prefixserve_paged_decode_path() {
#if defined(PREFIXSERVE_AMX)
    if (prefixserve_amx::available()) return "amx";
#endif
#if defined(PREFIXSERVE_BF16)
    return "avx512_bf16";
#elif defined(__AVX512F__)
    return "avx512";
#elif defined(PREFIXSERVE_AVX2)
    return "avx2";
#else
    return "generic";
#endif
}

}  // extern "C"
