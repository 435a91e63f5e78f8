// A decoder layer's work around its attention, in two calls instead of a dozen from Python: the kernels are the
// ones the op layer calls one by one (int4_gemm.cpp gemm_bf16, fused.cpp's norms, RoPE and SiLU), reached
// through the function pointers the launcher passes (kernels/cpu/layers.py), called in the same order on the
// same data, so the result is the same bit for bit. Launcher, buffers and when it applies: kernels/cpu/layers.py.
//
//     pre    h = norm(x (+= r))                  (rms_norm for the first layer, add_rms_norm after)
//            qkv = h @ Wqkv^T;  q, k, v = rope(split(qkv))
//     post   a = bf16(attention out)            (torch's .to(bfloat16): round to nearest even)
//            o = a @ Wo^T;  h = norm(x += o);  r = silu_mul(h @ Wgu^T) @ Wdown^T
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

}  // extern "C"
