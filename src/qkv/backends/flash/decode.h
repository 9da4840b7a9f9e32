// Decoding: a few query tokens per sequence against its cached keys, on one core for every
// decoding path (decode_dense here; paged.h's pages and packed sequences). A work item is (a
// group of up to kGroupTokens query tokens of one sequence, a block of key/value heads, a split of
// the keys): every query head of its tokens that shares a key/value head is computed together, so
// each K and V row is read once per call, in the order it lies in memory. The keys are read a pass
// at a time: the scores of all the pass's keys, then block by block of kChunk keys an online
// softmax step (a running maximum m and sum l per query row, in base 2) and Σ p v, so no row of
// scores as long as the cache is ever held. The blocks fix the arithmetic; a pass only the order
// memory is read in (pass_span), so any pass gives the same bits.
// Where the items are fewer than kSplitItems (a constant: the same bits on any number of threads),
// the keys are split (flash-decoding): each split gives partial (acc, m, l) per row, merged
// exactly through their log-sum-exps. Items, splits and blocks start at multiples of kChunk
// counted from key 0, whatever layout holds the keys: two layouts with the same keys run the very
// same arithmetic. float32 throughout: bfloat16 inputs are widened as they are read (bfloat16
// scores take AVX512-BF16's pair dot products where the build has them: decode_products.h). A
// pass's scores take a block of query rows × keys at a time and sum their dot products across
// lanes together (lane_sums), meanwhile asking memory for the key rows a pass (or kAheadBytes)
// ahead (and their value rows where one key/value head serves several query rows; else while the
// values are summed).
//
// A Layout gives the core a call's sizes and where things lie: Hq, Hkv, D, Dv, kv_limit (the most
// key/value heads one item may take), c (the exponent scale), scored (score rules); per query
// token t and head h: query(t, h), bounds(t, h) = its keys [lo, hi) (in its sequence's numbering),
// rule(t, h) (its score rules, d0 for key 0), out(t, h), lse(t, h); per sequence s and key j: the
// run of keys from j that lie at fixed strides, run(s, j, end), for key/value head 0 (head kv is
// kv · k_head further); k_key, v_key, k_head, v_head strides; segments: (sequence, first token,
// end token) for each sequence that has query tokens.

#pragma once

#include "decode_products.h"
#include "row_math.h"
#include "rules.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kChunk = 32;        // keys per step of the online softmax
constexpr int64_t kLoneSpan = 256;    // the most keys a pass of one row per key/value head takes
constexpr int64_t kPassBytes = int64_t{64} << 10;  // … and the most bytes of K and V it reads
// Keys of Σ p v per head in turn where an item has several heads, or where a block's float32
// value rows are summed in many pieces (short_value_steps).
constexpr int64_t kValueKeys = 8;
constexpr int64_t kGroupTokens = 8;   // query tokens of one sequence per work item
constexpr int64_t kItemRows = 128;    // query rows (tokens × heads) an item aims to hold at most
constexpr int64_t kSplitKeys = 1024;  // the fewest keys a split gets where splits are chosen
// Splits are chosen so that a call has at least kSplitItems work items: a number of the call's
// sizes alone, never of the thread count, so one thread and many give the same bits.
constexpr int64_t kSplitItems = 32;
// Calls that read at most this many bytes of keys and values do not ask for rows ahead: such a
// cache is likely still in the CPU's caches from its last step, where the requests cost more
// instructions than they save (a number of the call, never of the CPU).
constexpr int64_t kStreamBytes = int64_t{4} << 20;
// The fewest bytes of keys and values a thread is woken for.
constexpr int64_t kThreadBytes = int64_t{256} << 10;
// An item asks for rows about this many bytes of key rows (all its heads) ahead, at most a pass
// (in-process A/B, Intel Xeon, 2 threads, paged, 8 heads, D 128: a pass ahead 3–9 % slower).
constexpr int64_t kAheadBytes = int64_t{32} << 10;

// A run of keys that lie at the layout's strides: key/value head 0 of its first key, and how many.
template <typename T>
struct KeyRun { const T *k, *v; int64_t n; };

