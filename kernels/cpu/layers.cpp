// A decoder layer's work around its attention in two calls instead of a dozen from Python, and a decode step's
// layers, attention included, in one: the kernels are the ones the op layer calls one by one (int4_gemm.cpp
// gemm_bf16, or its float32 GEMMs gemm_q16 / gemm_wide; fused.cpp's norms, RoPE and SiLU; paged_decode.cpp), reached
// through the function pointers the launcher passes (kernels/cpu/layers.py), called in the same order on the same
// data, so the result is the same bit for bit. Launcher, buffers and when it applies: kernels/cpu/layers.py.
//
//     pre    h = norm(x (+= r))                  (rms_norm for the first layer, add_rms_norm after)
//            qkv = h @ Wqkv^T;  q, k, v = rope(split(qkv))
//     post   a = act(attention out)             (bfloat16: torch's .to(bfloat16), round to nearest even; float32: as is)
//            o = a @ Wo^T;  h = norm(x += o);  r = silu_mul(h @ Wgu^T) @ Wdown^T
//
//     layers_decode    every layer of a decode step: pre, the paged decode kernel (write this step's K / V, then
//                      attend: paged_decode.cpp, as CpuAttentionBackend.attend calls it), post
//
// x is the float32 residual stream [T, H], updated in place; everything between the matmuls is the activation type
// A: bfloat16 (uint16_t; gemm_bf16 over pack_bf16's weights) in the functions without a suffix, float32 in the _f32
// ones (gemm_f32: gemm_q16 or gemm_wide over pack's weights). Every buffer is contiguous (row stride = its width).
#include <cstdint>
#include "bf16_convert.h"

extern "C" {

struct PrefixserveLayerKernels {
    int (*gemm_bf16)(const uint16_t* x, int64_t x_stride, const uint8_t* w4, const uint16_t* sz, uint16_t* y,
                     int64_t y_stride, int T, int N, int K);
    void (*rms_norm)(const float* x, int64_t x_stride, const float* w, float eps, void* y, int64_t y_stride, int T,
                     int H, int act);
    void (*add_rms_norm)(float* x, int64_t x_stride, const void* r, int64_t r_stride, const float* w, float eps,
                         void* y, int64_t y_stride, int T, int H, int act);
    void (*qkv_rope)(const void* qkv, int64_t qkv_stride, const float* cos, const float* sin, float* q, float* k,
                     float* v, int T, int H, int Hkv, int D, int act);
    void (*silu_mul)(const void* gu, int64_t gu_stride, void* y, int64_t y_stride, int T, int I, int act);
    int (*gemm_f32)(const float* x, int64_t x_stride, const uint32_t* w, const float* sz, float* y, int64_t y_stride,
                    int T, int N, int K);
};

}  // extern "C"

namespace {

// The step's GEMM and the fused kernels' activation code (fused.py _ACT) for activations of type A.
inline int gemm(const PrefixserveLayerKernels* k, const uint16_t* x, int64_t x_stride, const void* w, const void* sz,
                uint16_t* y, int64_t y_stride, int T, int N, int K) {
    return k->gemm_bf16(x, x_stride, static_cast<const uint8_t*>(w), static_cast<const uint16_t*>(sz), y, y_stride,
                        T, N, K);
}
inline int gemm(const PrefixserveLayerKernels* k, const float* x, int64_t x_stride, const void* w, const void* sz,
                float* y, int64_t y_stride, int T, int N, int K) {
    return k->gemm_f32(x, x_stride, static_cast<const uint32_t*>(w), static_cast<const float*>(sz), y, y_stride,
                       T, N, K);
}
template <typename A> constexpr int act_code();
template <> constexpr int act_code<uint16_t>() { return 0; }
template <> constexpr int act_code<float>() { return 1; }

// The attention's output [T, QD] float32 as the o projection reads it: rounded to bfloat16 into a, or itself.
inline const uint16_t* attn_act(const float* attn, uint16_t* a, int64_t n) {
    #pragma omp parallel for schedule(static) if (n >= 32768)
    for (int64_t i = 0; i < n; ++i) a[i] = prefixserve_bf16::float_to_bf16(attn[i]);
    return a;
}
inline const float* attn_act(const float* attn, float* a, int64_t n) {
    (void)a; (void)n;
    return attn;
}

template <typename A>
int layer_pre(const PrefixserveLayerKernels* k, float* x, const A* r, const float* w_in, float eps, const void* w,
              const void* sz, const float* cos, const float* sin, A* h, A* qkv, float* q, float* kk, float* v, int T,
              int H, int Hq, int Hkv, int D) {
    const int N = (Hq + 2 * Hkv) * D;
    if (r == nullptr) k->rms_norm(x, H, w_in, eps, h, H, T, H, act_code<A>());
    else k->add_rms_norm(x, H, r, H, w_in, eps, h, H, T, H, act_code<A>());
    const int rc = gemm(k, h, H, w, sz, qkv, N, T, N, H);
    if (rc != 0) return rc;
    k->qkv_rope(qkv, N, cos, sin, q, kk, v, T, Hq, Hkv, D, act_code<A>());
    return 0;
}

template <typename A>
int layer_post(const PrefixserveLayerKernels* k, const float* attn, A* r, const void* o_w, const void* o_sz,
               const float* w_post, float eps, const void* gu_w, const void* gu_sz, const void* dn_w,
               const void* dn_sz, float* x, A* a, A* o, A* h, A* gu, A* act, int T, int H, int QD, int I) {
    int rc = gemm(k, attn_act(attn, a, static_cast<int64_t>(T) * QD), QD, o_w, o_sz, o, H, T, H, QD);
    if (rc != 0) return rc;
    k->add_rms_norm(x, H, o, H, w_post, eps, h, H, T, H, act_code<A>());
    if ((rc = gemm(k, h, H, gu_w, gu_sz, gu, 2 * I, T, 2 * I, H)) != 0) return rc;
    k->silu_mul(gu, 2 * I, act, I, T, I, act_code<A>());
    return gemm(k, act, I, dn_w, dn_sz, r, H, T, H, I);
}

}  // namespace

