// Decoding for packed sequences (qkv.varlen_attn): a few query tokens per sequence against its
// keys, which lie either in a pool of pages, (P, page_size, Hkv, D), mapped onto each sequence by
// its row of a block table (key j of sequence s is token j % page_size of page table[s][j /
// page_size]), or packed one sequence after another, (T_k, Hkv, D) (key j of sequence s is packed
// key start[s] + j). Both run decode.h's core in place: nothing is gathered into a contiguous
// copy, the pages of one long sequence are split across threads as a contiguous cache's keys
// are, and a token's key/value heads, which lie side by side, are read together. A paged call
// and a packed one over the same keys run the very same arithmetic.

#pragma once

#include "decode.h"
#include "row_math.h"
#include "rules.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

// Where sequence s's keys lie: pages of a pool through its block table row.
struct Pages {
  const int64_t* table;  // (N, M)
  int64_t M, page_size;

  // (key j's pool token, how many keys from j lie on its page, up to end)
  std::pair<int64_t, int64_t> run(int64_t s, int64_t j, int64_t end) const {
    const int64_t within = j % page_size;
    return {table[s * M + j / page_size] * page_size + within, std::min(end - j, page_size - within)};
  }
};

// Where sequence s's keys lie: packed from key start[s] on.
struct Packed {
  const int64_t* start;  // (N,)

  std::pair<int64_t, int64_t> run(int64_t s, int64_t j, int64_t end) const {
    return {start[s] + j, end - j};
  }
};

// A packed call's layout for decode.h: q (T, Hq, D) contiguous, rows (T, 4) int64 per query token
// (its sequence, the keys [lo, hi) it may see, its position: ALiBi's distance to key j is
// position − j); out (T, Hq, Dv), lse (T, Hq) float32.
template <typename T, typename Source>
struct TokenLayout {
  const T *qd, *kd, *vd;
  float *od, *ld;
  const int64_t* rows;
  Source source;
  int64_t Hq, Hkv, D, Dv, kv_limit;
  int64_t k_key, v_key, k_head, v_head;
  float scale, c;
  bool scored;
  ScoreRules rules;
  std::vector<std::tuple<int64_t, int64_t, int64_t>> segments;

  const T* query(int64_t t, int64_t h) const { return qd + (t * Hq + h) * D; }
  std::pair<int64_t, int64_t> bounds(int64_t t, int64_t) const {
    return {rows[t * 4 + 1], std::max(rows[t * 4 + 1], rows[t * 4 + 2])};
  }
  RowRules rule(int64_t t, int64_t h) const {
    const bool biased = rules.slopes != nullptr;
    return {scale, rules.cap, biased ? rules.slopes[h] : 0.f, biased, rows[t * 4 + 3]};
  }
  float* out(int64_t t, int64_t h) const { return od + (t * Hq + h) * Dv; }
  float* lse(int64_t t, int64_t h) const { return ld + t * Hq + h; }
  KeyRun<T> run(int64_t s, int64_t j, int64_t end) const {
    const auto [token, n] = source.run(s, j, end);
    return {kd + token * k_key, vd + token * v_key, n};
  }
};

// The runs of consecutive query tokens of one sequence: (sequence, first token, end token).
inline std::vector<std::tuple<int64_t, int64_t, int64_t>> token_segments(const int64_t* rows,
                                                                         int64_t T) {
  std::vector<std::tuple<int64_t, int64_t, int64_t>> segments;
  for (int64_t t = 0; t < T; ++t) {
    if (t == 0 || rows[t * 4] != rows[(t - 1) * 4]) segments.emplace_back(rows[t * 4], t, t);
    std::get<2>(segments.back()) = t + 1;
  }
  return segments;
}

