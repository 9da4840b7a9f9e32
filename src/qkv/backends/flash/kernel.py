"""flash's compiled CPU kernel (``flash_cpu.cpp``): how it is built and loaded, the calls it runs.

The kernel runs the forward recurrence of ``loop.py`` for calls without a mask (a causal rule,
a window and packed sequences given as each query row's range of keys), one query block
of one head at a time in cache-sized buffers, with one fused exp/sum pass per key block. Calls
with fewer than ``DECODE_QUERIES`` queries (decoding) take its decoding core (``decode.h``): the
query heads that share a key/value head together, K/V read once where they lie, so a KV cache's
buffer is never copied, and a long cache's keys split across the threads. Its backward pass
(``backward``) takes the same rules (key ranges, soft-capping, ALiBi, with the slopes'
gradient), recomputes each tile's weights from the saved log-sum-exp and sums dQ, dK and dV
per block, in a fixed order (the same bits on every run).

The kernel is compiled when first needed by torch's C++ extension tooling (a C++ compiler and
ninja; one line on stderr, about a minute) and cached under ``~/.cache/torch_extensions``
(``TORCH_EXTENSIONS_DIR`` moves it): later loads are silent and take a fraction of a second.
``qkv build`` builds it ahead of time. ``build.py`` holds the build lock: a build killed part-way
is started over by the next, and a process waits for another's build for at most
``QKV_BUILD_TIMEOUT`` seconds (10 minutes).

Its vector passes are written on ATen's portable vector type (``at::vec::Vectorized<float>``),
so one source compiles to AVX-512, AVX2, NEON or plain C++; ``QKV_FLASH_ISA`` picks the
instruction set:

- ``native`` (the default): everything the running CPU has (``-march=native``), with ATen's
  vectors as wide as its best ISA (AVX-512, else AVX2; NEON on aarch64);
- ``avx512``: AVX-512 (F, BW, VL, DQ) and nothing newer, 512-bit vectors;
- ``avx2``: AVX2, FMA and F16C, 256-bit vectors: what a CPU without AVX-512 runs, built and
  measured on one that has it.

One translation unit, ``flash_cpu.cpp``, includes the headers beside it (its opening comment
lists them). A cached build is named after the ISA, the CPU's flags and the source's hash (every
C++ file and header): no machine or version of qkv sharing a cache loads another's build. Where
it cannot be built (or another process's build outlasts the wait), qkv warns once, naming the
build folder; flash then runs its PyTorch loop (the same results, slower), and ``"auto"`` picks
torch's kernel instead. ``QKV_FLASH_KERNEL=0`` (or ``ENABLED = False``) skips the kernel
without trying. ``build_info()`` says what was built.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import platform
import warnings
from pathlib import Path
from types import ModuleType

import torch

from qkv._tracing import constant_result
from qkv.backends.flash.build import compile_extension, extension_folder
from qkv.backends.flash.loop import flat_heads
from qkv.backends.flash.rules import NO_RANGES, NO_SLOPES

# Run the calls the kernel supports on it (False: always the PyTorch loop).
ENABLED = os.environ.get("QKV_FLASH_KERNEL", "1") != "0"
# Calls with fewer queries than this (decoding) run on the kernel's decoding core (decode.h),
# which reads K/V once, where they lie (a KV cache's buffer), instead of rearranging them into
# blocks.
DECODE_QUERIES = 16
# How many pieces the decoding core splits each sequence's keys into: 0 lets it choose (it
# splits where the work items are fewer than a few per thread); a number forces it (tests use
# this to run both branches). Read at every call.
DECODE_SPLITS = 0

# The instruction set the kernel is built for: "native", "avx512" or "avx2" (see above).
ISA = os.environ.get("QKV_FLASH_ISA", "native")
ISAS = ("native", "avx512", "avx2")
# Where the float32 products run: "tiles" (the kernel's own register tiles on ATen's vectors),
# "brgemm" (torch's cpublas::brgemm: oneDNN's micro-kernels) or "blas" (torch's matrix multiply:
# MKL or OpenBLAS); "auto" picks per build (_default_products).
GEMM = os.environ.get("QKV_FLASH_GEMM", "auto")
PRODUCTS = ("tiles", "brgemm", "blas")

# The kernel's one translation unit, which includes the headers beside it.
SOURCE = Path(__file__).with_name("flash_cpu.cpp")
_COMMON_FLAGS = ["-O3", "-fopenmp"]
# ATen's vector headers pick their width from CPU_CAPABILITY_* (as torch's own kernels are
# built, once per capability); the compiler flags must allow the instructions that width needs.
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]
_AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
_AVX512_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
_loaded: dict[str, ModuleType | None] = {}
_chosen: dict[str, str] = {}
_bfloat16: dict[str, bool] = {}
_units: dict[str, bool] = {}


def capability_flags(isa: str) -> list[str]:
    """The compiler flags of a build for ``isa`` ("native", "avx512" or "avx2") on this CPU:
    the instruction set, and the CPU_CAPABILITY that gives ATen's vectors their width."""
    if isa not in ISAS:
        raise ValueError(f"QKV_FLASH_ISA: expected one of {', '.join(ISAS)}, got {isa!r}")
    if isa == "avx512":
        return [*_AVX512_FLAGS, *_capability("AVX512"), *_load_halves()]
    if isa == "avx2":
        return [*_AVX2_FLAGS, *_capability("AVX2")]
    flags = cpu_flags()
    if flags.issuperset(_AVX512_CPU_FLAGS):
        return ["-march=native", *_capability("AVX512"), *_load_halves()]
    if flags.issuperset({"avx2", "fma"}):
        return ["-march=native", *_capability("AVX2")]
    return ["-march=native", *_capability("DEFAULT")]  # aarch64 (NEON), or plain C++


