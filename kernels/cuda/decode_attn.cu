// The attention half of a decoder layer's decode step, before the attention itself, as ONE persistent launch
// (NVFP4, MXFP4 or INT4 fused q/k/v weight, bf16/fp16 activations, M <= 16 tokens, one token per KV-cache slot), for
// Hopper (sm_90a). The sibling of decode_layer.cu's MLP half, on the same machinery (decode_common.cuh): 7 GEMM warps
// and one LoRA warp per CTA, at most as many CTAs as are resident at once, grid-wide counters between phases.
//
//   residual    hn = rnd(h + delta)  (delta: the previous layer's MLP output; none: hn = h)
//               + per (token, 16-column block) sums of hn^2, each in column order
//   qkv GEMM    y  = rnd(x @ Wqkv^T * alpha + hq Bqkv^T + bias),  x = rnd(w * rnd(hn * rs))  (RMSNorm)
//   RoPE        q, k: o1 = rnd(rnd(y1 c1) + rnd(-y2 s1)), o2 = rnd(rnd(y2 c2) + rnd(y1 s2)) at each token's position
//               (rotate_half: y1 = element i of a head, y2 = element i + D/2); q to q_out, k and v (as is) into the
//               layer's cache at (slot = token, its position)
//
// (rnd: rounding to the activation dtype where the present decode path stores that dtype: add_rmsnorm, the cuda FP4
// GEMM's epilogue with its LoRA expand and fp32 bias, rope_kv_write.)
//
// Phases. Only one grid-wide wait precedes the GEMM: every CTA writes its share of hn and of the sums of squares
// (GEMM warps), counts itself on C_N; then each CTA's GEMM warps compute 1/rms of every token (a warp per token, the
// MLP half's fixed order) and the GEMM reads x in mma fragment order FORMED ON THE FLY from hn, w and 1/rms (per
// unit 4 x MT fragment uint4s: the same bits a norm phase would store, without the second grid-wide wait that phase
// and its x buffer would cost; the qkv GEMM has ~4 units per warp at 7B, so the extra instructions are few).
// The LoRA warp of each CTA waits on C_N too, computes 1/rms itself and its shrink units (x formed the same way),
// then the grid sums h in shares (C_S, C_H); a finishing warp waits for h only where it adds the expand.
//
// Units and RoPE pairs. RoPE needs both halves of a head (element i with i + D/2), so the GEMM's "block" is a PAIR of
// 16-row blocks of one head: rows [hd*D + 16j, +16) and the same + D/2, j < D/32, for every head hd of q, k and v (v
// pairs only so that the stage is uniform; they are not rotated). A pair's units are its first half's 128-wide K
// chunks, then its second half's (as gate/up's pairs in the MLP half), the W = C x 7 GEMM warps take equal contiguous
// ranges of the pairs' units, and the warp that counts a pair's last partial sums both halves in warp order: it then
// holds y1 and y2 of the same 16 x 8 fragment positions and rotates them in registers, no scratch or second wait.
//
// Weights never wait: the ring is filled before griddepcontrol.wait and each warp prefetches the next units of its
// range into L2 before the C_N wait, as in the MLP half. The last CTA zeroes the counters (graph replays need no
// reset). Build-time knobs: QERL_DL_S, QERL_DL_MINB (decode_common.cuh).
#include "decode_common.cuh"

