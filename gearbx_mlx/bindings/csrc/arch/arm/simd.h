/*
 * arch/arm/simd.h -- helpers shared by the AArch64 kernel files.
 */
#ifndef GEARBX_CPU_ARM_SIMD_H
#define GEARBX_CPU_ARM_SIMD_H

#include "../../internal.h"

#if GBX_NEON

/* int8 x int8 -> int32 lanes without dotprod: |a_k b_k + a_k+8 b_k+8| <=
 * 2*127*127 fits int16.  Its lane split differs from vdotq_s32's; the lane
 * total, an exact integer, does not. */
GBX_INLINE int32x4_t dot16_mull(int32x4_t acc, int8x16_t a, int8x16_t b)
{
    int16x8_t p = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    p = vmlal_high_s8(p, a, b);
    return vpadalq_s16(acc, p);
}

/* 16 signed int8 -> 16 floats multiplied into two accumulators */
GBX_INLINE void fma16_neon(float32x4_t *t0, float32x4_t *t1, int8x16_t q, const float *x)
{
    const int16x8_t l = vmovl_s8(vget_low_s8(q)), h = vmovl_high_s8(q);
    *t0 = vfmaq_f32(*t0, vcvtq_f32_s32(vmovl_s16(vget_low_s16(l))), vld1q_f32(x));
    *t1 = vfmaq_f32(*t1, vcvtq_f32_s32(vmovl_high_s16(l)), vld1q_f32(x + 4));
    *t0 = vfmaq_f32(*t0, vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))), vld1q_f32(x + 8));
    *t1 = vfmaq_f32(*t1, vcvtq_f32_s32(vmovl_high_s16(h)), vld1q_f32(x + 12));
}

/* 16 weight bytes of int4 -> signed low nibbles (elements 2k), high (2k+1) */
GBX_INLINE void q4_split16_neon(const uint8_t *p, int8x16_t *lo, int8x16_t *hi)
{
    const uint8x16_t v = vld1q_u8(p);
    const int8x16_t off = vdupq_n_s8(GBX_INT4_OFFSET);
    int8x16_t l = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))), off);
    int8x16_t h = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), off);
    GBX_NIBBLE_ORDER(int8x16_t, l, h);
    *lo = l;
    *hi = h;
}


/* One scale or bias (float32, float16 or bfloat16 storage) as float32. */
GBX_INLINE float gbx_scale1_neon(const void *p, size_t i, const int dtype)
{
    if (dtype == GBX_DTYPE_F32)
        return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    if (dtype == GBX_DTYPE_F16)
        return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
    return gbx_bf16_to_f32(h);
}

#endif /* GBX_NEON */
#endif /* GEARBX_CPU_ARM_SIMD_H */
