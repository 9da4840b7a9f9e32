// The math of one row of scores, on ATen's portable vectors: 2^x, tanh, the row's maximum, the
// fused exponentiation pass of the forward recurrence (forward.h) and the backward pass's
// weights and score gradients of one row (backward.h).
//
// Vec is at::vec::Vectorized<float>, which compiles to AVX-512 (16 lanes), AVX2 (8 lanes), NEON
// (4 lanes) or plain C++, as the build's CPU_CAPABILITY says (kernel.py). Every header of the
// kernel is included once, by flash_cpu.cpp: one translation unit, so that the compiler sees
// and inlines all of it (hence the unnamed namespaces).

#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kLog2E = 1.4426950408889634f;

// 2^x for x <= 0 (what the recurrence needs): 2^x = 2^n · 2^f with n = floor(x) and
// f in [0, 1], where a polynomial approximates 2^f. Below −126 the result is 0 (also for −inf);
// NaN stays NaN. Coefficients, highest power first, fitted for least maximum relative error:
// degree 5 is within 2.4e-7 (float32 weights); degree 3 within 7.5e-5, far inside bfloat16's
// rounding (2^-9), for the weights that are rounded to bfloat16 anyway.
constexpr float kExp2Degree5[] = {1.8775767e-03f, 8.9893406e-03f, 5.5826314e-02f,
                                  2.4015363e-01f, 6.9315302e-01f, 1.0f};
constexpr float kExp2Degree3[] = {7.8024521e-02f, 2.2606720e-01f, 6.9583350e-01f, 9.9992520e-01f};

inline float exp2_scalar(float x) {
  if (std::isnan(x)) return x;
  if (x < -126.f) return 0.f;
  const float n = std::floor(x);
  const float f = x - n;
  float p = 0.f;
  for (float coefficient : kExp2Degree5) p = p * f + coefficient;
  return std::ldexp(p, static_cast<int>(n));
}

// The same 2^x on a vector: n = floor(x), f = x − n, and p(f) · 2^n with 2^n made from its
// exponent bits, (n + 127) · 2^23. Lanes below −127 (−inf included) are first raised to −127,
// whose 2^n has all exponent bits 0: 2^n = 0, so below −126 the result is 0 without subnormal
// results. A NaN lane fails the comparison, keeps NaN and gives NaN through p. Above 128 the
// exponent bits overflow: the kernel never uses such lanes (m moves up first; see lag_allowed).
template <int Terms>
inline Vec exp2_vec(Vec x, const float (&coefficients)[Terms]) {
  const Vec lowest(-127.f);
  x = Vec::blendv(x, lowest, x < lowest);
  const Vec n = x.floor();
  const Vec f = x - n;
  Vec p(coefficients[0]);
  for (int i = 1; i < Terms; ++i) p = at::vec::fmadd(p, f, Vec(coefficients[i]));
  constexpr float kOne = 8388608.f;  // 2^23: one step of the exponent field
  const Vec exponent = at::vec::fmadd(n, Vec(kOne), Vec(127.f * kOne));
  return p * at::vec::cast<float>(at::vec::convert_to_int_of_same_size(exponent));
}

// Lanes 0 … count − 1 of a vector (count ≤ kLanes), as a comparison mask.
inline Vec first_lanes(int64_t count) {
  return Vec::arange(0.f, 1.f) < Vec(static_cast<float>(count));
}

inline float sum_lanes(const Vec& x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
}

// tanh(y) to float32 accuracy: the odd Taylor series to y⁹ for |y| < 1/4 (within 1e-8
// relative), else (1 − t) / (1 + t) with t = e^(−2|y|) = 2^(−2|y| log2 e), sign restored.
inline float tanh_scalar(float y) {
  const float a = std::fabs(y);
  if (a < 0.25f) {
    const float y2 = y * y;
    return y * (1.f + y2 * (-1.f / 3 + y2 * (2.f / 15 + y2 * (-17.f / 315 + y2 * (62.f / 2835)))));
  }
  const float t = exp2_scalar(-2.f * kLog2E * a);
  return std::copysign((1.f - t) / (1.f + t), y);
}

