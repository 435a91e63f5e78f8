// Paged prefill attention on the CPU: a step's prompt chunks (any number of query tokens per sequence, over the
// sequence's whole cached context) in one call, K and V read in place through the block table, GQA-aware,
// causal, and cascade: sequences whose tables start with the same blocks (a shared system prompt) walk those
// tiles once for all of them. Launcher and agreement criteria: kernels/cpu/paged_prefill.py.
//
// One walk, three kinds of tiles:
//   AMX tiles (amx_tile.h; AMX builds, bf16 caches, head_dim a multiple of 32): the bf16 tiles' packing, rounding
//                and softmax, their two products as TDPBF16PS on blocks of 16 rows;
//   bf16 tiles (bf16_tile.h; AVX-512 BF16 builds, bf16 caches): the products as bf16 dot products (vdpbf16ps)
//                of q * scale and the softmax weights rounded to bf16, float32 sums;
//   int16 tiles (i16_tile.h; AVX-512 VNNI builds without BF16, bf16 caches): the products as 16-bit integer dot
//                products (vpdpwssd) of q * scale, K, V and the weights each rounded with its own scale;
//   float32 tiles (f32_tile.h; every other build, and float32 caches everywhere): float32 products with FMA.
//
// An item's rows are query tokens of one or more sequences, each with the G query heads of one KV head (GQA:
// the heads that read the same K / V rows). It walks keys [k0, k1) in tiles of TILE keys aligned to absolute
// positions 0, TILE, 2 TILE, ...: per tile it packs K and V once (the int16 tiles' packing, the costliest, is done
// once a call for all the items that walk a tile: I16Packs), computes the scores of every row, one online-softmax
// update a row (float32 running max, sum and accumulator) and adds the V rows. A row masks the
// keys past its own position; rows whose position is before the tile skip it.
//
// The plan (make_plan). Without cascade an item is consecutive tokens of one sequence (as many as item_tokens
// picks for the step's chunks and threads) over keys [0, its last position]. With cascade, sequences whose
// tables agree on their first P keys (P a multiple of TILE, every member's chunk starting at or past P: its rows
// see all of them) form a group: phase 1 walks tiles
// [0, P) once for the rows of all members (items of up to CASCADE_TOKENS tokens across the members) and saves
// each row's softmax state; phase 2 resumes each member's rows from it over keys [P, its last position]. The
// other sequences' items run in phase 1.
//
// Chunk invariance: every row walks the same aligned tiles in the same order with the same per-row arithmetic
// whatever else its item holds (other rows; more keys in a tile: a masked key weighs exactly 0), and saving the
// state after a tile and resuming from it changes nothing. So a token's output is the same bit for bit however
// its prompt was cut into chunks, however much of it came from the prefix cache, and with or without cascade.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <unordered_map>
#include <vector>
#include <omp.h>
#include "amx_tile.h"
#include "bf16_tile.h"
#include "f32_tile.h"
#include "i16_tile.h"

