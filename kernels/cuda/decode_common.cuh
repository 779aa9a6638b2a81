// The device code shared by the persistent decode-layer kernels (decode_layer.cu: the MLP half; decode_attn.cu: the
// attention half): the CTA's warp roles and ring, activation values and the mma-fragment input layout, the grid-wide
// counters, the balanced unit ranges, the LoRA shrink units / h sums / expand, the fix-up's partial sums and the
// 1/rms of a token. Both kernels include it (nvcc_build hashes it into both libraries); docs/decode.md ("The
// persistent decode layer") describes the machinery.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>
#include <type_traits>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include "fp4_frag.cuh"

namespace qerl_dl {

using namespace qerl;  // the fragment and pipeline helpers of fp4_frag.cuh

#ifndef QERL_DL_S
#define QERL_DL_S 4
#endif
#ifndef QERL_DL_MINB
#define QERL_DL_MINB 2
#endif
constexpr int NW = 8;            // warps per CTA: NG GEMM warps and one LoRA warp
constexpr int NG = NW - 1;       // the GEMM warps (0 .. NG-1)
constexpr int LW = NW - 1;       // the LoRA warp: the three shrinks, beside the GEMMs
constexpr int S = QERL_DL_S;     // cp.async ring stages per warp (a power of two: slots by mask)
static_assert(S >= 2 && (S & (S - 1)) == 0, "QERL_DL_S: a power of two");
constexpr int MINB = QERL_DL_MINB;
constexpr int PF_UNITS = 8;      // units of its next range a warp prefetches into L2 before a wait

struct Gemm {
  const uint8_t* w;   // resident repacked weight [N, K/2], tiled (64-row groups)
  const uint8_t* s;   // checkpoint block scales: E4M3 [N, K/16] (NVFP4) or E8M0 [N, K/32] (MXFP4)
  const float* gs;    // NVFP4 global scale [1] (MXFP4: unused)
  const uint16_t* a;  // LoRA A_cat [R, K], activation dtype (null: no LoRA)
  const uint16_t* b;  // LoRA B_blk [N, R], scaling folded in
  float* hp;          // shrink partials [nseg][M][R] fp32
  uint16_t* hg;       // h = x @ A^T [M][R], activation dtype (rounded like the present path's shrink output)
  float4* part;       // GEMM partials [blocks][pmax][halves][MT][32] (mma fragment order)
  unsigned* bcnt;     // [blocks] partials counted per block; zero between launches
  int N, K, R, kseg, nseg, pmax;
  int spc;            // scale bytes per 128-wide chunk of a row: 8 (NVFP4), 4 (MXFP4), 2 (INT4), 0 (W8: per row)
  int shift;          // MXFP4's per-tensor exponent shift F (fp4.py); 0 for the others
  int code;           // the tile decode: DEC_FP4, DEC_INT4, DEC_INT8, DEC_FP8
};
// The tile decodes (a kernel's template parameter). The 8-bit ones read the checkpoint's row-major [N, K] bytes as
// they are (no repack: see w8_mma) and scale each output row by its per-channel scale after the sums.
constexpr int DEC_FP4 = 0, DEC_INT4 = 1, DEC_INT8 = 2, DEC_FP8 = 3;

// ---- the formats: the FP4 pair differs only in the block scales (the codes, layout and mma are the same); INT4 has
// the same layout and nibble order, its own code decode (fp4_frag.cuh's decode_slice_i4) and one 16-bit scale (the
// activation dtype's) per row and 128-wide group
// One row's scales of one chunk into the ring: 8 bytes (NVFP4), 4 (MXFP4, into the slot's low word), or INT4's 2
// bytes as the aligned word that holds them, with their bit offset in that word in the slot's high word (cp.async
// moves 4, 8 or 16 aligned bytes; a row's scales start 2-byte aligned when K / 128 is odd)
__device__ __forceinline__ void cp_scales(void* dst, const uint8_t* src, int spc, uint64_t pol) {
  if (spc == 8) {
    cp_async8(dst, src, pol);
  } else if (spc == 4) {
    cp_async4(dst, src, pol);
  } else {
    const uintptr_t at = reinterpret_cast<uintptr_t>(src);
    cp_async4(dst, reinterpret_cast<const void*>(at & ~(uintptr_t)3), pol);
    reinterpret_cast<uint32_t*>(dst)[1] = (uint32_t)(at & 2) << 3;
  }
}
// Slices i0 and i0 + 1 of a chunk row's raw scales as packed 16-bit scale pairs (fp4_frag.cuh's scale_pair; INT4:
// the group's scale in both halves of both pairs).
template <bool BF16>
__device__ __forceinline__ uint2 scale_pairs2(uint2 raw, int i0, int spc, int shift) {
  if (spc == 8) return make_uint2(scale_pair<true, BF16>(raw, i0, 0), scale_pair<true, BF16>(raw, i0 + 1, 0));
  if (spc == 2) {
    const uint32_t s = (raw.x >> raw.y) & 0xffffu, pr = s | (s << 16);
    return make_uint2(pr, pr);
  }
  return make_uint2(scale_pair<false, BF16>(raw, i0, shift), scale_pair<false, BF16>(raw, i0 + 1, shift));
}
// The factor of a GEMM's fp32 sums: 2^8 / global scale (NVFP4), 2^-F (MXFP4), as fp4_gemm.cu's out_alpha; 1 (INT4:
// its weights are decoded at their value).
__device__ __forceinline__ float gemm_alpha(int spc, const float* gs, int shift) {
  return spc == 8 ? 256.0f / *gs : spc == 2 ? 1.0f : exp2f((float)(-shift));
}

// ---- activation values ------------------------------------------------------------------------------------------
template <bool BF16>
__device__ __forceinline__ float f16(uint16_t v) {
  if constexpr (BF16) {
    return __uint_as_float((uint32_t)v << 16);
  } else {
    return __half2float(__ushort_as_half(v));
  }
}
template <bool BF16>
__device__ __forceinline__ uint16_t r16(float v) {
  if constexpr (BF16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  } else {
    return __half_as_ushort(__float2half_rn(v));
  }
}
__device__ __forceinline__ uint32_t ld32(const uint16_t* p) {  // coherent: p may have been written in this launch
  return *reinterpret_cast<const uint32_t*>(p);
}

// The mma B fragments of lane (g, q) for the 8 tokens of tile t and 32-wide slice kb of an input of K columns are
// one uint4 (b_frags of the u32 pairs at 32kb + 8j + 2q, j = 0..3, of token 8t + g), stored at
// xp[(t * K/32 + kb) * 32 + lane]: the GEMM stages read one 16-byte load per slice instead of four loads and four
// byte permutes. Element (tok, k) of the input sits in that uint4's u32 (j even: x, j odd: y; +2 for odd k) half j/2.
__device__ __forceinline__ size_t xp_index(int K, int t, int kb, int lane) {
  return ((size_t)t * (K >> 5) + kb) * 32 + lane;
}
__device__ __forceinline__ uint16_t* xp_element(uint4* xp, int K, int tok, int k) {
  const int w = k & 31, j = w >> 3, q = (w & 7) >> 1, word = (j & 1) + 2 * (w & 1);
  uint4* at = xp + xp_index(K, tok >> 3, k >> 5, (tok & 7) * 4 + q);
  return reinterpret_cast<uint16_t*>(reinterpret_cast<uint32_t*>(at) + word) + (j >> 1);
}

// ---- memory pipeline and grid-wide counters ---------------------------------------------------------------------
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
// This CTA's 1/C share of [p, p + bytes) into L2 (16-byte aligned pieces of at most 4 KiB, one per thread).
__device__ __forceinline__ void prefetch_share(const void* p, size_t bytes, int c, int C) {
  if (p == nullptr || bytes == 0) return;
  const size_t lo = (bytes * c / C) & ~(size_t)15, hi = c + 1 == C ? bytes : (bytes * (c + 1) / C) & ~(size_t)15;
  const unsigned char* b = static_cast<const unsigned char*>(p);
  for (size_t off = lo + (size_t)threadIdx.x * 4096; off < hi; off += (size_t)blockDim.x * 4096) {
    const size_t n = hi - off < 4096 ? hi - off : 4096;
    if (n >= 16) prefetch_l2(b + off, (unsigned)(n & ~(size_t)15));
  }
}

// Grid-wide phases: a part of a phase is written, made visible at GPU scope, then counted on the phase's counter; a
// consumer polls the counter with acquire loads until it holds the grid size. The GEMM warps of a CTA count and wait
// as one (named barrier 1), the LoRA warp on its own.
__device__ __forceinline__ void poll(const unsigned* c, unsigned n) {
  unsigned v;
  for (;;) {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
    if (v >= n) break;
    __nanosleep(32);
  }
}
__device__ __forceinline__ void bar_gemm() { asm volatile("bar.sync 1, %0;" ::"n"(NG * 32) : "memory"); }
__device__ __forceinline__ void arrive_gemm(unsigned* c) {
  bar_gemm();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(c, 1u);
  }
}
__device__ __forceinline__ void wait_gemm(const unsigned* c, unsigned n) {
  if (threadIdx.x == 0) poll(c, n);
  bar_gemm();
}
__device__ __forceinline__ void arrive_warp(unsigned* c) {
  __threadfence();
  __syncwarp();
  if ((threadIdx.x & 31) == 0) atomicAdd(c, 1u);
}
__device__ __forceinline__ void wait_warp(const unsigned* c, unsigned n) {
  if ((threadIdx.x & 31) == 0) poll(c, n);
  __syncwarp();
}