namespace qerl_dl {

// grid-wide counters: residual + sums of squares written, shrink partials written, h summed, the launch's end
constexpr int A_N = 0, A_S = 1, A_H = 2, A_END = 3, A_NCNT = 4;

struct AttnParams {
  Gemm g;                 // the fused q/k/v: N = (HQ + 2 HK) D rows, K = H
  const float* bias;      // fp32 [N] or null
  const uint16_t* hres;   // [M, H] rows ld_h apart: the residual stream
  const uint16_t* delta;  // [M, H] rows ld_d apart: the previous layer's MLP output, or null
  const uint16_t* nw;     // [H] input RMSNorm weight
  uint16_t* hout;         // [M, H] hn = h + delta (null with no delta: hn is hres)
  float* ss;              // [H/16][M] sums of hn^2 per 16-column block
  const uint16_t* cos;    // [max_len, D] RoPE tables (activation dtype), rows ld_cs apart
  const uint16_t* sin;
  const long long* pos;   // [M] each token's position (= its cache row)
  uint16_t* q;            // [M, HQ * D] rotated q
  uint16_t* kc;           // the layer's K cache: (slot, pos, kv head, d) at slot*kc_slot + pos*kc_pos + head*D + d
  uint16_t* vc;           // V cache, likewise
  long long kc_slot, kc_pos, vc_slot, vc_pos;
  unsigned* cnt;          // [A_NCNT] zero between launches
  float eps;
  int M, H, HQ, HK, D, ld_h, ld_d, ld_cs;
};

// The hn rows (written in this launch when there is a delta) and their stride.
__device__ __forceinline__ const uint16_t* hn_rows(const AttnParams& p) { return p.delta ? p.hout : p.hres; }
__device__ __forceinline__ int hn_ld(const AttnParams& p) { return p.delta ? p.H : p.ld_h; }

// x pair (tok, k), (tok, k + 1) of the RMSNorm output, 0 past M (rsm: 1/rms per token in shared memory).
template <bool BF16>
__device__ __forceinline__ uint32_t x_pair(const AttnParams& p, const uint16_t* hn, int ld, int tok, int k,
                                           const float* rsm) {
  if (tok >= p.M) return 0u;
  return norm_pair<BF16>(ld32(hn + (size_t)tok * ld + k), *reinterpret_cast<const uint32_t*>(p.nw + k), rsm[tok]);
}

// Stage geometry: N / 32 pairs, 2 x K/128 units per pair.
__device__ __forceinline__ Geo attn_geo(const AttnParams& p, int w) {
  const int kc = p.g.K >> 7, nb = p.g.N >> 5, u = 2 * kc, t = nb * u;
  return Geo{nb, u, kc, t, t < w ? t : w};
}
// First weight row of half `hf` of pair b: head b / (D/32), 16-row block b % (D/32) of its first half.
__device__ __forceinline__ int pair_row(const AttnParams& p, int b, int hf) {
  const int per = p.D >> 5;
  return (b / per) * p.D + (b % per) * 16 + hf * (p.D >> 1);
}

// Residual share: (token, 16-column block) items [c n / C, (c+1) n / C) of n = M x H/16, a GEMM-warp thread each:
// hn = rnd(h + delta) written (with a delta), the block's sum of hn^2 in column order.
template <bool BF16>
__device__ __forceinline__ void residual_share(const AttnParams& p, int c, int C) {
  const int nb = p.H >> 4, n = p.M * nb;
  const int hi = (int)((long long)(c + 1) * n / C);
  for (int id = (int)((long long)c * n / C) + (int)threadIdx.x; id < hi; id += NG * 32) {
    const int tok = id / nb, b = id - tok * nb;
    const uint16_t* hr = p.hres + (size_t)tok * p.ld_h + b * 16;
    float s2 = 0.f;
#pragma unroll
    for (int k = 0; k < 16; k += 2) {
      uint32_t hv = ld32(hr + k);
      if (p.delta != nullptr) {
        const uint32_t dv = ld32(p.delta + (size_t)tok * p.ld_d + b * 16 + k);
        const uint16_t lo = r16<BF16>(__fadd_rn(f16<BF16>((uint16_t)(hv & 0xffffu)), f16<BF16>((uint16_t)(dv & 0xffffu))));
        const uint16_t hi2 = r16<BF16>(__fadd_rn(f16<BF16>((uint16_t)(hv >> 16)), f16<BF16>((uint16_t)(dv >> 16))));
        hv = (uint32_t)lo | ((uint32_t)hi2 << 16);
        *reinterpret_cast<uint32_t*>(p.hout + (size_t)tok * p.H + b * 16 + k) = hv;
      }
      const float a = f16<BF16>((uint16_t)(hv & 0xffffu)), d = f16<BF16>((uint16_t)(hv >> 16));
      s2 = k == 0 ? __fmul_rn(a, a) : __fadd_rn(s2, __fmul_rn(a, a));
      s2 = __fadd_rn(s2, __fmul_rn(d, d));
    }
    p.ss[(size_t)b * p.M + tok] = s2;
  }
}

// RoPE half-products and sum with the present path's roundings (rope_kv_write).
template <bool BF16>
__device__ __forceinline__ void rope(float y1, float y2, float c1, float s1, float c2, float s2, uint16_t& o1,
                                     uint16_t& o2) {
  o1 = r16<BF16>(__fadd_rn(f16<BF16>(r16<BF16>(__fmul_rn(y1, c1))), f16<BF16>(r16<BF16>(__fmul_rn(-y2, s1)))));
  o2 = r16<BF16>(__fadd_rn(f16<BF16>(r16<BF16>(__fmul_rn(y2, c2))), f16<BF16>(r16<BF16>(__fmul_rn(y1, s2)))));
}

// SPC, the scale bytes per 128-wide chunk of a row, names the format: 8 NVFP4 (E4M3 scale per 16 weights, global
// scale), 4 MXFP4 (E8M0 per 32, exponent shift) or 2 INT4 (a 16-bit scale per 128): a template parameter here, so
// decode_common.cuh's format helpers fold at compile time (a run-time switch, as the MLP half has, costs this kernel
// a spilled register at two token tiles)
template <int MT, bool BF16, int SPC>
__global__ void __launch_bounds__(NW * 32, MINB) decode_attn_kernel(const AttnParams p) {
  using L = Smem<MT>;
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem);
  uint2* scs = reinterpret_cast<uint2*>(smem + L::RING);
  float* rsm = reinterpret_cast<float*>(smem + L::RING + L::SC + L::CS);  // [16] GEMM warps', then [16] LoRA warp's
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int c = blockIdx.x, C = gridDim.x, W = C * NG, v = c * NG + warp;
  uint32_t* cvt = reinterpret_cast<uint32_t*>(smem + L::RING + L::SC) + warp * 64;
  const Geo G = attn_geo(p, W);
  const int kc = G.kc, isk = kc * SPC;

