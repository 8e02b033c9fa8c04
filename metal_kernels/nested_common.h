// Helpers of the nested-plane GEMV (nested_gemv_body.inc), Metal and CUDA
// alike. Follows gemv_common.h (gbx_field, gbx_f8, gbx_load_x8, gbx_pad4).
//
// A plane is MLX's affine quantization (../gearbx_format.h): unsigned codes
// packed least significant first in 32-bit words, so code k of a word sits at
// bits [k*BITS, (k+1)*BITS) with no storage offset. 6-bit codes run on as
// one little-endian bit stream across words (code j at bits 6j .. 6j+5 of
// the row): 8 codes are 48 bits, a word and a half.

// NW consecutive 32-bit words of codes (p 4*NW-byte aligned): 16-byte loads
// where NW is a multiple of 4, 8-byte loads where it is even (2; 6 for a
// 6-bit plane at VEC 4), words otherwise (1; 3 for a 6-bit plane at VEC 2).
template <int NW>
struct gbx_words {
  gbx_u32 v[NW];
};
template <int NW>
GBX_FN gbx_words<NW> gbx_load_words(const GBX_DEVICE gbx_u32* p) {
  gbx_words<NW> r;
  if (NW % 4 == 0) {
    GBX_UNROLL
    for (int i = 0; i < NW / 4; ++i) {
      const uint4 q = ((const GBX_DEVICE uint4*)(p))[i];
      r.v[(4 * i + 0) % NW] = q.x;
      r.v[(4 * i + 1) % NW] = q.y;
      r.v[(4 * i + 2) % NW] = q.z;
      r.v[(4 * i + 3) % NW] = q.w;
    }
  } else if (NW % 2 == 0) {
    GBX_UNROLL
    for (int i = 0; i < NW / 2; ++i) {
      const uint2 q = ((const GBX_DEVICE uint2*)(p))[i];
      r.v[(2 * i) % NW] = q.x;
      r.v[(2 * i + 1) % NW] = q.y;
    }
  } else {
    GBX_UNROLL
    for (int i = 0; i < NW; ++i) {
      r.v[i] = p[i];
    }
  }
  return r;
}

// The four 8-bit codes of a word, as floats (exact; fields at bits 0 and 8
// of each half, below the 23-bit mantissa).
GBX_FN gbx_f4 gbx_unpack_u8(gbx_u32 w) {
  const gbx_u32 hi = w >> 16;
  gbx_f4 r;
  r.v[0] = gbx_field<0, 8, 0>(w);
  r.v[1] = gbx_field<8, 8, 0>(w);
  r.v[2] = gbx_field<0, 8, 0>(hi);
  r.v[3] = gbx_field<8, 8, 0>(hi);
  return r;
}

// The eight 6-bit codes in the 48 bits lo | (hi & 0xFFFF) << 32, as floats
// (exact: every field is read at a position below 18, inside the mantissa).
GBX_FN gbx_f8 gbx_unpack6(gbx_u32 lo, gbx_u32 hi) {
  const gbx_u32 mid = lo >> 18;               // codes 3, 4 at bits 0, 6
  const gbx_u32 top = (lo >> 30) | (hi << 2);  // codes 5, 6, 7 at bits 0, 6, 12
  gbx_f8 q;
  q.v[0] = gbx_field<0, 6, 0>(lo);
  q.v[1] = gbx_field<6, 6, 0>(lo);
  q.v[2] = gbx_field<12, 6, 0>(lo);
  q.v[3] = gbx_field<0, 6, 0>(mid);
  q.v[4] = gbx_field<6, 6, 0>(mid);
  q.v[5] = gbx_field<0, 6, 0>(top);
  q.v[6] = gbx_field<6, 6, 0>(top);
  q.v[7] = gbx_field<12, 6, 0>(top);
  return q;
}

