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
// lse −inf. Causal key blocks past the block's last diagonal are skipped; in a block the diagonal
// crosses, each row only exponentiates the keys it may see and the rest of its p is 0.
//
// Matrix products go through at::native::cpublas::brgemm, torch's small-matrix kernel (oneDNN):
// float32 products use the vector units; bfloat16 products use the CPU's bfloat16 matrix units
// (AMX) with float32 sums, which need each key block in pairs-of-rows ("VNNI") order, built once
// per call. Scores, softmax and accumulation are float32 in both cases.
//
// Inputs: q (NG, Lq, D), k (N, S, D), v (N, S, Dv), contiguous, all float32 or all bfloat16;
// query head i uses key/value head i / (NG / N) (grouped-query heads, K/V never repeated).
// Returns out (NG, Lq, Dv) and lse (NG, Lq), float32.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kQueryBlock = 128;  // rows per block: big enough for the matrix units
constexpr int64_t kKeyBlock = 512;    // keys per block: (Bq, Bk) float32 scores fit in L2
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kLog2E = 1.4426950408889634f;

// 2^x for x <= 0 (what the recurrence needs): 2^x = 2^n · 2^f with n = round(x) and
// f in [−½, ½], where a degree-6 Taylor polynomial is within 2e-7 relative. Below −126 the
// result is 0 (also for −inf); NaN stays NaN. Its coefficients, ln(2)^i / i!, highest first:
constexpr float kExp2Taylor[] = {1.5252734e-05f, 1.5403530e-04f, 1.3333558e-03f, 9.6181291e-03f,
                                 5.5504109e-02f, 2.4022651e-01f, 6.9314718e-01f, 1.0f};

inline float exp2_scalar(float x) {
  const float xc = std::max(x, -126.f);
  const float n = std::nearbyint(xc);
  const float f = xc - n;
  float p = kExp2Taylor[0];
  for (int i = 1; i < 8; ++i) p = p * f + kExp2Taylor[i];
  const float r = std::ldexp(p, static_cast<int>(n));
  if (std::isnan(x)) return x;
  return x < -126.f ? 0.f : r;
}

#if defined(__AVX512F__)
// The same 2^x on 16 lanes.
inline __m512 exp2_avx512(__m512 x) {
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(xc, n);
  __m512 p = _mm512_set1_ps(kExp2Taylor[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Taylor[i]));
  __m512 r = _mm512_scalef_ps(p, n);
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_LT_OQ);
  r = _mm512_mask_blend_ps(under, r, _mm512_setzero_ps());
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_blend_ps(nan, r, x);
}
#endif

// max_j s_j · c over one row. NaN scores are skipped here; they reach p and l below (a row
// whose scores are all NaN or −inf is caught by the caller).
inline float row_max(const float* s, int64_t n, float c) {
  float mx = kNegInf;
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < n; ++j) {
    const float x = s[j] * c;
    mx = x > mx ? x : mx;
  }
  return mx;
}

// p_j = 2^(s_j · c − m) written to p (float32 or bfloat16); returns Σ_j p_j.
template <typename P>
inline float exp_row(const float* s, P* p, int64_t n, float c, float m) {
  int64_t j = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 sums = _mm512_setzero_ps();
  const __m512 vc = _mm512_set1_ps(c), vm = _mm512_set1_ps(m);
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp2_avx512(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), vc, vm));
    sums = _mm512_add_ps(sums, e);
    if constexpr (std::is_same_v<P, float>) {
      _mm512_storeu_ps(p + j, e);
    } else {
#if defined(__AVX512BF16__)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e));
#else
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, e);
      for (int i = 0; i < 16; ++i) p[j + i] = P(lanes[i]);
#endif
    }
  }
  sum = _mm512_reduce_add_ps(sums);
#endif
  for (; j < n; ++j) {
    const float e = exp2_scalar(s[j] * c - m);
    sum += e;
    p[j] = P(e);
  }
  return sum;
}

// Keys and values in the order the products read them.
//   float32:  kt = kᵀ per head (N, D, S); v as given.
//   bfloat16: per key block, kᵀ (D, Bk) and v (Bk, Dv) in pairs-of-rows order: element
//             (r, c) of a (R, C) matrix at [(r / 2) · C + c] · 2 + r % 2, zero-padded to whole
//             blocks (keys) and to an even number of rows.
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
        for (int64_t d = 0; d < De; ++d)  // kᵀ: row d, column j
          for (int64_t j = 0; j < kKeyBlock; ++j)
            kb[((d / 2) * kKeyBlock + j) * 2 + d % 2] = (j < kn && d < D) ? kh[j * D + d] : T(0.f);
        for (int64_t j = 0; j < kKeyBlock; ++j)  // v: row j, column e
          for (int64_t e = 0; e < Dv; ++e)
            vb[((j / 2) * Dv + e) * 2 + j % 2] = j < kn ? vh[j * Dv + e] : T(0.f);
      }
    });
    return {keys, values};
  }
}

