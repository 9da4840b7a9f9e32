// A score_mod and a mask_mod as programs the forward pass runs on each row of a score block
// (program.py writes them from the mods' torch.fx graphs), so that no Python runs per tile.
//
// A program is a list of instructions (op, dst, a, b, c) over registers, each one row of up to
// kKeyBlock values or one value for the whole row ("uniform"). Registers 0 … 4 hold the row's
// inputs: the scaled score (a row), the batch entry b, the query head h and the query index i
// (uniform), and the key index j (a row). Every value is a float32: integers are exact below
// 2^24 (program.py refuses tables beyond that), booleans are 1 and 0. Gathers read a table (a
// captured tensor, flattened) at an index already wrapped and flattened by kWrap and arithmetic;
// an index outside the table gives NaN. A mask program's result is 1 where a pair may attend.
//
// The mask_mod's block states (program.py: EMPTY, PARTIAL, FULL per kQueryBlock × kStateBlock
// block over every batch entry and head) say where it is run: only in partial blocks; empty
// blocks are −inf without running it, full ones are left alone, and key blocks of the forward
// pass that are empty for a whole query block are skipped (ModProgram::skips).

#pragma once

#include "layout.h"
#include "program_code.h"
#include "row_math.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kStateBlock = 128;  // keys per block state (program.py's STATE_BLOCK)
constexpr int8_t kEmpty = 0, kPartial = 1, kFull = 2;

struct Table {
  const float* data;
  int64_t size;
};

// A thread's registers: rows of kRowStride floats, and which of them hold one value.
struct Registers {
  static constexpr int64_t kRowStride = kKeyBlock + 64;
  std::vector<float> rows;
  std::vector<float> value;
  std::vector<char> uniform;
  int64_t program = -1, z = -1, j0 = -1, n = -1;  // what the invariant registers were run for

  void fit(int64_t count) {
    if (static_cast<int64_t>(uniform.size()) >= count) return;
    rows.resize(count * kRowStride), value.resize(count), uniform.resize(count);
  }
  float* row(int64_t r) { return rows.data() + r * kRowStride; }
  Vec load(int64_t r, int64_t j) { return uniform[r] ? Vec(value[r]) : Vec::loadu(row(r) + j); }
  void set(int64_t r, float x) { uniform[r] = 1, value[r] = x; }
};

// A thread's registers for score programs (which = 0), mask programs (1) and the score
// programs' tangents (2).
inline Registers& thread_registers(int which) {
  thread_local Registers registers[3];
  return registers[which];
}

inline float first_lane(const Vec& x) {
  float lanes[kLanes];
  x.store(lanes);
  return lanes[0];
}

// One operand of an instruction: its row, or its one value (uniform).
struct Operand {
  const float* row;
  Vec value;
  bool uniform;

  Vec at(int64_t j) const { return uniform ? value : Vec::loadu(row + j); }
};

// d ← f(a, b, c) lane by lane (one value where a, b and c are uniform).
template <typename F>
inline void map3(Registers& r, int64_t d, int64_t a, int64_t b, int64_t c, int64_t n, F f) {
  const Operand x{r.row(a), Vec(r.value[a]), r.uniform[a] != 0};
  const Operand y{r.row(b), Vec(r.value[b]), r.uniform[b] != 0};
  const Operand z{r.row(c), Vec(r.value[c]), r.uniform[c] != 0};
  if (x.uniform && y.uniform && z.uniform) return r.set(d, first_lane(f(x.value, y.value, z.value)));
  r.uniform[d] = 0;
  float* __restrict__ out = r.row(d);
  if (!x.uniform && !y.uniform && !z.uniform) {
    for (int64_t j = 0; j < n; j += kLanes)
      f(Vec::loadu(x.row + j), Vec::loadu(y.row + j), Vec::loadu(z.row + j)).store(out + j);
  } else if (!x.uniform && y.uniform && z.uniform) {
    for (int64_t j = 0; j < n; j += kLanes) f(Vec::loadu(x.row + j), y.value, z.value).store(out + j);
  } else if (x.uniform && !y.uniform && y.row == z.row) {  // (map2 of a value and a row)
    for (int64_t j = 0; j < n; j += kLanes) {
      const Vec w = Vec::loadu(y.row + j);
      f(x.value, w, w).store(out + j);
    }
  } else {
    for (int64_t j = 0; j < n; j += kLanes) f(x.at(j), y.at(j), z.at(j)).store(out + j);
  }
}

