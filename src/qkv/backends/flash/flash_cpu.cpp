// qkv's compiled flash forward for CPUs: the tiled online-softmax recurrence of flash.py's
// module docstring, one query block of one head at a time, with the block's running m, l and acc
// kept in cache-sized buffers.
//
// For each query block (Bq rows of one query head) and each key block (Bk keys) it may see:
//
//     s      = q_block · k_blockᵀ                          (Bq, Bk) float32, one brgemm call
//     m_new  = max(m, max_j s_j · c)                        c = scale · log2(e): base-2 units
//     alpha  = 2^(m − m_new)                                rescales the old terms
//     p      = 2^(s · c − m_new)                            float32; bfloat16 for the product
//     l      = alpha · l + Σ_j p_j
//     acc    = alpha · acc + p · v_block                    (Bq, Dv) float32, one brgemm call
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

// Matrix products go through at::native::cpublas::brgemm, torch's small-matrix kernel (oneDNN):
// float32 products use the vector units; bfloat16 products use the CPU's bfloat16 matrix units
// (AMX) with float32 sums, which need each key block in pairs-of-rows ("VNNI") order, built once
// per call. Scores, softmax and accumulation are float32 in both cases; the weights that are
// rounded to bfloat16 for the product come from a cheaper 2^x (within 7.5e-5 relative).
//
// Inputs: q (NG, Lq, D), k (N, S, D), v (N, S, Dv), contiguous, all float32 or all bfloat16;
// query head i uses key/value head i / (NG / N) (grouped-query heads, K/V never repeated).
// Returns out (NG, Lq, Dv) and lse (NG, Lq), float32.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

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

#if defined(__AVX512F__)
// The same 2^x on 16 lanes, in two instructions besides the polynomial: f = x − floor(x) from
// reduce, and p(f) · 2^floor(x) from scalef, which floors its exponent itself, so n is never
// formed (for −inf, f = 0 and the result is 0; NaN stays NaN). Results below 2^-126 are flushed
// to 0 by the flush-to-zero mode the kernel runs in (see forward_impl).
template <int Terms>
inline __m512 exp2_avx512(__m512 x, const float (&coefficients)[Terms]) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(coefficients[0]);
  for (int i = 1; i < Terms; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(coefficients[i]));
  return _mm512_scalef_ps(p, x);
}
#endif

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

#if defined(__AVX512F__)
inline __m512 tanh_avx512(__m512 y) {
  const __m512 a = _mm512_abs_ps(y), y2 = _mm512_mul_ps(y, y);
  __m512 series = _mm512_set1_ps(62.f / 2835);
  series = _mm512_fmadd_ps(series, y2, _mm512_set1_ps(-17.f / 315));
  series = _mm512_fmadd_ps(series, y2, _mm512_set1_ps(2.f / 15));
  series = _mm512_fmadd_ps(series, y2, _mm512_set1_ps(-1.f / 3));
  series = _mm512_mul_ps(y, _mm512_fmadd_ps(series, y2, _mm512_set1_ps(1.f)));
  const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.25f), _CMP_LT_OQ);
  if (small == 0xFFFF) return series;  // the usual case for a large cap such as Gemma's 50
  const __m512 t = exp2_avx512(_mm512_mul_ps(a, _mm512_set1_ps(-2.f * kLog2E)), kExp2Degree5);
  const __m512 one = _mm512_set1_ps(1.f);
  __m512 large = _mm512_div_ps(_mm512_sub_ps(one, t), _mm512_add_ps(one, t));
  // tanh(|y|) >= 0 has no sign bit: give it y's
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(INT32_MIN));
  large = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(large), sign));
  return _mm512_mask_blend_ps(small, large, series);
}
#endif