def _capability_name(flags: list[str]) -> str:
    """The CPU_CAPABILITY that a build's ``flags`` give ATen's vectors (AVX512, AVX2, DEFAULT)."""
    return next(flag.split("=")[1] for flag in flags if flag.startswith("-DCPU_CAPABILITY="))


def _capability(name: str) -> list[str]:
    defines = [f"-DCPU_CAPABILITY={name}"]
    return defines if name == "DEFAULT" else [*defines, f"-DCPU_CAPABILITY_{name}"]


def _check_cpu_runs(isa: str) -> None:
    """A ValueError where this x86 CPU lacks the instructions a build for ``isa`` uses (it would
    stop at its first such instruction); elsewhere the build itself decides."""
    needs = {"avx512": _AVX512_CPU_FLAGS, "avx2": {"avx2", "fma", "f16c"}}.get(isa, set())
    flags = cpu_flags()
    if flags and not flags.issuperset(needs):
        missing = ", ".join(sorted(needs - flags))
        raise ValueError(f"QKV_FLASH_ISA: this CPU cannot run {isa!r} (it lacks {missing})")


def cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (none elsewhere)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = list(itertools.takewhile(str.strip, cpuinfo))  # to the first blank line
    except OSError:
        return {}
    return {name.strip(): value.strip() for name, _, value in (x.partition(":") for x in lines)}


def cpu_flags() -> set[str]:
    """This CPU's x86 feature flags from /proc/cpuinfo (empty elsewhere)."""
    return set(cpu_info().get("flags", "").split())


def _load_halves() -> list[str]:
    """QKV_LOAD_HALVES where the CPU carries out 512-bit operations as two 256-bit halves (AMD's
    Zen 4, family 25, whose only cores with AVX-512 these are): decoding reads 512 bits of its
    cache as two 256-bit loads there (decode_products.h)."""
    info = cpu_info()
    zen4 = info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family") == "25"
    return ["-DQKV_LOAD_HALVES"] if zen4 else []


def load() -> ModuleType | None:
    """The compiled kernel module, or None where it is switched off or cannot be built."""
    if not ENABLED:
        return None
    if ISA not in _loaded:
        _loaded[ISA] = _build(ISA)
    return _loaded[ISA]


@constant_result
def available() -> bool:
    """Whether the compiled kernel runs here (``load``: built on the first call that asks); a
    constant for torch.compile, which asks it while tracing."""
    return load() is not None


def build(isa: str) -> ModuleType:
    """The kernel built for ``isa``: built now (one line on stderr says so), or its cached build
    loaded. Unlike ``load``, raises where it cannot be built (what ``qkv build`` reports): a
    ValueError for an ISA this CPU cannot run or a setting that means nothing, a ``BuildError``
    (naming the build folder) for a failed build or for another process's build that did not
    end within ``QKV_BUILD_TIMEOUT``."""
    flags = capability_flags(isa)
    _check_cpu_runs(isa)  # (also for a build already loaded: the question is this CPU's)
    module = _loaded.get(isa)
    if module is None:
        module = _loaded[isa] = compile_extension(
            _extension_name(isa),
            SOURCE,
            cflags=[*_COMMON_FLAGS, *flags],
            ldflags=["-fopenmp"],
            what=f"flash's CPU kernel for {isa} ({_capability_name(flags)})",
        )
    return module


