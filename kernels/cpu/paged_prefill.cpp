// Paged prefill attention on the CPU for bfloat16 caches: a step's prompt chunks (any number of query
// tokens per sequence, over the sequence's whole cached context) in one call, K and V read in place
// through the block table, GQA-aware, causal. Launcher and agreement criterion: kernels/cpu/paged_prefill.py.
//
// Work items are (sequence, up to QB consecutive query tokens); an item takes every query head of a KV head
// at once (QB * G rows) and walks the context in tiles of TILE tokens aligned to absolute positions 0, TILE,
// 2 TILE, ...: each tile's K is transposed once into pairs of dimensions and its V interleaved into pairs of
// tokens, so the products run as bf16 dot products (vdpbf16ps: two products a lane, float32 sums):
//     scores  s = (q * scale as bf16) . K       over dimension pairs
//     values  acc = alpha acc + (p as bf16) . V  over token pairs
// with one online-softmax update (float32) a row a tile. A row masks the keys past its own position.
//
// Chunk invariance: every row walks the same aligned tiles in the same order with the same instructions
// whatever else its item holds (other rows, a longer tile): a masked key weighs exactly 0, so a token's
// output does not depend on how its prompt was cut into chunks, nor on how much of it hit the cache.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PREFIXSERVE_BF16 1
#endif

namespace {

constexpr int TILE = 64;         // keys a tile (a multiple of 32: whole token pairs, whole 16-lane chunks)
constexpr int QB = 16;           // query tokens an item
constexpr int MAX_GROUP = 16;
constexpr int MAX_ROWS = QB * MAX_GROUP;

struct Args {
    const float* q; const uint16_t* kc; const uint16_t* vc; const int32_t* bt; int64_t bt_stride;
    const int32_t* lens; const int32_t* qstart; float* out; int H, Hkv, D, B; float scale;
    int64_t kc_blk, kc_tok, kc_head, vc_blk, vc_tok, vc_head;
};

#if defined(PREFIXSERVE_BF16)
inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// exp for x <= 0 (a score minus its running max), Cephes' expf (as in paged_decode.cpp): ~1 ulp, 0 below -87.
inline __m512 exp512(__m512 x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), p, n);
}

inline void transpose16(__m512i* r) {      // 16 x 16 32-bit words, in place
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xdd);
        t[8 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xdd);
    }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
    }
}

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