// One row of n scores in place, keys j = 0 … n − 1 at distance d0 − j from the query:
// s_j ← cap · tanh(s_j · scale / cap) − slope · |d0 − j| (each part only where the call has it),
// the scaled scores the recurrence then exponentiates in base 2 (c = log2 e).
inline void modify_row(float* s, int64_t n, float scale, float cap, float slope, int64_t d0) {
  const bool capped = cap != 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vscale = _mm512_set1_ps(scale), vcap = _mm512_set1_ps(cap);
  const __m512 vinv = _mm512_set1_ps(capped ? 1.f / cap : 0.f), vslope = _mm512_set1_ps(slope);
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; j < n; j += 16) {
    const __mmask16 lanes = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, s + j), vscale);
    if (capped) x = _mm512_mul_ps(vcap, tanh_avx512(_mm512_mul_ps(x, vinv)));
    if (slope != 0.f) {
      const __m512 d = _mm512_sub_ps(_mm512_set1_ps(static_cast<float>(d0 - j)), lane);
      x = _mm512_fnmadd_ps(vslope, _mm512_abs_ps(d), x);
    }
    _mm512_mask_storeu_ps(s + j, lanes, x);
  }
#endif
  for (; j < n; ++j) {
    float x = s[j] * scale;
    if (capped) x = cap * tanh_scalar(x / cap);
    s[j] = x - slope * static_cast<float>(std::llabs(d0 - j));
  }
}

// The running extreme of one row's scores: the largest (Up) or the smallest. NaN is skipped.
template <bool Up>
inline float row_extreme(const float* s, int64_t n) {
  const auto better = [](float a, float b) { return Up ? std::max(a, b) : std::min(a, b); };
  float best = Up ? kNegInf : -kNegInf;
  int64_t j = 0;
#if defined(__AVX512F__)
  // Four running extremes, so that each comparison need not wait for the one before.
  const auto step = [](__m512 x, __m512 e) {
    return Up ? _mm512_max_ps(x, e) : _mm512_min_ps(x, e);  // e where x is NaN
  };
  __m512 e0 = _mm512_set1_ps(best), e1 = e0, e2 = e0, e3 = e0;
  for (; j + 64 <= n; j += 64) {
    e0 = step(_mm512_loadu_ps(s + j), e0);
    e1 = step(_mm512_loadu_ps(s + j + 16), e1);
    e2 = step(_mm512_loadu_ps(s + j + 32), e2);
    e3 = step(_mm512_loadu_ps(s + j + 48), e3);
  }
  for (; j + 16 <= n; j += 16) e0 = step(_mm512_loadu_ps(s + j), e0);
  const __m512 e = step(step(e0, e1), step(e2, e3));
  best = Up ? _mm512_reduce_max_ps(e) : _mm512_reduce_min_ps(e);
#endif
  for (; j < n; ++j) best = better(best, s[j]);
  return best;
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

#if defined(__AVX512F__)
// 2^x for weights of type P: float32 weights to float32 precision, bfloat16 ones cheaper.
template <typename P>
inline __m512 weight_exp2(__m512 x) {
  if constexpr (std::is_same_v<P, float>) return exp2_avx512(x, kExp2Degree5);
  else return exp2_avx512(x, kExp2Degree3);
}
#endif

// p_j = 2^(s_j · c − m) written to p (float32 or bfloat16), with their sum and largest exponent.
template <typename P>
inline Exponentials exp_row(const float* s, P* p, int64_t n, float c, float m) {
  constexpr bool f32 = std::is_same_v<P, float>;
  int64_t j = 0;
  Exponentials row{0.f, kNegInf};
#if defined(__AVX512F__)
  __m512 sums = _mm512_setzero_ps(), tops = _mm512_set1_ps(kNegInf);
  const __m512 vc = _mm512_set1_ps(c), vm = _mm512_set1_ps(m);
  if constexpr (f32) {
    for (; j + 16 <= n; j += 16) {
      const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), vc, vm);
      tops = _mm512_max_ps(x, tops);  // the second operand where x is NaN
      const __m512 e = weight_exp2<P>(x);
      sums = _mm512_add_ps(sums, e);
      _mm512_storeu_ps(p + j, e);
    }
  }
#if defined(__AVX512BF16__)
  if constexpr (!f32) {
    for (; j + 32 <= n; j += 32) {  // two vectors of weights make one of bfloat16
      const __m512 x0 = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), vc, vm);
      const __m512 x1 = _mm512_fmsub_ps(_mm512_loadu_ps(s + j + 16), vc, vm);
      tops = _mm512_max_ps(x0, _mm512_max_ps(x1, tops));
      const __m512 e0 = weight_exp2<P>(x0), e1 = weight_exp2<P>(x1);
      sums = _mm512_add_ps(sums, _mm512_add_ps(e0, e1));
      _mm512_storeu_si512(p + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
  }
  constexpr bool vector_weights = true;