template <typename F>
inline void map1(Registers& r, int64_t d, int64_t a, int64_t n, F f) {
  map3(r, d, a, a, a, n, [&](Vec x, Vec, Vec) { return f(x); });
}

template <typename F>
inline void map2(Registers& r, int64_t d, int64_t a, int64_t b, int64_t n, F f) {
  map3(r, d, a, b, b, n, [&](Vec x, Vec y, Vec) { return f(x, y); });
}

inline Vec floor_divide(Vec x, Vec y) { return (x / y).floor(); }

// d ← tables[t][a] (NaN outside the table).
inline void gather(Registers& r, int64_t d, const Table& table, int64_t a, int64_t n) {
  const auto at = [&](float index) {
    const bool inside = index >= 0.f && index < static_cast<float>(table.size);
    return inside ? table.data[static_cast<int64_t>(index)] : std::numeric_limits<float>::quiet_NaN();
  };
  if (r.uniform[a]) return r.set(d, at(r.value[a]));
  r.uniform[d] = 0;
  const float* index = r.row(a);
  float* out = r.row(d);
  for (int64_t j = 0; j < n; ++j) out[j] = at(index[j]);
}

// One instruction over n lanes (n rounded up to whole vectors: rows have room).
inline void step(Registers& r, const int64_t* in, const float* constants,
                 const std::vector<Table>& tables, int64_t n) {
  const int64_t d = in[1], a = in[2], b = in[3], c = in[4];
  const Vec zero(0.f), one(1.f);
  switch (in[0]) {
    case kConst: return r.set(d, constants[a]);
    case kAdd: return map2(r, d, a, b, n, [](Vec x, Vec y) { return x + y; });
    case kSub: return map2(r, d, a, b, n, [](Vec x, Vec y) { return x - y; });
    case kMul: return map2(r, d, a, b, n, [](Vec x, Vec y) { return x * y; });
    case kDiv: return map2(r, d, a, b, n, [](Vec x, Vec y) { return x / y; });
    case kMax: return map2(r, d, a, b, n, [](Vec x, Vec y) { return at::vec::maximum(x, y); });
    case kMin: return map2(r, d, a, b, n, [](Vec x, Vec y) { return at::vec::minimum(x, y); });
    case kLt: return map2(r, d, a, b, n, [](Vec x, Vec y) { return x.lt(y); });
    case kLe: return map2(r, d, a, b, n, [](Vec x, Vec y) { return x.le(y); });
    case kGt: return map2(r, d, a, b, n, [](Vec x, Vec y) { return x.gt(y); });
    case kGe: return map2(r, d, a, b, n, [](Vec x, Vec y) { return x.ge(y); });
    case kEq: return map2(r, d, a, b, n, [](Vec x, Vec y) { return x.eq(y); });
    case kNe: return map2(r, d, a, b, n, [](Vec x, Vec y) { return x.ne(y); });
    case kAnd: return map2(r, d, a, b, n, [](Vec x, Vec y) { return x * y; });
    case kOr: return map2(r, d, a, b, n, [](Vec x, Vec y) { return at::vec::maximum(x, y); });
    case kNot: return map1(r, d, a, n, [&](Vec x) { return one - x; });
    case kWhere:
      return map3(r, d, a, b, c, n,
                  [&](Vec x, Vec y, Vec z) { return Vec::blendv(z, y, x != zero); });
    case kNeg: return map1(r, d, a, n, [](Vec x) { return x.neg(); });
    case kAbs: return map1(r, d, a, n, [](Vec x) { return x.abs(); });
    case kExp: return map1(r, d, a, n, [](Vec x) { return x.exp(); });
    case kLog: return map1(r, d, a, n, [](Vec x) { return x.log(); });
    case kTanh: return map1(r, d, a, n, [](Vec x) { return tanh_vec(x); });
    case kSqrt: return map1(r, d, a, n, [](Vec x) { return x.sqrt(); });
    case kSigmoid: return map1(r, d, a, n, [&](Vec x) { return one / (one + x.neg().exp()); });
    case kFloor: return map1(r, d, a, n, [](Vec x) { return x.floor(); });
    case kTrunc: return map1(r, d, a, n, [](Vec x) { return x.trunc(); });
    case kFloorDiv: return map2(r, d, a, b, n, floor_divide);
    case kMod: return map2(r, d, a, b, n, [](Vec x, Vec y) { return x - y * floor_divide(x, y); });
    case kWrap:  // a negative index counts from the end (b: the size), as Python's
      return map2(r, d, a, b, n, [&](Vec x, Vec size) {
        return Vec::blendv(x, x + size, x < zero);
      });
    case kGather: return gather(r, d, tables[b], a, n);
    default: TORCH_CHECK(false, "mod program: unknown instruction ", in[0]);
  }
}

