// Metal spellings of the macros the shared GEMV body uses (gemv_common.h,
// gemv_body.inc). MLX prepends its own utils (metal_stdlib, bfloat16_t,
// float16_t) before this header.

#define GBX_METAL 1
// Address space of kernel buffers; declaration of threadgroup (shared)
// memory, and the address space of a pointer into it.
#define GBX_DEVICE device
#define GBX_SHARED threadgroup
#define GBX_SHARED_PTR threadgroup
#define GBX_FN inline
// Full unrolling is the Metal compiler's default for short constant loops.
#define GBX_UNROLL
// Reinterpret the bits of a 32-bit unsigned integer as a float.
#define GBX_AS_FLOAT(u) as_type<float>(u)
// Sum over the 32 lanes of a SIMD group; every lane gets the result.
#define GBX_SIMD_SUM(v) metal::simd_sum(v)
#define GBX_BARRIER() metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup)

typedef half gbx_half_t;
typedef bfloat16_t gbx_bfloat_t;

// Two float16 values packed in a 32-bit word (element 0 in the low half).
GBX_FN float2 gbx_half2_bits_to_float2(uint u) {
  return float2(as_type<half2>(u));
}
