// The float vector lora_sgmv.cpp computes with: 16 lanes (__m512) in the build with -mavx512f, else 8 lanes
// (__m256, -mavx2 -mfma). Adapter weights are float or bfloat16 (``uint16_t``: a float32's high half, so
// ``vload`` widens them with a zero-extend and a shift; ``widen`` does one).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace lora_simd {

#ifdef __AVX512F__
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#else
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline float vsum(Vec v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
#endif

inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128(int32_t{v} << 16))); }

}  // namespace lora_simd