namespace {

constexpr int TILE = 64;              // keys a tile (a multiple of 32: whole bf16 token pairs, whole 16-lane chunks)
constexpr int MAX_GROUP = 16;
constexpr int MAX_D = 256;
constexpr int ITEM_ROWS = 192;        // rows (tokens x G) a per-sequence item takes at most
constexpr int ITEM_PACK_ROWS = 8;     // a tile's packing of K and V, in rows' work (the plan's cost model)
constexpr int CASCADE_TOKENS = 96;    // tokens a phase-1 item of a group takes at most (across its members)
constexpr int MIN_SHARED_TILES = 2;   // a shared run of fewer tiles is walked by each sequence itself
constexpr int ITEMS_PER_THREAD = 4;   // enough items that dynamic scheduling evens out their lengths
constexpr int RESUME = 1, SAVE = 2;   // item flags: start from the saved state; save the state (do not finish)

struct Args {
    const float* q; const void* kc; const void* vc; const int32_t* bt; int64_t bt_stride;
    const int32_t* lens; const int32_t* qstart; float* out; int H, Hkv, D, B; float scale;
    int64_t kc_blk, kc_tok, kc_head, vc_blk, vc_tok, vc_head;
};

struct Seg { int s, a, b; };                          // query rows [a, b) of sequence s
struct Item { int seg0, nseg, k0, k1, flags; int64_t cost; };
struct Plan {
    std::vector<Seg> segs;
    std::vector<Item> phase[2];
    std::vector<int64_t> state_row;                   // a sequence's first row in the saved states (-1: none)
    int64_t state_rows = 0;
    int64_t groups = 0, grouped_keys = 0;             // cascade groups; members x shared keys, summed
};

inline int first_pos(const Args& A, int s, int t) { return A.lens[s] - (A.qstart[s + 1] - t); }  // token t's position

// Tiles [0, P) of sequences whose tables agree there: one group a time, led by the first candidate left; the
// members kept are those that maximize the tile walks saved, (members - 1) x P.
void find_groups(const Args& A, std::vector<int> cand, const std::vector<int>& tiles_before,
                 std::vector<std::pair<std::vector<int>, int>>& groups) {
    while (cand.size() >= 2) {
        const int lead = cand[0];
        const int32_t* lt = A.bt + static_cast<int64_t>(lead) * A.bt_stride;
        std::vector<std::pair<int, int>> shared;      // (tiles shared with the leader, sequence)
        for (size_t i = 1; i < cand.size(); ++i) {
            const int s = cand[i];
            const int32_t* st = A.bt + static_cast<int64_t>(s) * A.bt_stride;
            const int cap = std::min(tiles_before[lead], tiles_before[s]);
            const int blocks = (cap * TILE + A.B - 1) / A.B;
            int same = 0;
            while (same < blocks && st[same] == lt[same]) ++same;
            shared.push_back({std::min(cap, same * A.B / TILE), s});
        }
        std::stable_sort(shared.begin(), shared.end(), [](auto& x, auto& y) { return x.first > y.first; });
        int64_t best = 0;
        size_t keep = 0;
        for (size_t k = 0; k < shared.size(); ++k) {
            const int64_t saved = static_cast<int64_t>(k + 1) * shared[k].first;
            if (shared[k].first >= MIN_SHARED_TILES && saved > best) { best = saved; keep = k + 1; }
        }
        if (keep == 0) { cand.erase(cand.begin()); continue; }
        std::vector<int> members{lead};
        for (size_t k = 0; k < keep; ++k) members.push_back(shared[k].second);
        groups.push_back({members, shared[keep - 1].first});
        std::vector<int> rest;
        for (size_t k = keep; k < shared.size(); ++k) rest.push_back(shared[k].second);
        std::sort(rest.begin(), rest.end());
        cand = rest;
    }
}

// f(a, b) for sequence s's tokens [a, b) cut into ceil(n / qb) pieces of near-equal length.
template <typename F>
void cut(const Args& A, int s, int qb, F f) {
    const int q0 = A.qstart[s], q1 = A.qstart[s + 1];
    if (q1 <= q0) return;
    const int parts = (q1 - q0 + qb - 1) / qb, len = (q1 - q0 + parts - 1) / parts;
    for (int a = q0; a < q1; a += len) f(a, std::min(q1, a + len));
}

// Sequence s's tokens as items (`cut`), each over keys [k0, its last position].
void own_items(const Args& A, int s, int qb, int k0, int flags, Plan& p) {
    cut(A, s, qb, [&](int a, int b) {
        const int k1 = first_pos(A, s, b - 1) + 1;
        p.phase[flags & RESUME ? 1 : 0].push_back({static_cast<int>(p.segs.size()), 1, k0, k1, flags,
                                                   static_cast<int64_t>(b - a) * (k1 - k0)});
        p.segs.push_back({s, a, b});
    });
}

// Tokens an item of the sequences' own items: the most (up to ITEM_ROWS rows) where they are many; where they
// are few (a short chunk after a long context: a question after a system prompt), the count whose items,
// dealt longest first to the threads, end soonest: a step's 78 tokens after 3,072 as 6 items of 117 rows on two
// threads, not 9 of 96 (5 items on one thread, 4 on the other) or 15 of 48 (each tile packed for fewer rows).
// An item costs (rows + ITEM_PACK_ROWS) x keys in this model. Which rows share an item never changes a bit.
int item_tokens(const Args& A, const int32_t* seqs, int n_seqs, int threads) {
    const int G = A.H / A.Hkv, most = std::max(1, ITEM_ROWS / G);
    int64_t items = 0;
    for (int i = 0; i < n_seqs; ++i) {
        const int t = A.qstart[seqs[i] + 1] - A.qstart[seqs[i]];
        items += static_cast<int64_t>(A.Hkv) * ((t + most - 1) / most);
    }
    if (threads <= 1 || items >= static_cast<int64_t>(ITEMS_PER_THREAD) * threads || n_seqs > 64) return most;
    int best = most;
    double best_span = 0.;
    std::vector<int64_t> costs;
    std::vector<double> load(threads);
    for (int qb = most; qb >= std::max(1, most / 8); --qb) {
        costs.clear();
        for (int i = 0; i < n_seqs; ++i)
            cut(A, seqs[i], qb, [&](int a, int b) {
                costs.insert(costs.end(), A.Hkv,        // one item a KV head
                             static_cast<int64_t>((b - a) * G + ITEM_PACK_ROWS) * (first_pos(A, seqs[i], b - 1) + 1));
            });
        std::sort(costs.begin(), costs.end(), std::greater<int64_t>());
        std::fill(load.begin(), load.end(), 0.);
        for (int64_t c : costs) *std::min_element(load.begin(), load.end()) += static_cast<double>(c);
        const double span = *std::max_element(load.begin(), load.end());
        if (qb == most || span < best_span * 0.999) { best = qb; best_span = span; }
    }
    return best;
}

Plan make_plan(const Args& A, const int32_t* seqs, int n_seqs, bool cascade, int threads) {
    Plan p;
    const int G = A.H / A.Hkv;
    const int qb = item_tokens(A, seqs, n_seqs, threads);
    int n_lens = 0;
    for (int i = 0; i < n_seqs; ++i) n_lens = std::max(n_lens, seqs[i] + 1);
    p.state_row.assign(n_lens, -1);
    std::vector<std::pair<std::vector<int>, int>> groups;
    if (cascade && n_seqs > 1) {
        std::vector<int> tiles_before(n_lens, 0);     // whole tiles before a sequence's chunk
        std::unordered_map<int32_t, std::vector<int>> by_first_block;
        for (int i = 0; i < n_seqs; ++i) {
            const int s = seqs[i], q0 = A.qstart[s];
            if (A.qstart[s + 1] == q0) continue;
            tiles_before[s] = first_pos(A, s, q0) / TILE;
            if (tiles_before[s] >= MIN_SHARED_TILES) by_first_block[A.bt[static_cast<int64_t>(s) * A.bt_stride]].push_back(s);
        }
        for (auto& kv : by_first_block) {
            std::sort(kv.second.begin(), kv.second.end());
            if (kv.second.size() >= 2) find_groups(A, kv.second, tiles_before, groups);
        }
    }
    std::vector<char> grouped(n_lens, 0);
    for (auto& [members, tiles] : groups) {
        const int P = tiles * TILE;
        int64_t group_tokens = 0;
        for (int s : members) {
            grouped[s] = 1;
            p.state_row[s] = p.state_rows;
            p.state_rows += A.qstart[s + 1] - A.qstart[s];
            group_tokens += A.qstart[s + 1] - A.qstart[s];
        }
        // phase 1: the members' tokens in items of up to `take` tokens (segments across members)
        const int64_t wanted = std::max<int64_t>(1, (static_cast<int64_t>(ITEMS_PER_THREAD) * threads + A.Hkv - 1) / A.Hkv);
        const int take = static_cast<int>(std::clamp<int64_t>((group_tokens + wanted - 1) / wanted, 1, CASCADE_TOKENS));
        Item it{static_cast<int>(p.segs.size()), 0, 0, P, SAVE, 0};
        int in_item = 0;
        for (int s : members) {
            for (int a = A.qstart[s]; a < A.qstart[s + 1];) {
                const int b = std::min(A.qstart[s + 1], a + take - in_item);
                p.segs.push_back({s, a, b});
                ++it.nseg;
                in_item += b - a;
                a = b;
                if (in_item == take) {
                    it.cost = static_cast<int64_t>(in_item) * P;
                    p.phase[0].push_back(it);
                    it = Item{static_cast<int>(p.segs.size()), 0, 0, P, SAVE, 0};
                    in_item = 0;
                }
            }
        }
        if (in_item > 0) {
            it.cost = static_cast<int64_t>(in_item) * P;
            p.phase[0].push_back(it);
        }
        for (int s : members) own_items(A, s, qb, P, RESUME, p);     // phase 2
        ++p.groups;
        p.grouped_keys += static_cast<int64_t>(members.size()) * P;
    }
    for (int i = 0; i < n_seqs; ++i)
        if (!grouped[seqs[i]]) own_items(A, seqs[i], qb, 0, 0, p);
    for (auto& ph : p.phase)      // the longest first, so that dynamic scheduling ends with the short ones
        std::stable_sort(ph.begin(), ph.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
    return p;
}

template <typename T>
inline T* aligned(std::vector<T>& v, size_t n) {      // n elements, 64-byte aligned
    v.resize(n + 64 / sizeof(T));
    return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t{63});
}

// float32 tiles over a bf16 (KV = uint16_t) or float32 cache.
template <typename KV>
struct F32Tiles {
    static constexpr bool PREFETCH = true;     // the next tile's K / V rows while this one runs
    int D;
    float *q, *kt, *vt, *sc, *alpha;
    const float** qrow;
    F32Tiles(int nr, int d) : D(d) {
        thread_local std::vector<float> qb, kb, vb, sb, ab;
        thread_local std::vector<const float*> rb;
        q = aligned(qb, static_cast<size_t>(nr) * D);
        kt = aligned(kb, static_cast<size_t>(TILE) * D);
        vt = aligned(vb, static_cast<size_t>(TILE) * D);
        sc = aligned(sb, static_cast<size_t>(nr) * TILE);
        alpha = aligned(ab, nr);
        qrow = aligned(rb, nr);
    }
    void set_q(int x, const float* src, float scale) {         // q * scale * log2 e: scores in log2 units
        const float s = scale * 1.4426950408889634f;
        qrow[x] = q + static_cast<int64_t>(x) * D;
        for (int d = 0; d < D; ++d) q[static_cast<int64_t>(x) * D + d] = src[d] * s;
    }
    // One row's online-softmax update over its `valid` first scores s[0..valid) of a tile (all of them when
    // FULL: the same result without the masks): the weights 2^(s - max) replace the scores, zero from valid
    // to the tile's chunks.
    template <bool FULL>
    static void weights(float* s, int valid, int chunks, float& mx, float& sum, float& alpha) {
        using namespace prefixserve_f32;
        const int mine = FULL ? TILE / L : (valid + L - 1) / L;
        const V neg_inf = vset1(-INFINITY);
        V m = neg_inf;
        for (int c = 0; c < mine; ++c)
            m = vmax(m, FULL ? vload(s + c * L) : vfirst(vload(s + c * L), valid - c * L, neg_inf));
        const float top = std::max(mx, vhmax(m));
        alpha = std::exp2(mx - top);
        const V tv = vset1(top);
        V tot = vzero();
        for (int c = 0; c < mine; ++c) {
            const V e = vexp2(vsub(vload(s + c * L), tv));
            const V w = FULL ? e : vfirst(e, valid - c * L, vzero());
            vstore(s + c * L, w);
            tot = vadd(tot, w);
        }
        for (int c = mine; c < chunks; ++c) vstore(s + c * L, vzero());
        sum = sum * alpha + vhsum(tot);
        mx = top;
    }
    // rows [x0, nr) over the n keys of the tile at t0 (every row at or past t0)
    void step(const KV* const* krow, const KV* const* vrow, int n, int t0, int x0, int nr, const int* pos, float* mx,
              float* sum, float* const* acc) {
        using namespace prefixserve_f32;
        const float* vp[TILE];
        pack_k(krow, n, D, kt);
        if constexpr (sizeof(KV) == 2) {
            pack_v(vrow, n, D, vt);
            for (int j = 0; j < n; ++j) vp[j] = vt + j * D;
        } else {
            for (int j = 0; j < n; ++j) vp[j] = vrow[j];
        }
        const int chunks = (n + L - 1) / L;
        scores_rows(qrow + x0, nr - x0, kt, D, chunks, sc + static_cast<int64_t>(x0) * TILE, TILE);
        for (int x = x0; x < nr; ++x) {
            const int valid = std::min(n, pos[x] - t0 + 1);
            if (valid == TILE) weights<true>(sc + static_cast<int64_t>(x) * TILE, TILE, chunks, mx[x], sum[x], alpha[x]);
            else weights<false>(sc + static_cast<int64_t>(x) * TILE, valid, chunks, mx[x], sum[x], alpha[x]);
        }
        values_rows(acc + x0, alpha + x0, sc + static_cast<int64_t>(x0) * TILE, TILE, vp, n, D, nr - x0);
    }
};

// The buffers of the tiles of dimension pairs (bf16, AMX and int16 tiles; W words a row, D = 2 W dimensions): each
// row's q words and weight words, the tile's packed K and V, the scores and the softmax's factors.
struct PairBuffers {
    int w_;
    uint32_t *qw, *kt, *vt, *pw;
    float *sc, *alpha, *top, *wtop, *wtop_inv;
    const uint32_t** qrow;
    const uint32_t** prow;
    PairBuffers(int nr, int W, int D) : w_(W) {
        thread_local std::vector<uint32_t> qb, kb, vb, pb;
        thread_local std::vector<float> sb, ab, tb, wb, ib;
        thread_local std::vector<const uint32_t*> rb, pr;
        qw = aligned(qb, static_cast<size_t>(nr) * W);
        kt = aligned(kb, static_cast<size_t>(TILE) * W);
        vt = aligned(vb, static_cast<size_t>(TILE / 2) * D);
        pw = aligned(pb, static_cast<size_t>(nr) * TILE / 2);
        sc = aligned(sb, static_cast<size_t>(nr) * TILE);
        alpha = aligned(ab, nr);
        top = aligned(tb, nr);
        wtop = aligned(wb, nr);
        wtop_inv = aligned(ib, nr);
        qrow = aligned(rb, nr);
        prow = aligned(pr, nr);
    }
    uint32_t* rows(int x) {      // row x's q and weight rows; its q words, to fill
        qrow[x] = qw + static_cast<int64_t>(x) * w_;
        prow[x] = pw + static_cast<int64_t>(x) * (TILE / 2);
        return qw + static_cast<int64_t>(x) * w_;
    }
};

#if defined(PREFIXSERVE_BF16) || defined(PREFIXSERVE_I16)
// The softmax between a tile's two products, for the bf16, AMX and int16 tiles alike: rows [x0, nr) of the scores
// b.sc (a row's TILE floats, its first n the tile's keys) become their weights, handed to emit(x, e) (row x's
// TILE / 16 vectors, zero past its keys) for the tiles to round and pack, and mx, sum, alpha move on.
//   1. each row's largest score over its keys (those at positions <= its own) and its new max;
//   2. 16 rows at a time: the rescale factors e^(old - new) and each row's largest weight this tile, wtop =
//      e^(largest score - new max), computed as the weights are, so it is the weight of the largest score exactly
//      (and 1 / wtop: the int16 tiles round the weights with it, not with a max over each row's weights);
//   3. each row's weights e^(s - max) (e^x as 2^(x log2 e): vexp2, one float32 multiply-subtract per 16 weights;
//      the scores stay in natural units, so q * scale, a power of two for the usual head sizes, is not rounded
//      again), and their sums added 16 rows at a time: the rows' sum vectors transposed, then added in the order
//      of their lanes, the same order for every row wherever it sits among the 16.
// A horizontal max, sum and rounding scale a row, each a chain of dependent shuffles, took a seventh of the int16
// tiles' time (measured: 3,072 tokens a layer 45.8 -> 39.3 ms without the last two).
template <typename Emit>
inline void tile_weights(PairBuffers& b, int n, int t0, int x0, int nr, const int* pos, float* mx, float* sum,
                         Emit emit) {
    using prefixserve_simd::exp2_weight;
    constexpr float LOG2E = 1.4426950408889634f;
    const int chunks = (n + 15) / 16;
    for (int x = x0; x < nr; ++x) {
        const int valid = std::min(n, pos[x] - t0 + 1);
        const float* s_ = b.sc + static_cast<int64_t>(x) * TILE;
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int c = 0; c < chunks; ++c) {
            const int k = valid - 16 * c;
            const __mmask16 ok = static_cast<__mmask16>(k >= 16 ? 0xffff : k > 0 ? (1u << k) - 1 : 0);
            m = _mm512_mask_max_ps(m, ok, m, _mm512_load_ps(s_ + 16 * c));
        }
        b.wtop[x] = _mm512_reduce_max_ps(m);                 // the largest score, until 2
        b.top[x] = std::max(mx[x], b.wtop[x]);
    }
    const __m512 l2e = _mm512_set1_ps(LOG2E);
    for (int x = x0; x < nr; x += 16) {
        const __mmask16 ok = static_cast<__mmask16>(nr - x >= 16 ? 0xffff : (1u << (nr - x)) - 1);
        const __m512 t = _mm512_maskz_loadu_ps(ok, b.top + x);
        _mm512_mask_storeu_ps(b.alpha + x, ok, prefixserve_f32::vexp2(_mm512_mul_ps(
            _mm512_sub_ps(_mm512_maskz_loadu_ps(ok, mx + x), t), l2e)));
        _mm512_mask_storeu_ps(mx + x, ok, t);
        const __m512 w = exp2_weight(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(ok, b.wtop + x), l2e, _mm512_mul_ps(t, l2e)));
        _mm512_mask_storeu_ps(b.wtop + x, ok, w);
        _mm512_mask_storeu_ps(b.wtop_inv + x, ok, _mm512_div_ps(_mm512_set1_ps(1.f), w));   // w >= 2^-126
    }
    alignas(64) float tots[16][16];
    for (int x = x0; x < nr; ++x) {
        const int valid = std::min(n, pos[x] - t0 + 1);
        const float* s_ = b.sc + static_cast<int64_t>(x) * TILE;
        const __m512 tv = _mm512_set1_ps(mx[x] * LOG2E);
        __m512 e[TILE / 16];
        __m512 tot = _mm512_setzero_ps();
        for (int c = 0; c < TILE / 16; ++c) {
            const int k = valid - 16 * c;
            const __mmask16 ok = static_cast<__mmask16>(k >= 16 ? 0xffff : k > 0 ? (1u << k) - 1 : 0);
            e[c] = c < chunks ? _mm512_maskz_mov_ps(ok, exp2_weight(_mm512_fmsub_ps(_mm512_load_ps(s_ + 16 * c), l2e, tv)))
                              : _mm512_setzero_ps();
            tot = _mm512_add_ps(tot, e[c]);
        }
        const int i = (x - x0) % 16;
        _mm512_store_ps(tots[i], tot);
        emit(x, e);
        if (i == 15 || x == nr - 1) {                        // rows r0 .. x: their sums
            const int r0 = x - i;
            __m512i v[16];
            for (int j = 0; j < 16; ++j) v[j] = j <= i ? _mm512_castps_si512(_mm512_load_ps(tots[j])) : _mm512_setzero_si512();
            prefixserve_simd::transpose16(v);                // v[j]: lane r the j-th of row r0 + r's 16 partial sums
            __m512 add = _mm512_castsi512_ps(v[0]);
            for (int j = 1; j < 16; ++j) add = _mm512_add_ps(add, _mm512_castsi512_ps(v[j]));
            const __mmask16 ok = static_cast<__mmask16>(i == 15 ? 0xffff : (1u << (i + 1)) - 1);
            _mm512_mask_storeu_ps(sum + r0, ok, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(ok, sum + r0),
                                                                _mm512_maskz_loadu_ps(ok, b.alpha + r0), add));
        }
    }
}
#endif

