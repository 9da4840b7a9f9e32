// The products of decoding's core (decode.h), for a pass of keys: scores of a block of query
// rows against a block of keys, summed across lanes together (block_scores, lane_sums), and
// acc += p · V over a block's value rows (add_values), with the loads that widen bfloat16 (or read
// it in pairs: pair_products) and the prefetches that ask for the next pass's rows meanwhile. Keys
// and values are reached by a pointer per row, so any layout (a contiguous cache, pages, packed
// sequences) runs this code.

#pragma once

#include "row_math.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

namespace {

// Whether this is an AVX2 build (256-bit vectors, no AVX-512), where the code below takes ways of
// its own: bfloat16 widened in pairs (load_float_pair), float32 value rows summed alone
// (lone_rows).
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
#define QKV_AVX2_BUILD 1
constexpr bool kAvx2Build = true;
#else
constexpr bool kAvx2Build = false;
#endif

// 512 bits of the cache from x: one load, or two 256-bit halves in builds for CPUs that carry out
// 512-bit operations as two halves (QKV_LOAD_HALVES, which kernel.py sets for AMD's Zen 4), where
// a stream of 256-bit loads reads memory faster (a 2 GiB sum on 2 cores, 31 GB/s vs 28; decoding
// with one load: 7–15 % slower in the caches, 0–15 % from memory). One load elsewhere: on an Intel
// Xeon (AVX-512 and AMX), in-process A/B, float32 decoding 2–4 % faster in the caches (1 thread),
// 0–4 % from memory (2 threads); in L1, grouped-query 10 % fewer cycles.
#ifdef CPU_CAPABILITY_AVX512
inline __m512 wide_load(const float* x) {
#ifdef QKV_LOAD_HALVES
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(x)), _mm256_loadu_ps(x + 8), 1);
#else
  return _mm512_loadu_ps(x);
#endif
}
#endif

// float32 values from x (float32 or bfloat16, widened): a whole vector, or its first count
// lanes (the rest 0).
template <typename T>
inline Vec load_float(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
#ifdef CPU_CAPABILITY_AVX512
    return Vec(wide_load(x));
#else
    return Vec::loadu(x);
#endif
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

// Two vectors of float32 values from 2 · kLanes values at x: for bfloat16 in AVX2 builds, one
// 256-bit load whose two halves are widened by shuffles alone (its 64-bit quarters reordered, then
// each value's 16 bits placed above 16 zero bits), leaving the shift that load_float's widening
// takes to the ports that do the multiply-adds; elsewhere two load_float.
template <typename T>
[[gnu::always_inline]] inline std::pair<Vec, Vec> load_float_pair(const T* x) {
#ifdef QKV_AVX2_BUILD
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    const __m256i y = _mm256_permute4x64_epi64(raw, 0xD8), zero = _mm256_setzero_si256();
    return {Vec(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, y))),
            Vec(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, y)))};
  }
#endif
  return {load_float(x), load_float(x + kLanes)};
}

// Whether load_float_pair reads T with one load.
template <typename T>
constexpr bool kPairLoads = kAvx2Build && std::is_same_v<T, at::BFloat16>;

// Asks for the cache lines of n values (of type T) from x, into the cache levels near the core.
template <typename T>
inline void prefetch(const T* x, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(x);
  const int64_t size = n * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < size; b += 64) __builtin_prefetch(bytes + b, 0, 2);
}

// The value rows of the next pass to ask for while this pass's values are summed: row j at
// v[j] + offset, Dv values each, j < n (n 0: none).
template <typename T>
struct Ahead {
  const T* const* v = nullptr;
  int64_t n = 0, offset = 0, Dv = 0;
};

