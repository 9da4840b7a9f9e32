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
from pathlib import Path

import pytest
import torch
from oracle import TOLERANCE, oracle

from qkv.backends.flash import kernel

SRC = Path(__file__).resolve().parents[1] / "src"

# (name, q shape, k shape, v shape, causal): more than one key block (512 keys) and lengths and
# features that fill no whole vector, grouped heads, and the decoding path (fewer than 16 queries).
CASES = [
    ("full", (1, 2, 130, 40), (1, 2, 700, 40), (1, 2, 700, 40), False),
    ("causal", (1, 2, 300, 64), (1, 2, 300, 64), (1, 2, 300, 40), True),
    ("causal top-left", (2, 1, 200, 24), (2, 1, 333, 24), (2, 1, 333, 24), "top-left"),
    ("grouped", (2, 6, 150, 64), (2, 2, 260, 64), (2, 2, 260, 48), False),
    ("decoding", (1, 4, 3, 64), (1, 2, 530, 64), (1, 2, 530, 64), True),
]

# Runs in a fresh process built for QKV_FLASH_ISA: every case through qkv.attention on the
# kernel (never the PyTorch loop), the outputs saved beside the inputs.
_RUN_CASES = """
import sys, torch, qkv
from qkv.backends.flash import kernel
path = sys.argv[1]
saved = torch.load(path)
info = kernel.build_info()
outputs = []
for (q, k, v), causal in zip(saved["inputs"], saved["causal"]):
    assert kernel.takes(q, k, v), "the kernel does not take this call"
    outputs.append(qkv.attention(q, k, v, causal=causal, backend="flash"))
torch.save({"info": info, "outputs": outputs}, path)
"""


def test_each_isa_builds_with_its_own_instructions_and_vector_width() -> None:
    avx2 = kernel.capability_flags("avx2")
    assert "-mavx2" in avx2 and "-DCPU_CAPABILITY_AVX2" in avx2
    assert not any("avx512" in flag or "native" in flag for flag in avx2)
    avx512 = kernel.capability_flags("avx512")
    assert "-mavx512f" in avx512 and "-DCPU_CAPABILITY_AVX512" in avx512
    assert not any("native" in flag for flag in avx512)
    assert "-march=native" in kernel.capability_flags("native")


def test_an_unknown_isa_or_product_path_is_a_value_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match=r"QKV_FLASH_ISA: expected one of .*got 'sse'"):
        kernel.capability_flags("sse")
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
    """float32 and bfloat16, full, causal, grouped and decoding calls on the AVX2 build."""
    inputs, causal = [], []
    for dtype in (torch.float32, torch.bfloat16):
        for _, q_shape, k_shape, v_shape, rule in CASES:
            inputs.append(tuple(torch.randn(s).to(dtype) for s in (q_shape, k_shape, v_shape)))
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
    for (q, k, v), rule, out in zip(inputs, causal, result["outputs"], strict=True):
        expected, _ = oracle(q.double(), k.double(), v.double(), causal=rule)
        atol, rtol = TOLERANCE[q.dtype]
        assert out.dtype == q.dtype
        torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


def _cross_compiler() -> str | None:
    return shutil.which("aarch64-linux-gnu-g++")


@pytest.mark.skipif(_cross_compiler() is None, reason="no aarch64-linux-gnu-g++ installed")
def test_the_source_compiles_for_aarch64() -> None:
    """The kernel's one source for ARM (NEON through ATen's vectors): a syntax-only compile
    against torch's headers, as torch's extension builder would compile it there."""
    torch_include = Path(torch.__file__).parent / "include"
    command = [
        str(_cross_compiler()),
        "-std=c++17",
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
