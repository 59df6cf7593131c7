// Batched LoRA shrink + expand over a step's slot groups (built by loraplex/ops/lora_sgmv.py). Semantics, for
// each slot group g (slot s = group_slots[g], packed rank R = slot_ranks[s] > 0, rows i in order[group_offsets[g] :
// group_offsets[g + 1]]) and each B block (o_lo, o_hi, r_lo, r_hi) of slot_blocks[s] with r_hi > r_lo:
//   t[i, r] = c_i * (x[i] . A[s, r, :])                           r in [0, R)  (c_i = entry_scales[i], or 1 when empty)
//   y[i, o_lo:o_hi] += sum_{r in [r_lo, r_hi)} t[i, r] * B[s, o_lo:o_hi, r]
// Rows in no group are never read or written; slots in no group are never read. Each block's delta is
// summed in registers and added to y once (y + delta, as the torch ops do).
// x [T, in], y [T, out] float32 with unit inner strides (any row strides; y changed in place), A [L, R_max, in]
// with unit inner stride, B [L, out, R_max] with unit stride over out (loraplex keeps B rank-major), A and B both
// float32 or both bfloat16 (widened to float32 as read, sums in float32), order [T_lora] / group_slots [G] /
// group_offsets [G + 1] int64, slot_ranks [L] int32, slot_blocks [L, P, 4] int32 (blocks with r_hi == r_lo skipped),
// entry_scales [T_lora] float32 aligned with order, or empty.
// Each adapter's A and B are read from memory once per group of rows (up to 4 rows in registers; a larger group
// reads them again, from cache, per 4 rows): the shrink walks A's rank rows a few at a time, the expand walks a
// block's columns a tile at a time across its rank rows, and a Prefetcher keeps 16 KiB of what comes next (this
// group's and the next groups' A and B) on its way. No row of x or y is copied. The groups are split across
// ATen's threads (no row may be in two groups); each group's rows are summed in the same order whatever the rest
// of the batch and the thread count, so results are batch-independent.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "lora_sgmv_simd.h"

namespace {

using namespace lora_simd;

constexpr int kMaxRows = 4;  // rows of a group computed together in registers
constexpr int64_t kL = kLanes;  // floats per vector
constexpr int kWide = kLanes / 8;  // register tiles of 2+ rows this many times wider (AVX-512: 32 registers)

// A matrix region the kernel reads: ``rows`` rows of ``cols`` weights, ``stride`` weights apart, read row by row
// (``by_rows``: A, a few rank rows at a time) or a 64-byte column of lines at a time across its rows (B, by tile).
template <typename W>
struct Region {
  const W* base;
  int64_t stride, rows, cols;
  bool by_rows;
};

// Prefetches the regions of a call (every group's A, then its B blocks, in the order the kernel reads them)
// a fixed distance ahead of the reading. ``advance(n)`` is called as the kernel reads n weights (W); each call
// issues at most a few 64-byte lines more than were read, so the core's miss queue is never flooded (a burst
// of prefetches is mostly dropped).
template <typename W>
class Prefetcher {
 public:
  explicit Prefetcher(std::vector<Region<W>> regions) : regions_(std::move(regions)) {}

  void advance(int64_t n) {
    consumed_ += n;
    int64_t budget = n + kLine;
    while (region_ < regions_.size() && (issued_ < consumed_ || (issued_ < consumed_ + kLead && budget > 0))) {
      const Region<W>& g = regions_[region_];
      const int64_t width = std::min<int64_t>(kLine, g.cols - col_);
      if (issued_ >= consumed_) {
        _mm_prefetch(reinterpret_cast<const char*>(g.base + row_ * g.stride + col_), _MM_HINT_T0);
        budget -= kLine;
      }
      issued_ += width;
      if (g.by_rows ? (col_ += kLine) >= g.cols : ++row_ == g.rows) {  // the row (column of lines) is done
        if (g.by_rows) { col_ = 0; ++row_; } else { row_ = 0; col_ += kLine; }
        if (row_ == g.rows || col_ >= g.cols) {
          row_ = col_ = 0;
          ++region_;
        }
      }
    }
  }

