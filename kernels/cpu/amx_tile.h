// AMX tiles for the prefill attention's AmxTiles (paged_prefill.cpp): eight tile registers of 16 rows x 64 bytes
// and TDPBF16PS (C[m][n] += A[m] . B[:, n] over bf16 pairs, float32 sums). Two implementations of one interface:
//   real       an AMX build (-mamx-tile -mamx-bf16): the instructions, after the process asked Linux for the
//              tile state (arch_prctl ARCH_REQ_XCOMP_PERM, once) and each thread loaded the configuration;
//   emulated   any build with AVX-512 BF16 (PREFIXSERVE_BF16): the instructions' documented semantics in
//              memory (Intel SDM, TDPBF16PS: per row, pair products of bf16 widened to float32 added in pair
//              order, k outer), so that the tests run the AMX tiles' logic (layouts, strides, masks, the
//              softmax between the two products) on CPUs without AMX. Never chosen by the engine: the prefill
//              call takes it only when asked (`tiles` = 2 on a build without AMX).
// Tile numbers are literals (the instructions take immediates): AMX_LOAD(3, p, stride) and so on.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PREFIXSERVE_AMX 1
#endif

namespace prefixserve_amx {

constexpr int ROWS = 16, ROW_BYTES = 64;     // every tile this kernel uses: 16 rows x 64 bytes

struct alignas(64) Config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

inline Config full_tiles() {
    Config c;
    std::memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
        c.colsb[t] = ROW_BYTES;
        c.rows[t] = ROWS;
    }
    return c;
}

#if defined(PREFIXSERVE_AMX)
// Linux hands a process the AMX tile state only on request (XFEATURE_XTILEDATA = 18); false: no AMX here.
inline bool available() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
    return ok;
}
inline void configure() {
    static const Config c = full_tiles();
    _tile_loadconfig(&c);
}
inline void release() { _tile_release(); }
#define AMX_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define AMX_STORE(t, p, stride) _tile_stored(t, p, stride)
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#else
struct Emulated {
    alignas(64) uint8_t t[8][ROWS][ROW_BYTES];
};
inline Emulated& tiles() {
    thread_local Emulated e;
    return e;
}
inline bool available() { return true; }
inline void configure() {}
inline void release() {}
inline void load(int t, const void* p, int64_t stride) {
    for (int r = 0; r < ROWS; ++r) std::memcpy(tiles().t[t][r], static_cast<const uint8_t*>(p) + r * stride, ROW_BYTES);
}
inline void store(int t, void* p, int64_t stride) {
    for (int r = 0; r < ROWS; ++r) std::memcpy(static_cast<uint8_t*>(p) + r * stride, tiles().t[t][r], ROW_BYTES);
}
inline void zero(int t) { std::memset(tiles().t[t], 0, sizeof tiles().t[t]); }
inline float widen(uint16_t x) {
    const uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
inline void dp(int c, int a, int b) {
    Emulated& e = tiles();
    for (int m = 0; m < ROWS; ++m) {
        float acc[16];
        std::memcpy(acc, e.t[c][m], sizeof acc);
        uint16_t am[32];
        std::memcpy(am, e.t[a][m], sizeof am);
        for (int k = 0; k < 16; ++k) {
            uint16_t bk[32];
            std::memcpy(bk, e.t[b][k], sizeof bk);
            const float a0 = widen(am[2 * k]), a1 = widen(am[2 * k + 1]);
            for (int n = 0; n < 16; ++n) {
                acc[n] += a0 * widen(bk[2 * n]);
                acc[n] += a1 * widen(bk[2 * n + 1]);
            }
        }
        std::memcpy(e.t[c][m], acc, sizeof acc);
    }
}
#define AMX_LOAD(t, p, stride) prefixserve_amx::load(t, p, stride)
#define AMX_STORE(t, p, stride) prefixserve_amx::store(t, p, stride)
#define AMX_ZERO(t) prefixserve_amx::zero(t)
#define AMX_DP(c, a, b) prefixserve_amx::dp(c, a, b)
#endif

}  // namespace prefixserve_amx