#else
  constexpr bool vector_weights = f32;
#endif
  if constexpr (vector_weights) {
    for (; j < n; j += 16) {  // the last keys, in as many lanes as are left
      const __mmask16 lanes = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(lanes, s + j), vc, vm);
      tops = _mm512_mask_max_ps(tops, lanes, x, tops);
      const __m512 e = weight_exp2<P>(x);
      sums = _mm512_mask_add_ps(sums, lanes, sums, e);
      if constexpr (f32) {
        _mm512_mask_storeu_ps(p + j, lanes, e);
      } else {
#if defined(__AVX512BF16__)
        _mm256_mask_storeu_epi16(p + j, lanes, (__m256i)_mm512_cvtneps_pbh(e));
#endif
      }
    }
  }
  row = {_mm512_reduce_add_ps(sums), _mm512_reduce_max_ps(tops)};
#endif
  for (; j < n; ++j) {  // without AVX-512 (or bfloat16 conversions): one at a time
    const float x = s[j] * c - m;
    row.top = x > row.top ? x : row.top;
    const float e = exp2_scalar(x);
    row.sum += e;
    p[j] = P(e);
  }
  return row;
}

// Keys and values in the order the products read them.
//   float32:  kt = kᵀ per head (N, D, S); v as given.
//   bfloat16: per key block, kᵀ (D, Bk) and v (Bk, Dv) in pairs-of-rows order: element
//             (r, c) of a (R, C) matrix at [(r / 2) · C + c] · 2 + r % 2, zero-padded to what
//             the products read: kᵀ to a whole 32-key group, v to an even number of rows (the
//             rest of a short last block is left unwritten).
struct Operands {
  at::Tensor keys, values;
};

template <typename T>
Operands arrange(const at::Tensor& k, const at::Tensor& v, int64_t key_blocks) {
  const int64_t N = k.size(0), S = k.size(1), D = k.size(2), Dv = v.size(2);
  if constexpr (std::is_same_v<T, float>) {
    return {k.transpose(1, 2).contiguous(), v};
  } else {
    const int64_t De = (D + 1) / 2 * 2;
    auto keys = at::empty({N, key_blocks, De * kKeyBlock}, k.options());
    auto values = at::empty({N, key_blocks, kKeyBlock * Dv}, v.options());
    const T* kd = k.const_data_ptr<T>();
    const T* vd = v.const_data_ptr<T>();
    T* kp = keys.data_ptr<T>();
    T* vp = values.data_ptr<T>();
    at::parallel_for(0, N * key_blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t z = begin; z < end; ++z) {
        const int64_t h = z / key_blocks, n0 = (z % key_blocks) * kKeyBlock;
        const int64_t kn = std::min(kKeyBlock, S - n0);
        const T* kh = kd + (h * S + n0) * D;
        const T* vh = vd + (h * S + n0) * Dv;
        T* kb = kp + z * De * kKeyBlock;
        T* vb = vp + z * kKeyBlock * Dv;
        if (D % 2 == 0) {
          // A pair (k[j][2i], k[j][2i+1]) is one 32-bit word, which goes to row i, column j:
          // a transpose of 32-bit words.
          const auto* from = reinterpret_cast<const uint32_t*>(kh);
          auto* to = reinterpret_cast<uint32_t*>(kb);
          const int64_t pairs = D / 2;
          int64_t j = 0;
#if defined(__AVX512F__)
          // 16 keys at a time: row i of the block gets one whole cache line (a gather of the
          // 16 keys' i-th words).
          const __m512i offsets = _mm512_mullo_epi32(
              _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
              _mm512_set1_epi32(static_cast<int>(pairs)));
          for (; j + 16 <= kn; j += 16)
            for (int64_t i = 0; i < pairs; ++i)
              _mm512_storeu_si512(
                  to + i * kKeyBlock + j, _mm512_i32gather_epi32(offsets, from + j * pairs + i, 4));
#endif
          for (; j < kn; ++j)
            for (int64_t i = 0; i < pairs; ++i) to[i * kKeyBlock + j] = from[j * pairs + i];
          const int64_t kn32 = std::min(kKeyBlock, (kn + 31) / 32 * 32);
          for (int64_t i = 0; i < pairs; ++i)
            std::fill(to + i * kKeyBlock + kn, to + i * kKeyBlock + kn32, 0u);
        } else {
          for (int64_t d = 0; d < De; ++d)  // kᵀ: row d, column j
            for (int64_t j = 0; j < kKeyBlock; ++j)
              kb[((d / 2) * kKeyBlock + j) * 2 + d % 2] =
                  (j < kn && d < D) ? kh[j * D + d] : T(0.f);
        }
        // v: rows j and j + 1 interleaved, element by element, into row j / 2.
        const auto* bits = reinterpret_cast<const uint16_t*>(vh);
        auto* pairs = reinterpret_cast<uint32_t*>(vb);
        for (int64_t j = 0; j < kn; j += 2) {
          const uint16_t* even = bits + j * Dv;
          const uint16_t* odd = even + Dv;
          uint32_t* row = pairs + (j / 2) * Dv;
          if (j + 1 < kn) {
#pragma omp simd
            for (int64_t e = 0; e < Dv; ++e) row[e] = uint32_t(odd[e]) << 16 | even[e];
          } else if (j < kn) {
            for (int64_t e = 0; e < Dv; ++e) row[e] = even[e];
          } else {
            std::fill(row, row + Dv, 0u);
          }
        }
      }
    });
    return {keys, values};
  }
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

