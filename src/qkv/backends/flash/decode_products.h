// The products of decoding's core (decode.h), for a chunk of keys: scores of a block of query
// rows against a block of keys, summed across lanes together (block_scores, lane_sums), and
// acc += p · V over the chunk's value rows (add_values), with the loads that widen bfloat16 and
// the prefetches that ask for the next chunk's rows meanwhile. Keys and values are reached by a
// pointer per row, so any layout (a contiguous cache, pages, packed sequences) runs this code.

#pragma once

#include "row_math.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>

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

// Asks for the cache lines of n values (of type T) from x, into the cache levels near the core.
template <typename T>
inline void prefetch(const T* x, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(x);
  const int64_t size = n * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < size; b += 64) __builtin_prefetch(bytes + b, 0, 2);
}

// The value rows of the next chunk to ask for while a chunk's values are summed: row j at
// v[j] + offset, Dv values each, j < n (n 0: none).
template <typename T>
struct Ahead {
  const T* const* v = nullptr;
  int64_t n = 0, offset = 0, Dv = 0;
};

// acc[r][e0 … e0 + VN · kLanes) += Σ_{j < n} p[r · p_stride + j] · v_j[e0 …] for NR rows (NR 1
// or 4, acc rows acc_stride apart; VN 1 or 2 vectors), v_j at v[j] + offset; the last vector only
// its first `last` lanes unless kFull. The accumulators are named variables, not an array: an
// array of vectors is kept in memory by the compiler (a store per multiply-add), variables stay
// in registers over the keys.
template <typename T, int NR, int VN, bool kFull>
inline void add_block(float* acc, int64_t acc_stride, const float* p, int64_t p_stride,
                      const T* const* v, int64_t offset, int64_t n, int64_t e0, int64_t last,
                      const Ahead<T>& ahead) {
  static_assert((NR == 1 || NR == 4) && (VN == 1 || VN == 2));
  const auto full = [](int c) { return kFull || c + 1 < VN; };
  const auto load = [&](int r, int c) {
    const float* x = acc + r * acc_stride + e0 + c * kLanes;
    return full(c) ? Vec::loadu(x) : Vec::loadu(x, last);
  };
  const auto store = [&](const Vec& sum, int r, int c) {
    float* x = acc + r * acc_stride + e0 + c * kLanes;
    if (full(c)) sum.store(x); else sum.store(x, last);
  };
  Vec a00 = load(0, 0), a01, a10, a11, a20, a21, a30, a31;
  if constexpr (VN == 2) a01 = load(0, 1);
  if constexpr (NR == 4) {
    a10 = load(1, 0), a20 = load(2, 0), a30 = load(3, 0);
    if constexpr (VN == 2) a11 = load(1, 1), a21 = load(2, 1), a31 = load(3, 1);
  }
  for (int64_t j = 0; j < n; ++j) {
    if (j < ahead.n) prefetch(ahead.v[j] + ahead.offset, ahead.Dv);
    const T* row = v[j] + offset + e0;
    const Vec x0 = full(0) ? load_float(row) : load_float(row, last);
    Vec x1;
    if constexpr (VN == 2) x1 = kFull ? load_float(row + kLanes) : load_float(row + kLanes, last);
    const Vec w0(p[j]);
    a00 = at::vec::fmadd(w0, x0, a00);
    if constexpr (VN == 2) a01 = at::vec::fmadd(w0, x1, a01);
    if constexpr (NR == 4) {
      const Vec w1(p[p_stride + j]), w2(p[2 * p_stride + j]), w3(p[3 * p_stride + j]);
      a10 = at::vec::fmadd(w1, x0, a10), a20 = at::vec::fmadd(w2, x0, a20);
      a30 = at::vec::fmadd(w3, x0, a30);
      if constexpr (VN == 2) {
        a11 = at::vec::fmadd(w1, x1, a11), a21 = at::vec::fmadd(w2, x1, a21);
        a31 = at::vec::fmadd(w3, x1, a31);
      }
    }
  }
  store(a00, 0, 0);
  if constexpr (VN == 2) store(a01, 0, 1);
  if constexpr (NR == 4) {
    store(a10, 1, 0), store(a20, 2, 0), store(a30, 3, 0);
    if constexpr (VN == 2) store(a11, 1, 1), store(a21, 2, 1), store(a31, 3, 1);
  }
}

// acc (rows × Dv, rows a multiple of four) += p (rows × n) · V, for one piece of VN vectors.
template <typename T, int VN, bool kFull>
inline void add_piece(float* acc, const float* p, int64_t p_stride, int64_t rows, const T* const* v,
                      int64_t offset, int64_t n, int64_t Dv, int64_t e0, int64_t last,
                      const Ahead<T>& ahead) {
  for (int64_t r = 0; r < rows; r += 4)
    add_block<T, 4, VN, kFull>(acc + r * Dv, Dv, p + r * p_stride, p_stride, v, offset, n, e0, last,
                               r == 0 ? ahead : Ahead<T>{});
}

