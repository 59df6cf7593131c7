// Weight-only matmuls on GGUF K-quant weights (Q4_K, Q5_K, Q6_K) for x86 CPUs, built at first use by
// loraplex/ops/gguf/kquant_kernel.py twice from this source: -mavx2 -mfma -mf16c (8-float vectors) and with
// -mavx512f (16-float vectors).
//
// Semantics: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x float32 [M, K] (unit inner stride), w [N, K]
// stored as K / 256 super-blocks per row in the layouts of loraplex/ops/gguf/kquant_formats.py. Each
// super-block of a tile's weight rows is dequantized into a 1 KiB L1-resident buffer with exactly
// gguf.quants' float32 operations (w = (d * sc) * q - (dmin * m), compiled with -ffp-contract=off: no fused
// multiply-add), so w is bitwise gguf.quants.dequantize's; products are summed with fused multiply-adds into
// one accumulator vector per output (lane l takes k = l, l + W, ...), lanes added in a fixed order. A result
// depends on its own row of x alone, whatever M and the tiling.
#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "gemm_problem.h"

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kQKK = 256;

#ifdef __AVX512F__
constexpr int kW = 16;
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a); }
#else
constexpr int kW = 8;
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a); }
#endif
constexpr int kTileN = 4;  // weight rows per tile
constexpr int kTileM = 4;  // rows of x per tile (16 accumulators)

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

enum class Type { Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// The eight 6-bit scales and minimums of Q4_K / Q5_K from their 12 packed bytes.
inline void scale_min(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 0x3F;
    mn[j] = s[j + 4] & 0x3F;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
  }
}

template <Type T>
struct Super;

template <>
struct Super<Type::Q4_K> {
  static constexpr int64_t kBytes = 144;
  static inline void load(const uint8_t* p, float* w) {
    uint8_t sc[8], mn[8];
    scale_min(p + 4, sc, mn);
    const float d = f16(p), dmin = f16(p + 2);
    const uint8_t* qs = p + 16;
    for (int j = 0; j < 8; ++j) {
      const float dl = d * static_cast<float>(sc[j]), dm = dmin * static_cast<float>(mn[j]);
      const uint8_t* g = qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int l = 0; l < 32; ++l) w[32 * j + l] = dl * static_cast<float>((g[l] >> shift) & 0x0F) - dm;
    }
  }
};

template <>
struct Super<Type::Q5_K> {
  static constexpr int64_t kBytes = 176;
  static inline void load(const uint8_t* p, float* w) {
    uint8_t sc[8], mn[8];
    scale_min(p + 4, sc, mn);
    const float d = f16(p), dmin = f16(p + 2);
    const uint8_t* qh = p + 16;
    const uint8_t* qs = p + 48;
    for (int j = 0; j < 8; ++j) {
      const float dl = d * static_cast<float>(sc[j]), dm = dmin * static_cast<float>(mn[j]);
      const uint8_t* g = qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int l = 0; l < 32; ++l) {
        const int q = ((g[l] >> shift) & 0x0F) | (((qh[l] >> j) & 1) << 4);
        w[32 * j + l] = dl * static_cast<float>(q) - dm;
      }
    }
  }
};

template <>
struct Super<Type::Q6_K> {
  static constexpr int64_t kBytes = 210;
  static inline void load(const uint8_t* p, float* w) {
    const uint8_t* ql = p;
    const uint8_t* qh = p + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
    const float d = f16(p + 208);
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 4; ++s) {
        const uint8_t* lo = ql + 64 * h + 32 * (s % 2);
        const int lo_shift = 4 * (s / 2), hi_shift = 2 * s;
        const int v0 = 128 * h + 32 * s;
        const float d0 = d * static_cast<float>(scales[v0 / 16]), d1 = d * static_cast<float>(scales[v0 / 16 + 1]);
        for (int t = 0; t < 32; ++t) {
          const int q = (((lo[t] >> lo_shift) & 0x0F) | (((qh[32 * h + t] >> hi_shift) & 3) << 4)) - 32;
          w[v0 + t] = (t < 16 ? d0 : d1) * static_cast<float>(q);
        }
      }
    }
  }
};