def build_folder(isa: str) -> Path:
    """The folder the kernel for ``isa`` is built and cached in (``TORCH_EXTENSIONS_DIR``)."""
    return extension_folder(_extension_name(isa))


def build_info() -> dict[str, object]:
    """What the kernel runs on here: the ISA it is built for (``isa``), its float32 vector width
    in bits, and the matrix-product path of each dtype; ``built`` False (and no more) where it
    is switched off or could not be built. Builds the kernel if it is not built yet."""
    module = load()
    if module is None:
        return {"isa": ISA, "built": False}
    info: dict[str, object] = module.build_info()
    low = "brgemm in bfloat16, float32 sums" if bfloat16_products() else "float32 (widened)"
    return {
        "isa": ISA,
        "built": True,
        "float32_products": products(),
        "bfloat16_products": low,
        **info,
    }


@constant_result
def bfloat16_products() -> bool:
    """Whether bfloat16 inputs are multiplied in bfloat16 (float32 sums, oneDNN's brgemm), not
    widened: on bfloat16 matrix units (AMX) or, ``native``, AVX-512 bfloat16 dot products (twice
    float32's rate: T = 4096 in 55 % of the widened time), unless ``ONEDNN_MAX_CPU_ISA`` holds
    oneDNN below them. False where the kernel is not built."""
    if ISA not in _bfloat16:
        module = load()
        limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
        allowed = limit == "ALL" or "BF16" in limit or "AMX" in limit
        dot_products = ISA == "native" and "avx512_bf16" in cpu_flags()
        _bfloat16[ISA] = module is not None and allowed and (matrix_units() or dot_products)
    return _bfloat16[ISA]


@constant_result
def matrix_units() -> bool:
    """Whether oneDNN runs bfloat16 products on this CPU's matrix units (AMX); False unbuilt."""
    if ISA not in _units:
        module = load()
        _units[ISA] = module is not None and bool(module.bfloat16_matrix_units())
    return _units[ISA]


def products() -> str:
    """Where the float32 products run in this build: ``GEMM``, or for "auto" oneDNN's brgemm with
    512-bit vectors (its AVX-512 micro-kernels beat the kernel's tiles), the kernel's own tiles
    elsewhere (on AVX2 brgemm and torch's BLAS ran at torch's speed, the tiles 1.1-1.6x it)."""
    if GEMM == "auto":
        module = load()
        wide = module is not None and module.build_info()["vector_bits"] >= 512
        return "brgemm" if wide else "tiles"
    if GEMM not in PRODUCTS:
        raise ValueError(
            f"QKV_FLASH_GEMM: expected one of auto, {', '.join(PRODUCTS)}, got {GEMM!r}"
        )
    return GEMM


@constant_result
def cached_products() -> str:
    """``products()``, worked out once per ISA and GEMM (asked on every call of the kernel)."""
    key = f"{ISA}/{GEMM}"
    if key not in _chosen:
        _chosen[key] = products()
    return _chosen[key]


def _build(isa: str) -> ModuleType | None:
    try:
        return build(isa)
    except ValueError:  # a QKV_FLASH_ISA or QKV_BUILD_TIMEOUT that means nothing: said as such
        raise
    except Exception as error:  # no compiler, no ninja, a failed build: the loop still works
        warnings.warn(
            f"qkv: flash's compiled CPU kernel is unavailable ({type(error).__name__}: {error}); "
            'backend="flash" runs its PyTorch loop instead (same results, slower), and '
            'backend="auto" uses torch\'s kernel where it would have used this one. '
            "Set QKV_FLASH_KERNEL=0 to skip the kernel without this warning.",
            RuntimeWarning,
            stacklevel=4,
        )
        return None


def _extension_name(isa: str) -> str:
    return f"qkv_flash_cpu_{isa}_{_cpu_id()}_{_source_id()}"


