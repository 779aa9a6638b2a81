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
#ifdef __CUDACC_RTC__  // NVRTC: device code only (a syntax and register check without nvcc)
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
#else
#include <cuda_runtime.h>
#include <stdint.h>
#endif
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

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
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Nibble in the high 4 bits of each 16-bit half -> 16-bit float times 2^-126 (bf16) / 2^-14 (fp16).
template <bool BF16>
__device__ __forceinline__ uint32_t decode2(uint32_t q) {
  return (q & 0x80008000u) | ((q & 0x70007000u) >> (BF16 ? 6 : 3));
}
template <bool BF16>
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (BF16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  }
  return d;
}
template <bool BF16>
__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  if constexpr (BF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// The packed scale pair of 32-wide slice i of a chunk: (low half: k in [32i, 32i+16), high: [32i+16, 32i+32)).
template <bool NV, bool BF16>
__device__ __forceinline__ uint32_t scale_pair(uint2 raw, int i, int shift) {
  if constexpr (NV) {
    const uint32_t word = i < 2 ? raw.x : raw.y;
    const __nv_fp8x2_storage_t two = (__nv_fp8x2_storage_t)((word >> (16 * (i & 1))) & 0xffffu);
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3);  // .x = low byte, exact
    if constexpr (BF16) {
      const __half2 hh(h);  // from the raw bits (a __half built from h.x would convert the integer value)
      const float lo = __low2float(hh) * 0x1p118f, hi = __high2float(hh) * 0x1p118f;
      const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);  // exact: 4 significant bits
      return *reinterpret_cast<const uint32_t*>(&b);
    } else {
      const uint32_t hh = (uint32_t)h.x | ((uint32_t)h.y << 16);
      return mul2<false>(hh, 0x54005400u);  // * 2^6 (fp16 64.0), exact
    }
  } else {
    const int e = (int)((raw.x >> (8 * i)) & 0xffu) + shift;
    const uint32_t v = BF16 ? (uint32_t)min(max(e + 126, 0), 254) << 7 : (uint32_t)min(max(e - 98, 0), 30) << 10;
    return v | (v << 16);
  }
}

// B fragments of slice i for one 8-token tile: {V0.b0, V0.b1, V1.b0, V1.b1} from the four u32 pairs
// x_j = x[tok][32i + 8j + 2q .. +1].
__device__ __forceinline__ uint4 b_frags(uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3) {
  return make_uint4(prmt(x0, x2, 0x5410u), prmt(x1, x3, 0x5410u), prmt(x0, x2, 0x7632u), prmt(x1, x3, 0x7632u));
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

  // C fragment: acc[t] = {y[tok 2q][row g], y[2q+1][g], y[2q][g+8], y[2q+1][g+8]} of token tile t.
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    float* r = red[warp] + (t * 8 + 2 * q) * 16;
    r[g] = acc[t][0];
    r[16 + g] = acc[t][1];
    r[g + 8] = acc[t][2];
    r[16 + g + 8] = acc[t][3];
  }
  __syncthreads();
  const float alpha = NV ? 256.0f / p.gs[0] : exp2f((float)(-p.shift));
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
    } else {
      float out = sum * alpha;
      if (p.bias != nullptr) out += p.bias[n];
      if constexpr (BF16) {
        reinterpret_cast<__nv_bfloat16*>(p.y)[(size_t)tok * p.N + n] = __float2bfloat16_rn(out);
      } else {
        reinterpret_cast<__half*>(p.y)[(size_t)tok * p.N + n] = __float2half_rn(out);
      }
    }
  }
}

// y = (sum over splits, in split order) * alpha + bias.
template <bool NV, bool BF16>
__global__ void splitk_reduce_kernel(const Params p) {
  const size_t total = (size_t)p.M * p.N;
  const float alpha = NV ? 256.0f / p.gs[0] : exp2f((float)(-p.shift));
  for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
    float sum = 0.f;
    for (int s = 0; s < p.splits; ++s) sum += p.ws[s * total + idx];
    float out = sum * alpha;
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

template <bool NV, bool BF16>
cudaError_t launch_cfg(const Params& p, int mt, int wn, int wk, int perm, cudaStream_t stream) {
#define QERL_PICK(MT_, WN_, WK_, P_) \
  if (mt == MT_ && wn == WN_ && wk == WK_ && (perm != 0) == P_) return launch<MT_, WN_, WK_, NV, BF16, P_>(p, stream);
  QERL_FP4_CONFIGS(QERL_PICK)
#undef QERL_PICK
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
  if (cudaFuncGetAttributes(&a, (const void*)splitk_reduce_kernel<NV, BF16>) != cudaSuccess) e = cudaErrorInvalidDeviceFunction;
  if (cudaFuncGetAttributes(&a, (const void*)permute_x_kernel) != cudaSuccess) e = cudaErrorInvalidDeviceFunction;
  return e;
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

// Returns a cudaError_t (0 = success). Preconditions are checked by the caller (kernels/cuda_fp4.py):
// N % 16 == 0, K % 128 == 0, 16-byte aligned weight, 4-byte aligned x rows, tiled => N % 64 == 0.
int qerl_fp4_gemm(const void* x, void* xp, const void* w, const void* s, const float* gs, const float* bias, void* y,
                  float* ws, int M, int N, int K, int ldx, int nvfp4, int bf16, int tiled, int shift, int mt,
                  int wn, int wk, int perm, int splits, int cps, void* stream) {
  qerl::Params p{static_cast<const uint16_t*>(x), static_cast<const uint4*>(xp), static_cast<const uint8_t*>(w),
                 static_cast<const uint8_t*>(s), gs, bias, y, ws, M, N, K, ldx, tiled, shift, splits, cps};
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (nvfp4) {
    return bf16 ? qerl::launch_cfg<true, true>(p, mt, wn, wk, perm, st) : qerl::launch_cfg<true, false>(p, mt, wn, wk, perm, st);
  }
  return bf16 ? qerl::launch_cfg<false, true>(p, mt, wn, wk, perm, st) : qerl::launch_cfg<false, false>(p, mt, wn, wk, perm, st);
}

}  // extern "C"

#endif  // __CUDACC_RTC__
