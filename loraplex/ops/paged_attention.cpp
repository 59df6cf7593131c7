// Decode attention that reads the paged KV cache in place (built with cpu_kernels.cpp by loraplex/ops/cpu_kernels.py).
//
// Semantics, for each sequence s and K/V head k with query heads g = k*G .. k*G+G-1 (G = H / KV), over the
// keys at positions p in [first[s], end[s]), found at block tables[s, p / bs], offset p % bs:
//   scores[g, p] = scale * q[s, g] . K[p],   out[s, g] = softmax_p(scores[g]) @ V[p]
// When k_new / v_new [S, KV, d] are given, every sequence's row at position end[s] - 1 is first set to them
// (K[end - 1] = k_new[s], V[end - 1] = v_new[s], each head): a decode step's KV write, done before any read.
// q [S, H, d] float32 (any row strides, unit inner stride), cache [N, 2, KV, bs, d] float32 contiguous
// (changed in place when k_new / v_new are given), tables [S, max_blocks] int64, first/end [S] int64
// -> out [S, H, d].
//
// Nothing is gathered: each (sequence, K/V head) walks its blocks, where the head's K (then V) rows of a
// block are one contiguous bs * d run. Random 4 KiB runs defeat the hardware prefetcher, so each task lists
// the runs it reads in order (an item's K blocks, its V blocks, the next item's K blocks...) and, a few
// lines at a time while the current run is computed, prefetches the next run into L1 and the run
// kAheadRuns after the current one into L2 (measured: ~1.5x the throughput of prefetching each block in
// one burst, most of which the core's miss queue drops; the L2 prefetches 4 runs ahead: ~10 % faster than
// the next run alone, at batch 32, context 100, one thread). Scores take P keys x
// the G heads in registers (each K row is loaded once for all G heads); values accumulate 16 floats of d
// at a time for all G heads. Every (sequence, head) is summed in the same order whatever the rest of the
// batch: results are batch-independent.
#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int kMaxHeads = 4;  // query heads computed together (more are done in chunks of 4)
constexpr int64_t kAheadRuns = 4;  // runs prefetched ahead of the one being read

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// the sums of four vectors' lanes at once: [sum(a), sum(b), sum(c), sum(d)]
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// Prefetches two runs of floats in steps, as the work on the current run advances: the next run into L1
// and the run kAheadRuns after the current one into L2 (null: nothing to prefetch).
struct Prefetch {
  const float* near = nullptr;
  const float* far = nullptr;
  int64_t floats = 0, done = 0;
  // prefetch the runs' first ``fraction`` (in [0, 1] as num / den) not yet prefetched
  void upto(int64_t num, int64_t den) {
    for (const int64_t stop = floats * num / den; done < stop; done += 16) {
      if (far != nullptr) _mm_prefetch(reinterpret_cast<const char*>(far + done), _MM_HINT_T1);
      if (near != nullptr) _mm_prefetch(reinterpret_cast<const char*>(near + done), _MM_HINT_T0);
    }
  }
};

// scores[g * n + j] = scale * q[g] . k[j] for NG heads (rows of q, stride qs) and P keys (rows of k, stride d)
template <int NG, int P>
inline void score_tile(const float* q, int64_t qs, const float* k, int64_t d, float scale, float* scores, int64_t n) {
  __m256 acc[P][NG];
#pragma GCC unroll 4
  for (int j = 0; j < P; ++j)
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) acc[j][g] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    __m256 qv[NG];
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) qv[g] = _mm256_loadu_ps(q + g * qs + i);
#pragma GCC unroll 4
    for (int j = 0; j < P; ++j) {
      const __m256 kv = _mm256_loadu_ps(k + j * d + i);
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) acc[j][g] = _mm256_fmadd_ps(qv[g], kv, acc[j][g]);
    }
  }
  constexpr int kSums = P * NG;
  const __m256* flat = &acc[0][0];  // fully unrolled: constant indices, the accumulators stay in registers
  float sums[kSums];