// q (T, Hq, D) contiguous; k (·, Hkv, D) and v (·, Hkv, Dv): the pool's tokens or the packed
// keys, rows and heads at any stride; source says where each sequence's keys lie. Returns out
// (T, Hq, Dv) and lse (T, Hq), float32.
template <typename T, typename Source>
std::vector<at::Tensor> tokens_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const Source& source, const at::Tensor& rows,
                                    const ScoreRules& rules, float scale, int64_t splits) {
  const int64_t Tq = q.size(0), Hq = q.size(1), Hkv = k.size(1);
  at::Tensor out = at::empty({Tq, Hq, v.size(2)}, q.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({Tq, Hq}, q.options().dtype(at::kFloat));
  const int64_t* row_data = rows.const_data_ptr<int64_t>();
  const TokenLayout<T, Source> lay{
      q.const_data_ptr<T>(), k.const_data_ptr<T>(), v.const_data_ptr<T>(), out.data_ptr<float>(),
      lse.data_ptr<float>(), row_data, source, Hq, Hkv, q.size(2), v.size(2), Hkv, k.stride(0),
      v.stride(0), k.stride(1), v.stride(1), scale, rules.any() ? kLog2E : scale * kLog2E,
      rules.any(), rules, token_segments(row_data, Tq)};
  if (Tq > 0 && Hq > 0) decode_core<T>(lay, splits);
  return {out, lse};
}

void check_tokens(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& rows) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && rows.is_contiguous(), "q (T, Hq, D) contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type());
  TORCH_CHECK(k.stride(-1) == 1 && v.stride(-1) == 1, "keys and values: contiguous rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2 && rows.size(0) == q.size(0) &&
              rows.size(1) == 4, "rows (T, 4): int64");
  TORCH_CHECK(k.size(-2) > 0 && q.size(1) % k.size(-2) == 0, "heads must group");
  TORCH_CHECK(q.size(2) == k.size(-1), "q and k must agree on D");
}

template <typename Source>
std::vector<at::Tensor> tokens_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const Source& source, const at::Tensor& rows, double scale,
                                    double softcap, const at::Tensor& slopes, int64_t splits) {
  const ScoreRules rules = score_rules(softcap, slopes, q.size(1), 0, 0);
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16)
    return tokens_impl<at::BFloat16>(q, k, v, source, rows, rules, s, splits);
  TORCH_CHECK(q.scalar_type() == at::kFloat, "float32 or bfloat16");
  return tokens_impl<float>(q, k, v, source, rows, rules, s, splits);
}

// The checked entry points (flash_cpu.cpp binds them). paged_decode: pools (P, page_size, Hkv,
// D / Dv) contiguous, table (N, M) int64; the caller (qkv.varlen_attn) has checked that every page
// the rows reach lies in the pool. packed_decode: k (T_k, Hkv, D), v (T_k, Hkv, Dv) with
// contiguous rows, start (N,) int64: each sequence's first packed key. rows, the score rules and
// splits as tokens_impl and decode_core take them.
std::vector<at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_pool,
                                     const at::Tensor& v_pool, const at::Tensor& table,
                                     const at::Tensor& rows, double scale, double softcap,
                                     const at::Tensor& slopes, int64_t splits) {
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.dim() == 4 && k_pool.is_contiguous() &&
              v_pool.is_contiguous(), "pools (P, page_size, Hkv, D), contiguous");
  check_tokens(q, k_pool, v_pool, rows);
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.is_contiguous(),
              "table (N, M): int64");
  TORCH_CHECK(k_pool.sizes().slice(0, 3) == v_pool.sizes().slice(0, 3), "pool shapes must agree");
  const Pages pages{table.const_data_ptr<int64_t>(), table.size(1), k_pool.size(1)};
  const auto tokens = [](const at::Tensor& x) { return x.flatten(0, 1); };
  return tokens_call(q, tokens(k_pool), tokens(v_pool), pages, rows, scale, softcap, slopes, splits);
}

