// Paged decoding: a few queries per sequence against keys and values that lie in a pool of
// pages, (P, page_size, Hkv, D), mapped onto each sequence by its row of a block table: key j of
// sequence s is token j % page_size of page table[s][j / page_size]. One query row at a time, as
// decode.h: its scores page by page, their maximum, one exponentiation pass, then
// out = Σ_j p_j v_j / l summed page by page in registers. Nothing is gathered into a contiguous
// copy. float32 throughout: bfloat16 pools are widened as they are read.

#pragma once

#include "decode.h"
#include "row_math.h"
#include "rules.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// The keys of one sequence in the pool: its block table row and the page size. chunks(lo, hi, f)
// calls f(j, n, token) for runs of keys j … j + n − 1 (lo ≤ j < hi) that lie together on one page,
// starting at pool token `token` (= page · page_size + j % page_size).
struct PagedKeys {
  const int64_t* pages;
  int64_t page_size;

  template <typename F>
  void chunks(int64_t lo, int64_t hi, F&& f) const {
    for (int64_t j = lo; j < hi;) {
      const int64_t within = j % page_size;
      const int64_t n = std::min(hi - j, page_size - within);
      f(j, n, pages[j / page_size] * page_size + within);
      j += n;
    }
  }
};

// out[0 … width) = Σ_j p_j v_j over the keys lo … hi − 1 of one head, value row j at
// v + token · stride (chunks), for one group of at most kGroup output features in registers.
template <typename T, int64_t Chunks>
inline void paged_group(const float* p, const T* v, int64_t stride, const PagedKeys& keys,
                        int64_t lo, int64_t hi, int64_t width, float* out) {
  Vec acc[Chunks];
  for (auto& a : acc) a = Vec(0.f);
  const int64_t full = width / kLanes, rest = width % kLanes;
  keys.chunks(lo, hi, [&](int64_t j, int64_t n, int64_t token) {
    const T* row = v + token * stride;
    const float* weights = p + (j - lo);
    for (int64_t r = 0; r < n; ++r, row += stride) {
      const Vec weight(weights[r]);
      for (int64_t c = 0; c < full; ++c)
        acc[c] = at::vec::fmadd(weight, load_float(row + c * kLanes), acc[c]);
      if (rest) acc[full] = at::vec::fmadd(weight, load_float(row + full * kLanes, rest), acc[full]);
    }
  });
  for (int64_t c = 0; c < full; ++c) acc[c].store(out + c * kLanes);
  if (rest) acc[full].store(out + full * kLanes, rest);
}

// out (Dv) = Σ_j p_j v_j over keys lo … hi − 1, 64 features at a time.
template <typename T>
void paged_weighted_sum(const float* p, const T* v, int64_t stride, const PagedKeys& keys,
                        int64_t lo, int64_t hi, int64_t Dv, float* out) {
  constexpr int64_t kGroup = 64, kChunks = kGroup / kLanes;
  for (int64_t e0 = 0; e0 < Dv; e0 += kGroup) {
    const int64_t width = std::min(kGroup, Dv - e0);
    paged_group<T, kChunks>(p, v + e0, stride, keys, lo, hi, width, out + e0);
  }
}