#if defined(PREFIXSERVE_BF16)
// The bf16 and AMX tiles' weights: rounded to bf16 token pairs in pw (a row's TILE / 2 words).
inline void bf16_weights(PairBuffers& b, int n, int t0, int x0, int nr, const int* pos, float* mx, float* sum) {
    uint32_t* pw = b.pw;
    tile_weights(b, n, t0, x0, nr, pos, mx, sum, [pw](int x, const __m512* e) {
        uint32_t* pr = pw + static_cast<int64_t>(x) * (TILE / 2);
        for (int c = 0; c < TILE / 16; c += 2) prefixserve_bf16::pack_p(e[c], e[c + 1], pr + c * 8);
    });
}

// bf16 tiles (D = 16 NV) over a bf16 cache.
template <int NV>
struct Bf16Tiles : PairBuffers {
    static constexpr int W = 8 * NV, D = 16 * NV;     // 32-bit words (dimension pairs) a row; dimensions
    // No prefetch of the next tile: its ~256 prefetches a tile cost more than they saved, in place and into L2
    // alike (measured: 30 layers of 2,048 prompt tokens 497 -> 455 ms without them, with the weights' exp2 below)
    static constexpr bool PREFETCH = false;
    Bf16Tiles(int nr, int) : PairBuffers(nr, W, D) {}
    void set_q(int x, const float* src, float scale) {
        prefixserve_bf16::pack_q(src, scale, D, rows(x));
    }
    void step(const uint16_t* const* krow, const uint16_t* const* vrow, int n, int t0, int x0, int nr, const int* pos,
              float* mx, float* sum, float* const* acc) {
        using namespace prefixserve_bf16;
        const int chunks = (n + 15) / 16, rows = nr - x0;
        pack_k(krow, n, D, kt);
        pack_v(vrow, n, D, vt);
        scores_chunks(qrow + x0, rows, kt, W, chunks, sc + static_cast<int64_t>(x0) * TILE, TILE);
        bf16_weights(*this, n, t0, x0, nr, pos, mx, sum);
        values_rows<NV>(acc + x0, alpha + x0, prow + x0, vt, (n + 1) / 2, rows);
    }
};

