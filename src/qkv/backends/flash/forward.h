// The forward pass: the tiled online-softmax recurrence of loop.py's module docstring, one query
// block of one head at a time, with the block's running m, l and acc kept in cache-sized buffers.
//
// For each query block (Bq rows of one query head) and each key block (Bk keys) it may see:
//
//     s      = q_block · k_blockᵀ                          (Bq, Bk) float32, one product
//     m_new  = max(m, max_j s_j · c)                        c = scale · log2(e): base-2 units
//     alpha  = 2^(m − m_new)                                rescales the old terms
//     p      = 2^(s · c − m_new)                            float32; bfloat16 for the product
//     l      = alpha · l + Σ_j p_j
//     acc    = alpha · acc + p · v_block                    (Bq, Dv) float32, one product
//
// and at the end out = acc / l, lse = (m + log2 l) · ln 2. A row with no key keeps l = 0: out 0,
// lse −inf. Key blocks no row of the block may see are skipped: causally those past its last
// diagonal, and with a window or ranges (packed sequences) those before its rows' first keys too.
// In a block a row's range crosses, the row only exponentiates the keys it may see, the rest of
// its p is 0, and the products stop at the last key any row of the block may see.
//
// The maximum costs no pass of its own after a row's first key block: each block is
// exponentiated against the m it finds, keeping the block's largest exponent, top, on the side in
// the same pass. When top is above 0 the block holds a new maximum, but m moves up to it (and
// that row of the block is exponentiated again) only where its weight 2^top would be more than
// 1/8 of the row's sum so far or more than 2^8 (lag_allowed). Elsewhere weights above 1 go into
// l and acc as they are: float32 takes them without loss, and at most 2^8 each they cannot make
// the sums overflow. So in a row whose new maximum carries much of its weight, m is the exact
// running maximum and the largest weight is exactly 1, which bfloat16 holds without rounding;
// other rows are exponentiated once per block. (Moving m up to every new maximum redid about a
// quarter of all rows at T = 4096 on random inputs, and the branch, going either way at random,
// cost more than the passes it redid.)
//
// float32 products run where kernel.py's GEMM says (products.h). bfloat16 products go through
// cpublas::brgemm on the CPU's bfloat16 matrix units (AMX) or its AVX-512 bfloat16 dot
// products, with float32 sums, and need each key block in pairs-of-rows ("VNNI") order
// (layout.h). Where the CPU has neither, bfloat16 inputs are widened to float32 by the caller and
// take the float32 path (kernel.py's bfloat16_products()). Scores, softmax and accumulation are
// float32 in every case; the weights that are rounded to bfloat16 for the product come from a
// cheaper 2^x (within 7.5e-5 relative).

#pragma once

#include "layout.h"
#include "products.h"
#include "row_math.h"
#include "rules.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// Rows q0 … q0 + rows − 1 of query head `head`.
struct QueryBlock {
  int64_t head, q0, rows;
};

// The keys each query block may see (KeyBounds::span), block i of head h at
// of[h · query_blocks + i], and how many keys the blocks read in all.
struct BlockSpans {
  std::vector<std::pair<int64_t, int64_t>> of;
  int64_t reads;
};

inline BlockSpans block_spans(const KeyBounds& bounds, int64_t heads, int64_t Lq) {
  const int64_t query_blocks = (Lq + kQueryBlock - 1) / kQueryBlock;
  BlockSpans spans{std::vector<std::pair<int64_t, int64_t>>(heads * query_blocks), 0};
  for (int64_t head = 0; head < heads; ++head)
    for (int64_t i = 0; i < query_blocks; ++i) {
      const int64_t last = std::min(Lq, (i + 1) * kQueryBlock) - 1;
      const auto [begin, end] = spans.of[head * query_blocks + i] =
          bounds.span(head, i * kQueryBlock, last);
      spans.reads += std::max<int64_t>(0, end - begin);
    }
  return spans;
}