// acc[r][e0 … e0 + VN · kLanes) += Σ_{j < n} p[r · p_stride + j] · v_j[e0 …] for four rows r (acc
// rows acc_stride apart; VN vectors), v_j at v[j] + offset; the last vector only its first `last`
// lanes unless kFull. The 4 · VN accumulators are values indexed by constants (each fold below
// names every one), which the compiler keeps in registers over the keys.
template <typename T, int VN, bool kFull>
inline void add_block(float* acc, int64_t acc_stride, const float* p, int64_t p_stride,
                      const T* const* v, int64_t offset, int64_t n, int64_t e0, int64_t last,
                      const Ahead<T>& ahead) {
  constexpr int A = 4 * VN;  // accumulator i: row i / VN, vector i % VN
  const auto full = [](int c) { return kFull || c + 1 < VN; };
  const auto at = [&](int i) { return acc + (i / VN) * acc_stride + e0 + (i % VN) * kLanes; };
  std::array<Vec, A> a;
  [&]<size_t... I>(std::index_sequence<I...>) {
    ((a[I] = full(I % VN) ? Vec::loadu(at(I)) : Vec::loadu(at(I), last)), ...);
  }(std::make_index_sequence<A>{});
  for (int64_t j = 0; j < n; ++j) {
    if (j < ahead.n) prefetch(ahead.v[j] + ahead.offset, ahead.Dv);
    const T* row = v[j] + offset + e0;
    std::array<Vec, VN> x;
    if constexpr (kPairLoads<T> && VN % 2 == 0 && kFull) {
      [&]<size_t... C>(std::index_sequence<C...>) {
        ((std::tie(x[2 * C], x[2 * C + 1]) = load_float_pair(row + 2 * C * kLanes)), ...);
      }(std::make_index_sequence<VN / 2>{});
    } else {
      [&]<size_t... C>(std::index_sequence<C...>) {
        ((x[C] = full(C) ? load_float(row + C * kLanes) : load_float(row + C * kLanes, last)), ...);
      }(std::make_index_sequence<VN>{});
    }
    const std::array<Vec, 4> w{Vec(p[j]), Vec(p[p_stride + j]), Vec(p[2 * p_stride + j]),
                               Vec(p[3 * p_stride + j])};
    [&]<size_t... I>(std::index_sequence<I...>) {
      ((a[I] = at::vec::fmadd(w[I / VN], x[I % VN], a[I])), ...);
    }(std::make_index_sequence<A>{});
  }
  [&]<size_t... I>(std::index_sequence<I...>) {
    ((full(I % VN) ? a[I].store(at(I)) : a[I].store(at(I), last)), ...);
  }(std::make_index_sequence<A>{});
}

// acc (rows × Dv, rows a multiple of four) += p (rows × n) · V, for one piece of VN vectors.
template <typename T, int VN, bool kFull>
inline void add_piece(float* acc, const float* p, int64_t p_stride, int64_t rows, const T* const* v,
                      int64_t offset, int64_t n, int64_t Dv, int64_t e0, int64_t last,
                      const Ahead<T>& ahead) {
  for (int64_t r = 0; r < rows; r += 4)
    add_block<T, VN, kFull>(acc + r * Dv, Dv, p + r * p_stride, p_stride, v, offset, n, e0, last,
                               r == 0 ? ahead : Ahead<T>{});
}

// acc[e0 … e0 + width) += Σ_{j < n} p[j] · v_j[e0 …] for one query row, v_j at v[j] + offset:
// VN vectors, the last only its first `last` lanes unless kFull (at most kRowVecs: accumulators
// the compiler keeps in registers over the keys; every vector of the piece is summed in the one
// pass over the keys).
template <typename T, int VN, bool kFull>
inline void add_row(float* acc, const float* p, const T* const* v, int64_t offset, int64_t n,
                    int64_t e0, int64_t last, const Ahead<T>& ahead) {
  const auto full = [](int c) { return kFull || c + 1 < VN; };
  Vec a[VN];
  for (int c = 0; c < VN; ++c)
    a[c] = full(c) ? Vec::loadu(acc + e0 + c * kLanes) : Vec::loadu(acc + e0 + c * kLanes, last);
  for (int64_t j = 0; j < n; ++j) {
    if (j < ahead.n) prefetch(ahead.v[j] + ahead.offset, ahead.Dv);
    const T* row = v[j] + offset + e0;
    const Vec w(p[j]);
    int c = 0;
    if constexpr (kPairLoads<T>) {
      for (; c + 2 <= (kFull ? VN : VN - 1); c += 2) {  // two whole vectors
        const auto [x, y] = load_float_pair(row + c * kLanes);
        a[c] = at::vec::fmadd(w, x, a[c]), a[c + 1] = at::vec::fmadd(w, y, a[c + 1]);
      }
    }
    for (; c < VN; ++c) {
      const Vec x = full(c) ? load_float(row + c * kLanes) : load_float(row + c * kLanes, last);
      a[c] = at::vec::fmadd(w, x, a[c]);
    }
  }
  for (int c = 0; c < VN; ++c) {
    if (full(c)) a[c].store(acc + e0 + c * kLanes); else a[c].store(acc + e0 + c * kLanes, last);
  }
}