// AMX tiles (D = 16 NV, NV even) over a bf16 cache: the same packing, softmax and rounding as the bf16 tiles, the
// two products as TDPBF16PS on blocks of 16 rows (amx_tile.h; emulated on a build without AMX, for the tests).
//   scores: A = 16 rows of q * scale (bf16, 32 dimensions a tile), B = the packed K's 16 dimension pairs x 16 keys,
//           C = 16 rows x 16 keys, one C tile a chunk of the tile's (up to 4): amx_tile.h scores_block;
//   values: A = 16 rows' weights over 32 keys (bf16 pairs), B = the packed V's 16 key pairs x 16 dimensions,
//           C = 16 rows x 16 dimensions, four at a time, added to the accumulators as acc alpha + C: values_block.
// A row's arithmetic does not depend on the other rows of its block (a C row is its A row times B), so the tiles
// keep the chunk, cache, cascade and thread invariance of the bf16 tiles; they differ from them only in the order
// of the float32 sums (criterion: the same 0.5% of the largest |V| against float64).
template <int NV>
struct AmxTiles : Bf16Tiles<NV> {      // the bf16 tiles' buffers, for whole blocks of 16 rows, and set_q
    static_assert(NV % 2 == 0, "AMX tiles take 32 dimensions a tile");
    static constexpr int W = 8 * NV, D = 16 * NV, PAIRS = TILE / 2;
    using Bf16Tiles<NV>::qw;
    using Bf16Tiles<NV>::kt;
    using Bf16Tiles<NV>::vt;
    using Bf16Tiles<NV>::pw;
    using Bf16Tiles<NV>::sc;
    using Bf16Tiles<NV>::alpha;
    using Bf16Tiles<NV>::top;
    float* ot;
    AmxTiles(int nr, int d) : Bf16Tiles<NV>((nr + 15) / 16 * 16, d) {
        const int np = (nr + 15) / 16 * 16;           // the rows past nr (to a whole block) are zero: q and weights
        thread_local std::vector<float> ob;
        ot = aligned(ob, static_cast<size_t>(prefixserve_amx::ROWS) * D);
        std::memset(qw + static_cast<int64_t>(nr) * W, 0, sizeof(uint32_t) * (np - nr) * W);
        std::memset(pw + static_cast<int64_t>(nr) * PAIRS, 0, sizeof(uint32_t) * (np - nr) * PAIRS);
        prefixserve_amx::configure();
    }
    ~AmxTiles() { prefixserve_amx::release(); }
    // the weights of rows [r0, r0 + 16) times the tile's V (blocks of 16 key pairs) into ot, then acc = acc alpha + ot
    // for those of rows [x0, nr)
    void values(int r0, int blocks, int x0, int nr, float* const* acc) {
        prefixserve_amx::values_block(pw + static_cast<int64_t>(r0) * PAIRS, PAIRS, vt, NV, blocks, ot);
        for (int x = std::max(r0, x0); x < std::min(r0 + 16, nr); ++x) {
            const __m512 a = _mm512_set1_ps(alpha[x]);
            const float* o = ot + static_cast<int64_t>(x - r0) * D;
            for (int v = 0; v < NV; ++v)
                _mm512_storeu_ps(acc[x] + 16 * v, _mm512_fmadd_ps(a, _mm512_loadu_ps(acc[x] + 16 * v),
                                                                  _mm512_load_ps(o + 16 * v)));
        }
    }
    void step(const uint16_t* const* krow, const uint16_t* const* vrow, int n, int t0, int x0, int nr, const int* pos,
              float* mx, float* sum, float* const* acc) {
        using namespace prefixserve_bf16;
        const int chunks = (n + 15) / 16, pairs = (n + 1) / 2, blocks = (pairs + 15) / 16;
        pack_k(krow, n, D, kt);
        pack_v(vrow, n, D, vt);
        if (pairs < 16 * blocks)      // the last V block's rows past the tile's pairs: zero, not stale (0 x NaN)
            std::memset(vt + static_cast<int64_t>(pairs) * D, 0, sizeof(uint32_t) * (16 * blocks - pairs) * D);
        const int b0 = x0 / 16 * 16;
        for (int r0 = b0; r0 < nr; r0 += 16)
            prefixserve_amx::scores_block(qw + static_cast<int64_t>(r0) * W, W, kt, W, chunks,
                                          sc + static_cast<int64_t>(r0) * TILE, TILE);
        bf16_weights(*this, n, t0, x0, nr, pos, mx, sum);
        for (int r0 = b0; r0 < nr; r0 += 16) values(r0, blocks, x0, nr, acc);
    }
};
#endif

