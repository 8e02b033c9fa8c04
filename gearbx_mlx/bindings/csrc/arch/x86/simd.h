/*
 * arch/x86/simd.h -- helpers shared by the x86 kernel files.
 */
#ifndef GEARBX_CPU_X86_SIMD_H
#define GEARBX_CPU_X86_SIMD_H

#include "../../internal.h"

#if GBX_X86

/* Software prefetch this far ahead of the weight stream: the hardware
 * prefetchers alone left a single thread at about half the read bandwidth,
 * because the arithmetic between loads keeps few misses in flight. */
#ifndef GBX_PREFETCH_BYTES
#define GBX_PREFETCH_BYTES 2048
#endif
#define GBX_PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
/* (NEON kernels rely on the hardware prefetchers: not measured there.) */

GBX_AVX2_FN GBX_INLINE float hsum_avx2(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}


/* One scale or bias (float32, float16 or bfloat16 storage) as float32. */
__attribute__((target("avx2,fma,f16c"))) GBX_INLINE float gbx_scale1_x86(const void *p, size_t i, const int dtype)
{
    if (dtype == GBX_DTYPE_F32)
        return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    if (dtype == GBX_DTYPE_F16)
        return _cvtsh_ss(h);
    return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128((int)((uint32_t)h << 16))));
}

#endif /* GBX_X86 */
#endif /* GEARBX_CPU_X86_SIMD_H */
