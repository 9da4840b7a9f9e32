// qkv's compiled flash kernel for CPUs (kernel.py builds and calls it): the functions Python
// calls, which check their tensors and run the kernel's parts, each in a header of its own:
//
//   row_math.h   2^x, tanh, and the passes over one row of scores (its maximum, its weights)
//   rules.h      the keys each query row may see; soft-capping and ALiBi
//   layout.h     block sizes, the threads' buffers, keys and values packed for the products
//   products.h   float32 matrix products: the kernel's register tiles, oneDNN's brgemm, BLAS
//   forward.h    the forward recurrence, a query block at a time (its header explains it)
//   backward.h   the backward pass
//   decode.h     decoding's one core: a few queries per sequence, K/V read once where they lie
//   decode_products.h  its products for a chunk of keys: blocks of scores, acc += p · V
//   paged.h      decode.h's core for packed sequences: a paged KV cache, or keys packed in place
//   program_code.h  a score_mod's / mask_mod's instructions, and what is known before they run
//   program.h    a score_mod / mask_mod as a program run on each row of scores
//   program_calls.h  the forward and backward passes with such a program, and the program alone
//
// They are included here, once: the kernel is one translation unit, so that the compiler sees
// all of it and inlines the row passes and tiles into the loops that run them. kernel.py
// hashes every file of this folder into the build's name.
//
// The vector passes are written on ATen's portable vector type at::vec::Vectorized<float>,
// which compiles to AVX-512, AVX2, NEON or plain C++, as the build's CPU_CAPABILITY says.

#include <torch/extension.h>

#include "backward.h"
#include "decode.h"
#include "forward.h"
#include "layout.h"
#include "paged.h"
#include "products.h"
#include "program_calls.h"
#include "rules.h"

#include <ATen/native/CPUBlas.h>

#include <cstdint>
#include <vector>

namespace {

// q (NG, Lq, D), k (N, S, D), v (N, S, Dv), contiguous, all float32 or all bfloat16, with the
// call's rules: returns out (NG, Lq, Dv) and lse (NG, Lq), float32 (forward.h). products: where
// float32 products run (Products).
std::vector<at::Tensor> forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal,
    int64_t offset, bool windowed, int64_t window, int64_t products, const at::Tensor& ranges,
    int64_t heads_per_range, double softcap, const at::Tensor& slopes) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-d");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "need contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type());
  TORCH_CHECK(k.size(0) > 0 && q.size(0) % k.size(0) == 0, "heads must group");
  const CallRules call{static_cast<float>(scale),
                       key_bounds(causal, offset, windowed, window, k.size(1), q.size(1), ranges,
                                  heads_per_range),
                       score_rules(softcap, slopes, q.size(0), k.size(1), q.size(1))};
  const auto path = static_cast<Products>(products);
  if (q.scalar_type() == at::kBFloat16) return forward_impl<at::BFloat16>(q, k, v, call, path);
  TORCH_CHECK(q.scalar_type() == at::kFloat, "float32 or bfloat16");
  return forward_impl<float>(q, k, v, call, path);
}

// q (*B, Hq, Lq, D), k (*B, Hkv, S, D), v (*B, Hkv, S, Dv) with the same leading dims B (any
// number of them, 0 included), float32 or bfloat16, k and v with any strides but contiguous
// rows: returns out (*B, Hq, Lq, Dv) and lse (*B, Hq, Lq), float32 (decode.h). splits: how many
// pieces the keys are split into (0: decode.h chooses).
std::vector<at::Tensor> decode(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal,
    int64_t offset, bool windowed, int64_t window, const at::Tensor& ranges,
    int64_t heads_per_range, double softcap, const at::Tensor& slopes, int64_t splits) {
  TORCH_CHECK(q.dim() >= 3 && k.dim() == q.dim() && v.dim() == q.dim(), "q, k, v: same dims");
  TORCH_CHECK(q.sizes().slice(0, q.dim() - 3) == k.sizes().slice(0, k.dim() - 3) &&
              k.sizes().slice(0, k.dim() - 2) == v.sizes().slice(0, v.dim() - 2),
              "q, k, v must have the same leading dims");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type());
  TORCH_CHECK(k.size(-3) > 0 && q.size(-3) % k.size(-3) == 0, "heads must group");
  TORCH_CHECK(k.size(-2) == v.size(-2) && q.size(-1) == k.size(-1), "shapes must agree");
  const auto rows = [](const at::Tensor& x) {  // (·, L, D) with contiguous rows, a view if it can
    const at::Tensor flat = x.reshape({-1, x.size(-2), x.size(-1)});
    return flat.stride(2) == 1 ? flat : flat.contiguous();
  };
  const at::Tensor q3 = q.reshape({-1, q.size(-2), q.size(-1)}).contiguous();
  const CallRules call{static_cast<float>(scale),
                       key_bounds(causal, offset, windowed, window, k.size(-2), q.size(-2), ranges,
                                  heads_per_range),
                       score_rules(softcap, slopes, q3.size(0), k.size(-2), q.size(-2))};
  std::vector<at::Tensor> result;
  if (q.scalar_type() == at::kBFloat16) {
    result = decode_impl<at::BFloat16>(q3, rows(k), rows(v), call, splits);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "float32 or bfloat16");
    result = decode_impl<float>(q3, rows(k), rows(v), call, splits);
  }
  std::vector<int64_t> shape(q.sizes().begin(), q.sizes().end());
  shape.back() = v.size(-1);
  result[0] = result[0].view(shape);
  shape.pop_back();
  result[1] = result[1].view(shape);
  return result;
}