// f(std::integral_constant<int, count>) for a count of 1 … N known only at run time.
template <int N, typename F>
inline void with_count(int64_t count, F&& f) {
  if constexpr (N > 1) {
    if (count < N) return with_count<N - 1>(count, f);
  }
  f(std::integral_constant<int, N>{});
}

// Vectors of a value row's piece one add_block holds per query row: its 4 × kValueVecs
// accumulators, the piece and the weights fit in the vector registers (16 of AVX2's 8 lanes, 32 of
// AVX-512's 16: 64 features at a time there). A lone row takes up to kRowVecs at a time: 128
// features on AVX-512 (a D 128 value row summed in one pass over the keys, not two: lone-row
// decoding at D 128 6–10 % faster), 64 elsewhere.
constexpr int kValueVecs = kLanes >= 16 ? 4 : 2;
constexpr int kRowVecs = kLanes >= 16 ? 8 : static_cast<int>(64 / kLanes);

// Whether Σ p v takes each of the 4 to 8 query rows of an item's one key/value head on its own,
// its whole value row summed at once (add_row), where four rows at a time (add_block) would sum
// it in pieces of a cache line each, in short steps of keys: float32 value rows of 33 to 64
// features in AVX2 builds (in-process A/B, Intel Xeon, D 64, the same bits: each row adds its keys
// in the same order; grouped-query 4 rows in L2 (1 core) 7–12 % faster, from memory (2 threads)
// 5–9 %, multi-head 4 or 8 tokens 2–4 %; alone, D 32 (two pieces) 22 % slower, bfloat16 (a row
// widened once per query row) 12 %, AVX-512 D 128 14 %, 16 to 32 rows 0–2 %, paged items of 8
// heads, whose blocks of value rows stay in L1 less, 5 %).
template <typename T>
constexpr bool lone_rows(int64_t Dv, int64_t rows, int64_t heads) {
  return kAvx2Build && std::is_same_v<T, float> && heads == 1 && rows <= 8 && Dv > 32 &&
         Dv <= kRowVecs * kLanes;
}

// Whether Σ p v of `rows` query rows per key/value head (of `heads` in the item) should take a
// block's keys a few at a time: where a value row is summed in more than one piece, each piece
// reads the block's value rows again. For float32 value rows in pieces of four rows, a block of
// them larger than 4 KiB (Dv above 32), with the next pass's rows coming in, no longer stays in
// the L1 cache (in-process A/B, grouped-query, steps of 8 keys: AVX2 D 128 28–33 % faster, D 64
// 8–13 %; AVX-512 D 128 (two pieces) 4–11 %; AVX2 D 32 (two pieces, 4 KiB) 9–15 % slower;
// bfloat16 rows are half the bytes, and their widening makes the shorter steps' extra
// accumulator loads cost more than they save). An item of several heads (a page's tokens) holds
// every head's block of value rows: any row summed in pieces takes short steps; a row summed
// whole, the block's keys at once (in-process A/B, Intel Xeon, 2 threads, paged: AVX-512 D 64
// 2–6 % faster; AVX2 multi-head D 128, two pieces a row, 4 % slower at once).
template <typename T>
constexpr bool short_value_steps(int64_t Dv, int64_t rows, int64_t heads) {
  const bool blocks = rows >= 4 && !lone_rows<T>(Dv, rows, heads);  // (four rows at a time)
  const int64_t piece = (blocks ? kValueVecs : kRowVecs) * kLanes;
  if (heads > 1) return Dv > piece;
  return std::is_same_v<T, float> && rows >= 4 && Dv > piece && Dv > 32;
}

