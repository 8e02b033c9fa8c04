// CUDA spellings of the macros the shared GEMV body uses (gemv_common.h,
// gemv_body.inc). MLX's default header (device/utils.cuh: cuda_fp16.h,
// cuda_bf16.h, cooperative_groups) precedes this one.

#define GBX_CUDA 1
// CUDA pointers carry no address space; shared memory is declared
// __shared__ (a pointer into it is a plain pointer).
#define GBX_DEVICE
#define GBX_SHARED __shared__
#define GBX_SHARED_PTR
#define GBX_FN __device__ __forceinline__
#define GBX_UNROLL _Pragma("unroll")
#define GBX_AS_FLOAT(u) __uint_as_float(u)
#define GBX_SIMD_SUM(v) gbx_warp_sum(v)
#define GBX_BARRIER() __syncthreads()

typedef __half gbx_half_t;
typedef __nv_bfloat16 gbx_bfloat_t;

// Butterfly reduction: after five steps every lane holds the warp's sum.
GBX_FN float gbx_warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// Two float16 values packed in a 32-bit word (element 0 in the low half).
GBX_FN float2 gbx_half2_bits_to_float2(unsigned int u) {
  __half2 h = *reinterpret_cast<const __half2*>(&u);
  return __half22float2(h);
}