inline float lanes_sum(V a) {
  alignas(64) float buf[kW];
  vstore(buf, a);
  float s = 0.0f;
  for (int l = 0; l < kW; ++l) s += buf[l];
  return s;
}

using loraplex_gguf::Problem;

// Outputs y[r0 .. r0 + rm, n0 .. n0 + RN) (rm <= kTileM): each super-block of the RN rows dequantized once.
template <Type T, int RN>
void tile(const Problem& p, int64_t n0, int64_t r0, int rm) {
  alignas(64) float w[RN][kQKK];
  V acc[RN][kTileM];
  for (int n = 0; n < RN; ++n)
    for (int r = 0; r < kTileM; ++r) acc[n][r] = vzero();
  for (int64_t b = 0; b < p.blocks; ++b) {
    for (int n = 0; n < RN; ++n) Super<T>::load(p.w + (n0 + n) * p.row_bytes + b * Super<T>::kBytes, w[n]);
    for (int r = 0; r < rm; ++r) {
      const float* xr = p.x + (r0 + r) * p.ldx + b * kQKK;
      for (int v = 0; v < kQKK; v += kW) {
        const V xv = vload(xr + v);
#pragma GCC unroll 4
        for (int n = 0; n < RN; ++n) acc[n][r] = vfma(xv, vload(w[n] + v), acc[n][r]);
      }
    }
  }
  for (int n = 0; n < RN; ++n) {
    const float bias = p.bias ? p.bias[n0 + n] : 0.0f;
    for (int r = 0; r < rm; ++r) p.y[(r0 + r) * p.ldy + n0 + n] = lanes_sum(acc[n][r]) + bias;
  }
}

template <Type T>
void run(const Problem& p, int64_t m, int64_t n) {
  at::parallel_for(0, (n + kTileN - 1) / kTileN, 1, [&](int64_t t0, int64_t t1) {
    const int64_t end = std::min<int64_t>(n, t1 * kTileN);
    int64_t i = t0 * kTileN;
    for (; i + kTileN <= end; i += kTileN)
      for (int64_t r = 0; r < m; r += kTileM) tile<T, kTileN>(p, i, r, std::min<int64_t>(kTileM, m - r));
    for (; i < end; ++i)
      for (int64_t r = 0; r < m; r += kTileM) tile<T, 1>(p, i, r, std::min<int64_t>(kTileM, m - r));
  });
}

int64_t super_bytes(int64_t type) {
  switch (static_cast<Type>(type)) {
    case Type::Q4_K: return Super<Type::Q4_K>::kBytes;
    case Type::Q5_K: return Super<Type::Q5_K>::kBytes;
    case Type::Q6_K: return Super<Type::Q6_K>::kBytes;
  }
  TORCH_CHECK(false, "kquant_gemm: unsupported GGML type ", type);
}

}  // namespace

// y [M, N] (a view with unit inner stride, written) = x [M, K] @ dequantize(w)^T (+ bias [N]).
void linear_into(const torch::Tensor& x, const torch::Tensor& w, int64_t type, torch::Tensor& y,
                 const c10::optional<torch::Tensor>& bias) {
  torch::Tensor bias_keep;
  const Problem p = loraplex_gguf::checked_problem("kquant_gemm", x, w, y, bias, kQKK, super_bytes(type), bias_keep);
  const int64_t m = x.size(0), n = w.size(0);
  if (m == 0 || n == 0) return;
  switch (static_cast<Type>(type)) {
    case Type::Q4_K: return run<Type::Q4_K>(p, m, n);
    case Type::Q5_K: return run<Type::Q5_K>(p, m, n);
    case Type::Q6_K: return run<Type::Q6_K>(p, m, n);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_into", &linear_into, "y = x @ dequantize(w)^T + bias for GGUF Q4_K / Q5_K / Q6_K rows");
}