// acc (rows × Dv) += p (rows × n, rows p_stride apart) · V, value row j at v[j] + offset: rows four
// at a time (none where lone_rows, the item having `heads` key/value heads), Dv in pieces of
// kValueVecs whole vectors (then of two), then whole vectors, then a partial one; then the rows
// left one at a time, Dv in pieces of up to kRowVecs (the last partial).
template <typename T>
void add_values(float* acc, const float* p, int64_t p_stride, int64_t rows, const T* const* v,
                int64_t offset, int64_t n, int64_t Dv, int64_t heads, const Ahead<T>& ahead) {
  const Ahead<T> none{};
  const int64_t four = lone_rows<T>(Dv, rows, heads) ? 0 : rows / 4 * 4;
  int64_t e0 = 0;
  if (four > 0) {
    for (; e0 + kValueVecs * kLanes <= Dv; e0 += kValueVecs * kLanes)
      add_piece<T, kValueVecs, true>(acc, p, p_stride, four, v, offset, n, Dv, e0, kLanes,
                                     e0 == 0 ? ahead : none);
    if constexpr (kValueVecs > 2) {  // a rest of two vectors in one piece (D 32 on AVX-512)
      for (; e0 + 2 * kLanes <= Dv; e0 += 2 * kLanes)
        add_piece<T, 2, true>(acc, p, p_stride, four, v, offset, n, Dv, e0, kLanes,
                              e0 == 0 ? ahead : none);
    }
    for (; e0 + kLanes <= Dv; e0 += kLanes)
      add_piece<T, 1, true>(acc, p, p_stride, four, v, offset, n, Dv, e0, kLanes,
                            e0 == 0 ? ahead : none);
    if (e0 < Dv)
      add_piece<T, 1, false>(acc, p, p_stride, four, v, offset, n, Dv, e0, Dv - e0,
                             e0 == 0 ? ahead : none);
  }
  for (int64_t r = four; r < rows; ++r) {
    float* a = acc + r * Dv;
    const float* w = p + r * p_stride;
    const auto first = [&](int64_t e) { return r == 0 && e == 0 ? ahead : none; };
    for (e0 = 0; e0 < Dv; e0 += kRowVecs * kLanes) {
      const int64_t width = std::min<int64_t>(kRowVecs * kLanes, Dv - e0);
      const int64_t vecs = (width + kLanes - 1) / kLanes, last = width - (vecs - 1) * kLanes;
      with_count<kRowVecs>(vecs, [&](auto count) {
        constexpr int VN = decltype(count)::value;
        if (last == kLanes)
          add_row<T, VN, true>(a, w, v, offset, n, e0, last, first(e0));
        else
          add_row<T, VN, false>(a, w, v, offset, n, e0, last, first(e0));
      });
    }
  }
}

// Round `Round` of lane_sums: a and b side by side, their lanes summed in pairs, so that each
// vector's runs of summed lanes are twice as long and its runs of lanes half as many. On x86 the
// first two rounds stay within each 128-bit lane (unpacks: round 0 adds lanes 4i and 4i + 2, 4i + 1
// and 4i + 3; round 1 those two sums), the rest pair whole 128-bit lanes, so that only the last
// rounds shuffle across lanes (in-process A/B against deinterleaving in every round: grouped-query
// decoding 1–6 % faster on AVX-512 and AVX2); elsewhere every round deinterleaves the two vectors
// and adds the halves.
template <int Round>
[[gnu::always_inline]] inline Vec pair_sums(const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 x = a, y = b;
  if constexpr (Round == 0) {
    return Vec(_mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y)));
  } else if constexpr (Round == 1) {
    const __m512d xd = _mm512_castps_pd(x), yd = _mm512_castps_pd(y);
    return Vec(_mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(xd, yd)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(xd, yd))));
  } else {  // 128-bit lanes 0, 2 of x and of y against 1, 3
    return Vec(_mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD)));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 x = a, y = b;
  if constexpr (Round == 0) {
    return Vec(_mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y)));
  } else if constexpr (Round == 1) {
    const __m256d xd = _mm256_castps_pd(x), yd = _mm256_castps_pd(y);
    return Vec(_mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(xd, yd)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(xd, yd))));
  } else {  // the low 128-bit lanes of x and y against the high ones
    return Vec(
        _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31)));
  }
#else
  const auto [even, odd] = at::vec::deinterleave2(a, b);
  return even + odd;
#endif
}

// One round of lane_sums over N vectors: x[2i] and x[2i + 1] paired, for i < N / 2.
template <int Round, size_t N, size_t... I>
[[gnu::always_inline]] inline std::array<Vec, N / 2> pair_round(const std::array<Vec, N>& x,
                                                                 std::index_sequence<I...>) {
  return {pair_sums<Round>(x[2 * I], x[2 * I + 1])...};
}