#pragma GCC unroll 4
  for (int t = 0; t + 4 <= kSums; t += 4) _mm_storeu_ps(sums + t, hsum4(flat[t], flat[t + 1], flat[t + 2], flat[t + 3]));
#pragma GCC unroll 4
  for (int t = kSums / 4 * 4; t < kSums; ++t) sums[t] = hsum(flat[t]);
#pragma GCC unroll 4
  for (int j = 0; j < P; ++j)
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) {
      float s = sums[j * NG + g];
      for (int64_t t = i; t < d; ++t) s += q[g * qs + t] * k[j * d + t];
      scores[g * n + j] = s * scale;
    }
}

// scores for m consecutive keys of one block, P at a time (P keys x NG heads fit the 16 vector registers)
template <int NG>
inline void score_rows(const float* q, int64_t qs, const float* k, int64_t m, int64_t d, float scale, float* scores,
                       int64_t n, Prefetch next) {
  constexpr int P = NG <= 2 ? 4 : (NG == 3 ? 3 : 2);
  int64_t j = 0;
  for (; j + P <= m; j += P) {
    next.upto(j + P, m);
    score_tile<NG, P>(q, qs, k + j * d, d, scale, scores + j, n);
  }
  for (; j < m; ++j) score_tile<NG, 1>(q, qs, k + j * d, d, scale, scores + j, n);
  next.upto(1, 1);
}

// acc[g * d + i] += sum_j w[g * n + j] * v[j * d + i] over m consecutive value rows, NG heads
template <int NG>
inline void value_rows(const float* w, int64_t n, const float* v, int64_t m, int64_t d, float* acc, Prefetch next) {
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    next.upto(i + 16, d);
    __m256 a[NG][2];
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) {
      a[g][0] = _mm256_loadu_ps(acc + g * d + i);
      a[g][1] = _mm256_loadu_ps(acc + g * d + i + 8);
    }
    for (int64_t j = 0; j < m; ++j) {
      const __m256 v0 = _mm256_loadu_ps(v + j * d + i), v1 = _mm256_loadu_ps(v + j * d + i + 8);
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) {
        const __m256 wg = _mm256_broadcast_ss(w + g * n + j);
        a[g][0] = _mm256_fmadd_ps(wg, v0, a[g][0]);
        a[g][1] = _mm256_fmadd_ps(wg, v1, a[g][1]);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) {
      _mm256_storeu_ps(acc + g * d + i, a[g][0]);
      _mm256_storeu_ps(acc + g * d + i + 8, a[g][1]);
    }
  }
  next.upto(1, 1);
  for (; i < d; ++i)
    for (int64_t j = 0; j < m; ++j)
      for (int g = 0; g < NG; ++g) acc[g * d + i] += w[g * n + j] * v[j * d + i];
}

struct Cache {
  const float* data;
  const int64_t* table;  // this sequence's block table
  int64_t kv_heads, block_size, d;
  // the first of the block_size rows of K (kv = 0) or V (kv = 1) of head h in logical block b
  const float* rows(int64_t b, int kv, int64_t h) const {
    return data + ((table[b] * 2 + kv) * kv_heads + h) * block_size * d;
  }
};

