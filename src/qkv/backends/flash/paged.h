// Paged decoding: a few queries per sequence against keys and values that lie in a pool of
// pages, (P, page_size, Hkv, D), mapped onto each sequence by its row of a block table: key j of
// sequence s is token j % page_size of page table[s][j / page_size]. One query row at a time, as
// decode.h per row: its scores page by page, their maximum, one exponentiation pass, then
// out = Σ_j p_j v_j / l page by page. A page's tokens lie with their heads side by side, so the
// query heads of a query token are computed together and each token's keys and values are read
// once, in memory order. Nothing is gathered into a contiguous copy. float32 throughout:
// bfloat16 pools are widened as they are read.

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

  // The run that starts at key j (j < hi): (its first pool token, its length).
  std::pair<int64_t, int64_t> run(int64_t j, int64_t hi) const {
    const int64_t within = j % page_size;
    return {pages[j / page_size] * page_size + within, std::min(hi - j, page_size - within)};
  }

  template <typename F>
  void chunks(int64_t lo, int64_t hi, F&& f) const {
    for (int64_t j = lo; j < hi;) {
      const auto [token, n] = run(j, hi);
      f(j, n, token);
      j += n;
    }
  }
};


// The scores of the g query heads (g rows of D in q) that share one key (D values): written
// to s[0], s[stride], …; four heads at a time, each key vector loaded once for the four.
template <typename T>
inline void group_scores(const float* q, const T* key, int64_t g, int64_t D, float* s,
                         int64_t stride) {
  int64_t h = 0;
  for (; h + 4 <= g; h += 4) {
    const float* q0 = q + h * D;
    Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
    int64_t d = 0;
    for (; d + kLanes <= D; d += kLanes) {
      const Vec k = load_float(key + d);
      a0 = at::vec::fmadd(Vec::loadu(q0 + d), k, a0);
      a1 = at::vec::fmadd(Vec::loadu(q0 + D + d), k, a1);
      a2 = at::vec::fmadd(Vec::loadu(q0 + 2 * D + d), k, a2);
      a3 = at::vec::fmadd(Vec::loadu(q0 + 3 * D + d), k, a3);
    }
    if (d < D) {
      const Vec k = load_float(key + d, D - d);
      a0 = at::vec::fmadd(Vec::loadu(q0 + d, D - d), k, a0);
      a1 = at::vec::fmadd(Vec::loadu(q0 + D + d, D - d), k, a1);
      a2 = at::vec::fmadd(Vec::loadu(q0 + 2 * D + d, D - d), k, a2);
      a3 = at::vec::fmadd(Vec::loadu(q0 + 3 * D + d, D - d), k, a3);
    }
    s[h * stride] = sum_lanes(a0), s[(h + 1) * stride] = sum_lanes(a1);
    s[(h + 2) * stride] = sum_lanes(a2), s[(h + 3) * stride] = sum_lanes(a3);
  }
  for (; h < g; ++h) s[h * stride] = sum_lanes(dot_lanes(q + h * D, key, D));
}

// acc[h][0 … Dv) += p[h · stride] · value for the g heads h that share one value row (each
// value vector loaded once for all of them); acc holds g rows of Dv.
template <typename T>
inline void group_add(float* acc, const float* p, int64_t stride, const T* value, int64_t g,
                      int64_t Dv) {
  for (int64_t e = 0; e < Dv; e += kLanes) {
    const int64_t count = std::min(kLanes, Dv - e);
    const Vec v = count == kLanes ? load_float(value + e) : load_float(value + e, count);
    for (int64_t h = 0; h < g; ++h) {
      float* a = acc + h * Dv + e;
      const Vec sum = at::vec::fmadd(Vec(p[h * stride]), v, Vec::loadu(a, count));
      sum.store(a, count);
    }
  }
}

// The distance between two heads' rows of n scores: a whole number of cache lines plus one, so
// that the rows of many heads never fall in one cache set (as 4 KiB apart they would).
inline int64_t padded(int64_t n) { return (n + 15) / 16 * 16 + 16; }

// The sizes of a paged call and its pointers, as paged_rows reads them.
template <typename T>
struct PagedCall {
  const T *q, *k, *v;  // q (T, Hq, D); pools (P, page_size, Hkv, D or Dv)
  const int64_t *table, *rows;  // (N, M); (T, 4): sequence, lo, hi, position
  int64_t Hq, Hkv, D, Dv, M, page_size;
  float scale;
  ScoreRules rules;
};

