// The MLP half of a decoder layer's decode step as ONE persistent launch (NVFP4 weights, bf16/fp16 activations,
// M <= 16 tokens), for Hopper (sm_90a). Seven GEMM warps per CTA stream the weights through three phases, a grid-wide
// counter between them:
//
//   o GEMM          h1  = h + rnd(attn @ Wo^T + ho Bo^T)    (+ per-row-block sums of h1^2)
//   norm            x2  = rnd(w * rnd(h1 * rs))             (in mma fragment order)
//   gate/up GEMM    act = rnd(rnd(silu(g)) * u),  [g | u] = rnd(x2 @ Wgu^T + hg Bgu^T)
//   down GEMM       out = rnd(act @ Wd^T + hd Bd^T)
//
// while the CTA's eighth warp, the LoRA warp, computes the shrinks beside them: ho = attn @ Ao^T at once, hg once h1
// is complete (x2 formed on the fly), hd once act is; each as fp32 partials per (16 rank rows, K segment) unit, then
// summed in segment order and rounded (every CTA one share of the M x R values). A GEMM warp that finishes a row
// block waits for its group's h only there, where it adds the expand, by which time it is normally long done.
// (rnd: rounding to the activation dtype where the present decode path stores that dtype; docs/decode.md "The
// persistent decode layer" gives the schedule and the floors, kernels/decode_layer.py its CPU emulation.)
//
// The grid is at most what is resident at once (the host sizes it from the occupancy), so CTAs may wait for one
// another: a phase's consumers wait on a grid-wide counter that every CTA (its GEMM warps, or its LoRA warp)
// increments once when its part is written (release: __threadfence + atomicAdd; acquire: ld.acquire.gpu by one thread,
// then a named barrier or a warp sync). The last CTA to finish the launch puts every counter back to zero, so a CUDA
// graph replays it with no reset kernel.
//
// GEMM work split (no CTA barrier inside a GEMM stage): a stage's weight is a row of units, one unit = one 128-wide
// K chunk of one 16-row block, block-major (gate/up: per pair j, gate block j's chunks then up block I/16 + j's); the
// W = CTAs x 7 GEMM warps of the grid take equal contiguous ranges of it, so every warp streams the same number of bytes
// whatever the shape (row blocks are cut between warps). A warp sums its units of a block in fp32 in order and, at
// the block's end or its range's, writes that partial (mma fragment order) to the stage's scratch slot (block, its
// index among the block's warps) and counts it on the block's counter; the warp that counts last sums the block's
// partials in index order (fixed: reruns are bit-identical), x alpha (2^8 / global scale), + the LoRA expand on the
// tensor cores (h and B_blk rows from global), and runs the stage's epilogue, then zeroes the block's counter for the
// next launch.
//
// Weights never depend on activations: every GEMM warp walks ONE issue cursor over its units of all three GEMMs (in
// the order it will consume them) and keeps S-1 of them in flight in a cp.async ring in shared memory, so the next
// GEMM's first units are already in flight while the CTA waits on a counter; before each wait a warp also prefetches
// the next units of its range into L2 (cp.async.bulk.prefetch.L2), while DRAM is otherwise idle, and the launch
// starts by prefetching every LoRA factor into L2.
//
// Shrink units (16 rank rows, K segment of kseg chunks) go to the LoRA warps (CTA c: units c, c + C, ...); each
// writes fp32 partials [seg][M][R]; no atomics on data: every sum has a fixed order.
//
// The FP4 fragment math (resident repacked layout, K permutation, decode by mask/shift/lop3, the E4M3 scale pairs)
// is that of fp4_gemm.cu (docs/kernels.md); its device helpers are in fp4_frag.cuh, which both include, so that this
// library still builds on its own in seconds. Intermediates written inside the launch are read with ordinary
// (coherent) loads or ld.global.cg, never ld.global.nc. Build-time knobs: QERL_DL_S (ring stages per warp) and
// QERL_DL_MINB (CTAs per SM the registers are budgeted for).
#include <cuda_runtime.h>
#include <stdint.h>
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
// grid-wide counters: GEMM phases done (o, x2 written, gate/up), shrink partials written (per group), h summed (per
// group), the launch's end
constexpr int C_O = 0, C_X2 = 1, C_GU = 2, C_S = 3, C_H = 6, C_END = 9, NCNT = 10;
constexpr int PF_UNITS = 8;      // units of its next range a warp prefetches into L2 before a wait

