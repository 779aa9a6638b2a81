// qerl's W4A16 FP4 GEMM for Hopper (sm_90a): y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias).
//
// The weight is read in qerl's resident byte order (kernels/fp4.py `repack_fp4`, row or tiled): in
// every 64-byte unit of a row (128 weights), byte 16*q + g holds checkpoint byte 4*g + q. The tensor-core
// instruction is mma.sync.m16n8k16 with the WEIGHT as operand A (16 output features) and the
// activations as operand B (8 tokens), so M = 1..8 wastes nothing on the weight side. Lane (g, q) of a
// warp owns rows g and g+8 of a 16-row block and, per 128-wide K chunk, exactly the 16 bytes 16q..16q+15
// of each of those two rows: one 16-byte global load per row per chunk, straight into registers (no
// shared memory, no thread reads another thread's weight bytes). The K order inside each 32-wide slice
// is permuted (the same permutation on the activation side; docs/kernels.md gives the table) so that a
// packed pair of 16-bit weights comes out of one u32 of codes by a mask, a shift and a lop3, and both
// halves of the pair share one packed pair of block scales.
//
// Decode: a code's sign goes to bit 15 and its 3 magnitude bits to bits 8..6 (bf16) or 11..9 (fp16),
// which reads as value * 2^-126 (bf16; code 0.5 is a bf16 subnormal) or value * 2^-14 (fp16). One
// packed multiply by the block scale pre-multiplied by 2^(126-8) (bf16) or 2^(14-8) (fp16) gives
// code * scale * 2^-8 exactly (<= 6 significant bits, in range). The fp32 accumulator is multiplied by
// 2^8 / global_scale (NVFP4) or 2^-F (MXFP4, F = per-tensor exponent shift) once at the end.
//
// Work split: a CTA owns WN 16-row blocks, one M tile (8*MT tokens) and one K range (split); each block
// has WK warps that take the range's chunks round-robin, each keeping DEPTH chunks of weight loads in
// flight, and sum their fp32 partials through shared memory in warp order. Split K across CTAs writes
// fp32 partials to a workspace summed by a second kernel in split order. No atomics anywhere: results are
// bit-identical from run to run. The host side (kernels/cuda_fp4.py launch_plan) picks the configuration.
//
// Decode-size plans (M <= 64; docs/kernels.md "Decode at the byte floor"): persistent "stream" kernels whose CTAs,
// sized to the SM count, each take one contiguous range of (K segment, row group, 128-wide chunk) units, so every
// SM streams the same number of weight bytes; weights and block scales go through a cp.async ring of S stages in
// shared memory (bytes in flight no longer cost registers); with programmatic dependent launch a CTA fills its ring
// before griddepcontrol.wait, i.e. while the previous kernel of the stream still runs (only the activations depend
// on it). A row group cut by a CTA boundary or a K segment leaves fp32 pieces that a fix-up kernel sums in a fixed
// order (no atomics). The decode kernel (M <= 16) has 8 warps on one 16-row block splitting its chunks; the wide
// kernel (M <= 64) has every warp on its own 16-row blocks of one chunk, whose activation slice all warps share
// from shared memory.
//
// LoRA expand in the epilogue: y = x dequant(W)^T (+ bias) + lora_h[M, R] @ lora_b[N, R]^T, the product on the
// tensor cores (lora_b rows as operand A, lora_h rows as operand B: the same fragments as the main loop),
// accumulated in fp32 into the fp32 result before its one rounding.
#ifdef __CUDACC_RTC__  // NVRTC: device code only (a syntax and register check without nvcc)
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#else
#include <cuda_runtime.h>
#include <stdint.h>
#endif
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include "fp4_frag.cuh"

namespace qerl {

struct Params {
  const uint16_t* x;   // [M, K] bf16/fp16, rows ldx apart
  const uint4* xp;     // permuted activations (PERM kernels), see permute_x_kernel
  const uint8_t* w;    // repacked weight, [N, K/2] bytes
  const uint8_t* s;    // checkpoint block scales, [N, K/16] e4m3 (NVFP4) or [N, K/32] e8m0 (MXFP4)
  const float* gs;     // NVFP4 global scale [1]
  const float* bias;   // fp32 [N] or null
  void* y;             // [M, N] activation dtype
  float* ws;           // [splits, M, N] fp32 partials when splits > 1
  int M, N, K, ldx, tiled, shift, splits, cps;  // cps: K chunks per split
  // LoRA expand (null lh: off): lh [M, R] rows ldh apart, lb [N, R] contiguous, both in the activation dtype;
  // wsl [M, N] fp32: the LoRA term of a split-K legacy plan, written by the CTAs of split 0
  const uint16_t* lh;
  const uint16_t* lb;
  float* wsl;
  int R, ldh;
  // stream plans: slots [ctas][2][M][grows] fp32 pieces of portions cut by a CTA boundary, wseg [nseg][M][N] fp32
  // per-segment values; ctas CTAs per M group, nseg K segments of kcs chunks, pmode: ranges of whole portions
  float* slots;
  float* wseg;
  int ctas, nseg, kcs, pmode, grows, cpsm;  // cpsm: CTAs per SM the grid is sized for
};

__device__ __forceinline__ uint4 ld_stream(const uint8_t* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ uint2 ld_u64(const uint8_t* p) {
  uint2 r;
  asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}
__device__ __forceinline__ uint32_t ld_u32(const uint8_t* p) {
  uint32_t r;
  asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}

template <int MT, bool PERM>
__device__ __forceinline__ void load_b(uint4 (&b)[MT], const Params& p, const uint16_t* const (&xrow)[MT],
                                       int tile0, int c, int i, int lane) {
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    if constexpr (PERM) {
      b[t] = p.xp[((size_t)(tile0 + t) * (p.K >> 5) + (c * 4 + i)) * 32 + lane];
    } else {
      if (xrow[t] != nullptr) {
        const uint16_t* base = xrow[t] + c * 128 + 32 * i + 2 * (lane & 3);
        const uint32_t x0 = __ldg(reinterpret_cast<const unsigned int*>(base));
        const uint32_t x1 = __ldg(reinterpret_cast<const unsigned int*>(base + 8));
        const uint32_t x2 = __ldg(reinterpret_cast<const unsigned int*>(base + 16));
        const uint32_t x3 = __ldg(reinterpret_cast<const unsigned int*>(base + 24));
        b[t] = b_frags(x0, x1, x2, x3);
      } else {
        b[t] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }
}

// One 128-wide K chunk: rows g (wa, sa) and g+8 (wb, sb) against MT tiles of 8 tokens.
template <int MT, bool NV, bool BF16, bool PERM>
__device__ __forceinline__ void chunk(float (&acc)[MT][4], const uint4 wa, const uint4 wb, const uint2 sa,
                                      const uint2 sb, const Params& p, const uint16_t* const (&xrow)[MT],
                                      int tile0, int c, int lane) {
  const uint32_t wra[4] = {wa.x, wa.y, wa.z, wa.w}, wrb[4] = {wb.x, wb.y, wb.z, wb.w};
  uint4 bcur[MT];
  load_b<MT, PERM>(bcur, p, xrow, tile0, c, 0, lane);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint4 bnext[MT];
    if (i < 3) load_b<MT, PERM>(bnext, p, xrow, tile0, c, i + 1, lane);
    const uint32_t spa = scale_pair<NV, BF16>(sa, i, p.shift), spb = scale_pair<NV, BF16>(sb, i, p.shift);
    const uint32_t qa = wra[i], qb = wrb[i];
    // V0: low nibbles of bytes (0,2) and (1,3); V1: high nibbles.
    const uint32_t a0 = mul2<BF16>(decode2<BF16>(qa << 12), spa), a1 = mul2<BF16>(decode2<BF16>(qb << 12), spb);
    const uint32_t a2 = mul2<BF16>(decode2<BF16>(qa << 4), spa), a3 = mul2<BF16>(decode2<BF16>(qb << 4), spb);
    const uint32_t a4 = mul2<BF16>(decode2<BF16>(qa << 8), spa), a5 = mul2<BF16>(decode2<BF16>(qb << 8), spb);
    const uint32_t a6 = mul2<BF16>(decode2<BF16>(qa), spa), a7 = mul2<BF16>(decode2<BF16>(qb), spb);
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      mma<BF16>(acc[t], a0, a1, a2, a3, bcur[t].x, bcur[t].y);
      mma<BF16>(acc[t], a4, a5, a6, a7, bcur[t].z, bcur[t].w);
    }
    if (i < 3) {
#pragma unroll
      for (int t = 0; t < MT; ++t) bcur[t] = bnext[t];
    }
  }
}

// ---- shared by the legacy and the stream kernels ---------------------------------------------------------
// y += lora_h . lora_b^T for the 16 rows n0.. of one block and MT token tiles from tile0, added into C fragments
// (rows g/g+8, tokens 2q/2q+1) by mma: lora_b rows are operand A (row-major [16 rows, 16 r]), lora_h rows operand
// B ([16 r, 8 tokens], col-major = token rows). R % 8 == 0: a last block of 8 has its upper half zero.
template <int MT, bool BF16>
__device__ __forceinline__ void lora_mma(float (&c)[MT][4], const Params& p, int n0, int tile0, int lane) {
  const int g = lane >> 2, q = lane & 3;
  const uint16_t* b0 = p.lb + (size_t)(n0 + g) * p.R + 2 * q;
  const uint16_t* b1 = b0 + (size_t)8 * p.R;
  const uint16_t* h[MT];
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    const int tok = (tile0 + t) * 8 + g;
    h[t] = tok < p.M ? p.lh + (size_t)tok * p.ldh + 2 * q : nullptr;
  }
  for (int r0 = 0; r0 < p.R; r0 += 16) {
    const bool hi = r0 + 8 < p.R;
    const uint32_t a0 = __ldg(reinterpret_cast<const unsigned int*>(b0 + r0));
    const uint32_t a1 = __ldg(reinterpret_cast<const unsigned int*>(b1 + r0));
    const uint32_t a2 = hi ? __ldg(reinterpret_cast<const unsigned int*>(b0 + r0 + 8)) : 0u;
    const uint32_t a3 = hi ? __ldg(reinterpret_cast<const unsigned int*>(b1 + r0 + 8)) : 0u;
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      const uint32_t x0 = h[t] != nullptr ? __ldg(reinterpret_cast<const unsigned int*>(h[t] + r0)) : 0u;
      const uint32_t x1 = (h[t] != nullptr && hi) ? __ldg(reinterpret_cast<const unsigned int*>(h[t] + r0 + 8)) : 0u;
      mma<BF16>(c[t], a0, a1, a2, a3, x0, x1);
    }
  }
}

template <bool BF16>
__device__ __forceinline__ void store_y(const Params& p, int tok, int n, float v) {
  if constexpr (BF16) {
    reinterpret_cast<__nv_bfloat16*>(p.y)[(size_t)tok * p.N + n] = __float2bfloat16_rn(v);
  } else {
    reinterpret_cast<__half*>(p.y)[(size_t)tok * p.N + n] = __float2half_rn(v);
  }
}

template <bool NV>
__device__ __forceinline__ float out_alpha(const Params& p) {
  return NV ? 256.0f / p.gs[0] : exp2f((float)(-p.shift));
}

// C fragments c[t] = {y[tok 2q][row g], y[2q+1][g], y[2q][g+8], y[2q+1][g+8]} of token tile t into a shared
// [MT * 8 tokens][16 rows] block.
template <int MT>
__device__ __forceinline__ void frag_to_shared(float* blk, const float (&c)[MT][4], int q, int g) {
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    float* r = blk + (t * 8 + 2 * q) * 16;
    r[g] = c[t][0];
    r[16 + g] = c[t][1];
    r[g + 8] = c[t][2];
    r[16 + g + 8] = c[t][3];
  }
}

template <int MT, int WN, int WK, bool NV, bool BF16, bool PERM>
__global__ void __launch_bounds__(WN * WK * 32, (WN * WK >= 8 || MT >= 8) ? 2 : 3) fp4_gemm_kernel(const Params p) {
  // chunks of weight loads in flight per warp (32 B per lane each): 4 at decode sizes, 2 for the 64-token
  // tile, whose accumulators and activation fragments need the registers
  constexpr int DEPTH = MT >= 8 ? 2 : 4;
  __shared__ float red[WN * WK][MT * 8 * 16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wn = warp / WK, wk = warp % WK;
  const int g = lane >> 2, q = lane & 3;
  const int mtile = blockIdx.x, sp = blockIdx.z;
  const int nb = blockIdx.y * WN + wn;  // this warp's 16-row block
  const bool live = nb * 16 < p.N;
  const int KC = p.K >> 7;
  const int r0 = live ? nb * 16 + g : g, r1 = r0 + 8;
  const size_t cstride = p.tiled ? 4096 : 64;
  const uint8_t* w0 = p.tiled ? p.w + (size_t)(r0 >> 6) * KC * 4096 + (r0 & 63) * 64 + q * 16
                              : p.w + (size_t)r0 * (p.K >> 1) + q * 16;
  const uint8_t* w1 = p.tiled ? p.w + (size_t)(r1 >> 6) * KC * 4096 + (r1 & 63) * 64 + q * 16
                              : p.w + (size_t)r1 * (p.K >> 1) + q * 16;
  const int spr = NV ? (p.K >> 4) : (p.K >> 5);  // scale bytes per row
  const int spc = NV ? 8 : 4;                    // scale bytes per chunk
  const uint8_t* s0 = p.s + (size_t)r0 * spr;
  const uint8_t* s1 = p.s + (size_t)r1 * spr;

  const int tile0 = mtile * MT;  // first 8-token tile of this CTA
  const uint16_t* xrow[MT];
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    const int tok = (tile0 + t) * 8 + g;
    xrow[t] = (!PERM && tok < p.M) ? p.x + (size_t)tok * p.ldx : nullptr;
  }

  const int cb = sp * p.cps, ce = min(KC, cb + p.cps);
  const int nj = (live && ce - cb - wk > 0) ? (ce - cb - wk + WK - 1) / WK : 0;

  float acc[MT][4];
#pragma unroll
  for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;

  uint4 ra[DEPTH], rb[DEPTH];
  uint2 sa[DEPTH], sb[DEPTH];
  auto issue = [&](int u, int j) {
    const int c = cb + wk + WK * j;
    ra[u] = ld_stream(w0 + c * cstride);
    rb[u] = ld_stream(w1 + c * cstride);
    if constexpr (NV) {
      sa[u] = ld_u64(s0 + c * spc);
      sb[u] = ld_u64(s1 + c * spc);
    } else {
      sa[u] = make_uint2(ld_u32(s0 + c * spc), 0u);
      sb[u] = make_uint2(ld_u32(s1 + c * spc), 0u);
    }
  };
#pragma unroll
  for (int u = 0; u < DEPTH; ++u)
    if (u < nj) issue(u, u);
  for (int j0 = 0; j0 < nj; j0 += DEPTH) {
#pragma unroll
    for (int u = 0; u < DEPTH; ++u) {
      const int j = j0 + u;
      if (j < nj) {
        const uint4 wa = ra[u], wb = rb[u];
        const uint2 xa = sa[u], xb = sb[u];
        if (j + DEPTH < nj) issue(u, j + DEPTH);  // refill the slot before the math: DEPTH chunks in flight
        chunk<MT, NV, BF16, PERM>(acc, wa, wb, xa, xb, p, xrow, tile0, cb + wk + WK * j, lane);
      }
    }
  }

  frag_to_shared<MT>(red[warp], acc, q, g);
  // the LoRA term of each row block (one warp per block, CTAs of split 0), in the same element order
  __shared__ float lred[WN][MT * 8 * 16];
  const bool lora = p.lh != nullptr && sp == 0;
  if (lora && wk == 0 && live) {
    float l[MT][4];
#pragma unroll
    for (int t = 0; t < MT; ++t) l[t][0] = l[t][1] = l[t][2] = l[t][3] = 0.f;
    lora_mma<MT, BF16>(l, p, nb * 16, tile0, lane);
    frag_to_shared<MT>(lred[wn], l, q, g);
  }
  __syncthreads();
  const float alpha = out_alpha<NV>(p);
  constexpr int PER = MT * 8 * 16;  // outputs of one row block and token tile group
  for (int e = threadIdx.x; e < WN * PER; e += WN * WK * 32) {
    const int bn = e / PER, el = e % PER;
    const int tok = tile0 * 8 + el / 16, n = (blockIdx.y * WN + bn) * 16 + (el & 15);
    if (tok >= p.M || n >= p.N) continue;
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < WK; ++v) sum += red[bn * WK + v][el];  // fixed order: deterministic
    if (p.splits > 1) {
      p.ws[((size_t)sp * p.M + tok) * p.N + n] = sum;
      if (lora) p.wsl[(size_t)tok * p.N + n] = lred[bn][el];
    } else {
      float out = sum * alpha;
      if (lora) out += lred[bn][el];
      if (p.bias != nullptr) out += p.bias[n];
      store_y<BF16>(p, tok, n, out);
    }
  }
}

// y = (sum over splits, in split order) * alpha (+ the LoRA term) + bias.
template <bool NV, bool BF16>
__global__ void splitk_reduce_kernel(const Params p) {
  const size_t total = (size_t)p.M * p.N;
  const float alpha = out_alpha<NV>(p);
  for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
    float sum = 0.f;
    for (int s = 0; s < p.splits; ++s) sum += p.ws[s * total + idx];
    float out = sum * alpha;
    if (p.lh != nullptr) out += p.wsl[idx];
    if (p.bias != nullptr) out += p.bias[idx % p.N];
    if constexpr (BF16) {
      reinterpret_cast<__nv_bfloat16*>(p.y)[idx] = __float2bfloat16_rn(out);
    } else {
      reinterpret_cast<__half*>(p.y)[idx] = __float2half_rn(out);
    }
  }
}

// xp[(tile * K/32 + kb) * 32 + lane] = the B fragments (b_frags) of lane (g, q) for tokens tile*8+g,
// slice kb; zero past M. One thread per (tile, kb, lane).
__global__ void permute_x_kernel(const Params p, int tiles) {
  pdl_launch();  // no-ops unless launched with programmatic serialization (stream plans under graph capture)
  pdl_wait();
  const size_t id = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  const int kb32 = p.K >> 5;
  if (id >= (size_t)tiles * kb32 * 32) return;
  const int lane = (int)(id & 31);
  const size_t unit = id >> 5;
  const int kb = (int)(unit % kb32), tile = (int)(unit / kb32);
  const int tok = tile * 8 + (lane >> 2);
  uint4 out = make_uint4(0u, 0u, 0u, 0u);
  if (tok < p.M) {
    const uint16_t* base = p.x + (size_t)tok * p.ldx + kb * 32 + 2 * (lane & 3);
    const unsigned int* b = reinterpret_cast<const unsigned int*>(base);
    out = b_frags(__ldg(b), __ldg(b + 4), __ldg(b + 8), __ldg(b + 12));
  }
  const_cast<uint4*>(p.xp)[id] = out;
}

// ---- stream plans: persistent CTAs over (K segment, row group, chunk) units, cp.async ring, PDL ----------------
// Unit order: K segment s (kcs chunks; the last may be shorter), then row group gr (grows rows), then the chunk
// within the segment. A portion is one (s, gr): the units one output value sums within a segment. CTA c of C takes
// units [c U / C, (c+1) U / C) (pmode 0) or the units of portions [c P / C, (c+1) P / C) (pmode 1). Mirrored by
// kernels/cuda_fp4.py (StreamSplit), whose CPU emulation replays this assignment and the fix-up below.
struct Split {  // 32-bit: the host checks U * ctas < 2^31
  int KC, KCS, nseg, Rg, U, SU;
  __host__ __device__ explicit Split(const Params& p)
      : KC(p.K >> 7), KCS(p.kcs), nseg(p.nseg), Rg((p.N + p.grows - 1) / p.grows) {
    U = Rg * KC;
    SU = Rg * KCS;
  }
  __host__ __device__ int len(int s) const { return KC - s * KCS < KCS ? KC - s * KCS : KCS; }
  __host__ __device__ int pstart(int pi) const {  // first unit of portion pi (P -> U)
    if (pi >= nseg * Rg) return U;
    const int s = pi / Rg;
    return s * SU + (pi - s * Rg) * len(s);
  }
  __host__ __device__ int portion(int u) const {
    const int s = u / SU < nseg - 1 ? u / SU : nseg - 1;
    return s * Rg + (u - s * SU) / len(s);
  }
  __host__ __device__ void range(int c, int C, bool pmode, int& u0, int& u1) const {
    if (pmode) {
      const int P = nseg * Rg;
      u0 = pstart(c * P / C);
      u1 = pstart((c + 1) * P / C);
    } else {
      u0 = c * U / C;
      u1 = (c + 1) * U / C;
    }
  }
  __host__ __device__ int owner(int u, int C) const { return ((u + 1) * C - 1) / U; }  // pmode 0
};

// The range a CTA takes: the cpsm CTAs that share an SM (blocks b, b + C/cpsm, ... as the block scheduler places a
// grid that fits at once) get neighbouring ranges, so they read the same activation slice (one K segment) from L1.
// Only locality depends on that placement; every range is taken by exactly one CTA either way.
__device__ __forceinline__ int range_index(const Params& p) {
  const int b = blockIdx.x, C = gridDim.x, per = p.cpsm;
  if (per <= 1 || C % per) return b;
  const int nsm = C / per;
  return (b % nsm) * per + b / nsm;
}

// One portion met by a CTA's range [u0, u1): segment s, row group gr, its units [ps, pe), the CTA's part [a, b);
// the K chunk of unit u of it is u + chunk0.
struct Portion {
  int s, gr, ps, pe, a, b, chunk0;
  Portion() = default;
  __device__ Portion(const Split& sp, int pi, int u0, int u1) {
    s = pi / sp.Rg;
    gr = pi - s * sp.Rg;
    ps = sp.pstart(pi);
    pe = sp.pstart(pi + 1);
    a = u0 > ps ? u0 : ps;
    b = u1 < pe ? u1 : pe;
    chunk0 = s * sp.KCS - ps;
  }
};

// Where a portion's value goes, for the CTA that computed the units [a, b) of portion [ps, pe) of segment s:
// the whole portion of a single segment: y (+ bias); a whole portion of several segments: wseg[s]; a piece: slot B
// of the CTA if it holds the portion's first unit or neither end, slot A if it holds the last unit only (so the
// fix-up sums B of the first .. second-to-last CTA, then A of the last, in CTA order).
template <bool BF16>
__device__ __forceinline__ void put_value(const Params& p, int c, const Portion& po, int tok, int n, int row, float v) {
  if (tok >= p.M || n >= p.N) return;
  const int s = po.s;
  const bool a_in = po.a == po.ps, b_in = po.b == po.pe;
  if (a_in && b_in) {
    if (p.nseg == 1) {
      store_y<BF16>(p, tok, n, p.bias != nullptr ? v + p.bias[n] : v);
    } else {
      p.wseg[((size_t)s * p.M + tok) * p.N + n] = v;
    }
  } else {
    const int ab = (a_in || !b_in) ? 1 : 0;
    p.slots[(((size_t)c * 2 + ab) * p.M + tok) * p.grows + row] = v;
  }
}

// All four packed scale pairs of a chunk for rows g (sa) and g+8 (sb): lane q converts pair q, the four lanes of
// a row share them by shuffles (the legacy kernel converts all four in every lane).
template <bool NV, bool BF16>
__device__ __forceinline__ void scale_pairs4(uint32_t (&spa)[4], uint32_t (&spb)[4], uint2 sa, uint2 sb, int shift,
                                             int lane) {
  const int q = lane & 3;
  const uint32_t ma = scale_pair<NV, BF16>(sa, q, shift), mb = scale_pair<NV, BF16>(sb, q, shift);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    spa[i] = __shfl_sync(0xffffffffu, ma, (lane & ~3) | i);
    spb[i] = __shfl_sync(0xffffffffu, mb, (lane & ~3) | i);
  }
}

// lane (g, q)'s 16 weight bytes of row r in chunk ch (repacked layout, row or tiled)
__device__ __forceinline__ const uint8_t* weight_at(const Params& p, int r, int ch, int KC, int q) {
  return p.tiled ? p.w + ((size_t)(r >> 6) * KC + ch) * 4096 + (r & 63) * 64 + q * 16
                 : p.w + (size_t)r * (p.K >> 1) + (size_t)ch * 64 + q * 16;
}

constexpr int DW = 8;  // warps of a decode-kernel CTA

template <int MT, int S>
struct DecodeLayout {  // dynamic shared memory of the decode kernel, bytes
  static constexpr int W = S * DW * 1024;           // [S][DW][2 rows][32 lanes] uint4: each lane's 16 bytes per row
  static constexpr int SC = S * DW * 16 * 8;        // [S][DW][16 rows] uint2: the chunk's block scales per row
  static constexpr int RED = 2 * DW * MT * 32 * 16;  // [2][DW][MT][32 lanes] float4: warp partials, two buffers
  static constexpr int BYTES = W + SC + RED;
};

// M <= 16: 8 warps on one 16-row block (grows = 16) take its chunks in the CTA's range round-robin, each with its
// own S-stage cp.async ring (no barrier but the one per portion); at a portion's end the warps' fp32 partials meet in
// shared memory and one warp (rotating) sums them in warp order and writes the portion's value.
// CTAs per SM the decode kernel is built for (keep in step with cuda_fp4.ctas_per_sm): 3 where 85 registers and
// 3 rings fit (MT = 1 from the permuted copy, 4 stages), else 2
template <int MT, int S, bool PERM>
constexpr int decode_ctas_per_sm() {
  return (MT == 1 && S == 4 && PERM) ? 3 : 2;
}

template <int MT, int S, bool NV, bool BF16, bool PERM>
__global__ void __launch_bounds__(DW * 32, decode_ctas_per_sm<MT, S, PERM>()) fp4_decode_kernel(const Params p) {
  using L = DecodeLayout<MT, S>;
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem);
  uint2* scs = reinterpret_cast<uint2*>(smem + L::W);
  float4* red = reinterpret_cast<float4*>(smem + L::W + L::SC);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const Split sp(p);
  const int c = range_index(p);
  int u0, u1;
  sp.range(c, gridDim.x, p.pmode != 0, u0, u1);
  const int pfirst = u0 < u1 ? sp.portion(u0) : 0, plast = u0 < u1 ? sp.portion(u1 - 1) : -1;
  const int spr = NV ? (p.K >> 4) : (p.K >> 5);  // scale bytes per row
  const int spc = NV ? 8 : 4;                    // scale bytes per chunk
  const int tile0 = blockIdx.y * MT, kb32 = p.K >> 5;

  // the issue cursor: portion ip, this warp's next unit iu < ib there (its chunk iu + ich0), the row block's bytes
  // of chunk 0 (iw0, iw1: rows g, g+8; isc: the scales of row lane % 16); this warp's units are a + warp + DW i < b
  // in each portion part [a, b) of the CTA's range
  const size_t cstride = p.tiled ? 4096 : 64;
  int ip = pfirst - 1, iu = 0, ib = 0, ich0 = 0;
  const uint8_t *iw0 = p.w, *iw1 = p.w, *isc = p.s;
  auto next_portion = [&]() {  // on to the next portion that has a unit of this warp (ip > plast: none is left)
    for (++ip; ip <= plast; ++ip) {
      const Portion po(sp, ip, u0, u1);
      iu = po.a + warp;
      if (iu < po.b) {
        ib = po.b;
        ich0 = po.chunk0;
        iw0 = weight_at(p, po.gr * 16 + g, 0, sp.KC, q);
        iw1 = weight_at(p, po.gr * 16 + g + 8, 0, sp.KC, q);
        isc = p.s + (size_t)(po.gr * 16 + (lane & 15)) * spr;
        return;
      }
    }
  };
  const uint64_t pol = evict_first_policy();
  auto issue = [&](int slot) {  // unit iu's weight and scale bytes of this warp into ring slot; cursor on
    const int ch = iu + ich0;
    uint4* dst = ring + (slot * DW + warp) * 64;
    cp_async16_stream(dst + lane, iw0 + ch * cstride, pol);
    cp_async16_stream(dst + 32 + lane, iw1 + ch * cstride, pol);
    if (lane < 16) {
      uint2* sd = scs + (slot * DW + warp) * 16 + lane;
      if constexpr (NV) {
        cp_async8(sd, isc + ch * spc, pol);
      } else {
        cp_async4(sd, isc + ch * spc, pol);
      }
    }
    iu += DW;
    if (iu >= ib) next_portion();
  };
  next_portion();
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {  // the ring fills before the previous kernel is waited for
    if (ip <= plast) issue(st);
    cp_async_commit();
  }
  pdl_launch();
  pdl_wait();

  const uint16_t* xrow[MT];
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    const int tok = (tile0 + t) * 8 + g;
    xrow[t] = (!PERM && tok < p.M) ? p.x + (size_t)tok * p.ldx : nullptr;
  }
  const float alpha = out_alpha<NV>(p);
  float acc[MT][4];
#pragma unroll
  for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  int j = 0, buf = 0, pcount = 0;
  for (int pi = pfirst; pi <= plast; ++pi, ++pcount) {
    const Portion po(sp, pi, u0, u1);
    for (int u = po.a + warp; u < po.b; u += DW, ++j) {
      cp_async_wait<S - 2>();
      __syncwarp();  // the scales of the slot came from other lanes; the refilled slot was read by all lanes
      if (ip <= plast) issue((j + S - 1) % S);
      cp_async_commit();
      const int sl = j % S, ch = u + po.chunk0;
      const uint4* src = ring + (sl * DW + warp) * 64;
      const uint4 wa = src[lane], wb = src[32 + lane];
      const uint2* ss = scs + (sl * DW + warp) * 16;
      uint32_t spa[4], spb[4];
      scale_pairs4<NV, BF16>(spa, spb, ss[g], ss[g + 8], p.shift, lane);
      const uint32_t wra[4] = {wa.x, wa.y, wa.z, wa.w}, wrb[4] = {wb.x, wb.y, wb.z, wb.w};
      // slice i's B fragments: the permuted copy (one 16-byte load per tile) or gathered from x (M <= 2)
      const uint4* xpb = PERM ? p.xp + ((size_t)tile0 * kb32 + ch * 4) * 32 + lane : nullptr;
      auto ldb = [&](uint4 (&bf)[MT], int i) {
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          if constexpr (PERM) {
            bf[t] = __ldg(xpb + (size_t)t * kb32 * 32 + i * 32);
          } else if (xrow[t] != nullptr) {
            const unsigned int* xb = reinterpret_cast<const unsigned int*>(xrow[t] + ch * 128 + 32 * i + 2 * q);
            bf[t] = b_frags(__ldg(xb), __ldg(xb + 4), __ldg(xb + 8), __ldg(xb + 12));
          } else {
            bf[t] = make_uint4(0u, 0u, 0u, 0u);
          }
        }
      };
      uint4 bcur[MT];
      ldb(bcur, 0);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint4 bnext[MT];
        if (i < 3) ldb(bnext, i + 1);
        slice_mma<MT, BF16>(acc, wra[i], wrb[i], spa[i], spb[i], bcur);
        if (i < 3) {
#pragma unroll
          for (int t = 0; t < MT; ++t) bcur[t] = bnext[t];
        }
      }
    }
    // the portion's end: every warp's partial (zeros where it had no unit) into shared memory
    // (put_partials / sum_partials of fp4_frag.cuh, written out: through them ptxas allocates this kernel's registers
    // differently)
    float4* rw = red + (buf * DW + warp) * MT * 32;
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      rw[t * 32 + lane] = make_float4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
      acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    }
    __syncthreads();  // two buffers: the next portion's partials go to the other one
    if (warp == pcount % DW) {
      const float4* rr = red + buf * DW * MT * 32;
      float v[MT][4];
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        float4 s4 = rr[t * 32 + lane];
#pragma unroll
        for (int w = 1; w < DW; ++w) {  // fixed order: deterministic
          const float4 o = rr[(w * MT + t) * 32 + lane];
          s4.x += o.x;
          s4.y += o.y;
          s4.z += o.z;
          s4.w += o.w;
        }
        v[t][0] = s4.x * alpha;
        v[t][1] = s4.y * alpha;
        v[t][2] = s4.z * alpha;
        v[t][3] = s4.w * alpha;
      }
      if (p.lh != nullptr && po.s == 0 && po.a == po.ps) lora_mma<MT, BF16>(v, p, po.gr * 16, tile0, lane);
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        const int tok = (tile0 + t) * 8 + 2 * q, n = po.gr * 16 + g;
        put_value<BF16>(p, c, po, tok, n, g, v[t][0]);
        put_value<BF16>(p, c, po, tok + 1, n, g, v[t][1]);
        put_value<BF16>(p, c, po, tok, n + 8, g + 8, v[t][2]);
        put_value<BF16>(p, c, po, tok + 1, n + 8, g + 8, v[t][3]);
      }
    }
    buf ^= 1;
  }
}

template <int MT, int WN, int RBW, int S>
struct WideLayout {  // one ring stage of the wide kernel, bytes
  static constexpr int ACT = MT * 2048;       // [MT tiles][4 slices][32 lanes] uint4: the chunk's activation slice
  static constexpr int WB = WN * RBW * 1024;  // [WN][RBW][2 rows][32 lanes] uint4
  static constexpr int SCB = WN * RBW * 128;  // [WN][RBW][16 rows] uint2
  static constexpr int STAGE = ACT + WB + SCB;
  static constexpr int BYTES = S * STAGE;
};

// 16 < M <= 64: WN warps, each on its own RBW 16-row blocks of a row group of 16 WN RBW rows, all on the same chunk;
// a ring stage holds the chunk's permuted activation slice (shared by all warps) and every warp's weight bytes.
// One K segment: unit u = group * KC + chunk.
template <int MT, int WN, int RBW, int S, bool NV, bool BF16>
__global__ void __launch_bounds__(WN * 32, 2) fp4_wide_kernel(const Params p) {
  using L = WideLayout<MT, WN, RBW, S>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const Split sp(p);
  const int c = range_index(p), KC = sp.KC;
  int u0, u1;
  sp.range(c, gridDim.x, p.pmode != 0, u0, u1);
  const int spr = NV ? (p.K >> 4) : (p.K >> 5);
  const int spc = NV ? 8 : 4;
  const int tile0 = blockIdx.y * MT;
  const int kb32 = p.K >> 5, nblocks = p.N >> 4;

  // the issue cursor's row blocks: chunk-0 bytes of rows g, g+8 and the scales of row lane % 16, per block
  const size_t cstride = p.tiled ? 4096 : 64;
  const uint8_t* iw0[RBW];
  const uint8_t* iw1[RBW];
  const uint8_t* isc[RBW];
  auto bases = [&](int grp) {
#pragma unroll
    for (int r = 0; r < RBW; ++r) {
      const int rb = min((grp * WN + warp) * RBW + r, nblocks - 1);  // a dead block reads nothing: clamped
      iw0[r] = weight_at(p, rb * 16 + g, 0, KC, q);
      iw1[r] = weight_at(p, rb * 16 + g + 8, 0, KC, q);
      isc[r] = p.s + (size_t)(rb * 16 + (lane & 15)) * spr;
    }
  };
  const uint64_t pol = evict_first_policy();
  auto issue_w = [&](int slot, int grp, int ch) {
    unsigned char* st = smem + slot * L::STAGE;
#pragma unroll
    for (int r = 0; r < RBW; ++r) {
      if ((grp * WN + warp) * RBW + r < nblocks) {
        uint4* wd = reinterpret_cast<uint4*>(st + L::ACT) + (warp * RBW + r) * 64;
        cp_async16_stream(wd + lane, iw0[r] + ch * cstride, pol);
        cp_async16_stream(wd + 32 + lane, iw1[r] + ch * cstride, pol);
        if (lane < 16) {
          uint2* sd = reinterpret_cast<uint2*>(st + L::ACT + L::WB) + (warp * RBW + r) * 16 + lane;
          if constexpr (NV) {
            cp_async8(sd, isc[r] + ch * spc, pol);
          } else {
            cp_async4(sd, isc[r] + ch * spc, pol);
          }
        }
      }
    }
  };
  auto issue_act = [&](int slot, int ch) {
    uint4* ad = reinterpret_cast<uint4*>(smem + slot * L::STAGE);
    for (int idx = threadIdx.x; idx < MT * 128; idx += WN * 32) {
      const int t = idx >> 7, rem = idx & 127;
      cp_async16(ad + idx, p.xp + ((size_t)(tile0 + t) * kb32 + ch * 4) * 32 + rem);
    }
  };
  auto step = [&](int& grp, int& ch) {
    if (++ch == KC) {
      ch = 0;
      ++grp;
    }
  };
  auto istep = [&](int& grp, int& ch) {  // the issue cursor moves on, with its row-block bases
    if (++ch == KC) {
      ch = 0;
      bases(++grp);
    }
  };
  const int grp0 = u0 / KC, ch0 = u0 - grp0 * KC;
  // weights of the first S-1 units before the previous kernel is waited for, their activations after it: group 0
  // holds the prefetched weights and activation 0, group j < S-1 activation j
  int igrp = grp0, ich = ch0;
  bases(igrp);
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (u0 + st < u1) issue_w(st, igrp, ich);
    istep(igrp, ich);
  }
  pdl_launch();
  pdl_wait();
  int agrp = grp0, ach = ch0;
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (u0 + st < u1) issue_act(st, ach);
    step(agrp, ach);
    cp_async_commit();
  }

  const float alpha = out_alpha<NV>(p);
  float acc[RBW][MT][4];
#pragma unroll
  for (int r = 0; r < RBW; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t) acc[r][t][0] = acc[r][t][1] = acc[r][t][2] = acc[r][t][3] = 0.f;
  int grp = grp0, ch = ch0, j = 0;
  for (int u = u0; u < u1; ++u, ++j) {
    cp_async_wait<S - 2>();
    __syncthreads();  // every thread's copies of this slot landed; everyone is done with the slot refilled next
    if (u + S - 1 < u1) {
      issue_w((j + S - 1) % S, igrp, ich);
      issue_act((j + S - 1) % S, ich);
    }
    istep(igrp, ich);
    cp_async_commit();
    const unsigned char* st = smem + (j % S) * L::STAGE;
    const uint4* act = reinterpret_cast<const uint4*>(st);
    uint32_t wra[RBW][4], wrb[RBW][4], spa[RBW][4], spb[RBW][4];
#pragma unroll
    for (int r = 0; r < RBW; ++r) {
      const uint4* wd = reinterpret_cast<const uint4*>(st + L::ACT) + (warp * RBW + r) * 64;
      const uint4 wa = wd[lane], wb = wd[32 + lane];
      wra[r][0] = wa.x, wra[r][1] = wa.y, wra[r][2] = wa.z, wra[r][3] = wa.w;
      wrb[r][0] = wb.x, wrb[r][1] = wb.y, wrb[r][2] = wb.z, wrb[r][3] = wb.w;
      const uint2* ss = reinterpret_cast<const uint2*>(st + L::ACT + L::WB) + (warp * RBW + r) * 16;
      scale_pairs4<NV, BF16>(spa[r], spb[r], ss[g], ss[g + 8], p.shift, lane);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t av[RBW][8];
#pragma unroll
      for (int r = 0; r < RBW; ++r) decode_slice<BF16>(av[r], wra[r][i], wrb[r][i], spa[r][i], spb[r][i]);
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        const uint4 bf = act[(t * 4 + i) * 32 + lane];
#pragma unroll
        for (int r = 0; r < RBW; ++r) {
          mma<BF16>(acc[r][t], av[r][0], av[r][1], av[r][2], av[r][3], bf.x, bf.y);
          mma<BF16>(acc[r][t], av[r][4], av[r][5], av[r][6], av[r][7], bf.z, bf.w);
        }
      }
    }
    if (u + 1 == u1 || ch + 1 == KC) {  // the group's last unit in this CTA: its value out, per warp
      Portion po;
      po.s = 0, po.gr = grp, po.ps = grp * KC, po.pe = po.ps + KC;
      po.a = u0 > po.ps ? u0 : po.ps, po.b = u + 1, po.chunk0 = -po.ps;
#pragma unroll
      for (int r = 0; r < RBW; ++r) {
        const int rb = (grp * WN + warp) * RBW + r;
        float v[MT][4];
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          v[t][0] = acc[r][t][0] * alpha;
          v[t][1] = acc[r][t][1] * alpha;
          v[t][2] = acc[r][t][2] * alpha;
          v[t][3] = acc[r][t][3] * alpha;
          acc[r][t][0] = acc[r][t][1] = acc[r][t][2] = acc[r][t][3] = 0.f;
        }
        if (rb < nblocks) {
          if (p.lh != nullptr && po.a == po.ps) lora_mma<MT, BF16>(v, p, rb * 16, tile0, lane);
          const int row = (warp * RBW + r) * 16 + g, n = rb * 16 + g;
#pragma unroll
          for (int t = 0; t < MT; ++t) {
            const int tok = (tile0 + t) * 8 + 2 * q;
            put_value<BF16>(p, c, po, tok, n, row, v[t][0]);
            put_value<BF16>(p, c, po, tok + 1, n, row, v[t][1]);
            put_value<BF16>(p, c, po, tok, n + 8, row + 8, v[t][2]);
            put_value<BF16>(p, c, po, tok + 1, n + 8, row + 8, v[t][3]);
          }
        }
      }
    }
    step(grp, ch);
  }
}

// The outputs of the stream plans that no CTA wrote: per segment in order, the segment's portion value (wseg, or
// the pieces of the CTAs that share the portion, in CTA order), then + bias, rounded once. One CTA per row group:
// which CTAs hold each segment's portion is worked out once per group (MAX_SEGS segments at most).
constexpr int MAX_SEGS = 32;
template <bool BF16>
__global__ void __launch_bounds__(256) fp4_fixup_kernel(const Params p) {
  __shared__ int cut_first[MAX_SEGS], cut_last[MAX_SEGS];
  pdl_launch();
  pdl_wait();
  const Split sp(p);
  for (int gr = blockIdx.x; gr < sp.Rg; gr += gridDim.x) {
    __syncthreads();  // the previous group's cut_first/cut_last are read
    if (threadIdx.x < sp.nseg) {
      const int pi = threadIdx.x * sp.Rg + gr;
      const int ps = sp.pstart(pi), pe = sp.pstart(pi + 1);
      cut_first[threadIdx.x] = p.pmode ? 0 : sp.owner(ps, p.ctas);
      cut_last[threadIdx.x] = p.pmode ? 0 : sp.owner(pe - 1, p.ctas);
    }
    __syncthreads();
    if (sp.nseg == 1 && cut_first[0] == cut_last[0]) continue;  // written by the CTA that held it whole
    const int n0 = gr * p.grows, rows = p.N - n0 < p.grows ? p.N - n0 : p.grows;
    for (int e = threadIdx.x; e < p.M * rows; e += blockDim.x) {
      const int tok = e / rows, row = e - tok * rows, n = n0 + row;
      float sum = 0.f;
      for (int s = 0; s < sp.nseg; ++s) {
        const int cf = cut_first[s], cl = cut_last[s];
        float v;
        if (cf == cl) {
          v = p.wseg[((size_t)s * p.M + tok) * p.N + n];
        } else {
          v = 0.f;
          for (int cc = cf; cc < cl; ++cc) v += p.slots[(((size_t)cc * 2 + 1) * p.M + tok) * p.grows + row];
          v += p.slots[((size_t)cl * 2 * p.M + tok) * p.grows + row];
        }
        sum += v;
      }
      store_y<BF16>(p, tok, n, p.bias != nullptr ? sum + p.bias[n] : sum);
    }
  }
}

#ifdef __CUDACC_RTC__
// what the host code below instantiates (a sample: register counts per shape of the template)
template __global__ void fp4_gemm_kernel<1, 4, 1, true, true, false>(const Params);
template __global__ void fp4_gemm_kernel<1, 1, 8, true, true, false>(const Params);
template __global__ void fp4_gemm_kernel<1, 4, 2, true, true, true>(const Params);
template __global__ void fp4_gemm_kernel<2, 4, 1, true, true, true>(const Params);
template __global__ void fp4_gemm_kernel<4, 4, 1, true, true, true>(const Params);
template __global__ void fp4_gemm_kernel<8, 4, 1, true, true, true>(const Params);
template __global__ void fp4_gemm_kernel<8, 4, 1, false, false, true>(const Params);
template __global__ void splitk_reduce_kernel<true, true>(const Params);
template __global__ void fp4_decode_kernel<1, 8, true, true, false>(const Params);
template __global__ void fp4_decode_kernel<2, 8, true, true, true>(const Params);
template __global__ void fp4_wide_kernel<8, 4, 2, 4, true, true>(const Params);
template __global__ void fp4_fixup_kernel<true>(const Params);
}  // namespace qerl
#else
template <int MT, int WN, int WK, bool NV, bool BF16, bool PERM>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  const int mtiles = (p.M + 8 * MT - 1) / (8 * MT);
  if (PERM) {
    const int tiles = mtiles * MT;
    const size_t threads = (size_t)tiles * (p.K >> 5) * 32;
    permute_x_kernel<<<(unsigned)((threads + 255) / 256), 256, 0, stream>>>(p, tiles);
  }
  dim3 grid(mtiles, (p.N / 16 + WN - 1) / WN, p.splits);
  fp4_gemm_kernel<MT, WN, WK, NV, BF16, PERM><<<grid, WN * WK * 32, 0, stream>>>(p);
  if (p.splits > 1) {
    const size_t total = (size_t)p.M * p.N;
    const size_t want = (total + 255) / 256;
    const unsigned blocks = (unsigned)(want < 4096 ? want : 4096);
    splitk_reduce_kernel<NV, BF16><<<blocks, 256, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

// The built configurations: (MT, WN, WK, PERM). Keep in step with CONFIGS in kernels/cuda_fp4.py.
#define QERL_FP4_CONFIGS(X) \
  X(1, 4, 1, false) X(1, 4, 2, false) X(1, 1, 8, false) \
  X(1, 4, 1, true) X(1, 4, 2, true) X(1, 1, 8, true) \
  X(2, 4, 1, true) X(2, 4, 2, true) X(2, 1, 8, true) \
  X(4, 4, 1, true) X(4, 1, 8, true) \
  X(8, 4, 1, true)
// The stream plans (keep in step with DECODE_CONFIGS / WIDE_CONFIGS in kernels/cuda_fp4.py):
// decode kernel (MT, S stages, PERM); wide kernel (MT, WN, RBW, S).
#define QERL_DECODE_CONFIGS(X) \
  X(1, 4, false) X(1, 8, false) X(1, 4, true) X(1, 8, true) X(2, 4, true) X(2, 8, true)
#define QERL_WIDE_CONFIGS(X) X(4, 8, 1, 4) X(4, 4, 2, 4) X(8, 8, 1, 4) X(8, 4, 2, 4)

template <bool NV, bool BF16>
cudaError_t launch_cfg(const Params& p, int mt, int wn, int wk, int perm, cudaStream_t stream) {
#define QERL_PICK(MT_, WN_, WK_, P_) \
  if (mt == MT_ && wn == WN_ && wk == WK_ && (perm != 0) == P_) return launch<MT_, WN_, WK_, NV, BF16, P_>(p, stream);
  QERL_FP4_CONFIGS(QERL_PICK)
#undef QERL_PICK
  return cudaErrorInvalidValue;
}

// more than 48 KB of dynamic shared memory needs the function's limit raised, once per device
inline cudaError_t allow_smem(const void* kern, int bytes, int (&done)[64]) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess || dev >= 64 || done[dev]) return e;
  e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess) done[dev] = 1;
  return e;
}

inline cudaError_t launch_permute(const Params& p, int tiles, cudaStream_t st, bool pdl) {
  const size_t threads = (size_t)tiles * (p.K >> 5) * 32;
  return launch_ex(permute_x_kernel, dim3((unsigned)((threads + 255) / 256)), dim3(256), 0, st, pdl, p, tiles);
}

template <bool BF16>
cudaError_t launch_fixup(const Params& p, cudaStream_t st, bool pdl) {
  const int groups = (p.N + p.grows - 1) / p.grows;
  return launch_ex(fp4_fixup_kernel<BF16>, dim3(groups < 4096 ? groups : 4096), dim3(256), 0, st, pdl, p);
}

template <int MT, int S, bool NV, bool BF16, bool PERM>
cudaError_t decode_smem() {  // preload calls it too, so that no first launch inside a graph capture sets it
  static int done[64];
  return allow_smem((const void*)fp4_decode_kernel<MT, S, NV, BF16, PERM>, DecodeLayout<MT, S>::BYTES, done);
}

template <int MT, int WN, int RBW, int S, bool NV, bool BF16>
cudaError_t wide_smem() {
  static int done[64];
  return allow_smem((const void*)fp4_wide_kernel<MT, WN, RBW, S, NV, BF16>, WideLayout<MT, WN, RBW, S>::BYTES, done);
}

template <int MT, int S, bool NV, bool BF16, bool PERM>
cudaError_t launch_decode(const Params& p, bool fixup, cudaStream_t st, bool pdl) {
  cudaError_t e = decode_smem<MT, S, NV, BF16, PERM>();
  if (e != cudaSuccess) return e;
  const int mgroups = (p.M + 8 * MT - 1) / (8 * MT);
  if (PERM && (e = launch_permute(p, mgroups * MT, st, pdl)) != cudaSuccess) return e;
  e = launch_ex(fp4_decode_kernel<MT, S, NV, BF16, PERM>, dim3(p.ctas, mgroups), dim3(DW * 32),
                (size_t)DecodeLayout<MT, S>::BYTES, st, pdl, p);
  if (e == cudaSuccess && fixup) e = launch_fixup<BF16>(p, st, pdl);
  return e;
}

template <int MT, int WN, int RBW, int S, bool NV, bool BF16>
cudaError_t launch_wide(const Params& p, bool fixup, cudaStream_t st, bool pdl) {
  using L = WideLayout<MT, WN, RBW, S>;
  cudaError_t e = wide_smem<MT, WN, RBW, S, NV, BF16>();
  if (e != cudaSuccess) return e;
  const int mgroups = (p.M + 8 * MT - 1) / (8 * MT);
  if ((e = launch_permute(p, mgroups * MT, st, pdl)) != cudaSuccess) return e;
  e = launch_ex(fp4_wide_kernel<MT, WN, RBW, S, NV, BF16>, dim3(p.ctas, mgroups), dim3(WN * 32), (size_t)L::BYTES, st,
                pdl, p);
  if (e == cudaSuccess && fixup) e = launch_fixup<BF16>(p, st, pdl);
  return e;
}

template <bool NV, bool BF16>
cudaError_t launch_stream(const Params& p, int kind, int mt, int wn, int rbw, int stages, int perm, bool fixup,
                          cudaStream_t st, bool pdl) {
  if (kind == 1) {
#define QERL_PICK(MT_, S_, P_) \
  if (mt == MT_ && stages == S_ && (perm != 0) == P_) return launch_decode<MT_, S_, NV, BF16, P_>(p, fixup, st, pdl);
    QERL_DECODE_CONFIGS(QERL_PICK)
#undef QERL_PICK
  } else if (kind == 2) {
#define QERL_PICK(MT_, WN_, RBW_, S_) \
  if (mt == MT_ && wn == WN_ && rbw == RBW_ && stages == S_) return launch_wide<MT_, WN_, RBW_, S_, NV, BF16>(p, fixup, st, pdl);
    QERL_WIDE_CONFIGS(QERL_PICK)
#undef QERL_PICK
  }
  return cudaErrorInvalidValue;
}

template <bool NV, bool BF16>
cudaError_t preload_fmt() {
  cudaFuncAttributes a;
  cudaError_t e = cudaSuccess;
#define QERL_LOAD(MT_, WN_, WK_, P_) \
  if (cudaFuncGetAttributes(&a, (const void*)fp4_gemm_kernel<MT_, WN_, WK_, NV, BF16, P_>) != cudaSuccess) \
    e = cudaErrorInvalidDeviceFunction;
  QERL_FP4_CONFIGS(QERL_LOAD)
#undef QERL_LOAD
#define QERL_LOAD(MT_, S_, P_) \
  if (cudaFuncGetAttributes(&a, (const void*)fp4_decode_kernel<MT_, S_, NV, BF16, P_>) != cudaSuccess || \
      decode_smem<MT_, S_, NV, BF16, P_>() != cudaSuccess) \
    e = cudaErrorInvalidDeviceFunction;
  QERL_DECODE_CONFIGS(QERL_LOAD)
#undef QERL_LOAD
#define QERL_LOAD(MT_, WN_, RBW_, S_) \
  if (cudaFuncGetAttributes(&a, (const void*)fp4_wide_kernel<MT_, WN_, RBW_, S_, NV, BF16>) != cudaSuccess || \
      wide_smem<MT_, WN_, RBW_, S_, NV, BF16>() != cudaSuccess) \
    e = cudaErrorInvalidDeviceFunction;
  QERL_WIDE_CONFIGS(QERL_LOAD)
#undef QERL_LOAD
  if (cudaFuncGetAttributes(&a, (const void*)splitk_reduce_kernel<NV, BF16>) != cudaSuccess) e = cudaErrorInvalidDeviceFunction;
  if (cudaFuncGetAttributes(&a, (const void*)permute_x_kernel) != cudaSuccess) e = cudaErrorInvalidDeviceFunction;
  if (cudaFuncGetAttributes(&a, (const void*)fp4_fixup_kernel<BF16>) != cudaSuccess) e = cudaErrorInvalidDeviceFunction;
  return e;
}

// The Params both entry points fill alike: operands, shape, layout and the LoRA expand (the rest stays zero).
inline Params host_params(const void* x, void* xp, const void* w, const void* s, const float* gs, const float* bias,
                          void* y, const void* lh, const void* lb, int M, int N, int K, int ldx, int tiled, int shift,
                          int R, int ldh) {
  Params p{};
  p.x = static_cast<const uint16_t*>(x);
  p.xp = static_cast<const uint4*>(xp);
  p.w = static_cast<const uint8_t*>(w);
  p.s = static_cast<const uint8_t*>(s);
  p.gs = gs;
  p.bias = bias;
  p.y = y;
  p.M = M, p.N = N, p.K = K, p.ldx = ldx, p.tiled = tiled, p.shift = shift;
  p.lh = static_cast<const uint16_t*>(lh);
  p.lb = static_cast<const uint16_t*>(lb);
  p.R = R, p.ldh = ldh;
  return p;
}

}  // namespace qerl

extern "C" {

// Load every kernel of the library into the current context now (lazy module loading would otherwise
// load a kernel at its first launch, which may fall inside a CUDA-graph capture).
int qerl_fp4_preload() {
  cudaError_t e = qerl::preload_fmt<true, true>();
  if (e == cudaSuccess) e = qerl::preload_fmt<true, false>();
  if (e == cudaSuccess) e = qerl::preload_fmt<false, true>();
  if (e == cudaSuccess) e = qerl::preload_fmt<false, false>();
  return (int)e;
}

// 1 if the library holds the configuration (MT 8-token tiles, WN x WK warps, permuted activations).
int qerl_fp4_has(int mt, int wn, int wk, int perm) {
#define QERL_HAS(MT_, WN_, WK_, P_) \
  if (mt == MT_ && wn == WN_ && wk == WK_ && (perm != 0) == P_) return 1;
  QERL_FP4_CONFIGS(QERL_HAS)
#undef QERL_HAS
  return 0;
}

// 1 if the library holds the stream configuration (kind 1: decode kernel MT, S, PERM; kind 2: wide MT, WN, RBW, S).
int qerl_fp4_has_stream(int kind, int mt, int wn, int rbw, int stages, int perm) {
#define QERL_HAS(MT_, S_, P_) \
  if (kind == 1 && mt == MT_ && stages == S_ && (perm != 0) == P_) return 1;
  QERL_DECODE_CONFIGS(QERL_HAS)
#undef QERL_HAS
#define QERL_HAS(MT_, WN_, RBW_, S_) \
  if (kind == 2 && mt == MT_ && wn == WN_ && rbw == RBW_ && stages == S_) return 1;
  QERL_WIDE_CONFIGS(QERL_HAS)
#undef QERL_HAS
  return 0;
}

// Dynamic shared memory of a stream configuration, bytes (0: not built).
int qerl_fp4_stream_smem(int kind, int mt, int wn, int rbw, int stages, int perm) {
#define QERL_SMEM(MT_, S_, P_) \
  if (kind == 1 && mt == MT_ && stages == S_ && (perm != 0) == P_) return qerl::DecodeLayout<MT_, S_>::BYTES;
  QERL_DECODE_CONFIGS(QERL_SMEM)
#undef QERL_SMEM
#define QERL_SMEM(MT_, WN_, RBW_, S_) \
  if (kind == 2 && mt == MT_ && wn == WN_ && rbw == RBW_ && stages == S_) return qerl::WideLayout<MT_, WN_, RBW_, S_>::BYTES;
  QERL_WIDE_CONFIGS(QERL_SMEM)
#undef QERL_SMEM
  return 0;
}

// Returns a cudaError_t (0 = success). Preconditions are checked by the caller (kernels/cuda_fp4.py):
// N % 16 == 0, K % 128 == 0, 16-byte aligned weight, 4-byte aligned x rows, tiled => N % 64 == 0;
// LoRA (lh non-null): R % 8 == 0, 4-byte aligned lh rows and lb; wsl [M, N] fp32 when splits > 1.
int qerl_fp4_gemm(const void* x, void* xp, const void* w, const void* s, const float* gs, const float* bias, void* y,
                  float* ws, const void* lh, const void* lb, float* wsl, int M, int N, int K, int ldx, int nvfp4,
                  int bf16, int tiled, int shift, int R, int ldh, int mt, int wn, int wk, int perm, int splits, int cps,
                  void* stream) {
  qerl::Params p = qerl::host_params(x, xp, w, s, gs, bias, y, lh, lb, M, N, K, ldx, tiled, shift, R, ldh);
  p.ws = ws;
  p.splits = splits, p.cps = cps;
  p.wsl = wsl;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (nvfp4) {
    return bf16 ? qerl::launch_cfg<true, true>(p, mt, wn, wk, perm, st) : qerl::launch_cfg<true, false>(p, mt, wn, wk, perm, st);
  }
  return bf16 ? qerl::launch_cfg<false, true>(p, mt, wn, wk, perm, st) : qerl::launch_cfg<false, false>(p, mt, wn, wk, perm, st);
}

// A stream plan (kind 1 decode, 2 wide): ctas CTAs per M group over nseg K segments of kcs chunks (pmode: whole
// portions per CTA), the fix-up kernel after it when some output is left to sum (fixup); pdl launches every kernel
// with programmatic stream serialization. slots: [ctas][2][M][grows] fp32, wseg: [nseg][M][N] fp32 (nseg > 1).
int qerl_fp4_stream(const void* x, void* xp, const void* w, const void* s, const float* gs, const float* bias, void* y,
                    float* slots, float* wseg, const void* lh, const void* lb, int M, int N, int K, int ldx, int nvfp4,
                    int bf16, int tiled, int shift, int R, int ldh, int kind, int mt, int wn, int rbw, int stages,
                    int perm, int ctas, int nseg, int kcs, int pmode, int grows, int cpsm, int fixup, int pdl,
                    void* stream) {
  qerl::Params p = qerl::host_params(x, xp, w, s, gs, bias, y, lh, lb, M, N, K, ldx, tiled, shift, R, ldh);
  p.splits = 1, p.cps = K >> 7;
  p.slots = slots;
  p.wseg = wseg;
  p.ctas = ctas, p.nseg = nseg, p.kcs = kcs, p.pmode = pmode, p.grows = grows, p.cpsm = cpsm;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const bool f = fixup != 0, d = pdl != 0;
  if (nvfp4) {
    return bf16 ? qerl::launch_stream<true, true>(p, kind, mt, wn, rbw, stages, perm, f, st, d)
                : qerl::launch_stream<true, false>(p, kind, mt, wn, rbw, stages, perm, f, st, d);
  }
  return bf16 ? qerl::launch_stream<false, true>(p, kind, mt, wn, rbw, stages, perm, f, st, d)
              : qerl::launch_stream<false, false>(p, kind, mt, wn, rbw, stages, perm, f, st, d);
}

}  // extern "C"

#endif  // __CUDACC_RTC__
