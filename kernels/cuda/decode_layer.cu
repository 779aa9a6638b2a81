// The MLP half of a decoder layer's decode step as ONE persistent launch (NVFP4 weights, bf16/fp16 activations,
// M <= 16 tokens), for Hopper (sm_90a):
//
//   stage 0  o shrink       ho  = attn @ Ao^T                       (LoRA; partials per K segment)
//   stage 1  o GEMM         h1  = h + rnd(attn @ Wo^T + ho Bo^T)    (+ per-row-block sums of h1^2)
//   stage 2  norm + shrink  x2  = rnd(w * rnd(h1 * rs)),  hg = x2 @ Agu^T
//   stage 3  gate/up GEMM   act = rnd(rnd(silu(g)) * u),  [g | u] = rnd(x2 @ Wgu^T + hg Bgu^T)
//   stage 4  down shrink    hd  = act @ Ad^T
//   stage 5  down GEMM      out = rnd(act @ Wd^T + hd Bd^T)
//
// (rnd: rounding to the activation dtype where the present decode path stores that dtype; docs/decode.md "The
// persistent decode layer" gives the schedule and the floors, kernels/decode_layer.py its CPU emulation.)
//
// The grid is at most what is resident at once (the host sizes it from the occupancy), so CTAs may wait for one
// another: a stage's consumers wait on a grid-wide counter that every CTA increments once when its part of the stage
// is written (release: __threadfence + atomicAdd; acquire: ld.acquire.gpu by one thread, then a CTA barrier). The
// last CTA to finish the launch puts every counter back to zero, so a CUDA graph replays it with no reset kernel.
//
// Weights never depend on activations: every warp walks ONE issue cursor over the weight chunks of all three GEMM
// stages (in the order it will consume them) and keeps S-1 chunks of it in flight in a cp.async ring in shared
// memory, so the next GEMM's first chunks are already in flight while the CTA waits on a counter or runs a shrink;
// at the start of the norm and down-shrink stages each CTA also prefetches the start of its next GEMM span into L2
// (cp.async.bulk.prefetch.L2), while DRAM is otherwise idle.
//
// GEMM work split: CTA c of C takes the row blocks (16 output rows) [c NB / C, (c+1) NB / C) of a stage (gate/up:
// pairs of the gate block j and the up block I/16 + j, so SiLU(gate) * up is formed in the same CTA); its 8 warps
// take a block's 128-wide K chunks round-robin and their fp32 partials are summed in warp order through shared
// memory by one warp (rotating), which runs the epilogue: x alpha (2^8 / global scale), + the LoRA expand on the
// tensor cores (h from shared memory, B_blk rows from global), then the stage's own rounding and stores.
// Shrinks: units (16 rank rows, K segment of kseg chunks) over every warp of the grid; each writes fp32 partials
// [seg][M][R]; the consuming GEMM stage sums them in segment order into shared memory (rounded like the present
// path's shrink output). No atomics on data: every sum has a fixed order, reruns are bit-identical.
//
// The FP4 fragment math (resident repacked layout, K permutation, decode by mask/shift/lop3, the E4M3 scale pairs)
// is that of fp4_gemm.cu (docs/kernels.md); its device helpers are in fp4_frag.cuh, which both include, so that this
// library still builds on its own in seconds. Intermediates written inside the launch are read with ordinary (coherent) loads,
// never ld.global.nc.
#include <cuda_runtime.h>
#include <stdint.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include "fp4_frag.cuh"

