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
// GCC's tileloadd / tilestored intrinsics are asm statements that name only the address, not the memory behind it
// (no "memory" clobber): without a compiler barrier, a store into a buffer (the packed K, say) may be emitted after
// the tile load that reads it, or a read of the scores before the tile store that writes them.
#define AMX_LOAD(t, p, stride) do { __asm__ volatile("" ::: "memory"); _tile_loadd(t, p, stride); } while (0)
#define AMX_STORE(t, p, stride) do { _tile_stored(t, p, stride); __asm__ volatile("" ::: "memory"); } while (0)
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

// The two products of an attention tile (TILE = 64 keys) for one block of 16 query rows, in the bf16 tiles' layouts
// (bf16_tile.h pack_q, pack_k, pack_v, pack_p):
// scores: sc[m][16 c + j] (row stride sc_stride floats) = q_m . k_(16 c + j) for the tile's chunks c < chunks (1 to
//         4); q rows of W words (dimension pairs) at q + m q_stride; kt the packed K, [chunk][W][16 keys] words.
//         tmm0-3 the chunks' scores, tmm4 the queries' 32 dimensions, tmm5-7 K.
inline void scores_block(const uint32_t* q, int q_stride, const uint32_t* kt, int W, int chunks, float* sc,
                         int sc_stride) {
    AMX_ZERO(0); AMX_ZERO(1); AMX_ZERO(2); AMX_ZERO(3);
    for (int w0 = 0; w0 < W; w0 += 16) {
        AMX_LOAD(4, q + w0, q_stride * 4);
        AMX_LOAD(5, kt + w0 * 16, 64);
        AMX_DP(0, 4, 5);
        if (chunks > 1) { AMX_LOAD(6, kt + (W + w0) * 16, 64); AMX_DP(1, 4, 6); }
        if (chunks > 2) { AMX_LOAD(7, kt + (2 * W + w0) * 16, 64); AMX_DP(2, 4, 7); }
        if (chunks > 3) { AMX_LOAD(5, kt + (3 * W + w0) * 16, 64); AMX_DP(3, 4, 5); }
    }
    AMX_STORE(0, sc, sc_stride * 4);
    if (chunks > 1) AMX_STORE(1, sc + 16, sc_stride * 4);
    if (chunks > 2) AMX_STORE(2, sc + 32, sc_stride * 4);
    if (chunks > 3) AMX_STORE(3, sc + 48, sc_stride * 4);
}

// values: ot[m][d] (row stride D = 16 NV floats) = sum over the tile's key pairs i < 16 blocks of p_m[i] . vt[i][d];
//         the weights' rows of 32 words (bf16 key pairs) at p + m p_stride; vt the packed V, [pair][NV][16] words,
//         its rows zero from the tile's last pair to 16 blocks. NV even. tmm0-3 four blocks of 16 dimensions, tmm4
//         the weights, tmm5-7 V.
inline void values_block(const uint32_t* p, int p_stride, const uint32_t* vt, int NV, int blocks, float* ot) {
    const int D = 16 * NV;
    for (int v0 = 0; v0 < NV; v0 += 4) {
        AMX_ZERO(0); AMX_ZERO(1); AMX_ZERO(2); AMX_ZERO(3);
        for (int b = 0; b < blocks; ++b) {
            const uint32_t* v = vt + (static_cast<int64_t>(16 * b) * NV + v0) * 16;
            AMX_LOAD(4, p + 16 * b, p_stride * 4);
            AMX_LOAD(5, v, NV * 64);
            AMX_DP(0, 4, 5);
            AMX_LOAD(6, v + 16, NV * 64);
            AMX_DP(1, 4, 6);
            if (v0 + 2 < NV) {
                AMX_LOAD(7, v + 32, NV * 64);
                AMX_DP(2, 4, 7);
                AMX_LOAD(5, v + 48, NV * 64);
                AMX_DP(3, 4, 5);
            }
        }
        AMX_STORE(0, ot + 16 * v0, D * 4);
        AMX_STORE(1, ot + 16 * (v0 + 1), D * 4);
        if (v0 + 2 < NV) {
            AMX_STORE(2, ot + 16 * (v0 + 2), D * 4);
            AMX_STORE(3, ot + 16 * (v0 + 3), D * 4);
        }
    }
}

}  // namespace prefixserve_amx
