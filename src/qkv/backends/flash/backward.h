// The backward pass of the forward pass (forward.h), float32 (the caller widens other dtypes), for
// the keys given: with P = exp(s · scale − lse) recomputed per tile from the saved lse (the final
// one, over all keys), dP = dO · Vᵀ, delta = Σ_e dO · O (per row) and dS = P ∘ (dP − delta):
//
//     dV += Pᵀ · dO        dK += scale · dSᵀ · Q        dQ += scale · dS · K
//
// Deterministic, without atomics: each task owns one key/value head (and its query heads) and
// a contiguous share of its query blocks, and sums into its own dK and dV, in a fixed order;
// where there are fewer heads than threads, a head's query blocks are split into parts whose
// dK and dV are added up in order at the end. Rows with lse = −inf (no key) get P = 0.
// With the forward's rules: each row only its keys [lo, hi) (key blocks no row of a query block
// may see are skipped), and soft-capped or ALiBi scores recomputed as the forward pass made them
// (rule_gradients), with ALiBi's slopes' gradient; with a score_mod / mask_mod program, the
// scores it made and its derivative (ModProgram::gradients), over the keys of its non-empty
// block states only (ModProgram::trim, as the forward pass). The products run where the
// forward pass's do: on oneDNN's brgemm (kernel.py's "brgemm"), which sums dKᵀ = qᵀ · dS and
// dVᵀ = dOᵀ · P so that no operand is transposed per block (a tenth less time than the tiles
// at T = 2048 on an AVX-512 CPU), or on the kernel's own tiles.

#pragma once

#include "layout.h"
#include "products.h"
#include "row_math.h"
#include "rules.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace {

// One query block of one task: rows q0 … q0 + rows − 1 of query head `head`, summing into its
// task's dk (S, D) and dv (S, Dv) of the head's key/value head.
struct GradientBlock {
  int64_t head, q0, rows;
  float* dk;
  float* dv;
};

// What one thread works its tasks in: a block's weights P and score gradients dS (Bq, Bk), its
// dQ (Bq, D), its rows' lse in base 2 and delta, and the task's head's kᵀ and vᵀ (packed per
// task: a head at a time, not all heads): in panels for the tiles, (D, S) rows for brgemm,
// which also reads the block's qᵀ (D, Bq) and dOᵀ (Dv, Bq) and sums the task's dKᵀ (D, S) and
// dVᵀ (Dv, S) here (rows ldt apart), to be transposed into dK and dV at the task's end.
struct BackwardScratch {
  Scratch<float> weights, grads, dq_block, rows_lse2, rows_delta, key_panels, value_panels, q_t,
      dout_t, dk_t, dv_t;

  BackwardScratch(int64_t S, int64_t D, int64_t Dv, Products path)
      : weights(kQueryBlock * kScoreStride), grads(kQueryBlock * kScoreStride),
        dq_block(kQueryBlock * D), rows_lse2(kQueryBlock), rows_delta(kQueryBlock),
        key_panels(path == Products::kBrgemm ? D * transposed_ld(S)
                                             : (S + kPanel - 1) / kPanel * kPanel * D),
        value_panels(path == Products::kBrgemm ? Dv * transposed_ld(S)
                                               : (S + kPanel - 1) / kPanel * kPanel * Dv),
        q_t(path == Products::kBrgemm ? D * kQueryBlock : 0),
        dout_t(path == Products::kBrgemm ? Dv * kQueryBlock : 0),
        dk_t(path == Products::kBrgemm ? D * transposed_ld(S) : 0),
        dv_t(path == Products::kBrgemm ? Dv * transposed_ld(S) : 0) {}
};

// One call's backward pass, a task (a part of one key/value head's query blocks) at a time. Its
// functions are the parts of one loop, split to be read: always inlined (ForwardPass says why).
struct BackwardPass {
  const float *q, *k, *v, *out, *dout;  // (NG, Lq, D), (N, S, D), (N, S, Dv), 2 × (NG, Lq, Dv)
  const float *lse, *dlse;  // (NG, Lq); dlse: the gradient of lse (nullptr: none)
  int64_t NG, Lq, D, N, S, Dv, parts;
  const CallRules& call;
  Products path;        // the tiles, or brgemm (which sums dKᵀ and dVᵀ: no transposed operand)
  int64_t ldt;          // brgemm: the row length of kᵀ, vᵀ, dKᵀ and dVᵀ (transposed_ld(S))
  float* dq;            // (NG, Lq, D)
  float* dk_parts;      // (parts, N, S, D)
  float* dv_parts;      // (parts, N, S, Dv)
  float* dslope_parts;  // (parts, NG) where the call has ALiBi slopes