namespace qerl_dl {

using namespace qerl;  // the fragment and pipeline helpers of fp4_frag.cuh

constexpr int NW = 8;        // warps per CTA
constexpr int S = 4;         // cp.async ring stages per warp
constexpr int MAX_R = 256;   // LoRA rank sum of one group
constexpr int NCNT = 6;      // counters: stages 0..4, then the launch's end
constexpr int PF_BYTES = 64 * 1024;  // L2 prefetch per CTA at the start of a stage that streams no weights

struct Gemm {
  const uint8_t* w;   // resident repacked weight [N, K/2] (tiled when N % 64 == 0, else row order)
  const uint8_t* s;   // checkpoint E4M3 block scales [N, K/16]
  const float* gs;    // NVFP4 global scale [1]
  const uint16_t* a;  // LoRA A_cat [R, K], activation dtype (null: no LoRA)
  const uint16_t* b;  // LoRA B_blk [N, R], scaling folded in
  float* hp;          // shrink partials [nseg][M][R] fp32
  int N, K, tiled, R, kseg, nseg;
};

struct MlpParams {
  Gemm g[3];             // o, gate/up (gate rows [0, I), up rows [I, 2I)), down
  const uint16_t* attn;  // [M, H] rows ld_attn apart: o's input
  const uint16_t* hres;  // [M, H] rows ld_h apart: the residual stream before o
  const uint16_t* nw;    // [H] post-attention RMSNorm weight
  uint16_t* h1;          // [M, H] h + o (the residual stream after o)
  uint16_t* x2;          // [M, H] normed
  uint16_t* act;         // [M, I] SiLU(gate) * up
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

// ---- memory pipeline and grid-wide counters ---------------------------------------------------------------------
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// The CTA's part of a stage is written: make it visible at GPU scope, then count it.
__device__ __forceinline__ void arrive(unsigned* c) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(c, 1u);
  }
}
// Wait until every CTA has counted a stage (one thread polls with acquire loads; the barrier passes it on).
__device__ __forceinline__ void wait_all(const unsigned* c, unsigned ctas) {
  if (threadIdx.x == 0) {
    unsigned v;
    for (;;) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
      if (v >= ctas) break;
      __nanosleep(32);
    }
  }
  __syncthreads();
}

// ---- shared memory ----------------------------------------------------------------------------------------------
template <int MT>
struct Smem {
  static constexpr int RING = S * NW * 1024;            // [S][NW][2 rows][32 lanes] uint4
  static constexpr int SC = S * NW * 16 * 8;            // [S][NW][16 rows] uint2 block scales
  static constexpr int RED = 2 * NW * MT * 32 * 16;     // [2][NW][MT][32] float4 warp partials
  static constexpr int HS = MT * 8 * MAX_R * 2;         // [MT*8 tokens][MAX_R] the group's LoRA h
  static constexpr int GATE = MT * 8 * 16 * 4;          // [MT*8][16] the gate block's rounded values
  static constexpr int RS = 16 * 4;                     // [16] 1/rms per token
  static constexpr int BYTES = RING + SC + RED + HS + GATE + RS;
};

// Rows / K / pointers of GEMM stage gi without indexing the parameter array at run time (that would copy it to
// local memory).
#define QERL_SEL(p, gi, f) ((gi) == 0 ? (p).g[0].f : (gi) == 1 ? (p).g[1].f : (p).g[2].f)

__device__ __forceinline__ const uint8_t* weight_at(const uint8_t* w, int tiled, int K, int r, int ch, int q) {
  const int KC = K >> 7;
  return tiled ? w + ((size_t)(r >> 6) * KC + ch) * 4096 + (r & 63) * 64 + q * 16
               : w + (size_t)r * (K >> 1) + (size_t)ch * 64 + q * 16;
}

// The row blocks of GEMM stage gi held by CTA c: [first, first + count) portions; portion i is row block
// rb(gi, i) (gate/up: gate block j, then up block I/16 + j, alternating).
struct Span {
  int first, count;
};
__device__ __forceinline__ Span span_of(const MlpParams& p, int gi, int c, int C) {
  const int nb = gi == 1 ? p.I >> 4 : p.H >> 4;  // o, down: H/16 blocks; gate/up: I/16 pairs
  const int a = (int)((long long)c * nb / C), b = (int)((long long)(c + 1) * nb / C);
  return Span{a, gi == 1 ? 2 * (b - a) : b - a};
}
__device__ __forceinline__ int block_of(const MlpParams& p, int gi, const Span& sp, int i) {
  return gi == 1 ? ((i & 1) ? (p.I >> 4) : 0) + sp.first + (i >> 1) : sp.first + i;
}

