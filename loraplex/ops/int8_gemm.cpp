// Weight-only int8 matmul for x86 CPUs with AVX2 and FMA (built at first use by loraplex/ops/int8.py).
//
// Semantics: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k] (+ bias[n]), float32 x [M, K], int8 q packed by
// pack() into blocks of 16 output channels, [ceil(N / 16), K, 16] (channels past N are zero), scale [N].
// Each 16-channel block is multiplied by up to 6 rows of x at once (12 accumulators, the classic 6x16
// AVX2 register tile). With at most 6 rows its bytes are converted to float32 in registers as they
// stream in (the memory-bound case: a quarter of float32's bytes); with more, the block is converted
// once into a float scratch buffer that every row tile then reads from cache. Every output element sums over k in the same order
// whatever M is: a row's result does not depend on the other rows of the batch.
#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

namespace {

constexpr int64_t kBlock = 16;  // output channels per packed block
constexpr int64_t kRows = 6;    // rows of x per register tile

// Loads the 16 weights of step k as two float vectors: from int8 (converted here) or from floats
// already converted into a scratch buffer (when several row tiles share the block).
struct Int8Weights {
  const int8_t* w;
  inline void load(int64_t k, __m256& w0, __m256& w1) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kBlock));
    w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
  }
};

struct FloatWeights {
  const float* w;
  inline void load(int64_t k, __m256& w0, __m256& w1) const {
    w0 = _mm256_loadu_ps(w + k * kBlock);
    w1 = _mm256_loadu_ps(w + k * kBlock + 8);
  }
};

template <int R, typename W>
void tile(const float* x, int64_t ldx, const W& weights, int64_t k_len, const float* scale, const float* bias,
          float* y, int64_t ldy, int64_t cols) {
  // The r loops are unrolled so that the 2R accumulators live in registers (GCC keeps a rolled
  // array on the stack, storing every accumulator on every step).
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k) {
    __m256 w0, w1;
    weights.load(k, w0, w1);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  alignas(32) float out[kBlock];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(out, acc[r][0]);
    _mm256_store_ps(out + 8, acc[r][1]);
    for (int64_t c = 0; c < cols; ++c) {
      y[r * ldy + c] = out[c] * scale[c] + (bias ? bias[c] : 0.0f);
    }
  }
}

template <typename W>
void rows_tile(int64_t rows, const float* x, int64_t ldx, const W& w, int64_t k_len, const float* scale,
               const float* bias, float* y, int64_t ldy, int64_t cols) {
  switch (rows) {
    case 6: tile<6>(x, ldx, w, k_len, scale, bias, y, ldy, cols); break;
    case 5: tile<5>(x, ldx, w, k_len, scale, bias, y, ldy, cols); break;
    case 4: tile<4>(x, ldx, w, k_len, scale, bias, y, ldy, cols); break;
    case 3: tile<3>(x, ldx, w, k_len, scale, bias, y, ldy, cols); break;
    case 2: tile<2>(x, ldx, w, k_len, scale, bias, y, ldy, cols); break;
    default: tile<1>(x, ldx, w, k_len, scale, bias, y, ldy, cols); break;
  }
}

// One block of 16 output channels for all M rows. With more than one row tile the block is converted
// to floats once (scratch: K * 16 floats, in L1/L2) and every tile reads those.
void block_rows(int64_t m, const float* x, int64_t ldx, const int8_t* w, int64_t k_len, const float* scale,
                const float* bias, float* y, int64_t ldy, int64_t cols, std::vector<float>& scratch) {
  if (m <= kRows) {
    rows_tile(m, x, ldx, Int8Weights{w}, k_len, scale, bias, y, ldy, cols);
    return;
  }
  scratch.resize(k_len * kBlock);
  for (int64_t i = 0; i < k_len * kBlock; i += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + i));
    _mm256_storeu_ps(scratch.data() + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
  }
  const FloatWeights fw{scratch.data()};
  for (int64_t r0 = 0; r0 < m; r0 += kRows) {
    rows_tile(std::min(kRows, m - r0), x + r0 * ldx, ldx, fw, k_len, scale, bias, y + r0 * ldy, ldy, cols);
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
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock && packed.size(1) == x.size(1), "linear: packed must be [blocks, K, 16]");
  const int64_t m = x.size(0), k = x.size(1), n = scale.size(0), blocks = packed.size(0);
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == torch::kFloat && n <= blocks * kBlock, "linear: bad scale");
  const float* bias_ptr = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    bias_ptr = bias_c.data_ptr<float>();
  }
  auto y = torch::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t col0 = b * kBlock, cols = std::min(kBlock, n - col0);
      block_rows(m, xp, ldx, wp + b * k * kBlock, k, sp + col0, bias_ptr ? bias_ptr + col0 : nullptr,
                 yp + col0, n, cols, scratch);
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "pack int8 weights [N, K] into [ceil(N/16), K, 16] blocks");
  m.def("linear", &linear, "y = (x @ q^T) * scale + bias with packed int8 q");
}