// One work item: query tokens [t0, t1) of sequence s, key/value heads [kv0, kv1), keys [a, b),
// read `span` keys a pass.
struct Item {
  int64_t s, t0, t1, kv0, kv1, a, b, span;

  int64_t heads() const { return kv1 - kv0; }
  // query rows per key/value head, and in all, for g query heads per key/value head
  int64_t per_kv(int64_t g) const { return (t1 - t0) * g; }
  int64_t rows(int64_t g) const { return per_kv(g) * heads(); }
};

// A thread's buffers for the item it runs: R query rows, row r = ((kv − kv0) · tokens + t − t0) ·
// g + (h mod g), their queries (float32 in q, or bfloat16 in qb where QueryOf says so), one
// pass's scores (rows `span` apart), outputs, and their key bounds and rules; m, l as the online
// softmax keeps them. Kept by each thread from call to call (they only grow), so a small call
// allocates nothing.
struct Rows {
  std::vector<float> q, s, acc, m, l;
  std::vector<at::BFloat16> qb;
  std::vector<int64_t> lo, hi;
  std::vector<RowRules> rules;

  void resize(int64_t R, int64_t D, int64_t Dv, int64_t scores) {
    const auto grow = [](auto& x, int64_t n) {
      if (static_cast<int64_t>(x.size()) < n) x.resize(n);
    };
    grow(q, R * D), grow(qb, R * D), grow(s, scores), grow(acc, R * Dv), grow(m, R), grow(l, R);
    grow(lo, R), grow(hi, R), grow(rules, R);
  }
};

// This thread's Rows, large enough for the call.
inline Rows& thread_rows(int64_t R, int64_t D, int64_t Dv, int64_t scores) {
  thread_local Rows rows;
  rows.resize(R, D, Dv, scores);
  return rows;
}

// The item's query rows as the scores read them (QueryOf<T>).
template <typename T>
QueryOf<T>* queries(Rows& w) {
  if constexpr (std::is_same_v<QueryOf<T>, float>) return w.q.data(); else return w.qb.data();
}

template <typename T, typename L>
void gather_rows(const L& lay, const Item& item, Rows& w) {
  const int64_t g = lay.Hq / lay.Hkv;
  int64_t r = 0;
  for (int64_t kv = item.kv0; kv < item.kv1; ++kv)
    for (int64_t t = item.t0; t < item.t1; ++t)
      for (int64_t h = kv * g; h < (kv + 1) * g; ++h, ++r) {
        const T* x = lay.query(t, h);
        QueryOf<T>* row = queries<T>(w) + r * lay.D;
        for (int64_t d = 0; d < lay.D; ++d) row[d] = static_cast<QueryOf<T>>(x[d]);
        const auto [lo, hi] = lay.bounds(t, h);
        w.lo[r] = std::max(lo, item.a), w.hi[r] = std::min(hi, item.b);
        if (lay.scored) w.rules[r] = lay.rule(t, h);
      }
  const int64_t R = r;
  std::fill(w.m.begin(), w.m.begin() + R, kNegInf);
  std::fill(w.l.begin(), w.l.begin() + R, 0.f);
  std::fill(w.acc.begin(), w.acc.begin() + R * lay.Dv, 0.f);
}