// ---- shared memory ----------------------------------------------------------------------------------------------
// W8: 8-bit weights, a unit of 2 KiB (16 rows x 128 bytes), [S][NG][4 pieces][32 lanes] uint4 in the ring
template <int MT, bool W8 = false>
struct Smem {
  static constexpr int RING = S * NG * (W8 ? 2048 : 1024);  // [S][NG][2 rows][32 lanes] uint4 (W8: 4 pieces)
  static constexpr int SC = S * NG * 16 * 8;            // [S][NG][16 rows] uint2 block scales
  static constexpr int CS = NG * 16 * 16;               // [NG][16 rows] uint4: the unit's scale pairs, converted
  static constexpr int RS = 2 * 16 * 4;                 // [2][16] 1/rms per token (GEMM warps, LoRA warp)
  static constexpr int BYTES = RING + SC + CS + RS;
};

// Stage geometry: blocks (gate/up: pairs), units per block, 128-wide K chunks, and the warps that share its units:
// all W of the grid, or one per unit where the stage has fewer (so that every sharing warp holds at least one unit
// and a block's partials come from consecutive warps). 32-bit: the host checks units * W < 2^31.
struct Geo {
  int nb, u, kc, t, we;
};
// Warp v's range of a stage's units: [first(v), first(v + 1)) (empty for v >= we); the warp whose range holds unit x.
__device__ __forceinline__ int range_first(const Geo& G, int v) {
  return v >= G.we ? G.t : (int)((unsigned)v * (unsigned)G.t / (unsigned)G.we);
}
__device__ __forceinline__ int warp_of(const Geo& G, int x) {
  return (int)(((unsigned)(x + 1) * (unsigned)G.we + (unsigned)G.t - 1u) / (unsigned)G.t) - 1;
}

