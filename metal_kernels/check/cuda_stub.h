// Stand-in for the CUDA headers MLX's generated kernels see (cuda_fp16.h,
// cuda_bf16.h, vector types, mlx/backend/cuda/device/utils.cuh), so that
// clang's CUDA front end can syntax- and type-check the CUDA twin without a
// CUDA toolkit (scripts/check_metal_syntax.py --cuda).
#pragma once

#include <__clang_cuda_builtin_vars.h>

#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __host__ __attribute__((host))
#define __shared__ __attribute__((shared))
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __grid_constant__

typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef unsigned int uint32_t;
typedef int int32_t;

struct uint2 { unsigned int x, y; };
struct uint4 { unsigned int x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };

struct __half {
  unsigned short bits;
  __device__ __half() = default;
  __device__ __half(float f);
  __device__ operator float() const;
};
struct __half2 { __half x, y; };
struct __nv_bfloat16 {
  unsigned short bits;
  __device__ __nv_bfloat16() = default;
  __device__ __nv_bfloat16(float f);
  __device__ operator float() const;
};

__device__ float __uint_as_float(unsigned int u);
__device__ float __shfl_xor_sync(unsigned int mask, float v, int lane_mask);
__device__ float2 __half22float2(__half2 h);
__device__ void __syncthreads();
__device__ float roundf(float x);
__device__ float rintf(float x);
__device__ float fabsf(float x);
__device__ float fminf(float a, float b);
__device__ float fmaxf(float a, float b);
__device__ float __fmul_rn(float a, float b);
__device__ int __dp4a(int a, int b, int c);

namespace cooperative_groups {}
namespace mlx::core::cu {
struct Shape {
  int32_t data[8];
  __device__ const int32_t& operator[](int i) const { return data[i]; }
};
}  // namespace mlx::core::cu