// Row r's scores s of keys [c0, c0 + n) (in place) become its weights 2^(s_j · c − m) under
// its running maximum m (moved up, its sums rescaled, where the block holds a larger score);
// keys it may not see get weight 0.
template <typename L>
inline void softmax_step(const L& lay, Rows& w, int64_t r, float* s, int64_t c0, int64_t n) {
  const int64_t x0 = std::clamp(w.lo[r] - c0, int64_t{0}, n);
  const int64_t x1 = std::clamp(w.hi[r] - c0, x0, n);
  std::fill(s, s + x0, 0.f);
  std::fill(s + x1, s + n, 0.f);
  if (x0 == x1) return;
  float* x = s + x0;
  const int64_t seen = x1 - x0;
  if (lay.scored) {
    RowRules rule = w.rules[r];
    rule.d0 -= c0 + x0;
    modify_row(x, seen, rule);
  }
  const float top = row_max(x, seen, lay.c);
  if (top == kNegInf) {  // only −inf (or NaN) scores: nothing to add, but NaN is passed on
    if (any_nan(x, seen)) w.l[r] = std::numeric_limits<float>::quiet_NaN();
    std::fill(x, x + seen, 0.f);
    return;
  }
  if (top > w.m[r]) {
    if (w.m[r] != kNegInf) {
      const float f = std::exp2(w.m[r] - top);
      float* a = w.acc.data() + r * lay.Dv;
      for (int64_t e = 0; e < lay.Dv; ++e) a[e] *= f;
      w.l[r] *= f;
    }
    w.m[r] = top;
  }
  w.l[r] += exp_row<float>(x, x, seen, lay.c, w.m[r]).sum;
}

// Where the keys [c0, c1) of one pass lie: key c0 + i's key and value rows of head 0.
template <typename T>
struct PassRows {
  std::array<const T*, std::max(kChunk, kLoneSpan)> k, v;
  int64_t c0 = 0, n = 0;
};
template <typename T, typename L>
void locate(const L& lay, int64_t s, int64_t c0, int64_t c1, PassRows<T>& rows) {
  rows.c0 = c0, rows.n = std::max<int64_t>(0, c1 - c0);
  for (int64_t j = c0; j < c1;) {
    const KeyRun<T> run = lay.run(s, j, c1);
    const T *k = run.k, *v = run.v;  // (stepped, not multiplied: vector 64-bit products are slow)
    for (int64_t i = j - c0; i < j - c0 + run.n; ++i, k += lay.k_key, v += lay.v_key)
      rows.k[i] = k, rows.v[i] = v;
    j += run.n;
  }
}

// The value rows asked ahead that a pass's scores ask for with their key rows (Dv 0: none): head
// kv0 + x's at ahead.v[i] + offset + x · head.
struct ValuesAhead { int64_t offset = 0, head = 0, Dv = 0; };

// Rows r0 … r0 + RB − 1 of each key/value head's query rows against a pass's keys, for
// pass_scores (which says how). One row of an item with one key/value head (a lone row of a
// contiguous cache) takes a loop of its own, free of the heads' address arithmetic (and of
// `values`: a lone row's value rows are asked for while its values are summed).
template <typename T, int RB>
void score_block_rows(const QueryOf<T>* q, int64_t per_kv, int64_t heads, int64_t D,
                      const PassRows<T>& now, int64_t offset, int64_t k_head, float* s,
                      int64_t stride, const PassRows<T>& ahead, const ValuesAhead& values,
                      int64_t r0) {
  constexpr int KB = kBlockKeys<RB>;
  const int64_t n = now.n, last = n - 1, ahead_n = r0 == 0 ? ahead.n : 0;
  std::array<const T*, KB> keys;
  if (RB == 1 && heads == 1) {  // one key/value head: its row r0
    const QueryOf<T>* qr = q + r0 * D;
    float* sr = s + r0 * stride;
    for (int64_t i = 0; i < n; i += KB) {
      for (int64_t y = i; y < std::min<int64_t>(i + KB, ahead_n); ++y)
        prefetch(ahead.k[y] + offset, D);
      for (int k = 0; k < KB; ++k) keys[k] = now.k[std::min<int64_t>(i + k, last)] + offset;
      block_scores<T, RB>(qr, keys.data(), D, sr + i, stride);
    }
    return;
  }
  for (int64_t i = 0; i < n; i += KB) {
    for (int64_t x = 0; x < heads; ++x) {
      const int64_t at = offset + x * k_head, row = x * per_kv + r0;
      for (int64_t y = i; y < std::min<int64_t>(i + KB, ahead_n); ++y) {
        prefetch(ahead.k[y] + at, D);
        if (values.Dv > 0) prefetch(ahead.v[y] + values.offset + x * values.head, values.Dv);
      }
      for (int k = 0; k < KB; ++k) keys[k] = now.k[std::min<int64_t>(i + k, last)] + at;
      block_scores<T, RB>(q + row * D, keys.data(), D, s + row * stride + i, stride);
    }
  }
}

