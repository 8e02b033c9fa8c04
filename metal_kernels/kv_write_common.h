// Helpers of the KV write body (kv_write_body.inc), Metal and CUDA alike.
// Follows gemv_common.h (gbx_u32, gbx_f8, gbx_load_x8) and a prelude (the
// GBX_* macros, GBX_ROUND .. GBX_FMUL among them).
//
// One thread quantizes one group of GS consecutive elements of a row into
// MLX's affine format (../gearbx_format.h): codes c in [0, 2^BITS), packed
// least significant first into one bit stream of 32-bit words per row (3-,
// 5- and 6-bit codes straddle words), and a scale s and bias b in the
// input dtype, x ~ s * c + b. A group is GS * BITS / 32 whole words, so no
// two threads write one word. All arithmetic is float32, in the order the
// pure-MLX path (gearbx_mlx.kvcache.quantize) takes, op for op:
//
// * min-max: MLX's GPU affine quantize (its Metal and CUDA kernels alike):
//   the group's minimum, and its maximum clamped below at 0; a scale of
//   (max - min) / (2^BITS - 1), at least 1e-7, negative unless |min| >
//   |max|; the edge (min or max) put exactly on code 0 by rounding its
//   code; codes round((x - b) / s) half away from zero, at most 2^BITS - 1.
// * least squares (LS): from MLX's scale and bias as stored (rounded to T),
//   ITERS times: codes rint((x - b) / s) clipped to [0, 2^BITS - 1], then s
//   and b refitted to them by least squares (unless the normal equations'
//   determinant is <= 1e-6); the refit is kept where its squared error, with
//   s and b rounded to T, is below that of MLX's own codes dequantized in T.
//
// The sums over a group are serial here and in another order in MLX's
// reductions: the last bits of a sum may differ, which moves a code only
// where (x - b) / s lies within a rounding of a half (a tie).

// Threads per threadgroup of the launch (gearbx_mlx.kvcache.write_kernel reads it).
#define GBX_KV_THREADS 256

// v rounded to T and back: what an MLX array of dtype T holds.
template <typename T>
GBX_FN float gbx_kv_round_t(float v) {
  return float(T(v));
}

// Eight elements e .. e+7 of a group as the quantizer sees them: x, or with
// an offset, x - o rounded to T as MLX's `keys - offset.astype(T)` stores it
// (a float32 difference of two T values rounds to the same T value as T
// arithmetic: float has more than 2p + 2 bits for T's p).
template <typename T, bool OFF>
GBX_FN gbx_f8 gbx_kv_load8(const GBX_DEVICE T* x, const GBX_DEVICE float* off, int e) {
  gbx_f8 v = gbx_load_x8(x, e);
  if (OFF) {
    const gbx_f8 o = gbx_load_x8(off, e);
    GBX_UNROLL
    for (int i = 0; i < 8; ++i) {
      v.v[i] = gbx_kv_round_t<T>(v.v[i] - gbx_kv_round_t<T>(o.v[i]));
    }
  }
  return v;
}

// MLX's min-max code of x (float scale and bias, before rounding to T).
template <int BITS>
GBX_FN float gbx_kv_code_minmax(float x, float scale, float bias) {
  const float top = float((1 << BITS) - 1);
  return GBX_FMAX(GBX_FMIN(GBX_ROUND((x - bias) / scale), top), 0.0f);
}

// The least-squares path's code of x: mx.round (half to even) and mx.clip.
template <int BITS>
GBX_FN float gbx_kv_code_ls(float x, float scale, float bias) {
  const float top = float((1 << BITS) - 1);
  return GBX_FMIN(GBX_FMAX(GBX_RINT((x - bias) / scale), 0.0f), top);
}

// Packs codes least significant first into consecutive words at `out`.
struct gbx_kv_packer {
  gbx_u32 acc;
  int nbits;
  int word;
};

template <int BITS>
GBX_FN void gbx_kv_put(GBX_THREAD gbx_kv_packer& p, GBX_DEVICE gbx_u32* out, gbx_u32 code) {
  p.acc |= code << p.nbits;
  p.nbits += BITS;
  if (p.nbits >= 32) {
    out[p.word] = p.acc;
    p.word += 1;
    p.nbits -= 32;
    // The code's bits that did not fit (none when it ended the word).
    p.acc = p.nbits > 0 ? code >> (BITS - p.nbits) : 0u;
  }
}