 private:
  // weights read ahead (16 KiB; 8-64 KiB measured alike, none at all ~1.4x slower: a block's rank rows are too
  // many streams, and an adapter's A and B too short a run, for the hardware prefetcher)
  static constexpr int64_t kLine = 64 / sizeof(W), kLead = 16384 / sizeof(W);
  std::vector<Region<W>> regions_;
  size_t region_ = 0;
  int64_t row_ = 0, col_ = 0, issued_ = 0, consumed_ = 0;
};

// t[i * ts + k] = x_i . a[k * as] for NR rows and NK rank rows of A, over n floats
template <int NR, int NK, typename W>
inline void shrink_tile(const float* const* x, const W* a, int64_t as, int64_t n, float* t, int64_t ts,
                        Prefetcher<W>* pf) {
  Vec acc[NR][NK];
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 8
    for (int k = 0; k < NK; ++k) acc[i][k] = vzero();
  int64_t j = 0;
  for (; j + kL <= n; j += kL) {
    if (pf != nullptr && (j & 15) == 0) pf->advance(16 * NK);
    Vec xv[NR];
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) xv[i] = vload(x[i] + j);
#pragma GCC unroll 8
    for (int k = 0; k < NK; ++k) {
      const Vec av = vload(a + k * as + j);
#pragma GCC unroll 8
      for (int i = 0; i < NR; ++i) acc[i][k] = vfmadd(xv[i], av, acc[i][k]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 8
    for (int k = 0; k < NK; ++k) {
      float sum = vsum(acc[i][k]);
      for (int64_t jj = j; jj < n; ++jj) sum += x[i][jj] * widen(a[k * as + jj]);
      t[i * ts + k] = sum;
    }
}

// t[i * R + r] = x_i . A_s[r] for NR rows, every r < R
template <int NR, typename W>
void shrink_rows(const float* const* x, const W* a, int64_t as, int64_t in, int64_t rank, float* t,
                 Prefetcher<W>* pf) {
  constexpr int NK = NR == 1 ? 8 : (NR == 2 ? 4 : NR == 3 ? 3 : 2) * kWide;
  int64_t r = 0;
  for (; r + NK <= rank; r += NK) shrink_tile<NR, NK>(x, a + r * as, as, in, t + r, rank, pf);
  for (; r < rank; ++r) shrink_tile<NR, 1>(x, a + r * as, as, in, t + r, rank, pf);
}

// y_i[c : c + kLanes NV] += sum_{r < nr} t[i * ts + r] * b[r * bs + c : ...] for NR rows
template <int NR, int NV, typename W>
inline void expand_tile(float* const* y, int64_t c, const float* t, int64_t ts, const W* b, int64_t bs,
                        int64_t nr, Prefetcher<W>* pf) {
  Vec acc[NR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[i][v] = vzero();
  for (int64_t r = 0; r < nr; ++r) {
    const W* br = b + r * bs + c;
    if (pf != nullptr) pf->advance(kL * NV);
    Vec tv[NR];
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) tv[i] = vbroadcast(t + i * ts + r);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const Vec bv = vload(br + kL * v);
#pragma GCC unroll 8
      for (int i = 0; i < NR; ++i) acc[i][v] = vfmadd(tv[i], bv, acc[i][v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      float* yp = y[i] + c + kL * v;
      vstore(yp, vadd(vload(yp), acc[i][v]));
    }
}

// one block: y_i[lo:hi] += t_i[0:nr] @ B^T[0:nr, lo:hi] for NR rows (t and b start at the block's first rank)
template <int NR, typename W>
void expand_rows(float* const* y, const float* t, int64_t ts, const W* b, int64_t bs, int64_t nr, int64_t lo,
                 int64_t hi, Prefetcher<W>* pf) {
  constexpr int NV = NR == 1 ? 8 : (NR == 2 ? 4 : NR == 3 ? 3 : 2) * kWide;
  int64_t c = lo;
  for (; c + kL * NV <= hi; c += kL * NV) expand_tile<NR, NV>(y, c, t, ts, b, bs, nr, pf);
  for (; c + kL <= hi; c += kL) expand_tile<NR, 1>(y, c, t, ts, b, bs, nr, pf);
  for (; c < hi; ++c)
    for (int i = 0; i < NR; ++i) {
      float sum = 0.0f;
      for (int64_t r = 0; r < nr; ++r) sum += t[i * ts + r] * widen(b[r * bs + c]);
      y[i][c] += sum;
    }
}

template <typename W>
struct Slot {
  const W* a = nullptr;  // A_s [R, in], row stride as
  const W* bt = nullptr;  // B_s^T [R, out] (B rank-major), row stride bs
  int64_t rank = 0;
  const int32_t* blocks = nullptr;  // [P, 4]
};

// NR rows of one group; ``pf`` (null when another chunk of the group's rows read its weights) is told what is read
// ``sc`` (null: every scale 1) holds the NR rows' entry scales, applied to their shrunk vectors
template <int NR, typename W>
void group_rows(float* const* y, const float* const* x, const Slot<W>& s, int64_t as, int64_t bs, int64_t in,
                int64_t num_blocks, float* t, Prefetcher<W>* pf, const float* sc) {
  shrink_rows<NR>(x, s.a, as, in, s.rank, t, pf);
  if (sc != nullptr)
    for (int i = 0; i < NR; ++i)
      for (int64_t r = 0; r < s.rank; ++r) t[i * s.rank + r] *= sc[i];
  for (int64_t p = 0; p < num_blocks; ++p) {
    const int32_t* blk = s.blocks + 4 * p;
    if (blk[3] > blk[2])
      expand_rows<NR>(y, t + blk[2], s.rank, s.bt + blk[2] * bs, bs, blk[3] - blk[2], blk[0], blk[1], pf);
  }
}

// the call with weights of type W (float, or uint16_t for bfloat16)
template <typename W>
void sgmv_as(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& lora_a, const torch::Tensor& lora_b,
             const torch::Tensor& order, const torch::Tensor& group_slots, const torch::Tensor& group_offsets,
             const torch::Tensor& slot_ranks, const torch::Tensor& slot_blocks, const torch::Tensor& entry_scales) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 && y.stride(1) == 1,
              "sgmv: x [T, in] and y [T, out] with unit inner strides");
  TORCH_CHECK(lora_a.dim() == 3 && lora_b.dim() == 3 && lora_a.size(2) == x.size(1) && lora_b.size(1) == y.size(1) &&
              lora_a.stride(2) == 1 && lora_b.stride(1) == 1 && lora_a.size(1) == lora_b.size(2),
              "sgmv: A [L, R_max, in] with unit inner stride, B [L, out, R_max] with unit stride over out");
  TORCH_CHECK(order.scalar_type() == at::kLong && group_slots.scalar_type() == at::kLong &&
              group_offsets.scalar_type() == at::kLong && slot_ranks.scalar_type() == at::kInt &&
              slot_blocks.scalar_type() == at::kInt && order.is_contiguous() && group_slots.is_contiguous() &&
              group_offsets.is_contiguous() && slot_ranks.is_contiguous() && slot_blocks.is_contiguous() &&
              slot_blocks.dim() == 3 && slot_blocks.size(2) == 4, "sgmv: index tensors of the documented types");
  const int64_t num_groups = group_slots.size(0), in = x.size(1), out = y.size(1), rows = x.size(0);
  const int64_t r_max = lora_a.size(1), num_slots = lora_a.size(0), num_blocks = slot_blocks.size(1);
  TORCH_CHECK(group_offsets.size(0) == num_groups + 1 && slot_ranks.size(0) == num_slots &&
              slot_blocks.size(0) == num_slots, "sgmv: group and slot tables of mismatched sizes");
  const int64_t* ord = order.data_ptr<int64_t>();
  const int64_t* gs = group_slots.data_ptr<int64_t>();
  const int64_t* go = group_offsets.data_ptr<int64_t>();
  const int32_t* ranks = slot_ranks.data_ptr<int32_t>();
  const int32_t* blocks = slot_blocks.data_ptr<int32_t>();
  TORCH_CHECK(go[0] >= 0 && go[num_groups] <= order.size(0), "sgmv: group offsets past the order");
  TORCH_CHECK(entry_scales.numel() == 0 || (entry_scales.scalar_type() == at::kFloat && entry_scales.is_contiguous() &&
                                            entry_scales.numel() == order.size(0)),
              "sgmv: entry scales empty, or float32 [T_lora] in the order's order");
  const float* esc = entry_scales.numel() == 0 ? nullptr : entry_scales.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t as = lora_a.stride(1), bs = lora_b.stride(2), xs = x.stride(0), ys = y.stride(0);
  std::vector<char> seen(rows, 0);  // groups are run in parallel: no row may be in two of them
  for (int64_t i = go[0]; i < go[num_groups]; ++i)
    TORCH_CHECK(ord[i] >= 0 && ord[i] < rows && !seen[ord[i]]++, "sgmv: row ", ord[i], " out of range or repeated");
  std::vector<Slot<W>> slots(num_groups);
  std::vector<Region<W>> regions;
  std::vector<size_t> first_region(num_groups + 1, 0);  // group g reads regions [first_region[g], ...[g + 1])
  for (int64_t g = 0; g < num_groups; ++g) {
    first_region[g + 1] = regions.size();
    const int64_t s = gs[g];
    TORCH_CHECK(s >= 0 && s < num_slots, "sgmv: group slot ", s, " out of range");
    const int64_t rank = ranks[s];
    if (rank == 0) continue;
    TORCH_CHECK(rank > 0 && rank <= r_max, "sgmv: slot ", s, " has rank ", rank, " outside [0, ", r_max, "]");
    const int32_t* sb = blocks + s * num_blocks * 4;
    for (int64_t p = 0; p < num_blocks; ++p) {
      const int32_t* blk = sb + 4 * p;
      TORCH_CHECK(blk[3] == blk[2] || (0 <= blk[0] && blk[0] <= blk[1] && blk[1] <= out && 0 <= blk[2] &&
                                       blk[2] <= blk[3] && blk[3] <= rank), "sgmv: slot ", s, " block ", p,
                  " outside the layer or the slot's rank");
    }
    const Slot<W> slot{static_cast<const W*>(lora_a.data_ptr()) + s * lora_a.stride(0),
                       static_cast<const W*>(lora_b.data_ptr()) + s * lora_b.stride(0), rank, sb};
    slots[g] = slot;
    if (go[g + 1] == go[g]) continue;
    regions.push_back(as == in ? Region<W>{slot.a, 0, 1, rank * in, true} : Region<W>{slot.a, as, rank, in, true});
    for (int64_t p = 0; p < num_blocks; ++p) {
      const int32_t* blk = sb + 4 * p;
      if (blk[3] > blk[2])
        regions.push_back({slot.bt + blk[2] * bs + blk[0], bs, blk[3] - blk[2], blk[1] - blk[0], false});
    }
    first_region[g + 1] = regions.size();
  }
  // groups split evenly across the threads, each with its own prefetcher over its groups' regions
  at::parallel_for(0, num_groups, 1, [&](int64_t g_begin, int64_t g_end) {
    Prefetcher<W> prefetcher({regions.begin() + first_region[g_begin], regions.begin() + first_region[g_end]});
    std::vector<float> t(kMaxRows * std::max<int64_t>(r_max, 1));
    for (int64_t g = g_begin; g < g_end; ++g) {
      const Slot<W>& slot = slots[g];
      if (slot.rank == 0) continue;
      for (int64_t lo = go[g]; lo < go[g + 1]; lo += kMaxRows) {
        Prefetcher<W>* pf = lo == go[g] ? &prefetcher : nullptr;
        const int n = static_cast<int>(std::min<int64_t>(kMaxRows, go[g + 1] - lo));
        const float* xr[kMaxRows];
        float* yr[kMaxRows];
        for (int i = 0; i < n; ++i) xr[i] = xp + ord[lo + i] * xs, yr[i] = yp + ord[lo + i] * ys;
        const float* sc = esc == nullptr ? nullptr : esc + lo;
        switch (n) {
          case 1: group_rows<1>(yr, xr, slot, as, bs, in, num_blocks, t.data(), pf, sc); break;
          case 2: group_rows<2>(yr, xr, slot, as, bs, in, num_blocks, t.data(), pf, sc); break;
          case 3: group_rows<3>(yr, xr, slot, as, bs, in, num_blocks, t.data(), pf, sc); break;
          default: group_rows<4>(yr, xr, slot, as, bs, in, num_blocks, t.data(), pf, sc); break;
        }
      }
    }
  });
}

}  // namespace

void sgmv(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& lora_a, const torch::Tensor& lora_b,
          const torch::Tensor& order, const torch::Tensor& group_slots, const torch::Tensor& group_offsets,
          const torch::Tensor& slot_ranks, const torch::Tensor& slot_blocks, const torch::Tensor& entry_scales) {
  const auto w = lora_a.scalar_type();
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && lora_b.scalar_type() == w &&
              (w == at::kFloat || w == at::kBFloat16), "sgmv: float32 x and y, A and B both float32 or bfloat16");
  (w == at::kFloat ? sgmv_as<float> : sgmv_as<uint16_t>)(y, x, lora_a, lora_b, order, group_slots, group_offsets,
                                                         slot_ranks, slot_blocks, entry_scales);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sgmv", &sgmv, "y[rows of each slot group] += c_row (x[rows] @ A_s^T) @ B_s^T, block by block, in place "
        "(A, B float32 or bfloat16)");
}