struct Gemm {
  const uint8_t* w;   // resident repacked weight [N, K/2], tiled (64-row groups)
  const uint8_t* s;   // checkpoint E4M3 block scales [N, K/16]
  const float* gs;    // NVFP4 global scale [1]
  const uint16_t* a;  // LoRA A_cat [R, K], activation dtype (null: no LoRA)
  const uint16_t* b;  // LoRA B_blk [N, R], scaling folded in
  float* hp;          // shrink partials [nseg][M][R] fp32
  uint16_t* hg;       // h = x @ A^T [M][R], activation dtype (rounded like the present path's shrink output)
  float4* part;       // GEMM partials [blocks][pmax][halves][MT][32] (mma fragment order)
  unsigned* bcnt;     // [blocks] partials counted per block; zero between launches
  int N, K, R, kseg, nseg, pmax;
};

struct MlpParams {
  Gemm g[3];             // o, gate/up (gate rows [0, I), up rows [I, 2I)), down
  const uint16_t* attn;  // [M, KO] rows ld_attn apart: o's input
  const uint16_t* hres;  // [M, H] rows ld_h apart: the residual stream before o
  const uint16_t* nw;    // [H] post-attention RMSNorm weight
  uint16_t* h1;          // [M, H] h + o (the residual stream after o)
  uint4* xp;             // gate/up's and down's inputs in fragment order (see xp_index): x2 (the normed h1)
                         // [MT][H/32][32], then act [MT][I/32][32]; zero past M
  uint16_t* act;         // [M, I] SiLU(gate) * up (the down shrink's input)
  uint16_t* out;         // [M, H] the down projection (the next layer's residual delta)
  float* ss;             // [H/16][M] sums of h1^2 per o row block
  unsigned* cnt;         // [NCNT] zero between launches
  float eps;
  int M, H, I, ld_attn, ld_h;
};

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
template <int MT>
struct Smem {
  static constexpr int RING = S * NG * 1024;            // [S][NG][2 rows][32 lanes] uint4
  static constexpr int SC = S * NG * 16 * 8;            // [S][NG][16 rows] uint2 block scales
  static constexpr int CS = NG * 16 * 16;               // [NG][16 rows] uint4: the unit's scale pairs, converted
  static constexpr int RS = 2 * 16 * 4;                 // [2][16] 1/rms per token (GEMM warps, LoRA warp)
  static constexpr int BYTES = RING + SC + CS + RS;
};

// Fields of GEMM stage gi without indexing the parameter array at run time (that would copy it to local memory).
#define QERL_SEL(p, gi, f) ((gi) == 0 ? (p).g[0].f : (gi) == 1 ? (p).g[1].f : (p).g[2].f)

// Stage geometry: blocks (gate/up: pairs), units per block, 128-wide K chunks, and the warps that share its units:
// all W of the grid, or one per unit where the stage has fewer (so that every sharing warp holds at least one unit
// and a block's partials come from consecutive warps). 32-bit: the host checks units * W < 2^31.
struct Geo {
  int nb, u, kc, t, we;
};
__device__ __forceinline__ Geo geo_of(const MlpParams& p, int gi, int w) {
  const int kc = QERL_SEL(p, gi, K) >> 7;
  const int nb = gi == 1 ? p.I >> 4 : p.H >> 4, u = gi == 1 ? 2 * kc : kc, t = nb * u;
  return Geo{nb, u, kc, t, t < w ? t : w};
}
// Warp v's range of a stage's units: [first(v), first(v + 1)) (empty for v >= we); the warp whose range holds unit x.
__device__ __forceinline__ int range_first(const Geo& G, int v) {
  return v >= G.we ? G.t : (int)((unsigned)v * (unsigned)G.t / (unsigned)G.we);
}
__device__ __forceinline__ int warp_of(const Geo& G, int x) {
  return (int)(((unsigned)(x + 1) * (unsigned)G.we + (unsigned)G.t - 1u) / (unsigned)G.t) - 1;
}
// Weight row (first of 16) of unit `within` of block b.
__device__ __forceinline__ int unit_row(const MlpParams& p, int gi, const Geo& G, int b, int within) {
  return gi == 1 ? ((within >= G.kc ? (p.I >> 4) : 0) + b) * 16 : b * 16;
}