// Quantizes the GS elements at x (minus the offset at off, if OFF) into
// GS * BITS / 32 words at w and one scale and bias.
template <typename T, int BITS, int GS, bool LS, int ITERS, bool OFF>
GBX_FN void gbx_kv_quantize_group(const GBX_DEVICE T* x, const GBX_DEVICE float* off,
                                  GBX_DEVICE gbx_u32* w, GBX_DEVICE T* scale_out,
                                  GBX_DEVICE T* bias_out) {
  const float n_bins = float((1 << BITS) - 1);
  // Extremes as MLX's GPU kernels start them: the maximum from 0.
  float w_min = 3.402823466e+38f;
  float w_max = 0.0f;
  float sx = 0.0f;
  for (int e = 0; e < GS; e += 8) {
    const gbx_f8 v = gbx_kv_load8<T, OFF>(x, off, e);
    GBX_UNROLL
    for (int i = 0; i < 8; ++i) {
      w_min = GBX_FMIN(w_min, v.v[i]);
      w_max = GBX_FMAX(w_max, v.v[i]);
      sx += v.v[i];
    }
  }
  float scale = GBX_FMAX((w_max - w_min) / n_bins, 1e-7f);
  const bool side = GBX_FABS(w_min) > GBX_FABS(w_max);
  scale = side ? scale : -scale;
  const float edge = side ? w_min : w_max;
  const float q0 = GBX_ROUND(edge / scale);
  const bool at_zero = q0 == 0.0f;
  scale = at_zero ? scale : edge / q0;
  const float bias = at_zero ? 0.0f : edge;
  // What MLX stores, and reads back.
  const float s_t = gbx_kv_round_t<T>(scale);
  const float b_t = gbx_kv_round_t<T>(bias);

  bool refit = false;
  float s = s_t;
  float b = b_t;
  if (LS) {
    const float n = float(GS);
    for (int it = 0; it < ITERS; ++it) {
      const float safe = GBX_FABS(s) > 1e-30f ? s : 1e-30f;
      int sc = 0;
      int scc = 0;
      float scx = 0.0f;
      for (int e = 0; e < GS; e += 8) {
        const gbx_f8 v = gbx_kv_load8<T, OFF>(x, off, e);
        GBX_UNROLL
        for (int i = 0; i < 8; ++i) {
          const float c = gbx_kv_code_ls<BITS>(v.v[i], safe, b);
          const int ci = int(c);
          sc += ci;
          scc += ci * ci;
          scx += GBX_FMUL(c, v.v[i]);
        }
      }
      // n * scc and sc * sc are integers; float(n * scc) is exact (n is a
      // power of two) and float(sc * sc) rounds as a float product does.
      const float fsc = float(sc);
      const float det = float(GS * scc) - float(sc * sc);
      if (det > 1e-6f) {
        const float s_new = (n * scx - GBX_FMUL(fsc, sx)) / det;
        b = (sx - GBX_FMUL(s_new, fsc)) / n;
        s = s_new;
      }
    }
    // The refit's error with s and b as stored, against MLX's.
    const float safe = GBX_FABS(s) > 1e-30f ? s : 1e-30f;
    const float s16 = gbx_kv_round_t<T>(s);
    const float b16 = gbx_kv_round_t<T>(b);
    float err_new = 0.0f;
    float err_old = 0.0f;
    for (int e = 0; e < GS; e += 8) {
      const gbx_f8 v = gbx_kv_load8<T, OFF>(x, off, e);
      GBX_UNROLL
      for (int i = 0; i < 8; ++i) {
        const float c = gbx_kv_code_ls<BITS>(v.v[i], safe, b);
        const float dn = (GBX_FMUL(c, s16) + b16) - v.v[i];
        err_new += GBX_FMUL(dn, dn);
        // mx.dequantize in T: the product rounded to T, then the sum.
        const float cm = gbx_kv_code_minmax<BITS>(v.v[i], scale, bias);
        const float dq = gbx_kv_round_t<T>(gbx_kv_round_t<T>(GBX_FMUL(cm, s_t)) + b_t);
        const float d_old = dq - v.v[i];
        err_old += GBX_FMUL(d_old, d_old);
      }
    }
    refit = err_new < err_old;
    if (refit) {
      s = safe;  // the codes' divisor from here on; s16 is what is stored
      scale_out[0] = T(s16);
      bias_out[0] = T(b16);
    }
  }
  if (!refit) {
    scale_out[0] = T(s_t);
    bias_out[0] = T(b_t);
  }

  gbx_kv_packer p;
  p.acc = 0u;
  p.nbits = 0;
  p.word = 0;
  for (int e = 0; e < GS; e += 8) {
    const gbx_f8 v = gbx_kv_load8<T, OFF>(x, off, e);
    GBX_UNROLL
    for (int i = 0; i < 8; ++i) {
      const float c = refit ? gbx_kv_code_ls<BITS>(v.v[i], s, b)
                            : gbx_kv_code_minmax<BITS>(v.v[i], scale, bias);
      gbx_kv_put<BITS>(p, w, gbx_u32(c));
    }
  }
}