// L2 prefetch of the first PF_BYTES of CTA's weight span of GEMM stage gi (gate/up: of both halves).
__device__ __forceinline__ void prefetch_span(const MlpParams& p, int gi, const Span& sp) {
  if (sp.count == 0) return;
  const uint8_t* w = QERL_SEL(p, gi, w);
  const int K = QERL_SEL(p, gi, K), tiled = QERL_SEL(p, gi, tiled);
  const size_t row_bytes = (size_t)(K >> 1);
  const int halves = gi == 1 ? 2 : 1;
  const int blocks = gi == 1 ? sp.count / 2 : sp.count;
  for (int hh = 0; hh < halves; ++hh) {
    const int rb0 = block_of(p, gi, sp, hh), rb1 = rb0 + blocks;  // hh = 1: the up half's first block
    size_t lo, hi;
    if (tiled) {
      lo = (size_t)(rb0 >> 2) * 64 * row_bytes;
      hi = (size_t)(((rb1 - 1) >> 2) + 1) * 64 * row_bytes;
    } else {
      lo = (size_t)rb0 * 16 * row_bytes;
      hi = (size_t)rb1 * 16 * row_bytes;
    }
    if (hi - lo > (size_t)PF_BYTES / halves) hi = lo + PF_BYTES / halves;
    for (size_t off = lo + (size_t)threadIdx.x * 4096; off < hi; off += (size_t)blockDim.x * 4096) {
      const size_t n = hi - off < 4096 ? hi - off : 4096;
      prefetch_l2(w + off, (unsigned)n);
    }
  }
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
__device__ void shrink_stage(const MlpParams& p, int gi, const float* rsm) {
  const int R = QERL_SEL(p, gi, R);
  if (R == 0) return;
  const uint16_t* A = QERL_SEL(p, gi, a);
  float* hp = QERL_SEL(p, gi, hp);
  const int K = QERL_SEL(p, gi, K), kseg = QERL_SEL(p, gi, kseg), nseg = QERL_SEL(p, gi, nseg);
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int nrk = (R + 15) >> 4, units = nrk * nseg, KC = K >> 7;
  for (int u = blockIdx.x * NW + (threadIdx.x >> 5); u < units; u += gridDim.x * NW) {
    const int rk = u % nrk, seg = u / nrk;
    const int r0 = rk * 16;
    const bool hi = r0 + 8 < R;
    const uint16_t* a0p = A + (size_t)(r0 + g) * K + 2 * q;
    const uint16_t* a1p = a0p + (size_t)8 * K;
    float acc[MT][4];
#pragma unroll
    for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    const int c1 = (seg + 1) * kseg < KC ? (seg + 1) * kseg : KC;
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

// The group's h = (sum of its shrink partials in segment order), rounded to the activation dtype, into shared memory.
template <bool BF16>
__device__ __forceinline__ void gather_h(const MlpParams& p, int gi, uint16_t* hs) {
  const int R = QERL_SEL(p, gi, R), nseg = QERL_SEL(p, gi, nseg);
  const float* hp = QERL_SEL(p, gi, hp);
  for (int i = threadIdx.x; i < p.M * R; i += blockDim.x) {
    float v = 0.f;
    for (int s = 0; s < nseg; ++s) v = __fadd_rn(v, hp[(size_t)s * p.M * R + i]);
    hs[(i / R) * MAX_R + i % R] = r16<BF16>(v);
  }
  __syncthreads();
}

// ---- the persistent kernel --------------------------------------------------------------------------------------
template <int MT, bool BF16>
__global__ void __launch_bounds__(NW * 32, 2) decode_mlp_kernel(const MlpParams p) {
  using L = Smem<MT>;
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem);
  uint2* scs = reinterpret_cast<uint2*>(smem + L::RING);
  float4* red = reinterpret_cast<float4*>(smem + L::RING + L::SC);
  uint16_t* hs = reinterpret_cast<uint16_t*>(smem + L::RING + L::SC + L::RED);
  float* gate = reinterpret_cast<float*>(smem + L::RING + L::SC + L::RED + L::HS);
  float* rsm = reinterpret_cast<float*>(smem + L::RING + L::SC + L::RED + L::HS + L::GATE);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int c = blockIdx.x, C = gridDim.x;
  const Span sp0 = span_of(p, 0, c, C), sp1 = span_of(p, 1, c, C), sp2 = span_of(p, 2, c, C);
  // a Span array indexed at run time would live in local memory (a stack frame in ptxas' report)
  auto spn = [&](int gi) -> Span { return gi == 0 ? sp0 : gi == 1 ? sp1 : sp2; };

  // the issue cursor: GEMM stage ig (3: nothing left), portion ip, chunk iu (this warp's: warp + NW i)
  int ig = 0, ip = 0, iu = warp;
  auto settle = [&]() {
    while (ig < 3) {
      if (ip >= spn(ig).count) {
        ++ig, ip = 0, iu = warp;
      } else if (iu >= (QERL_SEL(p, ig, K) >> 7)) {
        ++ip, iu = warp;
      } else {
        break;
      }
    }
  };
  const uint64_t pol = evict_first_policy();
  auto issue = [&](int slot) {
    const uint8_t* w = QERL_SEL(p, ig, w);
    const uint8_t* s = QERL_SEL(p, ig, s);
    const int K = QERL_SEL(p, ig, K), tiled = QERL_SEL(p, ig, tiled);
    const int row = block_of(p, ig, spn(ig), ip) * 16;
    uint4* dst = ring + (slot * NW + warp) * 64;
    cp_async16_stream(dst + lane, weight_at(w, tiled, K, row + g, iu, q), pol);
    cp_async16_stream(dst + 32 + lane, weight_at(w, tiled, K, row + g + 8, iu, q), pol);
    if (lane < 16) cp_async8(scs + (slot * NW + warp) * 16 + lane, s + (size_t)(row + lane) * (K >> 4) + iu * 8, pol);
    iu += NW;
    settle();
  };
  settle();
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {  // the ring fills before the previous kernel of the stream is waited for
    if (ig < 3) issue(st);
    cp_async_commit();
  }
  pdl_launch();
  pdl_wait();

  int j = 0, buf = 0, pcount = 0;  // ring position, reduction buffer, portions done (rotates the reducing warp)
  auto gemm_stage = [&](int gi) {
    const int K = QERL_SEL(p, gi, K), KC = K >> 7, R = QERL_SEL(p, gi, R);
    const uint16_t* x = gi == 0 ? p.attn : gi == 1 ? p.x2 : p.act;
    const int ldx = gi == 0 ? p.ld_attn : gi == 1 ? p.H : p.I;
    const uint16_t* B = QERL_SEL(p, gi, b);
    const float alpha = 256.0f / *QERL_SEL(p, gi, gs);
    const uint16_t* xrow[MT];
#pragma unroll
    for (int t = 0; t < MT; ++t) xrow[t] = t * 8 + g < p.M ? x + (size_t)(t * 8 + g) * ldx : nullptr;
    float acc[MT][4];
#pragma unroll
    for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    for (int pi = 0; pi < spn(gi).count; ++pi, ++pcount) {
      const int rb = block_of(p, gi, spn(gi), pi);
      for (int u = warp; u < KC; u += NW, ++j) {
        cp_async_wait<S - 2>();
        __syncwarp();  // the slot's scales came from other lanes; the slot refilled next was read by all lanes
        if (ig < 3) issue((j + S - 1) % S);
        cp_async_commit();
        const int sl = j % S;
        const uint4* src = ring + (sl * NW + warp) * 64;
        const uint4 wa = src[lane], wb = src[32 + lane];
        const uint2* ss = scs + (sl * NW + warp) * 16;
        const uint2 sa = ss[g], sb = ss[g + 8];
        const uint32_t wra[4] = {wa.x, wa.y, wa.z, wa.w}, wrb[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          uint4 bf[MT];
#pragma unroll
          for (int t = 0; t < MT; ++t) {
            if (xrow[t] != nullptr) {
              const uint16_t* xb = xrow[t] + u * 128 + 32 * i + 2 * q;
              bf[t] = b_frags(ld32(xb), ld32(xb + 8), ld32(xb + 16), ld32(xb + 24));
            } else {
              bf[t] = make_uint4(0u, 0u, 0u, 0u);
            }
          }
          const uint32_t spa = scale_pair<true, BF16>(sa, i, 0), spb = scale_pair<true, BF16>(sb, i, 0);
          slice_mma<MT, BF16>(acc, wra[i], wrb[i], spa, spb, bf);
        }
      }
      put_partials<MT, NW>(red, buf, acc, warp, lane);
      __syncthreads();
      if (warp == pcount % NW) {
        float v[MT][4];
        sum_partials<MT, NW>(v, red, buf, lane, [alpha](float x) { return __fmul_rn(x, alpha); });
        if (R > 0) {  // the LoRA expand: B_blk rows are operand A, h rows (shared memory) operand B
          const uint16_t* b0 = B + (size_t)(rb * 16 + g) * R + 2 * q;
          const uint16_t* b1 = b0 + (size_t)8 * R;
          for (int r0 = 0; r0 < R; r0 += 16) {
            const bool hi = r0 + 8 < R;
            const uint32_t a0 = __ldg(reinterpret_cast<const unsigned*>(b0 + r0));
            const uint32_t a1 = __ldg(reinterpret_cast<const unsigned*>(b1 + r0));
            const uint32_t a2 = hi ? __ldg(reinterpret_cast<const unsigned*>(b0 + r0 + 8)) : 0u;
            const uint32_t a3 = hi ? __ldg(reinterpret_cast<const unsigned*>(b1 + r0 + 8)) : 0u;
#pragma unroll
            for (int t = 0; t < MT; ++t) {
              const uint16_t* hr = hs + (t * 8 + g) * MAX_R + r0 + 2 * q;
              const bool live = t * 8 + g < p.M;
              const uint32_t x0 = live ? *reinterpret_cast<const uint32_t*>(hr) : 0u;
              const uint32_t x1 = live && hi ? *reinterpret_cast<const uint32_t*>(hr + 8) : 0u;
              mma<BF16>(v[t], a0, a1, a2, a3, x0, x1);
            }
          }
        }
        // v[t][e]: token t*8 + 2q + (e & 1), row rb*16 + g + 8*(e >> 1)
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
                  const float y = f16<BF16>(r16<BF16>(v[t][e2 + 2 * hh]));
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
        } else if (gi == 1) {
          const int ni = p.I >> 4;
#pragma unroll
          for (int t = 0; t < MT; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int tok = t * 8 + 2 * q + (e & 1), row = g + 8 * (e >> 1);
              const float y = f16<BF16>(r16<BF16>(v[t][e]));
              if (rb < ni) {  // gate: kept for the up block that comes next in this CTA
                gate[(t * 8 + 2 * q + (e & 1)) * 16 + row] = y;
              } else if (tok < p.M) {
                const float gt = gate[(t * 8 + 2 * q + (e & 1)) * 16 + row];
                const float sl = f16<BF16>(r16<BF16>(__fdiv_rn(gt, __fadd_rn(1.0f, expf(-gt)))));
                p.act[(size_t)tok * p.I + (rb - ni) * 16 + row] = r16<BF16>(__fmul_rn(sl, y));
              }
            }
          }
        } else {
#pragma unroll
          for (int t = 0; t < MT; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int tok = t * 8 + 2 * q + (e & 1);
              if (tok < p.M) p.out[(size_t)tok * p.H + rb * 16 + g + 8 * (e >> 1)] = r16<BF16>(v[t][e]);
            }
          }
        }
      }
      buf ^= 1;
    }
  };

  // stage 0: o's shrink on the attention output
  shrink_stage<MT, BF16>(p, 0, rsm);
  arrive(p.cnt + 0);
  // stage 1: o GEMM, residual, sums of squares
  wait_all(p.cnt + 0, C);
  if (p.g[0].R > 0) gather_h<BF16>(p, 0, hs);
  gemm_stage(0);
  arrive(p.cnt + 1);
  // stage 2: 1/rms per token, x2, gate/up's shrink
  prefetch_span(p, 1, spn(1));
  wait_all(p.cnt + 1, C);
  if (warp < 2) {  // token warp + 2i: lane l sums blocks l, l+32, ... in order, then a butterfly
    for (int tok = warp; tok < p.M; tok += 2) {
      float s2 = 0.f;
      for (int b = lane; b < (p.H >> 4); b += 32) s2 = __fadd_rn(s2, p.ss[(size_t)b * p.M + tok]);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) s2 = __fadd_rn(s2, __shfl_xor_sync(0xffffffffu, s2, off));
      if (lane == 0) rsm[tok] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(s2, (float)p.H), p.eps)));
    }
  }
  __syncthreads();
  {
    const int pairs = p.M * (p.H >> 1);
    const int a = (int)((long long)c * pairs / C), b = (int)((long long)(c + 1) * pairs / C);
    for (int i = a + (int)threadIdx.x; i < b; i += blockDim.x) {
      const int tok = i / (p.H >> 1), k = 2 * (i % (p.H >> 1));
      *reinterpret_cast<uint32_t*>(p.x2 + (size_t)tok * p.H + k) = shrink_pair<MT, BF16>(p, 1, tok, k, rsm);
    }
  }
  shrink_stage<MT, BF16>(p, 1, rsm);
  arrive(p.cnt + 2);
  // stage 3: gate/up GEMM with SiLU * up
  wait_all(p.cnt + 2, C);
  if (p.g[1].R > 0) gather_h<BF16>(p, 1, hs);
  gemm_stage(1);
  arrive(p.cnt + 3);
  // stage 4: down's shrink
  prefetch_span(p, 2, spn(2));
  wait_all(p.cnt + 3, C);
  shrink_stage<MT, BF16>(p, 2, rsm);
  arrive(p.cnt + 4);
  // stage 5: down GEMM
  wait_all(p.cnt + 4, C);
  if (p.g[2].R > 0) gather_h<BF16>(p, 2, hs);
  gemm_stage(2);
  // the launch's end: the last CTA (every other one is past its last wait) zeroes the counters for the next launch
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(p.cnt + NCNT - 1, 1u) == (unsigned)C - 1) {
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

// One launch of the MLP half. Per GEMM g (o, gate/up, down): weight, scales, global scale, A_cat, B_blk, shrink
// partials, N, K, tiled, R, kseg, nseg (R = 0: no LoRA). Preconditions (kernels/decode_layer.py checks them):
// M <= 8 * mt <= 16, H % 128 == 0, I % 128 == 0, 4-byte aligned rows, R % 8 == 0 and R <= 256, cnt zeroed once.
int qerl_dl_mlp(const void* const* gptr, const int* gint, const void* attn, const void* hres, const void* nw, void* h1,
                void* x2, void* act, void* out, float* ss, unsigned* cnt, float eps, int M, int H, int I, int ld_attn,
                int ld_h, int mt, int bf16, int ctas, int pdl, void* stream) {
  qerl_dl::MlpParams p{};
  for (int i = 0; i < 3; ++i) {
    qerl_dl::Gemm& g = p.g[i];
    g.w = static_cast<const uint8_t*>(gptr[6 * i + 0]);
    g.s = static_cast<const uint8_t*>(gptr[6 * i + 1]);
    g.gs = static_cast<const float*>(gptr[6 * i + 2]);
    g.a = static_cast<const uint16_t*>(gptr[6 * i + 3]);
    g.b = static_cast<const uint16_t*>(gptr[6 * i + 4]);
    g.hp = static_cast<float*>(const_cast<void*>(gptr[6 * i + 5]));
    g.N = gint[6 * i + 0], g.K = gint[6 * i + 1], g.tiled = gint[6 * i + 2];
    g.R = gint[6 * i + 3], g.kseg = gint[6 * i + 4], g.nseg = gint[6 * i + 5];
  }
  p.attn = static_cast<const uint16_t*>(attn);
  p.hres = static_cast<const uint16_t*>(hres);
  p.nw = static_cast<const uint16_t*>(nw);
  p.h1 = static_cast<uint16_t*>(h1);
  p.x2 = static_cast<uint16_t*>(x2);
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