// The tangent (derivative with respect to the score) of one instruction's result, t[d], from
// its operands' values (r, before the instruction runs) and tangents (0 where !varies): the
// chain rule of each op; comparisons, and/or/not, floor, trunc, floor division, wrap and gathers
// have derivative 0, and where passes on the tangent of the branch it takes.
inline void tangent_step(Registers& r, Registers& t, const std::vector<char>& varies,
                         const int64_t* in, int64_t n) {
  const int64_t d = in[1], a = in[2], b = in[3], c = in[4];
  if (!varies[d]) return;
  t.uniform[d] = 0;
  float* __restrict__ out = t.row(d);
  const auto T = [&](int64_t x, int64_t j) { return varies[x] ? Vec::loadu(t.row(x) + j) : Vec(0.f); };
  const auto V = [&](int64_t x, int64_t j) { return r.load(x, j); };
  const auto each = [&](auto f) {
    for (int64_t j = 0; j < n; j += kLanes) f(j).store(out + j);
  };
  const Vec one(1.f), zero(0.f);
  switch (in[0]) {
    case kAdd: return each([&](int64_t j) { return T(a, j) + T(b, j); });
    case kSub: return each([&](int64_t j) { return T(a, j) - T(b, j); });
    case kMul: return each([&](int64_t j) { return T(a, j) * V(b, j) + V(a, j) * T(b, j); });
    case kDiv:
      return each([&](int64_t j) { return (T(a, j) - V(a, j) / V(b, j) * T(b, j)) / V(b, j); });
    case kMax: return each([&](int64_t j) { return Vec::blendv(T(b, j), T(a, j), V(a, j) >= V(b, j)); });
    case kMin: return each([&](int64_t j) { return Vec::blendv(T(b, j), T(a, j), V(a, j) <= V(b, j)); });
    case kWhere: return each([&](int64_t j) { return Vec::blendv(T(c, j), T(b, j), V(a, j) != zero); });
    case kNeg: return each([&](int64_t j) { return T(a, j).neg(); });
    case kAbs: return each([&](int64_t j) { return T(a, j) * (V(a, j).gt(zero) - V(a, j).lt(zero)); });
    case kExp: return each([&](int64_t j) { return T(a, j) * V(a, j).exp(); });
    case kLog: return each([&](int64_t j) { return T(a, j) / V(a, j); });
    case kTanh: return each([&](int64_t j) {
      const Vec y = tanh_vec(V(a, j));
      return T(a, j) * (one - y * y);
    });
    case kSqrt: return each([&](int64_t j) { return T(a, j) * Vec(0.5f) / V(a, j).sqrt(); });
    case kSigmoid: return each([&](int64_t j) {
      const Vec y = one / (one + V(a, j).neg().exp());
      return T(a, j) * y * (one - y);
    });
    case kMod: return each([&](int64_t j) { return T(a, j) - T(b, j) * floor_divide(V(a, j), V(b, j)); });
    default: return each([&](int64_t) { return zero; });
  }
}

// A call's score_mod and mask_mod programs with their tables and block states.
struct ModProgram {
  Code score, mask;
  std::vector<Table> tables;
  const int8_t* states = nullptr;  // (query blocks, state_columns); nullptr: no states
  int64_t state_columns = 0;
  int64_t heads = 1;  // query heads per batch entry: head z is (b, h) = (z / heads, z % heads)
  float scale = 1.f;
  int64_t id = 0;  // this program's own number (the registers' cache key)