// ---- shrinks: h[M, R] = x @ A^T, as fp32 partials per (16 rank rows, K segment) unit over all warps of the grid ---
// The units first, first + stride, ... of an A [R, K] (K segment = kseg 128-wide chunks, nseg of them): fp32 partials
// [seg][M][R] written to hp; xpair(tok, k) gives the u32 of x's (tok, k), (tok, k + 1) (0 past M), so that each
// kernel forms its input on the fly with the bits its own phases write.
template <int MT, bool BF16, typename XPair>
__device__ __forceinline__ void shrink_run(const uint16_t* A, float* hp, int K, int R, int kseg, int nseg, int M,
                                           int first, int stride, XPair xpair) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int nrk = (R + 15) >> 4, units = nrk * nseg, KC = K >> 7;
  for (int u = first; u < units; u += stride) {
    const int rk = u % nrk, seg = u / nrk;
    const int r0 = rk * 16;
    const bool hi = r0 + 8 < R;
    const uint16_t* a0p = A + (size_t)(r0 + g) * K + 2 * q;
    const uint16_t* a1p = a0p + (size_t)8 * K;
    float acc[MT][4];
#pragma unroll
    for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    const int c1 = (seg + 1) * kseg < KC ? (seg + 1) * kseg : KC;
#pragma unroll 4
    for (int k0 = seg * kseg * 128; k0 < c1 * 128; k0 += 16) {
      const uint32_t a0 = __ldg(reinterpret_cast<const unsigned*>(a0p + k0));
      const uint32_t a2 = __ldg(reinterpret_cast<const unsigned*>(a0p + k0 + 8));
      const uint32_t a1 = hi ? __ldg(reinterpret_cast<const unsigned*>(a1p + k0)) : 0u;
      const uint32_t a3 = hi ? __ldg(reinterpret_cast<const unsigned*>(a1p + k0 + 8)) : 0u;
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        const int tok = t * 8 + g;
        const uint32_t b0 = xpair(tok, k0 + 2 * q);
        const uint32_t b1 = xpair(tok, k0 + 8 + 2 * q);
        mma<BF16>(acc[t], a0, a1, a2, a3, b0, b1);
      }
    }
