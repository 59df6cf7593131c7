// Weight-only matmuls on GGUF block-quantized weights for x86 CPUs (built at first use by
// loraplex/ops/gguf/block_weight.py), compiled twice from this one source: -mavx2 -mfma -mf16c (8 floats
// per ymm vector) and with -mavx512f -mavx512bw -mavx512vl (16 floats per zmm vector).
//
// Semantics: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) with float32 x [M, K] (unit inner stride) and
// w [N, K] stored as GGUF rows: K / 32 blocks of 32 values per row, each block
//   Q4_0 (18 bytes): f16 d, 16 bytes of nibbles;  w = d * (nibble - 8)
//   Q4_1 (20 bytes): f16 d, f16 m, 16 bytes;      w = d * nibble + m
//   Q8_0 (34 bytes): f16 d, 32 int8 q;            w = d * q
// where value j < 16 of a block is the low nibble of byte j and value j + 16 its high nibble. Each block
// is dequantized in registers with exactly those float32 operations (a multiply, then an add: no fused
// multiply-add), so w is bitwise gguf.quants.dequantize's; the products are then summed with fused
// multiply-adds into one accumulator vector per output (lane l takes k = l, l + W, ...), whose lanes are
// added in a fixed order. Below kPanelMinM rows of x, a result depends on its own row of x alone.
//
// From kPanelMinM rows of x on (prefill, large decode batches) dequantizing each block once per tile of
// kTileM rows costs more than the FMAs it feeds, so the weight is instead dequantized (bitwise the same)
// kPanelN rows at a time into a cache-resident float32 panel that the BLAS sgemm multiplies with all of x:
// float math on the dequantized weights, summed in sgemm's order (which may depend on M).
#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "gemm_problem.h"

#include <cstdint>
#include <cstring>
#include <vector>

// The Fortran BLAS sgemm libtorch_cpu exports (ATen's cpublas::gemm is not exported to extensions).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace {

constexpr int64_t kQK = 32;  // values per block

#ifdef __AVX512F__
constexpr int kW = 16;  // floats per vector
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vset1(float a) { return _mm512_set1_ps(a); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a); }
// 16 unsigned / signed bytes -> 16 floats
inline V u8_to_f(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
inline V i8_to_f(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
constexpr int kTileN = 4;  // output rows per tile
constexpr int kTileM = 6;  // rows of x per tile (24 accumulators): each dequantized block serves 6 rows
constexpr int kDecodeN = 8;  // output rows per tile for a single row of x
#else
constexpr int kW = 8;
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vset1(float a) { return _mm256_set1_ps(a); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a); }
inline V u8_to_f(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
inline V i8_to_f(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
constexpr int kTileN = 2;
constexpr int kTileM = 4;  // 8 accumulators + 4 weight vectors + temporaries in 16 ymm registers
constexpr int kDecodeN = 8;
#endif
constexpr int kVecs = kQK / kW;  // vectors per block
constexpr int64_t kPanelN = 64;    // weight rows per dequantized panel (64 x K floats: 144 KiB at K = 576)
constexpr int64_t kPanelMinM = 8;  // rows of x from which the panel path runs

// The float16 at p, converted in every lane (a 16-bit broadcast, then one vector conversion).
inline V vset1_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __AVX512F__
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(h)));
#else
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(h)));
#endif
}

// The 16 bytes of nibbles -> the low-nibble bytes (values 0..15) and the high-nibble bytes (16..31).
inline void nibbles(const uint8_t* qs, __m128i& lo, __m128i& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  lo = _mm_and_si128(b, mask);
  hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
}

// 32 bytes' worth of values (two 16-byte halves) -> kVecs vectors of the byte values as floats.
template <bool Signed>
inline void bytes_to_f(__m128i lo, __m128i hi, V* out) {
  auto cvt = [](__m128i b) { return Signed ? i8_to_f(b) : u8_to_f(b); };
  if constexpr (kVecs == 2) {
    out[0] = cvt(lo);
    out[1] = cvt(hi);
  } else {
    out[0] = cvt(lo);
    out[1] = cvt(_mm_srli_si128(lo, 8));
    out[2] = cvt(hi);
    out[3] = cvt(_mm_srli_si128(hi, 8));
  }
}

enum class Type { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

template <Type T>
struct Block;

#ifdef __AVX512F__
// A 4-bit block as a lookup: `table` holds its 16 possible values (computed with the operations above), and
// vpermps picks each value's by the low 4 bits of its lane: one widening of the 16 bytes, two permutes.
inline void nibble_lookup(const uint8_t* qs, V table, V* w) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  w[0] = _mm512_permutexvar_ps(b, table);                        // low nibbles: values 0..15
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);  // high nibbles: values 16..31
}
inline V iota(float first) {
  return _mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), vset1(first));
}