// ---- shrinks: h[M, R] = x @ A^T, as fp32 partials per (16 rank rows, K segment) unit over all warps of the grid ---
// x is attn (gi 0), x2 formed from h1 on the fly (gi 1; the same bits as the x2 the stage writes) or act (gi 2).
template <int MT, bool BF16>
__device__ __forceinline__ uint32_t shrink_pair(const MlpParams& p, int gi, int tok, int k, const float* rsm) {
  if (tok >= p.M) return 0u;
  if (gi == 0) return ld32(p.attn + (size_t)tok * p.ld_attn + k);
  if (gi == 2) return ld32(p.act + (size_t)tok * p.I + k);
  const uint32_t hv = ld32(p.h1 + (size_t)tok * p.H + k), wv = *reinterpret_cast<const uint32_t*>(p.nw + k);
  const float r = rsm[tok];
  const uint16_t lo = r16<BF16>(__fmul_rn(f16<BF16>((uint16_t)(wv & 0xffffu)),
                                          f16<BF16>(r16<BF16>(__fmul_rn(f16<BF16>((uint16_t)(hv & 0xffffu)), r)))));
  const uint16_t hi = r16<BF16>(__fmul_rn(f16<BF16>((uint16_t)(wv >> 16)),
                                          f16<BF16>(r16<BF16>(__fmul_rn(f16<BF16>((uint16_t)(hv >> 16)), r)))));
  return (uint32_t)lo | ((uint32_t)hi << 16);
}

template <int MT, bool BF16>
__device__ void shrink_units(const MlpParams& p, int gi, const float* rsm, int first, int stride) {
  const int R = QERL_SEL(p, gi, R);
  if (R == 0) return;
  const uint16_t* A = QERL_SEL(p, gi, a);
  float* hp = QERL_SEL(p, gi, hp);
  const int K = QERL_SEL(p, gi, K), kseg = QERL_SEL(p, gi, kseg), nseg = QERL_SEL(p, gi, nseg);
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
        const uint32_t b0 = shrink_pair<MT, BF16>(p, gi, tok, k0 + 2 * q, rsm);
        const uint32_t b1 = shrink_pair<MT, BF16>(p, gi, tok, k0 + 8 + 2 * q, rsm);
        mma<BF16>(acc[t], a0, a1, a2, a3, b0, b1);
      }
    }
#pragma unroll
    for (int t = 0; t < MT; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = t * 8 + 2 * q + (e & 1), r = r0 + g + (e >> 1) * 8;
        if (tok < p.M && r < R) hp[((size_t)seg * p.M + tok) * R + r] = acc[t][e];
      }
    }
  }
}

// 1/rms of token tok from the o blocks' sums of squares: lane l sums blocks l, l+32, ... in order (loaded 8 at a
// time, so the L2 round trips overlap), then a butterfly over the 32 lanes. Every lane returns it.
__device__ __forceinline__ float inv_rms(const MlpParams& p, int tok, int lane) {
  const int nb = p.H >> 4;
  float s2 = 0.f;
  for (int b0 = lane; b0 < nb; b0 += 8 * 32) {
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = b0 + 32 * i < nb ? __ldcg(p.ss + (size_t)(b0 + 32 * i) * p.M + tok) : 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (b0 + 32 * i < nb) s2 = __fadd_rn(s2, v[i]);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s2 = __fadd_rn(s2, __shfl_xor_sync(0xffffffffu, s2, off));
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(s2, (float)p.H), p.eps)));
}

// The group's h = (sum of its shrink partials in segment order), rounded to the activation dtype: this CTA's 1/C
// share of its M x R values, by one warp.
template <bool BF16>
__device__ __forceinline__ void sum_h(const MlpParams& p, int gi, int c, int C) {
  const int R = QERL_SEL(p, gi, R), nseg = QERL_SEL(p, gi, nseg), n = p.M * R;
  const float* hp = QERL_SEL(p, gi, hp);
  uint16_t* hg = QERL_SEL(p, gi, hg);
  const int hi = (int)((long long)(c + 1) * n / C);
  for (int i = (int)((long long)c * n / C) + (threadIdx.x & 31); i < hi; i += 32) {
    float v = 0.f;
#pragma unroll 4
    for (int s = 0; s < nseg; ++s) v = __fadd_rn(v, __ldcg(hp + (size_t)s * n + i));
    hg[i] = r16<BF16>(v);
  }
}

// v += h @ B_blk[row0 : row0 + 16]^T on the tensor cores: B_blk rows are operand A, h rows (global, written in this
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