#pragma unroll
    for (int t = 0; t < MT; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = t * 8 + 2 * q + (e & 1), r = r0 + g + (e >> 1) * 8;
        if (tok < M && r < R) hp[((size_t)seg * M + tok) * R + r] = acc[t][e];
      }
    }
  }
}

// The RMSNorm output pair x = rnd(w * rnd(h * r)) of h pair hv and weight pair wv (the present path's roundings).
template <bool BF16>
__device__ __forceinline__ uint32_t norm_pair(uint32_t hv, uint32_t wv, float r) {
  const uint16_t lo = r16<BF16>(__fmul_rn(f16<BF16>((uint16_t)(wv & 0xffffu)),
                                          f16<BF16>(r16<BF16>(__fmul_rn(f16<BF16>((uint16_t)(hv & 0xffffu)), r)))));
  const uint16_t hi = r16<BF16>(__fmul_rn(f16<BF16>((uint16_t)(wv >> 16)),
                                          f16<BF16>(r16<BF16>(__fmul_rn(f16<BF16>((uint16_t)(hv >> 16)), r)))));
  return (uint32_t)lo | ((uint32_t)hi << 16);
}

// 1/rms of token tok from the per-16-column-block sums of squares ss [H/16][M]: lane l sums blocks l, l+32, ... in
// order (loaded 8 at a time, so the L2 round trips overlap), then a butterfly over the 32 lanes. Every lane returns
// it.
__device__ __forceinline__ float inv_rms_of(const float* ss, int H, int M, float eps, int tok, int lane) {
  const int nb = H >> 4;
  float s2 = 0.f;
  for (int b0 = lane; b0 < nb; b0 += 8 * 32) {
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = b0 + 32 * i < nb ? __ldcg(ss + (size_t)(b0 + 32 * i) * M + tok) : 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (b0 + 32 * i < nb) s2 = __fadd_rn(s2, v[i]);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s2 = __fadd_rn(s2, __shfl_xor_sync(0xffffffffu, s2, off));
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(s2, (float)H), eps)));
}

// A group's h = (sum of its shrink partials hp [nseg][n] in segment order), rounded to the activation dtype: this
// CTA's 1/C share of its n = M x R values, by one warp.
template <bool BF16>
__device__ __forceinline__ void sum_h_share(const float* hp, uint16_t* hg, int nseg, int n, int c, int C) {
  const int hi = (int)((long long)(c + 1) * n / C);
  for (int i = (int)((long long)c * n / C) + (threadIdx.x & 31); i < hi; i += 32) {
    float v = 0.f;
#pragma unroll 4
    for (int s = 0; s < nseg; ++s) v = __fadd_rn(v, __ldcg(hp + (size_t)s * n + i));
    hg[i] = r16<BF16>(v);
  }
}

