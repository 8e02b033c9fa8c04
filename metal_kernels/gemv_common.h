// Shared helpers of the packed decode GEMV (Metal and CUDA alike).
//
// Needs the GBX_* macros and gbx_half_t / gbx_bfloat_t of a prelude, and the
// format header (../gearbx_format.h: int8 is two's complement; int4 holds
// q + GBX_INT4_OFFSET, element j in byte j/2, low nibble for even j).
// Weights are read as little-endian 32-bit words, so element k of a word
// sits at bits [k*BITS, (k+1)*BITS).

typedef unsigned int gbx_u32;

// Inputs are staged in threadgroup/shared memory up to GBX_SHARED_K (format
// header). float4 slots of the staged x: K/4, plus one slot of padding per 8.
#define GBX_SHARED_F4 (GBX_SHARED_K / 4 + GBX_SHARED_K / 32)

// Slot of float4 number f of x in the padded threadgroup copy.
GBX_FN int gbx_pad4(int f) {
  return f + (f >> 3);
}

// VEC consecutive 32-bit words of packed weights. VEC == 4 is one 16-byte
// load (p 16-byte aligned). (`% VEC` keeps the unused branch in bounds.)
template <int VEC>
struct gbx_wvec {
  gbx_u32 v[VEC];
};
template <int VEC>
GBX_FN gbx_wvec<VEC> gbx_load_wvec(const GBX_DEVICE gbx_u32* p) {
  gbx_wvec<VEC> r;
  if (VEC == 4) {
    const uint4 q = *((const GBX_DEVICE uint4*)(p));
    r.v[0 % VEC] = q.x;
    r.v[1 % VEC] = q.y;
    r.v[2 % VEC] = q.z;
    r.v[3 % VEC] = q.w;
  } else {
    for (int j = 0; j < VEC; ++j) {
      r.v[j] = p[j];
    }
  }
  return r;
}

struct gbx_f8 {
  float v[8];
};
struct gbx_f4 {
  float v[4];
};

// Integer fields to float without an int->float conversion instruction
// (those run at a quarter of the FMA rate on many GPUs, and int4 decode
// would be bound by them): OR the field into the mantissa of a float whose
// exponent makes the field's lowest bit worth 1, then subtract the implicit
// leading one and the storage offset. Exact for every field value.
//
// (On sm_90, nvcc emits two logic instructions per field here, AND then OR
// with immediates; holding the exponents in registers would make it one.)
//
// Field of `BITS` bits at bit position `POS` of `w`, minus `OFFSET`. Needs
// POS + BITS <= 23 so the field stays inside the mantissa.
template <int POS, int BITS, int OFFSET>
GBX_FN float gbx_field(gbx_u32 w) {
  const gbx_u32 mask = ((1u << BITS) - 1u) << POS;
  // Exponent 23 - POS: mantissa bit POS is then worth 2^0.
  const gbx_u32 exponent = gbx_u32(127 + 23 - POS) << 23;
  const float bias = float((1u << (23 - POS)) + gbx_u32(OFFSET));
  return GBX_AS_FLOAT(exponent | (w & mask)) - bias;
}

// The eight int4 fields of a word minus OFFSET: the signed values of the
// packed format (OFFSET = GBX_INT4_OFFSET), or MLX's unsigned codes (0).
template <int OFFSET>
GBX_FN gbx_f8 gbx_unpack4(gbx_u32 w) {
  // Nibbles 5..7 lie above the 23-bit mantissa: shift them down once.
  const gbx_u32 hi = w >> 12;
  gbx_f8 r;
  r.v[0] = gbx_field<0, 4, OFFSET>(w);
  r.v[1] = gbx_field<4, 4, OFFSET>(w);
  r.v[2] = gbx_field<8, 4, OFFSET>(w);
  r.v[3] = gbx_field<12, 4, OFFSET>(w);
  r.v[4] = gbx_field<16, 4, OFFSET>(w);
  r.v[5] = gbx_field<8, 4, OFFSET>(hi);
  r.v[6] = gbx_field<12, 4, OFFSET>(hi);
  r.v[7] = gbx_field<16, 4, OFFSET>(hi);
  return r;
}

// The eight signed int4 values of a word of the packed format.
GBX_FN gbx_f8 gbx_unpack_int4(gbx_u32 w) {
  return gbx_unpack4<GBX_INT4_OFFSET>(w);
}

// The four int8 values of a word.
GBX_FN gbx_f4 gbx_unpack_int8(gbx_u32 w) {
  // Flipping each sign bit turns two's complement q into q+128.
  const gbx_u32 u = w ^ 0x80808080u;
  const gbx_u32 hi = u >> 16;
  gbx_f4 r;
  r.v[0] = gbx_field<0, 8, 128>(u);
  r.v[1] = gbx_field<8, 8, 128>(u);
  r.v[2] = gbx_field<0, 8, 128>(hi);
  r.v[3] = gbx_field<8, 8, 128>(hi);
  return r;
}

// bfloat16 -> float is a 16-bit shift; two values per 32-bit word.
GBX_FN float gbx_bf16_lo(gbx_u32 u) {
  return GBX_AS_FLOAT(u << 16);
}
GBX_FN float gbx_bf16_hi(gbx_u32 u) {
  return GBX_AS_FLOAT(u & 0xFFFF0000u);
}

