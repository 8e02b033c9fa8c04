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
// Scalar float math of the KV write body (kv_write_body.inc): round half
// away from zero (MLX's affine quantize), round half to even (mx.round),
// magnitude, minimum, maximum, and a product rounded to float on its own.
// Metal has no unfused-multiply intrinsic: the compiler may contract a
// product into a following add (one rounding instead of two).
#define GBX_ROUND(x) metal::round(x)
#define GBX_RINT(x) metal::rint(x)
#define GBX_FABS(x) metal::abs(x)
#define GBX_FMIN(a, b) metal::min(a, b)
#define GBX_FMAX(a, b) metal::max(a, b)
#define GBX_FMUL(a, b) ((a) * (b))

typedef half gbx_half_t;
typedef bfloat16_t gbx_bfloat_t;

// Two float16 values packed in a 32-bit word (element 0 in the low half).
GBX_FN float2 gbx_half2_bits_to_float2(uint u) {
  return float2(as_type<half2>(u));
}

// -- matrix-unit variant (gemv_mma_body.inc) -----------------------------------
// Metal's simdgroup matrices hide their register layout, so the CUDA mma is
// emulated lane by lane: each lane multiplies its own operand registers and
// keeps a partial sum; gbx_quad_sum adds the four lanes of a row at the end.
// Same inputs, same k order, same float32 sums as the CUDA twin.
#define GBX_THREAD thread

// A weight pair: (q0, q1) as floats (the emulation needs no 16-bit form).
typedef float2 gbx_apair;

// Nibbles at bits [0, 4) and [16, 20) of u as (q0, q1), q = n - GBX_INT4_OFFSET.
template <typename T>
GBX_FN gbx_apair gbx_i4_pair(uint u) {
  return float2(float(u & 0xFu) - float(GBX_INT4_OFFSET), float((u >> 16) & 0xFu) - float(GBX_INT4_OFFSET));
}

// Two 16-bit inputs of type T packed in a word, as floats.
template <typename T>
GBX_FN float2 gbx_x_pair(uint u);
template <>
GBX_FN float2 gbx_x_pair<half>(uint u) {
  return float2(as_type<half2>(u));
}
template <>
GBX_FN float2 gbx_x_pair<bfloat16_t>(uint u) {
  return float2(as_type<float>(u << 16), as_type<float>(u & 0xFFFF0000u));
}

// This lane's share of c += A B (see prelude_cuda.cuh): rows g and g + 8
// times its own four k slots.
template <typename T>
GBX_FN void gbx_mma(thread float (&c)[4], thread const gbx_apair (&a)[4], uint b0, uint b1) {
  const float2 x0 = gbx_x_pair<T>(b0);
  const float2 x1 = gbx_x_pair<T>(b1);
  c[0] += a[0].x * x0.x + a[0].y * x0.y + a[2].x * x1.x + a[2].y * x1.y;
  c[2] += a[1].x * x0.x + a[1].y * x0.y + a[3].x * x1.x + a[3].y * x1.y;
}

// Sum over the four lanes of a row (lanes 4g .. 4g + 3).
GBX_FN float gbx_quad_sum(float v) {
  v += metal::simd_shuffle_xor(v, ushort(1));
  v += metal::simd_shuffle_xor(v, ushort(2));
  return v;
}