  // Task `task`: part task % parts of key/value head task / parts, a contiguous share of its
  // query blocks for each of its query heads, summing into that part's dK and dV.
  [[gnu::always_inline]]
  void run(int64_t task, BackwardScratch& scratch) const {
    const int64_t kv = task / parts, part = task % parts, g = NG / N;
    const int64_t query_blocks = (Lq + kQueryBlock - 1) / kQueryBlock;
    if (path == Products::kBrgemm) {
      transpose_rows(k + kv * S * D, S, D, scratch.key_panels.data(), ldt);
      transpose_rows(v + kv * S * Dv, S, Dv, scratch.value_panels.data(), ldt);
    } else {
      pack_transposed(k + kv * S * D, S, D, scratch.key_panels.data());
      pack_transposed(v + kv * S * Dv, S, Dv, scratch.value_panels.data());
    }
    const int64_t first = query_blocks * part / parts, last = query_blocks * (part + 1) / parts;
    float* dk_part = dk_parts + (part * N + kv) * S * D;
    float* dv_part = dv_parts + (part * N + kv) * S * Dv;
    // The sums: dK and dV in place (tiles), or dKᵀ and dVᵀ in the thread's scratch (brgemm).
    const bool transposed = path == Products::kBrgemm;
    float* dk_head = transposed ? scratch.dk_t.data() : dk_part;
    float* dv_head = transposed ? scratch.dv_t.data() : dv_part;
    std::fill(dk_head, dk_head + (transposed ? ldt : S) * D, 0.f);
    std::fill(dv_head, dv_head + (transposed ? ldt : S) * Dv, 0.f);
    for (int64_t head = kv * g; head < (kv + 1) * g; ++head) {
      double distance_sum = 0.0;  // −dL/d slope of this head over this task's rows
      for (int64_t i = first; i < last; ++i) {
        const int64_t q0 = i * kQueryBlock;
        const GradientBlock block{head, q0, std::min(kQueryBlock, Lq - q0), dk_head, dv_head};
        query_block(block, k + kv * S * D, distance_sum, scratch);
      }
      if (call.scores.slopes != nullptr) {
        dslope_parts[part * NG + head] = static_cast<float>(-distance_sum);
      }
    }
    if (transposed) {
      transpose_rows(dk_head, D, S, dk_part, D, ldt);
      transpose_rows(dv_head, Dv, S, dv_part, Dv, ldt);
    }
    for (int64_t e = 0; e < S * D; ++e) dk_part[e] *= call.scale;
  }