template <typename T>
std::vector<at::Tensor> forward_impl(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal,
    const KeyBounds& bounds, const ScoreRules& rules) {
  constexpr bool low = std::is_same_v<T, at::BFloat16>;
  using P = std::conditional_t<low, T, float>;  // the weights' type
  const int64_t NG = q.size(0), Lq = q.size(1), D = q.size(2);
  const int64_t N = k.size(0), S = k.size(1), Dv = v.size(2);
  const int64_t g = NG / N;
  const int64_t De = low ? (D + 1) / 2 * 2 : D;  // q's row length as the products read it
  const int64_t key_blocks = (S + kKeyBlock - 1) / kKeyBlock;
  const int64_t query_blocks = (Lq + kQueryBlock - 1) / kQueryBlock;
  // Soft-capped or biased scores are scaled before they are changed (modify_row): then only
  // log2(e) is left to multiply them by.
  const float c = rules.any() ? kLog2E : static_cast<float>(scale) * kLog2E;

  auto out = at::empty({NG, Lq, Dv}, q.options().dtype(at::kFloat));
  auto lse = at::empty({NG, Lq}, q.options().dtype(at::kFloat));
  at::Tensor q_even = q;  // bfloat16 products need an even feature count
  if (low && De != D) q_even = at::constant_pad_nd(q, {0, 1});
  const Operands ops = arrange<T>(k, v, key_blocks);

  const T* qd = q_even.const_data_ptr<T>();
  const T* kd = ops.keys.const_data_ptr<T>();
  const T* vd = ops.values.const_data_ptr<T>();
  float* od = out.data_ptr<float>();
  float* ld = lse.data_ptr<float>();

  // Blocks are handed out one at a time, so a core that runs slower (another process on it)
  // takes fewer; causal blocks go longest first, so none is left alone at the end.
  std::atomic<int64_t> next_block{0};
  const int64_t blocks = NG * query_blocks;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    // Flush-to-zero: 2^x below 2^-126 becomes 0 (exp2_avx512) without slow subnormal results.
    const unsigned int control = _mm_getcsr();
    _mm_setcsr(control | _MM_FLUSH_ZERO_ON);
    Scratch<float> scores(kQueryBlock * kScoreStride), acc(kQueryBlock * Dv);
    std::vector<float> m(kQueryBlock), l(kQueryBlock);
    Scratch<P> weights(kQueryBlock * kWeightStride);
    for (int64_t z; (z = next_block.fetch_add(1)) < blocks;) {
      const int64_t head = z / query_blocks, i = z % query_blocks;
      const int64_t q0 = (causal ? query_blocks - 1 - i : i) * kQueryBlock;
      const int64_t kv = head / g, rows = std::min(kQueryBlock, Lq - q0);
      const T* q_block = qd + (head * Lq + q0) * De;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.f);
      // Keys this block may see: from its rows' first to their last (causally up to its last
      // row's diagonal); key blocks outside are skipped.
      int64_t keys_begin = S, keys_end = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const auto [lo, hi] = bounds.row(head, q0 + r);
        if (lo < hi) keys_begin = std::min(keys_begin, lo), keys_end = std::max(keys_end, hi);
      }
      // (bfloat16 keys and values are arranged by whole key blocks: start at one)
      const int64_t keys_start = low ? keys_begin / kKeyBlock * kKeyBlock : keys_begin;
      for (int64_t k0 = keys_start; k0 < keys_end; k0 += kKeyBlock) {
        const int64_t kn = std::min(kKeyBlock, keys_end - k0), block = k0 / kKeyBlock;
        float* s = scores.data();
        if constexpr (low) {  // s = q · kᵀ, bfloat16 products, float32 sums, whole 32-key groups
          const int64_t kn32 = std::min(kKeyBlock, (kn + 31) / 32 * 32);
          at::native::cpublas::brgemm(
              rows, kn32, De, De, kKeyBlock, kScoreStride, false, q_block,
              kd + (kv * key_blocks + block) * De * kKeyBlock, s, true);
        } else {
          at::native::cpublas::brgemm(
              rows, kn, D, D, S, kScoreStride, false, q_block, kd + kv * D * S + k0, s, false);
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
              vd + (kv * key_blocks + block) * kKeyBlock * Dv, acc.data(), true);
        } else {
          at::native::cpublas::brgemm(
              rows, Dv, kn, kWeightStride, Dv, Dv, true, weights.data(), vd + (kv * S + k0) * Dv,
              acc.data(), false);
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
    _mm_setcsr(control);
  });
  return {out, lse};
}