// One query token t against its sequence's pages, for the query heads of key/value heads
// kv0 … kv1 − 1 together: each page's tokens are read once, in the order they lie (a token's
// heads side by side), so the pool streams from memory as a contiguous cache would. s holds the
// heads' scores (heads × keys), acc their outputs (heads × Dv), both float32 buffers.
template <typename T>
void paged_rows(const PagedCall<T>& call, int64_t t, int64_t kv0, int64_t kv1, float* s,
                float* acc, float* query, float* out, float* lse) {
  const int64_t g = call.Hq / call.Hkv, h0 = kv0 * g, heads = (kv1 - kv0) * g;
  const int64_t* row = call.rows + t * 4;
  const PagedKeys keys{call.table + row[0] * call.M, call.page_size};
  const int64_t lo = row[1], hi = std::max(row[1], row[2]), seen = hi - lo;
  const int64_t width = padded(seen);
  for (int64_t i = 0; i < heads * call.D; ++i)
    query[i] = static_cast<float>(call.q[(t * call.Hq + h0) * call.D + i]);
  const int64_t kv_heads = kv1 - kv0;
  keys.chunks(lo, hi, [&](int64_t j, int64_t n, int64_t token) {  // the scores, page by page
    for (int64_t r = 0; r < n; ++r) {
      const T* key = call.k + ((token + r) * call.Hkv + kv0) * call.D;
      for (int64_t kv = 0; kv < kv_heads; ++kv)
        group_scores(query + kv * g * call.D, key + kv * call.D, g, call.D,
                     s + kv * g * width + (j - lo + r), width);
    }
  });
  const float c = call.rules.any() ? kLog2E : call.scale * kLog2E;
  std::vector<float> inverse(heads);
  for (int64_t h = 0; h < heads; ++h) {  // each head's softmax weights, in place
    float* p = s + h * width;
    if (call.rules.any()) {
      const bool biased = call.rules.slopes != nullptr;
      const float slope = biased ? call.rules.slopes[h0 + h] : 0.f;
      modify_row(p, seen, {call.scale, call.rules.cap, slope, biased, row[3] - lo});
    }
    const float m = row_max(p, seen, c);
    float l = 0.f;
    if (m == kNegInf) {  // no key (or only −inf scores): weights 0, or NaN if a score is NaN
      l = any_nan(p, seen) ? std::numeric_limits<float>::quiet_NaN() : 0.f;
      std::fill(p, p + seen, l);
    } else {
      l = exp_row<float>(p, p, seen, c, m).sum;  // 2^(s_j · c − m)
    }
    inverse[h] = l == 0.f ? 0.f : 1.f / l;  // (a row without keys: 0, never 0 · inf)
    lse[h] = row_lse(m, l);
  }
  std::fill(acc, acc + heads * call.Dv, 0.f);
  keys.chunks(lo, hi, [&](int64_t j, int64_t n, int64_t token) {  // Σ_j p_j v_j, page by page
    for (int64_t r = 0; r < n; ++r) {
      const T* value = call.v + ((token + r) * call.Hkv + kv0) * call.Dv;
      for (int64_t kv = 0; kv < kv_heads; ++kv)
        group_add(acc + kv * g * call.Dv, s + kv * g * width + (j - lo + r), width,
                  value + kv * call.Dv, g, call.Dv);
    }
  });
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t e = 0; e < call.Dv; ++e)
      out[h * call.Dv + e] = inverse[h] == 0.f ? 0.f : acc[h * call.Dv + e] * inverse[h];
}

// q (T, Hq, D) contiguous; k_pool (P, page_size, Hkv, D) and v_pool (P, page_size, Hkv, Dv)
// contiguous, float32 or bfloat16; table (N, M) int64; rows (T, 4) int64, per query token: its
// sequence, the keys [lo, hi) it may see and its position (ALiBi's distance to key j is
// position − j). Returns out (T, Hq, Dv) and lse (T, Hq), float32. Work is split by query token
// and, where there are few tokens for the threads, by blocks of key/value heads.
template <typename T>
std::vector<at::Tensor> paged_impl(const at::Tensor& q, const at::Tensor& k_pool,
                                   const at::Tensor& v_pool, const at::Tensor& table,
                                   const at::Tensor& rows, const ScoreRules& rules, float scale) {
  const int64_t Tq = q.size(0), Hq = q.size(1), Hkv = k_pool.size(2);
  const PagedCall<T> call{q.const_data_ptr<T>(), k_pool.const_data_ptr<T>(),
                          v_pool.const_data_ptr<T>(), table.const_data_ptr<int64_t>(),
                          rows.const_data_ptr<int64_t>(), Hq, Hkv, q.size(2), v_pool.size(3),
                          table.size(1), k_pool.size(1), scale, rules};
  at::Tensor out = at::empty({Tq, Hq, call.Dv}, q.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({Tq, Hq}, q.options().dtype(at::kFloat));
  float* od = out.data_ptr<float>();
  float* ld = lse.data_ptr<float>();
  const int64_t threads = at::get_num_threads();
  const int64_t blocks =  // at least 4 items per thread where there are few query tokens
      std::clamp<int64_t>((4 * threads + Tq - 1) / std::max<int64_t>(Tq, 1), 1, Hkv);
  const int64_t per_block = (Hkv + blocks - 1) / blocks, g = Hq / Hkv;
  const int64_t keys = call.M * call.page_size;
  at::parallel_for(0, Tq * blocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t heads = per_block * g;
    std::vector<float> s(heads * padded(keys)), acc(heads * call.Dv), query(heads * call.D);
    for (int64_t z = begin; z < end; ++z) {
      const int64_t t = z / blocks, kv0 = (z % blocks) * per_block;
      const int64_t kv1 = std::min(Hkv, kv0 + per_block);
      if (kv0 >= kv1) continue;
      const int64_t first = t * Hq + kv0 * g;
      paged_rows(call, t, kv0, kv1, s.data(), acc.data(), query.data(), od + first * call.Dv,
                 ld + first);
    }
  });
  return {out, lse};
}

// The checked entry point (flash_cpu.cpp binds it): see paged_impl. The caller (qkv.varlen_attn)
// has checked that every page the rows reach lies in the pool.
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