template <>
struct Block<Type::Q4_0> {
  static constexpr int64_t kBytes = 18;
  static inline void load(const uint8_t* p, V* w) { nibble_lookup(p + 2, vmul(vset1_f16(p), iota(-8.0f)), w); }
};

template <>
struct Block<Type::Q4_1> {
  static constexpr int64_t kBytes = 20;
  static inline void load(const uint8_t* p, V* w) {
    nibble_lookup(p + 4, vadd(vmul(vset1_f16(p), iota(0.0f)), vset1_f16(p + 2)), w);
  }
};
#else
template <>
struct Block<Type::Q4_0> {
  static constexpr int64_t kBytes = 18;
  static inline void load(const uint8_t* p, V* w) {
    __m128i lo, hi;
    nibbles(p + 2, lo, hi);
    const __m128i eight = _mm_set1_epi8(8);
    bytes_to_f<true>(_mm_sub_epi8(lo, eight), _mm_sub_epi8(hi, eight), w);
    const V d = vset1_f16(p);
    for (int v = 0; v < kVecs; ++v) w[v] = vmul(d, w[v]);
  }
};

template <>
struct Block<Type::Q4_1> {
  static constexpr int64_t kBytes = 20;
  static inline void load(const uint8_t* p, V* w) {
    __m128i lo, hi;
    nibbles(p + 4, lo, hi);
    bytes_to_f<false>(lo, hi, w);
    const V d = vset1_f16(p), m = vset1_f16(p + 2);
    for (int v = 0; v < kVecs; ++v) w[v] = vadd(vmul(d, w[v]), m);
  }
};
#endif

template <>
struct Block<Type::Q8_0> {
  static constexpr int64_t kBytes = 34;
  static inline void load(const uint8_t* p, V* w) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18));
    bytes_to_f<true>(lo, hi, w);
    const V d = vset1_f16(p);
    for (int v = 0; v < kVecs; ++v) w[v] = vmul(d, w[v]);
  }
};

// The lanes of one accumulator summed in a fixed order.
inline float lanes_sum(V a) {
  alignas(64) float buf[kW];
  vstore(buf, a);
  float s = 0.0f;
  for (int l = 0; l < kW; ++l) s += buf[l];
  return s;
}

using loraplex_gguf::Problem;

// Outputs y[r0 .. r0 + RM, n0 .. n0 + RN): RN weight rows (each block dequantized once) times RM rows of x.
template <Type T, int RN, int RM>
void tile(const Problem& p, int64_t n0, int64_t r0) {
  V acc[RN][RM];
#pragma GCC unroll 16
  for (int n = 0; n < RN; ++n)
#pragma GCC unroll 16
    for (int r = 0; r < RM; ++r) acc[n][r] = vzero();
  for (int64_t b = 0; b < p.blocks; ++b) {
#pragma GCC unroll 16
    for (int n = 0; n < RN; ++n) {
      V w[kVecs];
      Block<T>::load(p.w + (n0 + n) * p.row_bytes + b * Block<T>::kBytes, w);
#pragma GCC unroll 16
      for (int r = 0; r < RM; ++r) {
        const float* xr = p.x + (r0 + r) * p.ldx + b * kQK;
#pragma GCC unroll 4
        for (int v = 0; v < kVecs; ++v) acc[n][r] = vfma(vload(xr + v * kW), w[v], acc[n][r]);
      }
    }
  }
  for (int n = 0; n < RN; ++n) {
    const float bias = p.bias ? p.bias[n0 + n] : 0.0f;
    for (int r = 0; r < RM; ++r) p.y[(r0 + r) * p.ldy + n0 + n] = lanes_sum(acc[n][r]) + bias;
  }
}

// A tile of `rows` rows of x (1 <= rows <= RM, chosen at run time).
template <Type T, int RN, int RM>
void rows_tile(int64_t rows, const Problem& p, int64_t n0, int64_t r0) {
  if constexpr (RM > 1) {
    if (rows < RM) return rows_tile<T, RN, RM - 1>(rows, p, n0, r0);
  }
  tile<T, RN, RM>(p, n0, r0);
}

