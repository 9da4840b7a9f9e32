"""``qkv bench --arguments``: what each argument real models use costs on flash.

Each of ``sinks``, ``softcap``, ``alibi_slopes``, ``window`` and ``segments`` is added to the
same causal call, (B, H, T, D) float32, and timed against the call without it (interleaved, so all
see the same load): forward, and forward+backward. The path says where the forward ran: the compiled
kernel, or the PyTorch loop (where the kernel is not available); the backward pass runs where
flash's autograd Function sends it (the kernel's backward where the kernel takes the call). A
window of T/32 keys and documents of 256 tokens skip most of the work: their ratio says how much.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

import qkv
from qkv.backends.flash import runs_compiled
from qkv.bench.cases import PASSES, Shape
from qkv.bench.timing import interleaved, progress, seconds
from qkv.canonical import canonical_call

DOCUMENT = 256  # tokens per packed document

Variant = Callable[[int, int], dict[str, Any]]  # (T, H) -> the extra keyword arguments
VARIANTS: dict[str, Variant] = {
    "causal": lambda t, h: {},
    "+ sinks": lambda t, h: {"sinks": torch.zeros(h)},
    "+ softcap=50": lambda t, h: {"softcap": 50.0},
    "+ alibi_slopes": lambda t, h: {"alibi_slopes": 2.0 ** -torch.arange(1.0, h + 1)},
    "+ window=T/32": lambda t, h: {"window": max(1, t // 32)},
    f"+ segments ({DOCUMENT}-token documents)": lambda t, h: {
        "segments": torch.arange(t) // DOCUMENT
    },
}


def arguments_benchmark(
    length: int, shape: Shape, repeats: int, passes: Sequence[str] = PASSES
) -> list[dict[str, Any]]:
    """Median ms of every variant at T = ``length`` per pass, its ratio to the plain causal
    call, and the forward's path; a progress line per pass."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(shape.batch, shape.heads, length, shape.dim, generator=generator)
        for _ in range(3)
    )
    extras = {name: variant(length, shape.heads) for name, variant in VARIANTS.items()}
    rows = []
    for pass_ in passes:
        backward = pass_ != "forward"
        steps = {
            name: functools.partial(run_once, q, k, v, extra, backward)
            for name, extra in extras.items()
        }
        warm_up = max(seconds(step) for step in steps.values())
        count = min(50, max(repeats, int(0.5 / max(warm_up, 1e-6))))
        times = interleaved(steps, count)
        medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        plain = medians["causal"]
        for name, extra in extras.items():
            rows.append(
                {
                    "pass": pass_,
                    "variant": name,
                    "ms": medians[name],
                    "vs_causal": medians[name] / plain,
                    "path": path(q, k, v, extra),
                }
            )
        progress(f"{pass_}: {', '.join(f'{n} {m:.2f} ms' for n, m in medians.items())}")
    return rows


def run_once(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra: dict[str, Any], backward: bool
) -> None:
    if not backward:
        with torch.no_grad():
            qkv.attention(q, k, v, causal=True, backend="flash", **extra)
        return
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    learnable = {
        name: value.detach().requires_grad_() if name in ("sinks", "alibi_slopes") else value
        for name, value in extra.items()
    }
    out = qkv.attention(*leaves, causal=True, backend="flash", **learnable)
    torch.autograd.backward(out.sum())


def path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra: dict[str, Any]) -> str:
    """Where flash runs the forward pass of this call: "kernel" or "loop"."""
    plain = dict(mask=None, causal=True, scale=None, dropout_p=0.0, return_weights=False)
    call, _ = canonical_call(q, k, v, **plain, backend="flash", **extra)
    return "kernel" if runs_compiled(call) else "loop"


def format_arguments(rows: Sequence[dict[str, Any]], length: int, shape: Shape) -> str:
    """One line per pass and variant: median ms, the ratio to the plain causal call, the path."""
    title = (
        f"flash, causal, float32, B={shape.batch} H={shape.heads} T={length} D={shape.dim}: "
        "median ms, and the time over the plain causal call's"
    )
    header = f"{'pass':<18}{'variant':<36}{'ms':>10}{'vs causal':>11}  path"
    lines = [title, header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['pass']:<18}{row['variant']:<36}{row['ms']:>10.2f}"
            f"{row['vs_causal']:>10.2f}x  {row['path']}"
        )
    return "\n".join(lines)