// NG query heads of one sequence against K/V head h, keys [lo, hi): out rows at stride os. ``ahead[j]`` is the
// j-th run this call reads (its K blocks, then its V blocks), followed by the runs read after it (null: none).
template <int NG>
void attend(const float* q, int64_t qs, const Cache& c, int64_t h, int64_t lo, int64_t hi, float scale,
            float* scores, float* acc, float* out, int64_t os, const float* const* ahead) {
  const int64_t n = hi - lo, bs = c.block_size, d = c.d, run = bs * d;
  int64_t j = 0;
  for (int64_t p = lo; p < hi;) {
    const int64_t b = p / bs, stop = std::min(hi, (b + 1) * bs);
    score_rows<NG>(q, qs, c.rows(b, 0, h) + (p % bs) * d, stop - p, d, scale, scores + (p - lo), n,
                   Prefetch{ahead[j + 1], ahead[j + kAheadRuns], run});
    ++j;
    p = stop;
  }
  float inv_sum[NG];
  for (int g = 0; g < NG; ++g) {
    float* row = scores + g * n;
    const float top = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, row, n);
    at::vec::map([top](Vec x) { return (x - Vec(top)).exp(); }, row, row, n);
    inv_sum[g] = 1.0f / at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, row, n);
  }
  std::fill(acc, acc + NG * d, 0.0f);
  for (int64_t p = lo; p < hi;) {
    const int64_t b = p / bs, stop = std::min(hi, (b + 1) * bs);
    value_rows<NG>(scores + (p - lo), n, c.rows(b, 1, h) + (p % bs) * d, stop - p, d, acc,
                   Prefetch{ahead[j + 1], ahead[j + kAheadRuns], run});
    ++j;
    p = stop;
  }
  for (int g = 0; g < NG; ++g)
    for (int64_t i = 0; i < d; ++i) out[g * os + i] = acc[g * d + i] * inv_sum[g];
}

using AttendFn = void (*)(const float*, int64_t, const Cache&, int64_t, int64_t, int64_t, float, float*, float*,
                          float*, int64_t, const float* const*);
constexpr AttendFn kAttend[kMaxHeads + 1] = {nullptr, attend<1>, attend<2>, attend<3>, attend<4>};

}  // namespace

// Checks q's and the cache's shapes and every block the attention of ``seqs`` sequences will read (before any
// read): shared by both entry points (this one and decode_attention_qkv in fused_decode.cpp).
void check_decode_reads(int64_t seqs, int64_t heads, int64_t d, const torch::Tensor& cache,
                        const torch::Tensor& tables, const torch::Tensor& first, const torch::Tensor& end) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(1) == 2 && cache.scalar_type() == torch::kFloat && cache.is_contiguous(),
              "paged_decode_attention: cache must be a contiguous float32 [N, 2, KV, bs, d] tensor");
  const int64_t num_blocks = cache.size(0), kv_heads = cache.size(2), bs = cache.size(3);
  TORCH_CHECK(cache.size(4) == d && heads % kv_heads == 0, "paged_decode_attention: q and cache shapes disagree");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == seqs && tables.scalar_type() == torch::kLong &&
                  tables.is_contiguous(), "paged_decode_attention: tables must be contiguous int64 [S, max_blocks]");
  TORCH_CHECK(first.numel() == seqs && end.numel() == seqs && first.scalar_type() == torch::kLong &&
                  end.scalar_type() == torch::kLong && first.is_contiguous() && end.is_contiguous(),
              "paged_decode_attention: first and end must be contiguous int64 [S]");
  const int64_t max_blocks = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* fp = first.data_ptr<int64_t>();
  const int64_t* ep = end.data_ptr<int64_t>();
  for (int64_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(0 <= fp[s] && fp[s] < ep[s] && ep[s] <= max_blocks * bs,
                "paged_decode_attention: sequence ", s, " reads keys [", fp[s], ", ", ep[s], ") outside its table");
    for (int64_t b = fp[s] / bs; b <= (ep[s] - 1) / bs; ++b) {
      TORCH_CHECK(0 <= tp[s * max_blocks + b] && tp[s * max_blocks + b] < num_blocks,
                  "paged_decode_attention: block id out of range");
    }
  }
}