// sum_k code_k * x_k over the 8 inputs j*8 .. j*8+7 of a chunk whose codes
// are `w` (BITS 4: word j; BITS 8: words 2j and 2j+1; BITS 6: bits 48j ..
// 48j+47, in words 3j/2 and 3j/2+1, starting half-way into the first for odd
// j). j is a constant after unrolling, so the choice of words folds away.
template <int BITS, int NW>
GBX_FN float gbx_dot8(gbx_words<NW> w, int j, gbx_f8 x) {
  float s = 0.0f;
  if (BITS == 6) {
    const int k = (3 * j) / 2;
    gbx_u32 lo = w.v[k % NW], hi = w.v[(k + 1) % NW];
    if (j & 1) {
      lo = (lo >> 16) | (hi << 16);
      hi >>= 16;
    }
    const gbx_f8 q = gbx_unpack6(lo, hi);
    GBX_UNROLL
    for (int i = 0; i < 8; ++i) {
      s += q.v[i] * x.v[i];
    }
  } else if (BITS == 4) {
    const gbx_f8 q = gbx_unpack4<0>(w.v[j % NW]);
    GBX_UNROLL
    for (int k = 0; k < 8; ++k) {
      s += q.v[k] * x.v[k];
    }
  } else {
    const gbx_f4 a = gbx_unpack_u8(w.v[(2 * j) % NW]);
    const gbx_f4 b = gbx_unpack_u8(w.v[(2 * j + 1) % NW]);
    GBX_UNROLL
    for (int k = 0; k < 4; ++k) {
      s += a.v[k] * x.v[k];
      s += b.v[k] * x.v[k + 4];
    }
  }
  return s;
}

// The biased reading of a word of 4-bit codes (BIASED): each code lands in
// the mantissa of a float whose exponent makes it worth M + code, M = 256 for
// the even codes (mantissa bits 15..18) and 16 for the odd ones (19..22), so
// a code costs a mask-and-or and a multiply-add, and no subtraction:
//   returns sum_k (M_k + code_k) * x_k over the word's 8 codes;
// the caller subtracts sum_k M_k x_k = 16 * sum(x) + 240 * sum(even x) once
// per chunk. Four shifts bring the code pairs (0,1), (2,3), (4,5), (6,7) to
// bits 15 and 19. The offsets cost the products log2(256/15) ~ 4 bits of
// float32's 24 against exact codes, far below a half-precision output's.
#define GBX_BIAS_EVEN 256.0f
#define GBX_BIAS_ODD 16.0f
GBX_FN float gbx_dot8_biased4(gbx_u32 w, gbx_f8 x) {
  const gbx_u32 even = gbx_u32(127 + 8) << 23;  // 2^8: bit 15 of the mantissa is worth 1
  const gbx_u32 odd = gbx_u32(127 + 4) << 23;   // 2^4: bit 19 is worth 1
  const gbx_u32 lo = 0xFu << 15, hi = 0xFu << 19;
  const gbx_u32 a = w << 15, b = w << 7, c = w >> 1, d = w >> 9;
  float s = GBX_AS_FLOAT(even | (a & lo)) * x.v[0];
  s += GBX_AS_FLOAT(odd | (a & hi)) * x.v[1];
  s += GBX_AS_FLOAT(even | (b & lo)) * x.v[2];
  s += GBX_AS_FLOAT(odd | (b & hi)) * x.v[3];
  s += GBX_AS_FLOAT(even | (c & lo)) * x.v[4];
  s += GBX_AS_FLOAT(odd | (c & hi)) * x.v[5];
  s += GBX_AS_FLOAT(even | (d & lo)) * x.v[6];
  s += GBX_AS_FLOAT(odd | (d & hi)) * x.v[7];
  return s;
}

