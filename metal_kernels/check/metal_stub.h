// Stand-in for <metal_stdlib> and MLX's Metal utils, so that clang can
// syntax- and type-check a Metal kernel source as C++17
// (scripts/check_metal_syntax.py). It declares only what the GEMV kernels and
// MLX's generated signature use. Limits: address spaces are erased (a
// device/threadgroup mix-up is not caught) and `[[kernel]]`, `[[buffer(i)]]`
// and the thread-position attributes are unknown attributes, ignored.
#pragma once

#define device
#define constant
#define threadgroup
#define thread

typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef unsigned short uint16_t;
typedef short int16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long uint64_t;
typedef long int64_t;
typedef unsigned int uint;
typedef unsigned short ushort;

struct uint2 { uint x, y; };
struct uint3 { uint x, y, z; };
struct uint4 { uint x, y, z, w; };
struct float4 { float x, y, z, w; };

// 16-bit floats: storage plus conversions, which is all the kernels use.
struct half {
  unsigned short bits;
  half() = default;
  half(float f);
  operator float() const;
};
struct half2 { half x, y; };
struct bfloat {
  unsigned short bits;
  bfloat() = default;
  bfloat(float f);
  operator float() const;
};
typedef half float16_t;
typedef bfloat bfloat16_t;

struct float2 {
  float x, y;
  float2() = default;
  float2(float a, float b) : x(a), y(b) {}
  explicit float2(half2 h) : x(h.x), y(h.y) {}
};

template <typename T, typename U>
T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs types of one size");
  return __builtin_bit_cast(T, u);
}

namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };
void threadgroup_barrier(mem_flags flags);
float simd_sum(float v);
float simd_shuffle_xor(float v, ushort lane_mask);
float round(float x);
float rint(float x);
float abs(float x);
float min(float a, float b);
float max(float a, float b);
}  // namespace metal
using namespace metal;