  // The rows of a query block: their lse in base 2 (+inf where there is no key, so that
  // 2^(s · c − lse) = 0) and delta = Σ_e dO · O (less the gradient of lse where it has one:
  // d lse / d s = p, so dS = P ∘ (dP − delta + dlse)).
  [[gnu::always_inline]]
  void row_terms(const GradientBlock& block, BackwardScratch& scratch) const {
    for (int64_t r = 0; r < block.rows; ++r) {
      const int64_t row = block.head * Lq + block.q0 + r;
      const float *o = out + row * Dv, *d = dout + row * Dv;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t e = 0; e < Dv; ++e) sum += d[e] * o[e];
      scratch.rows_delta[r] = dlse == nullptr ? sum : sum - dlse[row];
      scratch.rows_lse2[r] = lse[row] == kNegInf ? -kNegInf : lse[row] * kLog2E;
    }
  }

  // One query block's gradients over the keys its rows may see (keys: its head's (S, D)): dQ
  // written, dK and dV added to, the slope's gradient (negated) to distance_sum.
  [[gnu::always_inline]]
  void query_block(const GradientBlock& block, const float* keys, double& distance_sum,
                   BackwardScratch& scratch) const {
    const int64_t rows = block.rows;
    // Keys this block's rows may see (key blocks outside are skipped), from a whole panel on the
    // tiles.
    auto [keys_begin, keys_end] = call.keys.span(block.head, block.q0, block.q0 + rows - 1);
    if (call.program != nullptr) call.program->trim(block.q0, keys_begin, keys_end);
    std::fill(scratch.dq_block.begin(), scratch.dq_block.end(), 0.f);
    row_terms(block, scratch);
    if (path == Products::kBrgemm) {
      transpose_rows(q + (block.head * Lq + block.q0) * D, rows, D, scratch.q_t.data(), rows);
      transpose_rows(dout + (block.head * Lq + block.q0) * Dv, rows, Dv, scratch.dout_t.data(),
                     rows);
    }
    const int64_t align = path == Products::kBrgemm ? 1 : kPanel;
    for (int64_t k0 = keys_begin / align * align; k0 < keys_end; k0 += kKeyBlock) {
      const int64_t kn = std::min(kKeyBlock, keys_end - k0);
      if (call.program != nullptr && call.program->skips(block.q0, k0, kn)) continue;
      key_block(block, keys, k0, kn, distance_sum, scratch);
    }
    float* dq_rows = dq + (block.head * Lq + block.q0) * D;
    for (int64_t e = 0; e < rows * D; ++e) dq_rows[e] = scratch.dq_block[e] * call.scale;
  }

  // query_block's work on keys k0 … k0 + kn − 1: s = q · kᵀ and dP = dO · vᵀ, each row's
  // weights P and score gradients dS (row_gradients), then the three sums. On brgemm none of
  // the products reads an operand transposed per block: it sums dVᵀ += dOᵀ · P and
  // dKᵀ += qᵀ · dS (block.dv and block.dk hold dVᵀ (Dv, S) and dKᵀ (D, S)) on qᵀ and dOᵀ
  // transposed once per query block; the tiles read Pᵀ and dSᵀ in place (lda 1).
  [[gnu::always_inline]]
  void key_block(const GradientBlock& block, const float* keys, int64_t k0, int64_t kn,
                 double& distance_sum, BackwardScratch& scratch) const {
    using at::native::cpublas::brgemm;
    const int64_t rows = block.rows;
    const float* q_block = q + (block.head * Lq + block.q0) * D;
    const float* dout_block = dout + (block.head * Lq + block.q0) * Dv;
    const float *kp = scratch.key_panels.data(), *vp = scratch.value_panels.data();
    float *p = scratch.weights.data(), *ds = scratch.grads.data();
    float* dq_block = scratch.dq_block.data();
    if (path == Products::kBrgemm) {
      brgemm(rows, kn, D, D, ldt, kScoreStride, false, q_block, kp + k0, p, false);  // s = q · kᵀ
      brgemm(rows, kn, Dv, Dv, ldt, kScoreStride, false, dout_block, vp + k0, ds,
             false);  // dP = dO · vᵀ
    } else {
      product_tiles({.M = rows, .N = kn, .K = D, .a = q_block, .lda = D, .step = 1,
                     .b = kp + k0 * D, .ldb = kPanel, .panel_stride = D * kPanel, .c = p,
                     .ldc = kScoreStride, .add = false});  // s = q · kᵀ
      product_tiles({.M = rows, .N = kn, .K = Dv, .a = dout_block, .lda = Dv, .step = 1,
                     .b = vp + k0 * Dv, .ldb = kPanel, .panel_stride = Dv * kPanel, .c = ds,
                     .ldc = kScoreStride, .add = false});  // dP = dO · vᵀ
    }
    for (int64_t r = 0; r < rows; ++r) {
      distance_sum +=
          row_gradients(block, r, k0, kn, p + r * kScoreStride, ds + r * kScoreStride, scratch);
    }
    if (path == Products::kBrgemm) {
      brgemm(Dv, kn, rows, rows, kScoreStride, ldt, true, scratch.dout_t.data(), p,
             block.dv + k0, false);  // dVᵀ += dOᵀ · P
      brgemm(D, kn, rows, rows, kScoreStride, ldt, true, scratch.q_t.data(), ds, block.dk + k0,
             false);  // dKᵀ += qᵀ · dS (scaled at the task's end)
      brgemm(rows, D, kn, kScoreStride, D, D, true, ds, keys + k0 * D, dq_block,
             false);  // dQ += dS · k
      return;
    }
    product_tiles({.M = kn, .N = Dv, .K = rows, .a = p, .lda = 1, .step = kScoreStride,
                   .b = dout_block, .ldb = Dv, .panel_stride = kPanel, .c = block.dv + k0 * Dv,
                   .ldc = Dv, .add = true});  // dV += Pᵀ · dO
    product_tiles({.M = kn, .N = D, .K = rows, .a = ds, .lda = 1, .step = kScoreStride,
                   .b = q_block, .ldb = D, .panel_stride = kPanel, .c = block.dk + k0 * D,
                   .ldc = D, .add = true});  // dK += dSᵀ · q (scaled at the task's end)
    product_tiles({.M = rows, .N = D, .K = kn, .a = ds, .lda = kScoreStride, .step = 1,
                   .b = keys + k0 * D, .ldb = D, .panel_stride = kPanel, .c = dq_block, .ldc = D,
                   .add = true});  // dQ += dS · k
  }

  // Row r of the block against keys k0 … k0 + kn − 1, in place: its scores p become its weights,
  // its dp its score gradients ds (both 0 for the keys it may not see). Returns its part of
  // −dL/d slope (0 without ALiBi).
  [[gnu::always_inline]]
  float row_gradients(const GradientBlock& block, int64_t r, int64_t k0, int64_t kn, float* p,
                      float* ds, const BackwardScratch& scratch) const {
    // Keys from … from + seen − 1 of this block row r may see; the rest get 0.
    const int64_t i = block.q0 + r;
    const float top = scratch.rows_lse2[r], delta = scratch.rows_delta[r];
    const auto [lo, hi] = call.keys.row(block.head, i);
    const int64_t from = std::clamp<int64_t>(lo - k0, 0, kn);
    const int64_t seen = std::max(from, std::clamp<int64_t>(hi - k0, 0, kn)) - from;
    std::fill(p, p + from, 0.f);
    std::fill(ds, ds + from, 0.f);
    if (call.program != nullptr) {  // a score_mod / mask_mod program (program.h)
      call.program->gradients(p + from, ds + from, seen, block.head, i, k0 + from, top, delta);
      std::fill(p + from + seen, p + kn, 0.f);
      std::fill(ds + from + seen, ds + kn, 0.f);
      return 0.f;
    }
    if (!call.scores.any()) {
      tile_gradients(p + from, ds + from, seen, kn - from, call.exponent_scale(), top, delta);
      return 0.f;
    }
    const RowRules rule = call.row(block.head, i, k0 + from);
    const float part = rule_gradients(p + from, ds + from, seen, rule, top, delta);
    std::fill(p + from + seen, p + kn, 0.f);
    std::fill(ds + from + seen, ds + kn, 0.f);
    return part;
  }
};

