"""A score_mod and a mask_mod as programs that flash's compiled kernel runs on each row of
scores (``program.h``), so that a call with mods runs at the kernel's speed with no Python per
tile.

``compile_mods`` traces each mod with ``torch.fx`` (symbolic score, b, h, q_idx, kv_idx; the
tensors it reads become tables) and lowers the graph to instructions over registers:
arithmetic, comparisons, ``where``, and/or/not, min/max/clamp, exp/log/tanh/sqrt/sigmoid/abs,
floor, integer floor division and remainder, dtype conversions, and gathers from captured
tensors indexed by such values (``bias[h]``, ``table[h, q_idx - kv_idx + c]``,
``doc_id[q_idx]``). Everything else (a reduction, Python control flow on the indices, a table
with integers beyond 2^24, ...) makes it None, and the call takes the exact path (the loop with
``TileMods``, ``mods.py``).

``program_call.py`` runs calls on the programs, with the mask_mod's block states (EMPTY,
PARTIAL or FULL per QUERY_BLOCK × STATE_BLOCK block over every batch entry and head) telling
the kernel which key blocks to skip and where to run the mask program, and proves each program
equal to the eager mods on its first tile before it runs, the score program's derivative with
respect to the score (which the backward pass runs, forward mode) too.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

QUERY_BLOCK = 128  # the kernel's query block (layout.h's kQueryBlock)
KEY_BLOCK = 512  # the kernel's key block (layout.h's kKeyBlock): the proof's tile width
STATE_BLOCK = 128  # keys per block state (program.h's kStateBlock)
EXACT = 2**24  # float32 holds every integer below this
OPS = [
    "const",
    "add",
    "sub",
    "mul",
    "div",
    "max",
    "min",
    "lt",
    "le",
    "gt",
    "ge",
    "eq",
    "ne",
    "and",
    "or",
    "not",
    "where",
    "neg",
    "abs",
    "exp",
    "log",
    "tanh",
    "sqrt",
    "sigmoid",
    "floor",
    "trunc",
    "floordiv",
    "mod",
    "wrap",
    "gather",
]
OP = {name: i for i, name in enumerate(OPS)}


class Unsupported(Exception):
    """The mod uses something the program cannot express."""


@dataclass
class Code:
    """One mod's instructions (count, 5) int64 as (op, dst, a, b, c), its float32 constants
    and the register holding its result."""

    ops: torch.Tensor
    constants: torch.Tensor
    result: int

    def arguments(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.ops, self.constants, self.result


NO_CODE = Code(torch.empty(0, 5, dtype=torch.long), torch.empty(0), -1)


@dataclass
class Program:
    """A call's score_mod and mask_mod programs (``NO_CODE`` for an absent mod) and the tables
    (captured tensors) their gathers read, float32, flattened."""

    score: Code
    mask: Code
    tables: list[torch.Tensor] = field(default_factory=list)

    def arguments(self) -> tuple[Any, ...]:
        return (*self.score.arguments(), *self.mask.arguments(), self.tables)


@dataclass
class _Value:
    reg: int
    kind: str  # "f" float, "i" integer, "b" bool


class _Lowering:
    """Instructions of one mod's fx graph; ``tables`` shared by the score and mask programs."""

    def __init__(self, tables: list[torch.Tensor]) -> None:
        self.tables, self.ops, self.constants = tables, [], []  # type: ignore[var-annotated]
        self.next = 5

    def emit(self, op: str, kind: str, a: int = 0, b: int = 0, c: int = 0) -> _Value:
        self.ops.append((OP[op], self.next, a, b, c))
        self.next += 1
        return _Value(self.next - 1, kind)

    def const(self, x: Any) -> _Value:
        if isinstance(x, bool):
            kind = "b"
        elif isinstance(x, int):
            kind = "i"
            if abs(x) >= EXACT:
                raise Unsupported(f"integer constant {x}")
        elif isinstance(x, float):
            kind = "f"
        else:
            raise Unsupported(f"constant {type(x).__name__}")
        self.constants.append(float(x))
        return self.emit("const", kind, len(self.constants) - 1)

    def table(self, t: torch.Tensor) -> int:
        if t.is_complex() or t.device.type != "cpu":
            raise Unsupported("table dtype or device")
        flat = t.detach().reshape(-1).to(torch.float32).contiguous()
        if not t.is_floating_point() and t.numel() and int(t.abs().max()) >= EXACT:
            raise Unsupported("table with integers beyond 2^24")
        self.tables.append(flat)
        return len(self.tables) - 1

    def value(self, x: Any) -> _Value:
        if isinstance(x, _Value):
            return x
        if isinstance(x, torch.Tensor):  # a 0-dim captured tensor used as it is
            if x.dim() != 0:
                raise Unsupported("a captured tensor used without an index")
            return self.gather(x, ())
        return self.const(x)

    def gather(self, t: torch.Tensor, index: Any) -> _Value:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != t.dim():
            raise Unsupported("an index per dimension of a table")
        flat: _Value | None = None
        for size, stride, i in zip(t.shape, _strides(t.shape), index):
            v = self.value(i)
            if v.kind == "f":
                raise Unsupported("float index")
            wrapped = self.emit("wrap", "i", v.reg, self.const(size).reg)
            part = (
                wrapped
                if stride == 1
                else self.emit("mul", "i", wrapped.reg, self.const(stride).reg)
            )
            flat = part if flat is None else self.emit("add", "i", flat.reg, part.reg)
        if flat is None:
            flat = self.const(0)
        kind = "f" if t.is_floating_point() else ("b" if t.dtype == torch.bool else "i")
        return self.emit("gather", kind, flat.reg, self.table(t))

    def code(self, result: _Value) -> Code:
        ops = torch.tensor(self.ops, dtype=torch.long).reshape(-1, 5)
        return Code(ops, torch.tensor(self.constants, dtype=torch.float32), result.reg)


def _strides(shape: torch.Size) -> list[int]:
    strides, total = [], 1
    for size in reversed(shape):
        strides.append(total)
        total *= size
    return strides[::-1]


_BINARY = {
    operator.add: "add", torch.add: "add", "add": "add",
    operator.sub: "sub", torch.sub: "sub", "sub": "sub",
    operator.mul: "mul", torch.mul: "mul", "mul": "mul",
    operator.truediv: "div", torch.div: "div", "div": "div",
    operator.floordiv: "floordiv", torch.floor_divide: "floordiv",
    operator.mod: "mod", torch.remainder: "mod", "remainder": "mod",
    operator.lt: "lt", operator.le: "le", operator.gt: "gt", operator.ge: "ge",
    operator.eq: "eq", operator.ne: "ne", torch.maximum: "max", torch.minimum: "min",
    operator.and_: "and", torch.logical_and: "and", operator.or_: "or", torch.logical_or: "or",
    "logical_and": "and", "logical_or": "or", "maximum": "max", "minimum": "min",
}  # fmt: skip
_UNARY = {
    torch.exp: "exp", torch.log: "log", torch.tanh: "tanh", torch.sqrt: "sqrt",
    torch.sigmoid: "sigmoid", torch.abs: "abs", operator.abs: "abs", torch.floor: "floor",
    torch.neg: "neg", operator.neg: "neg", torch.trunc: "trunc",
    "exp": "exp", "log": "log", "tanh": "tanh", "sqrt": "sqrt", "sigmoid": "sigmoid",
    "abs": "abs", "floor": "floor", "neg": "neg", "trunc": "trunc",
}  # fmt: skip
_FLOAT_RESULT = {"div", "exp", "log", "tanh", "sqrt", "sigmoid"}


def _binary(low: _Lowering, op: str, a: Any, b: Any) -> _Value:
    x, y = low.value(a), low.value(b)
    if op in ("and", "or"):
        if x.kind != "b" or y.kind != "b":
            raise Unsupported("bitwise and/or of integers")
        return low.emit(op, "b", x.reg, y.reg)
    if op in ("lt", "le", "gt", "ge", "eq", "ne"):
        return low.emit(op, "b", x.reg, y.reg)
    kind = "f" if "f" in (x.kind, y.kind) or op == "div" else "i"
    return low.emit(op, kind, x.reg, y.reg)


