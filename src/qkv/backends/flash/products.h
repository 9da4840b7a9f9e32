// The kernel's float32 matrix products: its own register tiles (product_tiles, on kᵀ packed in
// panels and V as it lies), or torch's: at::native::cpublas::brgemm, its small-matrix kernel
// (oneDNN's micro-kernels from AVX2 up, torch's own gemm where there are none), which kernel.py
// picks for builds with 512-bit vectors, or its matrix multiply (MKL or OpenBLAS for the ISA the
// CPU has, one thread inside the kernel's threads) on tensors that view the buffers. (bfloat16
// products always run on cpublas::brgemm: forward.h.)
//
// The tiles: c is cut into register tiles of kTileRows rows × kTileVectors vectors, each summed
// over all K in registers (kTileRows · kTileVectors accumulators, as many as the ISA's registers
// hold besides the b vectors and the broadcast a value), then written once. Column panels go
// outermost, so that the b panel one column strip reads (K × a tile's width) stays in the L1
// cache while every row tile runs over it.

#pragma once

#include "layout.h"
#include "row_math.h"

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int kTileRows = kLanes >= 16 ? 12 : 6;  // 32 registers (AVX-512) or 16 (AVX2)
// The sum over K goes kDepth rows of b at a time, so that the part of b one pass reads stays in
// the L1 cache (in p · v, K is up to 512 keys: the products waited on the L2 cache). Where that
// part is small (p · v: kDepth × Dv values), each row tile runs over all of it before the next
// starts, so that its rows of a are read once; otherwise (q · kᵀ: D × 512) each panel meets
// all row tiles before the next panel is read.
constexpr int64_t kDepth = 128;
constexpr int64_t kL1Floats = 8192;  // 32 KiB: most of an L1 data cache

// c (M, N) = a (M, K) · b (K, N), or c += a · b (add), float32.
// a's element (r, d) is at a[r · lda + d · step] (step 1: row-major; lda 1: a transposed).
// b comes in column panels of kPanel columns, panel i at b + i · panel_stride, its rows ldb apart
// (arrange packs kᵀ so, each panel contiguous and the last one zero-padded; a row-major
// matrix, such as v, is such panels with panel_stride kPanel). c's rows are ldc apart.
struct Product {
  int64_t M, N, K;
  const float* a;
  int64_t lda, step;
  const float* b;
  int64_t ldb, panel_stride;
  float* c;
  int64_t ldc;
  bool add;
};

// Where a block of c lies in a product: rows r … r + rows − 1, columns j … j + kPanel − 1 (one
// panel of b, fewer columns in the last), and the part d0 … d0 + depth − 1 of the sum over K.
struct TilePlace {
  int64_t r, rows, j, d0, depth;
};

// One register tile of the product, at `at` (at.rows = Rows; Partial: the panel has fewer than
// kPanel columns, and its last vector is read and written in part).
template <int Rows, bool Partial>
inline void product_tile(const Product& product, const TilePlace& at) {
  const int64_t K = at.depth, width = std::min(kPanel, product.N - at.j);
  const int64_t lda = product.lda, step = product.step, ldb = product.ldb, ldc = product.ldc;
  const float* a = product.a + at.r * lda + at.d0 * step;
  const float* b = product.b + at.d0 * ldb + at.j / kPanel * product.panel_stride;
  float* c = product.c + at.r * ldc + at.j;
  const bool add = product.add || at.d0 > 0;
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

// product_tile for the rows left below the last whole row tile (at.rows < kTileRows).
template <bool Partial, int Rows = kTileRows - 1>
inline void product_rest(const Product& product, const TilePlace& at) {
  if constexpr (Rows > 0) {
    if (at.rows == Rows) return product_tile<Rows, Partial>(product, at);
    product_rest<Partial, Rows - 1>(product, at);
  }
}

// The rows at.r … at.r + at.rows − 1 of c in one panel, a row tile at a time.
template <bool Partial>
inline void product_panel(const Product& product, const TilePlace& at) {
  TilePlace tile = at;
  tile.rows = kTileRows;
  for (; tile.r + kTileRows <= at.r + at.rows; tile.r += kTileRows) {
    product_tile<kTileRows, Partial>(product, tile);
  }
  if (tile.r < at.r + at.rows) {
    tile.rows = at.r + at.rows - tile.r;
    product_rest<Partial>(product, tile);
  }
}

// The product on the kernel's register tiles.
inline void product_tiles(const Product& product) {
  const int64_t M = product.M, N = product.N, K = product.K;
  for (int64_t d0 = 0; d0 < K; d0 += kDepth) {
    const int64_t depth = std::min(kDepth, K - d0);
    // Rows r … r + rows − 1 of c, every panel, this part of the sum.
    const auto panels = [&](int64_t r, int64_t rows) {
      int64_t j = 0;
      for (; j + kPanel <= N; j += kPanel) product_panel<false>(product, {r, rows, j, d0, depth});
      if (j < N) product_panel<true>(product, {r, rows, j, d0, depth});
    };
    if (N * depth > kL1Floats) {
      panels(0, M);
      continue;
    }
    for (int64_t r = 0; r < M; r += kTileRows) panels(r, std::min<int64_t>(kTileRows, M - r));
  }
}

// Where the kernel's float32 products run (kernel.py's GEMM, PRODUCTS): its own register tiles,
// cpublas::brgemm, or torch's matrix multiply.
enum class Products : int64_t { kTiles = 0, kBrgemm = 1, kBlas = 2 };

// The product on the tiles, or on torch's brgemm or matrix multiply (a and b row-major: step 1,
// b one panel, its rows ldb apart).
inline void multiply(Products path, const Product& product) {
  if (path == Products::kTiles) return product_tiles(product);
  const int64_t M = product.M, N = product.N, K = product.K;
  if (path == Products::kBrgemm) {
    return at::native::cpublas::brgemm(M, N, K, product.lda, product.ldb, product.ldc, product.add,
                                       product.a, product.b, product.c, false);
  }
  const auto view = [](const float* x, int64_t rows, int64_t columns, int64_t ld) {
    return at::from_blob(const_cast<float*>(x), {rows, columns}, {ld, 1}, at::kFloat);
  };
  at::Tensor result = view(product.c, M, N, product.ldc);
  const at::Tensor a = view(product.a, M, K, product.lda), b = view(product.b, K, N, product.ldb);
  if (product.add) {
    at::addmm_out(result, result, a, b);
  } else {
    at::mm_out(result, a, b);
  }
}

}  // namespace