#if defined(PREFIXSERVE_I16)
struct I16Tile { const uint32_t* kt; const float* ks; const uint32_t* vt; const float* vs; };   // a packed tile

class I16Packs;

// int16 tiles (D = 16 NV) over a bf16 cache (i16_tile.h): the bf16 tiles' walk and softmax, the products as 16-bit
// integer dot products, each side with its scales.
template <int NV>
struct I16Tiles : PairBuffers {
    using Packs = I16Packs;
    static constexpr int W = 8 * NV, D = 16 * NV;     // 32-bit words (dimension pairs) a row; dimensions
    static constexpr bool PREFETCH = false;
    float *qs, *ks, *vs, *ps;      // the scales: of each q row, each key's K and V rows, each row's weights
    I16Tiles(int nr, int) : PairBuffers(nr, W, D) {
        thread_local std::vector<float> qsb, ksb, vsb, psb;
        qs = aligned(qsb, nr);
        ks = aligned(ksb, TILE);
        vs = aligned(vsb, TILE);
        ps = aligned(psb, nr);
    }
    void set_q(int x, const float* src, float scale) {
        prefixserve_i16::pack_q(src, scale, D, rows(x), qs + x);
    }
    void step(const uint16_t* const* krow, const uint16_t* const* vrow, int n, int t0, int x0, int nr, const int* pos,
              float* mx, float* sum, float* const* acc) {
        prefixserve_i16::pack_k(krow, n, D, kt, ks);
        prefixserve_i16::pack_v(vrow, n, D, TILE, vt, vs);
        step_packed({kt, ks, vt, vs}, n, t0, x0, nr, pos, mx, sum, acc);
    }
    // rows [x0, nr) over the n keys of a tile packed already (here, or once for every item: I16Packs)
    void step_packed(const I16Tile& t, int n, int t0, int x0, int nr, const int* pos, float* mx, float* sum,
                     float* const* acc) {
        using namespace prefixserve_i16;
        const int chunks = (n + 15) / 16, rows = nr - x0;
        scores_chunks(qrow + x0, qs + x0, rows, t.kt, t.ks, W, chunks, sc + static_cast<int64_t>(x0) * TILE, TILE);
        // Each row's weights times V's scales, in units of (its largest weight) x (the largest V scale of its keys,
        // those at or before its position: vtop[valid - 1], so a row's integers depend on its own keys only) / lim.
        const float lim = limit(TILE);
        alignas(64) float vtop[TILE], vinv[TILE];
        top_scales(t.vs, n, lim, vtop, vinv);
        tile_weights(*this, n, t0, x0, nr, pos, mx, sum, [&](int x, const __m512* e) {
            const int last = std::min(n, pos[x] - t0 + 1) - 1;
            pack_p<TILE / 16>(e, t.vs, _mm512_set1_ps(vinv[last] * wtop_inv[x]), pw + static_cast<int64_t>(x) * (TILE / 2));
            ps[x] = wtop[x] * vtop[last] / lim;
        });
        values_rows<NV>(acc + x0, alpha + x0, prow + x0, ps + x0, t.vt, (n + 1) / 2, rows);
    }
};

