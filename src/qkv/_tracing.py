"""Whether a call is being traced (torch.compile, torch.export, FakeTensor or meta tensors), and
how qkv keeps what a tracer cannot follow out of its path.

A traced call never reaches code that reads files, the environment or tensor values: backends
decide from shapes, dtypes and devices, flash runs as one custom operator
(``backends/flash/ops.py``), and facts about this machine that cannot change within a process
(whether the compiled kernel is built, where its products run) are ``constant_result``
functions, which torch.compile calls once while tracing and keeps as constants.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable[..., object])

# The types of tensors that run eagerly (a tracer's tensors are subclasses: FakeTensor,
# FunctionalTensor, ...).
_EAGER_TYPES = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)


def traced(x: torch.Tensor) -> bool:
    """Whether ``x`` belongs to a trace rather than to an eager computation: inside
    torch.compile or torch.export, a FakeTensor (or any tracer's tensor subclass) or a tensor
    on the meta device."""
    return torch.compiler.is_compiling() or type(x) not in _EAGER_TYPES or x.device.type == "meta"


def constant_result(fn: F) -> F:
    """Mark ``fn`` (no arguments, or constant ones) as returning the same value for the whole
    process: what ``torch.compiler.assume_constant_result`` does (it sets this attribute), without
    importing torch's compiler (seconds) when qkv is imported. tests/test_compile.py checks that
    torch's decorator still sets the same attribute."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn
