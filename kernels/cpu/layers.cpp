// A decoder layer's work around its attention in two calls instead of a dozen from Python, and a decode step's
// layers, attention included, in one: the kernels are the ones the op layer calls one by one (int4_gemm.cpp
// gemm_bf16, fused.cpp's norms, RoPE and SiLU, paged_decode.cpp), reached through the function pointers the launcher
// passes (kernels/cpu/layers.py), called in the same order on the same data, so the result is the same bit for bit.
// Launcher, buffers and when it applies: kernels/cpu/layers.py.
//
//     pre    h = norm(x (+= r))                  (rms_norm for the first layer, add_rms_norm after)
//            qkv = h @ Wqkv^T;  q, k, v = rope(split(qkv))
//     post   a = bf16(attention out)            (torch's .to(bfloat16): round to nearest even)
//            o = a @ Wo^T;  h = norm(x += o);  r = silu_mul(h @ Wgu^T) @ Wdown^T
//
//     layers_decode    every layer of a decode step: pre, the paged decode kernel (write this step's K / V, then
//                      attend: paged_decode.cpp, as CpuAttentionBackend.attend calls it), post
//
// x is the float32 residual stream [T, H], updated in place; everything between the matmuls is bfloat16; every
// buffer is contiguous (row stride = its width).
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
};

// x [T, H] float32 (+= r, in place); r: the previous layer's output [T, H] bfloat16, or null (the first layer);
// w4 / sz: the qkv projection as int4_gemm.py pack_bf16 made it; cos, sin [T, D]; h [T, H], qkv [T, (Hq + 2 Hkv) D]
// bfloat16 scratch; q [T, Hq, D], k, v [T, Hkv, D] float32 out. Returns gemm_bf16's code (0: done).
int prefixserve_layer_pre(const PrefixserveLayerKernels* k, float* x, const uint16_t* r,
                          const float* w_in, float eps, const uint8_t* w4, const uint16_t* sz,
                          const float* cos, const float* sin, uint16_t* h, uint16_t* qkv, float* q, float* kk,
                          float* v, int T, int H, int Hq, int Hkv, int D) {
    const int N = (Hq + 2 * Hkv) * D;
    if (r == nullptr) k->rms_norm(x, H, w_in, eps, h, H, T, H, 0);
    else k->add_rms_norm(x, H, r, H, w_in, eps, h, H, T, H, 0);
    const int rc = k->gemm_bf16(h, H, w4, sz, qkv, N, T, N, H);
    if (rc != 0) return rc;
    k->qkv_rope(qkv, N, cos, sin, q, kk, v, T, Hq, Hkv, D, 0);
    return 0;
}

// attn: the attention's output [T, QD] float32; r [T, H] bfloat16 out (the next layer's r); the o, gate_up and down
// projections and the norm's weight; x [T, H] float32 (+= o, in place); a [T, QD], o, h [T, H], gu [T, 2 I], act
// [T, I] bfloat16 scratch. Returns the first gemm_bf16 code that is not 0, else 0.
int prefixserve_layer_post(const PrefixserveLayerKernels* k, const float* attn, uint16_t* r,
                           const uint8_t* o_w4, const uint16_t* o_sz, const float* w_post, float eps,
                           const uint8_t* gu_w4, const uint16_t* gu_sz, const uint8_t* dn_w4, const uint16_t* dn_sz,
                           float* x, uint16_t* a, uint16_t* o, uint16_t* h, uint16_t* gu, uint16_t* act,
                           int T, int H, int QD, int I) {
    const int64_t n = static_cast<int64_t>(T) * QD;
    #pragma omp parallel for schedule(static) if (n >= 32768)
    for (int64_t i = 0; i < n; ++i) a[i] = prefixserve_bf16::float_to_bf16(attn[i]);
    int rc = k->gemm_bf16(a, QD, o_w4, o_sz, o, H, T, H, QD);
    if (rc != 0) return rc;
    k->add_rms_norm(x, H, o, H, w_post, eps, h, H, T, H, 0);
    if ((rc = k->gemm_bf16(h, H, gu_w4, gu_sz, gu, 2 * I, T, 2 * I, H)) != 0) return rc;
    k->silu_mul(gu, 2 * I, act, I, T, I, 0);
    return k->gemm_bf16(act, I, dn_w4, dn_sz, r, H, T, H, I);
}

// One layer's weights (kernels/cpu/layers.py BoundLayer).
struct PrefixserveBoundLayer {
    const float* w_in; float eps_in; const uint8_t* qkv_w4; const uint16_t* qkv_sz;
    const uint8_t* o_w4; const uint16_t* o_sz; const float* w_post; float eps_post;
    const uint8_t* gu_w4; const uint16_t* gu_sz; const uint8_t* dn_w4; const uint16_t* dn_sz;
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

// The n layers of a decode step of T sequences: for each, pre, the decode kernel (q, k, v in, out [T, Hq, D]
// float32), post; r0 / r1 take the layers' outputs in turn (layer i's in r0 if i is even). Returns 0, or the first
// code that is not.
int prefixserve_layers_decode(const PrefixserveLayerKernels* k, const PrefixserveDecodeStep* d,
                              const PrefixserveBoundLayer* layers, int n, float* x, const float* cos, const float* sin,
                              uint16_t* h, uint16_t* qkv, float* q, float* kk, float* v, float* out, uint16_t* a,
                              uint16_t* o, uint16_t* gu, uint16_t* act, uint16_t* r0, uint16_t* r1, int T, int H,
                              int Hq, int Hkv, int D, int I) {
    const uint16_t* r = nullptr;
    for (int i = 0; i < n; ++i) {
        const PrefixserveBoundLayer& L = layers[i];
        int rc = prefixserve_layer_pre(k, x, r, L.w_in, L.eps_in, L.qkv_w4, L.qkv_sz, cos, sin, h, qkv, q, kk, v, T, H,
                                       Hq, Hkv, D);
        if (rc != 0) return rc;
        rc = d->decode(q, kk, v, static_cast<int64_t>(Hkv) * D, D, static_cast<int64_t>(Hkv) * D, D, d->rows,
                       d->kc + i * d->kc_layer, d->vc + i * d->vc_layer, d->bt, d->bt_stride, d->lens, out, T, Hq, Hkv,
                       D, d->B, d->scale, d->kc_blk, d->kc_tok, d->kc_head, d->vc_blk, d->vc_tok, d->vc_head,
                       d->kv_dtype, d->items, d->n_items, d->members);
        if (rc != 0) return rc;
        uint16_t* ro = i % 2 == 0 ? r0 : r1;
        rc = prefixserve_layer_post(k, out, ro, L.o_w4, L.o_sz, L.w_post, L.eps_post, L.gu_w4, L.gu_sz, L.dn_w4,
                                    L.dn_sz, x, a, o, h, gu, act, T, H, Hq * D, I);
        if (rc != 0) return rc;
        r = ro;
    }
    return 0;
}

}  // extern "C"
