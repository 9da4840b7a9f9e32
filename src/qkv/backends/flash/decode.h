// Decoding: a few queries, one query row at a time: its scores against the keys it may see,
// their maximum, one exponentiation pass, then out = Σ_j p_j v_j / l. k and v are read where
// they lie (a KV cache's buffer), with any head and row strides; only their last dim must be
// contiguous. float32 throughout: bfloat16 inputs are widened as they are read.

#pragma once

#include "row_math.h"
#include "rules.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// float32 values from x (float32 or bfloat16, widened): a whole vector, or its first count
// lanes (the rest 0).
template <typename T>
inline Vec load_float(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(x);
  } else {
    Vec out;
    at::vec::load_fp32_from_bf16(x, out);
    return out;
  }
}

template <typename T>
inline Vec load_float(const T* x, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(x, count);
  } else {
    return std::get<0>(at::vec::convert_bfloat16_float(at::vec::Vectorized<T>::loadu(x, count)));
  }
}

// q · key over D features, q float32, in one vector of partial sums (summed by the caller).
template <typename T>
inline Vec dot_lanes(const float* q, const T* key, int64_t D) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) acc = at::vec::fmadd(Vec::loadu(q + d), load_float(key + d), acc);
  if (d < D) acc = at::vec::fmadd(Vec::loadu(q + d, D - d), load_float(key + d, D - d), acc);
  return acc;
}

// s_j = q · k_j for j < n, with k_j at k + j · stride (D contiguous values each).
template <typename T>
void dot_rows(const float* q, const T* k, int64_t stride, int64_t n, int64_t D, float* s) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {  // four keys at a time: four independent chains of sums
    const Vec a0 = dot_lanes(q, k + j * stride, D), a1 = dot_lanes(q, k + (j + 1) * stride, D);
    const Vec a2 = dot_lanes(q, k + (j + 2) * stride, D), a3 = dot_lanes(q, k + (j + 3) * stride, D);
    s[j] = sum_lanes(a0), s[j + 1] = sum_lanes(a1), s[j + 2] = sum_lanes(a2), s[j + 3] = sum_lanes(a3);
  }
  for (; j < n; ++j) s[j] = sum_lanes(dot_lanes(q, k + j * stride, D));
}

// out = Σ_{j < n} p_j v_j, with v_j at v + j · stride (Dv contiguous values each): 64 output
// features at a time, summed in 64 / kLanes registers.
template <typename T>
void weighted_sum(const float* p, const T* v, int64_t stride, int64_t n, int64_t Dv, float* out) {
  constexpr int64_t kGroup = 64, kChunks = kGroup / kLanes;
  for (int64_t e0 = 0; e0 < Dv; e0 += kGroup) {
    const int64_t width = std::min(kGroup, Dv - e0);
    Vec acc[kChunks];
    for (auto& a : acc) a = Vec(0.f);
    if (width == kGroup) {
      for (int64_t j = 0; j < n; ++j) {
        const Vec weight(p[j]);
        const T* row = v + j * stride + e0;
        for (int64_t c = 0; c < kChunks; ++c)
          acc[c] = at::vec::fmadd(weight, load_float(row + c * kLanes), acc[c]);
      }
      for (int64_t c = 0; c < kChunks; ++c) acc[c].store(out + e0 + c * kLanes);
      continue;
    }
    const int64_t chunks = (width + kLanes - 1) / kLanes;  // the last group's: fewer, the last partial
    for (int64_t j = 0; j < n; ++j) {
      const Vec weight(p[j]);
      const T* row = v + j * stride + e0;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t count = std::min(kLanes, width - c * kLanes);
        acc[c] = at::vec::fmadd(weight, load_float(row + c * kLanes, count), acc[c]);
      }
    }
    for (int64_t c = 0; c < chunks; ++c)
      acc[c].store(out + e0 + c * kLanes, std::min(kLanes, width - c * kLanes));
  }
}

// q (NG, Lq, D) contiguous, k (N, S, D) and v (N, S, Dv) with contiguous rows, float32 or
// bfloat16: returns out (NG, Lq, Dv) and lse (NG, Lq), float32.
template <typename T>
std::vector<at::Tensor> decode_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const CallRules& call) {
  const int64_t NG = q.size(0), Lq = q.size(1), D = q.size(2);
  const int64_t N = k.size(0), S = k.size(1), Dv = v.size(2);
  const int64_t g = NG / N;
  const float c = call.exponent_scale();
  auto out = at::empty({NG, Lq, Dv}, q.options().dtype(at::kFloat));
  auto lse = at::empty({NG, Lq}, q.options().dtype(at::kFloat));
  const T* qd = q.const_data_ptr<T>();
  const T* kd = k.const_data_ptr<T>();
  const T* vd = v.const_data_ptr<T>();
  float* od = out.data_ptr<float>();
  float* ld = lse.data_ptr<float>();
  // Rows are split between threads only when each gets enough work to pay for waking them.
  const int64_t row_work = std::max<int64_t>(1, S * (D + Dv));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / row_work);
  at::parallel_for(0, NG * Lq, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> query(D), p(S);
    for (int64_t z = begin; z < end; ++z) {
      const int64_t head = z / Lq, i = z % Lq;
      const auto [lo, hi] = call.keys.row(head, i);
      const int64_t seen = std::max<int64_t>(0, hi - lo);  // keys lo … hi − 1
      for (int64_t d = 0; d < D; ++d) query[d] = static_cast<float>(qd[z * D + d]);
      const T* keys = kd + (head / g) * k.stride(0) + lo * k.stride(1);
      dot_rows(query.data(), keys, k.stride(1), seen, D, p.data());
      if (call.scores.any()) modify_row(p.data(), seen, call.row(head, i, lo));
      const float m = row_max(p.data(), seen, c);
      float l = 0.f, *o = od + z * Dv;
      if (m == kNegInf) {  // no key (or only −inf scores): nothing to add, unless one is NaN
        l = any_nan(p.data(), seen) ? std::numeric_limits<float>::quiet_NaN() : 0.f;
        std::fill(o, o + Dv, l);
      } else {
        l = exp_row<float>(p.data(), p.data(), seen, c, m).sum;  // in place: 2^(s_j · c − m)
        const T* values = vd + (head / g) * v.stride(0) + lo * v.stride(1);
        weighted_sum(p.data(), values, v.stride(1), seen, Dv, o);
        const float inv = 1.f / l;
        for (int64_t e = 0; e < Dv; ++e) o[e] *= inv;
      }
      ld[z] = row_lse(m, l);
    }
  });
  return {out, lse};
}

}  // namespace
