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

#endif /* GBX_X86 */
#endif /* GEARBX_CPU_X86_SIMD_H */
