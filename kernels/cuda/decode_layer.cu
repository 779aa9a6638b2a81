// The MLP half of a decoder layer's decode step as ONE persistent launch (NVFP4, MXFP4, INT4, INT8 or FP8 weights,
// bf16/fp16 activations, M <= 16 tokens), for Hopper (sm_90a). Seven GEMM warps per CTA stream the weights through three
// phases, a grid-wide counter between them:
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
// library still builds on its own in seconds; what it shares with the attention half (decode_attn.cu) is in
// decode_common.cuh. Intermediates written inside the launch are read with ordinary
// (coherent) loads or ld.global.cg, never ld.global.nc. Build-time knobs: QERL_DL_S (ring stages per warp),
// QERL_DL_MINB (CTAs per SM the registers are budgeted for) and QERL_DL_XPF (1: gate/up's and down's x fragments
// loaded two slices ahead at one token tile; the same sums in the same order, so the same bits).
#include "decode_common.cuh"

#ifndef QERL_DL_XPF
#define QERL_DL_XPF 0
#endif

namespace qerl_dl {

constexpr bool XPF = QERL_DL_XPF != 0;

// grid-wide counters: GEMM phases done (o, x2 written, gate/up), shrink partials written (per group), h summed (per
// group), the launch's end
constexpr int C_O = 0, C_X2 = 1, C_GU = 2, C_S = 3, C_H = 6, C_END = 9, NCNT = 10;

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

// Fields of GEMM stage gi without indexing the parameter array at run time (that would copy it to local memory).
#define QERL_SEL(p, gi, f) ((gi) == 0 ? (p).g[0].f : (gi) == 1 ? (p).g[1].f : (p).g[2].f)

__device__ __forceinline__ Geo geo_of(const MlpParams& p, int gi, int w) {
  const int kc = QERL_SEL(p, gi, K) >> 7;
  const int nb = gi == 1 ? p.I >> 4 : p.H >> 4, u = gi == 1 ? 2 * kc : kc, t = nb * u;
  return Geo{nb, u, kc, t, t < w ? t : w};
}
// Weight row (first of 16) of unit `within` of block b.
__device__ __forceinline__ int unit_row(const MlpParams& p, int gi, const Geo& G, int b, int within) {
  return gi == 1 ? ((within >= G.kc ? (p.I >> 4) : 0) + b) * 16 : b * 16;
}

// ---- shrinks of the three groups (shrink_run): x is attn (gi 0), x2 formed from h1 on the fly (gi 1; the same bits
// as the x2 the stage writes) or act (gi 2)
template <int MT, bool BF16>
__device__ __forceinline__ uint32_t shrink_pair(const MlpParams& p, int gi, int tok, int k, const float* rsm) {
  if (tok >= p.M) return 0u;
  if (gi == 0) return ld32(p.attn + (size_t)tok * p.ld_attn + k);
  if (gi == 2) return ld32(p.act + (size_t)tok * p.I + k);
  return norm_pair<BF16>(ld32(p.h1 + (size_t)tok * p.H + k), *reinterpret_cast<const uint32_t*>(p.nw + k), rsm[tok]);
}

template <int MT, bool BF16>
__device__ void shrink_units(const MlpParams& p, int gi, const float* rsm, int first, int stride) {
  const int R = QERL_SEL(p, gi, R);
  if (R == 0) return;
  shrink_run<MT, BF16>(QERL_SEL(p, gi, a), QERL_SEL(p, gi, hp), QERL_SEL(p, gi, K), R, QERL_SEL(p, gi, kseg),
                       QERL_SEL(p, gi, nseg), p.M, first, stride,
                       [&](int tok, int k) { return shrink_pair<MT, BF16>(p, gi, tok, k, rsm); });
}

// 1/rms of token tok from the o blocks' sums of squares (every lane returns it).
__device__ __forceinline__ float inv_rms(const MlpParams& p, int tok, int lane) {
  return inv_rms_of(p.ss, p.H, p.M, p.eps, tok, lane);
}

// The group's h, rounded to the activation dtype: this CTA's 1/C share of its M x R values, by one warp.
template <bool BF16>
__device__ __forceinline__ void sum_h(const MlpParams& p, int gi, int c, int C) {
  sum_h_share<BF16>(QERL_SEL(p, gi, hp), QERL_SEL(p, gi, hg), QERL_SEL(p, gi, nseg), p.M * QERL_SEL(p, gi, R), c, C);
}

// ---- the persistent kernel --------------------------------------------------------------------------------------
// DEC: the tile decode of all three GEMMs (decode_common.cuh's DEC_*; a template parameter: a run-time switch in
// the slice loop would cost the FP4 kernel registers); the FP4 pair share one instantiation (a run-time scale
// switch). W8 (INT8/FP8) tiles are 2 KiB of the checkpoint's row-major bytes, read with the 8-bit mma order
// (w8_mma), x read as rows (x2 written as rows where the 4-bit kernels write fragments), the per-channel scale on
// each finished block.
template <int MT, bool BF16, int DEC>
__global__ void __launch_bounds__(NW * 32, MINB) decode_mlp_kernel(const MlpParams p) {
  constexpr bool W8 = DEC == DEC_INT8 || DEC == DEC_FP8;
  constexpr int UNIT = W8 ? 128 : 64;  // uint4 per unit in the ring
  using L = Smem<MT, W8>;
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
  int ig = -1, ib = 0, iw = 0, il = 0, iu = 0, ikc = 0, isk = 0, ispc = 8;
  const uint8_t *iwp = nullptr, *isp = nullptr;
  const uint64_t pol = evict_first_policy();
  // the 16-row x 64-byte piece of a unit (tiled layout: contiguous) and its rows' block scales
  auto unit_addr = [&](int gi, int b, int within, const uint8_t*& wp, const uint8_t*& sp) {
    const int kc = QERL_SEL(p, gi, K) >> 7, spc = QERL_SEL(p, gi, spc);
    const int up = gi == 1 && within >= kc;
    const int ch = up ? within - kc : within, row = ((up ? (p.I >> 4) : 0) + b) * 16;
    if constexpr (W8) {
      wp = QERL_SEL(p, gi, w) + (size_t)row * QERL_SEL(p, gi, K) + ch * 128;
      sp = nullptr;
    } else {
      wp = QERL_SEL(p, gi, w) + ((size_t)(row >> 6) * kc + ch) * 4096 + (row & 63) * 64;
      sp = QERL_SEL(p, gi, s) + (size_t)row * (kc * spc) + ch * spc;
    }
  };
  auto settle = [&]() {
    while (ig < 3 && il == 0) {
      if (++ig < 3) {
        const Geo G = geo_of(p, ig, W);
        const int first = range_first(G, v);
        il = range_first(G, v + 1) - first;
        ib = first / G.u;
        iw = first - ib * G.u;
        ispc = QERL_SEL(p, ig, spc);
        iu = G.u, ikc = G.kc, isk = G.kc * ispc;
        if (il > 0) unit_addr(ig, ib, iw, iwp, isp);
      }
    }
  };
  auto issue = [&](int slot) {
    uint4* dst = ring + (slot * NG + warp) * UNIT;
    if constexpr (W8) {  // bytes [32q, 32q + 32) of rows g and g + 8 of the chunk
      const size_t ld = (size_t)QERL_SEL(p, ig, K);
      const uint8_t* ra = iwp + g * ld + q * 32;
      const uint8_t* rb = ra + 8 * ld;
      cp_async16_stream(dst + lane, ra, pol);
      cp_async16_stream(dst + 32 + lane, ra + 16, pol);
      cp_async16_stream(dst + 64 + lane, rb, pol);
      cp_async16_stream(dst + 96 + lane, rb + 16, pol);
    } else {
      cp_async16_stream(dst + lane, iwp + g * 64 + q * 16, pol);
      cp_async16_stream(dst + 32 + lane, iwp + (g + 8) * 64 + q * 16, pol);
      if (lane < 16) cp_scales(scs + (slot * NG + warp) * 16 + lane, isp + lane * isk, ispc, pol);
    }
    if (--il == 0) {
      settle();
    } else if (++iw == iu) {
      ++ib, iw = 0;
      unit_addr(ig, ib, 0, iwp, isp);
    } else if (iw == ikc && ig == 1) {  // gate/up: the pair's up half starts
      unit_addr(ig, ib, iw, iwp, isp);
    } else {
      iwp += W8 ? 128 : 4096, isp += ispc;
    }
  };
  // L2 prefetch of the PF_UNITS units after the ring's of this warp's range of stage gi (lane i: unit i)
  auto prefetch_next = [&](int gi) {
    if constexpr (W8) return;  // a W8 unit is 16 rows K bytes apart, not one 1 KiB piece
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
    for (int t = 0; t < MT; ++t) xrow[t] = t * 8 + g < p.M && !W8 ? p.attn + (size_t)(t * 8 + g) * p.ld_attn : nullptr;
    // W8 reads every stage's x as rows (attn, x2 as rows in the xp buffer, act): the lane's row of tile t is
    // xw + (t * 8 + g) * xld, formed per chunk (kept per tile, the pointers spill a register at two tiles)
    const uint16_t* xw = gi == 0 ? p.attn : gi == 1 ? reinterpret_cast<const uint16_t*>(p.xp) : p.act;
    const size_t xld = gi == 0 ? p.ld_attn : gi == 1 ? p.H : p.I;
    const uint16_t* B = QERL_SEL(p, gi, b);
    float4* part = QERL_SEL(p, gi, part);
    unsigned* bcnt = QERL_SEL(p, gi, bcnt);
    const int spc = QERL_SEL(p, gi, spc), shift = QERL_SEL(p, gi, shift);
    const float alpha = gemm_alpha(spc, QERL_SEL(p, gi, gs), shift);
    // gate/up: the gate half, the up half (other stages: acc0); with one token tile the odd 32-wide slices of a chunk
    // go to a second accumulator (acc0x, acc1x), so that consecutive mma do not wait on each other's result
    constexpr bool SPLIT = MT == 1;
    float acc0[MT][4], acc1[MT][4], acc0x[MT][4], acc1x[MT][4];
#pragma unroll
    for (int t = 0; t < MT; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc0[t][e] = acc1[t][e] = acc0x[t][e] = acc1x[t][e] = 0.f;
    }
    // XPF builds: the x fragments of gate/up and down (precomputed, in L2) are loaded ahead into nx, so their L2
    // latency is hidden behind the mma of the slices before instead of stalling each slice (o reads attn rows)
    // Two slices ahead (8 registers a token tile: four ahead spilled at 128 registers)
    const bool pf = XPF && !W8 && MT == 1 && gi != 0;
    uint4 nx[2][MT];  // (unused where pf is false)
    auto load_x = [&](int ch) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int t = 0; t < MT; ++t) nx[i][t] = xp[xp_index(kx, t, ch * 4 + i, lane)];
      }
    };
    auto chunk = [&](float (&acc)[MT][4], float (&accx)[MT][4], int ch, int chn) {
      cp_async_wait<S - 2>();
      __syncwarp();  // the slot's scales came from other lanes; the slot refilled next was read by all lanes
      if (ig < 3) issue((j + S - 1) & (S - 1));
      cp_async_commit();
      const int sl = j & (S - 1);
      const uint4* src = ring + (sl * NG + warp) * UNIT;
      if constexpr (W8) {  // w8_mma's order: word jj of rows g / g + 8 and x's u32 pairs 2jj, 2jj + 1
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // x values [32q + 8i, +8) of each tile's token: mma 2i and 2i + 1
          // words 2i, 2i + 1 of rows g and g + 8, read here (all eight at once spill a register at two tiles)
          const uint2 wa = reinterpret_cast<const uint2*>(src + (i >> 1) * 32 + lane)[i & 1];
          const uint2 wb = reinterpret_cast<const uint2*>(src + 64 + (i >> 1) * 32 + lane)[i & 1];
          uint32_t bx0[MT], bx1[MT], by0[MT], by1[MT];
#pragma unroll
          for (int t = 0; t < MT; ++t) {
            const int tok = t * 8 + g;
            const uint4 xv = tok < p.M ? *reinterpret_cast<const uint4*>(xw + tok * xld + ch * 128 + 32 * q + 8 * i)
                                       : make_uint4(0u, 0u, 0u, 0u);
            bx0[t] = xv.x, bx1[t] = xv.y, by0[t] = xv.z, by1[t] = xv.w;
          }
          w8_mma<MT, BF16, DEC>(acc, wa.x, wb.x, bx0, bx1);
          if (SPLIT) {
            w8_mma<MT, BF16, DEC>(accx, wa.y, wb.y, by0, by1);
          } else {
            w8_mma<MT, BF16, DEC>(acc, wa.y, wb.y, by0, by1);
          }
        }
        ++j;
        return;
      }
      const uint4 wa = src[lane], wb = src[32 + lane];
      {  // the unit's 16 rows x 4 slices of scale pairs, converted once (lane: row lane/2, slices 2(lane&1) + 0/1)
        const uint2 raw = scs[(sl * NG + warp) * 16 + (lane >> 1)];
        const int i0 = 2 * (lane & 1);
        *reinterpret_cast<uint2*>(cvt + (lane >> 1) * 4 + i0) = scale_pairs2<BF16>(raw, i0, spc, shift);
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
          if (pf) {  // slice i, loaded two slices ago; slice i + 2 (of this unit, or the next's) in its place
            bf[t] = nx[i & 1][t];
            if (i < 2) {
              nx[i & 1][t] = xp[xp_index(kx, t, ch * 4 + i + 2, lane)];
            } else if (chn >= 0) {
              nx[i & 1][t] = xp[xp_index(kx, t, chn * 4 + i - 2, lane)];
            }
          } else if (gi != 0) {
            bf[t] = xp[xp_index(kx, t, ch * 4 + i, lane)];
          } else if (xrow[t] != nullptr) {
            const uint16_t* xb = xrow[t] + ch * 128 + 32 * i + 2 * q;
            bf[t] = b_frags(ld32(xb), ld32(xb + 8), ld32(xb + 16), ld32(xb + 24));
          } else {
            bf[t] = make_uint4(0u, 0u, 0u, 0u);
          }
        }
        if (SPLIT && (i & 1)) {
          slice_mma<MT, BF16, DEC == DEC_INT4>(accx, wra[i], wrb[i], sca[i], scb[i], bf);
        } else {
          slice_mma<MT, BF16, DEC == DEC_INT4>(acc, wra[i], wrb[i], sca[i], scb[i], bf);
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
    if (pf && u0 < u1) {  // the first unit's fragments (x is complete: this stage's wait is behind us)
      const int w0 = u0 - b * G.u;
      load_x(w0 >= G.kc ? w0 - G.kc : w0);
    }
    for (int u = u0; u < u1; ++b) {
      const int bend = (b + 1) * G.u, stop = bend < u1 ? bend : u1;
      for (int within = u - b * G.u; u < stop; ++u, ++within) {
        // the chunk of this warp's next unit (-1: none): the next within the block, or chunk 0 of the next block
        int chn = -1;
        if (u + 1 < u1) {
          const int wn = within + 1 == G.u ? 0 : within + 1;
          chn = wn >= G.kc ? wn - G.kc : wn;
        }
        if (within >= G.kc) {
          chunk(acc1, acc1x, within - G.kc, chn);
        } else {
          chunk(acc0, acc0x, within, chn);
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
      if constexpr (W8) row_scale<MT, BF16>(va, QERL_SEL(p, gi, s), rb * 16, g);
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
        if constexpr (W8) row_scale<MT, BF16>(vu, p.g[1].s, ((p.I >> 4) + b) * 16, g);
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
              if constexpr (!W8) *xp_element(p.xp + (size_t)MT * (p.H >> 5) * 32, p.I, tok, k) = a;
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
    if constexpr (W8) {  // x2 as rows [M][H] in the xp buffer (W8 reads rows), this CTA's share of its u32 pairs
      uint32_t* x2r = reinterpret_cast<uint32_t*>(p.xp);
      const int hp = p.H >> 1, n = p.M * hp;
      for (int id = (int)((long long)c * n / C) + (int)threadIdx.x; id < (int)((long long)(c + 1) * n / C);
           id += NG * 32) {
        const int tok = id / hp, k = 2 * (id - tok * hp);
        x2r[id] = shrink_pair<MT, BF16>(p, 1, tok, k, rsm);
      }
    } else {
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
  end_of_launch<NCNT>(p.cnt, C_END);
}

// Every decode's kernel; the CTAs per SM that all fit (the host sizes one grid for any).
template <int MT, bool BF16>
cudaError_t prepare(int& ctas_per_sm) {
  int i4 = 0, i8 = 0, f8 = 0;
  cudaError_t e = prepare_kernel(decode_mlp_kernel<MT, BF16, DEC_FP4>, Smem<MT>::BYTES, ctas_per_sm);
  if (e == cudaSuccess) e = prepare_kernel(decode_mlp_kernel<MT, BF16, DEC_INT4>, Smem<MT>::BYTES, i4);
  if (e == cudaSuccess) e = prepare_kernel(decode_mlp_kernel<MT, BF16, DEC_INT8>, Smem<MT, true>::BYTES, i8);
  if (e == cudaSuccess) e = prepare_kernel(decode_mlp_kernel<MT, BF16, DEC_FP8>, Smem<MT, true>::BYTES, f8);
  ctas_per_sm = min(min(ctas_per_sm, i4), min(i8, f8));
  return e;
}

template <int MT, bool BF16>
cudaError_t launch(const MlpParams& p, int ctas, cudaStream_t st, bool pdl) {
  const dim3 grid(ctas), block(NW * 32);
  switch (p.g[0].code) {
    case DEC_INT4:
      return launch_ex(decode_mlp_kernel<MT, BF16, DEC_INT4>, grid, block, Smem<MT>::BYTES, st, pdl, p);
    case DEC_INT8:
      return launch_ex(decode_mlp_kernel<MT, BF16, DEC_INT8>, grid, block, Smem<MT, true>::BYTES, st, pdl, p);
    case DEC_FP8:
      return launch_ex(decode_mlp_kernel<MT, BF16, DEC_FP8>, grid, block, Smem<MT, true>::BYTES, st, pdl, p);
    default:
      return launch_ex(decode_mlp_kernel<MT, BF16, DEC_FP4>, grid, block, Smem<MT>::BYTES, st, pdl, p);
  }
}

}  // namespace qerl_dl

extern "C" {

// Set the shared-memory limit of every variant (outside any graph capture) and report how many CTAs of variant
// (mt, bf16) fit on one SM at once: the grid must not exceed that times the SM count (the CTAs wait on each other).
int qerl_dl_prepare(int mt, int bf16, int* ctas_per_sm) {
  return qerl_dl::prepare_variants(mt, bf16, ctas_per_sm, [](auto m, auto b, int& ctas) {
    return qerl_dl::prepare<decltype(m)::value, decltype(b)::value>(ctas);
  });
}

int qerl_dl_smem(int mt) { return mt == 1 ? qerl_dl::Smem<1, true>::BYTES : qerl_dl::Smem<2, true>::BYTES; }
// the build's knobs: ring stages per warp, CTAs per SM budgeted
int qerl_dl_stages() { return qerl_dl::S; }
int qerl_dl_minb() { return qerl_dl::MINB; }
int qerl_dl_xpf() { return qerl_dl::XPF ? 1 : 0; }

// One launch of the MLP half. Per GEMM g (o, gate/up, down), 9 pointers: weight, scales, global scale (null for
// MXFP4, INT4 and W8), A_cat, B_blk, shrink partials, GEMM partials, block counters, h; 9 ints: N, K, R, kseg, nseg,
// pmax (R = 0: no LoRA), scale bytes per chunk (8 NVFP4, 4 MXFP4, 2 INT4, 0 W8), MXFP4's exponent shift, the tile
// decode (DEC_*: one for all three GEMMs).
// Preconditions (kernels/decode_layer.py checks them): 4-bit weights tiled (N % 64 == 0), W8 weights row-major with
// attn rows 16-byte aligned, M <= 8 * mt <= 16, H % 128 == 0, I % 128 == 0, 4-byte aligned rows, R % 8 == 0 and
// R <= 256, cnt and block counters zeroed once.
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
    g.N = gint[9 * i + 0], g.K = gint[9 * i + 1], g.R = gint[9 * i + 2];
    g.kseg = gint[9 * i + 3], g.nseg = gint[9 * i + 4], g.pmax = gint[9 * i + 5];
    g.spc = gint[9 * i + 6], g.shift = gint[9 * i + 7], g.code = gint[9 * i + 8];
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
