// gearbx_format.h -- the weight formats the kernels read, defined once for C,
// Metal and CUDA (as ggml-common.h is for ggml).
//
// Included by the C kernels (cpu/gearbx_cpu.h), and put at the head of every
// GPU kernel's header by gearbx_mlx.bindings.packed_gpu. Python reads these #defines
// (gearbx_mlx.bindings.kernel_files.format_constants), and
// tests/test_kernel_format.py checks them against gearbx_mlx.packed.formats
// and gearbx_mlx.nested.planes. So this file holds only preprocessor
// constants, macros of plain integer arithmetic and static assertions: no
// includes, no types, `//` comments (the GPU loader strips those).
//
// Two families of formats:
//
// Packed symmetric (gearbx_mlx.packed.formats), W (O rows, I columns):
//   scales  float32 (O, n_groups); n_groups = 1 (per row) or I / group_size.
//   int8    int8 (O, I), q in [-127, 127].
//   int4    uint8 (O, I/2): element j of a row in byte j/2, low nibble for
//           even j, high nibble for odd j, stored as q + 8 (q in [-7, 7]).
//   y_i = sum_g s_{i,g} * sum_{j in g} q_ij * x_j.
//
// Affine planes (MLX's mx.quantize; gearbx_mlx.nested.planes), W (O, I):
//   codes   uint32 (O, I * bits / 32): unsigned codes packed least
//           significant first, 32 / bits per word (so at 4 bits byte j/2 of
//           a row holds element j in its low nibble for even j: the int4
//           layout above without the offset). 6-bit codes are one
//           little-endian bit stream per row: code j at bits 6j .. 6j+5,
//           four codes in three bytes, words not holding whole codes.
//   scales, biases  (O, I / group_size) in float32, float16 or bfloat16, each
//           plane with its own bits and group size.
//   A plane with exponent e adds 2^-e * (scale * q + bias) to each weight;
//   a gear reads the first n planes (1 <= n <= GBX_MAX_PLANES):
//   y_o = sum_{p<n} 2^-e_p * sum_g (s_pog * sum_{j in g} q_poj x_j
//                                  + b_pog * sum_{j in g} x_j).
#ifndef GEARBX_FORMAT_H
#define GEARBX_FORMAT_H

#if defined(__cplusplus)
#define GBX_STATIC_ASSERT(c, m) static_assert(c, m)
#else
#define GBX_STATIC_ASSERT(c, m) _Static_assert(c, m)
#endif

// ---- packed symmetric formats -----------------------------------------------
#define GBX_QMAX_INT8 127
#define GBX_QMAX_INT4 7
#define GBX_INT4_OFFSET 8
// Signed value of element 2k (LO) and 2k+1 (HI) from byte k of an int4 row.
#define GBX_INT4_LO(b) ((int)((b) & 0x0F) - GBX_INT4_OFFSET)
#define GBX_INT4_HI(b) ((int)(((b) >> 4) & 0x0F) - GBX_INT4_OFFSET)

// ---- group sizes (both families) ------------------------------------------
// Groups are powers of two from GBX_GROUP_MIN to GBX_GROUP_MAX inputs; the
// packed formats also take per-row scales (group size 0).
#define GBX_GROUP_MIN 32
#define GBX_GROUP_MAX 128

// ---- affine planes ----------------------------------------------------------
#define GBX_MAX_PLANES 3
#define GBX_WORD_BITS 32
// Plane bit widths with kernels: 4 and 8, and 6 (the default plan's third
// plane). MLX also quantizes to 2, 3 and 5 bits; those planes take the
// pure-MLX path.
#define GBX_PLANE_BITS_LO 4
#define GBX_PLANE_BITS_HI 8
#define GBX_PLANE_BITS_6 6
// Codes of one 32-bit word at `bits` bits.
#define GBX_CODES_PER_WORD(bits) (GBX_WORD_BITS / (bits))
// Scale and bias dtypes, as the C kernels and the GPU kernel names number them.
#define GBX_DTYPE_F32 0
#define GBX_DTYPE_F16 1
#define GBX_DTYPE_BF16 2

// ---- GPU kernels ------------------------------------------------------------
// Inputs staged in threadgroup/shared memory up to this K (§8.1, §16.2): as
// float32 that is 24 KB, leaving room for several threadgroups per core.
#define GBX_SHARED_K 6144
// Largest K whose input vector the matrix-unit variant stages in threadgroup
// memory: 14336 16-bit inputs are 28 KB, under Metal's 32 KB.
#define GBX_MMA_MAX_K 14336
// Largest K whose input vector the nested GEMV's int8-activation variant
// stages (one byte an input, a step and a sum per 32): 20 KB at 16384.
#define GBX_INT8_K 16384

GBX_STATIC_ASSERT(GBX_INT4_OFFSET == GBX_QMAX_INT4 + 1, "int4 storage is q + 8: 1..15, 0 unused");
GBX_STATIC_ASSERT(GBX_GROUP_MIN % 32 == 0, "a group holds whole 32-input blocks and 32-bit words");
GBX_STATIC_ASSERT((GBX_GROUP_MAX & (GBX_GROUP_MAX - 1)) == 0, "group sizes are powers of two");
GBX_STATIC_ASSERT(GBX_WORD_BITS % GBX_PLANE_BITS_LO == 0 && GBX_WORD_BITS % GBX_PLANE_BITS_HI == 0,
                  "a word holds whole codes");
GBX_STATIC_ASSERT(GBX_GROUP_MIN % GBX_CODES_PER_WORD(GBX_PLANE_BITS_LO) == 0,
                  "a 4-bit word never straddles a group");
GBX_STATIC_ASSERT((GBX_GROUP_MIN * GBX_PLANE_BITS_6) % GBX_WORD_BITS == 0,
                  "a group of 6-bit codes fills whole words");
GBX_STATIC_ASSERT(GBX_SHARED_K % 32 == 0 && GBX_MMA_MAX_K % 64 == 0 && GBX_INT8_K % 32 == 0,
                  "staged inputs are whole SIMD-group chunks");

#endif  // GEARBX_FORMAT_H