// Scores of the item's query rows (per_kv rows of D from q for each of its key/value heads, head
// x's rows x · per_kv on) against the pass's keys (key i of head kv0 + x at keys[i] + offset + x ·
// k_head), into s (rows `stride` apart): rows four, then two, then one at a time, keys
// kBlockKeys<RB> at a time (a block past the pass's last key repeats that key; its scores land in
// columns past the keys, which the softmax never reads), each block of keys for every head before
// the next block, so that heads lying side by side (a page's token) are read together. The key
// rows `ahead` (and their value rows where `values` says) are asked for as the first row block
// goes, so memory streams while this pass computes.
template <typename T>
void pass_scores(const QueryOf<T>* q, int64_t per_kv, int64_t heads, int64_t D,
                 const PassRows<T>& now, int64_t offset, int64_t k_head, float* s, int64_t stride,
                 const PassRows<T>& ahead, const ValuesAhead& values) {
  int64_t r = 0;
  for (; r + 4 <= per_kv; r += 4)
    score_block_rows<T, 4>(q, per_kv, heads, D, now, offset, k_head, s, stride, ahead, values, r);
  for (; r + 2 <= per_kv; r += 2)
    score_block_rows<T, 2>(q, per_kv, heads, D, now, offset, k_head, s, stride, ahead, values, r);
  for (; r < per_kv; ++r)
    score_block_rows<T, 1>(q, per_kv, heads, D, now, offset, k_head, s, stride, ahead, values, r);
}

// One pass's keys for every row of the item: the scores of all its keys (each key row read once
// for the rows of its key/value head; meanwhile the key rows `ahead` are asked for), then block by
// block of kChunk keys the weights and Σ p v (meanwhile the value rows `ahead` of the same place,
// unless the scores asked for them), so that memory streams while this pass computes.
template <typename T, typename L>
void run_pass(const L& lay, const Item& item, Rows& w, const PassRows<T>& now,
              const PassRows<T>& ahead) {
  const int64_t g = lay.Hq / lay.Hkv, per_kv = item.per_kv(g), heads = item.heads();
  const int64_t R = item.rows(g), span = item.span;
  // Query rows sharing an item's one key/value head make its scores the longer part of a pass:
  // value rows are asked for with their keys (in-process A/B, Intel Xeon, 2 threads, from memory:
  // grouped-query 1–8 % faster natively, 2–13 % on AVX2; multi-head 0–5 %, paged 8 heads 1–14 %
  // slower).
  const bool early = per_kv > 1 && heads == 1;
  const ValuesAhead values{item.kv0 * lay.v_head, lay.v_head, early ? lay.Dv : 0};
  pass_scores<T>(queries<T>(w), per_kv, heads, lay.D, now, item.kv0 * lay.k_head, lay.k_head,
                 w.s.data(), span, ahead, values);
  for (int64_t b0 = 0; b0 < now.n; b0 += kChunk) {  // now.c0 is a multiple of kChunk
    const int64_t n = std::min(kChunk, now.n - b0);
    for (int64_t r = 0; r < R; ++r)
      softmax_step(lay, w, r, w.s.data() + r * span + b0, now.c0 + b0, n);
    // Σ p v for every head in turn, the block's keys at once or (short_value_steps) a few at a
    // time for every head before the next few; each row adds its keys in order either way.
    const int64_t step = short_value_steps<T>(lay.Dv, per_kv, heads) ? kValueKeys : n;
    for (int64_t j0 = b0; j0 < b0 + n; j0 += step) {
      const int64_t m = std::min(step, b0 + n - j0);
      const int64_t asked = early ? 0 : std::clamp(ahead.n - j0, int64_t{0}, m);
      for (int64_t kv = item.kv0; kv < item.kv1; ++kv) {
        const int64_t row = (kv - item.kv0) * per_kv;
        add_values(w.acc.data() + row * lay.Dv, w.s.data() + row * span + j0, span, per_kv,
                   now.v.data() + j0, kv * lay.v_head, m, lay.Dv, heads,
                   Ahead<T>{ahead.v.data() + j0, asked, kv * lay.v_head, lay.Dv});
      }
    }
  }
}

// The item's rows over its keys, pass by pass (passes end at multiples of the item's span). With
// `stream`, each pass asks memory for its keys' rows `ahead` keys on (kAheadBytes, at most a pass).
template <typename T, typename L>
void run_item(const L& lay, const Item& item, Rows& w, bool stream) {
  gather_rows<T>(lay, item, w);
  const int64_t span = item.span, row = item.heads() * lay.D * static_cast<int64_t>(sizeof(T));
  const int64_t ahead = std::clamp(kAheadBytes / std::max<int64_t>(row, 1), int64_t{1}, span);
  const auto end = [&](int64_t c0) { return std::min(item.b, (c0 / span + 1) * span); };
  PassRows<T> passes[3];
  static const PassRows<T> none{};
  PassRows<T>*now = &passes[0], *next = &passes[1], *asked = &passes[2];
  locate(lay, item.s, item.a, end(item.a), *now);
  while (now->n > 0) {
    const int64_t c1 = now->c0 + now->n;
    locate(lay, item.s, c1, c1 < item.b ? end(c1) : c1, *next);
    if (stream && ahead < span)
      locate(lay, item.s, std::min(now->c0 + ahead, item.b), std::min(c1 + ahead, item.b), *asked);
    run_pass<T>(lay, item, w, *now, !stream ? none : ahead < span ? *asked : *next);
    std::swap(now, next);
  }
}

// out = acc / l (0 for a row without keys), lse from (m, l), for the item's rows.
template <typename L>
void finish_rows(const L& lay, const Item& item, const Rows& w) {
  const int64_t g = lay.Hq / lay.Hkv;
  int64_t r = 0;
  for (int64_t kv = item.kv0; kv < item.kv1; ++kv)
    for (int64_t t = item.t0; t < item.t1; ++t)
      for (int64_t h = kv * g; h < (kv + 1) * g; ++h, ++r) {
        const float l = w.l[r], inverse = l == 0.f ? 0.f : 1.f / l;
        float* o = lay.out(t, h);
        for (int64_t e = 0; e < lay.Dv; ++e) o[e] = w.acc[r * lay.Dv + e] * inverse;
        *lay.lse(t, h) = row_lse(w.m[r], l);
      }
}

// The splits' partial rows of one item group merged: M = max m, l = Σ l_s 2^(m_s − M),
// out = Σ acc_s 2^(m_s − M) / l (partials: splits, stride apart, each R × Dv acc, R m, R l).
template <typename L>
void merge_splits(const L& lay, const Item& item, const float* part, int64_t splits,
                  int64_t stride, int64_t R, Rows& w) {
  for (int64_t r = 0; r < R; ++r) {
    float top = kNegInf;
    for (int64_t x = 0; x < splits; ++x) top = std::max(top, part[x * stride + R * lay.Dv + r]);
    float l = 0.f;
    float* acc = w.acc.data() + r * lay.Dv;
    std::fill(acc, acc + lay.Dv, 0.f);
    for (int64_t x = 0; x < splits; ++x) {
      const float* p = part + x * stride;
      const float m = p[R * lay.Dv + r], ls = p[R * lay.Dv + R + r];
      const float f = top == kNegInf ? 1.f : std::exp2(m - top);  // (m = −inf: 0)
      l += ls * f;
      if (ls != 0.f)
        for (int64_t e = 0; e < lay.Dv; ++e) acc[e] += p[r * lay.Dv + e] * f;
    }
    w.m[r] = top, w.l[r] = l;
  }
  finish_rows(lay, item, w);
}