// acc_t = alpha_t acc_t + sum over token pairs i of p_t[i] . vt[i], T rows, the accumulators in registers.
template <int NV, int T>
inline void values_tile(float* const* acc, const float* alpha, const uint32_t* const* p, const uint32_t* vt,
                        int pairs) {
    __m512 a[T][NV];
    for (int t = 0; t < T; ++t) {
        const __m512 al = _mm512_set1_ps(alpha[t]);
        for (int v = 0; v < NV; ++v) a[t][v] = _mm512_mul_ps(al, _mm512_load_ps(acc[t] + 16 * v));
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
        for (int v = 0; v < NV; ++v) _mm512_store_ps(acc[t] + 16 * v, a[t][v]);
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

inline float* align64(std::vector<float>& v, size_t n) {
    v.resize(n + 16);
    return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t{63});
}

// One item: query tokens [a, b) of sequence s (rows of q), every head. Token a + i sits at position
// first + i, where first = lens[s] - (qstart[s + 1] - a).
template <int NV>
void run_item(const Args& A, int s, int a, int b) {
    constexpr int W = 8 * NV;                        // words a row (D / 2)
    constexpr int D = 16 * NV;
    const int H = A.H, G = A.H / A.Hkv, B = A.B, nt = b - a, nr = nt * G;
    const int first = A.lens[s] - (A.qstart[s + 1] - a), last = first + nt - 1;
    thread_local std::vector<float> qbuf, sbuf, kbuf, vbuf, pbuf, abuf;
    uint32_t* qw = reinterpret_cast<uint32_t*>(align64(qbuf, static_cast<size_t>(nr) * W));
    float* sc = align64(sbuf, static_cast<size_t>(nr) * TILE);
    uint32_t* kt = reinterpret_cast<uint32_t*>(align64(kbuf, static_cast<size_t>(TILE) * W));
    uint32_t* vt = reinterpret_cast<uint32_t*>(align64(vbuf, static_cast<size_t>(TILE / 2) * D));
    uint32_t* pw = reinterpret_cast<uint32_t*>(align64(pbuf, static_cast<size_t>(nr) * TILE / 2));
    float* acc = align64(abuf, static_cast<size_t>(nr) * D);
    const uint32_t* qrow[MAX_ROWS];
    const uint32_t* prow[MAX_ROWS];
    float* arow[MAX_ROWS];
    float mx[MAX_ROWS], sum[MAX_ROWS], alpha[MAX_ROWS];
    int pos[MAX_ROWS];
    for (int x = 0; x < nr; ++x) {
        qrow[x] = qw + x * W;
        prow[x] = pw + x * (TILE / 2);
        arow[x] = acc + x * D;
        pos[x] = first + x / G;
    }
    const int32_t* table = A.bt + static_cast<int64_t>(s) * A.bt_stride;
    const uint16_t* krow[TILE];
    const uint16_t* vrow[TILE];
    for (int h = 0; h < A.Hkv; ++h) {
        for (int x = 0; x < nr; ++x) {        // row x: token a + x / G, head h G + x % G
            const float* src = A.q + (static_cast<int64_t>(a + x / G) * H + h * G + x % G) * D;
            uint32_t* dst = qw + x * W;
            for (int d = 0; d < D; d += 32) {
                const __m512bh p = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + d + 16), _mm512_set1_ps(A.scale)),
                                                        _mm512_mul_ps(_mm512_loadu_ps(src + d), _mm512_set1_ps(A.scale)));
                _mm512_store_si512(dst + d / 2, reinterpret_cast<const __m512i&>(p));
            }
            mx[x] = -INFINITY;
            sum[x] = 0.f;
            for (int d = 0; d < D; ++d) arow[x][d] = 0.f;
        }
        for (int t0 = 0; t0 <= last; t0 += TILE) {
            const int n = std::min(TILE, last + 1 - t0), chunks = (n + 15) / 16;
            for (int j = 0; j < n; ++j) {
                const int64_t blk = table[(t0 + j) / B], off = (t0 + j) % B;
                krow[j] = A.kc + blk * A.kc_blk + off * A.kc_tok + h * A.kc_head;
                vrow[j] = A.vc + blk * A.vc_blk + off * A.vc_tok + h * A.vc_head;
            }
            pack_k(krow, n, D, kt);
            pack_v(vrow, n, D, vt);
            switch (chunks) {
                case 1: scores_rows<1>(qrow, nr, kt, W, sc, TILE); break;
                case 2: scores_rows<2>(qrow, nr, kt, W, sc, TILE); break;
                case 3: scores_rows<3>(qrow, nr, kt, W, sc, TILE); break;
                default: scores_rows<4>(qrow, nr, kt, W, sc, TILE); break;
            }
            for (int x = 0; x < nr; ++x) {
                const int valid = std::min(n, pos[x] - t0 + 1);     // keys at positions <= the row's own
                uint32_t* pr = pw + x * (TILE / 2);
                if (valid <= 0) {                                  // nothing here for this row: unchanged
                    alpha[x] = 1.f;
                    for (int c = 0; c < TILE / 2; c += 16) _mm512_store_si512(pr + c, _mm512_setzero_si512());
                    continue;
                }
                const float* s_ = sc + x * TILE;
                __m512 m = _mm512_set1_ps(-INFINITY);
                for (int c = 0; c < chunks; ++c) {
                    const int k = valid - 16 * c;
                    const __mmask16 ok = static_cast<__mmask16>(k >= 16 ? 0xffff : k > 0 ? (1u << k) - 1 : 0);
                    m = _mm512_mask_max_ps(m, ok, m, _mm512_load_ps(s_ + 16 * c));
                }
                const float top = std::max(mx[x], _mm512_reduce_max_ps(m));
                alpha[x] = std::exp(mx[x] - top);
                mx[x] = top;
                __m512 e[TILE / 16];
                __m512 tot = _mm512_setzero_ps();
                for (int c = 0; c < TILE / 16; ++c) {
                    const int k = valid - 16 * c;
                    const __mmask16 ok = static_cast<__mmask16>(k >= 16 ? 0xffff : k > 0 ? (1u << k) - 1 : 0);
                    e[c] = c < chunks ? _mm512_maskz_mov_ps(ok, exp512(_mm512_sub_ps(_mm512_load_ps(s_ + 16 * c),
                                                                                        _mm512_set1_ps(top))))
                                      : _mm512_setzero_ps();
                    tot = _mm512_add_ps(tot, e[c]);
                }
                sum[x] = sum[x] * alpha[x] + _mm512_reduce_add_ps(tot);
                for (int c = 0; c < TILE / 16; c += 2) {
                    const __m512bh p = _mm512_cvtne2ps_pbh(e[c + 1], e[c]);
                    _mm512_store_si512(pr + c * 8, reinterpret_cast<const __m512i&>(p));
                }
            }
            values_rows<NV>(arow, alpha, prow, vt, (n + 1) / 2, nr);
        }
        for (int x = 0; x < nr; ++x) {
            float* o = A.out + (static_cast<int64_t>(a + x / G) * H + h * G + x % G) * D;
            const float inv = sum[x] > 0.f ? 1.f / sum[x] : 0.f;
            for (int d = 0; d < D; ++d) o[d] = arow[x][d] * inv;
        }
    }
}

