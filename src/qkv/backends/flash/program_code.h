// A score_mod's or mask_mod's program as the kernel reads it (program.h runs it): its
// instructions (op, dst, a, b, c) over registers, their constants and the register holding the
// result (program.py writes them), and what is known of them before they run (code_of): which
// instructions give the same result for every row of a block, which registers vary with the
// score, and the result's derivative with respect to the score where it is one number.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kInputs = 5;  // score, b, h, i, j

enum Op : int64_t {
  kConst, kAdd, kSub, kMul, kDiv, kMax, kMin, kLt, kLe, kGt, kGe, kEq, kNe, kAnd, kOr, kNot,
  kWhere, kNeg, kAbs, kExp, kLog, kTanh, kSqrt, kSigmoid, kFloor, kTrunc, kFloorDiv, kMod,
  kWrap, kGather, kOps
};

// One mod's instructions (count rows of 5 int64), its constants, and the register it leaves
// its result in (result < 0: no such mod).
struct Code {
  const int64_t* ops = nullptr;
  int64_t count = 0;
  const float* constants = nullptr;
  int64_t result = -1;
  int64_t registers = kInputs;
  bool reads_keys = true;  // whether an instruction reads register 4, the key index
  // Per instruction: whether it reads only b, h, j and constants, so that its result holds for
  // every row of a block (run computes it once for consecutive rows of one head and keys).
  std::vector<char> invariant;
  // Per register: whether its derivative with respect to the score (register 0) may be nonzero.
  std::vector<char> varies;
  // The result's derivative with respect to the score where it is one number for every key (a
  // score plus or minus a bias, times a constant: slope_of), NaN where it is not.
  float slope = std::numeric_limits<float>::quiet_NaN();

  bool present() const { return result >= 0; }
  bool constant_slope() const { return !std::isnan(slope); }
};

// The registers an instruction reads (a, b, c as its op uses them), -1 for none.
inline std::array<int64_t, 3> operands(const int64_t* in) {
  switch (in[0]) {
    case kConst: return {-1, -1, -1};
    case kGather: return {in[2], -1, -1};
    case kNot: case kNeg: case kAbs: case kExp: case kLog: case kTanh: case kSqrt: case kSigmoid:
    case kFloor: case kTrunc: return {in[2], -1, -1};
    case kWhere: return {in[2], in[3], in[4]};
    default: return {in[2], in[3], -1};
  }
}

// The derivative of instruction `in`'s result with respect to the score where it is one number
// for every key, from its operands' (slopes: NaN where one is not; constants: each register's
// value where a kConst instruction set it, NaN otherwise): a sum or difference of such,
// a negation, a product with a constant; 0 where it does not vary with the score. NaN otherwise.
inline float slope_of(const int64_t* in, const std::vector<char>& varies,
                      const std::vector<float>& slopes, const std::vector<float>& constants) {
  if (!varies[in[1]]) return 0.f;
  const auto slope = [&](int64_t x) { return slopes[x]; };
  switch (in[0]) {
    case kAdd: return slope(in[2]) + slope(in[3]);
    case kSub: return slope(in[2]) - slope(in[3]);
    case kNeg: return -slope(in[2]);
    case kMul:  // by a factor that does not vary: its constant (NaN where it is no constant)
      if (!varies[in[3]]) return slope(in[2]) * constants[in[3]];
      if (!varies[in[2]]) return constants[in[2]] * slope(in[3]);
      return std::numeric_limits<float>::quiet_NaN();
    default: return std::numeric_limits<float>::quiet_NaN();
  }
}

// Whether instruction `in`'s result may have a nonzero derivative with respect to the score.
inline bool differentiable(const int64_t* in, const std::vector<char>& varies) {
  switch (in[0]) {
    case kAdd: case kSub: case kMul: case kDiv: case kMax: case kMin: case kMod:
      return varies[in[2]] || varies[in[3]];
    case kWhere: return varies[in[3]] || varies[in[4]];
    case kNeg: case kAbs: case kExp: case kLog: case kTanh: case kSqrt: case kSigmoid:
      return varies[in[2]];
    default: return false;
  }
}

inline Code code_of(const at::Tensor& ops, const at::Tensor& constants, int64_t result) {
  if (result < 0) return {};
  TORCH_CHECK(ops.scalar_type() == at::kLong && ops.is_contiguous() && ops.dim() == 2 &&
              ops.size(1) == 5, "mod program: contiguous int64 (count, 5) instructions");
  TORCH_CHECK(constants.scalar_type() == at::kFloat && constants.is_contiguous(),
              "mod program: contiguous float32 constants");
  const int64_t* in = ops.const_data_ptr<int64_t>();
  int64_t registers = std::max(kInputs, result + 1);
  for (int64_t k = 0; k < ops.size(0); ++k) {
    TORCH_CHECK(in[5 * k] >= 0 && in[5 * k] < kOps && in[5 * k + 1] >= kInputs,
                "mod program: bad instruction ", k);
    registers = std::max(registers, in[5 * k + 1] + 1);
  }
  std::vector<char> fixed(registers, 0), invariant(ops.size(0), 0), varies(registers, 0);
  fixed[1] = fixed[2] = fixed[4] = 1;  // b, h, j: the same for every row of a block
  varies[0] = 1;                       // the score
  const float none = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> slopes(registers, 0.f), values(registers, none);
  slopes[0] = 1.f;
  const float* constants_data = constants.const_data_ptr<float>();
  bool reads_keys = result == 4;
  for (int64_t k = 0; k < ops.size(0); ++k) {
    bool all = true;
    for (const int64_t a : operands(in + 5 * k)) {
      if (a < 0) continue;
      TORCH_CHECK(a < registers, "mod program: bad register in instruction ", k);
      all = all && fixed[a];
      reads_keys = reads_keys || a == 4;
    }
    const int64_t d = in[5 * k + 1];
    fixed[d] = invariant[k] = all;
    varies[d] = differentiable(in + 5 * k, varies);
    slopes[d] = slope_of(in + 5 * k, varies, slopes, values);
    values[d] = in[5 * k] == kConst ? constants_data[in[5 * k + 2]] : none;
  }
  return {in, ops.size(0), constants_data, result, registers, reads_keys,
          std::move(invariant), std::move(varies), slopes[result]};
}

}  // namespace
