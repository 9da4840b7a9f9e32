// What a call asks of its scores besides q · kᵀ (the kernel's side of rules.py): the keys each
// query row may see (KeyBounds: the causal rule, a window, packed sequences), soft-capping and
// ALiBi (ScoreRules), applied to one row of scores (modify_row) and differentiated
// (rule_gradients).

#pragma once

#include "program.h"
#include "row_math.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <utility>

namespace {

// The keys each query row may see, [lo, hi): all S keys, causally keys 0 … i + offset, with a
// window from key i + window on, and with ranges (packed sequences) within the row's range too:
// row i of head z sees ranges[z / heads_per_range][i] = (lo, hi), an (R, Lq, 2) int64 tensor.
// An (R, Lq, 3) tensor also gives each row its own ALiBi shift (third column; packed sequences
// of different lengths, each aligned bottom-right, see ScoreRules).
struct KeyBounds {
  bool causal;
  int64_t offset;
  bool windowed;
  int64_t window;
  int64_t S, Lq;
  const int64_t* ranges;  // nullptr: no ranges
  int64_t heads_per_range;
  int64_t width = 2;  // values per row of ranges: 2, or 3 with a shift

  std::pair<int64_t, int64_t> row(int64_t head, int64_t i) const {
    int64_t lo = windowed ? std::clamp<int64_t>(i + window, 0, S) : 0;
    int64_t hi = causal ? std::clamp<int64_t>(i + offset + 1, 0, S) : S;
    if (ranges != nullptr) {
      const int64_t* b = ranges + ((head / heads_per_range) * Lq + i) * width;
      lo = std::max(lo, std::clamp<int64_t>(b[0], 0, S));
      hi = std::min(hi, std::clamp<int64_t>(b[1], 0, S));
    }
    return {lo, hi};
  }

  // Row i's ALiBi shift: its own where the ranges have a third column, else the call's.
  int64_t shift(int64_t head, int64_t i, int64_t call_shift) const {
    if (ranges == nullptr || width < 3) return call_shift;
    return ranges[((head / heads_per_range) * Lq + i) * width + 2];
  }

  // The keys rows first … last of one head may see together, [begin, end): from their first
  // key to their last (causally up to the last row's diagonal); begin ≥ end: none.
  std::pair<int64_t, int64_t> span(int64_t head, int64_t first, int64_t last) const {
    if (ranges == nullptr && !windowed) {  // every row from key 0, the last row the furthest
      const int64_t hi = row(head, last).second;
      return hi > 0 ? std::pair<int64_t, int64_t>{0, hi} : std::pair<int64_t, int64_t>{S, 0};
    }
    int64_t begin = S, end = 0;
    for (int64_t r = first; r <= last; ++r) {
      const auto [lo, hi] = row(head, r);
      if (lo < hi) begin = std::min(begin, lo), end = std::max(end, hi);
    }
    return {begin, end};
  }
};

// The bounds of a call: the causal rule (causal, offset), a window's left edge (windowed,
// window) and ranges (empty: none).
KeyBounds key_bounds(bool causal, int64_t offset, bool windowed, int64_t window, int64_t S,
                     int64_t Lq, const at::Tensor& ranges, int64_t heads_per_range) {
  if (ranges.numel() == 0) return {causal, offset, windowed, window, S, Lq, nullptr, 1};
  TORCH_CHECK(ranges.scalar_type() == at::kLong && ranges.is_contiguous() && ranges.dim() == 3 &&
              ranges.size(1) == Lq && (ranges.size(2) == 2 || ranges.size(2) == 3) &&
              heads_per_range > 0, "ranges: contiguous int64 (R, Lq, 2) or (R, Lq, 3)");
  return {causal, offset, windowed, window, S, Lq, ranges.const_data_ptr<int64_t>(),
          heads_per_range, ranges.size(2)};
}

// What a call adds to q · k: soft-capping and ALiBi. cap = 0: no capping; slopes = nullptr: no
// ALiBi (one slope per query head otherwise); shift = S − Lq aligns the last query with the last
// key, as the causal rule (KeyBounds::shift may give each row its own).
struct ScoreRules {
  float cap;
  const float* slopes;
  int64_t shift;

  bool any() const { return cap != 0.f || slopes != nullptr; }
};

ScoreRules score_rules(double softcap, const at::Tensor& slopes, int64_t heads, int64_t S,
                       int64_t Lq) {
  if (slopes.numel() == 0) return {static_cast<float>(softcap), nullptr, S - Lq};
  TORCH_CHECK(slopes.scalar_type() == at::kFloat && slopes.is_contiguous() &&
              slopes.numel() == heads, "alibi slopes: contiguous float32, one per query head");
  return {static_cast<float>(softcap), slopes.const_data_ptr<float>(), S - Lq};
}

// The score rules of one row whose keys j = 0, 1, … lie at distance d0 − j from its query:
// s_j ← cap · tanh(s_j · scale / cap) − slope · |d0 − j| (cap 0: no capping). biased: the call
// has ALiBi slopes (this row's slope may still be 0, and still has a gradient).
struct RowRules {
  float scale, cap, slope;
  bool biased;
  int64_t d0;
};

// Everything a call asks besides its tensors: the scale of q · kᵀ, the keys each row may see,
// the score rules, and a score_mod / mask_mod program (program.h; nullptr: none).
struct CallRules {
  float scale;
  KeyBounds keys;
  ScoreRules scores;
  const ModProgram* program = nullptr;