// The work items of a call: each segment's tokens in groups of kGroupTokens, key/value heads in
// blocks of at most kv_limit and kItemRows rows, the keys in `splits` pieces (0: chosen here).
template <typename L>
std::vector<Item> plan_items(const L& lay, int64_t& splits) {
  const int64_t g = lay.Hq / lay.Hkv;
  std::vector<Item> groups;
  groups.reserve(lay.segments.size() * lay.Hkv);
  for (const auto& [s, first, end] : lay.segments)
    for (int64_t t0 = first; t0 < end; t0 += kGroupTokens) {
      const int64_t t1 = std::min(end, t0 + kGroupTokens);
      const int64_t block = std::clamp(kItemRows / ((t1 - t0) * g), int64_t{1}, lay.kv_limit);
      for (int64_t kv0 = 0; kv0 < lay.Hkv; kv0 += block) {
        Item item{s, t0, t1, kv0, std::min(lay.Hkv, kv0 + block), 0, 0, kChunk};
        int64_t a = std::numeric_limits<int64_t>::max(), b = 0;
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t h = item.kv0 * g; h < item.kv1 * g; ++h) {
            const auto [lo, hi] = lay.bounds(t, h);
            if (lo < hi) a = std::min(a, lo), b = std::max(b, hi);
          }
        item.a = a < b ? a / kChunk * kChunk : 0, item.b = a < b ? b : 0;
        groups.push_back(item);
      }
    }
  if (splits <= 0) {
    const int64_t n = static_cast<int64_t>(groups.size()), wanted = kSplitItems;
    int64_t longest = 0;
    for (const Item& item : groups) longest = std::max(longest, item.b - item.a);
    splits = n >= wanted ? 1 : std::clamp((wanted + n - 1) / std::max<int64_t>(n, 1), int64_t{1},
                                          std::max<int64_t>(1, longest / kSplitKeys));
  }
  return groups;
}

// The keys a pass of `item` reads: kChunk where its query rows share a key/value head (their
// products fill the work between two reads) or where the call streams (short passes keep the rows
// asked ahead near); one row per key/value head in a call the caches hold reads longer runs, up
// to kPassBytes of K and V (at most kLoneSpan keys), which spreads each pass's bookkeeping over
// more keys. element: the bytes of one K or V value.
template <typename L>
int64_t pass_span(const L& lay, const Item& item, int64_t element, bool stream) {
  if (stream || item.per_kv(lay.Hq / lay.Hkv) > 1) return kChunk;
  const int64_t row = item.heads() * (lay.D + lay.Dv) * element;
  return std::clamp(kPassBytes / row / kChunk * kChunk, kChunk, kLoneSpan);
}

// Split x of `splits` of an item's keys [a, b): a whole number of blocks of kChunk keys each.
inline Item split_item(const Item& item, int64_t x, int64_t splits) {
  const int64_t chunks = (item.b - item.a + kChunk - 1) / kChunk;
  const int64_t per = (chunks + splits - 1) / splits * kChunk;
  Item piece = item;
  piece.a = std::min(item.b, item.a + x * per), piece.b = std::min(item.b, item.a + (x + 1) * per);
  return piece;
}