  // the issue cursor over this warp's units: pair ib, unit iw within it, il left; the unit's weight piece / scales
  // (within a half the next unit is one tiled 4 KiB chunk / 8 scale bytes further)
  int ib = 0, iw = 0, il = 0;
  const uint8_t *iwp = nullptr, *isp = nullptr;
  const uint64_t pol = evict_first_policy();
  auto unit_addr = [&](int b, int within) {
    const int hf = within >= kc, ch = within - hf * kc, row = pair_row(p, b, hf);
    iwp = p.g.w + ((size_t)(row >> 6) * kc + ch) * 4096 + (row & 63) * 64;
    isp = p.g.s + (size_t)row * isk + ch * SPC;
  };
  const int u0 = range_first(G, v), u1 = range_first(G, v + 1);
  if (warp < NG && u1 > u0) {
    il = u1 - u0, ib = u0 / G.u, iw = u0 - ib * G.u;
    unit_addr(ib, iw);
  }
  auto issue = [&](int slot) {
    uint4* dst = ring + (slot * NG + warp) * 64;
    cp_async16_stream(dst + lane, iwp + g * 64 + q * 16, pol);
    cp_async16_stream(dst + 32 + lane, iwp + (g + 8) * 64 + q * 16, pol);
    if (lane < 16) cp_scales(scs + (slot * NG + warp) * 16 + lane, isp + lane * isk, SPC, pol);
    --il;
    if (++iw == G.u) {
      ++ib, iw = 0;
      if (il > 0) unit_addr(ib, 0);
    } else if (iw == kc) {  // the pair's second half starts
      unit_addr(ib, iw);
    } else {
      iwp += 4096, isp += SPC;
    }
  };
  if (warp < NG) {
#pragma unroll
    for (int st = 0; st < S - 1; ++st) {  // the ring fills before the previous kernel of the stream is waited for
      if (il > 0) issue(st);
      cp_async_commit();
    }
    // and the next units of the range into L2 (lane i: unit u0 + S - 1 + i)
    const int x = u0 + (S - 1) + lane;
    if (lane < PF_UNITS && x < u1) {
      const int b = x / G.u, within = x - b * G.u, hf = within >= kc, row = pair_row(p, b, hf);
      prefetch_l2(p.g.w + ((size_t)(row >> 6) * kc + within - hf * kc) * 4096 + (row & 63) * 64, 1024);
    }
  }
  if (p.g.R > 0) {  // the LoRA factors do not depend on the previous kernel either
    prefetch_share(p.g.a, (size_t)p.g.R * p.g.K * 2, c, C);
    prefetch_share(p.g.b, (size_t)p.g.R * p.g.N * 2, c, C);
  }
  pdl_launch();
  pdl_wait();