// The lane sums of N vectors x (N a power of two, at most kLanes): lane i of the result is Σ lanes
// of x[i]. Each round pairs the vectors (pair_sums), halving their count; once one is left it is
// paired with itself, for log2(kLanes) rounds in all. Every sum is the same balanced tree of its
// own lanes, whatever N and its place among them. The vectors are values indexed by constants (an
// array indexed in a loop is kept in memory by the compiler, a store and a load per round).
template <size_t N, int Round = 0>
[[gnu::always_inline]] inline Vec lane_sums(const std::array<Vec, N>& x) {
  static_assert(N >= 1 && (N & (N - 1)) == 0 && N <= kLanes);
  if constexpr ((int64_t{1} << Round) == kLanes) {
    return x[0];
  } else if constexpr (N == 1) {
    return lane_sums<1, Round + 1>({pair_sums<Round>(x[0], x[0])});
  } else {
    return lane_sums<N / 2, Round + 1>(pair_round<Round, N>(x, std::make_index_sequence<N / 2>{}));
  }
}

// s[r · stride + k] = lane r · KB + k of x, for r < RB, k < KB: each row's run of lanes stored
// at once on x86 (a 128-bit lane, or half of one), not lane by lane through memory.
template <int RB, int KB>
[[gnu::always_inline]] inline void store_rows(const Vec& x, float* s, int64_t stride) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (KB == 4) {
    const __m512 v = x;
    _mm_storeu_ps(s, _mm512_castps512_ps128(v));
    if constexpr (RB > 1) _mm_storeu_ps(s + stride, _mm512_extractf32x4_ps(v, 1));
    if constexpr (RB > 2) _mm_storeu_ps(s + 2 * stride, _mm512_extractf32x4_ps(v, 2));
    if constexpr (RB > 3) _mm_storeu_ps(s + 3 * stride, _mm512_extractf32x4_ps(v, 3));
    return;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 v = x;
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  if constexpr (KB == 4) {
    _mm_storeu_ps(s, lo);
    if constexpr (RB > 1) _mm_storeu_ps(s + stride, hi);
    return;
  } else if constexpr (KB == 2 && RB == 4) {
    _mm_storel_pi(reinterpret_cast<__m64*>(s), lo);
    _mm_storeh_pi(reinterpret_cast<__m64*>(s + stride), lo);
    _mm_storel_pi(reinterpret_cast<__m64*>(s + 2 * stride), hi);
    _mm_storeh_pi(reinterpret_cast<__m64*>(s + 3 * stride), hi);
    return;
  }
#endif
  float sums[kLanes];
  x.store(sums);
  for (int r = 0; r < RB; ++r)
    for (int k = 0; k < KB; ++k) s[r * stride + k] = sums[r * KB + k];
}

// x held in a vector register: the compiler may not fold its load into each instruction that
// uses it, so a query vector is loaded once for the block's keys, not once per key (GCC folds it
// into every multiply-add, and the loads, not the multiply-adds, then bound the block: in-process
// A/B, 1 thread, grouped-query 8/2 and 32/8, 8,192 keys: float32 3–16 % faster on AVX-512 (8/2,
// whose 8–16 MB stay in L3: 12–16 %), float32 and bfloat16 1–14 % on AVX2; the same bits).
[[gnu::always_inline]] inline void in_register(Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r = x;
  asm("" : "+v"(r));
  x = Vec(r);
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 r = x;
  asm("" : "+x"(r));
  x = Vec(r);
#endif
}

// Keys per block of scores for RB query rows: RB × KB dot products fit one vector of lane sums,
// and at most 4 keys, whose addresses the compiler keeps in general registers.
template <int RB>
constexpr int kBlockKeys = std::min(static_cast<int>(kLanes) / RB, 4);

// bfloat16 dot products in pairs (AVX512-BF16's vdpbf16ps: a lane adds the products of two
// neighbouring features, each exact in float32, one after the other; subnormal numbers count as
// 0) where the build's instructions have them: a bfloat16 key is then read as it lies, 32
// features a vector, with no widening, and its query row is kept in bfloat16 (exactly: the query
// was bfloat16). Elsewhere every key is widened to float32. Grouped-query bfloat16 decoding:
// 15–27 % faster. (Σ p v in pair dots, the weights rounded to bfloat16, measured no faster: the
// value rows' loop waits on memory, not on its arithmetic.)
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define QKV_PAIR_DOTS 1
constexpr bool kPairDots = true;
#else
constexpr bool kPairDots = false;
#endif

