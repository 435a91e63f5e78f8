// Paged decode attention on the CPU: one query token per sequence, K and V read in place through the
// block table (no gather, no padding), GQA-aware, split-KV for long contexts. Launcher and layout:
// kernels/cpu/paged_decode.py.
//
// Work items are (sequence, KV head, split). An item owns the GROUP query heads that share its KV head,
// so every K and V row it reads serves the whole group. Per block of the table it computes the group's
// scores for the block's tokens, rescales its running max / sum / accumulator once (online softmax, fp32)
// and adds the block's V rows. A long context is cut into splits of whole blocks when there are too few
// (sequence, KV head) items to keep every thread busy; each split writes (max, sum, unnormalized
// accumulator) and a second pass merges them; an empty split (max = -inf) weighs nothing.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int MAX_GROUP = 16;
constexpr int MAX_BLOCK = 256;

inline float bf16_to_float(uint16_t x) {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) { return bf16_to_float(x); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {   // 16 bfloat16 -> 16 float32 (a bf16 is the top half of a float)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

struct Args {
    const float* q; const void* kc; const void* vc; const int32_t* bt; int64_t bt_stride; const int32_t* lens;
    float* out; int S, H, Hkv, D, B; float scale;
    int64_t kc_blk, kc_tok, kc_head, vc_blk, vc_tok, vc_head;
};

// One item: blocks [b0, b1) of sequence s, KV head h. Writes m[g], l[g], acc[g][:D] (acc unnormalized).
template <typename KV, int NV>
void run_item(const Args& a, int s, int h, int b0, int b1, float* m, float* l, float* acc_out) {
    const int G = a.H / a.Hkv, D = a.D, B = a.B, L = a.lens[s];
    const KV* kc = static_cast<const KV*>(a.kc);
    const KV* vc = static_cast<const KV*>(a.vc);
    alignas(64) float sc[MAX_GROUP][MAX_BLOCK];
#if defined(__AVX512F__)
    __m512 qv[MAX_GROUP][NV], acc[MAX_GROUP][NV];
    for (int g = 0; g < G; ++g) {
        const float* qp = a.q + (static_cast<int64_t>(s) * a.H + h * G + g) * D;
        for (int v = 0; v < NV; ++v) {
            qv[g][v] = _mm512_mul_ps(_mm512_loadu_ps(qp + 16 * v), _mm512_set1_ps(a.scale));
            acc[g][v] = _mm512_setzero_ps();
        }
    }
#else
    alignas(64) float qv[MAX_GROUP][16 * NV], acc[MAX_GROUP][16 * NV];
    for (int g = 0; g < G; ++g) {
        const float* qp = a.q + (static_cast<int64_t>(s) * a.H + h * G + g) * D;
        for (int d = 0; d < D; ++d) { qv[g][d] = qp[d] * a.scale; acc[g][d] = 0.f; }
    }
#endif
    for (int g = 0; g < G; ++g) { m[g] = -INFINITY; l[g] = 0.f; }
    for (int b = b0; b < b1; ++b) {
        const int n = std::min(B, L - b * B);
        const int64_t blk = a.bt[static_cast<int64_t>(s) * a.bt_stride + b];
        const KV* kb = kc + blk * a.kc_blk + h * a.kc_head;
        const KV* vb = vc + blk * a.vc_blk + h * a.vc_head;
        float bm[MAX_GROUP];
        for (int g = 0; g < G; ++g) bm[g] = m[g];
        for (int j = 0; j < n; ++j) {                       // scores of the block's tokens
            const KV* kr = kb + j * a.kc_tok;
#if defined(__AVX512F__)
            __m512 kv[NV];
            for (int v = 0; v < NV; ++v) kv[v] = load16(kr + 16 * v);
            for (int g = 0; g < G; ++g) {
                __m512 d = _mm512_mul_ps(qv[g][0], kv[0]);
                for (int v = 1; v < NV; ++v) d = _mm512_fmadd_ps(qv[g][v], kv[v], d);
                const float x = _mm512_reduce_add_ps(d);
                sc[g][j] = x;
                bm[g] = std::max(bm[g], x);
            }
#else
            for (int g = 0; g < G; ++g) {
                float x = 0.f;
                #pragma omp simd reduction(+ : x)
                for (int d = 0; d < D; ++d) x += qv[g][d] * to_float(kr[d]);
                sc[g][j] = x;
                bm[g] = std::max(bm[g], x);
            }
#endif
        }
        for (int g = 0; g < G; ++g) {                       // rescale once per block
            const float alpha = std::exp(m[g] - bm[g]);
            l[g] *= alpha;
#if defined(__AVX512F__)
            const __m512 av = _mm512_set1_ps(alpha);
            for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_mul_ps(acc[g][v], av);
#else
            for (int d = 0; d < D; ++d) acc[g][d] *= alpha;
#endif
            m[g] = bm[g];
            float sum = 0.f;
            for (int j = 0; j < n; ++j) {
                const float p = std::exp(sc[g][j] - bm[g]);
                sc[g][j] = p;
                sum += p;
            }
            l[g] += sum;
        }
        for (int j = 0; j < n; ++j) {                       // weighted V rows
            const KV* vr = vb + j * a.vc_tok;
#if defined(__AVX512F__)
            __m512 vv[NV];
            for (int v = 0; v < NV; ++v) vv[v] = load16(vr + 16 * v);
            for (int g = 0; g < G; ++g) {
                const __m512 p = _mm512_set1_ps(sc[g][j]);
                for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_fmadd_ps(p, vv[v], acc[g][v]);
            }
#else
            for (int g = 0; g < G; ++g) {
                const float p = sc[g][j];
                #pragma omp simd
                for (int d = 0; d < D; ++d) acc[g][d] += p * to_float(vr[d]);
            }
#endif
        }
    }
    for (int g = 0; g < G; ++g) {
#if defined(__AVX512F__)
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc_out + g * D + 16 * v, acc[g][v]);
#else
        for (int d = 0; d < D; ++d) acc_out[g * D + d] = acc[g][d];
#endif
    }
}

template <typename KV, int NV>
void decode(const Args& a, int splits) {
    const int G = a.H / a.Hkv, D = a.D;
    const int items = a.S * a.Hkv * splits;
    const int64_t part_stride = static_cast<int64_t>(G) * (D + 2);
    float* part = splits > 1 ? static_cast<float*>(std::malloc(sizeof(float) * items * part_stride)) : nullptr;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int it = 0; it < items; ++it) {
        const int s = it / (a.Hkv * splits), h = (it / splits) % a.Hkv, sp = it % splits;
        const int nblk = (a.lens[s] + a.B - 1) / a.B;
        const int per = (nblk + splits - 1) / splits;
        const int b0 = std::min(nblk, sp * per), b1 = std::min(nblk, b0 + per);
        float m[MAX_GROUP], l[MAX_GROUP];
        alignas(64) float acc[MAX_GROUP * 16 * NV];
        run_item<KV, NV>(a, s, h, b0, b1, m, l, acc);
        if (splits == 1) {
            for (int g = 0; g < G; ++g) {
                const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
                float* o = a.out + (static_cast<int64_t>(s) * a.H + h * G + g) * D;
                for (int d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
            }
        } else {
            float* p = part + it * part_stride;
            for (int g = 0; g < G; ++g) {
                p[g * (D + 2)] = m[g];
                p[g * (D + 2) + 1] = l[g];
                std::memcpy(p + g * (D + 2) + 2, acc + g * D, sizeof(float) * D);
            }
        }
    }
    if (splits == 1) return;
    #pragma omp parallel for
    for (int sh = 0; sh < a.S * a.Hkv; ++sh) {
        const int s = sh / a.Hkv, h = sh % a.Hkv;
        for (int g = 0; g < G; ++g) {
            float mx = -INFINITY;
            for (int sp = 0; sp < splits; ++sp) mx = std::max(mx, part[(static_cast<int64_t>(sh) * splits + sp) * part_stride + g * (D + 2)]);
            float* o = a.out + (static_cast<int64_t>(s) * a.H + h * G + g) * D;
            for (int d = 0; d < D; ++d) o[d] = 0.f;
            float sum = 0.f;
            for (int sp = 0; sp < splits; ++sp) {
                const float* pg = part + (static_cast<int64_t>(sh) * splits + sp) * part_stride + g * (D + 2);
                if (pg[0] == -INFINITY) continue;             // an empty split weighs nothing
                const float w = std::exp(pg[0] - mx);
                sum += pg[1] * w;
                for (int d = 0; d < D; ++d) o[d] += pg[2 + d] * w;
            }
            const float inv = sum > 0.f ? 1.f / sum : 0.f;
            for (int d = 0; d < D; ++d) o[d] *= inv;
        }
    }
    std::free(part);
}

template <typename KV>
int dispatch(const Args& a, int splits) {
    switch (a.D / 16) {
        case 1: decode<KV, 1>(a, splits); return 0;
        case 2: decode<KV, 2>(a, splits); return 0;
        case 3: decode<KV, 3>(a, splits); return 0;
        case 4: decode<KV, 4>(a, splits); return 0;
        case 5: decode<KV, 5>(a, splits); return 0;
        case 6: decode<KV, 6>(a, splits); return 0;
        case 8: decode<KV, 8>(a, splits); return 0;
        case 16: decode<KV, 16>(a, splits); return 0;
        default: return -2;
    }
}

inline uint16_t float_to_bf16(float f) {     // round to nearest even, as torch's .to(torch.bfloat16)
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;   // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// The step's new K and V rows into the cache: token i's [Hkv, D] at cache row rows[i] (block * B + offset).
template <typename KV>
void write_rows(const float* k, const float* v, int64_t k_tok, int64_t k_head, int64_t v_tok, int64_t v_head,
                const int64_t* rows, int n,
                KV* kc, KV* vc, int Hkv, int D, int B, int64_t kc_blk, int64_t kc_tok, int64_t kc_head,
                int64_t vc_blk, int64_t vc_tok, int64_t vc_head) {
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

// kv_dtype: 0 float32, 1 bfloat16. Returns 0, or < 0 for shapes this kernel does not take.
int prefixserve_paged_decode(const float* q, const void* kc, const void* vc, const int32_t* bt, int64_t bt_stride,
                             const int32_t* lens, float* out, int S, int H, int Hkv, int D, int B, float scale,
                             int64_t kc_blk, int64_t kc_tok, int64_t kc_head, int64_t vc_blk, int64_t vc_tok,
                             int64_t vc_head, int kv_dtype, int splits) {
    if (S <= 0) return 0;
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAX_GROUP || B <= 0 || B > MAX_BLOCK || D % 16 != 0 || splits < 1) return -1;
    const Args a{q, kc, vc, bt, bt_stride, lens, out, S, H, Hkv, D, B, scale, kc_blk, kc_tok, kc_head,
                 vc_blk, vc_tok, vc_head};
    return kv_dtype == 1 ? dispatch<uint16_t>(a, splits) : dispatch<float>(a, splits);
}

// The same, after writing this step's K and V (float32 [S, Hkv, D], D contiguous, strides given) into the
// cache at rows[s]: one call per layer for a decode step.
int prefixserve_paged_decode_write(const float* q, const float* k, const float* v, int64_t k_tok, int64_t k_head,
                                   int64_t v_tok, int64_t v_head, const int64_t* rows, void* kc, void* vc, const int32_t* bt, int64_t bt_stride,
                                   const int32_t* lens, float* out, int S, int H, int Hkv, int D, int B, float scale,
                                   int64_t kc_blk, int64_t kc_tok, int64_t kc_head, int64_t vc_blk, int64_t vc_tok,
                                   int64_t vc_head, int kv_dtype, int splits) {
    if (S <= 0) return 0;
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAX_GROUP || B <= 0 || B > MAX_BLOCK || D % 16 != 0 || splits < 1) return -1;
    if (kv_dtype == 1)
        write_rows<uint16_t>(k, v, k_tok, k_head, v_tok, v_head, rows, S, static_cast<uint16_t*>(kc), static_cast<uint16_t*>(vc),
                             Hkv, D, B, kc_blk, kc_tok, kc_head, vc_blk, vc_tok, vc_head);
    else
        write_rows<float>(k, v, k_tok, k_head, v_tok, v_head, rows, S, static_cast<float*>(kc), static_cast<float*>(vc), Hkv, D,
                          B, kc_blk, kc_tok, kc_head, vc_blk, vc_tok, vc_head);
    const Args a{q, kc, vc, bt, bt_stride, lens, out, S, H, Hkv, D, B, scale, kc_blk, kc_tok, kc_head,
                 vc_blk, vc_tok, vc_head};
    return kv_dtype == 1 ? dispatch<uint16_t>(a, splits) : dispatch<float>(a, splits);
}

int prefixserve_num_threads() { return omp_get_max_threads(); }

}  // extern "C"
