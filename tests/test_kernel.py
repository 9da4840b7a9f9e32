"""flash's compiled CPU kernel as built for each instruction set (``QKV_FLASH_ISA``).

The tests in test_flash.py and test_functional.py run the kernel as built for this machine
(``native``); here the AVX2 build, which a CPU without AVX-512 runs, is built on this one and
checked against the float64 oracle in a fresh process (the ISA is fixed per process), and the
source is compiled for aarch64 (NEON) with a cross compiler where one is installed. Building
takes a minute or two; torch caches the build (``TORCH_EXTENSIONS_DIR``, by default under the
user's cache), so later runs pay nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from oracle import TOLERANCE, oracle

import qkv
from qkv.backends.flash import kernel, loop

SRC = Path(__file__).resolve().parents[1] / "src"

# (name, q shape, k shape, v shape, causal): more than one key block (512 keys) and lengths and
# features that fill no whole vector, grouped heads, and the decoding path (fewer than 16 queries:
# rows of a head four at a time and alone, features in pairs of vectors and a part of one).
# The kernel packs keys for its products per query block where each key is read by at most 3
# query blocks on average ("full", "causal", "causal top-left"), else once per call ("grouped":
# each key read by 3 query heads × 2 blocks, and the two last).
CASES = [
    ("full", (1, 2, 130, 40), (1, 2, 700, 40), (1, 2, 700, 40), False),
    ("causal", (1, 2, 300, 64), (1, 2, 300, 64), (1, 2, 300, 40), True),
    ("causal top-left", (2, 1, 200, 24), (2, 1, 333, 24), (2, 1, 333, 24), "top-left"),
    ("grouped", (2, 6, 150, 64), (2, 2, 260, 64), (2, 2, 260, 48), False),
    ("decoding", (1, 4, 3, 64), (1, 2, 530, 64), (1, 2, 530, 64), True),
    ("decoding, a row per head", (1, 3, 1, 44), (1, 3, 400, 44), (1, 3, 400, 44), True),
    ("decoding, four rows per head", (1, 8, 1, 36), (1, 2, 300, 36), (1, 2, 300, 36), True),
    ("keys read 18 times", (1, 2, 1100, 40), (1, 1, 600, 40), (1, 1, 600, 40), False),
    ("long causal", (1, 1, 1300, 32), (1, 1, 1300, 32), (1, 1, 1300, 24), True),
]

# Runs in a fresh process built for QKV_FLASH_ISA: every case forward and backward through
# qkv.attention on the kernel (never the PyTorch loop), the results saved beside the inputs.
_RUN_CASES = """
import sys, torch, qkv
from qkv.backends.flash import kernel
path = sys.argv[1]
saved = torch.load(path)
info = kernel.build_info()
compiled, calls, results = kernel.backward, [], []
kernel.backward = lambda *a, **kw: calls.append(1) or compiled(*a, **kw)
for (q, k, v, grad_out), causal in zip(saved["inputs"], saved["causal"]):
    assert kernel.takes(q, k, v), "the kernel does not take this call"
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out = qkv.attention(*leaves, causal=causal, backend="flash")
    results.append((out.detach(), *torch.autograd.grad(out, leaves, grad_out)))