extern "C" {

// x [T, H] float32 (+= r, in place); r: the previous layer's output [T, H] bfloat16, or null (the first layer);
// w4 / sz: the qkv projection as int4_gemm.py pack_bf16 made it; cos, sin [T, D]; h [T, H], qkv [T, (Hq + 2 Hkv) D]
// bfloat16 scratch; q [T, Hq, D], k, v [T, Hkv, D] float32 out. Returns gemm_bf16's code (0: done).
int prefixserve_layer_pre(const PrefixserveLayerKernels* k, float* x, const uint16_t* r,
                          const float* w_in, float eps, const uint8_t* w4, const uint16_t* sz,
                          const float* cos, const float* sin, uint16_t* h, uint16_t* qkv, float* q, float* kk,
                          float* v, int T, int H, int Hq, int Hkv, int D) {
    return layer_pre<uint16_t>(k, x, r, w_in, eps, w4, sz, cos, sin, h, qkv, q, kk, v, T, H, Hq, Hkv, D);
}

// The same with float32 activations: r, h, qkv float32; w / sz: the qkv projection as int4_gemm.py pack made it, for
// gemm_f32. Returns gemm_f32's code (0: done).
int prefixserve_layer_pre_f32(const PrefixserveLayerKernels* k, float* x, const float* r,
                              const float* w_in, float eps, const uint32_t* w, const float* sz,
                              const float* cos, const float* sin, float* h, float* qkv, float* q, float* kk,
                              float* v, int T, int H, int Hq, int Hkv, int D) {
    return layer_pre<float>(k, x, r, w_in, eps, w, sz, cos, sin, h, qkv, q, kk, v, T, H, Hq, Hkv, D);
}

// attn: the attention's output [T, QD] float32; r [T, H] bfloat16 out (the next layer's r); the o, gate_up and down
// projections and the norm's weight; x [T, H] float32 (+= o, in place); a [T, QD], o, h [T, H], gu [T, 2 I], act
// [T, I] bfloat16 scratch. Returns the first gemm_bf16 code that is not 0, else 0.
int prefixserve_layer_post(const PrefixserveLayerKernels* k, const float* attn, uint16_t* r,
                           const uint8_t* o_w4, const uint16_t* o_sz, const float* w_post, float eps,
                           const uint8_t* gu_w4, const uint16_t* gu_sz, const uint8_t* dn_w4, const uint16_t* dn_sz,
                           float* x, uint16_t* a, uint16_t* o, uint16_t* h, uint16_t* gu, uint16_t* act,
                           int T, int H, int QD, int I) {
    return layer_post<uint16_t>(k, attn, r, o_w4, o_sz, w_post, eps, gu_w4, gu_sz, dn_w4, dn_sz, x, a, o, h, gu, act,
                                T, H, QD, I);
}

// The same with float32 activations (the o projection reads attn itself; a is not written). Returns the first
// gemm_f32 code that is not 0, else 0.
int prefixserve_layer_post_f32(const PrefixserveLayerKernels* k, const float* attn, float* r,
                               const uint32_t* o_w, const float* o_sz, const float* w_post, float eps,
                               const uint32_t* gu_w, const float* gu_sz, const uint32_t* dn_w, const float* dn_sz,
                               float* x, float* a, float* o, float* h, float* gu, float* act, int T, int H, int QD,
                               int I) {
    return layer_post<float>(k, attn, r, o_w, o_sz, w_post, eps, gu_w, gu_sz, dn_w, dn_sz, x, a, o, h, gu, act,
                             T, H, QD, I);
}

// One layer's weights (kernels/cpu/layers.py BoundLayer): each projection's packed weights and scales, as the step's
// GEMM takes them (pack_bf16's for gemm_bf16, pack's for gemm_f32).
struct PrefixserveBoundLayer {
    const float* w_in; float eps_in; const void* qkv_w; const void* qkv_sz;
    const void* o_w; const void* o_sz; const float* w_post; float eps_post;
    const void* gu_w; const void* gu_sz; const void* dn_w; const void* dn_sz;
};

// What every layer's call of the paged decode kernel shares in a decode step (kernels/cpu/layers.py
// LayerHalves.decode_layers): its plan, the caches of layer 0 and the bytes from one layer's caches to the next.
struct PrefixserveDecodeStep {
    int (*decode)(const float* q, const float* k, const float* v, int64_t k_tok, int64_t k_head, int64_t v_tok,
                  int64_t v_head, const int64_t* rows, void* kc, void* vc, const int32_t* bt, int64_t bt_stride,
                  const int32_t* lens, float* out, int S, int H, int Hkv, int D, int B, float scale, int64_t kc_blk,
                  int64_t kc_tok, int64_t kc_head, int64_t vc_blk, int64_t vc_tok, int64_t vc_head, int kv_dtype,
                  const int32_t* items, int n_items, const int32_t* members);
    const int64_t* rows; const int32_t* bt; int64_t bt_stride; const int32_t* lens;
    int B; float scale;
    int64_t kc_blk, kc_tok, kc_head, vc_blk, vc_tok, vc_head; int kv_dtype;
    const int32_t* items; int n_items; const int32_t* members;
    char* kc; char* vc; int64_t kc_layer, vc_layer;
};

}  // extern "C"