// ---- the persistent kernel --------------------------------------------------------------------------------------
template <int MT, bool BF16>
__global__ void __launch_bounds__(NW * 32, MINB) decode_mlp_kernel(const MlpParams p) {
  using L = Smem<MT>;
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem);
  uint2* scs = reinterpret_cast<uint2*>(smem + L::RING);
  float* rsm = reinterpret_cast<float*>(smem + L::RING + L::SC + L::CS);  // [16] GEMM warps', then [16] LoRA warp's
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int c = blockIdx.x, C = gridDim.x, W = C * NG, v = c * NG + warp;  // v: this GEMM warp's index
  uint32_t* cvt = reinterpret_cast<uint32_t*>(smem + L::RING + L::SC) + warp * 64;

  // the issue cursor: GEMM stage ig (3: nothing left), block ib, unit iw within it, il units left in the range, and
  // the unit's weight piece / scales; within a block's half the next unit is 4 KiB / 8 B further (one tiled chunk),
  // so the stage's fields are read only where a block or a half starts
  int ig = -1, ib = 0, iw = 0, il = 0, iu = 0, ikc = 0, isk = 0;
  const uint8_t *iwp = nullptr, *isp = nullptr;
  const uint64_t pol = evict_first_policy();
  // the 16-row x 64-byte piece of a unit (tiled layout: contiguous) and its rows' block scales
  auto unit_addr = [&](int gi, int b, int within, const uint8_t*& wp, const uint8_t*& sp) {
    const int kc = QERL_SEL(p, gi, K) >> 7;
    const int up = gi == 1 && within >= kc;
    const int ch = up ? within - kc : within, row = ((up ? (p.I >> 4) : 0) + b) * 16;
    wp = QERL_SEL(p, gi, w) + ((size_t)(row >> 6) * kc + ch) * 4096 + (row & 63) * 64;
    sp = QERL_SEL(p, gi, s) + (size_t)row * (kc * 8) + ch * 8;
  };
  auto settle = [&]() {
    while (ig < 3 && il == 0) {
      if (++ig < 3) {
        const Geo G = geo_of(p, ig, W);
        const int first = range_first(G, v);
        il = range_first(G, v + 1) - first;
        ib = first / G.u;
        iw = first - ib * G.u;
        iu = G.u, ikc = G.kc, isk = G.kc * 8;
        if (il > 0) unit_addr(ig, ib, iw, iwp, isp);
      }
    }
  };
  auto issue = [&](int slot) {
    uint4* dst = ring + (slot * NG + warp) * 64;
    cp_async16_stream(dst + lane, iwp + g * 64 + q * 16, pol);
    cp_async16_stream(dst + 32 + lane, iwp + (g + 8) * 64 + q * 16, pol);
    if (lane < 16) cp_async8(scs + (slot * NG + warp) * 16 + lane, isp + lane * isk, pol);
    if (--il == 0) {
      settle();
    } else if (++iw == iu) {
      ++ib, iw = 0;
      unit_addr(ig, ib, 0, iwp, isp);
    } else if (iw == ikc && ig == 1) {  // gate/up: the pair's up half starts
      unit_addr(ig, ib, iw, iwp, isp);
    } else {
      iwp += 4096, isp += 8;
    }
  };
  // L2 prefetch of the PF_UNITS units after the ring's of this warp's range of stage gi (lane i: unit i)
  auto prefetch_next = [&](int gi) {
    const Geo G = geo_of(p, gi, W);
    const int x = range_first(G, v) + (S - 1) + lane;
    if (lane < PF_UNITS && x < range_first(G, v + 1)) {
      const uint8_t *wp, *sp;
      const int b = x / G.u;
      unit_addr(gi, b, x - b * G.u, wp, sp);
      prefetch_l2(wp, 1024);
    }
  };
  if (warp < NG) {
    settle();
#pragma unroll
    for (int st = 0; st < S - 1; ++st) {  // the ring fills before the previous kernel of the stream is waited for
      if (ig < 3) issue(st);
      cp_async_commit();
    }
  }
  // the LoRA factors do not depend on the previous kernel either