// A decoding step's new keys and values written into a paged pool (qkv.PagedKVCache's step of
// attention_with_cache, whose Python has taken the pages): k (N, Hkv, L, D) and v (N, Hkv, L,
// Dv) with contiguous rows, pools (P, page_size, Hkv, D / Dv) contiguous, all of one dtype; token
// t of entry b goes to slot slots[b·L + t] of page pages[b·L + t]. One row copy per token and
// head, in place of two small tensor copies per entry.
void paged_write(at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& k, const at::Tensor& v,
                 const std::vector<int64_t>& pages, const std::vector<int64_t>& slots) {
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k_pool.dim() == 4 && v_pool.dim() == 4);
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k.stride(3) == 1 &&
              v.stride(3) == 1, "pools contiguous, rows contiguous");
  TORCH_CHECK(k.scalar_type() == k_pool.scalar_type() && v.scalar_type() == v_pool.scalar_type());
  const int64_t N = k.size(0), H = k.size(1), L = k.size(2);
  TORCH_CHECK(k_pool.size(2) == H && k_pool.size(3) == k.size(3) && v_pool.size(3) == v.size(3) &&
              v.sizes().slice(0, 3) == k.sizes().slice(0, 3) &&
              k_pool.sizes().slice(0, 3) == v_pool.sizes().slice(0, 3));
  TORCH_CHECK(static_cast<int64_t>(pages.size()) == N * L && pages.size() == slots.size());
  const int64_t P = k_pool.size(0), page_size = k_pool.size(1);
  for (size_t i = 0; i < pages.size(); ++i)
    TORCH_CHECK(pages[i] >= 0 && pages[i] < P && slots[i] >= 0 && slots[i] < page_size);
  const auto write = [&](at::Tensor& pool, const at::Tensor& x) {
    const int64_t row = x.size(3) * x.element_size();
    char* out = static_cast<char*>(pool.data_ptr());
    const char* in = static_cast<const char*>(x.const_data_ptr());
    for (int64_t b = 0; b < N; ++b)
      for (int64_t t = 0; t < L; ++t) {
        const int64_t place = (pages[b * L + t] * page_size + slots[b * L + t]) * H;
        for (int64_t h = 0; h < H; ++h)
          std::memcpy(out + (place + h) * row,
                      in + (b * x.stride(0) + h * x.stride(1) + t * x.stride(2)) * x.element_size(),
                      row);
      }
  };
  write(k_pool, k);
  write(v_pool, v);
}

std::vector<at::Tensor> packed_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& start, const at::Tensor& rows, double scale,
                                      double softcap, const at::Tensor& slopes, int64_t splits) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(0) == v.size(0) && k.size(1) == v.size(1),
              "k (T_k, Hkv, D) and v (T_k, Hkv, Dv)");
  check_tokens(q, k, v, rows);
  TORCH_CHECK(start.scalar_type() == at::kLong && start.dim() == 1 && start.is_contiguous(),
              "start (N,): int64");
  const Packed packed{start.const_data_ptr<int64_t>()};
  return tokens_call(q, k, v, packed, rows, scale, softcap, slopes, splits);
}

// A 1-D or 2-D int32/int64 tensor's values, or nothing where it is not one (or not contiguous).
inline bool int_values(const at::Tensor& x, int64_t dims, std::vector<int64_t>& out) {
  if (x.dim() != dims || !x.is_contiguous() || x.device().type() != at::kCPU) return false;
  out.resize(x.numel());
  if (x.scalar_type() == at::kLong) {
    std::copy_n(x.const_data_ptr<int64_t>(), x.numel(), out.begin());
  } else if (x.scalar_type() == at::kInt) {
    std::copy_n(x.const_data_ptr<int32_t>(), x.numel(), out.begin());
  } else {
    return false;
  }
  return true;
}

// Sequence i's query token rows (sequence, lo, hi, position) as sequences.py's rows gives them,
// causal bottom-right or no rule, written from row on: lq query tokens against lk keys. False
// where the whole path would reject the lengths.
inline bool plain_rows(int64_t i, int64_t lq, int64_t lk, int64_t max_q, int64_t max_k,
                       bool causal, int64_t*& row) {
  if (lq < 0 || lq > max_q || lk < 0 || lk > max_k) return false;
  for (int64_t j = 0; j < lq; ++j, row += 4) {
    const int64_t p = lk - lq + j;  // the token's position among its sequence's keys
    row[0] = i, row[1] = 0, row[2] = causal ? std::clamp(p + 1, int64_t{0}, lk) : lk, row[3] = p;
  }
  return true;
}