// The biased reading of eight 6-bit codes (BIASED6), the 48 bits from bit
// `o` (0 or 16) of lo | hi << 32: one shift (a funnel shift where the pair
// straddles the words) brings each pair of codes (2i, 2i+1), 12 adjacent
// bits, to bits 11..22, and a mask-and-or makes each a float worth M + code,
// M = 4096 for the even code (bits 11..16) and 64 for the odd one (17..22):
//   returns sum_k (M_k + code_k) * x_k;
// the caller subtracts 64 * sum(x) + 4032 * sum(even x) once per chunk.
// Against gbx_dot8's reading this drops a subtraction per code and the
// realignment of the odd chunks' words. The even codes' offset costs the
// products 12 of float32's 24 bits against exact codes: a 6-bit plane is the
// last residual, far below a half-precision output's step.
#define GBX_BIAS6_EVEN 4096.0f
#define GBX_BIAS6_ODD 64.0f
GBX_FN float gbx_dot8_biased6(gbx_u32 lo, gbx_u32 hi, int o, gbx_f8 x) {
  const gbx_u32 even = gbx_u32(127 + 12) << 23;  // 2^12: bit 11 of the mantissa is worth 1
  const gbx_u32 odd = gbx_u32(127 + 6) << 23;    // 2^6: bit 17 is worth 1
  const gbx_u32 lo_mask = 0x3Fu << 11, hi_mask = 0x3Fu << 17;
  gbx_u32 p[4];
  if (o == 0) {  // pairs at bits 0, 12, 24 (straddling) and 36 of the window
    p[0] = lo << 11;
    p[1] = lo >> 1;
    p[2] = (lo >> 13) | (hi << 19);
    p[3] = hi << 7;
  } else {  // at bits 16, 28 (straddling), 40 and 52
    p[0] = lo >> 5;
    p[1] = (lo >> 17) | (hi << 15);
    p[2] = hi << 3;
    p[3] = hi >> 9;
  }
  float s = 0.0f;
  GBX_UNROLL
  for (int i = 0; i < 4; ++i) {
    s += GBX_AS_FLOAT(even | (p[i] & lo_mask)) * x.v[2 * i];
    s += GBX_AS_FLOAT(odd | (p[i] & hi_mask)) * x.v[2 * i + 1];
  }
  return s;
}

// gbx_dot8 of one plane: a 4-bit plane biased where BIASED, a 6-bit one
// where BIASED6 (see above).
template <int BITS, int NW, bool BIASED_CODES, bool BIASED6_CODES>
GBX_FN float gbx_dot8_plane(gbx_words<NW> w, int j, gbx_f8 x) {
  if (BITS == 4 && BIASED_CODES) {
    return gbx_dot8_biased4(w.v[j % NW], x);
  }
  if (BITS == 6 && BIASED6_CODES) {
    const int k = (3 * j) / 2;  // as gbx_dot8: the chunk's codes start in word k, at bit 16 for odd j
    return gbx_dot8_biased6(w.v[k % NW], w.v[(k + 1) % NW], (j & 1) * 16, x);
  }
  return gbx_dot8<BITS, NW>(w, j, x);
}

// Int8 activations (INT8X): sum_k a_k * b_k over the four signed bytes of
// each word, plus c. CUDA has one instruction for it (GBX_DP4A in its
// prelude); Metal and the host emulation spell it out.
#ifndef GBX_DP4A
GBX_FN int gbx_dp4a(gbx_u32 a, gbx_u32 b, int c) {
  GBX_UNROLL
  for (int k = 0; k < 32; k += 8) {
    c += (int(((a >> k) & 0xFFu) ^ 0x80u) - 128) * (int(((b >> k) & 0xFFu) ^ 0x80u) - 128);
  }
  return c;
}
#define GBX_DP4A(a, b, c) gbx_dp4a(a, b, c)
#endif

// A word's 8 codes against its 8 inputs rounded to int8: `xe` holds the
// inputs of codes 0, 2, 4, 6 (bytes 0..3), `xo` those of codes 1, 3, 5, 7, so
// one mask reads the even codes and a shift and a mask the odd ones (codes
// 0..15 are non-negative signed bytes): two integer dot products a word.
GBX_FN int gbx_idot8_4(gbx_u32 w, gbx_u32 xe, gbx_u32 xo, int acc) {
  acc = GBX_DP4A(w & 0x0F0F0F0Fu, xe, acc);
  return GBX_DP4A((w >> 4) & 0x0F0F0F0Fu, xo, acc);
}

// Four int8 values (each in [-127, 127]) packed least significant first.
GBX_FN gbx_u32 gbx_pack_i8(int a, int b, int c, int d) {
  return (gbx_u32(a) & 0xFFu) | ((gbx_u32(b) & 0xFFu) << 8) | ((gbx_u32(c) & 0xFFu) << 16) |
         ((gbx_u32(d) & 0xFFu) << 24);
}