#pragma unroll
  for (int gi = 0; gi < 3; ++gi) {
    const int R = QERL_SEL(p, gi, R);
    if (R > 0) {
      prefetch_share(QERL_SEL(p, gi, a), (size_t)R * QERL_SEL(p, gi, K) * 2, c, C);
      prefetch_share(QERL_SEL(p, gi, b), (size_t)R * QERL_SEL(p, gi, N) * 2, c, C);
    }
  }
  pdl_launch();
  pdl_wait();

  int j = 0;  // ring position
  auto gemm_stage = [&](int gi) {
    const Geo G = geo_of(p, gi, W);
    const int u0 = range_first(G, v), u1 = range_first(G, v + 1);
    const int R = QERL_SEL(p, gi, R), pmax = QERL_SEL(p, gi, pmax), halves = gi == 1 ? 2 : 1;
    const int kx = QERL_SEL(p, gi, K);
    const uint4* xp = p.xp + (gi == 2 ? (size_t)MT * (p.H >> 5) * 32 : 0);  // gi 0 reads attn as it is
    const uint16_t* xrow[MT];  // o: attn rows (written by the previous kernel; no phase to put it in fragment order)
#pragma unroll
    for (int t = 0; t < MT; ++t) xrow[t] = t * 8 + g < p.M ? p.attn + (size_t)(t * 8 + g) * p.ld_attn : nullptr;
    const uint16_t* B = QERL_SEL(p, gi, b);
    float4* part = QERL_SEL(p, gi, part);
    unsigned* bcnt = QERL_SEL(p, gi, bcnt);
    const float alpha = 256.0f / *QERL_SEL(p, gi, gs);
    // gate/up: the gate half, the up half (other stages: acc0); with one token tile the odd 32-wide slices of a chunk
    // go to a second accumulator (acc0x, acc1x), so that consecutive mma do not wait on each other's result
    constexpr bool SPLIT = MT == 1;
    float acc0[MT][4], acc1[MT][4], acc0x[MT][4], acc1x[MT][4];
#pragma unroll
    for (int t = 0; t < MT; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc0[t][e] = acc1[t][e] = acc0x[t][e] = acc1x[t][e] = 0.f;
    }
    auto chunk = [&](float (&acc)[MT][4], float (&accx)[MT][4], int ch) {
      cp_async_wait<S - 2>();
      __syncwarp();  // the slot's scales came from other lanes; the slot refilled next was read by all lanes
      if (ig < 3) issue((j + S - 1) & (S - 1));
      cp_async_commit();
      const int sl = j & (S - 1);
      const uint4* src = ring + (sl * NG + warp) * 64;
      const uint4 wa = src[lane], wb = src[32 + lane];
      {  // the unit's 16 rows x 4 slices of scale pairs, converted once (lane: row lane/2, slices 2(lane&1) + 0/1)
        const uint2 raw = scs[(sl * NG + warp) * 16 + (lane >> 1)];
        const int i0 = 2 * (lane & 1);
        *reinterpret_cast<uint2*>(cvt + (lane >> 1) * 4 + i0) =
            make_uint2(scale_pair<true, BF16>(raw, i0, 0), scale_pair<true, BF16>(raw, i0 + 1, 0));
      }
      __syncwarp();
      const uint4 ca = *reinterpret_cast<const uint4*>(cvt + g * 4);
      const uint4 cb = *reinterpret_cast<const uint4*>(cvt + (g + 8) * 4);
      const uint32_t sca[4] = {ca.x, ca.y, ca.z, ca.w}, scb[4] = {cb.x, cb.y, cb.z, cb.w};
      const uint32_t wra[4] = {wa.x, wa.y, wa.z, wa.w}, wrb[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint4 bf[MT];
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          if (gi != 0) {
            bf[t] = xp[xp_index(kx, t, ch * 4 + i, lane)];
          } else if (xrow[t] != nullptr) {
            const uint16_t* xb = xrow[t] + ch * 128 + 32 * i + 2 * q;
            bf[t] = b_frags(ld32(xb), ld32(xb + 8), ld32(xb + 16), ld32(xb + 24));
          } else {
            bf[t] = make_uint4(0u, 0u, 0u, 0u);
          }
        }
        if (SPLIT && (i & 1)) {
          slice_mma<MT, BF16>(accx, wra[i], wrb[i], sca[i], scb[i], bf);
        } else {
          slice_mma<MT, BF16>(acc, wra[i], wrb[i], sca[i], scb[i], bf);
        }
      }
      ++j;
    };
    auto put = [&](float (&acc)[MT][4], float (&accx)[MT][4], float4* slot) {
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        if (SPLIT) {
          slot[t * 32 + lane] = make_float4(__fadd_rn(acc[t][0], accx[t][0]), __fadd_rn(acc[t][1], accx[t][1]),
                                            __fadd_rn(acc[t][2], accx[t][2]), __fadd_rn(acc[t][3], accx[t][3]));
        } else {
          slot[t * 32 + lane] = make_float4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][e] = accx[t][e] = 0.f;
      }
    };
    int b = u0 / G.u;
    for (int u = u0; u < u1; ++b) {
      const int bend = (b + 1) * G.u, stop = bend < u1 ? bend : u1;
      for (int within = u - b * G.u; u < stop; ++u, ++within) {
        if (within >= G.kc) {
          chunk(acc1, acc1x, within - G.kc);
        } else {
          chunk(acc0, acc0x, within);
        }
      }
      // the block's partial from this warp, counted; the last of its warps finishes the block
      const int vf = warp_of(G, b * G.u), np = warp_of(G, bend - 1) - vf + 1;
      const float4* slot0 = part + (size_t)b * pmax * halves * MT * 32;
      float4* mine = part + ((size_t)b * pmax + (v - vf)) * halves * MT * 32;
      put(acc0, acc0x, mine);
      if (gi == 1) put(acc1, acc1x, mine + MT * 32);
      __threadfence();
      __syncwarp();
      unsigned old = 0;
      if (lane == 0) old = atomicAdd(bcnt + b, 1u);
      old = __shfl_sync(0xffffffffu, old, 0);
      if (old + 1 < (unsigned)np) continue;
      __threadfence();
      if (lane == 0) bcnt[b] = 0u;  // every partial of the block is counted: none will touch it again this launch
      float va[MT][4];
      sum_block<MT>(va, slot0, halves, 0, np, alpha, lane);
      const int rb = unit_row(p, gi, G, b, 0) >> 4;
      if (R > 0) {  // h of the group is summed by the LoRA warps beside the GEMM (long done, as a rule)
        wait_warp(p.cnt + C_H + gi, C);
        lora_expand<MT, BF16>(va, B, R, rb * 16, QERL_SEL(p, gi, hg), p.M, g, q);
      }
      // va[t][e]: token t*8 + 2q + (e & 1), row rb*16 + g + 8*(e >> 1)
      if (gi == 0) {  // h1 = h + rnd(o); sums of h1^2 over the block's 16 columns (a fixed butterfly)
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          float sq[2];
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const int tok = t * 8 + 2 * q + e2;
            float s2 = 0.f;
            if (tok < p.M) {
#pragma unroll
              for (int hh = 0; hh < 2; ++hh) {
                const int n = rb * 16 + g + 8 * hh;
                const float y = f16<BF16>(r16<BF16>(va[t][e2 + 2 * hh]));
                const uint16_t hv = r16<BF16>(__fadd_rn(f16<BF16>(p.hres[(size_t)tok * p.ld_h + n]), y));
                p.h1[(size_t)tok * p.H + n] = hv;
                const float hf = f16<BF16>(hv);
                s2 = hh == 0 ? __fmul_rn(hf, hf) : __fadd_rn(s2, __fmul_rn(hf, hf));
              }
            }
            sq[e2] = s2;
          }
#pragma unroll
          for (int off = 4; off < 32; off <<= 1) {  // over g: lanes q, q+4, ..., q+28
            sq[0] = __fadd_rn(sq[0], __shfl_xor_sync(0xffffffffu, sq[0], off));
            sq[1] = __fadd_rn(sq[1], __shfl_xor_sync(0xffffffffu, sq[1], off));
          }
          if (g == 0) {
#pragma unroll
            for (int e2 = 0; e2 < 2; ++e2) {
              const int tok = t * 8 + 2 * q + e2;
              if (tok < p.M) p.ss[(size_t)rb * p.M + tok] = sq[e2];
            }
          }
        }
      } else if (gi == 1) {  // act = rnd(rnd(silu(gate)) * up) for pair b
        float vu[MT][4];
        sum_block<MT>(vu, slot0, halves, 1, np, alpha, lane);
        if (R > 0) lora_expand<MT, BF16>(vu, B, R, ((p.I >> 4) + b) * 16, p.g[1].hg, p.M, g, q);
#pragma unroll
        for (int t = 0; t < MT; ++t) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int tok = t * 8 + 2 * q + (e & 1);
            if (tok < p.M) {
              const float gt = f16<BF16>(r16<BF16>(va[t][e])), up = f16<BF16>(r16<BF16>(vu[t][e]));
              const float sl = f16<BF16>(r16<BF16>(__fdiv_rn(gt, __fadd_rn(1.0f, expf(-gt)))));
              const uint16_t a = r16<BF16>(__fmul_rn(sl, up));
              const int k = b * 16 + g + 8 * (e >> 1);
              p.act[(size_t)tok * p.I + k] = a;
              *xp_element(p.xp + (size_t)MT * (p.H >> 5) * 32, p.I, tok, k) = a;
            }
          }
        }
      } else {
#pragma unroll
        for (int t = 0; t < MT; ++t) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int tok = t * 8 + 2 * q + (e & 1);
            if (tok < p.M) p.out[(size_t)tok * p.H + rb * 16 + g + 8 * (e >> 1)] = r16<BF16>(va[t][e]);
          }
        }
      }
    }
  };

  if (warp == LW) {
    // the LoRA warp: each shrink as soon as its input is complete, its partials summed into h by every CTA's share;
    // the GEMM warps' finishing warps wait for h only where they add the expand
    float* rsl = rsm + 16;
#pragma unroll 1
    for (int gi = 0; gi < 3; ++gi) {
      if (QERL_SEL(p, gi, R) == 0) continue;
      if (gi == 1) {  // x2 is formed from h1 on the fly: 1/rms per token once o is complete
        wait_warp(p.cnt + C_O, C);
        for (int tok = 0; tok < p.M; ++tok) {
          const float r = inv_rms(p, tok, lane);
          if (lane == 0) rsl[tok] = r;
        }
        __syncwarp();
      } else if (gi == 2) {
        wait_warp(p.cnt + C_GU, C);
      }
      shrink_units<MT, BF16>(p, gi, rsl, c, C);
      arrive_warp(p.cnt + C_S + gi);
      wait_warp(p.cnt + C_S + gi, C);
      sum_h<BF16>(p, gi, c, C);
      arrive_warp(p.cnt + C_H + gi);
    }
  } else {
    // o GEMM, residual, sums of squares
    gemm_stage(0);
    arrive_gemm(p.cnt + C_O);
    // 1/rms per token, x2 in fragment order; act's fragments of tokens past M zeroed (the gate/up epilogue writes
    // only tokens < M)
    prefetch_next(1);
    wait_gemm(p.cnt + C_O, C);
    for (int tok = warp; tok < p.M; tok += NG) {  // token warp + NG i
      const float r = inv_rms(p, tok, lane);
      if (lane == 0) rsm[tok] = r;
    }
    bar_gemm();
    {
      const int n = MT * (p.H >> 5) * 32, na = MT * (p.I >> 5) * 32;
      for (int id = (int)((long long)c * n / C) + (int)threadIdx.x; id < (int)((long long)(c + 1) * n / C);
           id += NG * 32) {
        const int ln = id & 31, kb = (id >> 5) % (p.H >> 5), t = (id >> 5) / (p.H >> 5);
        const int tok = t * 8 + (ln >> 2), k = kb * 32 + 2 * (ln & 3);
        p.xp[id] = tok < p.M ? b_frags(shrink_pair<MT, BF16>(p, 1, tok, k, rsm),
                                       shrink_pair<MT, BF16>(p, 1, tok, k + 8, rsm),
                                       shrink_pair<MT, BF16>(p, 1, tok, k + 16, rsm),
                                       shrink_pair<MT, BF16>(p, 1, tok, k + 24, rsm))
                             : make_uint4(0u, 0u, 0u, 0u);
      }
      uint4* xpa = p.xp + n;
      for (int id = (int)((long long)c * na / C) + (int)threadIdx.x; id < (int)((long long)(c + 1) * na / C);
           id += NG * 32) {
        if (((id >> 5) / (p.I >> 5)) * 8 + ((id & 31) >> 2) >= p.M) xpa[id] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    arrive_gemm(p.cnt + C_X2);
    // gate/up GEMM with SiLU * up
    wait_gemm(p.cnt + C_X2, C);
    gemm_stage(1);
    arrive_gemm(p.cnt + C_GU);
    // down GEMM
    prefetch_next(2);
    wait_gemm(p.cnt + C_GU, C);
    gemm_stage(2);
  }
  // the launch's end: the last CTA (every other one is past its last wait) zeroes the counters for the next launch
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(p.cnt + C_END, 1u) == (unsigned)C - 1) {
#pragma unroll
      for (int i = 0; i < NCNT; ++i) atomicExch(p.cnt + i, 0u);
      __threadfence();
    }
  }
}