// Runs a call on its layout: every item on the threads, then (split calls) the merge.
template <typename T, typename L>
void decode_core(const L& lay, int64_t splits) {
  std::vector<Item> groups = plan_items(lay, splits);
  const int64_t n = static_cast<int64_t>(groups.size()), g = lay.Hq / lay.Hkv;
  constexpr int64_t element = sizeof(T);
  int64_t R = 1, scores = 1, bytes = 0;
  for (const Item& item : groups)
    bytes += (item.b - item.a) * item.heads() * (lay.D + lay.Dv) * element;
  const bool stream = bytes > kStreamBytes;
  for (Item& item : groups) {
    item.span = pass_span(lay, item, element, stream);
    R = std::max(R, item.rows(g)), scores = std::max(scores, item.rows(g) * item.span);
  }
  const int64_t stride = R * (lay.Dv + 2);
  std::vector<float> parts(splits > 1 ? n * splits * stride : 0);
  // Other threads are woken only where each gets at least kThreadBytes. Items are handed out
  // one at a time (as the forward's blocks), so a thread that starts late (woken from sleep
  // after the caller ran alone) or runs slower takes fewer; which thread runs an item does not
  // change its sums.
  const int64_t total = n * splits;
  const int64_t threads = std::clamp<int64_t>(bytes / kThreadBytes, 1, at::get_num_threads());
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, std::min(threads, total), 1, [&](int64_t, int64_t) {
    Rows& w = thread_rows(R, lay.D, lay.Dv, scores);
    for (int64_t z; (z = next_item.fetch_add(1)) < total;) {
      const Item& item = groups[z / splits];
      run_item<T>(lay, split_item(item, z % splits, splits), w, stream);
      if (splits == 1) {
        finish_rows(lay, item, w);
        continue;
      }
      const int64_t rows = item.rows(g);
      float* p = parts.data() + z * stride;
      std::copy(w.acc.begin(), w.acc.begin() + rows * lay.Dv, p);
      std::copy(w.m.begin(), w.m.begin() + rows, p + rows * lay.Dv);
      std::copy(w.l.begin(), w.l.begin() + rows, p + rows * lay.Dv + rows);
    }
  });
  if (splits == 1) return;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    Rows& w = thread_rows(R, lay.D, lay.Dv, 0);
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = groups[i];
      merge_splits(lay, item, parts.data() + i * splits * stride, splits, stride, item.rows(g), w);
    }
  });
}

// A call of kernel.decode: q (NG, Lq, D) contiguous, k (N, S, D) and v (N, S, Dv) with
// contiguous rows, query head z using key/value head z / (NG / N); out (NG, Lq, Dv), lse (NG, Lq).
template <typename T>
struct DenseLayout {
  const T *qd, *kd, *vd;
  float *od, *ld;
  int64_t Hq, Hkv, D, Dv, Lq, kv_limit;
  int64_t k_key, v_key, k_head, v_head;
  float c;
  bool scored;
  const CallRules* call;
  std::vector<std::tuple<int64_t, int64_t, int64_t>> segments;

  const T* query(int64_t t, int64_t h) const { return qd + (h * Lq + t) * D; }
  std::pair<int64_t, int64_t> bounds(int64_t t, int64_t h) const { return call->keys.row(h, t); }
  RowRules rule(int64_t t, int64_t h) const { return call->row(h, t, 0); }
  float* out(int64_t t, int64_t h) const { return od + (h * Lq + t) * Dv; }
  float* lse(int64_t t, int64_t h) const { return ld + h * Lq + t; }
  KeyRun<T> run(int64_t, int64_t j, int64_t end) const {
    return {kd + j * k_key, vd + j * v_key, end - j};
  }
};

// q (NG, Lq, D) contiguous, k (N, S, D) and v (N, S, Dv) with contiguous rows, float32 or
// bfloat16: returns out (NG, Lq, Dv) and lse (NG, Lq), float32. splits: 0 to choose, else
// forced. An item takes one key/value head: each head's keys are one stream in memory (heads side
// by side in one item would be many streams whose addresses share their low bits, a multiple of
// 4 KiB apart, and evict each other from the cache's sets).
template <typename T>
std::vector<at::Tensor> decode_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const CallRules& call, int64_t splits) {
  constexpr int64_t kv_limit = 1;
  const int64_t NG = q.size(0), Lq = q.size(1), N = k.size(0);
  auto out = at::empty({NG, Lq, v.size(2)}, q.options().dtype(at::kFloat));
  auto lse = at::empty({NG, Lq}, q.options().dtype(at::kFloat));
  const DenseLayout<T> lay{q.const_data_ptr<T>(), k.const_data_ptr<T>(), v.const_data_ptr<T>(),
                           out.data_ptr<float>(), lse.data_ptr<float>(), NG, N, q.size(2),
                           v.size(2), Lq, kv_limit, k.stride(1),
                           v.stride(1), k.stride(0), v.stride(0), call.exponent_scale(),
                           call.scores.any(), &call, {{0, 0, Lq}}};
  if (NG > 0 && N > 0) decode_core<T>(lay, splits);
  return {out, lse};
}

}  // namespace