// The int16 tiles' K and V, packed once a call (pack_k / pack_v: each K / V row rounded to integers, K transposed
// into dimension pairs, V into token pairs) for every item that walks them, where a tile is walked by two items or
// more: the items of a prompt chunk's rows all walk its leading tiles (a 3,072-token prompt's 48 items of 64
// tokens walk the first tile 48 times), and packing a tile cost about what 8 of its rows' products do. A tile is
// packed with every key its sequence has there (an item that stops inside it masks the rest: a masked key weighs
// exactly 0), so an item's result is the same bit for bit whoever packed the tile. Keyed by the sequence whose
// table an item walks (a cascade group's first member for the shared tiles) and the tile's index.
class I16Packs {
public:
    using Tile = I16Tile;
    static constexpr int64_t MAX_BYTES = int64_t{256} << 20;   // beyond: the items pack their tiles themselves
    I16Packs(const Args& A, const Plan& p) : W_(A.D / 2), D_(A.D), Hkv_(A.Hkv) {
        std::vector<std::vector<int>> uses;                    // items walking (sequence, tile)
        for (const auto& ph : p.phase)
            for (const Item& it : ph) {
                const int s = p.segs[it.seg0].s;
                if (static_cast<int>(uses.size()) <= s) uses.resize(s + 1);
                const int t1 = (it.k1 + TILE - 1) / TILE;
                if (static_cast<int>(uses[s].size()) < t1) uses[s].resize(t1, 0);
                for (int t = it.k0 / TILE; t < t1; ++t) ++uses[s][t];
            }
        slot_.resize(uses.size());
        for (int s = 0; s < static_cast<int>(uses.size()); ++s) {
            slot_[s].assign(uses[s].size(), -1);
            for (int t = 0; t < static_cast<int>(uses[s].size()); ++t)
                if (uses[s][t] >= 2) {
                    slot_[s][t] = static_cast<int64_t>(work_.size());
                    work_.push_back({s, t});
                }
        }
        const int64_t bytes = static_cast<int64_t>(work_.size()) * Hkv_ * tile_words() * 4;
        if (bytes > MAX_BYTES || work_.empty()) {
            work_.clear();
            slot_.clear();
            return;
        }
        store_.reset(static_cast<uint32_t*>(std::aligned_alloc(64, static_cast<size_t>(bytes))));
        if (!store_) {
            work_.clear();
            slot_.clear();
        }
    }
    // Packs every tile of the list, its KV heads dealt to the team's threads (call from each thread of it).
    void pack(const Args& A) {
        const int n_work = static_cast<int>(work_.size()) * Hkv_;
        const uint16_t* kc = static_cast<const uint16_t*>(A.kc);
        const uint16_t* vc = static_cast<const uint16_t*>(A.vc);
        #pragma omp for schedule(dynamic, 4)
        for (int i = 0; i < n_work; ++i) {
            const auto [s, t] = work_[i / Hkv_];
            const int h = i % Hkv_, t0 = t * TILE, n = std::min(TILE, A.lens[s] - t0);
            const int32_t* table = A.bt + static_cast<int64_t>(s) * A.bt_stride;
            const uint16_t* krow[TILE];
            const uint16_t* vrow[TILE];
            for (int j = 0; j < n; ++j) {
                const int64_t blk = table[(t0 + j) / A.B], off = (t0 + j) % A.B;
                krow[j] = kc + blk * A.kc_blk + off * A.kc_tok + h * A.kc_head;
                vrow[j] = vc + blk * A.vc_blk + off * A.vc_tok + h * A.vc_head;
            }
            uint32_t* w = words(i);
            float* scales = reinterpret_cast<float*>(w + TILE * W_ + TILE / 2 * D_);
            prefixserve_i16::pack_k(krow, n, D_, w, scales);
            prefixserve_i16::pack_v(vrow, n, D_, TILE, w + TILE * W_, scales + TILE);
        }
    }
    int64_t tiles() const { return static_cast<int64_t>(work_.size()); }      // tiles packed a KV head
    // Sequence s's tile t of KV head h, if packed here (else the item packs it).
    bool find(int s, int t, int h, I16Tile& out) const {
        const uint32_t* w = packed(s, t, h);
        if (w == nullptr) return false;
        const float* scales = reinterpret_cast<const float*>(w + TILE * W_ + TILE / 2 * D_);
        out = {w, scales, w + TILE * W_, scales + TILE};
        return true;
    }

    // The tile's bytes into L2 (the next tile an item walks, while it runs this one).
    void prefetch(int s, int t, int h) const {
        const char* w = reinterpret_cast<const char*>(packed(s, t, h));
        if (w == nullptr) return;
        for (int64_t b = 0; b < tile_words() * 4; b += 64) _mm_prefetch(w + b, _MM_HINT_T1);
    }

private:
    struct Free { void operator()(uint32_t* x) const { std::free(x); } };
    int64_t tile_words() const { return static_cast<int64_t>(TILE) * W_ + TILE / 2 * D_ + 2 * TILE; }   // kt vt ks vs
    uint32_t* words(int i) const { return store_.get() + static_cast<int64_t>(i) * tile_words(); }
    const uint32_t* packed(int s, int t, int h) const {          // null: not packed here
        if (s >= static_cast<int>(slot_.size()) || t >= static_cast<int>(slot_[s].size()) || slot_[s][t] < 0)
            return nullptr;
        return words(static_cast<int>(slot_[s][t]) * Hkv_ + h);
    }
    int W_, D_, Hkv_;
    std::vector<std::vector<int64_t>> slot_;      // [sequence][tile]: its index in work_, -1 if not packed here
    std::vector<std::pair<int, int>> work_;       // (sequence, tile) to pack
    std::unique_ptr<uint32_t, Free> store_;
};
#endif

