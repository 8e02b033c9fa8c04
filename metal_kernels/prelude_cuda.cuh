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
// Scalar float math of the KV write body (kv_write_body.inc), as MLX's own
// kernels spell it: round half away from zero (affine quantize), round half
// to even (mx.round), magnitude, minimum, maximum. GBX_FMUL is a product
// rounded to float on its own: never contracted into a following add
// (NVRTC's default --fmad=true would), as MLX's separate multiply and add
// kernels round twice.
#define GBX_ROUND(x) roundf(x)
#define GBX_RINT(x) rintf(x)
#define GBX_FABS(x) fabsf(x)
#define GBX_FMIN(a, b) fminf(a, b)
#define GBX_FMAX(a, b) fmaxf(a, b)
#define GBX_FMUL(a, b) __fmul_rn(a, b)
// Four signed 8-bit products summed into c, one instruction (sm_61+); the
// other back ends spell it out (nested_common.h).
#define GBX_DP4A(a, b, c) __dp4a(int(a), int(b), c)

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

// -- matrix-unit variant (gemv_mma_body.inc) -----------------------------------
#define GBX_THREAD

// Two weights in one 32-bit register, as the mma operand takes them.
typedef unsigned int gbx_apair;

// Constants of the int4 -> 16-bit float trick, per operand type: OR a nibble
// into the mantissa of a value whose mantissa unit is 1 (1024.0 in half,
// 128.0 in bfloat16), then one paired fma by 1.0 subtracts that value plus 8
// (the storage offset). Exact: every result is an integer in [-8, 7].
// The `neg` words below spell -(1024 + 8) and -(128 + 8): the offset is in them.
static_assert(GBX_INT4_OFFSET == 8, "gbx_mma_consts encode the int4 storage offset 8");
template <typename T>
struct gbx_mma_consts;
template <>
struct gbx_mma_consts<__half> {
  static constexpr unsigned int magic = 0x64006400u;  // (1024, 1024)
  static constexpr unsigned int one = 0x3C003C00u;    // (1, 1)
  static constexpr unsigned int neg = 0xE408E408u;    // (-1032, -1032)
};
template <>
struct gbx_mma_consts<__nv_bfloat16> {
  static constexpr unsigned int magic = 0x43004300u;  // (128, 128)
  static constexpr unsigned int one = 0x3F803F80u;    // (1, 1)
  static constexpr unsigned int neg = 0xC308C308u;    // (-136, -136)
};

// Nibbles at bits [0, 4) and [16, 20) of u as the pair (q0, q1), q = n - 8:
// (u & 0x000F000F) | magic in one LOP3 (the magic in a register), then one
// paired fma. TY is the PTX type suffix of T.
template <typename T>
GBX_FN gbx_apair gbx_i4_pair(unsigned int u);

// c += A B for one 16x8x16 tile (sm_80+): A from a[4] (rows g, g + 8 of this
// lane), B from b0, b1 (k 2t..2t+1 and 2t+8..2t+9, every column alike).
// The matrix unit sums over the four lanes of a row: every lane of row g
// gets the full tile sum in c[0] (and c[1]), of row g + 8 in c[2] (c[3]).
template <typename T>
GBX_FN void gbx_mma(float (&c)[4], const gbx_apair (&a)[4], unsigned int b0, unsigned int b1);

#define GBX_MMA_OPS(T, TY)                                                                \
  template <>                                                                             \
  GBX_FN gbx_apair gbx_i4_pair<T>(unsigned int u) {                                       \
    unsigned int h, r;                                                                    \
    asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;" : "=r"(h) : "r"(u),                      \
        "r"(gbx_mma_consts<T>::magic));                                                   \
    asm("fma.rn." TY "x2 %0, %1, %2, %3;" : "=r"(r) : "r"(h), "r"(gbx_mma_consts<T>::one), \
        "r"(gbx_mma_consts<T>::neg));                                                     \
    return r;                                                                             \
  }                                                                                       \
  template <>                                                                             \
  GBX_FN void gbx_mma<T>(float (&c)[4], const gbx_apair (&a)[4], unsigned int b0,         \
                         unsigned int b1) {                                               \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 "               \
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"        \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                         \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));         \
  }
GBX_MMA_OPS(__half, "f16")
GBX_MMA_OPS(__nv_bfloat16, "bf16")
#undef GBX_MMA_OPS

// The mma already summed over the lanes of a row.
GBX_FN float gbx_quad_sum(float v) {
  return v;
}
