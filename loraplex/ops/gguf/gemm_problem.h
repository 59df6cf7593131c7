// One weight-only product on GGUF-quantized rows, as block_gemm.cpp and kquant_gemm.cpp take it: their
// linear_into's arguments checked once, in one place, and turned into a Problem.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace loraplex_gguf {

// y [M, N] (+)= x [M, K] @ dequantize(w)^T (+ bias [N]); w holds N rows of `blocks` blocks each.
struct Problem {
  const float* x;
  int64_t ldx;
  const uint8_t* w;
  int64_t row_bytes, blocks;  // per weight row
  float* y;
  int64_t ldy;
  const float* bias;
};

// Checks x [M, K] float32 with unit inner stride, w contiguous uint8 [N, K / block_values * block_bytes],
// y [M, N] float32 with unit inner stride and bias float32 [N] (made contiguous into `bias_keep`, which must
// outlive the Problem); `who` names the kernel in the errors.
inline Problem checked_problem(const char* who, const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& y,
                               const c10::optional<torch::Tensor>& bias, int64_t block_values, int64_t block_bytes,
                               torch::Tensor& bias_keep) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1,
              who, ": x must be [M, K] float32 with unit inner stride");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(k % block_values == 0, who, ": K must be a multiple of ", block_values);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() &&
                  w.size(1) == k / block_values * block_bytes,
              who, ": w must be contiguous uint8 [N, K / ", block_values, " * ", block_bytes, " bytes]");
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == torch::kFloat && y.size(0) == m && y.size(1) == n && y.stride(1) == 1,
              who, ": y must be [M, N] float32 with unit inner stride");
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_keep = bias->contiguous();
    TORCH_CHECK(bias_keep.scalar_type() == torch::kFloat && bias_keep.numel() == n, who, ": bias must be float32 [N]");
    bias_ptr = bias_keep.data_ptr<float>();
  }
  return Problem{x.data_ptr<float>(), x.stride(0), w.data_ptr<uint8_t>(), w.size(1), k / block_values,
                 y.data_ptr<float>(), y.stride(0), bias_ptr};
}

}  // namespace loraplex_gguf