// The tiles that pack K and V in each item (all but the int16 ones: I16Packs).
struct NoPacks {
    NoPacks(const Args&, const Plan&) {}
    void pack(const Args&) {}
    int64_t tiles() const { return 0; }
};
template <typename T, typename = void> struct packs_of { using type = NoPacks; };
template <typename T> struct packs_of<T, std::void_t<typename T::Packs>> { using type = typename T::Packs; };

template <typename KV>
inline void prefetch_row(const KV* p, int D) {
    for (int64_t b = 0; b < static_cast<int64_t>(sizeof(KV)) * D; b += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(p) + b, 0, 3);
}

// One item, KV head h: its rows' softmax state from scratch (or resumed from `state`), keys [k0, k1) tile by
// tile through the table of its first sequence, then each row's output (or its state saved).
template <typename Tiles, typename KV>
void run_item(const Args& A, const Plan& p, const Item& it, int h, float* state,
              const typename packs_of<Tiles>::type& packs) {
    using Packs = typename packs_of<Tiles>::type;
    const int H = A.H, G = A.H / A.Hkv, D = A.D, PS = D + 2;
    int nr = 0;
    for (int i = 0; i < it.nseg; ++i) nr += (p.segs[it.seg0 + i].b - p.segs[it.seg0 + i].a) * G;
    thread_local std::vector<float> ab, mb, sb;
    thread_local std::vector<int> posb;
    thread_local std::vector<float*> accb, stb;
    thread_local std::vector<int64_t> outb;
    float* acc = aligned(ab, static_cast<size_t>(nr) * D);
    float* mx = aligned(mb, nr);
    float* sum = aligned(sb, nr);
    int* pos = aligned(posb, nr);
    float** arow = aligned(accb, nr);
    float** st = aligned(stb, nr);
    int64_t* orow = aligned(outb, nr);
    Tiles tiles(nr, D);
    int x = 0;
    for (int i = 0; i < it.nseg; ++i) {
        const Seg& g = p.segs[it.seg0 + i];
        for (int t = g.a; t < g.b; ++t) {
            for (int r = 0; r < G; ++r, ++x) {              // row x: token t, head h G + r
                const int64_t o = (static_cast<int64_t>(t) * H + h * G + r) * D;
                tiles.set_q(x, A.q + o, A.scale);
                orow[x] = o;
                pos[x] = first_pos(A, g.s, t);
                arow[x] = acc + static_cast<int64_t>(x) * D;
                st[x] = state == nullptr ? nullptr :
                        state + ((p.state_row[g.s] + t - A.qstart[g.s]) * H + h * G + r) * PS;
                if (it.flags & RESUME) {
                    mx[x] = st[x][0];
                    sum[x] = st[x][1];
                    std::memcpy(arow[x], st[x] + 2, sizeof(float) * D);
                } else {
                    mx[x] = -INFINITY;
                    sum[x] = 0.f;
                    std::memset(arow[x], 0, sizeof(float) * D);
                }
            }
        }
    }
    const KV* kc = static_cast<const KV*>(A.kc);
    const KV* vc = static_cast<const KV*>(A.vc);
    const int owner = p.segs[it.seg0].s;              // whose table the item walks
    const int32_t* table = A.bt + static_cast<int64_t>(owner) * A.bt_stride;
    const KV* krow[TILE];
    const KV* vrow[TILE];
    int x0 = 0;      // NOTE: an item's rows are in position order (one sequence), or all see every key (phase 1)
    for (int t0 = it.k0; t0 < it.k1; t0 += TILE) {
        const int n = std::min(TILE, it.k1 - t0);
        while (x0 < nr && pos[x0] < t0) ++x0;
        if constexpr (!std::is_same_v<Packs, NoPacks>) {
            typename Packs::Tile packed;
            if (packs.find(owner, t0 / TILE, h, packed)) {
                if (t0 + TILE < it.k1) packs.prefetch(owner, t0 / TILE + 1, h);
                tiles.step_packed(packed, n, t0, x0, nr, pos, mx, sum, arow);
                continue;
            }
        }
        for (int j = 0; j < n; ++j) {
            const int64_t blk = table[(t0 + j) / A.B], off = (t0 + j) % A.B;
            krow[j] = kc + blk * A.kc_blk + off * A.kc_tok + h * A.kc_head;
            vrow[j] = vc + blk * A.vc_blk + off * A.vc_tok + h * A.vc_head;
        }
        if constexpr (Tiles::PREFETCH)
            for (int j = t0 + TILE; j < std::min(it.k1, t0 + 2 * TILE); ++j) {     // the next tile's rows, meanwhile
                const int64_t blk = table[j / A.B], off = j % A.B;
                prefetch_row(kc + blk * A.kc_blk + off * A.kc_tok + h * A.kc_head, D);
                prefetch_row(vc + blk * A.vc_blk + off * A.vc_tok + h * A.vc_head, D);
            }
        tiles.step(krow, vrow, n, t0, x0, nr, pos, mx, sum, arow);
    }
    for (int y = 0; y < nr; ++y) {
        if (it.flags & SAVE) {
            st[y][0] = mx[y];
            st[y][1] = sum[y];
            std::memcpy(st[y] + 2, arow[y], sizeof(float) * D);
        } else {
            float* o = A.out + orow[y];
            const float inv = sum[y] > 0.f ? 1.f / sum[y] : 0.f;
            for (int d = 0; d < D; ++d) o[d] = arow[y][d] * inv;
        }
    }
}

// Returns the tiles packed once for all the items (a KV head's: I16Packs), 0 for the other tiles.
template <typename Tiles, typename KV>
int64_t prefill(const Args& A, const Plan& p) {
    std::unique_ptr<float[]> state(p.state_rows > 0 ? new float[p.state_rows * A.H * (A.D + 2)] : nullptr);
    const int n0 = static_cast<int>(p.phase[0].size()) * A.Hkv, n1 = static_cast<int>(p.phase[1].size()) * A.Hkv;
    typename packs_of<Tiles>::type packs(A, p);
    #pragma omp parallel
    {
        packs.pack(A);                           // an omp for: every tile packed before any item runs
        #pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < n0; ++i) run_item<Tiles, KV>(A, p, p.phase[0][i / A.Hkv], i % A.Hkv, state.get(), packs);
        #pragma omp for schedule(dynamic, 1)     // after every phase-1 item (the implied barrier)
        for (int i = 0; i < n1; ++i) run_item<Tiles, KV>(A, p, p.phase[1][i / A.Hkv], i % A.Hkv, state.get(), packs);
    }
    return packs.tiles();
}

