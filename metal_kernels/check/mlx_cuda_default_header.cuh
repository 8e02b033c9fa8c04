// Stand-in for the default header MLX puts before a custom CUDA kernel
// (mlx/backend/cuda/device/utils.cuh and cooperative_groups): the real CUDA
// headers plus MLX's Shape type. Used when nvcc is present
// (scripts/check_metal_syntax.py --cuda), so the twin compiles for real.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cooperative_groups.h>
#include <cuda/std/array>
#include <cuda/std/cstdint>

#define MAX_NDIM 10
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}  // namespace mlx::core::cu