// The attention of checked inputs: q rows at strides (qs0, qs1) -> out [seqs, heads, d] contiguous at op.
void attend_decode(const float* qp, int64_t qs0, int64_t qs1, int64_t seqs, int64_t heads, const torch::Tensor& cache,
                   const torch::Tensor& tables, const torch::Tensor& first, const torch::Tensor& end, double scale,
                   float* op) {
  const int64_t kv_heads = cache.size(2), bs = cache.size(3), d = cache.size(4);
  const int64_t group = heads / kv_heads, max_blocks = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* fp = first.data_ptr<int64_t>();
  const int64_t* ep = end.data_ptr<int64_t>();
  const float* cp = cache.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t stop) {
    std::vector<const float*> order;  // every run this task reads, in order, then kAheadRuns nulls
    for (int64_t item = begin; item < stop; ++item) {
      const int64_t s = item / kv_heads, h = item % kv_heads;
      const Cache c{cp, tp + s * max_blocks, kv_heads, bs, d};
      for (int64_t g0 = 0; g0 < group; g0 += kMaxHeads)
        for (int kv = 0; kv < 2; ++kv)
          for (int64_t b = fp[s] / bs; b <= (ep[s] - 1) / bs; ++b) order.push_back(c.rows(b, kv, h));
    }
    order.insert(order.end(), kAheadRuns, nullptr);
    Prefetch{order[0], nullptr, bs * d}.upto(1, 1);
    for (int64_t r = 1; r < kAheadRuns; ++r) Prefetch{nullptr, order[r], bs * d}.upto(1, 1);
    std::vector<float> scores, acc(kMaxHeads * d);
    size_t r = 0;
    for (int64_t item = begin; item < stop; ++item) {
      const int64_t s = item / kv_heads, h = item % kv_heads;
      const Cache c{cp, tp + s * max_blocks, kv_heads, bs, d};
      const int64_t runs = 2 * ((ep[s] - 1) / bs - fp[s] / bs + 1);
      scores.resize(kMaxHeads * (ep[s] - fp[s]));
      for (int64_t g0 = 0; g0 < group; g0 += kMaxHeads) {
        const int64_t ng = std::min<int64_t>(kMaxHeads, group - g0);
        kAttend[ng](qp + s * qs0 + (h * group + g0) * qs1, qs1, c, h, fp[s], ep[s], sc, scores.data(), acc.data(),
                    op + (s * heads + h * group + g0) * d, d, order.data() + r);
        r += runs;
      }
    }
  });
}

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& tables,
                                     const torch::Tensor& first, const torch::Tensor& end, double scale,
                                     const c10::optional<torch::Tensor>& k_new,
                                     const c10::optional<torch::Tensor>& v_new) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.stride(2) == 1 && q.device().is_cpu(),
              "paged_decode_attention: q must be a CPU float32 [S, H, d] tensor with unit inner stride");
  const int64_t seqs = q.size(0), heads = q.size(1), d = q.size(2);
  check_decode_reads(seqs, heads, d, cache, tables, first, end);
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), "paged_decode_attention: give both k_new and v_new or neither");
  if (k_new.has_value()) {  // the step's KV write, before any read: all rows, then the parallel attention
    const int64_t kv_heads = cache.size(2), bs = cache.size(3), max_blocks = tables.size(1);
    const int64_t* tp = tables.data_ptr<int64_t>();
    const int64_t* ep = end.data_ptr<int64_t>();
    float* base = cache.data_ptr<float>();
    for (int kv = 0; kv < 2; ++kv) {
      const torch::Tensor& src = kv == 0 ? *k_new : *v_new;
      TORCH_CHECK(src.dim() == 3 && src.size(0) == seqs && src.size(1) == kv_heads && src.size(2) == d &&
                      src.scalar_type() == torch::kFloat && src.stride(2) == 1,
                  "paged_decode_attention: k_new and v_new must be float32 [S, KV, d] with unit inner stride");
      const float* sp = src.data_ptr<float>();
      for (int64_t s = 0; s < seqs; ++s) {
        const int64_t pos = ep[s] - 1, block = tp[s * max_blocks + pos / bs];
        for (int64_t h = 0; h < kv_heads; ++h) {
          std::copy_n(sp + s * src.stride(0) + h * src.stride(1), d,
                      base + (((block * 2 + kv) * kv_heads + h) * bs + pos % bs) * d);
        }
      }
    }
  }
  auto out = torch::empty({seqs, heads, d}, q.options());
  attend_decode(q.data_ptr<float>(), q.stride(0), q.stride(1), seqs, heads, cache, tables, first, end, scale,
                out.data_ptr<float>());
  return out;
}