// Plain decoding calls of qkv.varlen_attn (its lengths, max_q, max_k, causal and scale, nothing
// more; backends/flash/varlen.py's plain has checked the tensors' kinds and shapes): every check
// the whole path makes of cu_seq_q (N + 1,), seqused_k (N,) and the block table (N, M) of a
// paged call, or of cu_seq_q and cu_seq_k of a packed one, made here as a test, and each query
// token's row built; then they are paged_decode and packed_decode. They return (out, lse), or
// nothing where a check fails (or a packed sequence has `queries` query tokens or more, which the
// whole path runs on the block kernel): the caller then takes the whole path, which names the
// error. (A decoding step comes once per layer per token; here its checks cost no tensor
// operations.)
std::vector<at::Tensor> plain_paged_decode(const at::Tensor& q, const at::Tensor& k_pool,
                                           const at::Tensor& v_pool, const at::Tensor& cu_seq_q,
                                           const at::Tensor& seqused_k, const at::Tensor& table,
                                           int64_t max_q, int64_t max_k, bool causal,
                                           double scale, int64_t splits) {
  std::vector<int64_t> cu, used, pages;
  const int64_t T = q.size(0), N = table.size(0), M = table.size(1);
  const int64_t P = k_pool.size(0), page_size = k_pool.size(1);
  if (!int_values(cu_seq_q, 1, cu) || !int_values(seqused_k, 1, used) ||
      !int_values(table, 2, pages) || static_cast<int64_t>(cu.size()) != N + 1 ||
      static_cast<int64_t>(used.size()) != N || N == 0 || T == 0 || page_size == 0 ||
      cu[0] != 0 || cu[N] != T)
    return {};
  at::Tensor rows = at::empty({T, 4}, table.options().dtype(at::kLong));
  int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) {
    const int64_t lk = used[i], held = (lk + page_size - 1) / page_size;
    if (!plain_rows(i, cu[i + 1] - cu[i], lk, max_q, max_k, causal, row) || held > M) return {};
    for (int64_t j = 0; j < held; ++j)
      if (pages[i * M + j] < 0 || pages[i * M + j] >= P) return {};
  }
  const at::Tensor table64 = table.scalar_type() == at::kLong ? table : table.to(at::kLong);
  const at::Tensor no_slopes = at::empty({0}, q.options().dtype(at::kFloat));
  return paged_decode(q, k_pool, v_pool, table64, rows, scale, 0.0, no_slopes, splits);
}

std::vector<at::Tensor> plain_packed_decode(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const at::Tensor& cu_seq_q,
                                            const at::Tensor& cu_seq_k, int64_t max_q,
                                            int64_t max_k, int64_t queries, bool causal,
                                            double scale, int64_t splits) {
  std::vector<int64_t> cq, ck;
  const int64_t T = q.size(0), N = static_cast<int64_t>(cu_seq_q.numel()) - 1;
  if (!int_values(cu_seq_q, 1, cq) || !int_values(cu_seq_k, 1, ck) || N < 1 ||
      static_cast<int64_t>(ck.size()) != N + 1 || T == 0 || cq[0] != 0 || ck[0] != 0 ||
      cq[N] != T || ck[N] != k.size(0))
    return {};
  at::Tensor rows = at::empty({T, 4}, cu_seq_q.options().dtype(at::kLong));
  at::Tensor start = at::empty({N}, cu_seq_q.options().dtype(at::kLong));
  int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) {
    const int64_t lq = cq[i + 1] - cq[i];
    if (lq >= queries || !plain_rows(i, lq, ck[i + 1] - ck[i], max_q, max_k, causal, row))
      return {};
    start.data_ptr<int64_t>()[i] = ck[i];
  }
  const at::Tensor no_slopes = at::empty({0}, q.options().dtype(at::kFloat));
  return packed_decode(q.contiguous(), k, v, start, rows, scale, 0.0, no_slopes, splits);
}

}  // namespace