// launch: coherent loads) operand B.
template <int MT, bool BF16>
__device__ __forceinline__ void lora_expand(float (&v)[MT][4], const uint16_t* B, int R, int row0, const uint16_t* hg,
                                            int M, int g, int q) {
  const uint16_t* b0 = B + (size_t)(row0 + g) * R + 2 * q;
  const uint16_t* b1 = b0 + (size_t)8 * R;
#pragma unroll 4
  for (int r0 = 0; r0 < R; r0 += 16) {
    const bool hi = r0 + 8 < R;
    const uint32_t a0 = __ldg(reinterpret_cast<const unsigned*>(b0 + r0));
    const uint32_t a1 = __ldg(reinterpret_cast<const unsigned*>(b1 + r0));
    const uint32_t a2 = hi ? __ldg(reinterpret_cast<const unsigned*>(b0 + r0 + 8)) : 0u;
    const uint32_t a3 = hi ? __ldg(reinterpret_cast<const unsigned*>(b1 + r0 + 8)) : 0u;
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      const uint16_t* hr = hg + (size_t)(t * 8 + g) * R + r0 + 2 * q;
      const bool live = t * 8 + g < M;
      const uint32_t x0 = live ? ld32(hr) : 0u;
      const uint32_t x1 = live && hi ? ld32(hr + 8) : 0u;
      mma<BF16>(v[t], a0, a1, a2, a3, x0, x1);
    }
  }
}

// Sum of a block's np partials of one half in index order, x alpha (fragment positions of this lane).
template <int MT>
__device__ __forceinline__ void sum_block(float (&v)[MT][4], const float4* slot0, int halves, int half, int np,
                                          float alpha, int lane) {
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    float4 s4 = __ldcg(slot0 + (half * MT + t) * 32 + lane);
    for (int i = 1; i < np; ++i) {
      const float4 o = __ldcg(slot0 + ((size_t)(i * halves + half) * MT + t) * 32 + lane);
      s4.x = __fadd_rn(s4.x, o.x);
      s4.y = __fadd_rn(s4.y, o.y);
      s4.z = __fadd_rn(s4.z, o.z);
      s4.w = __fadd_rn(s4.w, o.w);
    }
    v[t][0] = __fmul_rn(s4.x, alpha);
    v[t][1] = __fmul_rn(s4.y, alpha);
    v[t][2] = __fmul_rn(s4.z, alpha);
    v[t][3] = __fmul_rn(s4.w, alpha);
  }
}


// W8's per-channel scale on a block's sums: v[t][e] (row row0 + g + 8 (e >> 1)) times its row's 16-bit scale in
// fp32, as the per-GEMM W8 kernel scales its fp32 sums.
template <int MT, bool BF16>
__device__ __forceinline__ void row_scale(float (&v)[MT][4], const uint8_t* s, int row0, int g) {
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(s);
  const float s0 = f16<BF16>(sc[row0 + g]), s1 = f16<BF16>(sc[row0 + g + 8]);
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    v[t][0] = __fmul_rn(v[t][0], s0);
    v[t][1] = __fmul_rn(v[t][1], s0);
    v[t][2] = __fmul_rn(v[t][2], s1);
    v[t][3] = __fmul_rn(v[t][3], s1);
  }
}