template <int NV>
void prefill(const Args& A, const int32_t* seqs, int n_seqs) {
    struct Item { int s, a, b, cost; };
    std::vector<Item> items;
    for (int i = 0; i < n_seqs; ++i) {
        const int s = seqs[i], q0 = A.qstart[s], q1 = A.qstart[s + 1];
        for (int a = q0; a < q1; a += QB) {
            const int b = std::min(q1, a + QB);
            items.push_back({s, a, b, A.lens[s] - (q1 - b)});
        }
    }
    // the longest first, so that dynamic scheduling ends with the short ones
    std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
    #pragma omp parallel for schedule(dynamic, 1)
    for (size_t i = 0; i < items.size(); ++i) run_item<NV>(A, items[i].s, items[i].a, items[i].b);
}
#endif

}  // namespace

extern "C" {

// q [T, H, D] float32 (rows of sequence s: qstart[s] .. qstart[s + 1], the last positions of its lens[s]);
// caches bfloat16 [blocks, B, Hkv, D] (strides given, D contiguous); out [T, H, D] float32. Only the rows
// of the sequences listed in seqs are computed. Returns 0, or < 0 where this kernel does not apply (the
// caller takes its other path): -1 shapes, -2 no AVX-512 BF16 on this CPU / compiler.
int prefixserve_paged_prefill(const float* q, const void* kc, const void* vc, const int32_t* bt, int64_t bt_stride,
                              const int32_t* lens, const int32_t* qstart, const int32_t* seqs, int n_seqs, float* out,
                              int H, int Hkv, int D, int B, float scale, int64_t kc_blk, int64_t kc_tok,
                              int64_t kc_head, int64_t vc_blk, int64_t vc_tok, int64_t vc_head) {
#if defined(PREFIXSERVE_BF16)
    if (n_seqs <= 0) return 0;
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAX_GROUP || B <= 0 || D % 32 != 0 || D > 256) return -1;
    const Args A{q, static_cast<const uint16_t*>(kc), static_cast<const uint16_t*>(vc), bt, bt_stride, lens, qstart,
                 out, H, Hkv, D, B, scale, kc_blk, kc_tok, kc_head, vc_blk, vc_tok, vc_head};
    switch (D / 16) {
        case 2: prefill<2>(A, seqs, n_seqs); return 0;
        case 4: prefill<4>(A, seqs, n_seqs); return 0;
        case 6: prefill<6>(A, seqs, n_seqs); return 0;
        case 8: prefill<8>(A, seqs, n_seqs); return 0;
        case 16: prefill<16>(A, seqs, n_seqs); return 0;
        default: return -1;
    }
#else
    (void)q; (void)kc; (void)vc; (void)bt; (void)bt_stride; (void)lens; (void)qstart; (void)seqs; (void)n_seqs;
    (void)out; (void)H; (void)Hkv; (void)D; (void)B; (void)scale; (void)kc_blk; (void)kc_tok; (void)kc_head;
    (void)vc_blk; (void)vc_tok; (void)vc_head;
    return -2;
#endif
}

// 1 where this build has the bf16 loops (AVX-512 BF16), else 0.
int prefixserve_paged_prefill_available() {
#if defined(PREFIXSERVE_BF16)
    return 1;
#else
    return 0;
#endif
}

}  // extern "C"
