// The FP4 fragment math, the memory pipeline and the programmatic-launch helper shared by fp4_gemm.cu and
// decode_layer.cu (each includes it; both modules' build hashes cover it, so an edit here rebuilds both). The layout
// they decode is the one fp4_gemm.cu's head describes (docs/kernels.md): resident repacked weight as mma operand A,
// the K permutation that makes a packed pair of 16-bit weights come out of one u32 of codes, E4M3 / E8M0 scale pairs.
//
// Under NVRTC the includer defines the fixed-width integer types first (no <stdint.h> there).
#pragma once
#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>
#include <stdint.h>
#endif
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace qerl {

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

// The chunk math of the legacy kernel with the block-scale pairs already converted (spa/spb: slice i's pair).
template <bool BF16>
__device__ __forceinline__ void decode_slice(uint32_t (&a)[8], uint32_t qa, uint32_t qb, uint32_t spa, uint32_t spb) {
  a[0] = mul2<BF16>(decode2<BF16>(qa << 12), spa);
  a[1] = mul2<BF16>(decode2<BF16>(qb << 12), spb);
  a[2] = mul2<BF16>(decode2<BF16>(qa << 4), spa);
  a[3] = mul2<BF16>(decode2<BF16>(qb << 4), spb);
  a[4] = mul2<BF16>(decode2<BF16>(qa << 8), spa);
  a[5] = mul2<BF16>(decode2<BF16>(qb << 8), spb);
  a[6] = mul2<BF16>(decode2<BF16>(qa), spa);
  a[7] = mul2<BF16>(decode2<BF16>(qb), spb);
}

// INT4 (compressed-tensors pack-quantized: code u = value + 8 per nibble, the nibble order FP4's) in the same layout:
// the nibbles at bits sh..sh+3 of each 16-bit half -> u - 8 as 16-bit floats, exact: OR-ing u into the mantissa of
// 128 (bf16 0x4300) or 1024 (fp16 0x6400), whose ulp is 1, gives 128 + u / 1024 + u, and one fma subtracts 136 /
// 1032. The nibble at bit sh is the one decode2 reads from q << (12 - sh).
template <bool BF16>
__device__ __forceinline__ uint32_t int4_2(uint32_t q, int sh) {
  const uint32_t v = ((q >> sh) & 0x000F000Fu) | (BF16 ? 0x43004300u : 0x64006400u);
  uint32_t d;
  if constexpr (BF16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(v), "r"(0x3F803F80u), "r"(0xC308C308u));  // * 1 - 136
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(v), "r"(0x3C003C00u), "r"(0xE408E408u));  // * 1 - 1032
  }
  return d;
}
// decode_slice for INT4: (u - 8) * the group's 16-bit scale (spa = spb's halves: one scale per 128-wide chunk), one
// rounding of the exact product, as the dequantize-then-matmul path rounds it.
template <bool BF16>
__device__ __forceinline__ void decode_slice_i4(uint32_t (&a)[8], uint32_t qa, uint32_t qb, uint32_t spa,
                                                uint32_t spb) {
  a[0] = mul2<BF16>(int4_2<BF16>(qa, 0), spa);
  a[1] = mul2<BF16>(int4_2<BF16>(qb, 0), spb);
  a[2] = mul2<BF16>(int4_2<BF16>(qa, 8), spa);
  a[3] = mul2<BF16>(int4_2<BF16>(qb, 8), spb);
  a[4] = mul2<BF16>(int4_2<BF16>(qa, 4), spa);
  a[5] = mul2<BF16>(int4_2<BF16>(qb, 4), spb);
  a[6] = mul2<BF16>(int4_2<BF16>(qa, 12), spa);
  a[7] = mul2<BF16>(int4_2<BF16>(qb, 12), spb);
}

// One 32-wide slice of a chunk into MT token tiles: rows g (codes qa, scale pair spa) and g+8 (qb, spb) decoded as
// operand A (I4: INT4 codes), b[t] the tile's B fragments (b_frags order).
template <int MT, bool BF16, bool I4 = false>
__device__ __forceinline__ void slice_mma(float (&acc)[MT][4], uint32_t qa, uint32_t qb, uint32_t spa, uint32_t spb,
                                          const uint4 (&b)[MT]) {
  uint32_t a[8];
  if constexpr (I4) {
    decode_slice_i4<BF16>(a, qa, qb, spa, spb);
  } else {
    decode_slice<BF16>(a, qa, qb, spa, spb);
  }
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    mma<BF16>(acc[t], a[0], a[1], a[2], a[3], b[t].x, b[t].y);
    mma<BF16>(acc[t], a[4], a[5], a[6], a[7], b[t].z, b[t].w);
  }
}

// The cross-warp sum of one row block's fp32 partials in a CTA of NWARP warps, through red ([2][NWARP][MT][32]
// float4; two buffers, so the next block's partials need no second barrier). First every warp stores its
// accumulators to buffer buf and restarts them (put_partials); after a barrier, one warp sums them in warp order
// (fixed: reruns are bit-identical) into v = scale(sum) (sum_partials). scale is the caller's: its rounding
// (explicit or contractible) is part of that kernel's bits.
template <int MT, int NWARP>
__device__ __forceinline__ void put_partials(float4* red, int buf, float (&acc)[MT][4], int warp, int lane) {
  float4* rw = red + (buf * NWARP + warp) * MT * 32;
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    rw[t * 32 + lane] = make_float4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
    acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  }
}
template <int MT, int NWARP, typename Scale>
__device__ __forceinline__ void sum_partials(float (&v)[MT][4], const float4* red, int buf, int lane, Scale scale) {
  const float4* rr = red + buf * NWARP * MT * 32;
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    float4 s4 = rr[t * 32 + lane];
#pragma unroll
    for (int w = 1; w < NWARP; ++w) {
      const float4 o = rr[(w * MT + t) * 32 + lane];
      s4.x += o.x;
      s4.y += o.y;
      s4.z += o.z;
      s4.w += o.w;
    }
    v[t][0] = scale(s4.x);
    v[t][1] = scale(s4.y);
    v[t][2] = scale(s4.z);
    v[t][3] = scale(s4.w);
  }
}

// programmatic dependent launch: wait for the previous grid of the stream (and its memory), let the next start
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
}
// weights and block scales are read once per GEMM: marked first to leave L2, so that the activations, the LoRA
// factors and the fix-up's pieces (re-read) stay
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ void cp_async16_stream(void* dst, const void* src, uint64_t pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;"
               ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "l"(pol) : "memory");
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src, uint64_t pol) {
  asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], 8, %2;"
               ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "l"(pol) : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, uint64_t pol) {
  asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], 4, %2;"
               ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "l"(pol) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

#ifndef __CUDACC_RTC__
// cudaLaunchKernelEx, with programmatic stream serialization when pdl: the kernel may start before the previous
// kernel of the stream ends (it calls griddepcontrol.wait before reading anything that kernel wrote)
template <typename... Args>
cudaError_t launch_ex(void (*kern)(Args...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, bool pdl,
                      Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kern, args...);
}
#endif

}  // namespace qerl