  // Runs `code` for query i of head z over keys j0 … j0 + n − 1, scores s times s_scale (score
  // code only; nullptr for a mask), and returns the register holding the result.
  // With tangents t: also each register's derivative with respect to the scaled score (rows of
  // registers that vary with it; tangent_step).
  int64_t run(const Code& code, Registers& r, const float* s, float s_scale, int64_t n, int64_t z,
              int64_t i, int64_t j0, Registers* t = nullptr) const {
    r.fit(code.registers);
    const int64_t width = (n + kLanes - 1) / kLanes * kLanes;
    const bool cached = r.program == id && r.z == z && r.j0 == j0 && r.n == width;
    if (s != nullptr) {
      r.uniform[0] = 0;
      float* row = r.row(0);
      for (int64_t j = 0; j < n; ++j) row[j] = s[j] * s_scale;
    }
    r.set(1, static_cast<float>(z / heads));
    r.set(2, static_cast<float>(z % heads));
    r.set(3, static_cast<float>(i));
    if (code.reads_keys && !cached) {
      r.uniform[4] = 0;
      Vec key = Vec(static_cast<float>(j0)) + Vec::arange(0.f, 1.f);
      for (int64_t j = 0; j < width; j += kLanes, key = key + Vec(static_cast<float>(kLanes)))
        key.store(r.row(4) + j);
    }
    if (t != nullptr) {
      t->fit(code.registers);
      t->uniform[0] = 0;
      std::fill(t->row(0), t->row(0) + width, 1.f);
    }
    for (int64_t k = 0; k < code.count; ++k) {
      if (cached && code.invariant[k]) continue;  // (invariant: its tangent is 0)
      if (t != nullptr) tangent_step(r, *t, code.varies, code.ops + 5 * k, width);
      step(r, code.ops + 5 * k, code.constants, tables, width);
    }
    r.program = id, r.z = z, r.j0 = j0, r.n = width;
    return code.result;
  }

  // Row i of head z, n scores q · k of keys j0 … in place: scaled, the score code, the mask.
  void apply(float* s, int64_t n, int64_t z, int64_t i, int64_t j0) const {
    Registers& r = thread_registers(0);
    if (score.present()) {
      write(r, run(score, r, s, scale, n, z, i, j0), s, n);
    } else {
      for (int64_t j = 0; j < n; ++j) s[j] *= scale;
    }
    mask_row(s, n, z, i, j0);
  }

  // The mask_mod (its block states, its program) on a row of n modified scores: −inf where it
  // does not keep a pair.
  void mask_row(float* s, int64_t n, int64_t z, int64_t i, int64_t j0) const {
    if (states == nullptr) {
      if (mask.present()) block(thread_registers(1), s, n, z, i, j0);
      return;
    }
    const int8_t* row_states = states + (i / kQueryBlock) * state_columns;
    for (int64_t j = 0; j < n;) {
      const int64_t column = (j0 + j) / kStateBlock;
      const int64_t end = std::min(n, (column + 1) * kStateBlock - j0);
      if (row_states[column] == kEmpty) std::fill(s + j, s + end, kNegInf);
      if (row_states[column] == kPartial && mask.present())
        block(thread_registers(1), s + j, end - j, z, i, j0 + j);
      j = end;
    }
  }

  // The backward pass's row (backward.h): p holds n scores q · k, dp the row's dO · vᵀ. As
  // apply, with the score code's tangent ∂mod/∂s: p ← 2^(s' · log2 e − top) and
  // dp ← p (dp − delta) ∂mod/∂s (0 where p is 0: masked pairs).
  void gradients(float* p, float* dp, int64_t n, int64_t z, int64_t i, int64_t j0, float top,
                 float delta) const {
    Registers& t = thread_registers(2);
    const float* tangent = nullptr;
    float constant = 1.f;  // the tangent where it is the same for every key
    if (score.present()) {
      Registers& r = thread_registers(0);
      const bool constant_slope = score.constant_slope();  // no tangents to run
      const int64_t result = run(score, r, p, scale, n, z, i, j0, constant_slope ? nullptr : &t);
      write(r, result, p, n);
      if (constant_slope) constant = score.slope;
      else tangent = t.row(result);
    } else {
      for (int64_t j = 0; j < n; ++j) p[j] *= scale;
    }
    mask_row(p, n, z, i, j0);
    const Vec vc(kLog2E), vtop(top), vdelta(delta), vconstant(constant), zero(0.f);
    for (int64_t j = 0; j < n; j += kLanes) {
      const int64_t count = std::min(kLanes, n - j);
      const Vec weight = exp2_vec(at::vec::fmsub(Vec::loadu(p + j, count), vc, vtop), kExp2Degree5);
      const Vec slope = tangent != nullptr ? Vec::loadu(tangent + j, count) : vconstant;
      const Vec grad = weight * (Vec::loadu(dp + j, count) - vdelta) * slope;
      weight.store(p + j, count);
      Vec::blendv(grad, zero, weight == zero).store(dp + j, count);
    }
  }


