// Row-wise kernels of a decoder block, each one pass over its input (built with cpu_kernels.cpp by
// loraplex/ops/cpu_kernels.py). They compute what the torch code in loraplex/layers computes, in the same
// order of float32 operations except for the sum inside RMSNorm (eight lanes, then across them); the
// extension is compiled with -ffp-contract=off so that no multiply-add is fused behind our back.
// Inputs are float32 [rows, n] with any row stride and a unit inner stride; outputs are new contiguous tensors.
#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>

namespace {

using Vec = at::vec::Vectorized<float>;

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// rows per parallel task: small steps (a decode batch) stay on the calling thread
inline int64_t grain(int64_t n) { return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(n, 1)); }

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1 && x.device().is_cpu(),
              name, ": x must be a CPU float32 [rows, n] tensor with unit inner stride");
}

}  // namespace

namespace {

// out = rms_norm(row) as the Semantics of rms_norm below state (one row of n floats)
void norm_row(const float* row, const float* wp, int64_t n, float eps, float offset, float* out) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(row + i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  float sum = hsum(acc);
  for (; i < n; ++i) sum += row[i] * row[i];
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  if (offset != 0.0f) {
    for (i = 0; i < n; ++i) out[i] = (row[i] * r) * (offset + wp[i]);
  } else {
    for (i = 0; i < n; ++i) out[i] = wp[i] * (row[i] * r);
  }
}

void check_weight(const torch::Tensor& weight, int64_t n, const char* name) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == torch::kFloat &&
                  weight.is_contiguous(), name, ": weight must be a contiguous float32 [n] tensor");
}

}  // namespace

// Semantics: y[t] = (x[t] * r[t]) * (offset + weight) with r[t] = 1 / sqrt(sum_i x[t, i]^2 / n + eps);
// offset 0 multiplies by weight alone (Llama's order: weight * normed). x [T, n], weight [n] -> y [T, n].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, double offset) {
  check_rows(x, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1), ldx = x.stride(0);
  check_weight(weight, n, "rms_norm");
  auto y = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(xp + t * ldx, wp, n, eps, offset, yp + t * n);
  });
  return y;
}

// Semantics: x[t] = residual[t] + x[t] (in place: x becomes the new residual stream), then
// y[t] = rms_norm(x[t]) exactly as rms_norm computes it: the residual add and the next norm in one pass
// (vLLM's fused_add_rms_norm). x, residual [T, n] (unit inner stride; x writable), weight [n] -> y [T, n].
torch::Tensor add_rms_norm(torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight, double eps,
                           double offset) {
  check_rows(x, "add_rms_norm");
  check_rows(residual, "add_rms_norm");
  const int64_t rows = x.size(0), n = x.size(1), ldx = x.stride(0), ldr = residual.stride(0);
  TORCH_CHECK(residual.size(0) == rows && residual.size(1) == n, "add_rms_norm: x and residual shapes differ");
  check_weight(weight, n, "add_rms_norm");
  auto y = torch::empty({rows, n}, x.options());
  float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = xp + t * ldx;
      const float* res = rp + t * ldr;
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(row + i, _mm256_add_ps(_mm256_loadu_ps(res + i), _mm256_loadu_ps(row + i)));
      for (; i < n; ++i) row[i] = res[i] + row[i];
      norm_row(row, wp, n, eps, offset, yp + t * n);
    }
  });
  return y;
}

// Semantics: y[t] = silu(x[t, :I]) * x[t, I:] with silu(g) = g / (1 + exp(-g)). x [T, 2I] -> y [T, I].
torch::Tensor silu_mul(const torch::Tensor& x) {
  check_rows(x, "silu_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_mul: x must have an even number of columns");
  const int64_t rows = x.size(0), half = x.size(1) / 2, ldx = x.stride(0);
  auto y = torch::empty({rows, half}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, grain(half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = xp + t * ldx;
      const float* up = gate + half;
      float* out = yp + t * half;
      int64_t i = 0;
      for (; i + Vec::size() <= half; i += Vec::size()) {
        const Vec g = Vec::loadu(gate + i);
        ((g / (Vec(1.0f) + g.neg().exp())) * Vec::loadu(up + i)).store(out + i);
      }
      for (; i < half; ++i) out[i] = (gate[i] / (1.0f + std::exp(-gate[i]))) * up[i];
    }
  });
  return y;
}

// One head of the rotary below (shared with decode_attention_qkv in fused_decode.cpp, so both round alike).
void rotate_head(const float* in, const float* c, const float* s, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = in[i] * c[i] + in[i + half] * s[i];
  for (int64_t i = half; i < d; ++i) out[i] = in[i] * c[i] + in[i - half] * s[i];
}

// Semantics: y[t, h] = x[t, h] * cos[t] + cat(x2, x1)[t, h] * signed_sin[t] with x1, x2 the halves of x[t, h]
// (HF's rotate_half convention, signed_sin = cat(-sin, sin)). x [T, heads, d] (any strides but a unit inner
// one), cos / signed_sin [T, 1, d] contiguous -> y [T, heads, d].
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat && x.stride(2) == 1 && x.device().is_cpu(),
              "rotary: x must be a CPU float32 [T, heads, d] tensor with unit inner stride");
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 2 == 0, "rotary: head_dim must be even");
  for (const auto* t : {&cos, &signed_sin}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->numel() == rows * d,
                "rotary: cos and signed_sin must be contiguous float32 [T, 1, d] tensors");
  }
  auto y = torch::empty({rows, heads, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = signed_sin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, rows, grain(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * d;
      const float* s = sp + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        rotate_head(xp + t * s0 + h * s1, c, s, d, yp + (t * heads + h) * d);
      }
    }
  });
  return y;
}
