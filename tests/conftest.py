"""Shared test set-up: a reproducible hypothesis profile, seeded torch, the backend fixture.

hypothesis profiles: "ci" (the default: derandomized, so every run draws the same examples) and
"thorough" (many more examples, random); pick one with QKV_HYPOTHESIS_PROFILE=thorough.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from oracle import BACKENDS

from qkv.backends import flash

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=20,
    derandomize=True,
    database=None,
    print_blob=True,
    # The function-scoped fixtures here (a backend name, a seed) hold no state between examples.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "thorough",
    deadline=None,
    max_examples=500,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("QKV_HYPOTHESIS_PROFILE", "ci"))

# Test tensors are tiny: a second intra-op thread only adds hand-over cost, and on a busy or
# shared 2-core machine (or under pytest-xdist) it makes each small op many times slower.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test starts from the same random state."""
    torch.manual_seed(0)


@pytest.fixture(params=(*BACKENDS, "flash-loop"))
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each of qkv's backends, and "auto". "flash-loop" is flash with its compiled CPU kernel
    switched off, so that the PyTorch loop also meets the contract on the calls the kernel
    would take (float32/float16/bfloat16 without a mask)."""
    if request.param == "flash-loop":
        monkeypatch.setattr(flash.kernel, "ENABLED", False)
        return "flash"
    return request.param


@pytest.fixture(params=["kernel", "loop"])
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """flash's compiled CPU kernel (skipped where it is not available), or the same call with
    the kernel switched off (QKV_FLASH_KERNEL=0's paths)."""
    if request.param == "loop":
        monkeypatch.setattr(flash.kernel, "ENABLED", False)
    elif flash.kernel.load() is None:
        pytest.skip("flash's compiled kernel is not available")
    return str(request.param)