  // [begin, end) narrowed to the non-empty state blocks of the query block starting at q0
  // (begin ≥ end: none).
  void trim(int64_t q0, int64_t& begin, int64_t& end) const {
    if (states == nullptr) return;
    const int8_t* row_states = states + (q0 / kQueryBlock) * state_columns;
    int64_t first = state_columns, last = -1;
    for (int64_t c = 0; c < state_columns; ++c)
      if (row_states[c] != kEmpty) first = std::min(first, c), last = c;
    begin = std::max(begin, first * kStateBlock);
    end = std::min(end, (last + 1) * kStateBlock);
  }

  // Whether keys k0 … k0 + kn − 1 are empty for every row of the query block starting at q0.
  bool skips(int64_t q0, int64_t k0, int64_t kn) const {
    if (states == nullptr || kn <= 0) return false;
    const int8_t* row_states = states + (q0 / kQueryBlock) * state_columns;
    for (int64_t c = k0 / kStateBlock; c <= (k0 + kn - 1) / kStateBlock; ++c)
      if (row_states[c] != kEmpty) return false;
    return true;
  }

  // The mask code on n scores: −inf where it gives 0.
  void block(Registers& r, float* s, int64_t n, int64_t z, int64_t i, int64_t j0) const {
    const int64_t result = run(mask, r, nullptr, 1.f, n, z, i, j0);
    if (r.uniform[result]) {
      if (r.value[result] == 0.f) std::fill(s, s + n, kNegInf);
      return;
    }
    const float* keep = r.row(result);
    for (int64_t j = 0; j < n; ++j) s[j] = keep[j] != 0.f ? s[j] : kNegInf;
  }

  // The part [a, b) of n scores outside which every score is −inf, in whole vectors.
  static std::pair<int64_t, int64_t> visible(const float* s, int64_t n) {
    const Vec none(kNegInf);
    int64_t a = 0, b = n;
    while (a + kLanes <= b && (Vec::loadu(s + a) != none).zero_mask() == (1 << kLanes) - 1)
      a += kLanes;
    while (b - kLanes >= a && (Vec::loadu(s + b - kLanes) != none).zero_mask() == (1 << kLanes) - 1)
      b -= kLanes;
    return {a, b};
  }

  static void write(Registers& r, int64_t result, float* s, int64_t n) {
    if (r.uniform[result]) return std::fill(s, s + n, r.value[result]);
    std::copy(r.row(result), r.row(result) + n, s);
  }
};

// The program of program.py's arguments; the tensors must outlive it.
inline ModProgram mod_program(const at::Tensor& score_ops, const at::Tensor& score_constants,
                              int64_t score_result, const at::Tensor& mask_ops,
                              const at::Tensor& mask_constants, int64_t mask_result,
                              const std::vector<at::Tensor>& tables, const at::Tensor& states,
                              int64_t heads, double scale) {
  ModProgram program{code_of(score_ops, score_constants, score_result),
                     code_of(mask_ops, mask_constants, mask_result), {}, nullptr, 0, heads,
                     static_cast<float>(scale)};
  static std::atomic<int64_t> programs{1};
  program.id = programs++;
  for (const at::Tensor& table : tables) {
    TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous(),
                "mod program: contiguous float32 tables");
    program.tables.push_back({table.const_data_ptr<float>(), table.numel()});
  }
  for (const Code* code : {&program.score, &program.mask})
    for (int64_t k = 0; k < code->count; ++k)
      TORCH_CHECK(code->ops[5 * k] != kGather ||
                  (code->ops[5 * k + 3] >= 0 &&
                   code->ops[5 * k + 3] < static_cast<int64_t>(tables.size())),
                  "mod program: gather from a missing table");
  if (states.numel() > 0) {
    TORCH_CHECK(states.scalar_type() == at::kChar && states.is_contiguous() && states.dim() == 2,
                "mod program: contiguous int8 (query blocks, key blocks) states");
    program.states = states.const_data_ptr<int8_t>();
    program.state_columns = states.size(1);
  }
  return program;
}

}  // namespace
