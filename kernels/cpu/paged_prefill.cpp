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
#include "bf16_tile.h"

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
using namespace prefixserve_bf16;

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
            pack_q(src, A.scale, D, qw + x * W);
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
                for (int c = 0; c < TILE / 16; c += 2) pack_p(e[c], e[c + 1], pr + c * 8);
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
