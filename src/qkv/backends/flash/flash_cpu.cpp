// qkv's compiled flash forward for CPUs: the tiled online-softmax recurrence of flash.py's
// module docstring, one query block of one head at a time, with the block's running m, l and acc
// kept in cache-sized buffers.
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
// diagonal, and with ranges (a window, packed sequences) those before its rows' first keys too.
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

// The vector passes (maxima, the fused exponentiation pass, the decoding path's dot products and
// weighted sums) are written on ATen's portable vector type at::vec::Vectorized<float>, which
// compiles to AVX-512 (16 lanes), AVX2 (8 lanes), NEON (4 lanes) or plain C++, as the build's
// CPU_CAPABILITY says (kernel.py).
//
// float32 matrix products run on the kernel's own register tiles (product_tiles, on kᵀ packed
// in panels and V as it lies), or on at::native::cpublas::brgemm, torch's small-matrix kernel (oneDNN's
// micro-kernels), which kernel.py picks for builds with 512-bit vectors, or torch's BLAS (see
// Products). bfloat16 products go through cpublas::brgemm on the CPU's bfloat16 matrix units
// (AMX) or its AVX-512 bfloat16 dot products, with float32 sums, and need each key block in
// pairs-of-rows ("VNNI") order (Arranged). Where the CPU has neither, bfloat16 inputs
// are widened to float32 by the caller and take the float32 path (kernel.py's
// bfloat16_products()). Scores, softmax and accumulation are float32 in every case; the weights
// that are rounded to bfloat16 for the product come from a cheaper 2^x (within 7.5e-5 relative).
//
// Inputs: q (NG, Lq, D), k (N, S, D), v (N, S, Dv), contiguous, all float32 or all bfloat16;
// query head i uses key/value head i / (NG / N) (grouped-query heads, K/V never repeated).
// Returns out (NG, Lq, Dv) and lse (NG, Lq), float32.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kQueryBlock = 128;  // rows per block: big enough for the matrix units
constexpr int64_t kKeyBlock = 512;    // keys per block: (Bq, Bk) float32 scores fit in L2
// Where the query blocks read each key at most this many times on average, key blocks are
// packed for the products as they are read, not all at once (Arranged).
constexpr int64_t kPackPerBlock = 3;
// Row strides of the score and weight buffers: a little over a power of two bytes, so that
// the rows a matrix tile touches do not all fall into the same few cache sets, and whole cache
// lines (2112 and 1088 bytes for bfloat16), so that in a buffer that starts on a line (Scratch)
// each row a tile reads or writes does too.
constexpr int64_t kScoreStride = kKeyBlock + 16, kWeightStride = kKeyBlock + 32;
// A thread's scratch buffers (scores, weights, acc) start on a cache line, and are not zeroed
// (every element is written before it is read; zeroing them cost short calls up to a fifth of
// their time). std::vector's allocator promises only 16 bytes; with the score and weight rows
// 16 or 32 bytes off a line (each row a tile reads or writes, each vector of the
// exponentiation pass then spans two lines), the bfloat16 kernel took 13–28 % longer at
// T = 4096 (docs/performance.md).
template <typename T>
struct LineAligned {
  using value_type = T;
  static constexpr std::size_t kLine = 64;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(std::size_t n) {
    const std::size_t bytes = (n * sizeof(T) + kLine - 1) / kLine * kLine;
    if (void* p = std::aligned_alloc(kLine, bytes)) return static_cast<T*>(p);
    throw std::bad_alloc();
  }
  void deallocate(T* p, std::size_t) { std::free(p); }
  template <typename U>
  void construct(U* p) noexcept {  // default-initialised: left as allocated
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
template <typename T>
using Scratch = std::vector<T, LineAligned<T>>;

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

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
// The register tiles of the kernel's own products (product_tiles).
constexpr int kTileVectors = 2;
constexpr int kTileRows = kLanes >= 16 ? 12 : 6;  // 32 registers (AVX-512) or 16 (AVX2)
constexpr int64_t kPanel = kTileVectors * kLanes;   // columns of one register tile

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

// What a call adds to q · k: soft-capping and ALiBi. cap = 0: no capping; slopes = nullptr: no
// ALiBi (one slope per query head otherwise); shift = S − Lq aligns the last query with the last
// key, as the causal rule.
struct ScoreRules {
  float cap;
  const float* slopes;
  int64_t shift;

  bool any() const { return cap != 0.f || slopes != nullptr; }
};

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

// One row of n scores in place, keys j = 0 … n − 1 at distance d0 − j from the query:
// s_j ← cap · tanh(s_j · scale / cap) − slope · |d0 − j| (each part only where the call has it),
// the scaled scores the recurrence then exponentiates in base 2 (c = log2 e).
template <bool Capped, bool Biased>
inline void modify_row_as(float* s, int64_t n, float scale, float cap, float slope, int64_t d0) {
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

inline void modify_row(float* s, int64_t n, float scale, float cap, float slope, int64_t d0) {
  if (cap != 0.f) {
    if (slope != 0.f) return modify_row_as<true, true>(s, n, scale, cap, slope, d0);
    return modify_row_as<true, false>(s, n, scale, cap, slope, d0);
  }
  if (slope != 0.f) return modify_row_as<false, true>(s, n, scale, cap, slope, d0);
  for (int64_t j = 0; j < n; ++j) s[j] *= scale;  // (no rule: only the scale)
}

// The running extreme of one row's scores: the largest (Up) or the smallest. NaN is skipped.
template <bool Up>
inline float row_extreme(const float* s, int64_t n) {
  // e where x is NaN (the comparison fails) or not better
  const auto step = [](const Vec& e, const Vec& x) { return Vec::blendv(e, x, Up ? x > e : x < e); };
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
  for (; j < n; j += kLanes) {  // the last lanes: the rest of the vector is worst
    const int64_t count = std::min(kLanes, n - j);
    e0 = step(e0, Vec::blendv(Vec(worst), Vec::loadu(s + j, count), first_lanes(count)));
  }
  const Vec e = step(step(e0, e1), step(e2, e3));
  const auto pick = [](Vec& a, Vec& b) { return Up ? at::vec::maximum(a, b) : at::vec::minimum(a, b); };
  return at::vec::vec_reduce_all<float>(pick, e);  // no NaN left to propagate
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

// tile_gradients for a call with score rules, keys j = 0 … n − 1 at distance d0 − j from the
// query: the scores are changed as the forward pass changed them (modify_row's function),
// s' = cap · t − slope · |d| with t = tanh(s · scale / cap), then p_j = 2^(s'_j · log2 e − top),
// ds'_j = p_j (dp_j − delta), and ds_j = ds'_j (1 − t_j²) (scale is applied by the caller).
// Returns Σ_j ds'_j · |d0 − j|, the row's part of −dL/d slope (0 without a slope). Capped and
// Biased (a slope) are template arguments, so that neither costs a row that lacks it.
template <bool Capped, bool Biased>
inline float rule_gradients(float* p, float* ds, int64_t n, float scale, float cap, float slope,
                            int64_t d0, float top, float delta) {
  const Vec vscale(scale), vcap(cap), vinv(Capped ? 1.f / cap : 0.f), vslope(slope);
  const Vec vc(kLog2E), vtop(top), vdelta(delta), lane = Vec::arange(0.f, 1.f);
  Vec distance_sum(0.f);
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t count = std::min(kLanes, n - j);
    Vec x = Vec::loadu(p + j, count) * vscale, t(0.f), distance(0.f);
    if constexpr (Capped) t = tanh_vec(x * vinv), x = vcap * t;
    if constexpr (Biased) {
      distance = (Vec(static_cast<float>(d0 - j)) - lane).abs();
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

// rule_gradients for the rules a call has (a cap, slopes, or both).
inline float rule_gradients_of(const ScoreRules& rules, float* p, float* ds, int64_t n,
                               float scale, float slope, int64_t d0, float top, float delta) {
  // (a slope of 0 still has a gradient: Biased wherever the call has slopes)
  if (rules.cap != 0.f && rules.slopes != nullptr)
    return rule_gradients<true, true>(p, ds, n, scale, rules.cap, slope, d0, top, delta);
  if (rules.cap != 0.f)
    return rule_gradients<true, false>(p, ds, n, scale, rules.cap, slope, d0, top, delta);
  return rule_gradients<false, true>(p, ds, n, scale, rules.cap, slope, d0, top, delta);
}

// Keys and values in the order the products read them, per key block:
//   float32, own tiles: kᵀ in column panels of kPanel columns, zero-padded (⌈n / kPanel⌉, D,
//             kPanel) (pack_transposed); v as given (its rows are the panels' rows, kDepth of
//             them at a time).
//   float32, otherwise: kᵀ (D, n), its rows ld apart (transpose_rows); v as given.
//   bfloat16: kᵀ (D, Bk) and v (Bk, Dv) in pairs-of-rows order (pack_pairs): element (r, c) of
//             a (R, C) matrix at [(r / 2) · C + c] · 2 + r % 2, zero-padded to what the
//             products read: kᵀ to a whole 32-key group, v to an even number of rows (the rest
//             of a short block is left unwritten).
// Where the query blocks read each key many times (long full or causal calls), a call arranges
// all its keys once (arrange). Where they read each key at most kPackPerBlock times on average
// (packed sequences, windows, short calls), each query block packs the key blocks it reads into
// its thread's buffers instead (Arranged::per_block): the packed keys are then still in the
// cache when the products read them, and no buffer the size of k is allocated (a fresh 32 MiB
// costs 10 ms of page faults). Measured on an AVX-512 CPU, one thread: 64 packed documents of
// 256 tokens at T = 16384 took 22 % less time, window 256 17 % less; a full T = 512 call, whose
// four query blocks each read every key, 4 % more, so it arranges once.

// One head's x (S, D) as xᵀ in column panels, zero-padded: (⌈S / kPanel⌉, D, kPanel), the
// layout product_tiles reads kᵀ from.
void pack_transposed(const float* x, int64_t S, int64_t D, float* to) {
  for (int64_t j0 = 0; j0 < S; j0 += kPanel, to += D * kPanel)
    for (int64_t c = 0; c < kPanel; ++c) {
      const float* row = x + (j0 + c) * D;
      for (int64_t d = 0; d < D; ++d) to[d * kPanel + c] = j0 + c < S ? row[d] : 0.f;
    }
}

// n rows of x (n, D) as xᵀ (D, n), rows ld apart: ATen's transpose (16 × 16 tiles in vector
// registers with AVX-512, element by element elsewhere) on 64 rows at a time, which stay in L1
// (at::Tensor::contiguous() of the transposed view ran at 2 ns an element: a fifth of a
// packed call at T = 16384). x holds float32, or 32-bit words (pairs of bfloat16) as float32
// bits, which the transpose only moves.
void transpose_rows(const float* x, int64_t n, int64_t D, float* to, int64_t ld) {
  constexpr int64_t kTile = 64;
  for (int64_t j0 = 0; j0 < n; j0 += kTile) {
    const int rows = static_cast<int>(std::min(kTile, n - j0));
    at::vec::transpose_mxn<float>(x + j0 * D, D, to + j0, ld, rows, static_cast<int>(D));
  }
}

// n ≤ kKeyBlock keys kh (n, D) and values vh (n, Dv) of one head into kb and vb in the
// bfloat16 products' pairs-of-rows order.
template <typename T>
void pack_pairs(const T* kh, const T* vh, int64_t n, int64_t D, int64_t Dv, T* kb, T* vb) {
  const int64_t De = (D + 1) / 2 * 2;
  if (D % 2 == 0) {
    // A pair (k[j][2i], k[j][2i+1]) is one 32-bit word, which goes to row i, column j:
    // a transpose of 32-bit words.
    const int64_t pairs = D / 2;
    transpose_rows(reinterpret_cast<const float*>(kh), n, pairs, reinterpret_cast<float*>(kb),
                   kKeyBlock);
    auto* to = reinterpret_cast<uint32_t*>(kb);
    const int64_t n32 = std::min(kKeyBlock, (n + 31) / 32 * 32);
    for (int64_t i = 0; i < pairs; ++i)
      std::fill(to + i * kKeyBlock + n, to + i * kKeyBlock + n32, 0u);
  } else {
    for (int64_t d = 0; d < De; ++d)  // kᵀ: row d, column j
      for (int64_t j = 0; j < kKeyBlock; ++j)
        kb[((d / 2) * kKeyBlock + j) * 2 + d % 2] = (j < n && d < D) ? kh[j * D + d] : T(0.f);
  }
  // v: rows j and j + 1 interleaved, element by element, into row j / 2.
  const auto* bits = reinterpret_cast<const uint16_t*>(vh);
  auto* pairs = reinterpret_cast<uint32_t*>(vb);
  for (int64_t j = 0; j < n; j += 2) {
    const uint16_t* even = bits + j * Dv;
    const uint16_t* odd = even + Dv;
    uint32_t* row = pairs + (j / 2) * Dv;
    if (j + 1 < n) {
#pragma omp simd
      for (int64_t e = 0; e < Dv; ++e) row[e] = uint32_t(odd[e]) << 16 | even[e];
    } else {
      for (int64_t e = 0; e < Dv; ++e) row[e] = even[e];
    }
  }
}

// Where the products read keys k0 … k0 + n − 1 of key/value head kv: kᵀ (rows ldk apart, or
// panels) and v.
template <typename T>
struct BlockOperands {
  const T* keys;
  int64_t ldk;
  const T* values;
};

// The keys and values of a call as the products read them: all arranged once (arrange), or
// each key block packed into the reading thread's buffers when it is read (per_block).
template <typename T>
struct Arranged {
  static constexpr bool kLow = std::is_same_v<T, at::BFloat16>;
  const T* k;  // as given: (N, S, D), (N, S, Dv)
  const T* v;
  int64_t S, D, Dv;
  bool panels, per_block;
  at::Tensor keys, values;  // arranged once (not per_block)

  // Keys (and values) k0 … k0 + n − 1 of head kv where the products read them; per_block, packed
  // into key_buffer and value_buffer first. Arranged once, k0 is a multiple of alignment().
  BlockOperands<T> block(int64_t kv, int64_t k0, int64_t n, T* key_buffer, T* value_buffer) const {
    const T* kh = k + (kv * S + k0) * D;
    const T* vh = v + (kv * S + k0) * Dv;
    if (per_block) {
      if constexpr (kLow) {
        pack_pairs(kh, vh, n, D, Dv, key_buffer, value_buffer);
        return {key_buffer, kKeyBlock, value_buffer};
      } else {
        if (panels) pack_transposed(kh, n, D, key_buffer);
        else transpose_rows(kh, n, D, key_buffer, kKeyBlock);
        return {key_buffer, panels ? kPanel : kKeyBlock, vh};
      }
    }
    if constexpr (kLow) {
      const int64_t z = kv * key_blocks() + k0 / kKeyBlock, De = (D + 1) / 2 * 2;
      return {keys.const_data_ptr<T>() + z * De * kKeyBlock, kKeyBlock,
              values.const_data_ptr<T>() + z * kKeyBlock * Dv};
    } else {
      if (panels) return {keys.const_data_ptr<T>() + (kv * key_blocks() * kKeyBlock + k0) * D,
                          kPanel, vh};
      return {keys.const_data_ptr<T>() + kv * D * S + k0, S, vh};
    }
  }
  int64_t key_blocks() const { return (S + kKeyBlock - 1) / kKeyBlock; }
  // Where a block of keys may start: anywhere when packed per block, else on the arranged
  // blocks (bfloat16) or panels (the tiles' kᵀ).
  int64_t alignment() const { return per_block ? 1 : kLow ? kKeyBlock : panels ? kPanel : 1; }
  // Elements of a thread's key and value buffers (per_block).
  int64_t key_buffer_size() const { return per_block ? ((D + 1) / 2 * 2) * kKeyBlock : 0; }
  int64_t value_buffer_size() const { return per_block && kLow ? kKeyBlock * Dv : 0; }
};

// Each key block arranged once, all heads' blocks in parallel: (N, key blocks, kKeyBlock · D)
// for panels and bfloat16 (values too), (N, D, S) for kᵀ.
template <typename T>
Arranged<T> arrange(const at::Tensor& k, const at::Tensor& v, bool panels, bool per_block) {
  const int64_t N = k.size(0), S = k.size(1), D = k.size(2), Dv = v.size(2);
  Arranged<T> a{k.const_data_ptr<T>(), v.const_data_ptr<T>(), S, D, Dv, panels, per_block, {}, {}};
  if (per_block) return a;
  const int64_t blocks = a.key_blocks(), De = (D + 1) / 2 * 2;
  a.keys = Arranged<T>::kLow ? at::empty({N, blocks, De * kKeyBlock}, k.options())
            : panels        ? at::empty({N, blocks, D * kKeyBlock}, k.options())
                            : at::empty({N, D, S}, k.options());
  if (Arranged<T>::kLow) a.values = at::empty({N, blocks, kKeyBlock * Dv}, v.options());
  T* kp = a.keys.template data_ptr<T>();
  at::parallel_for(0, N * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t z = begin; z < end; ++z) {
      const int64_t h = z / blocks, n0 = (z % blocks) * kKeyBlock;
      const int64_t n = std::min(kKeyBlock, S - n0);
      const T* kh = a.k + (h * S + n0) * D;
      if constexpr (Arranged<T>::kLow) {
        pack_pairs(kh, a.v + (h * S + n0) * Dv, n, D, Dv, kp + z * De * kKeyBlock,
                   a.values.template data_ptr<T>() + z * kKeyBlock * Dv);
      } else if (panels) {
        pack_transposed(kh, n, D, kp + z * D * kKeyBlock);
      } else {
        transpose_rows(kh, n, D, kp + h * D * S + n0, S);
      }
    }
  });
  return a;
}

// The keys each query row may see, [lo, hi). Without ranges: all S keys, or causally keys
// 0 … i + offset. With ranges (a window, packed sequences; the causal rule already in them):
// row i of head z sees ranges[z / heads_per_range][i] = (lo, hi), an (R, Lq, 2) int64 tensor.
struct KeyBounds {
  bool causal;
  int64_t offset, S, Lq;
  const int64_t* ranges;  // nullptr: no ranges
  int64_t heads_per_range;

  std::pair<int64_t, int64_t> row(int64_t head, int64_t i) const {
    if (ranges != nullptr) {
      const int64_t* b = ranges + ((head / heads_per_range) * Lq + i) * 2;
      return {std::clamp<int64_t>(b[0], 0, S), std::clamp<int64_t>(b[1], 0, S)};
    }
    return {0, causal ? std::clamp<int64_t>(i + offset + 1, 0, S) : S};
  }

  // The keys rows first … last of one head may see together, [begin, end): from their first
  // key to their last (causally up to the last row's diagonal); begin ≥ end: none.
  std::pair<int64_t, int64_t> span(int64_t head, int64_t first, int64_t last) const {
    if (ranges == nullptr) {  // every row from key 0, the last row the furthest
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

KeyBounds key_bounds(bool causal, int64_t offset, int64_t S, int64_t Lq, const at::Tensor& ranges,
                     int64_t heads_per_range) {
  if (ranges.numel() == 0) return {causal, offset, S, Lq, nullptr, 1};
  TORCH_CHECK(ranges.scalar_type() == at::kLong && ranges.is_contiguous() && ranges.dim() == 3 &&
              ranges.size(1) == Lq && ranges.size(2) == 2 && heads_per_range > 0,
              "ranges: contiguous int64 (R, Lq, 2)");
  return {causal, offset, S, Lq, ranges.const_data_ptr<int64_t>(), heads_per_range};
}

ScoreRules score_rules(double softcap, const at::Tensor& slopes, int64_t heads, int64_t S,
                       int64_t Lq) {
  if (slopes.numel() == 0) return {static_cast<float>(softcap), nullptr, S - Lq};
  TORCH_CHECK(slopes.scalar_type() == at::kFloat && slopes.is_contiguous() &&
              slopes.numel() == heads, "alibi slopes: contiguous float32, one per query head");
  return {static_cast<float>(softcap), slopes.const_data_ptr<float>(), S - Lq};
}

// c (M, N) = a (M, K) · b (K, N), or c += a · b (add), float32, rows with leading dims lda, ldb,
// ldc, on the vector units: c is cut into register tiles of kTileRows rows × kTileVectors
// vectors, each summed over all K in registers (kTileRows · kTileVectors accumulators, as many as
// the ISA's registers hold besides the b vectors and the broadcast a value), then written once.
// Column panels go outermost, so that the b panel one column strip reads (K × a tile's width)
// stays in the L1 cache while every row tile runs over it.

// One register tile: Rows rows of a, Columns = kTileVectors · kLanes columns of b, of which the
// first `width` count (Partial: fewer than all; the last vector is read and written in part).
template <int Rows, bool Partial>
inline void product_tile(int64_t K, int64_t width, const float* a, int64_t lda, int64_t step,
                         const float* b, int64_t ldb, float* c, int64_t ldc, bool add) {
  const auto load = [&](const float* x, int v) {
    return Partial && (v + 1) * kLanes > width ? Vec::loadu(x, std::max<int64_t>(0, width - v * kLanes))
                                               : Vec::loadu(x);
  };
  Vec acc[Rows][kTileVectors];
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < kTileVectors; ++v)
      acc[r][v] = add ? load(c + r * ldc + v * kLanes, v) : Vec(0.f);
  for (int64_t d = 0; d < K; ++d) {
    Vec bv[kTileVectors];
    for (int v = 0; v < kTileVectors; ++v) bv[v] = load(b + d * ldb + v * kLanes, v);
    for (int r = 0; r < Rows; ++r) {
      const Vec ar(a[r * lda + d * step]);
      for (int v = 0; v < kTileVectors; ++v) acc[r][v] = at::vec::fmadd(ar, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < kTileVectors; ++v) {
      const int64_t left = width - v * kLanes;
      if (!Partial || left >= kLanes) acc[r][v].store(c + r * ldc + v * kLanes);
      else if (left > 0) acc[r][v].store(c + r * ldc + v * kLanes, left);
    }
}

// product_tile for the rows left below the last whole row tile (fewer than kTileRows).
template <bool Partial, int Rows = kTileRows - 1>
inline void product_rest(int64_t rows, int64_t K, int64_t width, const float* a, int64_t lda,
                         int64_t step, const float* b, int64_t ldb, float* c, int64_t ldc,
                         bool add) {
  if constexpr (Rows > 0) {
    if (rows == Rows)
      return product_tile<Rows, Partial>(K, width, a, lda, step, b, ldb, c, ldc, add);
    product_rest<Partial, Rows - 1>(rows, K, width, a, lda, step, b, ldb, c, ldc, add);
  }
}

template <bool Partial>
inline void product_panel(int64_t M, int64_t K, int64_t width, const float* a, int64_t lda,
                          int64_t step, const float* b, int64_t ldb, float* c, int64_t ldc,
                          bool add) {
  int64_t r = 0;
  for (; r + kTileRows <= M; r += kTileRows)
    product_tile<kTileRows, Partial>(K, width, a + r * lda, lda, step, b, ldb, c + r * ldc, ldc,
                                     add);
  if (r < M)
    product_rest<Partial>(M - r, K, width, a + r * lda, lda, step, b, ldb, c + r * ldc, ldc, add);
}

// a's element (r, d) is at a[r · lda + d · step] (step 1: row-major; lda 1: a transposed).
// b comes in column panels of kPanel columns, panel i at b + i · panel_stride, its rows ldb apart
// (arrange packs kᵀ so, each panel contiguous and the last one zero-padded; a row-major
// matrix, such as v, is such panels with panel_stride kPanel).
// The sum over K goes kDepth rows of b at a time, so that the part of b one pass reads stays in
// the L1 cache (in p · v, K is up to 512 keys: the products waited on the L2 cache). Where that
// part is small (p · v: kDepth × Dv values), each row tile runs over all of it before the next
// starts, so that its rows of a are read once; otherwise (q · kᵀ: D × 512) each panel meets
// all row tiles before the next panel is read.
constexpr int64_t kDepth = 128;
constexpr int64_t kL1Floats = 8192;  // 32 KiB: most of an L1 data cache

inline void product_tiles(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda,
                          int64_t step, const float* b, int64_t ldb, int64_t panel_stride,
                          float* c, int64_t ldc, bool add) {
  for (int64_t d0 = 0; d0 < K; d0 += kDepth) {
    const int64_t depth = std::min(kDepth, K - d0);
    const bool sum = add || d0 > 0;
    // Rows of a (from a_rows) times every panel of this part of b, into c_rows.
    const auto panels = [&](int64_t rows, const float* a_rows, float* c_rows) {
      const float* panel = b + d0 * ldb;
      int64_t j = 0;
      for (; j + kPanel <= N; j += kPanel, panel += panel_stride)
        product_panel<false>(rows, depth, kPanel, a_rows, lda, step, panel, ldb, c_rows + j, ldc,
                             sum);
      if (j < N)
        product_panel<true>(rows, depth, N - j, a_rows, lda, step, panel, ldb, c_rows + j, ldc,
                            sum);
    };
    if (N * depth > kL1Floats) {
      panels(M, a + d0 * step, c);
      continue;
    }
    for (int64_t r = 0; r < M; r += kTileRows)
      panels(std::min<int64_t>(kTileRows, M - r), a + r * lda + d0 * step, c + r * ldc);
  }
}

// Where the kernel's float32 products run (kernel.py's GEMM): its own register tiles
// (product_tiles, on kᵀ packed in panels), cpublas::brgemm (oneDNN's micro-kernels from AVX2
// up, torch's own gemm where there are none) or torch's matrix multiply (MKL or OpenBLAS for the
// ISA the CPU has, one thread inside the kernel's threads) on tensors that view the buffers.
enum class Products : int64_t { kTiles = 0, kBrgemm = 1, kBlas = 2 };

// product_tiles' alternatives (plain row-major b).
inline void product(Products path, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
                    int64_t ldc, bool add, const float* a, const float* b, float* c) {
  if (path == Products::kBrgemm)
    return at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, a, b, c, false);
  const auto view = [](const float* x, int64_t rows, int64_t columns, int64_t ld) {
    return at::from_blob(const_cast<float*>(x), {rows, columns}, {ld, 1}, at::kFloat);
  };
  at::Tensor result = view(c, M, N, ldc);
  if (add) {
    at::addmm_out(result, result, view(a, M, K, lda), view(b, K, N, ldb));
  } else {
    at::mm_out(result, view(a, M, K, lda), view(b, K, N, ldb));
  }
}

template <typename T>
std::vector<at::Tensor> forward_impl(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal,
    const KeyBounds& bounds, const ScoreRules& rules, Products path) {
  constexpr bool low = std::is_same_v<T, at::BFloat16>;
  using P = std::conditional_t<low, T, float>;  // the weights' type
  const int64_t NG = q.size(0), Lq = q.size(1), D = q.size(2);
  const int64_t N = k.size(0), S = k.size(1), Dv = v.size(2);
  const int64_t g = NG / N;
  const int64_t De = low ? (D + 1) / 2 * 2 : D;  // q's row length as the products read it
  const int64_t query_blocks = (Lq + kQueryBlock - 1) / kQueryBlock;
  // Soft-capped or biased scores are scaled before they are changed (modify_row): then only
  // log2(e) is left to multiply them by.
  const float c = rules.any() ? kLog2E : static_cast<float>(scale) * kLog2E;

  auto out = at::empty({NG, Lq, Dv}, q.options().dtype(at::kFloat));
  auto lse = at::empty({NG, Lq}, q.options().dtype(at::kFloat));
  at::Tensor q_even = q;  // bfloat16 products need an even feature count
  if (low && De != D) q_even = at::constant_pad_nd(q, {0, 1});
  const T* qd = q_even.const_data_ptr<T>();
  float* od = out.data_ptr<float>();
  float* ld = lse.data_ptr<float>();

  // The keys each block may see (KeyBounds::span); key blocks outside are skipped.
  const int64_t blocks = NG * query_blocks;
  std::vector<std::pair<int64_t, int64_t>> spans(blocks);
  int64_t reads = 0;  // keys read, over all blocks
  for (int64_t head = 0; head < NG; ++head)
    for (int64_t i = 0; i < query_blocks; ++i) {
      const int64_t last = std::min(Lq, (i + 1) * kQueryBlock) - 1;
      const auto [begin, end] = spans[head * query_blocks + i] =
          bounds.span(head, i * kQueryBlock, last);
      reads += std::max<int64_t>(0, end - begin);
    }
  // Keys read by at most kPackPerBlock query blocks each, on average, are packed as they are read.
  const bool per_block = reads <= kPackPerBlock * N * S;
  const Arranged<T> keys = arrange<T>(k, v, path == Products::kTiles, per_block);

  // Blocks are handed out one at a time, so a core that runs slower (another process on it)
  // takes fewer; causal blocks go longest first, so none is left alone at the end.
  std::atomic<int64_t> next_block{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch<float> scores(kQueryBlock * kScoreStride), acc(kQueryBlock * Dv);
    std::vector<float> m(kQueryBlock), l(kQueryBlock);
    Scratch<P> weights(kQueryBlock * kWeightStride);
    Scratch<T> key_buffer(keys.key_buffer_size()), value_buffer(keys.value_buffer_size());
    for (int64_t z; (z = next_block.fetch_add(1)) < blocks;) {
      const int64_t head = z / query_blocks, i = z % query_blocks;
      const int64_t q0 = (causal ? query_blocks - 1 - i : i) * kQueryBlock;
      const int64_t kv = head / g, rows = std::min(kQueryBlock, Lq - q0);
      const T* q_block = qd + (head * Lq + q0) * De;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.f);
      const auto [keys_begin, keys_end] = spans[head * query_blocks + q0 / kQueryBlock];
      const int64_t align = keys.alignment();
      // Key blocks in order; with ALiBi from the last: its bias makes the keys nearest a row
      // score highest, and a row whose maximum comes first is exponentiated once per block.
      const int64_t keys_start = keys_begin / align * align;
      const int64_t key_steps =
          (std::max(keys_end, keys_start) - keys_start + kKeyBlock - 1) / kKeyBlock;
      for (int64_t step = 0; step < key_steps; ++step) {
        const int64_t k0 =
            keys_start + (rules.slopes != nullptr ? key_steps - 1 - step : step) * kKeyBlock;
        const int64_t kn = std::min(kKeyBlock, keys_end - k0);
        const BlockOperands<T> block =
            keys.block(kv, k0, kn, key_buffer.data(), value_buffer.data());
        float* s = scores.data();
        if constexpr (low) {  // s = q · kᵀ, bfloat16 products, float32 sums, whole 32-key groups
          const int64_t kn32 = std::min(kKeyBlock, (kn + 31) / 32 * 32);
          at::native::cpublas::brgemm(
              rows, kn32, De, De, kKeyBlock, kScoreStride, false, q_block, block.keys, s, true);
        } else if (path == Products::kTiles) {  // kᵀ's panels k0 / kPanel …
          product_tiles(rows, kn, D, q_block, D, 1, block.keys, kPanel, D * kPanel, s,
                        kScoreStride, false);
        } else {
          product(path, rows, kn, D, D, block.ldk, kScoreStride, false, q_block, block.keys, s);
        }
        for (int64_t r = 0; r < rows; ++r) {
          // Keys first … seen − 1 of this block row r may see; the rest of its p is 0.
          const auto [lo, hi] = bounds.row(head, q0 + r);
          const int64_t first = std::clamp<int64_t>(lo - k0, 0, kn);
          const int64_t seen = std::max(first, std::clamp<int64_t>(hi - k0, 0, kn)) - first;
          const int64_t width = low ? (kn + 1) / 2 * 2 : kn;
          P* p_row = weights.data() + r * kWeightStride;
          std::fill(p_row, p_row + first, P(0.f));
          std::fill(p_row + first + seen, p_row + width, P(0.f));
          float* s_r = s + r * kScoreStride + first;  // from here on: the keys it may see
          P* p_r = p_row + first;
          if (rules.any()) {
            const float slope = rules.slopes == nullptr ? 0.f : rules.slopes[head];
            const int64_t d0 = q0 + r + rules.shift - (k0 + first);
            modify_row(s_r, seen, static_cast<float>(scale), rules.cap, slope, d0);
          }
          if (m[r] == kNegInf) {  // the row's first keys: their maximum becomes m
            const float m_new = row_max(s_r, seen, c);
            if (m_new == kNegInf) {  // no key seen yet: nothing to add, unless a score is NaN
              if (any_nan(s_r, seen)) {
                l[r] = std::numeric_limits<float>::quiet_NaN();  // out and lse become NaN
              }
              std::fill(p_r, p_r + seen, P(0.f));
              continue;
            }
            m[r] = m_new;
            l[r] = exp_row<P>(s_r, p_r, seen, c, m_new).sum;
            continue;
          }
          Exponentials row = exp_row<P>(s_r, p_r, seen, c, m[r]);
          if (row.top > lag_allowed(l[r] + row.sum)) {  // m moves up, and the row is redone
            const float alpha = exp2_scalar(-row.top);  // 2^(m_old − m_new)
            m[r] += row.top;
            row = exp_row<P>(s_r, p_r, seen, c, m[r]);
            l[r] *= alpha;
            float* acc_r = acc.data() + r * Dv;
#pragma omp simd
            for (int64_t e = 0; e < Dv; ++e) acc_r[e] *= alpha;
          }
          l[r] += row.sum;
        }
        if constexpr (low) {  // acc += p · v_block
          at::native::cpublas::brgemm(
              rows, Dv, (kn + 1) / 2 * 2, kWeightStride, Dv, Dv, true, weights.data(),
              block.values, acc.data(), true);
        } else if (path == Products::kTiles) {  // v as it lies
          product_tiles(rows, Dv, kn, weights.data(), kWeightStride, 1, block.values, Dv, kPanel,
                        acc.data(), Dv, true);
        } else {
          product(path, rows, Dv, kn, kWeightStride, Dv, Dv, true, weights.data(), block.values,
                  acc.data());
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        // l = 0 only for a row with no key: out 0 (not 0/0), lse −inf. NaN stays NaN.
        const float inv = l[r] == 0.f ? 0.f : 1.f / l[r];
        float* o = od + (head * Lq + q0 + r) * Dv;
        for (int64_t e = 0; e < Dv; ++e) o[e] = acc[r * Dv + e] * inv;
        ld[head * Lq + q0 + r] = row_lse(m[r], l[r]);
      }
    }
    if constexpr (low) at::native::cpublas::brgemm_release(true);
  });
  return {out, lse};
}

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

// A few queries (decoding), one query row at a time: its scores against the keys it may see,
// their maximum, one exponentiation pass, then out = Σ_j p_j v_j / l. k and v are read where
// they lie (a KV cache's buffer), with any head and row strides; only their last dim must be
// contiguous. float32 throughout: bfloat16 inputs are widened as they are read.
template <typename T>
std::vector<at::Tensor> decode_impl(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
    const KeyBounds& bounds, const ScoreRules& rules) {
  const int64_t NG = q.size(0), Lq = q.size(1), D = q.size(2);
  const int64_t N = k.size(0), S = k.size(1), Dv = v.size(2);
  const int64_t g = NG / N;
  const float c = rules.any() ? kLog2E : static_cast<float>(scale) * kLog2E;  // (forward_impl)
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
      const auto [lo, hi] = bounds.row(head, i);
      const int64_t seen = std::max<int64_t>(0, hi - lo);  // keys lo … hi − 1
      for (int64_t d = 0; d < D; ++d) query[d] = static_cast<float>(qd[z * D + d]);
      const T* keys = kd + (head / g) * k.stride(0) + lo * k.stride(1);
      dot_rows(query.data(), keys, k.stride(1), seen, D, p.data());
      if (rules.any()) {
        const float slope = rules.slopes == nullptr ? 0.f : rules.slopes[head];
        modify_row(p.data(), seen, static_cast<float>(scale), rules.cap, slope, i + rules.shift - lo);
      }
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

// q (*B, Hq, Lq, D), k (*B, Hkv, S, D), v (*B, Hkv, S, Dv) with the same leading dims B (any
// number of them, 0 included): returns out (*B, Hq, Lq, Dv) and lse (*B, Hq, Lq), float32.
std::vector<at::Tensor> decode(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal,
    int64_t offset, const at::Tensor& ranges, int64_t heads_per_range, double softcap,
    const at::Tensor& slopes) {
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
  const KeyBounds bounds =
      key_bounds(causal, offset, k.size(-2), q.size(-2), ranges, heads_per_range);
  const ScoreRules rules = score_rules(softcap, slopes, q3.size(0), k.size(-2), q.size(-2));
  std::vector<at::Tensor> result;
  if (q.scalar_type() == at::kBFloat16) {
    result = decode_impl<at::BFloat16>(q3, rows(k), rows(v), scale, bounds, rules);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "float32 or bfloat16");
    result = decode_impl<float>(q3, rows(k), rows(v), scale, bounds, rules);
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
// start … start+L−1, then q (B, H, L, D) attends to the first start + L positions (decode_impl,
// reading the buffers in place). Returns out (B, H, L, Dv) in q's dtype.
at::Tensor decode_step(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                       const at::Tensor& k_buf, const at::Tensor& v_buf, int64_t start,
                       double scale, bool causal, int64_t offset) {
  TORCH_CHECK(q.dim() == 4 && k_new.dim() == 4 && v_new.dim() == 4 && k_buf.dim() == 4 &&
              v_buf.dim() == 4, "q, new keys/values and buffers must be 4-d");
  const int64_t L = k_new.size(2);
  TORCH_CHECK(start >= 0 && start + L <= k_buf.size(2) && k_buf.size(2) == v_buf.size(2),
              "no room in the buffers");
  k_buf.narrow(2, start, L).copy_(k_new);
  v_buf.narrow(2, start, L).copy_(v_new);
  const int64_t S = start + L;
  const at::Tensor out =
      decode(q, k_buf.narrow(2, 0, S), v_buf.narrow(2, 0, S), scale, causal, offset, at::Tensor(),
             1, 0.0, at::Tensor())[0];
  return out.to(q.scalar_type());
}

std::vector<at::Tensor> forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal,
    int64_t offset, int64_t products, const at::Tensor& ranges, int64_t heads_per_range,
    double softcap, const at::Tensor& slopes) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-d");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "need contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type());
  TORCH_CHECK(k.size(0) > 0 && q.size(0) % k.size(0) == 0, "heads must group");
  const KeyBounds bounds = key_bounds(causal, offset, k.size(1), q.size(1), ranges, heads_per_range);
  const ScoreRules rules = score_rules(softcap, slopes, q.size(0), k.size(1), q.size(1));
  const auto path = static_cast<Products>(products);
  if (q.scalar_type() == at::kBFloat16) {
    return forward_impl<at::BFloat16>(q, k, v, scale, causal, bounds, rules, path);
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat, "float32 or bfloat16");
  return forward_impl<float>(q, k, v, scale, causal, bounds, rules, path);
}

// The backward pass of the forward above (float32; the caller widens other dtypes), for the
// keys given: with P = exp(s · scale − lse) recomputed per tile from the saved lse (the final
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
// (rule_gradients); the fourth result is then ALiBi's slopes' gradient (NG,), else empty.
std::vector<at::Tensor> backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& dout, const at::Tensor& lse, double scale, bool causal, int64_t offset,
    const at::Tensor& ranges, int64_t heads_per_range, double softcap, const at::Tensor& slopes) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-d");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
              v.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
              dout.scalar_type() == at::kFloat && lse.scalar_type() == at::kFloat, "float32");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() &&
              dout.is_contiguous() && lse.is_contiguous(), "need contiguous");
  TORCH_CHECK(k.size(0) > 0 && q.size(0) % k.size(0) == 0, "heads must group");
  const int64_t NG = q.size(0), Lq = q.size(1), D = q.size(2);
  const int64_t N = k.size(0), S = k.size(1), Dv = v.size(2), g = NG / N;
  const int64_t query_blocks = (Lq + kQueryBlock - 1) / kQueryBlock;
  const KeyBounds bounds = key_bounds(causal, offset, S, Lq, ranges, heads_per_range);
  const ScoreRules rules = score_rules(softcap, slopes, NG, S, Lq);
  const float c = static_cast<float>(scale) * kLog2E;  // (with rules: kLog2E, rule_gradients)
  const at::Tensor delta = (dout * out).sum(-1).contiguous();  // (NG, Lq)
  // In base 2, as the scores; +inf where there is no key, so that 2^(s · c − lse) = 0.
  const at::Tensor lse2 = at::where(lse == kNegInf, -kNegInf, lse * kLog2E).contiguous();
  const int64_t key_panels = (S + kPanel - 1) / kPanel;
  // Parts per head: enough tasks for every thread, never more parts than query blocks.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::clamp<int64_t>((threads + N - 1) / N, 1, std::max<int64_t>(1, query_blocks));
  auto dq = at::empty({NG, Lq, D}, q.options());
  auto dk_parts = at::zeros({parts, N, S, D}, k.options());
  auto dv_parts = at::zeros({parts, N, S, Dv}, v.options());
  auto dslope_parts = at::zeros({parts, rules.slopes == nullptr ? 0 : NG}, q.options());
  const float *qd = q.const_data_ptr<float>(), *kd = k.const_data_ptr<float>();
  const float *od = dout.const_data_ptr<float>(), *ld = lse2.const_data_ptr<float>();
  const float *dd = delta.const_data_ptr<float>(), *vd = v.const_data_ptr<float>();
  float *dqd = dq.data_ptr<float>(), *dkd = dk_parts.data_ptr<float>();
  float *dvd = dv_parts.data_ptr<float>(), *dsd = dslope_parts.data_ptr<float>();
  at::parallel_for(0, N * parts, 1, [&](int64_t begin, int64_t end) {
    Scratch<float> weights(kQueryBlock * kScoreStride), grads(kQueryBlock * kScoreStride);
    Scratch<float> dq_block(kQueryBlock * D);
    // This task's head's kᵀ and vᵀ in panels (packed per task: a head at a time, not all heads).
    Scratch<float> key_panels_of(key_panels * kPanel * D), value_panels_of(key_panels * kPanel * Dv);
    const float *kp = key_panels_of.data(), *vp = value_panels_of.data();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / parts, part = task % parts;
      pack_transposed(kd + kv * S * D, S, D, key_panels_of.data());
      pack_transposed(vd + kv * S * Dv, S, Dv, value_panels_of.data());
      const int64_t first = query_blocks * part / parts, last = query_blocks * (part + 1) / parts;
      float* dk_head = dkd + (part * N + kv) * S * D;
      float* dv_head = dvd + (part * N + kv) * S * Dv;
      for (int64_t head = kv * g; head < (kv + 1) * g; ++head) {
        const float slope = rules.slopes == nullptr ? 0.f : rules.slopes[head];
        double distance_sum = 0.0;  // −dL/d slope of this head over this task's rows
        for (int64_t i = first; i < last; ++i) {
          const int64_t q0 = i * kQueryBlock, rows = std::min(kQueryBlock, Lq - q0);
          const float* q_block = qd + (head * Lq + q0) * D;
          const float* dout_block = od + (head * Lq + q0) * Dv;
          // Keys this block's rows may see (key blocks outside are skipped), from a whole panel.
          const auto [keys_begin, keys_end] = bounds.span(head, q0, q0 + rows - 1);
          std::fill(dq_block.begin(), dq_block.end(), 0.f);
          for (int64_t k0 = keys_begin / kPanel * kPanel; k0 < keys_end; k0 += kKeyBlock) {
            const int64_t kn = std::min(kKeyBlock, keys_end - k0);
            float *p = weights.data(), *ds = grads.data();
            product_tiles(rows, kn, D, q_block, D, 1, kp + k0 * D, kPanel, D * kPanel, p,
                          kScoreStride, false);  // s = q · kᵀ
            product_tiles(rows, kn, Dv, dout_block, Dv, 1, vp + k0 * Dv, kPanel, Dv * kPanel, ds,
                          kScoreStride, false);  // dP = dO · vᵀ
            for (int64_t r = 0; r < rows; ++r) {
              // Keys from … from + seen − 1 of this block row r may see; the rest get 0.
              const auto [lo, hi] = bounds.row(head, q0 + r);
              const int64_t from = std::clamp<int64_t>(lo - k0, 0, kn);
              const int64_t seen = std::max(from, std::clamp<int64_t>(hi - k0, 0, kn)) - from;
              const float top = ld[head * Lq + q0 + r], row_delta = dd[head * Lq + q0 + r];
              float *p_r = p + r * kScoreStride, *ds_r = ds + r * kScoreStride;
              std::fill(p_r, p_r + from, 0.f);
              std::fill(ds_r, ds_r + from, 0.f);
              if (rules.any()) {
                const int64_t d0 = q0 + r + rules.shift - (k0 + from);
                distance_sum += rule_gradients_of(rules, p_r + from, ds_r + from, seen,
                                                  static_cast<float>(scale), slope, d0, top,
                                                  row_delta);
                std::fill(p_r + from + seen, p_r + kn, 0.f);
                std::fill(ds_r + from + seen, ds_r + kn, 0.f);
              } else {
                tile_gradients(p_r + from, ds_r + from, seen, kn - from, c, top, row_delta);
              }
            }
            product_tiles(kn, Dv, rows, p, 1, kScoreStride, dout_block, Dv, kPanel,
                          dv_head + k0 * Dv, Dv, true);  // dV += Pᵀ · dO
            product_tiles(kn, D, rows, ds, 1, kScoreStride, q_block, D, kPanel, dk_head + k0 * D,
                          D, true);  // dK += dSᵀ · q (scaled at the end)
            product_tiles(rows, D, kn, ds, kScoreStride, 1, kd + (kv * S + k0) * D, D, kPanel,
                          dq_block.data(), D, true);  // dQ += dS · k
          }
          float* dq_rows = dqd + (head * Lq + q0) * D;
          for (int64_t e = 0; e < rows * D; ++e) dq_rows[e] = dq_block[e] * static_cast<float>(scale);
        }
        if (rules.slopes != nullptr) dsd[part * NG + head] = static_cast<float>(-distance_sum);
      }
    }
  });
  at::Tensor dk = parts == 1 ? dk_parts[0] : dk_parts.sum(0);  // parts added up in order
  at::Tensor dv = parts == 1 ? dv_parts[0] : dv_parts.sum(0);
  return {dq, dk.mul_(scale), dv, dslope_parts.sum(0)};
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
  module.def("backward", &backward, "flash backward: (dq, dk, dv), float32");
  module.def("bfloat16_matrix_units", &bfloat16_matrix_units);
  module.def("build_info", &build_info, "capability, vector width");
}