  const uint16_t* hn = hn_rows(p);
  const int ldn = hn_ld(p);
  if (warp == LW) {
    // the LoRA warp: 1/rms per token once the residual is complete, the shrink with x formed on the fly, h summed
    // by every CTA's share
    if (p.g.R > 0) {
      float* rsl = rsm + 16;
      wait_warp(p.cnt + A_N, C);
      for (int tok = 0; tok < p.M; ++tok) {
        const float r = inv_rms_of(p.ss, p.H, p.M, p.eps, tok, lane);
        if (lane == 0) rsl[tok] = r;
      }
      __syncwarp();
      shrink_run<MT, BF16>(p.g.a, p.g.hp, p.g.K, p.g.R, p.g.kseg, p.g.nseg, p.M, c, C,
                           [&](int tok, int k) { return x_pair<BF16>(p, hn, ldn, tok, k, rsl); });
      arrive_warp(p.cnt + A_S);
      wait_warp(p.cnt + A_S, C);
      sum_h_share<BF16>(p.g.hp, p.g.hg, p.g.nseg, p.M * p.g.R, c, C);
      arrive_warp(p.cnt + A_H);
    }
  } else {
    residual_share<BF16>(p, c, C);
    arrive_gemm(p.cnt + A_N);
    wait_gemm(p.cnt + A_N, C);
    for (int tok = warp; tok < p.M; tok += NG) {  // 1/rms of token warp + NG i
      const float r = inv_rms_of(p.ss, p.H, p.M, p.eps, tok, lane);
      if (lane == 0) rsm[tok] = r;
    }
    bar_gemm();

    // the qkv GEMM over this warp's range; with one token tile the odd 32-wide slices go to a second accumulator
    // (acc0x, acc1x), so that consecutive mma do not wait on each other's result
    constexpr bool SPLIT = MT == 1;
    const float alpha = gemm_alpha(SPC, p.g.gs, p.g.shift);
    float acc0[MT][4], acc1[MT][4], acc0x[MT][4], acc1x[MT][4];
#pragma unroll
    for (int t = 0; t < MT; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc0[t][e] = acc1[t][e] = acc0x[t][e] = acc1x[t][e] = 0.f;
    }
    int j = 0;  // ring position
    auto chunk = [&](float (&acc)[MT][4], float (&accx)[MT][4], int ch) {
      cp_async_wait<S - 2>();
      __syncwarp();  // the slot's scales came from other lanes; the slot refilled next was read by all lanes
      if (il > 0) issue((j + S - 1) & (S - 1));
      cp_async_commit();
      const int sl = j & (S - 1);
      const uint4* src = ring + (sl * NG + warp) * 64;
      const uint4 wa = src[lane], wb = src[32 + lane];
      {  // the unit's 16 rows x 4 slices of scale pairs, converted once (lane: row lane/2, slices 2(lane&1) + 0/1)
        const uint2 raw = scs[(sl * NG + warp) * 16 + (lane >> 1)];
        const int i0 = 2 * (lane & 1);
        *reinterpret_cast<uint2*>(cvt + (lane >> 1) * 4 + i0) = scale_pairs2<BF16>(raw, i0, SPC, p.g.shift);
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
        for (int t = 0; t < MT; ++t) {  // x of token t*8 + g, columns ch*128 + 32i + 8jj + 2q: formed here
          const int tok = t * 8 + g, k = ch * 128 + 32 * i + 2 * q;
          bf[t] = b_frags(x_pair<BF16>(p, hn, ldn, tok, k, rsm), x_pair<BF16>(p, hn, ldn, tok, k + 8, rsm),
                          x_pair<BF16>(p, hn, ldn, tok, k + 16, rsm), x_pair<BF16>(p, hn, ldn, tok, k + 24, rsm));
        }
        if (SPLIT && (i & 1)) {
          slice_mma<MT, BF16, SPC == 2>(accx, wra[i], wrb[i], sca[i], scb[i], bf);
        } else {
          slice_mma<MT, BF16, SPC == 2>(acc, wra[i], wrb[i], sca[i], scb[i], bf);
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
    const int half = p.D >> 1, R = p.g.R;
    int b = u0 / G.u;
    for (int u = u0; u < u1; ++b) {
      const int bend = (b + 1) * G.u, stop = bend < u1 ? bend : u1;
      for (int within = u - b * G.u; u < stop; ++u, ++within) {
        if (within >= kc) {
          chunk(acc1, acc1x, within - kc);
        } else {
          chunk(acc0, acc0x, within);
        }
      }
      // the pair's partial from this warp, counted; the last of its warps finishes the pair
      const int vf = warp_of(G, b * G.u), np = warp_of(G, bend - 1) - vf + 1;
      const float4* slot0 = p.g.part + (size_t)b * p.g.pmax * 2 * MT * 32;
      float4* mine = p.g.part + ((size_t)b * p.g.pmax + (v - vf)) * 2 * MT * 32;
      put(acc0, acc0x, mine);
      put(acc1, acc1x, mine + MT * 32);
      __threadfence();
      __syncwarp();
      unsigned old = 0;
      if (lane == 0) old = atomicAdd(p.g.bcnt + b, 1u);
      old = __shfl_sync(0xffffffffu, old, 0);
      if (old + 1 < (unsigned)np) continue;
      __threadfence();
      if (lane == 0) p.g.bcnt[b] = 0u;  // every partial of the pair is counted: none will touch it again this launch
      float y1[MT][4], y2[MT][4];
      sum_block<MT>(y1, slot0, 2, 0, np, alpha, lane);
      sum_block<MT>(y2, slot0, 2, 1, np, alpha, lane);
      const int row1 = pair_row(p, b, 0), row2 = row1 + half;
      if (R > 0) {  // h is summed by the LoRA warps beside the GEMM (long done, as a rule)
        wait_warp(p.cnt + A_H, C);
        lora_expand<MT, BF16>(y1, p.g.b, R, row1, p.g.hg, p.M, g, q);
        lora_expand<MT, BF16>(y2, p.g.b, R, row2, p.g.hg, p.M, g, q);
      }
      // y[t][e]: token t*8 + 2q + (e & 1), row + g + 8*(e >> 1); the head's element i = row - head*D + g + 8(e>>1)
      const int head = row1 / p.D, i0 = row1 - head * p.D;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = i0 + g + 8 * (e >> 1);
        const float b1 = p.bias != nullptr ? p.bias[row1 + g + 8 * (e >> 1)] : 0.f;
        const float b2 = p.bias != nullptr ? p.bias[row2 + g + 8 * (e >> 1)] : 0.f;
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          const int tok = t * 8 + 2 * q + (e & 1);
          if (tok >= p.M) continue;
          // the GEMM output as the present path stores it: fp32 (acc x alpha + LoRA) + bias, rounded once
          uint16_t o1 = r16<BF16>(p.bias != nullptr ? __fadd_rn(y1[t][e], b1) : y1[t][e]);
          uint16_t o2 = r16<BF16>(p.bias != nullptr ? __fadd_rn(y2[t][e], b2) : y2[t][e]);
          const long long ps = p.pos[tok];
          if (head < p.HQ + p.HK) {
            const uint16_t* cr = p.cos + (size_t)ps * p.ld_cs;
            const uint16_t* sr = p.sin + (size_t)ps * p.ld_cs;
            rope<BF16>(f16<BF16>(o1), f16<BF16>(o2), f16<BF16>(cr[i]), f16<BF16>(sr[i]), f16<BF16>(cr[i + half]),
                       f16<BF16>(sr[i + half]), o1, o2);
          }
          uint16_t* dst;
          if (head < p.HQ) {
            dst = p.q + (size_t)tok * p.HQ * p.D + (size_t)head * p.D;
          } else if (head < p.HQ + p.HK) {
            dst = p.kc + tok * p.kc_slot + ps * p.kc_pos + (long long)(head - p.HQ) * p.D;
          } else {
            dst = p.vc + tok * p.vc_slot + ps * p.vc_pos + (long long)(head - p.HQ - p.HK) * p.D;
          }
          dst[i] = o1;
          dst[i + half] = o2;
        }
      }
    }
  }
  end_of_launch<A_NCNT>(p.cnt, A_END);
}

// Every format's kernel; the CTAs per SM that all fit (the host sizes one grid for any).
template <int MT, bool BF16>
cudaError_t prepare(int& ctas_per_sm) {
  int mx = 0, i4 = 0;
  cudaError_t e = prepare_kernel(decode_attn_kernel<MT, BF16, 8>, Smem<MT>::BYTES, ctas_per_sm);
  if (e == cudaSuccess) e = prepare_kernel(decode_attn_kernel<MT, BF16, 4>, Smem<MT>::BYTES, mx);
  if (e == cudaSuccess) e = prepare_kernel(decode_attn_kernel<MT, BF16, 2>, Smem<MT>::BYTES, i4);
  ctas_per_sm = min(ctas_per_sm, min(mx, i4));
  return e;
}

template <int MT, bool BF16>
cudaError_t launch(const AttnParams& p, int ctas, cudaStream_t st, bool pdl) {
  const dim3 grid(ctas), block(NW * 32);
  if (p.g.spc == 8) return launch_ex(decode_attn_kernel<MT, BF16, 8>, grid, block, Smem<MT>::BYTES, st, pdl, p);
  if (p.g.spc == 4) return launch_ex(decode_attn_kernel<MT, BF16, 4>, grid, block, Smem<MT>::BYTES, st, pdl, p);
  return launch_ex(decode_attn_kernel<MT, BF16, 2>, grid, block, Smem<MT>::BYTES, st, pdl, p);
}

}  // namespace qerl_dl