// q (NG, Lq, D), k (N, S, D), v (N, S, Dv), out and dout (NG, Lq, Dv), lse and its gradient dlse
// (NG, Lq; dlse empty: none), contiguous float32: returns dq, dk and dv (the shapes of q, k, v)
// and ALiBi's slopes' gradient (NG,) (empty (0,) without slopes), float32.
std::vector<at::Tensor> backward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& out, const at::Tensor& dout,
                                      const at::Tensor& lse, const at::Tensor& dlse,
                                      const CallRules& call, Products path) {
  const int64_t NG = q.size(0), Lq = q.size(1), D = q.size(2);
  const int64_t N = k.size(0), S = k.size(1), Dv = v.size(2);
  const int64_t query_blocks = (Lq + kQueryBlock - 1) / kQueryBlock;
  TORCH_CHECK(dlse.numel() == 0 || (dlse.scalar_type() == at::kFloat &&
                                     dlse.sizes() == lse.sizes() && dlse.is_contiguous()),
              "dlse: contiguous float32 shaped as lse");
  // Parts per head: enough tasks for every thread, never more parts than query blocks.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::clamp<int64_t>((threads + N - 1) / N, 1, std::max<int64_t>(1, query_blocks));
  // Each written whole by its task (in the task: first touched by the thread that fills it).
  auto dq = at::empty({NG, Lq, D}, q.options());
  auto dk_parts = at::empty({parts, N, S, D}, k.options());
  auto dv_parts = at::empty({parts, N, S, Dv}, v.options());
  auto dslope_parts = at::zeros({parts, call.scores.slopes == nullptr ? 0 : NG}, q.options());
  const BackwardPass pass{q.const_data_ptr<float>(), k.const_data_ptr<float>(),
                          v.const_data_ptr<float>(), out.const_data_ptr<float>(),
                          dout.const_data_ptr<float>(), lse.const_data_ptr<float>(),
                          dlse.numel() == 0 ? nullptr : dlse.const_data_ptr<float>(),
                          NG, Lq, D, N, S, Dv, parts, call, path, transposed_ld(S),
                          dq.data_ptr<float>(),
                          dk_parts.data_ptr<float>(), dv_parts.data_ptr<float>(),
                          dslope_parts.data_ptr<float>()};
  // Tasks are handed out one at a time (as forward_impl's blocks), so that a core that runs
  // slower takes fewer; which thread runs a task does not change its sums.
  const int64_t tasks = N * parts;
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min(threads, tasks), 1, [&](int64_t, int64_t) {
    BackwardScratch scratch(S, D, Dv, path);
    for (int64_t task; (task = next_task.fetch_add(1)) < tasks;) pass.run(task, scratch);
  });
  at::Tensor dk = parts == 1 ? dk_parts[0] : dk_parts.sum(0);  // parts added up in order
  at::Tensor dv = parts == 1 ? dv_parts[0] : dv_parts.sum(0);
  return {dq, dk, dv, dslope_parts.sum(0)};
}

}  // namespace
