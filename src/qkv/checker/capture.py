"""The implementation's own Q, K and V, read from its Linear layers while it runs.

Forward hooks on every ``nn.Linear`` record each call. The calls that read x are the Q, K, V
projections (one fused call, or one per projection, told apart by their names); the first call
after them that does not read x is the output projection, and its *input* is what the attention
produced. With those, qkv recomputes the attention in float64 and compares it with what the
implementation computed, before anything else in the module can blur the difference. ``torch``'s
``nn.MultiheadAttention`` projects with its own weights, not Linear calls; it is read from them.
Legend: B batch, H heads, L length, E features of all heads together.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from qkv.checker.inputs import Inputs
from qkv.checker.target import Output, Target


@dataclass
class Capture:
    """Float64 projections (B, L, E) and what the attention gave (B, L, Ev), in the space of
    ``finish(merged heads)``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    observed: torch.Tensor
    finish: Callable[[torch.Tensor], torch.Tensor]
    per_head: bool  # a function's q, k, v: heads were never split by the implementation
    source: str


def _identity(merged: torch.Tensor) -> torch.Tensor:
    return merged


@dataclass
class _Call:
    name: str
    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any


def run_captured(target: Target, inputs: Inputs, **options: Any) -> tuple[Output, Capture | None]:
    """Call the target once (no gradients) and read its Q, K, V; None when they cannot be found."""
    if target.kind == "function":
        with torch.no_grad():
            output = target.call(inputs, **options)
        return output, _function_capture(target, inputs, output)
    module = target.module
    assert module is not None
    calls: list[_Call] = []
    handles = []
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear) or is_multihead(sub):

            def hook(sub: nn.Module, args: Any, kwargs: Any, out: Any, name: str = name) -> None:
                calls.append(_Call(name, sub, args, kwargs, out))

            handles.append(sub.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            output = target.call(inputs, **options)
    finally:
        for handle in handles:
            handle.remove()
    return output, _module_capture(inputs.tensors[0], output, calls)


def _function_capture(target: Target, inputs: Inputs, output: Output) -> Capture:
    q, k, v = (t.detach().cpu().double() for t in inputs.tensors)
    if target.layout == "BHLD":
        q, k, v = (t.transpose(1, 2).flatten(2) for t in (q, k, v))  # (B, L, H*D)
    return Capture(
        q, k, v, output.rows.detach().cpu().double(), _identity, True, "the function's q, k, v"
    )


def _reads(call: _Call, x: torch.Tensor) -> bool:
    if not call.args or not isinstance(call.args[0], torch.Tensor):
        return False
    first = call.args[0]
    return first.shape == x.shape and torch.equal(first.detach().to("cpu", x.dtype), x)


def _module_capture(x: torch.Tensor, output: Output, calls: list[_Call]) -> Capture | None:
    mha = [c for c in calls if is_multihead(c.module)]
    linear = [c for c in calls if isinstance(c.module, nn.Linear)]
    projections = [c for c in linear if _reads(c, x)]
    if not projections:
        return _mha_capture(mha[-1]) if mha else None
    split = _split_projections(projections, x.shape[-1])
    if split is None:
        return None
    q, k, v, what = split
    after = [c for c in linear[linear.index(projections[-1]) + 1 :] if not _reads(c, x)]
    if after:  # the first Linear after the projections reads what the attention produced
        observed = after[0].args[0]
        what += f"; output projection {after[0].name} (its input is the attention's output)"
    else:
        observed = output.rows
        what += "; no output projection (the output is the attention's output)"
    return Capture(q, k, v, observed.detach().cpu().double(), _identity, False, what)


def _role(name: str) -> str | None:
    """'W_q', 'q_proj', 'to_q', 'QueryM' -> 'q'; 'qkv', 'c_attn' style fused names -> None."""
    last = name.rsplit(".", 1)[-1].lower()
    for word, role in (("query", "q"), ("key", "k"), ("value", "v")):
        if word in last:
            return role
    letters = re.sub(r"proj|linear|weight|layer|lin|fc|to|w", "", re.sub("[^a-z]", "", last))
    return letters if letters in ("q", "k", "v", "kv") else None


def _split_projections(
    calls: list[_Call], width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str] | None:
    """Q, K, V from the projection calls; ``width`` is x's (the usual width of Q)."""
    outs = [c.output.detach().cpu().double() for c in calls]
    names = ", ".join(f"{c.name} ({_shape(c.module)})" for c in calls)
    if len(calls) == 1:  # [Q; K; V] stacked: thirds, or Q as wide as x and K, V narrower
        fused = outs[0].shape[-1]
        if fused != 3 * width and fused > width and (fused - width) % 2 == 0:
            q, k, v = outs[0].split([width, (fused - width) // 2, (fused - width) // 2], dim=-1)
        elif fused % 3 == 0:
            q, k, v = outs[0].chunk(3, dim=-1)
        else:
            return None
        return q, k, v, f"fused Q/K/V projection {names}"
    roles = [_role(c.name) for c in calls]
    if len(calls) == 2:  # queries, then keys and values fused (or named the other way round)
        q_at = 1 if roles[1] == "q" or roles[0] == "kv" else 0
        k, v = outs[1 - q_at].chunk(2, dim=-1)
        return outs[q_at], k, v, f"Q and fused K/V projections {names}"
    if len(calls) == 3:
        by_role = dict(zip(roles, outs))
        if set(by_role) != {"q", "k", "v"}:  # names say nothing: the usual order
            by_role = dict(zip("qkv", outs))
        return by_role["q"], by_role["k"], by_role["v"], f"Q, K, V projections {names}"
    return None


def _shape(module: nn.Module) -> str:
    assert isinstance(module, nn.Linear)
    return f"{module.in_features} → {module.out_features}"


def is_multihead(module: nn.Module) -> bool:
    """torch's ``nn.MultiheadAttention`` or a drop-in with its parameters (``qkv``'s)."""
    return hasattr(module, "in_proj_weight") and hasattr(module, "num_heads")


def _mha_capture(call: _Call) -> Capture | None:
    mha: Any = call.module
    query = call.args[0] if call.args else call.kwargs.get("query")
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        return None
    rows = query if mha.batch_first else query.transpose(0, 1)
    rows = rows.detach().cpu().double()
    embed = mha.embed_dim
    if mha.in_proj_weight is not None:
        weights = mha.in_proj_weight.detach().cpu().double().split(embed)
    else:
        weights = tuple(
            getattr(mha, f"{n}_proj_weight").detach().cpu().double() for n in ("q", "k", "v")
        )
    bias = mha.in_proj_bias
    biases = (None,) * 3 if bias is None else bias.detach().cpu().double().split(embed)
    q, k, v = (F.linear(rows, w, b) for w, b in zip(weights, biases))
    out = call.output[0] if isinstance(call.output, tuple) else call.output
    out = (out if mha.batch_first else out.transpose(0, 1)).detach().cpu().double()
    weight = mha.out_proj.weight.detach().cpu().double()
    out_bias = None if mha.out_proj.bias is None else mha.out_proj.bias.detach().cpu().double()

    def finish(merged: torch.Tensor) -> torch.Tensor:
        return F.linear(merged, weight, out_bias)

    source = "nn.MultiheadAttention's in_proj_weight and out_proj"
    return Capture(q, k, v, out, finish, False, source)
