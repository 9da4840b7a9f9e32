// The kernel's calls with a score_mod / mask_mod program (program.h, program.py): the forward
// and backward passes with the program, and the program alone on one block of scores (program.py's proof
// that it means what the mods mean).

#pragma once

#include "backward.h"
#include "forward.h"
#include "program.h"
#include "rules.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace {

// What both passes check of a call with a program: q (NG, Lq, D), k (N, S, D) with N dividing NG
// and `heads` dividing it too; states, where given, one per (query block, key block of 128).
inline void check_program_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& states,
                               int64_t heads) {
  TORCH_CHECK(k.size(0) > 0 && q.size(0) % k.size(0) == 0, "heads must group");
  TORCH_CHECK(heads > 0 && q.size(0) % heads == 0, "heads must divide q's heads");
  TORCH_CHECK(states.numel() == 0 ||
              (states.dim() == 2 && states.size(0) == (q.size(1) + kQueryBlock - 1) / kQueryBlock &&
               states.size(1) == (k.size(1) + kStateBlock - 1) / kStateBlock),
              "mod program: states must be (ceil(Lq / 128), ceil(S / 128))");
}

// A call's rules with a program: its key bounds, no soft-cap or ALiBi, the program (which must
// outlive them).
inline CallRules program_rules(const at::Tensor& q, const at::Tensor& k, double scale, bool causal,
                               int64_t offset, bool windowed, int64_t window,
                               const at::Tensor& ranges, int64_t heads_per_range,
                               const ModProgram& program) {
  return {static_cast<float>(scale),
          key_bounds(causal, offset, windowed, window, k.size(1), q.size(1), ranges,
                     heads_per_range),
          score_rules(0.0, at::Tensor(), q.size(0), k.size(1), q.size(1)), &program};
}

// forward (flash_cpu.cpp) with the program of mod_program's arguments in place of soft-capping
// and ALiBi: returns out (NG, Lq, Dv) and lse (NG, Lq), float32.
std::vector<at::Tensor> forward_program(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal,
    int64_t offset, bool windowed, int64_t window, int64_t products, const at::Tensor& ranges,
    int64_t heads_per_range, const at::Tensor& score_ops, const at::Tensor& score_constants,
    int64_t score_result, const at::Tensor& mask_ops, const at::Tensor& mask_constants,
    int64_t mask_result, const std::vector<at::Tensor>& tables, const at::Tensor& states,
    int64_t heads) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-d");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "need contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type());
  check_program_call(q, k, states, heads);
  const ModProgram program =
      mod_program(score_ops, score_constants, score_result, mask_ops, mask_constants,
                  mask_result, tables, states, heads, scale);
  const CallRules call = program_rules(q, k, scale, causal, offset, windowed, window, ranges,
                                       heads_per_range, program);
  const auto path = static_cast<Products>(products);
  if (q.scalar_type() == at::kBFloat16) return forward_impl<at::BFloat16>(q, k, v, call, path);
  TORCH_CHECK(q.scalar_type() == at::kFloat, "float32 or bfloat16");
  return forward_impl<float>(q, k, v, call, path);
}

// backward (flash_cpu.cpp) of forward_program: dq, dk, dv (float32, the shapes of q, k, v).
std::vector<at::Tensor> backward_program(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& dout, const at::Tensor& lse, const at::Tensor& dlse, double scale,
    bool causal, int64_t offset, bool windowed, int64_t window, int64_t products,
    const at::Tensor& ranges, int64_t heads_per_range, const at::Tensor& score_ops,
    const at::Tensor& score_constants, int64_t score_result, const at::Tensor& mask_ops,
    const at::Tensor& mask_constants, int64_t mask_result, const std::vector<at::Tensor>& tables,
    const at::Tensor& states, int64_t heads) {
  for (const at::Tensor* x : {&q, &k, &v, &out, &dout, &lse})
    TORCH_CHECK(x->scalar_type() == at::kFloat && x->is_contiguous() && x->dim() >= 2,
                "backward_program: contiguous float32 tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-d");
  check_program_call(q, k, states, heads);
  const ModProgram program =
      mod_program(score_ops, score_constants, score_result, mask_ops, mask_constants,
                  mask_result, tables, states, heads, scale);
  const CallRules call = program_rules(q, k, scale, causal, offset, windowed, window, ranges,
                                       heads_per_range, program);
  std::vector<at::Tensor> grads =
      backward_impl(q, k, v, out, dout, lse, dlse, call, static_cast<Products>(products));
  grads.pop_back();  // (no slopes)
  return grads;
}

// The programs alone on scores (Z, R, n) of queries q0 … and keys k0 … (n ≤ the kernel's key
// block), float32 q · k before the scale: the score code's result (the scaled scores where there
// is none), the mask code's as 1/0 (1 where there is none) and the score code's derivative with
// respect to the scaled score (1 where there is none), each (Z, R, n).
std::vector<at::Tensor> evaluate_program(
    const at::Tensor& scores, int64_t q0, int64_t k0, double scale, const at::Tensor& score_ops,
    const at::Tensor& score_constants, int64_t score_result, const at::Tensor& mask_ops,
    const at::Tensor& mask_constants, int64_t mask_result, const std::vector<at::Tensor>& tables,
    int64_t heads) {
  TORCH_CHECK(scores.scalar_type() == at::kFloat && scores.dim() == 3 &&
              scores.size(2) <= kKeyBlock, "scores: float32 (Z, R, n ≤ kernel key block)");
  const ModProgram program =
      mod_program(score_ops, score_constants, score_result, mask_ops, mask_constants,
                  mask_result, tables, at::Tensor(), heads, scale);
  at::Tensor modified = scores.contiguous().clone();
  at::Tensor keep = at::ones_like(modified), slope = at::ones_like(modified);
  const int64_t Z = scores.size(0), R = scores.size(1), n = scores.size(2);
  Registers& r = thread_registers(0);
  Registers& m = thread_registers(1);
  Registers& t = thread_registers(2);
  for (int64_t z = 0; z < Z; ++z)
    for (int64_t row = 0; row < R; ++row) {
      float* s = modified.data_ptr<float>() + (z * R + row) * n;
      for (int64_t j = 0; j < n; ++j) s[j] *= static_cast<float>(scale);
      if (program.score.present()) {
        const bool constant = program.score.constant_slope();  // as gradients runs it
        const int64_t result = program.run(program.score, r, s, 1.f, n, z, q0 + row, k0,
                                           constant ? nullptr : &t);
        ModProgram::write(r, result, s, n);
        float* d = slope.data_ptr<float>() + (z * R + row) * n;
        if (constant) std::fill(d, d + n, program.score.slope);
        else std::copy(t.row(result), t.row(result) + n, d);
      }
      if (program.mask.present())
        ModProgram::write(m, program.run(program.mask, m, nullptr, 1.f, n, z, q0 + row, k0),
                          keep.data_ptr<float>() + (z * R + row) * n, n);
    }
  return {modified, keep, slope};
}

}  // namespace