assert len(calls) == len(results), "a backward pass did not run on the kernel"
torch.save({"info": info, "results": results}, path)
"""


def test_each_isa_builds_with_its_own_instructions_and_vector_width() -> None:
    avx2 = kernel.capability_flags("avx2")
    assert "-mavx2" in avx2 and "-DCPU_CAPABILITY_AVX2" in avx2
    assert not any("avx512" in flag or "native" in flag for flag in avx2)
    avx512 = kernel.capability_flags("avx512")
    assert "-mavx512f" in avx512 and "-DCPU_CAPABILITY_AVX512" in avx512
    assert not any("native" in flag for flag in avx512)
    assert "-march=native" in kernel.capability_flags("native")


def test_only_zen_4_builds_read_the_cache_in_256_bit_halves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    avx512 = "fpu avx2 fma f16c avx512f avx512bw avx512vl avx512dq"
    cpus = {
        ("AuthenticAMD", "25"): True,  # Zen 4: 512-bit operations as two halves
        ("AuthenticAMD", "26"): False,  # Zen 5
        ("GenuineIntel", "6"): False,
    }
    for (vendor, family), halves in cpus.items():
        info = {"vendor_id": vendor, "cpu family": family, "flags": avx512}
        monkeypatch.setattr(kernel, "cpu_info", lambda info=info: info)
        assert kernel.cpu_flags() == set(avx512.split())
        for isa in ("native", "avx512"):
            assert ("-DQKV_LOAD_HALVES" in kernel.capability_flags(isa)) == halves, (vendor, isa)
        assert "-DQKV_LOAD_HALVES" not in kernel.capability_flags("avx2")


def test_an_unknown_isa_or_product_path_is_a_value_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match=r"QKV_FLASH_ISA: expected one of .*got 'sse'"):
        kernel.capability_flags("sse")
    monkeypatch.setattr(kernel, "cpu_flags", lambda: {"sse2", "avx"})
    with pytest.raises(ValueError, match=r"QKV_FLASH_ISA: this CPU cannot run 'avx2' \(it lacks"):
        kernel._build("avx2")
    monkeypatch.setattr(kernel, "GEMM", "cublas")
    with pytest.raises(ValueError, match=r"QKV_FLASH_GEMM: expected one of .*got 'cublas'"):
        kernel.products()


def test_build_info_names_what_this_build_runs() -> None:
    if kernel.load() is None:
        pytest.skip("the compiled kernel is switched off or cannot be built here")
    info = kernel.build_info()
    flags = kernel.cpu_flags()
    wide = kernel.ISA == "avx512" or (kernel.ISA == "native" and "avx512f" in flags)
    assert info["vector_bits"] == (512 if wide else 256 if "avx2" in flags else 128)
    assert info["float32_products"] == ("brgemm" if wide else "tiles") or kernel.GEMM != "auto"
    assert info["isa"] == kernel.ISA and info["built"] is True


def _can_build() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None and kernel.ENABLED


@pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= kernel.cpu_flags() or not _can_build(),
    reason="needs an x86 CPU with AVX2, a C++ compiler and the kernel switched on",
)
def test_the_avx2_build_matches_float64(tmp_path: Path) -> None:
    """float32 and bfloat16, full, causal, grouped and decoding calls on the AVX2 build, their
    outputs and gradients."""
    inputs, causal = [], []
    for dtype in (torch.float32, torch.bfloat16):
        for _, q_shape, k_shape, v_shape, rule in CASES:
            out_shape = (*q_shape[:-1], v_shape[-1])
            shapes = (q_shape, k_shape, v_shape, out_shape)
            inputs.append(tuple(torch.randn(s).to(dtype) for s in shapes))
            causal.append(rule)
    path = tmp_path / "cases.pt"
    torch.save({"inputs": inputs, "causal": causal}, path)
    environment = {**os.environ, "QKV_FLASH_ISA": "avx2", "PYTHONPATH": str(SRC)}
    run = subprocess.run(
        [sys.executable, "-c", _RUN_CASES, str(path)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = torch.load(path)
    assert result["info"]["capability"] == "AVX2" and result["info"]["vector_bits"] == 256
    for (q, k, v, grad_out), rule, got in zip(inputs, causal, result["results"], strict=True):
        assert_matches_float64(q, k, v, grad_out, rule, got)


# Runs test_decoding.py in a fresh process built for QKV_FLASH_ISA, its build checked first.
_RUN_DECODING_TESTS = """
import sys, pytest
from qkv.backends.flash import kernel
assert kernel.build_info()["capability"] == sys.argv[1], kernel.build_info()
sys.exit(pytest.main(["-q", "-o", "addopts=", "-p", "no:cacheprovider", sys.argv[2]]))
"""


@pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= kernel.cpu_flags() or not _can_build(),
    reason="needs an x86 CPU with AVX2, a C++ compiler and the kernel switched on",
)
def test_the_avx2_build_passes_the_decoding_tests() -> None:
    """The decoding core's tests (every path split and unsplit against the oracle, paged and
    contiguous caches bit for bit) on the AVX2 build, whose Σ p v takes float32 grouped-query
    rows its own way (decode_products.h's lone_rows)."""
    tests = Path(__file__).resolve().parent
    path = f"{SRC}{os.pathsep}{tests}"
    environment = {**os.environ, "QKV_FLASH_ISA": "avx2", "PYTHONPATH": path}
    run = subprocess.run(
        [sys.executable, "-c", _RUN_DECODING_TESTS, "AVX2", str(tests / "test_decoding.py")],
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tests.parent,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-4000:]


def assert_matches_float64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    causal: object,
    got: Sequence[torch.Tensor],
) -> None:
    """got = (out, dq, dk, dv) against the float64 oracle and its autograd: the output within
    the dtype's tolerance, the gradients within 4 times it (as in test_functional.py)."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected_out, _ = oracle(*leaves, causal=causal)
    expected = torch.autograd.grad(expected_out, leaves, grad_out.double())
    atol, rtol = TOLERANCE[q.dtype]
    assert all(x.dtype == q.dtype for x in got)
    torch.testing.assert_close(got[0].double(), expected_out, atol=atol, rtol=rtol)
    for grad, want in zip(got[1:], expected, strict=True):
        torch.testing.assert_close(grad.double(), want, atol=4 * atol, rtol=4 * rtol)


# (dtype, where the float32 products run): both backward paths, the kernel's own tiles and
# oneDNN's brgemm (which sums dKᵀ and dVᵀ), whichever this build picks by itself ("auto").
PRODUCT_PATHS = [(torch.float32, "tiles"), (torch.float32, "brgemm"), (torch.bfloat16, "auto")]
# Every case on every path, but the long one on the tiles (its float64 oracle takes seconds;
# the AVX2 build's test above runs it on the tiles).
BACKWARD_CASES = [
    (case, dtype, products)
    for case in CASES
    for dtype, products in PRODUCT_PATHS
    if not (case[0] == "long causal" and products == "tiles")
]


@pytest.mark.parametrize(
    ("case", "dtype", "products"),
    BACKWARD_CASES,
    ids=[f"{c[0]}-{d}-{p}" for c, d, p in BACKWARD_CASES],
)
def test_the_compiled_backward_matches_float64(
    monkeypatch: pytest.MonkeyPatch, case: tuple[Any, ...], dtype: torch.dtype, products: str
) -> None:
    """This machine's build, forward and backward, every call on the kernel."""
    if kernel.load() is None:
        pytest.skip("the compiled kernel is switched off or cannot be built here")
    monkeypatch.setattr(kernel, "GEMM", products)
    _, q_shape, k_shape, v_shape, rule = case
    compiled, calls = kernel.backward, []
    monkeypatch.setattr(kernel, "backward", lambda *a, **kw: calls.append(1) or compiled(*a, **kw))
    q, k, v = (torch.randn(s).to(dtype).requires_grad_() for s in (q_shape, k_shape, v_shape))
    out = qkv.attention(q, k, v, causal=rule, backend="flash")
    grad_out = torch.randn(out.shape).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert calls == [1], "the backward pass did not run on the kernel"
    assert_matches_float64(q, k, v, grad_out, rule, (out, *grads))