// The same tanh on a vector: the series where every lane is below 1/4 (the usual case for a
// large cap such as Gemma's 50), else each lane from its own formula.
inline Vec tanh_vec(const Vec& y) {
  const Vec a = y.abs(), y2 = y * y;
  Vec series(62.f / 2835);
  series = at::vec::fmadd(series, y2, Vec(-17.f / 315));
  series = at::vec::fmadd(series, y2, Vec(2.f / 15));
  series = at::vec::fmadd(series, y2, Vec(-1.f / 3));
  series = y * at::vec::fmadd(series, y2, Vec(1.f));
  const Vec large_lanes = a >= Vec(0.25f);
  if (large_lanes.zero_mask() == (1 << kLanes) - 1) return series;  // no lane at or above 1/4
  const Vec t = exp2_vec(a * Vec(-2.f * kLog2E), kExp2Degree5);
  const Vec large = (Vec(1.f) - t) / (Vec(1.f) + t);  // tanh(|y|)
  const Vec signed_large = Vec::blendv(large, Vec(0.f) - large, y < Vec(0.f));
  return Vec::blendv(series, signed_large, large_lanes);
}

// The running extreme of one row's scores: the largest (Up) or the smallest. NaN is skipped.
template <bool Up>
inline float row_extreme(const float* s, int64_t n) {
  // e where x is NaN or not better. x86's maxps / minps give their second operand where either is
  // NaN (and of two zeros): max(x, e) in one instruction (clamp_min(e, x)); elsewhere a comparison
  // and a blend (NEON's maximum passes NaN on).
  const auto step = [](const Vec& e, const Vec& x) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    return Up ? at::vec::clamp_min(e, x) : at::vec::clamp_max(e, x);
#else
    return Vec::blendv(e, x, Up ? x > e : x < e);
#endif
  };
  const float worst = Up ? kNegInf : -kNegInf;
  // Four running extremes, so that each comparison need not wait for the one before.
  Vec e0(worst), e1 = e0, e2 = e0, e3 = e0;
  int64_t j = 0;
  for (; j + 4 * kLanes <= n; j += 4 * kLanes) {
    e0 = step(e0, Vec::loadu(s + j));
    e1 = step(e1, Vec::loadu(s + j + kLanes));
    e2 = step(e2, Vec::loadu(s + j + 2 * kLanes));
    e3 = step(e3, Vec::loadu(s + j + 3 * kLanes));
  }
  for (; j + kLanes <= n; j += kLanes) e0 = step(e0, Vec::loadu(s + j));
  if (j < n) {  // the last lanes: the rest of the vector is worst
    const int64_t count = n - j;
    e0 = step(e0, Vec::blendv(Vec(worst), Vec::loadu(s + j, count), first_lanes(count)));
  }
  const Vec e = step(step(e0, e1), step(e2, e3));
  // No NaN is left to propagate: the plain comparisons (one instruction each) suffice.
  const auto pick = [](Vec& a, Vec& b) { return Up ? at::vec::clamp_min(a, b) : at::vec::clamp_max(a, b); };
  return at::vec::vec_reduce_all<float>(pick, e);
}

// max_j s_j · c over one row: c times the largest score, or the smallest where c < 0. NaN scores
// are skipped here; they reach p and l below (a row whose scores are all NaN or −inf is caught
// by the caller).
inline float row_max(const float* s, int64_t n, float c) {
  const float top = (c >= 0.f ? row_extreme<true>(s, n) : row_extreme<false>(s, n)) * c;
  return std::isnan(top) ? kNegInf : top;  // no score, or an infinite one times c = 0
}

// Whether any of a row's n scores is NaN: a row with no key to add passes NaN on, not 0.
inline bool any_nan(const float* s, int64_t n) {
  return std::any_of(s, s + n, [](float x) { return std::isnan(x); });
}