// Eight inputs x[e .. e+7] from device memory as float (e % 8 == 0, so the
// vector loads are aligned). One overload per input dtype.
GBX_FN gbx_f8 gbx_load_x8(const GBX_DEVICE float* x, int e) {
  const float4 a = ((const GBX_DEVICE float4*)(x + e))[0];
  const float4 b = ((const GBX_DEVICE float4*)(x + e))[1];
  gbx_f8 r;
  r.v[0] = a.x; r.v[1] = a.y; r.v[2] = a.z; r.v[3] = a.w;
  r.v[4] = b.x; r.v[5] = b.y; r.v[6] = b.z; r.v[7] = b.w;
  return r;
}
GBX_FN gbx_f8 gbx_load_x8(const GBX_DEVICE gbx_bfloat_t* x, int e) {
  const uint4 u = *((const GBX_DEVICE uint4*)(x + e));
  gbx_f8 r;
  r.v[0] = gbx_bf16_lo(u.x); r.v[1] = gbx_bf16_hi(u.x);
  r.v[2] = gbx_bf16_lo(u.y); r.v[3] = gbx_bf16_hi(u.y);
  r.v[4] = gbx_bf16_lo(u.z); r.v[5] = gbx_bf16_hi(u.z);
  r.v[6] = gbx_bf16_lo(u.w); r.v[7] = gbx_bf16_hi(u.w);
  return r;
}
GBX_FN gbx_f8 gbx_load_x8(const GBX_DEVICE gbx_half_t* x, int e) {
  const uint4 u = *((const GBX_DEVICE uint4*)(x + e));
  const float2 a = gbx_half2_bits_to_float2(u.x);
  const float2 b = gbx_half2_bits_to_float2(u.y);
  const float2 c = gbx_half2_bits_to_float2(u.z);
  const float2 d = gbx_half2_bits_to_float2(u.w);
  gbx_f8 r;
  r.v[0] = a.x; r.v[1] = a.y; r.v[2] = b.x; r.v[3] = b.y;
  r.v[4] = c.x; r.v[5] = c.y; r.v[6] = d.x; r.v[7] = d.y;
  return r;
}

// Four inputs x[e .. e+3] (e % 4 == 0).
GBX_FN gbx_f4 gbx_load_x4(const GBX_DEVICE float* x, int e) {
  const float4 a = *((const GBX_DEVICE float4*)(x + e));
  gbx_f4 r;
  r.v[0] = a.x; r.v[1] = a.y; r.v[2] = a.z; r.v[3] = a.w;
  return r;
}
GBX_FN gbx_f4 gbx_load_x4(const GBX_DEVICE gbx_bfloat_t* x, int e) {
  const uint2 u = *((const GBX_DEVICE uint2*)(x + e));
  gbx_f4 r;
  r.v[0] = gbx_bf16_lo(u.x); r.v[1] = gbx_bf16_hi(u.x);
  r.v[2] = gbx_bf16_lo(u.y); r.v[3] = gbx_bf16_hi(u.y);
  return r;
}
GBX_FN gbx_f4 gbx_load_x4(const GBX_DEVICE gbx_half_t* x, int e) {
  const uint2 u = *((const GBX_DEVICE uint2*)(x + e));
  const float2 a = gbx_half2_bits_to_float2(u.x);
  const float2 b = gbx_half2_bits_to_float2(u.y);
  gbx_f4 r;
  r.v[0] = a.x; r.v[1] = a.y; r.v[2] = b.x; r.v[3] = b.y;
  return r;
}

// -- matrix-unit variant (gemv_mma_body.inc) -----------------------------------

// The variant stages at most GBX_MMA_MAX_K inputs (format header).

// Eight 16-bit inputs x0..x7 (as loaded: x0 | x1 << 16, ...) reordered into
// the pairs (x0, x4), (x1, x5), (x2, x6), (x3, x7): the k order of the
// weight pairs gbx_i4_pair makes.
GBX_FN uint4 gbx_pair_order(uint4 u) {
  uint4 r;
  r.x = (u.x & 0xFFFFu) | (u.z << 16);
  r.y = (u.x >> 16) | (u.z & 0xFFFF0000u);
  r.z = (u.y & 0xFFFFu) | (u.w << 16);
  r.w = (u.y >> 16) | (u.w & 0xFFFF0000u);
  return r;
}

// One 32-bit word of each of the lane's two rows (same 8 inputs): two
// 16x8x16 products. Word nibble s and s + 4 form pair s (gbx_i4_pair reads
// the nibbles at bits 0 and 16); xp holds the inputs in that pair order.
// The operand registers follow mma.m16n8k16: a[0] row g, k 2t..2t+1;
// a[1] row g + 8, same k; a[2] row g, k 2t+8..2t+9; a[3] row g + 8.
template <typename T>
GBX_FN void gbx_mma_word(GBX_THREAD float (&c)[4], gbx_u32 wa, gbx_u32 wb, uint4 xp) {
  gbx_apair a[4];
  a[0] = gbx_i4_pair<T>(wa);
  a[1] = gbx_i4_pair<T>(wb);
  a[2] = gbx_i4_pair<T>(wa >> 4);
  a[3] = gbx_i4_pair<T>(wb >> 4);
  gbx_mma<T>(c, a, xp.x, xp.y);
  a[0] = gbx_i4_pair<T>(wa >> 8);
  a[1] = gbx_i4_pair<T>(wb >> 8);
  a[2] = gbx_i4_pair<T>(wa >> 12);
  a[3] = gbx_i4_pair<T>(wb >> 12);
  gbx_mma<T>(c, a, xp.z, xp.w);
}