def _convert(low: _Lowering, x: Any, dtype: Any) -> _Value:
    v = low.value(x)
    if not isinstance(dtype, torch.dtype):
        raise Unsupported("conversion to a non-dtype")
    if dtype == torch.bool:
        return low.emit("ne", "b", v.reg, low.const(0).reg)
    if dtype.is_floating_point:
        return _Value(v.reg, "f")
    if v.kind == "f":
        return low.emit("trunc", "i", v.reg)
    return _Value(v.reg, "i")


def _node(low: _Lowering, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if target in (operator.getitem, "__getitem__") and isinstance(args[0], torch.Tensor):
        return low.gather(args[0], args[1])
    if target in _BINARY and len(args) == 2 and not kwargs:
        return _binary(low, _BINARY[target], *args)
    if target in _UNARY and len(args) == 1 and not kwargs:
        v = low.value(args[0])
        kind = "f" if _UNARY[target] in _FLOAT_RESULT else v.kind
        return low.emit(_UNARY[target], kind, v.reg)
    if target in (torch.where, "where") and len(args) == 3 and not kwargs:
        c, x, y = (low.value(a) for a in args)
        kind = "f" if "f" in (x.kind, y.kind) else ("i" if "i" in (x.kind, y.kind) else "b")
        return low.emit("where", kind, c.reg, x.reg, y.reg)
    if target in (operator.invert, torch.logical_not, "logical_not") and len(args) == 1:
        v = low.value(args[0])
        if v.kind != "b":
            raise Unsupported("bitwise not of an integer")
        return low.emit("not", "b", v.reg)
    if target in (torch.clamp, "clamp", "clamp_min", "clamp_max"):
        names = {"clamp_min": ("min",), "clamp_max": ("max",)}.get(target, ("min", "max"))
        bounds = dict(zip(names, args[1:]), **kwargs)
        v = low.value(args[0])
        for name, op in (("min", "max"), ("max", "min")):
            if bounds.get(name) is not None:
                v = _binary(low, op, v, bounds[name])
        return v
    conversions = {"float": torch.float32, "long": torch.int64, "int": torch.int32}
    if target in conversions and len(args) == 1 and not kwargs:
        return _convert(low, args[0], conversions[target])
    if target in ("bool",) and len(args) == 1:
        return _convert(low, args[0], torch.bool)
    if target == "to" and len(args) == 2 and not kwargs:
        return _convert(low, args[0], args[1])
    raise Unsupported(f"{getattr(target, '__name__', target)}")


def lower(mod: Callable[..., Any], score: bool, tables: list[torch.Tensor]) -> Code:
    """The instructions of a score_mod (``score``) or mask_mod; Unsupported where it has no
    program (tracing fails, or an operation the kernel does not run)."""
    try:
        graph = torch.fx.symbolic_trace(mod)
    except Exception as error:  # control flow on the indices, a non-traceable call, ...
        raise Unsupported(f"tracing: {error}") from error
    low = _Lowering(tables)
    inputs = iter(range(5) if score else range(1, 5))
    env: dict[str, Any] = {}
    result: Any = None
    for node in graph.graph.nodes:
        args = torch.fx.node.map_arg(node.args, lambda n: env[n.name])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n.name])
        if node.op == "placeholder":
            reg = next(inputs, None)
            if reg is None:
                raise Unsupported("too many arguments")
            env[node.name] = _Value(reg, "f" if reg == 0 else "i")
        elif node.op == "get_attr":
            env[node.name] = getattr(graph, node.target)
        elif node.op in ("call_function", "call_method"):
            env[node.name] = _node(low, node.target, tuple(args), dict(kwargs))
        elif node.op == "output":
            result = low.value(args[0])
        else:
            raise Unsupported(node.op)
    assert isinstance(result, _Value)
    if result.kind != ("f" if score else "b"):
        raise Unsupported("result kind")
    return low.code(result)