template <typename T>
std::vector<at::Tensor> forward_impl(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal,
    int64_t offset) {
  constexpr bool low = std::is_same_v<T, at::BFloat16>;
  const int64_t NG = q.size(0), Lq = q.size(1), D = q.size(2);
  const int64_t N = k.size(0), S = k.size(1), Dv = v.size(2);
  const int64_t g = NG / N;
  const int64_t De = low ? (D + 1) / 2 * 2 : D;  // q's row length as the products read it
  const int64_t key_blocks = (S + kKeyBlock - 1) / kKeyBlock;
  const int64_t query_blocks = (Lq + kQueryBlock - 1) / kQueryBlock;
  const float c = static_cast<float>(scale) * kLog2E;

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

  at::parallel_for(0, NG * query_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kQueryBlock * kKeyBlock), acc(kQueryBlock * Dv);
    std::vector<float> m(kQueryBlock), l(kQueryBlock);
    std::vector<T> p_low(low ? kQueryBlock * kKeyBlock : 0);
    for (int64_t z = begin; z < end; ++z) {
      const int64_t head = z / query_blocks, q0 = (z % query_blocks) * kQueryBlock;
      const int64_t kv = head / g, rows = std::min(kQueryBlock, Lq - q0);
      const T* q_block = qd + (head * Lq + q0) * De;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.f);
      // Keys this block may see: all, or causally up to its last row's diagonal.
      const int64_t keys_end =
          causal ? std::clamp<int64_t>(q0 + rows + offset, 0, S) : S;
      for (int64_t k0 = 0; k0 < keys_end; k0 += kKeyBlock) {
        const int64_t kn = std::min(kKeyBlock, S - k0), block = k0 / kKeyBlock;
        float* s = scores.data();
        if constexpr (low) {  // s = q · kᵀ, bfloat16 products, float32 sums
          at::native::cpublas::brgemm(
              rows, kKeyBlock, De, De, kKeyBlock, kKeyBlock, false, q_block,
              kd + (kv * key_blocks + block) * De * kKeyBlock, s, true);
        } else {
          at::native::cpublas::brgemm(
              rows, kn, D, D, S, kKeyBlock, false, q_block, kd + kv * D * S + k0, s, false);
        }
        for (int64_t r = 0; r < rows; ++r) {
          // Keys of this block row r may see; the rest of its p is 0.
          const int64_t seen =
              causal ? std::clamp<int64_t>(q0 + r + offset + 1 - k0, 0, kn) : kn;
          float* s_r = s + r * kKeyBlock;
          const float m_new = std::max(m[r], row_max(s_r, seen, c));
          const int64_t width = low ? (kn + 1) / 2 * 2 : kn;
          if (m_new == kNegInf) {  // no key seen yet: nothing to add, unless a score is NaN
            if (std::any_of(s_r, s_r + seen, [](float x) { return std::isnan(x); })) {
              l[r] = std::numeric_limits<float>::quiet_NaN();  // out and lse become NaN
            }
            if constexpr (low) std::fill_n(p_low.data() + r * kKeyBlock, width, T(0.f));
            else std::fill_n(s_r, width, 0.f);
            continue;
          }
          float sum;
          if constexpr (low) {
            T* p_r = p_low.data() + r * kKeyBlock;
            sum = exp_row<T>(s_r, p_r, seen, c, m_new);
            std::fill(p_r + seen, p_r + width, T(0.f));
          } else {
            sum = exp_row<float>(s_r, s_r, seen, c, m_new);  // p overwrites s
            std::fill(s_r + seen, s_r + width, 0.f);
          }
          const float alpha = exp2_scalar(m[r] - m_new);
          l[r] = alpha * l[r] + sum;
          m[r] = m_new;
          if (alpha != 1.f) {
            float* acc_r = acc.data() + r * Dv;
#pragma omp simd
            for (int64_t e = 0; e < Dv; ++e) acc_r[e] *= alpha;
          }
        }
        if constexpr (low) {  // acc += p · v_block
          at::native::cpublas::brgemm(
              rows, Dv, (kn + 1) / 2 * 2, kKeyBlock, Dv, Dv, true, p_low.data(),
              vd + (kv * key_blocks + block) * kKeyBlock * Dv, acc.data(), true);
        } else {
          at::native::cpublas::brgemm(
              rows, Dv, kn, kKeyBlock, Dv, Dv, true, s, vd + (kv * S + k0) * Dv, acc.data(),
              false);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        // l = 0 only for a row with no key: out 0 (not 0/0), lse −inf. NaN stays NaN.
        const float inv = l[r] == 0.f ? 0.f : 1.f / l[r];
        float* o = od + (head * Lq + q0 + r) * Dv;
        for (int64_t e = 0; e < Dv; ++e) o[e] = acc[r * Dv + e] * inv;
        ld[head * Lq + q0 + r] = l[r] == 0.f ? kNegInf : (m[r] + std::log2(l[r])) * kLn2;
      }
    }
    if constexpr (low) at::native::cpublas::brgemm_release(true);
  });
  return {out, lse};
}

std::vector<at::Tensor> forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal,
    int64_t offset) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-d");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "need contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type());
  TORCH_CHECK(k.size(0) > 0 && q.size(0) % k.size(0) == 0, "heads must group");
  if (q.scalar_type() == at::kBFloat16) {
    return forward_impl<at::BFloat16>(q, k, v, scale, causal, offset);
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat, "float32 or bfloat16");
  return forward_impl<float>(q, k, v, scale, causal, offset);
}

// Whether this CPU runs bfloat16 products in matrix units (otherwise bfloat16 goes as float32).
bool bfloat16_products() { return at::native::cpublas::could_pack(at::kBFloat16); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("forward", &forward, "flash forward: (out, lse)");
  module.def("bfloat16_products", &bfloat16_products);
}