// One decoding step against a KV cache: k_new (B, Hkv, L, D) and v_new (B, Hkv, L, Dv) are written
// into the cache's buffers k_buf (B, Hkv, capacity, D) and v_buf (B, Hkv, capacity, Dv) at
// start … start+L−1, then q (B, H, L, D) attends to the first start + L positions (decode,
// reading the buffers in place, keys split as decode's splits say). Returns out (B, H, L, Dv) in
// q's dtype.
at::Tensor decode_step(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                       const at::Tensor& k_buf, const at::Tensor& v_buf, int64_t start,
                       double scale, bool causal, int64_t offset, int64_t splits) {
  TORCH_CHECK(q.dim() == 4 && k_new.dim() == 4 && v_new.dim() == 4 && k_buf.dim() == 4 &&
              v_buf.dim() == 4, "q, new keys/values and buffers must be 4-d");
  const int64_t L = k_new.size(2);
  TORCH_CHECK(start >= 0 && start + L <= k_buf.size(2) && k_buf.size(2) == v_buf.size(2),
              "no room in the buffers");
  k_buf.narrow(2, start, L).copy_(k_new);
  v_buf.narrow(2, start, L).copy_(v_new);
  const int64_t S = start + L;
  const at::Tensor out =
      decode(q, k_buf.narrow(2, 0, S), v_buf.narrow(2, 0, S), scale, causal, offset, false, 0,
             at::Tensor(), 1, 0.0, at::Tensor(), splits)[0];
  return out.to(q.scalar_type());
}

// The forward pass's gradients (backward.h), float32 (the caller widens other dtypes): q, k, v
// and lse as forward took and gave them, out and its gradient dout (NG, Lq, Dv), the gradient of
// lse dlse (NG, Lq) (empty: none). Returns dq, dk, dv and ALiBi's slopes' gradient (NG,), empty
// (0,) for a call without slopes.
std::vector<at::Tensor> backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& dout, const at::Tensor& lse, const at::Tensor& dlse, double scale,
    bool causal, int64_t offset, bool windowed, int64_t window, int64_t products,
    const at::Tensor& ranges, int64_t heads_per_range, double softcap, const at::Tensor& slopes) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-d");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
              v.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
              dout.scalar_type() == at::kFloat && lse.scalar_type() == at::kFloat, "float32");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() &&
              out.is_contiguous() && dout.is_contiguous() && lse.is_contiguous(),
              "need contiguous");
  TORCH_CHECK(k.size(0) > 0 && q.size(0) % k.size(0) == 0, "heads must group");
  const CallRules call{static_cast<float>(scale),
                       key_bounds(causal, offset, windowed, window, k.size(1), q.size(1), ranges,
                                  heads_per_range),
                       score_rules(softcap, slopes, q.size(0), k.size(1), q.size(1))};
  return backward_impl(q, k, v, out, dout, lse, dlse, call, static_cast<Products>(products));
}

// Whether oneDNN runs bfloat16 products on this CPU's matrix units (AMX).
bool bfloat16_matrix_units() { return at::native::cpublas::could_pack(at::kBFloat16); }

#define QKV_STRING(x) #x
#define QKV_EXPANDED_STRING(x) QKV_STRING(x)

// What this build runs: ATen's vector capability and width.
pybind11::dict build_info() {
  pybind11::dict info;
  info["capability"] = QKV_EXPANDED_STRING(CPU_CAPABILITY);
  info["vector_bits"] = kLanes * 32;
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("forward", &forward, "flash forward: (out, lse)");
  module.def("decode", &decode, "flash forward for a few queries, k and v strided: (out, lse)");
  module.def("decode_step", &decode_step, "write new keys/values into a KV cache's buffers, attend");
  module.def("paged_decode", &paged_decode, "a few queries per sequence against a paged cache");
  module.def("plain_paged_decode", &plain_paged_decode, "paged_decode with its checks and rows");
  module.def("plain_packed_decode", &plain_packed_decode, "packed_decode with its checks, rows");
  module.def("paged_write", &paged_write, "a decoding step's keys and values into a paged pool");
  module.def("forward_program", &forward_program, "flash forward with a mod program");
  module.def("backward_program", &backward_program, "flash backward with a mod program");
  module.def("evaluate_program", &evaluate_program, "a mod program on a block of scores");
  module.def("packed_decode", &packed_decode, "a few queries per sequence against packed keys");
  module.def("backward", &backward, "flash backward: (dq, dk, dv, dslopes), float32");
  module.def("bfloat16_matrix_units", &bfloat16_matrix_units);
  module.def("build_info", &build_info, "capability, vector width");
}