#if defined(PREFIXSERVE_BF16) || defined(PREFIXSERVE_I16)
// The prefill over a bf16 cache with tiles of dimension pairs (Bf16Tiles, AmxTiles, I16Tiles) for head_dim 16 NV, NV
// in 2, 4, 6, 8, 16 (*packed: as prefill's); false for another head_dim.
template <template <int> class Tiles>
bool prefill_pairs(const Args& A, const Plan& p, int64_t* packed) {
    switch (A.D / 16) {
        case 2: *packed = prefill<Tiles<2>, uint16_t>(A, p); return true;
        case 4: *packed = prefill<Tiles<4>, uint16_t>(A, p); return true;
        case 6: *packed = prefill<Tiles<6>, uint16_t>(A, p); return true;
        case 8: *packed = prefill<Tiles<8>, uint16_t>(A, p); return true;
        case 16: *packed = prefill<Tiles<16>, uint16_t>(A, p); return true;
        default: return false;
    }
}
#endif

// The AMX tiles take a bf16 cache whose head_dim is a multiple of 32 (16 NV, NV in 2, 4, 6, 8, 16): on an AMX build
// where Linux grants the tile state (real), on any other AVX-512 BF16 build only when asked (emulated, tests).
inline bool amx_takes(int kv_dtype, int D) {
#if defined(PREFIXSERVE_BF16)
    const int nv = D / 16;
    return kv_dtype == 1 && D % 32 == 0 && (nv == 2 || nv == 4 || nv == 6 || nv == 8 || nv == 16) &&
           prefixserve_amx::available();
#else
    (void)kv_dtype; (void)D;
    return false;
#endif
}

// What `tiles` = 0 runs: the AMX tiles where the build has AMX and takes the shape, else the bf16 (vector) tiles.
inline bool amx_default(int kv_dtype, int D) {
#if defined(PREFIXSERVE_AMX)
    return amx_takes(kv_dtype, D);
#else
    (void)kv_dtype; (void)D;
    return false;
#endif
}

}  // namespace

extern "C" {

// q [T, H, D] float32 (rows of sequence s: qstart[s] .. qstart[s + 1], the last positions of its lens[s]);
// caches [blocks, B, Hkv, D] float32 (kv_dtype 0) or bfloat16 (1), strides given, D contiguous; out [T, H, D]
// float32. Only the rows of the sequences listed in seqs are computed. cascade: 1 to walk shared leading tiles
// once for all. stats (null, or 4 int64): cascade groups; members x shared keys, summed over the groups; keys
// walked in all (summed over the items, per KV head); tiles packed once for all the items that walk them (per KV
// head: I16Packs; 0 for the other tiles). tiles: 0 the build's best loops (the AMX tiles on an AMX
// build, where the shape allows), 1 the vector tiles, 2 the AMX tiles where they take the cache (bf16, head_dim a
// multiple of 32; emulated on a build with AVX-512 BF16 and no AMX: for the tests), else as 0. Returns 0, or -1 for
// shapes it does not take.
int prefixserve_paged_prefill(const float* q, const void* kc, const void* vc, const int32_t* bt, int64_t bt_stride,
                              const int32_t* lens, const int32_t* qstart, const int32_t* seqs, int n_seqs, float* out,
                              int H, int Hkv, int D, int B, float scale, int64_t kc_blk, int64_t kc_tok,
                              int64_t kc_head, int64_t vc_blk, int64_t vc_tok, int64_t vc_head, int kv_dtype,
                              int cascade, int64_t* stats, int tiles) {
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAX_GROUP || B <= 0 || D % 16 != 0 || D > MAX_D || kv_dtype < 0 ||
        kv_dtype > 1 || tiles < 0 || tiles > 2)
        return -1;
    const Args A{q, kc, vc, bt, bt_stride, lens, qstart, out, H, Hkv, D, B, scale, kc_blk, kc_tok, kc_head,
                 vc_blk, vc_tok, vc_head};
    const Plan p = make_plan(A, seqs, std::max(0, n_seqs), cascade != 0, omp_get_max_threads());
    int64_t packed = 0;
    if (stats != nullptr) {
        int64_t keys = 0;
        for (const auto& ph : p.phase)
            for (const Item& it : ph) keys += it.k1 - it.k0;
        stats[0] = p.groups;
        stats[1] = p.grouped_keys;
        stats[2] = keys;
    }
    [&] {
        if (kv_dtype == 0) { prefill<F32Tiles<float>, float>(A, p); return; }
#if defined(PREFIXSERVE_BF16)
        if ((tiles == 2 && amx_takes(kv_dtype, D)) || (tiles == 0 && amx_default(kv_dtype, D))) {
            if (prefill_pairs<AmxTiles>(A, p, &packed)) return;
        }
        if (prefill_pairs<Bf16Tiles>(A, p, &packed)) return;
#endif
#if defined(PREFIXSERVE_I16)
        if (kv_dtype == 1 && prefill_pairs<I16Tiles>(A, p, &packed)) return;
#endif
        prefill<F32Tiles<uint16_t>, uint16_t>(A, p);
    }();
    if (stats != nullptr) stats[3] = packed;
    return 0;
}

// The loops a cache dtype runs with `tiles` (as prefixserve_paged_prefill's): "amx" (bf16 products as AMX tiles),
// "avx512_bf16" (bf16 products), "avx512_vnni" (int16 products), "avx512", "avx2" or "generic" (float32 products).
const char* prefixserve_paged_prefill_path(int kv_dtype, int head_dim, int tiles) {
    if ((tiles == 0 && amx_default(kv_dtype, head_dim)) || (tiles == 2 && amx_takes(kv_dtype, head_dim)))
        return "amx";
#if defined(PREFIXSERVE_BF16)
    if (kv_dtype == 1 && head_dim % 32 == 0 && (head_dim / 16 == 2 || head_dim / 16 == 4 || head_dim / 16 == 6 ||
                                                head_dim / 16 == 8 || head_dim / 16 == 16))
        return "avx512_bf16";
#elif defined(PREFIXSERVE_I16)
    if (kv_dtype == 1 && head_dim % 32 == 0 && (head_dim / 16 == 2 || head_dim / 16 == 4 || head_dim / 16 == 6 ||
                                                head_dim / 16 == 8 || head_dim / 16 == 16))
        return "avx512_vnni";
#else
    (void)kv_dtype; (void)head_dim;
#endif
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "generic";
#endif
}

}  // extern "C"