template <int MT, bool BF16>
cudaError_t prepare(int& ctas_per_sm) {
  const void* k = (const void*)decode_mlp_kernel<MT, BF16>;
  cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, Smem<MT>::BYTES);
  if (e != cudaSuccess) return e;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm, decode_mlp_kernel<MT, BF16>, NW * 32,
                                                       Smem<MT>::BYTES);
}

template <int MT, bool BF16>
cudaError_t launch(const MlpParams& p, int ctas, cudaStream_t st, bool pdl) {
  return launch_ex(decode_mlp_kernel<MT, BF16>, dim3(ctas), dim3(NW * 32), Smem<MT>::BYTES, st, pdl, p);
}

}  // namespace qerl_dl

extern "C" {

// Set the shared-memory limit of every variant (outside any graph capture) and report how many CTAs of variant
// (mt, bf16) fit on one SM at once: the grid must not exceed that times the SM count (the CTAs wait on each other).
int qerl_dl_prepare(int mt, int bf16, int* ctas_per_sm) {
  int dummy = 0;
  cudaError_t e = qerl_dl::prepare<1, true>(mt == 1 && bf16 ? *ctas_per_sm : dummy);
  if (e == cudaSuccess) e = qerl_dl::prepare<2, true>(mt == 2 && bf16 ? *ctas_per_sm : dummy);
  if (e == cudaSuccess) e = qerl_dl::prepare<1, false>(mt == 1 && !bf16 ? *ctas_per_sm : dummy);
  if (e == cudaSuccess) e = qerl_dl::prepare<2, false>(mt == 2 && !bf16 ? *ctas_per_sm : dummy);
  return (int)e;
}

int qerl_dl_smem(int mt) { return mt == 1 ? qerl_dl::Smem<1>::BYTES : qerl_dl::Smem<2>::BYTES; }
// the build's knobs: ring stages per warp, CTAs per SM budgeted
int qerl_dl_stages() { return qerl_dl::S; }
int qerl_dl_minb() { return qerl_dl::MINB; }

// One launch of the MLP half. Per GEMM g (o, gate/up, down), 9 pointers: weight, scales, global scale, A_cat, B_blk,
// shrink partials, GEMM partials, block counters, h; 6 ints: N, K, R, kseg, nseg, pmax (R = 0: no LoRA).
// Preconditions (kernels/decode_layer.py checks them): tiled weights (N % 64 == 0), M <= 8 * mt <= 16,
// H % 128 == 0, I % 128 == 0, 4-byte aligned rows, R % 8 == 0 and R <= 256, cnt and block counters zeroed once.
int qerl_dl_mlp(const void* const* gptr, const int* gint, const void* attn, const void* hres, const void* nw, void* h1,
                void* xp, void* act, void* out, float* ss, unsigned* cnt, float eps, int M, int H, int I, int ld_attn,
                int ld_h, int mt, int bf16, int ctas, int pdl, void* stream) {
  qerl_dl::MlpParams p{};
  for (int i = 0; i < 3; ++i) {
    qerl_dl::Gemm& g = p.g[i];
    g.w = static_cast<const uint8_t*>(gptr[9 * i + 0]);
    g.s = static_cast<const uint8_t*>(gptr[9 * i + 1]);
    g.gs = static_cast<const float*>(gptr[9 * i + 2]);
    g.a = static_cast<const uint16_t*>(gptr[9 * i + 3]);
    g.b = static_cast<const uint16_t*>(gptr[9 * i + 4]);
    g.hp = static_cast<float*>(const_cast<void*>(gptr[9 * i + 5]));
    g.part = static_cast<float4*>(const_cast<void*>(gptr[9 * i + 6]));
    g.bcnt = static_cast<unsigned*>(const_cast<void*>(gptr[9 * i + 7]));
    g.hg = static_cast<uint16_t*>(const_cast<void*>(gptr[9 * i + 8]));
    g.N = gint[6 * i + 0], g.K = gint[6 * i + 1], g.R = gint[6 * i + 2];
    g.kseg = gint[6 * i + 3], g.nseg = gint[6 * i + 4], g.pmax = gint[6 * i + 5];
  }
  p.attn = static_cast<const uint16_t*>(attn);
  p.hres = static_cast<const uint16_t*>(hres);
  p.nw = static_cast<const uint16_t*>(nw);
  p.h1 = static_cast<uint16_t*>(h1);
  p.xp = static_cast<uint4*>(xp);
  p.act = static_cast<uint16_t*>(act);
  p.out = static_cast<uint16_t*>(out);
  p.ss = ss;
  p.cnt = cnt;
  p.eps = eps;
  p.M = M, p.H = H, p.I = I, p.ld_attn = ld_attn, p.ld_h = ld_h;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const bool d = pdl != 0;
  if (mt == 1) return bf16 ? qerl_dl::launch<1, true>(p, ctas, st, d) : qerl_dl::launch<1, false>(p, ctas, st, d);
  return bf16 ? qerl_dl::launch<2, true>(p, ctas, st, d) : qerl_dl::launch<2, false>(p, ctas, st, d);
}

}  // extern "C"