// 16 float32 values from x (float32 or bfloat16, widened), the lanes not in `lanes` 0.
#if defined(__AVX512F__)
template <typename T>
inline __m512 load16(const T* x, __mmask16 lanes) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(lanes, x);
  } else {  // bfloat16: the upper half of a float32
    const __m256i bits = _mm256_maskz_loadu_epi16(lanes, x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}

// Lane i of the result: the sum of v[i]'s 16 lanes. Pairs of vectors are added lane-wise after
// shuffles that line up their partial sums, halving the count at each step (45 instructions for
// what 16 separate reductions would do in about 130).
inline __m512 lane_sums(const __m512 (&v)[16]) {
  __m512 t[8], w[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v2i[0]+v2i[2], v2i+1[0]+v2i+1[2], ...
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: that lane's sums of v4i ... v4i+3
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const auto halves = [](__m512 a, __m512 b) {  // a's lanes 0+1, 2+3, then b's
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return halves(halves(w[0], w[1]), halves(w[2], w[3]));
}

// The lanes of the c-th 16-value chunk of a row of n values.
inline __mmask16 chunk_lanes(int64_t n, int64_t c) {
  const int64_t left = std::clamp<int64_t>(n - 16 * c, 0, 16);
  return static_cast<__mmask16>((1u << left) - 1);
}

// dot_rows for rows of at most 16 · C values, held in C registers.
template <int C, typename T>
void dot_rows_in_registers(const float* q, const T* k, int64_t stride, int64_t n, int64_t D,
                           float* s) {
  __mmask16 lanes[C];
  __m512 query[C];
  for (int c = 0; c < C; ++c) {
    lanes[c] = chunk_lanes(D, c);
    query[c] = _mm512_maskz_loadu_ps(lanes[c], q + 16 * c);
  }
  const auto dot = [&](const T* key) {  // 16 products, summed across lanes by the caller
    __m512 acc = _mm512_mul_ps(query[0], load16(key, lanes[0]));
    for (int c = 1; c < C; ++c)
      acc = _mm512_fmadd_ps(query[c], load16(key + 16 * c, lanes[c]), acc);
    return acc;
  };
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 sums[16];
    for (int i = 0; i < 16; ++i) sums[i] = dot(k + (j + i) * stride);
    _mm512_storeu_ps(s + j, lane_sums(sums));
  }
  for (; j < n; ++j) s[j] = _mm512_reduce_add_ps(dot(k + j * stride));
}

// weighted_sum for rows of at most 16 · C values, summed in C registers.
template <int C, typename T>
void weighted_sum_in_registers(const float* p, const T* v, int64_t stride, int64_t n, int64_t Dv,
                               float* out) {
  __mmask16 lanes[C];
  __m512 acc[C];
  for (int c = 0; c < C; ++c) {
    lanes[c] = chunk_lanes(Dv, c);
    acc[c] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < n; ++j) {
    const __m512 weight = _mm512_set1_ps(p[j]);
    for (int c = 0; c < C; ++c)
      acc[c] = _mm512_fmadd_ps(weight, load16(v + j * stride + 16 * c, lanes[c]), acc[c]);
  }
  for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(out + 16 * c, lanes[c], acc[c]);
}
#endif

// s_j = q · k_j for j < n, with k_j at k + j · stride (D contiguous values each).
template <typename T>
void dot_rows(const float* q, const T* k, int64_t stride, int64_t n, int64_t D, float* s) {
#if defined(__AVX512F__)
  switch ((D + 15) / 16) {
    case 1: return dot_rows_in_registers<1>(q, k, stride, n, D, s);
    case 2: return dot_rows_in_registers<2>(q, k, stride, n, D, s);
    case 3: return dot_rows_in_registers<3>(q, k, stride, n, D, s);
    case 4: return dot_rows_in_registers<4>(q, k, stride, n, D, s);
    default: break;  // longer rows: below
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const T* key = k + j * stride;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += q[d] * static_cast<float>(key[d]);
    s[j] = dot;
  }
}

// out = Σ_{j < n} p_j v_j, with v_j at v + j · stride (Dv contiguous values each).
template <typename T>
void weighted_sum(const float* p, const T* v, int64_t stride, int64_t n, int64_t Dv, float* out) {
  int64_t e0 = 0;
#if defined(__AVX512F__)
  for (; e0 < Dv; e0 += 64) {  // 64 output features at a time
    const int64_t width = std::min<int64_t>(64, Dv - e0);
    switch ((width + 15) / 16) {
      case 1: weighted_sum_in_registers<1>(p, v + e0, stride, n, width, out + e0); break;
      case 2: weighted_sum_in_registers<2>(p, v + e0, stride, n, width, out + e0); break;
      case 3: weighted_sum_in_registers<3>(p, v + e0, stride, n, width, out + e0); break;
      default: weighted_sum_in_registers<4>(p, v + e0, stride, n, width, out + e0); break;
    }
  }
#endif
  for (int64_t e = e0; e < Dv; ++e) {
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) sum += p[j] * static_cast<float>(v[j * stride + e]);
    out[e] = sum;
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
    const unsigned int control = _mm_getcsr();
    _mm_setcsr(control | _MM_FLUSH_ZERO_ON);  // as in forward_impl
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
    _mm_setcsr(control);
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
    int64_t offset, const at::Tensor& ranges, int64_t heads_per_range, double softcap,
    const at::Tensor& slopes) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-d");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "need contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type());
  TORCH_CHECK(k.size(0) > 0 && q.size(0) % k.size(0) == 0, "heads must group");
  const KeyBounds bounds = key_bounds(causal, offset, k.size(1), q.size(1), ranges, heads_per_range);
  const ScoreRules rules = score_rules(softcap, slopes, q.size(0), k.size(1), q.size(1));
  if (q.scalar_type() == at::kBFloat16) {
    return forward_impl<at::BFloat16>(q, k, v, scale, causal, bounds, rules);
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat, "float32 or bfloat16");
  return forward_impl<float>(q, k, v, scale, causal, bounds, rules);
}

// Whether this CPU runs bfloat16 products in matrix units (otherwise bfloat16 goes as float32).
bool bfloat16_products() { return at::native::cpublas::could_pack(at::kBFloat16); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("forward", &forward, "flash forward: (out, lse)");
  module.def("decode", &decode, "flash forward for a few queries, k and v strided: (out, lse)");
  module.def("decode_step", &decode_step, "write new keys/values into a KV cache's buffers, attend");
  module.def("bfloat16_products", &bfloat16_products);
}