def _source_files() -> list[Path]:
    """Every file of the kernel's source: the C++ files and headers of ``SOURCE``'s folder, in
    a fixed order (by name)."""
    folder = SOURCE.parent
    return sorted([*folder.glob("*.cpp"), *folder.glob("*.h")], key=lambda path: path.name)


def _source_id() -> str:
    """A short hash of the kernel's source, every file of it (names and contents): builds of
    different versions (another checkout of qkv sharing the cache) never take each other's
    place, so none loads a stale build."""
    digest = hashlib.sha256()
    for path in _source_files():
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _cpu_id() -> str:
    """A short hash of this CPU's model and feature flags (what ``-march=native`` compiles for)."""
    info = cpu_info()
    model = info.get("model name", "") + info.get("flags", "") if info else platform.processor()
    return hashlib.sha256((platform.machine() + model).encode()).hexdigest()[:12]


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel runs these inputs (given no mask): it is
    switched on, the tensors are on the CPU in float32, float16 or bfloat16 and nothing is
    empty, and the kernel is built (the first call that asks builds it)."""
    return (
        ENABLED  # the cheapest tests first: auto asks on every call
        and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and q.device.type == "cpu"
        and 0 not in (q.numel(), k.numel(), v.numel())
        and available()
    )


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal_offset: int | None,
    window_offset: int | None = None,
    ranges: tuple[torch.Tensor, int] | None = None,
    softcap: float | None = None,
    slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``loop.forward`` (without a mask) on the compiled kernel: (out, lse) in float32, or None
    where it does not apply (``takes``). Query row i sees keys j <= i + ``causal_offset`` and
    j >= i + ``window_offset`` (None: no such bound); ``ranges``: packed sequences, (the keys
    [lo, hi) each query row may see, (R, Lq, 2) int64, and how many consecutive heads of q share
    one of the R) (``rules.kernel_ranges``). ``softcap``, and ALiBi ``slopes`` (one float32 per
    query head of the flattened (*B, Hq)), change each score before its exponential."""
    if not takes(q, k, v):
        return None
    kernel = load()  # built and cached by takes
    assert kernel is not None
    rules = _rule_arguments(causal_offset, window_offset, ranges, softcap, slopes)
    if q.shape[-2] < DECODE_QUERIES:  # the decoding core: K/V read once, where they lie
        if q.dtype != torch.float16 and q.shape[:-3] == k.shape[:-3] == v.shape[:-3]:
            out, lse = kernel.decode(q, k, v, scale, *rules, DECODE_SPLITS)
            return out, lse  # the common case: (*B, Hq, Lq, Dv), (*B, Hq, Lq) as they come
        dtype = torch.float32 if q.dtype == torch.float16 else q.dtype
        q_flat, k_flat, v_flat, batch = flat_heads(q, k, v, dtype)  # batch dims broadcast
        flat = q_flat.flatten(0, 1)
        out, lse = kernel.decode(flat, k_flat, v_flat, scale, *rules, DECODE_SPLITS)
    else:
        low = q.dtype == torch.bfloat16 and bfloat16_products()
        dtype = torch.bfloat16 if low else torch.float32
        q_flat, k_flat, v_flat, batch = flat_heads(q, k, v, dtype)
        causal, offset, windowed, window, *others = rules
        out, lse = kernel.forward(
            q_flat.flatten(0, 1).contiguous(),  # (N·g, Lq, Dk)
            k_flat.contiguous(),
            v_flat.contiguous(),
            scale,
            causal,
            offset,
            windowed,
            window,
            PRODUCTS.index(cached_products()),
            *others,
        )
    hq = q.shape[-3]
    return out.view(*batch, hq, *out.shape[1:]), lse.view(*batch, hq, lse.shape[-1])


def decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None
) -> torch.Tensor:
    """``forward``'s out (float32) for float32 or bfloat16 q, k, v of one batch shape with Lq <
    ``DECODE_QUERIES`` and at most a causal rule, where ``takes``: its decoding core, no more."""
    rules = _rule_arguments(causal_offset, None, None, None, None)
    return load().decode(q, k, v, scale, *rules, DECODE_SPLITS)[0]  # type: ignore[union-attr,no-any-return]


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal_offset: int | None,
    window_offset: int | None = None,
    ranges: tuple[torch.Tensor, int] | None = None,
    softcap: float | None = None,
    slopes: torch.Tensor | None = None,
    grad_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``loop.backward_all`` (without a mask) on the compiled kernel: (dq, dk, dv, dslopes) in
    float32, dq, dk and dv with the shapes of q, k and v, or None where it does not apply:
    ``takes``, and q, k and v of one batch shape (dk and dv then need no sum over broadcast
    batch dims). The rules as for ``forward``; ``grad_lse`` (*B, Hq, Lq), the gradient of a
    returned log-sum-exp (None: none). dslopes is ALiBi's slopes' gradient, one per query head
    of the flattened (*B, Hq) (None without slopes)."""
    if not (takes(q, k, v) and q.dim() >= 3 and q.shape[:-3] == k.shape[:-3] == v.shape[:-3]):
        return None
    kernel = load()
    assert kernel is not None  # built by takes
    causal, offset, windowed, window, *others = _rule_arguments(
        causal_offset, window_offset, ranges, softcap, slopes
    )
    dq, dk, dv, dslopes = kernel.backward(
        *backward_tensors(q, k, v, out, grad_out, lse, grad_lse),
        scale,
        causal,
        offset,
        windowed,
        window,
        PRODUCTS.index(cached_products()),
        *others,
    )
    grads = dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
    return (*grads, None if slopes is None else dslopes)


def backward_tensors(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    grad_lse: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """The tensors a compiled backward pass takes first, float32 and contiguous: q as (N·g, Lq,
    Dk) rows, k and v as (N, Lk, D), out and grad_out as (N·g, Lq, Dv), lse and grad_lse as
    (N·g, Lq) (an empty tensor for no grad_lse)."""
    f32 = torch.float32
    q_flat, k_flat, v_flat, _ = flat_heads(q, k, v, f32)
    rows = q_flat.flatten(0, 1).shape  # (N·g, Lq, Dk)
    no_lse = torch.empty(0)
    return (
        q_flat.reshape(rows).contiguous(),
        k_flat.contiguous(),
        v_flat.contiguous(),
        out.to(f32).reshape(*rows[:2], -1).contiguous(),
        grad_out.to(f32).reshape(*rows[:2], -1).contiguous(),
        lse.to(f32).reshape(rows[:2]).contiguous(),
        no_lse if grad_lse is None else grad_lse.to(f32).reshape(rows[:2]).contiguous(),
    )


def _rule_arguments(
    causal_offset: int | None,
    window_offset: int | None,
    ranges: tuple[torch.Tensor, int] | None,
    softcap: float | None,
    slopes: torch.Tensor | None,
) -> tuple[bool, int, bool, int, torch.Tensor, int, float, torch.Tensor]:
    """The rules as the compiled functions take them, an absent rule as False and 0 or an empty
    tensor: (causal, offset, windowed, window, key ranges, heads per range, soft-cap, slopes)."""
    bounds, heads_per_range = (NO_RANGES, 1) if ranges is None else ranges
    return (
        causal_offset is not None,
        causal_offset or 0,
        window_offset is not None,
        window_offset or 0,
        bounds,
        heads_per_range,
        softcap or 0.0,
        NO_SLOPES if slopes is None else slopes,
    )


def decode_step_takes(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> bool:
    """Whether ``decode_step`` runs these inputs: few enough queries for the decoding path, one
    batch shape, not float16 (which that path takes only widened), and what ``takes`` asks."""
    return (
        q.shape[-2] < DECODE_QUERIES
        and q.dtype != torch.float16
        and q.dim() == k_new.dim() == 4
        and q.shape[0] == k_new.shape[0]
        and takes(q, k_new, v_new)
    )


def decode_step(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    scale: float,
    causal_offset: int | None,
) -> torch.Tensor:
    """Write k_new (B, Hkv, L, Dk) and v_new (B, Hkv, L, Dv) into a KV cache's buffers ``keys``
    and ``values`` (B, Hkv, capacity, ·) at ``start`` and attend q (B, Hq, L, Dk) to the first
    ``start + L`` positions, in one call (where ``decode_step_takes``). Returns (B, Hq, L, Dv)
    in q's dtype."""
    kernel = load()
    assert kernel is not None  # decode_step_takes said so
    causal = causal_offset is not None
    out: torch.Tensor = kernel.decode_step(
        q, k_new, v_new, keys, values, start, scale, causal, causal_offset or 0, DECODE_SPLITS
    )
    return out