def _cross_compiler() -> str | None:
    return shutil.which("aarch64-linux-gnu-g++")


@pytest.mark.skipif(_cross_compiler() is None, reason="no aarch64-linux-gnu-g++ installed")
def test_the_source_compiles_for_aarch64() -> None:
    """The kernel's source (flash_cpu.cpp and the headers it includes) for ARM (NEON through
    ATen's vectors): a syntax-only compile against torch's headers, as torch's extension builder
    would compile it there."""
    torch_include = Path(torch.__file__).parent / "include"
    command = [
        str(_cross_compiler()),
        "-std=c++20",  # as torch's extension builder compiles
        "-fsyntax-only",
        "-march=armv8-a",
        "-fopenmp",
        "-DCPU_CAPABILITY=DEFAULT",
        "-DTORCH_EXTENSION_NAME=qkv_flash_cpu",
        f"-I{torch_include}",
        f"-I{torch_include / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}",
        str(kernel.SOURCE),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]


def test_the_build_is_named_after_every_source_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edit to any C++ file or header of the kernel gives its build a new name (no stale build
    is loaded), and the same files always give the same name."""
    for path in kernel.SOURCE.parent.iterdir():
        if path.suffix in (".cpp", ".h"):
            shutil.copy(path, tmp_path / path.name)
    monkeypatch.setattr(kernel, "SOURCE", tmp_path / kernel.SOURCE.name)
    files = sorted(path for path in tmp_path.iterdir() if path.suffix in (".cpp", ".h"))
    assert len(files) > 1 and kernel._source_id() == kernel._source_id()
    names = {kernel._source_id()}
    for path in files:
        path.write_text(path.read_text() + "\n")
        names.add(kernel._source_id())
    assert len(names) == len(files) + 1


# (name, q shape, k shape, keyword arguments): every score rule the compiled backward takes, with
# grouped heads, causal or not, lengths crossing key blocks (512 keys) and query blocks (128).
RULE_CASES = [
    ("window", (2, 4, 300, 24), (2, 2, 700, 24), {"causal": True, "window": 100}),
    ("two-sided window", (1, 4, 600, 32), (1, 2, 600, 32), {"window": (37, 200)}),
    ("segments", (2, 4, 700, 16), (2, 2, 700, 16), {"causal": True, "segments": "runs"}),
    ("softcap", (1, 4, 300, 40), (1, 2, 650, 40), {"softcap": 0.7}),
    ("causal softcap", (2, 2, 300, 32), (2, 2, 300, 32), {"causal": True, "softcap": 5.0}),
    ("alibi", (2, 4, 260, 32), (2, 1, 600, 32), {"alibi_slopes": "slopes"}),
    (
        "everything",
        (2, 4, 600, 16),
        (2, 2, 600, 16),
        {
            "causal": True,
            "window": (150, None),
            "segments": "runs",
            "softcap": 2.0,
            "alibi_slopes": "batch slopes",
            "sinks": "sinks",
        },
    ),
]


def _rule_arguments(case: tuple[Any, ...], dtype: torch.dtype) -> tuple[list[torch.Tensor], dict]:
    """[q, k, v] and the keyword arguments of a RULE_CASES case, slopes and sinks learnable."""
    _, q_shape, k_shape, structure = case
    generator = torch.Generator().manual_seed(q_shape[-2] + k_shape[-2])
    q, k, v = (torch.randn(s, generator=generator) for s in (q_shape, k_shape, k_shape))
    heads, keys = q_shape[1], k_shape[-2]
    values = {
        "runs": torch.arange(keys) // 97,
        "sinks": torch.randn(heads, generator=generator),
        "slopes": torch.rand(heads, generator=generator),
        # a slope of 0 (head 0) changes no score but still has a gradient
        "batch slopes": torch.rand(q_shape[0], heads, generator=generator)
        * (torch.arange(heads) > 0),
    }
    kwargs = {name: values.get(x, x) if isinstance(x, str) else x for name, x in structure.items()}
    for name in ("alibi_slopes", "sinks"):
        if name in kwargs:
            kwargs[name] = kwargs[name].requires_grad_()
    return [x.to(dtype).requires_grad_() for x in (q, k, v)], kwargs


@pytest.mark.parametrize(
    ("dtype", "products"), PRODUCT_PATHS, ids=[f"{d}-{p}" for d, p in PRODUCT_PATHS]
)
@pytest.mark.parametrize("case", RULE_CASES, ids=[case[0] for case in RULE_CASES])
def test_the_compiled_backward_takes_every_score_rule(
    monkeypatch: pytest.MonkeyPatch, case: tuple[Any, ...], dtype: torch.dtype, products: str
) -> None:
    """Windows, packed segments, soft-capping and ALiBi (its slopes' gradient too) on the
    kernel's backward pass, never the loop's, against the float64 reference's gradients."""
    if kernel.load() is None:
        pytest.skip("the compiled kernel is switched off or cannot be built here")
    monkeypatch.setattr(kernel, "GEMM", products)
    compiled, calls = kernel.backward, []
    monkeypatch.setattr(kernel, "backward", lambda *a, **kw: calls.append(1) or compiled(*a, **kw))
    monkeypatch.setattr(loop, "backward_all", None)  # the loop's backward must not run
    leaves, kwargs = _rule_arguments(case, dtype)
    names = [n for n in ("alibi_slopes", "sinks") if n in kwargs]
    out = qkv.attention(*leaves, backend="flash", **kwargs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = torch.autograd.grad(out, [*leaves, *(kwargs[n] for n in names)], grad_out)
    assert calls == [1], "the backward pass did not run on the kernel"
    wide = {n: x.detach().double().requires_grad_() for n, x in zip("qkv", leaves)}
    wide_kwargs = {**kwargs, **{n: kwargs[n].detach().double().requires_grad_() for n in names}}
    expected_out = qkv.attention(*wide.values(), backend="reference", **wide_kwargs)
    wrt = [*wide.values(), *(wide_kwargs[n] for n in names)]
    expected = torch.autograd.grad(expected_out, wrt, grad_out.double())
    atol, rtol = TOLERANCE[dtype]
    # slopes and sinks: sums over every row (and key), whose rounding errors add up
    summed = out.shape[0] * out.shape[-2] * leaves[1].shape[-2]
    for name, grad, want in zip(["q", "k", "v", *names], grads, expected, strict=True):
        scale = 1.0 if name in "qkv" else summed**0.5
        torch.testing.assert_close(
            grad.double(),
            want,
            atol=4 * atol * scale,
            rtol=4 * rtol,
            msg=lambda m, name=name: f"{name}: {m}",
        )


@pytest.mark.parametrize("with_rules", [False, True], ids=["plain", "rules"])
def test_the_compiled_backward_is_deterministic(with_rules: bool) -> None:
    """Two threads and one key/value head serving four query heads: the query blocks split
    between the threads, whose dK and dV parts are added in a fixed order. The same call twice
    gives the same bits, plain and with a window, soft-capping and ALiBi (the slopes' gradient
    included)."""
    if kernel.load() is None:
        pytest.skip("the compiled kernel is switched off or cannot be built here")
    q, k, v = (torch.randn(1, 4, 700, 32) for _ in range(3))
    k, v = k[:, :1], v[:, :1]
    rules: tuple[Any, ...] = ()
    if with_rules:
        rules = (-200, None, 5.0, torch.rand(4))  # window offset, no segments, softcap, slopes
    forward = kernel.forward(q, k, v, 0.2, 0, *rules)
    assert forward is not None, "the kernel does not take this call"
    out, lse = forward
    grad_out = torch.randn(out.shape)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = [kernel.backward(q, k, v, out, grad_out, lse, 0.2, 0, *rules) for _ in range(2)]
    finally:
        torch.set_num_threads(threads)
    first, second = runs
    assert first is not None and second is not None
    assert (first[3] is not None) == with_rules  # the slopes' gradient, with slopes only
    for one, two in zip(first[:3], second[:3], strict=True):
        assert torch.equal(one, two)
    if with_rules:
        assert torch.equal(first[3], second[3])
