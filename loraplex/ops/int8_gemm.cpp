// Weight-only int8 matmul for x86 CPUs (built at first use by loraplex/ops/int8.py), compiled twice from
// this one source: with -mavx2 -mfma (16 channels = two ymm vectors) and with -mavx512f -mavx512bw
// -mavx512vl (16 channels = one zmm vector, twice the registers, so larger tiles).
//
// Semantics: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k] (+ bias[n]), float32 x [M, K], int8 q packed by
// pack() into blocks of 16 output channels, [ceil(N / 16), K, 16] (channels past N are zero), scale [N].
// Every output element is one fused multiply-add chain over k = 0, 1, ..., K-1 starting from zero, then
// one fused multiply-add with scale and bias, in both builds and for every tile shape: the result is
// bitwise the same whatever M is (a row does not depend on its batch) and whichever build runs.
//
// Tiles: R rows of x times C blocks of 16 channels (R*C accumulators). Few rows (decode): the bytes are
// converted to float in registers as they stream in (a quarter of float32's bytes), with several blocks
// at once so that the C independent FMA chains hide the FMA latency. Many rows: each group of C blocks is
// converted once into a float scratch buffer (L1/L2) that every row tile reads.
#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;  // output channels per packed block

#ifdef __AVX512F__
// 16 floats in one zmm register.
struct Vec {
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec from_int8(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  static Vec from_float(const float* p) { return {_mm512_loadu_ps(p)}; }
  void fma(float x, const Vec& w) { v = _mm512_fmadd_ps(_mm512_set1_ps(x), w.v, v); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};
constexpr int kSmallRows = 4;  // up to this many rows: int8 converted in registers
constexpr int kSmallCols = 8;  // blocks per tile with a single row (8 independent FMA chains)
constexpr int kRows = 12;      // rows per tile from the float scratch
constexpr int kCols = 2;       // blocks per tile from the float scratch (24 accumulators)
#else
// 16 floats in two ymm registers.
struct Vec {
  __m256 lo, hi;
  static Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Vec from_int8(const int8_t* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
  }
  static Vec from_float(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  void fma(float x, const Vec& w) {
    const __m256 xv = _mm256_set1_ps(x);
    lo = _mm256_fmadd_ps(xv, w.lo, lo);
    hi = _mm256_fmadd_ps(xv, w.hi, hi);
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
};
constexpr int kSmallRows = 2;
constexpr int kSmallCols = 4;
constexpr int kRows = 6;  // the classic 6x16 AVX2 tile: 12 accumulators
constexpr int kCols = 1;
#endif

// The weights of C consecutive blocks at step k: int8 (converted here) or floats from the scratch.
struct Int8Weights {
  const int8_t* w;
  int64_t block_stride;  // elements between blocks
  inline Vec load(int64_t k, int c) const { return Vec::from_int8(w + c * block_stride + k * kBlock); }
};

struct FloatWeights {
  const float* w;
  int64_t block_stride;
  inline Vec load(int64_t k, int c) const { return Vec::from_float(w + c * block_stride + k * kBlock); }
};

// Where one tile writes: y rows of stride ldy from column col0, n columns in all.
struct Out {
  float* y;
  int64_t ldy, col0, n;
  const float* scale;
  const float* bias;
};

template <int R, int C, typename W>
void tile(const float* x, int64_t ldx, const W& weights, int64_t k_len, const Out& out) {
  // The loops over r and c are unrolled so that the R*C accumulators live in registers.
  Vec acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = Vec::zero();
  for (int64_t k = 0; k < k_len; ++k) {
    // Weights first, then row by row: one broadcast of x live at a time (C + R*C + 1 registers).
    Vec w[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) w[c] = weights.load(k, c);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[r][c].fma(xv, w[c]);
    }
  }
  alignas(64) float buf[kBlock];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      acc[r][c].store(buf);
      const int64_t col = out.col0 + c * kBlock, cols = std::min(kBlock, out.n - col);
      float* y = out.y + r * out.ldy + col;
      for (int64_t j = 0; j < cols; ++j) {
        y[j] = std::fma(buf[j], out.scale[col + j], out.bias ? out.bias[col + j] : 0.0f);
      }
    }
  }
}

// A tile of `rows` rows (1 <= rows <= R, chosen at run time) times C blocks.
template <int C, int R, typename W>
void rows_tile(int64_t rows, const float* x, int64_t ldx, const W& w, int64_t k_len, const Out& out) {
  if constexpr (R > 1) {
    if (rows < R) return rows_tile<C, R - 1>(rows, x, ldx, w, k_len, out);
  }
  tile<R, C>(x, ldx, w, k_len, out);
}

// Few rows: all m rows against `blocks` blocks, int8 converted in registers; tiles of kSmallCols blocks
// for one row (kSmallCols / 2 for more rows), then halving down to single blocks for the rest.
void small_m(int64_t m, const float* x, int64_t ldx, const int8_t* w, int64_t k_len, int64_t blocks,
             const Out& out) {
  const int64_t stride = k_len * kBlock;
  int64_t b = 0;
  auto run = [&](auto c_const) {
    constexpr int C = decltype(c_const)::value;
    for (; b + C <= blocks; b += C) {
      const Out o{out.y, out.ldy, out.col0 + b * kBlock, out.n, out.scale, out.bias};
      rows_tile<C, kSmallRows>(m, x, ldx, Int8Weights{w + b * stride, stride}, k_len, o);
    }
  };
  if (m == 1) run(std::integral_constant<int, kSmallCols>{});
  run(std::integral_constant<int, kSmallCols / 2>{});
  if constexpr (kSmallCols / 4 > 1) run(std::integral_constant<int, kSmallCols / 4>{});
  run(std::integral_constant<int, 1>{});
}

// Many rows: each group of kCols blocks converted to floats once, then row tiles of kRows.
void large_m(int64_t m, const float* x, int64_t ldx, const int8_t* w, int64_t k_len, int64_t blocks,
             const Out& out, std::vector<float>& scratch) {
  const int64_t stride = k_len * kBlock;
  scratch.resize(kCols * stride);
  // m rows in as few tiles as kRows allows, evenly (32 rows: 11 + 11 + 10, not 12 + 12 + 8).
  const int64_t tiles = (m + kRows - 1) / kRows, rows_per_tile = (m + tiles - 1) / tiles;
  for (int64_t b = 0; b < blocks; b += kCols) {
    const int64_t group = std::min<int64_t>(kCols, blocks - b);
    for (int64_t i = 0; i < group * stride; i += kBlock) {
      Vec::from_int8(w + b * stride + i).store(scratch.data() + i);
    }
    const FloatWeights fw{scratch.data(), stride};
    for (int64_t r0 = 0; r0 < m; r0 += rows_per_tile) {
      const int64_t rows = std::min<int64_t>(rows_per_tile, m - r0);
      const Out o{out.y + r0 * out.ldy, out.ldy, out.col0 + b * kBlock, out.n, out.scale, out.bias};
      if (group == kCols) {
        rows_tile<kCols, kRows>(rows, x + r0 * ldx, ldx, fw, k_len, o);
      } else {
        rows_tile<1, kRows>(rows, x + r0 * ldx, ldx, fw, k_len, o);
      }
    }
  }
}

}  // namespace

