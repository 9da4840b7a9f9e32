// Where the kernel's data lies: the block sizes, the threads' scratch buffers, and the keys and
// values packed in the order the products read them, per key block:
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

#pragma once

#include "row_math.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
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
// The register tiles of the kernel's own products (products.h) are kTileVectors vectors wide:
// kPanel columns, the width of a panel of packed kᵀ.
constexpr int kTileVectors = 2;
constexpr int64_t kPanel = kTileVectors * kLanes;

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

// One head's x (S, D) as xᵀ in column panels, zero-padded: (⌈S / kPanel⌉, D, kPanel), the
// layout product_tiles reads kᵀ from.
void pack_transposed(const float* x, int64_t S, int64_t D, float* to) {
  for (int64_t j0 = 0; j0 < S; j0 += kPanel, to += D * kPanel)
    for (int64_t c = 0; c < kPanel; ++c) {
      const float* row = x + (j0 + c) * D;
      for (int64_t d = 0; d < D; ++d) to[d * kPanel + c] = j0 + c < S ? row[d] : 0.f;
    }
}

// n rows of x (n, D) (its rows x_ld apart: D where not given) as xᵀ (D, n), rows ld apart:
// ATen's transpose (16 × 16 tiles in vector registers with AVX-512, element by element
// elsewhere) on 64 rows at a time, which stay in L1 (at::Tensor::contiguous() of the
// transposed view ran at 2 ns an element: a fifth of a packed call at T = 16384). x holds
// float32, or 32-bit words (pairs of bfloat16) as float32 bits, which the transpose only moves.
void transpose_rows(const float* x, int64_t n, int64_t D, float* to, int64_t ld,
                    int64_t x_ld = -1) {
  constexpr int64_t kTile = 64;
  if (x_ld < 0) x_ld = D;
  for (int64_t j0 = 0; j0 < n; j0 += kTile) {
    const int rows = static_cast<int>(std::min(kTile, n - j0));
    at::vec::transpose_mxn<float>(x + j0 * x_ld, x_ld, to + j0, ld, rows, static_cast<int>(D));
  }
}

// The row length of a (D, S) transposed operand: S in whole vectors of 16, and 16 more, so
// that its rows (kᵀ's, read down the columns) do not all fall into the same few cache sets
// where S is a power of two.
inline int64_t transposed_ld(int64_t S) { return (S + 15) / 16 * 16 + 16; }

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

}  // namespace