// What one thread works its query blocks in: a block's scores s and weights p (Bq, Bk), each
// row's running maximum m, sum l and output acc (Bq, Dv), and the key and value buffers of the
// key blocks it packs (Arranged::per_block).
template <typename T>
struct ForwardScratch {
  using P = std::conditional_t<std::is_same_v<T, at::BFloat16>, T, float>;  // the weights' type
  Scratch<float> scores, acc;
  std::vector<float> m, l;
  Scratch<P> weights;
  Scratch<T> key_buffer, value_buffer;

  ForwardScratch(const Arranged<T>& keys, int64_t Dv)
      : scores(kQueryBlock * kScoreStride), acc(kQueryBlock * Dv), m(kQueryBlock), l(kQueryBlock),
        weights(kQueryBlock * kWeightStride), key_buffer(keys.key_buffer_size()),
        value_buffer(keys.value_buffer_size()) {}
};

// One call's forward pass, a query block at a time (run). Its functions are the parts of one
// loop, split to be read: always inlined, so that the compiler optimises the loop whole. (Left to
// itself, GCC kept exp_row out of update_row, whose small stack frame inlining it would have
// grown tenfold, and the bfloat16 forward pass, calling it per row and key block, slowed down.)
template <typename T>
struct ForwardPass {
  static constexpr bool kLow = std::is_same_v<T, at::BFloat16>;
  using P = typename ForwardScratch<T>::P;
  const T* q;  // (NG, Lq, De): bfloat16 products need an even feature count De
  int64_t Lq, D, De, Dv, g;
  const CallRules& call;
  float c;  // call.exponent_scale()
  Products path;
  const Arranged<T>& keys;
  float* out;  // (NG, Lq, Dv)
  float* lse;  // (NG, Lq)

  // One query block's rows over the keys [span.first, span.second) they may see, block after
  // block of keys; its out and lse written at the end.
  [[gnu::always_inline]]
  void run(const QueryBlock& block, std::pair<int64_t, int64_t> span,
           ForwardScratch<T>& scratch) const {
    std::fill(scratch.acc.begin(), scratch.acc.end(), 0.f);
    std::fill(scratch.m.begin(), scratch.m.end(), kNegInf);
    std::fill(scratch.l.begin(), scratch.l.end(), 0.f);
    const auto [keys_begin, keys_end] = span;
    const int64_t align = keys.alignment();
    // Key blocks in order; with ALiBi (or a score_mod's program: a bias) from the last: its bias
    // makes the keys nearest a row score highest, and a row whose maximum comes first is
    // exponentiated once per block.
    const int64_t keys_start = keys_begin / align * align;
    const int64_t key_steps =
        (std::max(keys_end, keys_start) - keys_start + kKeyBlock - 1) / kKeyBlock;
    for (int64_t step = 0; step < key_steps; ++step) {
      const bool backwards = call.scores.slopes != nullptr ||
                             (call.program != nullptr && call.program->score.present());
      const int64_t k0 = keys_start + (backwards ? key_steps - 1 - step : step) * kKeyBlock;
      const int64_t kn = std::min(kKeyBlock, keys_end - k0);
      if (call.program != nullptr && call.program->skips(block.q0, k0, kn)) continue;
      const BlockOperands<T> operands = keys.block(block.head / g, k0, kn,
                                                   scratch.key_buffer.data(),
                                                   scratch.value_buffer.data());
      multiply_keys(block, operands, kn, scratch.scores.data());
      for (int64_t r = 0; r < block.rows; ++r) weigh_row(block, r, k0, kn, scratch);
      multiply_values(block.rows, operands, kn, scratch);
    }
    finish(block, scratch);
  }

  // s = q_block · kᵀ (rows, kn), rows kScoreStride apart.
  [[gnu::always_inline]]
  void multiply_keys(const QueryBlock& block, const BlockOperands<T>& operands, int64_t kn,
                     float* s) const {
    const T* q_block = q + (block.head * Lq + block.q0) * De;
    if constexpr (kLow) {  // bfloat16 products, float32 sums, whole 32-key groups
      const int64_t kn32 = std::min(kKeyBlock, (kn + 31) / 32 * 32);
      at::native::cpublas::brgemm(block.rows, kn32, De, De, kKeyBlock, kScoreStride, false,
                                  q_block, operands.keys, s, true);
    } else {  // on the tiles, kᵀ's panels k0 / kPanel …
      multiply(path, {.M = block.rows, .N = kn, .K = D, .a = q_block, .lda = D, .step = 1,
                      .b = operands.keys, .ldb = operands.ldk, .panel_stride = D * kPanel,
                      .c = s, .ldc = kScoreStride, .add = false});
    }
  }