  // What a score is multiplied by before 2^x: log2 e times the scale, or log2 e alone where
  // the score rules or the program have scaled it already (modify_row, ModProgram::apply).
  bool scales() const { return scores.any() || program != nullptr; }
  float exponent_scale() const { return scales() ? kLog2E : scale * kLog2E; }

  // The rules of query i of head `head` over keys j0, j0 + 1, …
  RowRules row(int64_t head, int64_t i, int64_t j0) const {
    const float slope = scores.slopes == nullptr ? 0.f : scores.slopes[head];
    const int64_t shift = keys.shift(head, i, scores.shift);
    return {scale, scores.cap, slope, scores.slopes != nullptr, i + shift - j0};
  }
};

// One row of n scores in place, s_j ← cap · tanh(s_j · scale / cap) − slope · |d0 − j| (each
// part only where the row has it): the scaled scores the recurrence then exponentiates in base 2
// (c = log2 e).
template <bool Capped, bool Biased>
inline void modify_row_as(float* s, int64_t n, const RowRules& rule) {
  const float scale = rule.scale, cap = rule.cap, slope = rule.slope;
  const int64_t d0 = rule.d0;
  const Vec vscale(scale), vcap(cap), vinv(Capped ? 1.f / cap : 0.f), vslope(slope);
  // d0 − j in each lane (exact: integers below 2^24), a vector's width less each step
  Vec distance = Vec(static_cast<float>(d0)) - Vec::arange(0.f, 1.f);
  const Vec step(static_cast<float>(kLanes));
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes, distance = distance - step) {
    Vec x = Vec::loadu(s + j);
    if constexpr (Capped) x = vcap * tanh_vec(x * vscale * vinv);
    if constexpr (Capped && Biased) x = x - vslope * distance.abs();
    if constexpr (!Capped && Biased) x = at::vec::fmsub(x, vscale, vslope * distance.abs());
    x.store(s + j);
  }
  for (; j < n; ++j) {
    float x = s[j] * scale;
    if constexpr (Capped) x = cap * tanh_scalar(x * (1.f / cap));
    if constexpr (Biased) x -= slope * static_cast<float>(std::llabs(d0 - j));
    s[j] = x;
  }
}

inline void modify_row(float* s, int64_t n, const RowRules& rule) {
  if (rule.cap != 0.f) {
    if (rule.slope != 0.f) return modify_row_as<true, true>(s, n, rule);
    return modify_row_as<true, false>(s, n, rule);
  }
  if (rule.slope != 0.f) return modify_row_as<false, true>(s, n, rule);
  for (int64_t j = 0; j < n; ++j) s[j] *= rule.scale;  // (no rule: only the scale)
}

// tile_gradients for a row with score rules, its n keys in place: the scores are changed as the
// forward pass changed them (modify_row's function), s' = cap · t − slope · |d| with
// t = tanh(s · scale / cap), then p_j = 2^(s'_j · log2 e − top), ds'_j = p_j (dp_j − delta),
// and ds_j = ds'_j (1 − t_j²) (scale is applied by the caller). Returns Σ_j ds'_j · |d0 − j|, the
// row's part of −dL/d slope (0 without a slope). Capped and Biased (a slope) are template
// arguments, so that neither costs a row that lacks it.
template <bool Capped, bool Biased>
inline float rule_gradients_as(float* p, float* ds, int64_t n, const RowRules& rule, float top,
                               float delta) {
  const Vec vscale(rule.scale), vcap(rule.cap), vinv(Capped ? 1.f / rule.cap : 0.f);
  const Vec vslope(rule.slope), vc(kLog2E), vtop(top), vdelta(delta), lane = Vec::arange(0.f, 1.f);
  Vec distance_sum(0.f);
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t count = std::min(kLanes, n - j);
    Vec x = Vec::loadu(p + j, count) * vscale, t(0.f), distance(0.f);
    if constexpr (Capped) t = tanh_vec(x * vinv), x = vcap * t;
    if constexpr (Biased) {
      distance = (Vec(static_cast<float>(rule.d0 - j)) - lane).abs();
      x = x - vslope * distance;
    }
    const Vec weight = exp2_vec(at::vec::fmsub(x, vc, vtop), kExp2Degree5);
    Vec grad = weight * (Vec::loadu(ds + j, count) - vdelta);
    if constexpr (Biased) {  // (lanes past count hold garbage: left out of the sum)
      distance_sum = distance_sum + Vec::blendv(Vec(0.f), grad * distance, first_lanes(count));
    }
    if constexpr (Capped) grad = grad * (Vec(1.f) - t * t);
    weight.store(p + j, count);
    grad.store(ds + j, count);
  }
  return Biased ? sum_lanes(distance_sum) : 0.f;
}

// rule_gradients_as for the rules a row has (a cap, slopes, or both).
inline float rule_gradients(float* p, float* ds, int64_t n, const RowRules& rule, float top,
                            float delta) {
  if (rule.cap != 0.f && rule.biased) return rule_gradients_as<true, true>(p, ds, n, rule, top, delta);
  if (rule.cap != 0.f) return rule_gradients_as<true, false>(p, ds, n, rule, top, delta);
  return rule_gradients_as<false, true>(p, ds, n, rule, top, delta);
}

}  // namespace