// ---- 8-bit tiles (W8: INT8 or FP8 E4M3 codes, [N, K] row-major as the checkpoint holds them) ----------------------
// An mma's k order may be any permutation that A and B share. Lane (g, q) holds bytes [32q, 32q + 32) of its rows
// g and g + 8 of a 128-wide chunk, as 8 u32 words; mma j (0..7) of the chunk takes word j: its bytes 0-1 as the A
// pair of logical k = 2q, 2q + 1 and bytes 2-3 as k = 2q + 8, 2q + 9, i.e. physical k = 32q + 4j + (0, 1 | 2, 3);
// the B fragments are then x's u32 pairs 2j and 2j + 1 of the lane's 32 contiguous x values of that chunk. No
// repack, no fragment-order copy of x: rows are read as they are.
// Two codes (bytes lo, lo + 1 of w) -> a 16-bit pair of their exact values.
template <bool BF16, int DEC>
__device__ __forceinline__ uint32_t w8_pair(uint32_t w, int lo) {
  if constexpr (DEC == DEC_INT8) {
    const uint32_t u = w ^ 0x80808080u;  // c + 128, unsigned
    if constexpr (BF16) {  // 2^23 + u exactly in fp32, minus 2^23 + 128: c, exact; packed (c fits bf16's 8 bits)
      const float f0 = __int_as_float((int)prmt(u, 0x4B000000u, 0x7650u + (uint32_t)lo)) - 8388736.0f;
      const float f1 = __int_as_float((int)prmt(u, 0x4B000000u, 0x7651u + (uint32_t)lo)) - 8388736.0f;
      uint32_t d;
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(f1), "f"(f0));
      return d;
    } else {  // 1024 + u exactly in fp16 (ulp 1), minus 1152
      const uint32_t h = prmt(u, 0x64646464u, lo == 0 ? 0x5140u : 0x5342u);
      uint32_t d;
      asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(h), "r"(0x64806480u));
      return d;
    }
  } else {  // FP8 E4M3: cvt to f16x2, exact; bf16: the f16 bits moved into bf16's fields (x 2^-112), times 2^112
    uint32_t h;
    const unsigned short two = (unsigned short)(w >> (8 * lo));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(two));  // .x (low half) from the low byte
    if constexpr (BF16) {
      const uint32_t b = (h & 0x80008000u) | ((h & 0x7FFF7FFFu) >> 3);
      uint32_t d;
      asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(b), "r"(0x77807780u), "r"(0x80008000u));
      return d;
    } else {
      return h;
    }
  }
}
// mma j of a chunk for MT token tiles: A from words wa (row g) and wb (row g + 8), B from the tiles' x words.
template <int MT, bool BF16, int DEC>
__device__ __forceinline__ void w8_mma(float (&acc)[MT][4], uint32_t wa, uint32_t wb, const uint32_t (&b0)[MT],
                                       const uint32_t (&b1)[MT]) {
  const uint32_t a0 = w8_pair<BF16, DEC>(wa, 0), a2 = w8_pair<BF16, DEC>(wa, 2);
  const uint32_t a1 = w8_pair<BF16, DEC>(wb, 0), a3 = w8_pair<BF16, DEC>(wb, 2);
#pragma unroll
  for (int t = 0; t < MT; ++t) mma<BF16>(acc[t], a0, a1, a2, a3, b0[t], b1[t]);
}

// The launch's end: the last CTA (every other one is past its last wait) zeroes the N counters for the next launch,
// so a CUDA graph replays the kernel with no reset kernel. cnt[end] counts the CTAs that got here.
template <int N>
__device__ __forceinline__ void end_of_launch(unsigned* cnt, int end) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(cnt + end, 1u) == gridDim.x - 1) {
#pragma unroll
      for (int i = 0; i < N; ++i) atomicExch(cnt + i, 0u);
      __threadfence();
    }
  }
}

// Host side, shared by the persistent kernels: raise one variant's shared-memory limit (outside any graph capture)
// and report how many of its CTAs fit on one SM at once (the grid must not exceed that times the SM count: the
// CTAs wait on each other).
template <typename Kernel>
inline cudaError_t prepare_kernel(Kernel k, int smem, int& ctas_per_sm) {
  cudaError_t e = cudaFuncSetAttribute((const void*)k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm, k, NW * 32, smem);
}

// Every (MT, BF16) variant prepared by prep(integral_constant MT, bool_constant BF16, int& ctas), the occupancy of
// variant (mt, bf16) reported in *ctas_per_sm.
template <typename Prep>
inline int prepare_variants(int mt, int bf16, int* ctas_per_sm, Prep prep) {
  int dummy = 0;
  using one = std::integral_constant<int, 1>;
  using two = std::integral_constant<int, 2>;
  cudaError_t e = prep(one{}, std::true_type{}, mt == 1 && bf16 ? *ctas_per_sm : dummy);
  if (e == cudaSuccess) e = prep(two{}, std::true_type{}, mt == 2 && bf16 ? *ctas_per_sm : dummy);
  if (e == cudaSuccess) e = prep(one{}, std::false_type{}, mt == 1 && !bf16 ? *ctas_per_sm : dummy);
  if (e == cudaSuccess) e = prep(two{}, std::false_type{}, mt == 2 && !bf16 ? *ctas_per_sm : dummy);
  return (int)e;
}

}  // namespace qerl_dl