  // acc += p · v_block (rows, Dv).
  [[gnu::always_inline]]
  void multiply_values(int64_t rows, const BlockOperands<T>& operands, int64_t kn,
                       ForwardScratch<T>& scratch) const {
    if constexpr (kLow) {
      at::native::cpublas::brgemm(rows, Dv, (kn + 1) / 2 * 2, kWeightStride, Dv, Dv, true,
                                  scratch.weights.data(), operands.values, scratch.acc.data(),
                                  true);
    } else {  // v as it lies
      multiply(path, {.M = rows, .N = Dv, .K = kn, .a = scratch.weights.data(),
                      .lda = kWeightStride, .step = 1, .b = operands.values, .ldb = Dv,
                      .panel_stride = kPanel, .c = scratch.acc.data(), .ldc = Dv, .add = true});
    }
  }

  // Row r of the block against keys k0 … k0 + kn − 1: its weights p (0 for the keys it may not
  // see), and its m, l and acc moved on by the recurrence.
  [[gnu::always_inline]]
  void weigh_row(const QueryBlock& block, int64_t r, int64_t k0, int64_t kn,
                 ForwardScratch<T>& scratch) const {
    // Keys first … first + seen − 1 of this block row r may see; the rest of its p is 0.
    const auto [lo, hi] = call.keys.row(block.head, block.q0 + r);
    const int64_t first = std::clamp<int64_t>(lo - k0, 0, kn);
    const int64_t seen = std::max(first, std::clamp<int64_t>(hi - k0, 0, kn)) - first;
    const int64_t width = kLow ? (kn + 1) / 2 * 2 : kn;
    P* p_row = scratch.weights.data() + r * kWeightStride;
    std::fill(p_row, p_row + first, P(0.f));
    std::fill(p_row + first + seen, p_row + width, P(0.f));
    float* s = scratch.scores.data() + r * kScoreStride + first;  // the keys it may see
    if (call.program != nullptr) {  // its scores, and only their part not all −inf
      call.program->apply(s, seen, block.head, block.q0 + r, k0 + first);
      const auto [a, b] = ModProgram::visible(s, seen);
      std::fill(p_row + first, p_row + first + a, P(0.f));
      std::fill(p_row + first + b, p_row + first + seen, P(0.f));
      if (a < b) update_row(s + a, p_row + first + a, b - a, scratch.m[r], scratch.l[r],
                            scratch.acc.data() + r * Dv);
      return;
    }
    if (call.scores.any()) {
      modify_row(s, seen, call.row(block.head, block.q0 + r, k0 + first));
    }
    update_row(s, p_row + first, seen, scratch.m[r], scratch.l[r], scratch.acc.data() + r * Dv);
  }

  // The recurrence's step for one row of n scores s: p = 2^(s · c − m), m, l and acc (Dv).
  [[gnu::always_inline]]
  void update_row(const float* s, P* p, int64_t n, float& m, float& l, float* acc) const {
    if (m == kNegInf) {  // the row's first keys: their maximum becomes m
      const float m_new = row_max(s, n, c);
      if (m_new == kNegInf) {  // no key seen yet: nothing to add, unless a score is NaN
        if (any_nan(s, n)) l = std::numeric_limits<float>::quiet_NaN();  // out and lse: NaN
        std::fill(p, p + n, P(0.f));
        return;
      }
      m = m_new;
      l = exp_row<P>(s, p, n, c, m_new).sum;
      return;
    }
    Exponentials row = exp_row<P>(s, p, n, c, m);
    if (row.top > lag_allowed(l + row.sum)) {  // m moves up, and the row is redone
      const float alpha = exp2_scalar(-row.top);  // 2^(m_old − m_new)
      m += row.top;
      row = exp_row<P>(s, p, n, c, m);
      l *= alpha;
#pragma omp simd
      for (int64_t e = 0; e < Dv; ++e) acc[e] *= alpha;
    }
    l += row.sum;
  }