// The query rows' type for keys of type T: bfloat16 where pair dots read bfloat16 keys.
template <typename T>
using QueryOf = std::conditional_t<kPairDots && std::is_same_v<T, at::BFloat16>, T, float>;

// a[r · KB + k] += the dot product of query row r (rows D apart) and key k, in pairs of features
// (kPairDots builds only; 32 features a step, the last step's missing features read as 0).
template <int RB, int KB>
[[gnu::always_inline]] inline void pair_products(const at::BFloat16* q,
                                                 const at::BFloat16* const* keys, int64_t D,
                                                 std::array<Vec, RB * KB>& a) {
#ifdef QKV_PAIR_DOTS
  const auto step = [&](int64_t d, __mmask32 lanes) {
    __m512bh key[KB];
    for (int k = 0; k < KB; ++k) key[k] = (__m512bh)_mm512_maskz_loadu_epi16(lanes, keys[k] + d);
    for (int r = 0; r < RB; ++r) {
      const auto x = (__m512bh)_mm512_maskz_loadu_epi16(lanes, q + r * D + d);
      for (int k = 0; k < KB; ++k) a[r * KB + k] = Vec(_mm512_dpbf16_ps(a[r * KB + k], x, key[k]));
    }
  };
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) step(d, ~__mmask32{0});
  if (d < D) step(d, static_cast<__mmask32>((uint64_t{1} << (D - d)) - 1));
#endif
}

// Scores of RB query rows (rows of D in q, D apart) against KB = kBlockKeys<RB> keys (key k at
// keys[k]): s[r · stride + k]. Each key vector is loaded (and widened, or read in pairs where Q
// is bfloat16: QueryOf) once for the RB rows, each query vector once for the keys, and the RB ×
// KB dot products are summed across their lanes together (lane_sums).
template <typename T, int RB, typename Q>
[[gnu::always_inline]] inline void block_scores(const Q* q, const T* const* keys, int64_t D,
                                                float* s, int64_t stride) {
  constexpr int KB = kBlockKeys<RB>;
  std::array<Vec, RB * KB> a;
  a.fill(Vec(0.f));
  if constexpr (std::is_same_v<Q, at::BFloat16>) {
    pair_products<RB, KB>(q, keys, D, a);
  } else {
    const auto step = [&](int64_t d, int64_t count) {
      Vec key[KB];
      for (int k = 0; k < KB; ++k)
        key[k] = count == kLanes ? load_float(keys[k] + d) : load_float(keys[k] + d, count);
      for (int r = 0; r < RB; ++r) {
        Vec x = count == kLanes ? Vec::loadu(q + r * D + d) : Vec::loadu(q + r * D + d, count);
        in_register(x);
        for (int k = 0; k < KB; ++k) a[r * KB + k] = at::vec::fmadd(x, key[k], a[r * KB + k]);
      }
    };
    // Two steps at once where one load widens a key's two vectors and AVX2's 16 registers hold
    // them: the accumulators, two vectors a key, two query vectors. (Its multiply-adds repeat
    // step's: one helper taking the keys by pointer made GCC keep them in memory, float32 scores
    // 40 % slower.)
    const auto steps = [&](int64_t d) {
      Vec key[KB], next[KB];
      for (int k = 0; k < KB; ++k) std::tie(key[k], next[k]) = load_float_pair(keys[k] + d);
      for (int r = 0; r < RB; ++r) {
        Vec x = Vec::loadu(q + r * D + d), y = Vec::loadu(q + r * D + d + kLanes);
        in_register(x), in_register(y);
        for (int k = 0; k < KB; ++k) a[r * KB + k] = at::vec::fmadd(x, key[k], a[r * KB + k]);
        for (int k = 0; k < KB; ++k) a[r * KB + k] = at::vec::fmadd(y, next[k], a[r * KB + k]);
      }
    };
    int64_t d = 0;
    if constexpr (kPairLoads<T> && RB * KB + 2 * KB + 2 <= 16) {
      for (; d + 2 * kLanes <= D; d += 2 * kLanes) steps(d);
    }
    for (; d + kLanes <= D; d += kLanes) step(d, kLanes);
    if (d < D) step(d, D - d);
  }
  store_rows<RB, KB>(lane_sums<RB * KB>(a), s, stride);
}

}  // namespace