// Weight rows [n_begin, n_end) against all m rows of x.
template <Type T>
void run_rows(const Problem& p, int64_t m, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  if (m == 1) {
    for (; n + kDecodeN <= n_end; n += kDecodeN) tile<T, kDecodeN, 1>(p, n, 0);
  }
  for (; n + kTileN <= n_end; n += kTileN) {
    for (int64_t r = 0; r < m; r += kTileM) rows_tile<T, kTileN, kTileM>(std::min<int64_t>(kTileM, m - r), p, n, r);
  }
  for (; n < n_end; ++n) {
    for (int64_t r = 0; r < m; r += kTileM) rows_tile<T, 1, kTileM>(std::min<int64_t>(kTileM, m - r), p, n, r);
  }
}

// Weight rows [n0, n0 + rows) dequantized into `panel` [rows, K] (row-major).
template <Type T>
void dequantize_panel(const Problem& p, int64_t n0, int64_t rows, float* panel) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = p.w + (n0 + r) * p.row_bytes;
    float* out = panel + r * p.blocks * kQK;
    for (int64_t b = 0; b < p.blocks; ++b) {
      V w[kVecs];
      Block<T>::load(row + b * Block<T>::kBytes, w);
      for (int v = 0; v < kVecs; ++v) vstore(out + b * kQK + v * kW, w[v]);
    }
  }
}

// y[:, n0 .. n0 + rows) = x @ panel^T (+ bias) for each panel of kPanelN weight rows, one thread per panel.
template <Type T>
void run_panels(const Problem& p, int64_t m, int64_t n) {
  const int64_t k = p.blocks * kQK;
  at::parallel_for(0, (n + kPanelN - 1) / kPanelN, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> panel(kPanelN * k);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kPanelN, rows = std::min(kPanelN, n - n0);
      dequantize_panel<T>(p, n0, rows, panel.data());
      // column-major view: y^T [rows, m] (ld ldy) = panel^T^T [rows, k] @ x^T [k, m] (ld ldx)
      const int rn = static_cast<int>(rows), mm = static_cast<int>(m), kk = static_cast<int>(k);
      const int ldx = static_cast<int>(p.ldx), ldy = static_cast<int>(p.ldy);
      const float one = 1.0f, zero = 0.0f;
      sgemm_("T", "N", &rn, &mm, &kk, &one, panel.data(), &kk, p.x, &ldx, &zero, p.y + n0, &ldy);
      if (p.bias) {
        for (int64_t r = 0; r < m; ++r)
          for (int64_t j = 0; j < rows; ++j) p.y[r * p.ldy + n0 + j] += p.bias[n0 + j];
      }
    }
  });
}

template <Type T>
void run(const Problem& p, int64_t m, int64_t n) {
  if (m >= kPanelMinM) return run_panels<T>(p, m, n);
  // Threads take whole tiles of weight rows; every output is computed the same way in any split.
  at::parallel_for(0, (n + kDecodeN - 1) / kDecodeN, 1, [&](int64_t t0, int64_t t1) {
    run_rows<T>(p, m, t0 * kDecodeN, std::min<int64_t>(n, t1 * kDecodeN));
  });
}

int64_t block_bytes(int64_t type) {
  switch (static_cast<Type>(type)) {
    case Type::Q4_0: return Block<Type::Q4_0>::kBytes;
    case Type::Q4_1: return Block<Type::Q4_1>::kBytes;
    case Type::Q8_0: return Block<Type::Q8_0>::kBytes;
  }
  TORCH_CHECK(false, "block_gemm: unsupported GGML type ", type);
}

}  // namespace

// y [M, N] (a view with unit inner stride, written) = x [M, K] @ dequantize(w)^T (+ bias [N]).
void linear_into(const torch::Tensor& x, const torch::Tensor& w, int64_t type, torch::Tensor& y,
                 const c10::optional<torch::Tensor>& bias) {
  torch::Tensor bias_keep;
  const Problem p = loraplex_gguf::checked_problem("block_gemm", x, w, y, bias, kQK, block_bytes(type), bias_keep);
  const int64_t m = x.size(0), n = w.size(0);
  if (m == 0 || n == 0) return;
  switch (static_cast<Type>(type)) {
    case Type::Q4_0: return run<Type::Q4_0>(p, m, n);
    case Type::Q4_1: return run<Type::Q4_1>(p, m, n);
    case Type::Q8_0: return run<Type::Q8_0>(p, m, n);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_into", &linear_into, "y = x @ dequantize(w)^T + bias for GGUF Q4_0 / Q4_1 / Q8_0 rows");
  m.attr("panel_min_rows") = kPanelMinM;
}