  // out = acc / l and lse of the block's rows. l = 0 only for a row with no key: out 0 (not
  // 0/0), lse −inf. NaN stays NaN.
  [[gnu::always_inline]]
  void finish(const QueryBlock& block, const ForwardScratch<T>& scratch) const {
    for (int64_t r = 0; r < block.rows; ++r) {
      const int64_t row = block.head * Lq + block.q0 + r;
      const float l = scratch.l[r], inv = l == 0.f ? 0.f : 1.f / l;
      const float* acc = scratch.acc.data() + r * Dv;
      float* o = out + row * Dv;
      for (int64_t e = 0; e < Dv; ++e) o[e] = acc[e] * inv;
      lse[row] = row_lse(scratch.m[r], l);
    }
  }
};

// q (NG, Lq, D), k (N, S, D), v (N, S, Dv), contiguous, all float32 or all bfloat16; query head
// i uses key/value head i / (NG / N) (grouped-query heads, K/V never repeated). Returns out
// (NG, Lq, Dv) and lse (NG, Lq), float32.
template <typename T>
std::vector<at::Tensor> forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const CallRules& call, Products path) {
  constexpr bool low = std::is_same_v<T, at::BFloat16>;
  const int64_t NG = q.size(0), Lq = q.size(1), D = q.size(2);
  const int64_t N = k.size(0), S = k.size(1), Dv = v.size(2);
  const int64_t De = low ? (D + 1) / 2 * 2 : D;  // q's row length as the products read it
  const int64_t query_blocks = (Lq + kQueryBlock - 1) / kQueryBlock;
  auto out = at::empty({NG, Lq, Dv}, q.options().dtype(at::kFloat));
  auto lse = at::empty({NG, Lq}, q.options().dtype(at::kFloat));
  at::Tensor q_even = q;  // bfloat16 products need an even feature count
  if (low && De != D) q_even = at::constant_pad_nd(q, {0, 1});

  // Key blocks outside a query block's span are skipped; keys read by at most kPackPerBlock query
  // blocks each, on average, are packed as they are read.
  BlockSpans spans = block_spans(call.keys, NG, Lq);
  if (call.program != nullptr) {  // narrowed to the mask_mod's non-empty state blocks
    spans.reads = 0;
    for (int64_t z = 0; z < static_cast<int64_t>(spans.of.size()); ++z) {
      auto& [begin, end] = spans.of[z];
      call.program->trim((z % query_blocks) * kQueryBlock, begin, end);
      spans.reads += std::max<int64_t>(0, end - begin);
    }
  }
  const bool per_block = spans.reads <= kPackPerBlock * N * S;
  const Arranged<T> keys = arrange<T>(k, v, path == Products::kTiles, per_block);
  const ForwardPass<T> pass{q_even.const_data_ptr<T>(), Lq, D, De, Dv, NG / N, call,
                            call.exponent_scale(), path, keys, out.data_ptr<float>(),
                            lse.data_ptr<float>()};

  // Blocks are handed out one at a time, so a core that runs slower (another process on it)
  // takes fewer; causal blocks go longest first, so none is left alone at the end.
  const int64_t blocks = NG * query_blocks;
  std::atomic<int64_t> next_block{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    ForwardScratch<T> scratch(keys, Dv);
    for (int64_t z; (z = next_block.fetch_add(1)) < blocks;) {
      const int64_t head = z / query_blocks, i = z % query_blocks;
      const int64_t index = call.keys.causal ? query_blocks - 1 - i : i;
      const int64_t q0 = index * kQueryBlock;
      pass.run({head, q0, std::min(kQueryBlock, Lq - q0)}, spans.of[head * query_blocks + index],
               scratch);
    }
    if constexpr (low) at::native::cpublas::brgemm_release(true);
  });
  return {out, lse};
}

}  // namespace