// acc[e0 … e0 + VN · kLanes) += Σ_{j < n} p[j] · v_j[e0 …] for one query row, v_j at v[j] +
// offset: VN whole vectors (64 features: 256 bytes of accumulators, which the compiler keeps in
// registers over the keys).
template <typename T, int VN>
inline void add_row(float* acc, const float* p, const T* const* v, int64_t offset, int64_t n,
                    int64_t e0, const Ahead<T>& ahead) {
  Vec a[VN];
  for (int c = 0; c < VN; ++c) a[c] = Vec::loadu(acc + e0 + c * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    if (j < ahead.n) prefetch(ahead.v[j] + ahead.offset, ahead.Dv);
    const T* row = v[j] + offset + e0;
    const Vec w(p[j]);
    for (int c = 0; c < VN; ++c) a[c] = at::vec::fmadd(w, load_float(row + c * kLanes), a[c]);
  }
  for (int c = 0; c < VN; ++c) a[c].store(acc + e0 + c * kLanes);
}

// Vectors of a value row's piece one add_block holds per query row: its 4 × kValueVecs
// accumulators, the piece and the weight fit in 16 registers (AVX2 too). A lone row takes
// kRowVecs at a time (64 features).
constexpr int kValueVecs = 2;
constexpr int kRowVecs = static_cast<int>(64 / kLanes);

// acc (rows × Dv) += p (rows × n, rows p_stride apart) · V, value row j at v[j] + offset: rows four
// at a time, Dv in pieces of kValueVecs whole vectors, then whole vectors, then a partial one;
// then the rows left one at a time, Dv in pieces of kRowVecs, then as the four.
template <typename T>
void add_values(float* acc, const float* p, int64_t p_stride, int64_t rows, const T* const* v,
                int64_t offset, int64_t n, int64_t Dv, const Ahead<T>& ahead) {
  const Ahead<T> none{};
  const int64_t four = rows / 4 * 4;
  int64_t e0 = 0;
  if (four > 0) {
    for (; e0 + kValueVecs * kLanes <= Dv; e0 += kValueVecs * kLanes)
      add_piece<T, kValueVecs, true>(acc, p, p_stride, four, v, offset, n, Dv, e0, kLanes,
                                     e0 == 0 ? ahead : none);
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
    for (e0 = 0; e0 + kRowVecs * kLanes <= Dv; e0 += kRowVecs * kLanes)
      add_row<T, kRowVecs>(a, w, v, offset, n, e0, first(e0));
    for (; e0 + kLanes <= Dv; e0 += kLanes)
      add_block<T, 1, 1, true>(a, Dv, w, p_stride, v, offset, n, e0, kLanes, first(e0));
    if (e0 < Dv)
      add_block<T, 1, 1, false>(a, Dv, w, p_stride, v, offset, n, e0, Dv - e0, first(e0));
  }
}

// The lane sums of N vectors x[0 … N) (N a power of two, at most kLanes; x is overwritten):
// lane i of the result is Σ lanes of x[i]. Deinterleaving two vectors and adding the halves puts
// both vectors' pair sums side by side in one vector; log2(kLanes) such rounds (a lone vector
// paired with itself once they are one) leave each sum in its own lane. Every sum is the same
// balanced tree of its own lanes, whatever N and its place among them.
template <int N>
[[gnu::always_inline]] inline Vec lane_sums(Vec (&x)[N]) {
  static_assert(N >= 1 && (N & (N - 1)) == 0 && N <= kLanes);
  int count = N;
  for (int width = 1; width < kLanes; width *= 2) {
    for (int i = 0; i < std::max(count / 2, 1); ++i) {
      const Vec& other = count > 1 ? x[2 * i + 1] : x[2 * i];
      const auto [even, odd] = at::vec::deinterleave2(x[2 * i], other);
      x[i] = even + odd;
    }
    count = std::max(count / 2, 1);
  }
  return x[0];
}

// Keys per block of scores for RB query rows: RB × KB dot products fit one vector of lane sums,
// and at most 4 keys, whose addresses the compiler keeps in general registers.
template <int RB>
constexpr int kBlockKeys = std::min(static_cast<int>(kLanes) / RB, 4);

// Scores of RB query rows (rows of D in q, D apart) against KB = kBlockKeys<RB> keys (key k at
// keys[k]): s[r · stride + k]. Each key vector is loaded (and widened) once for the RB rows, each
// query vector once for the keys, and the RB × KB dot products are summed across their lanes
// together (lane_sums).
template <typename T, int RB>
[[gnu::always_inline]] inline void block_scores(const float* q, const T* const* keys, int64_t D,
                                                float* s, int64_t stride) {
  constexpr int KB = kBlockKeys<RB>;
  Vec a[RB * KB];
  for (Vec& x : a) x = Vec(0.f);
  const auto step = [&](int64_t d, int64_t count) {
    Vec key[KB];
    for (int k = 0; k < KB; ++k)
      key[k] = count == kLanes ? load_float(keys[k] + d) : load_float(keys[k] + d, count);
    for (int r = 0; r < RB; ++r) {
      const Vec x = count == kLanes ? Vec::loadu(q + r * D + d) : Vec::loadu(q + r * D + d, count);
      for (int k = 0; k < KB; ++k) a[r * KB + k] = at::vec::fmadd(x, key[k], a[r * KB + k]);
    }
  };
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) step(d, kLanes);
  if (d < D) step(d, D - d);
  float sums[kLanes];
  lane_sums<RB * KB>(a).store(sums);
  for (int r = 0; r < RB; ++r)
    for (int k = 0; k < KB; ++k) s[r * stride + k] = sums[r * KB + k];
}

}  // namespace
