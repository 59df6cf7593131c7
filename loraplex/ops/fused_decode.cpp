// A decode step's attention from the packed q/k/v projection output in one call (built with cpu_kernels.cpp by
// loraplex/ops/cpu_kernels.py): rotary on q and k, the K/V write into the paged cache, then the attention of
// paged_attention.cpp. It replaces the slicing, the rotary kernel's output and the separate calls the layer
// made, and rounds exactly as they do (the same rotate_head, the same attention).
#include <torch/extension.h>

// fused_pointwise.cpp
void rotate_head(const float* in, const float* c, const float* s, int64_t d, float* out);
// paged_attention.cpp
void check_decode_reads(int64_t seqs, int64_t heads, int64_t d, const torch::Tensor& cache,
                        const torch::Tensor& tables, const torch::Tensor& first, const torch::Tensor& end);
void attend_decode(const float* qp, int64_t qs0, int64_t qs1, int64_t seqs, int64_t heads, const torch::Tensor& cache,
                   const torch::Tensor& tables, const torch::Tensor& first, const torch::Tensor& end, double scale,
                   float* op);

// Semantics: with [q, k, v] = qkv[s] split as H, KV and KV heads of d floats, q' = rotary(q), k' = rotary(k)
// (rotary of fused_pointwise.cpp with cos[s], signed_sin[s]): the cache row of every sequence s at position
// end[s] - 1 gets K = k', V = v (each K/V head), then out[s] = paged_decode_attention(q', cache, ...) for the
// keys [first[s], end[s]). qkv [S, (H + 2 KV) d] float32 (any row stride, unit inner stride), cos /
// signed_sin [S, 1, d] contiguous, cache [N, 2, KV, bs, d] (changed in place), tables [S, max_blocks] int64,
// first / end [S] int64 -> out [S, H * d] (the o_proj input).
torch::Tensor decode_attention_qkv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                                   const torch::Tensor& cache, const torch::Tensor& tables, const torch::Tensor& first,
                                   const torch::Tensor& end, double scale, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat && qkv.stride(1) == 1 && qkv.device().is_cpu(),
              "decode_attention_qkv: qkv must be a CPU float32 [S, (H + 2 KV) d] tensor with unit inner stride");
  TORCH_CHECK(cache.dim() == 5, "decode_attention_qkv: cache must be [N, 2, KV, bs, d]");
  const int64_t seqs = qkv.size(0), kv_heads = cache.size(2), bs = cache.size(3), d = cache.size(4);
  TORCH_CHECK(d % 2 == 0, "decode_attention_qkv: head_dim must be even");
  TORCH_CHECK(heads > 0 && qkv.size(1) == (heads + 2 * kv_heads) * d,
              "decode_attention_qkv: qkv has ", qkv.size(1), " columns, not (heads + 2 KV heads) * head_dim");
  for (const auto* t : {&cos, &signed_sin}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->numel() == seqs * d,
                "decode_attention_qkv: cos and signed_sin must be contiguous float32 [S, 1, d] tensors");
  }
  check_decode_reads(seqs, heads, d, cache, tables, first, end);
  const int64_t ldq = qkv.stride(0), max_blocks = tables.size(1);
  const float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = signed_sin.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* ep = end.data_ptr<int64_t>();
  float* base = cache.data_ptr<float>();
  auto q = torch::empty({seqs, heads, d}, qkv.options());
  float* qp = q.data_ptr<float>();
  for (int64_t s = 0; s < seqs; ++s) {  // every write before any read (a few KiB per sequence: one thread)
    const float* row = xp + s * ldq;
    const float* c = cp + s * d;
    const float* sn = sp + s * d;
    for (int64_t h = 0; h < heads; ++h) rotate_head(row + h * d, c, sn, d, qp + (s * heads + h) * d);
    const int64_t pos = ep[s] - 1, block = tp[s * max_blocks + pos / bs];
    for (int64_t h = 0; h < kv_heads; ++h) {
      float* k_row = base + ((block * 2 * kv_heads + h) * bs + pos % bs) * d;
      float* v_row = base + (((block * 2 + 1) * kv_heads + h) * bs + pos % bs) * d;
      rotate_head(row + (heads + h) * d, c, sn, d, k_row);
      std::copy_n(row + (heads + kv_heads + h) * d, d, v_row);
    }
  }
  auto out = torch::empty({seqs, heads * d}, qkv.options());
  attend_decode(qp, heads * d, d, seqs, heads, cache, tables, first, end, scale, out.data_ptr<float>());
  return out;
}