// Round x[32c .. 32c+31] to int8 with one step d = max|x| / 127 (the C
// int-dot path's rounding, gearbx_mlx.kernelcheck's `intdot` bound), into
// the chunk's 8 words of `q` (for each 8 inputs: their even, then odd,
// inputs, as gbx_idot8_4 takes them) and (d, sum of the rounded inputs)
// into `dsum`: the biases' term sees the same rounded x as the codes', so
// the error is that of the whole weight times x's rounding, as the bound
// says, not of s * q alone. A step that is 0 or not finite rounds every
// input to 0 and keeps x's own sum, so an infinity or NaN in x still
// reaches the output.
template <typename T>
GBX_FN void gbx_stage_i8(const GBX_DEVICE T* x, int c, GBX_SHARED_PTR gbx_u32* q,
                         GBX_SHARED_PTR float* dsum) {
  gbx_f8 v[4];
  float amax = 0.0f, sum = 0.0f;
  GBX_UNROLL
  for (int j = 0; j < 4; ++j) {
    v[j] = gbx_load_x8(x, 32 * c + 8 * j);
    GBX_UNROLL
    for (int k = 0; k < 8; ++k) {
      amax = GBX_FMAX(amax, GBX_FABS(v[j].v[k]));
      sum += v[j].v[k];
    }
  }
  const float d = amax / 127.0f;
  const bool ok = d > 0.0f && d < 3.0e38f;  // NaN fails both
  int isum = 0;
  GBX_UNROLL
  for (int j = 0; j < 4; ++j) {
    int r[8];
    GBX_UNROLL
    for (int k = 0; k < 8; ++k) {
      r[k] = ok ? int(GBX_RINT(v[j].v[k] / d)) : 0;
      isum += r[k];
    }
    q[8 * c + 2 * j] = gbx_pack_i8(r[0], r[2], r[4], r[6]);
    q[8 * c + 2 * j + 1] = gbx_pack_i8(r[1], r[3], r[5], r[7]);
  }
  dsum[2 * c] = ok ? d : amax;  // a non-finite |x| keeps its infinity or NaN
  dsum[2 * c + 1] = ok ? float(isum) * d : sum;
}

// The sum of a chunk's VEC staged sums (float4 entries, chunk ch: entries ch*VEC ..).
template <int VEC_>
GBX_FN float gbx_shared_sum(GBX_SHARED_PTR const float4* sums, int ch) {
  GBX_SHARED_PTR const float* p = (GBX_SHARED_PTR const float*)(sums) + ch * VEC_;
  if (VEC_ == 4) {
    const float4 q = *((GBX_SHARED_PTR const float4*)(p));
    return (q.x + q.y) + (q.z + q.w);
  }
  float t = 0.0f;
  GBX_UNROLL
  for (int j = 0; j < VEC_; ++j) {
    t += p[j];
  }
  return t;
}

// Issue the loads of chunk `ch` of one plane for ROWS rows: the chunk's codes
// (NW words at word ch * NW of each row) and its group's scale and bias, kept
// as stored: converting them here would wait for the loads at once, before
// the current chunk is computed, and undo the double buffering.
template <typename S, int NW, int ROWS>
GBX_FN void gbx_load_chunk(GBX_THREAD gbx_words<NW> (&w)[ROWS], GBX_THREAD S (&s)[ROWS],
                           GBX_THREAD S (&b)[ROWS], const GBX_DEVICE gbx_u32* codes,
                           const GBX_DEVICE S* scales, const GBX_DEVICE S* biases,
                           GBX_THREAD const int (&row)[ROWS], int words_per_row, int ng, int ch,
                           int g) {
  GBX_UNROLL
  for (int r = 0; r < ROWS; ++r) {
    w[r] = gbx_load_words<NW>(codes + row[r] * words_per_row + ch * NW);
    s[r] = scales[row[r] * ng + g];
    b[r] = biases[row[r] * ng + g];
  }
}