// q (T, Hq, D) contiguous; k_pool (P, page_size, Hkv, D) and v_pool (P, page_size, Hkv, Dv)
// contiguous, float32 or bfloat16; table (N, M) int64; rows (T, 4) int64, per query token: its
// sequence, the keys [lo, hi) it may see and its position (ALiBi's distance to key j is
// position − j). Returns out (T, Hq, Dv) and lse (T, Hq), float32.
template <typename T>
std::vector<at::Tensor> paged_impl(const at::Tensor& q, const at::Tensor& k_pool,
                                   const at::Tensor& v_pool, const at::Tensor& table,
                                   const at::Tensor& rows, const ScoreRules& rules, float scale) {
  const int64_t Tq = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t page_size = k_pool.size(1), Hkv = k_pool.size(2), Dv = v_pool.size(3);
  const int64_t g = Hq / Hkv, M = table.size(1);
  const float c = rules.any() ? kLog2E : scale * kLog2E;
  auto out = at::empty({Tq, Hq, Dv}, q.options().dtype(at::kFloat));
  auto lse = at::empty({Tq, Hq}, q.options().dtype(at::kFloat));
  const T* qd = q.const_data_ptr<T>();
  const T* kd = k_pool.const_data_ptr<T>();
  const T* vd = v_pool.const_data_ptr<T>();
  const int64_t* td = table.const_data_ptr<int64_t>();
  const int64_t* rd = rows.const_data_ptr<int64_t>();
  float* od = out.data_ptr<float>();
  float* ld = lse.data_ptr<float>();
  const int64_t row_work = std::max<int64_t>(1, M * page_size * (D + Dv));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / row_work);
  at::parallel_for(0, Tq * Hq, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> query(D), p(M * page_size);
    for (int64_t z = begin; z < end; ++z) {
      const int64_t t = z / Hq, head = z % Hq, kv = head / g;
      const int64_t* row = rd + t * 4;
      const PagedKeys keys{td + row[0] * M, page_size};
      const int64_t lo = row[1], hi = std::max(row[1], row[2]), seen = hi - lo;
      for (int64_t d = 0; d < D; ++d) query[d] = static_cast<float>(qd[z * D + d]);
      keys.chunks(lo, hi, [&](int64_t j, int64_t n, int64_t token) {
        const T* first = kd + (token * Hkv + kv) * D;
        dot_rows(query.data(), first, Hkv * D, n, D, p.data() + (j - lo));
      });
      if (rules.any()) {
        const float slope = rules.slopes == nullptr ? 0.f : rules.slopes[head];
        modify_row(p.data(), seen, {scale, rules.cap, slope, rules.slopes != nullptr, row[3] - lo});
      }
      const float m = row_max(p.data(), seen, c);
      float l = 0.f, *o = od + z * Dv;
      if (m == kNegInf) {  // no key (or only −inf scores): nothing to add, unless one is NaN
        l = any_nan(p.data(), seen) ? std::numeric_limits<float>::quiet_NaN() : 0.f;
        std::fill(o, o + Dv, l);
      } else {
        l = exp_row<float>(p.data(), p.data(), seen, c, m).sum;  // in place: 2^(s_j · c − m)
        paged_weighted_sum(p.data(), vd + kv * Dv, Hkv * Dv, keys, lo, hi, Dv, o);
        const float inv = 1.f / l;
        for (int64_t e = 0; e < Dv; ++e) o[e] *= inv;
      }
      ld[z] = row_lse(m, l);
    }
  });
  return {out, lse};
}

// The checked entry point (flash_cpu.cpp binds it): see paged_impl. The caller (kernel.py) has
// checked that every page the rows reach lies in the pool.
std::vector<at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_pool,
                                     const at::Tensor& v_pool, const at::Tensor& table,
                                     const at::Tensor& rows, double scale, double softcap,
                                     const at::Tensor& slopes) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.dim() == 4, "q 3-d, pools 4-d");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
              table.is_contiguous() && rows.is_contiguous(), "need contiguous");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type());
  TORCH_CHECK(table.scalar_type() == at::kLong && rows.scalar_type() == at::kLong &&
              table.dim() == 2 && rows.dim() == 2 && rows.size(0) == q.size(0) &&
              rows.size(1) == 4, "table (N, M) and rows (T, 4): int64");
  TORCH_CHECK(k_pool.sizes().slice(0, 3) == v_pool.sizes().slice(0, 3) &&
              q.size(2) == k_pool.size(3), "pool shapes must agree with q");
  TORCH_CHECK(k_pool.size(2) > 0 && q.size(1) % k_pool.size(2) == 0, "heads must group");
  const ScoreRules rules = score_rules(softcap, slopes, q.size(1), 0, 0);
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16)
    return paged_impl<at::BFloat16>(q, k_pool, v_pool, table, rows, rules, s);
  TORCH_CHECK(q.scalar_type() == at::kFloat, "float32 or bfloat16");
  return paged_impl<float>(q, k_pool, v_pool, table, rows, rules, s);
}

}  // namespace