// q [N, K] int8 -> [ceil(N / 16), K, 16] int8, zero past N.
torch::Tensor pack(const torch::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8, "pack: q must be a 2-D int8 tensor");
  const int64_t n = q.size(0), k = q.size(1), blocks = (n + kBlock - 1) / kBlock;
  auto padded = torch::zeros({blocks * kBlock, k}, q.options());
  padded.narrow(0, 0, n).copy_(q);
  return padded.view({blocks, kBlock, k}).transpose(1, 2).contiguous();
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                     const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1, "linear: x must be [M, K] float32 with unit inner stride");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock && packed.size(1) == x.size(1) && packed.is_contiguous(),
              "linear: packed must be contiguous [blocks, K, 16]");
  const int64_t m = x.size(0), k = x.size(1), n = scale.size(0), blocks = packed.size(0);
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == torch::kFloat && n <= blocks * kBlock && n > (blocks - 1) * kBlock,
              "linear: scale must be float32 [N] with ceil(N / 16) == blocks");
  const float* bias_ptr = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == torch::kFloat && bias_c.numel() == n, "linear: bias must be float32 [N]");
    bias_ptr = bias_c.data_ptr<float>();
  }
  auto y = torch::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const Out out{y.data_ptr<float>(), n, 0, n, scale.data_ptr<float>(), bias_ptr};
  const int64_t ldx = x.stride(0);
  // Threads split the blocks evenly (36 blocks: 18 + 18; whole groups of 8 gave 24 + 12), each range
  // then tiled as above; the tiling does not change any result.
  at::parallel_for(0, blocks, kSmallCols, [&](int64_t b0, int64_t b1) {
    const int8_t* w = wp + b0 * k * kBlock;
    const Out o{out.y, out.ldy, b0 * kBlock, out.n, out.scale, out.bias};
    if (m <= kSmallRows) {
      small_m(m, xp, ldx, w, k, b1 - b0, o);
    } else {
      std::vector<float> scratch;
      large_m(m, xp, ldx, w, k, b1 - b0, o, scratch);
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "pack int8 weights [N, K] into [ceil(N/16), K, 16] blocks");
  m.def("linear", &linear, "y = (x @ q^T) * scale + bias with packed int8 q");
}