// A row's log-sum-exp from its base-2 maximum m and sum l: −inf for a row with no key (l = 0).
inline float row_lse(float m, float l) {
  return l == 0.f ? kNegInf : (m + std::log2(l)) * kLn2;
}

// How far a block's largest exponent may lie above m before m moves up to it: as far as keeps
// its weight 2^top at most 1/8 of the row's sum l (this block's weights included) and at most 2^8,
// so floor(log2 l) − 3, from l's exponent bits, kept within 0 to 8 (8 for an inf or NaN sum).
inline float lag_allowed(float l) {
  uint32_t bits;
  std::memcpy(&bits, &l, sizeof bits);
  const int log2_l = static_cast<int>((bits >> 23) & 0xFF) - 127;
  return static_cast<float>(std::clamp(log2_l - 3, 0, 8));
}

struct Exponentials {
  float sum;  // Σ_j p_j
  float top;  // max_j (s_j · c − m), NaN skipped: above 0, a new maximum
};

// 2^x for weights of type P: float32 weights to float32 precision, bfloat16 ones cheaper.
template <typename P>
inline Vec weight_exp2(const Vec& x) {
  if constexpr (std::is_same_v<P, float>) return exp2_vec(x, kExp2Degree5);
  else return exp2_vec(x, kExp2Degree3);
}

// p_j = 2^(s_j · c − m) written to p (float32 or bfloat16), with their sum and largest exponent.
template <typename P>
inline Exponentials exp_row(const float* s, P* p, int64_t n, float c, float m) {
  const Vec vc(c), vm(m);
  Vec sums(0.f), tops(kNegInf);
  // Exponentials of count ≤ kLanes scores from s + j, added to sums and tops. Lanes past count
  // are −inf: weight 0, and never the top.
  const auto weights = [&](int64_t j, int64_t count) {
    Vec x = at::vec::fmsub(Vec::loadu(s + j, count), vc, vm);
    if (count < kLanes) x = Vec::blendv(Vec(kNegInf), x, first_lanes(count));
    tops = Vec::blendv(tops, x, x > tops);  // tops where x is NaN
    const Vec e = weight_exp2<P>(x);
    sums = sums + e;
    return e;
  };
  int64_t j = 0;
  if constexpr (std::is_same_v<P, float>) {
    for (; j + kLanes <= n; j += kLanes) weights(j, kLanes).store(p + j);
    if (j < n) weights(j, n - j).store(p + j, n - j);
  } else {  // two vectors of weights make one of bfloat16
    for (; j < n; j += 2 * kLanes) {
      const int64_t count = std::min(2 * kLanes, n - j);
      const Vec e0 = weights(j, std::min(kLanes, count));
      const Vec e1 = count > kLanes ? weights(j + kLanes, count - kLanes) : Vec(0.f);
      at::vec::convert_float_bfloat16(e0, e1).store(p + j, count);
    }
  }
  const auto larger = [](Vec& a, Vec& b) { return at::vec::maximum(a, b); };
  return {sum_lanes(sums), at::vec::vec_reduce_all<float>(larger, tops)};
}

// One row of a backward tile, in place: p_j = 2^(s_j · c − top) (the weights, from the row's
// base-2 log-sum-exp top) and ds_j = p_j (dp_j − delta) for the keys the row may see (j < seen),
// both 0 for the rest of the block's n keys.
inline void tile_gradients(float* p, float* ds, int64_t seen, int64_t n, float c, float top,
                           float delta) {
  const Vec vc(c), vtop(top), vdelta(delta);
  for (int64_t j = 0; j < seen; j += kLanes) {
    const int64_t count = std::min(kLanes, seen - j);
    const Vec weight = exp2_vec(at::vec::fmsub(Vec::loadu(p + j, count), vc, vtop), kExp2Degree5);
    weight.store(p + j, count);
    (weight * (Vec::loadu(ds + j, count) - vdelta)).store(ds + j, count);
  }
  std::fill(p + seen, p + n, 0.f);
  std::fill(ds + seen, ds + n, 0.f);
}

}  // namespace