namespace {

template <typename A>
int layers_decode(const PrefixserveLayerKernels* k, const PrefixserveDecodeStep* d, const PrefixserveBoundLayer* layers,
                  int n, float* x, const float* cos, const float* sin, A* h, A* qkv, float* q, float* kk, float* v,
                  float* out, A* a, A* o, A* gu, A* act, A* r0, A* r1, int T, int H, int Hq, int Hkv, int D, int I) {
    const A* r = nullptr;
    for (int i = 0; i < n; ++i) {
        const PrefixserveBoundLayer& L = layers[i];
        int rc = layer_pre<A>(k, x, r, L.w_in, L.eps_in, L.qkv_w, L.qkv_sz, cos, sin, h, qkv, q, kk, v, T, H, Hq, Hkv,
                              D);
        if (rc != 0) return rc;
        rc = d->decode(q, kk, v, static_cast<int64_t>(Hkv) * D, D, static_cast<int64_t>(Hkv) * D, D, d->rows,
                       d->kc + i * d->kc_layer, d->vc + i * d->vc_layer, d->bt, d->bt_stride, d->lens, out, T, Hq, Hkv,
                       D, d->B, d->scale, d->kc_blk, d->kc_tok, d->kc_head, d->vc_blk, d->vc_tok, d->vc_head,
                       d->kv_dtype, d->items, d->n_items, d->members);
        if (rc != 0) return rc;
        A* ro = i % 2 == 0 ? r0 : r1;
        rc = layer_post<A>(k, out, ro, L.o_w, L.o_sz, L.w_post, L.eps_post, L.gu_w, L.gu_sz, L.dn_w, L.dn_sz, x, a, o,
                           h, gu, act, T, H, Hq * D, I);
        if (rc != 0) return rc;
        r = ro;
    }
    return 0;
}

}  // namespace

extern "C" {

// The n layers of a decode step of T sequences: for each, pre, the decode kernel (q, k, v in, out [T, Hq, D]
// float32), post; r0 / r1 take the layers' outputs in turn (layer i's in r0 if i is even). Returns 0, or the first
// code that is not.
int prefixserve_layers_decode(const PrefixserveLayerKernels* k, const PrefixserveDecodeStep* d,
                              const PrefixserveBoundLayer* layers, int n, float* x, const float* cos, const float* sin,
                              uint16_t* h, uint16_t* qkv, float* q, float* kk, float* v, float* out, uint16_t* a,
                              uint16_t* o, uint16_t* gu, uint16_t* act, uint16_t* r0, uint16_t* r1, int T, int H,
                              int Hq, int Hkv, int D, int I) {
    return layers_decode<uint16_t>(k, d, layers, n, x, cos, sin, h, qkv, q, kk, v, out, a, o, gu, act, r0, r1, T, H,
                                   Hq, Hkv, D, I);
}

// The same with float32 activations (h ... r1 float32; the layers' weights for gemm_f32).
int prefixserve_layers_decode_f32(const PrefixserveLayerKernels* k, const PrefixserveDecodeStep* d,
                                  const PrefixserveBoundLayer* layers, int n, float* x, const float* cos,
                                  const float* sin, float* h, float* qkv, float* q, float* kk, float* v, float* out,
                                  float* a, float* o, float* gu, float* act, float* r0, float* r1, int T, int H,
                                  int Hq, int Hkv, int D, int I) {
    return layers_decode<float>(k, d, layers, n, x, cos, sin, h, qkv, q, kk, v, out, a, o, gu, act, r0, r1, T, H, Hq,
                                Hkv, D, I);
}

}  // extern "C"