extern "C" {

// Set the shared-memory limit of every variant (outside any graph capture) and report how many CTAs of variant
// (mt, bf16) fit on one SM at once: the grid must not exceed that times the SM count (the CTAs wait on each other).
int qerl_da_prepare(int mt, int bf16, int* ctas_per_sm) {
  return qerl_dl::prepare_variants(mt, bf16, ctas_per_sm, [](auto m, auto b, int& ctas) {
    return qerl_dl::prepare<decltype(m)::value, decltype(b)::value>(ctas);
  });
}

int qerl_da_stages() { return qerl_dl::S; }
int qerl_da_minb() { return qerl_dl::MINB; }

// One launch of the attention half. gptr: the q/k/v GEMM's weight, scales, global scale, A_cat, B_blk, shrink
// partials, GEMM partials, pair counters, h (9 pointers, as decode_layer.cu's per GEMM); gint: N, K, R, kseg, nseg,
// pmax, scale bytes per chunk (8 NVFP4, 4 MXFP4, 2 INT4), MXFP4's exponent shift, the tile decode (4-bit only: the
// kernel is chosen by the scale bytes). Preconditions (kernels/decode_layer.py checks them): tiled weight
// (N % 64 == 0), N = (hq + 2 hk) d, d % 32 == 0, K = H % 128 == 0, M <= 8 * mt <= 16, 4-byte aligned rows, R % 8 == 0
// and R <= 256, token m's cache slot is m, cnt and the pair counters zeroed once.
int qerl_da_attn(const void* const* gptr, const int* gint, const float* bias, const void* hres, const void* delta,
                 const void* nw, void* hout, float* ss, const void* cos, const void* sin, const long long* pos,
                 void* q, void* kc, void* vc, long long kc_slot, long long kc_pos, long long vc_slot,
                 long long vc_pos, unsigned* cnt, float eps, int M, int H, int hq, int hk, int d, int ld_h, int ld_d,
                 int ld_cs, int mt, int bf16, int ctas, int pdl, void* stream) {
  qerl_dl::AttnParams p{};
  qerl_dl::Gemm& g = p.g;
  g.w = static_cast<const uint8_t*>(gptr[0]);
  g.s = static_cast<const uint8_t*>(gptr[1]);
  g.gs = static_cast<const float*>(gptr[2]);
  g.a = static_cast<const uint16_t*>(gptr[3]);
  g.b = static_cast<const uint16_t*>(gptr[4]);
  g.hp = static_cast<float*>(const_cast<void*>(gptr[5]));
  g.part = static_cast<float4*>(const_cast<void*>(gptr[6]));
  g.bcnt = static_cast<unsigned*>(const_cast<void*>(gptr[7]));
  g.hg = static_cast<uint16_t*>(const_cast<void*>(gptr[8]));
  g.N = gint[0], g.K = gint[1], g.R = gint[2], g.kseg = gint[3], g.nseg = gint[4], g.pmax = gint[5];
  g.spc = gint[6], g.shift = gint[7], g.code = gint[8];
  p.bias = bias;
  p.hres = static_cast<const uint16_t*>(hres);
  p.delta = static_cast<const uint16_t*>(delta);
  p.nw = static_cast<const uint16_t*>(nw);
  p.hout = static_cast<uint16_t*>(hout);
  p.ss = ss;
  p.cos = static_cast<const uint16_t*>(cos);
  p.sin = static_cast<const uint16_t*>(sin);
  p.pos = pos;
  p.q = static_cast<uint16_t*>(q);
  p.kc = static_cast<uint16_t*>(kc);
  p.vc = static_cast<uint16_t*>(vc);
  p.kc_slot = kc_slot, p.kc_pos = kc_pos, p.vc_slot = vc_slot, p.vc_pos = vc_pos;
  p.cnt = cnt;
  p.eps = eps;
  p.M = M, p.H = H, p.HQ = hq, p.HK = hk, p.D = d, p.ld_h = ld_h, p.ld_d = ld_d, p.ld_cs = ld_cs;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const bool dd = pdl != 0;
  if (mt == 1) return bf16 ? qerl_dl::launch<1, true>(p, ctas, st, dd) : qerl_dl::launch<1, false>(p, ctas, st, dd);
  return bf16 ? qerl_dl::launch<2, true>(p, ctas, st, dd) : qerl_dl::launch<2, false>(p, ctas, st, dd);
}

}  // extern "C"
