"""``qkv bench --mods``, against torch: ``qkv.flex_attention``'s forward pass with six rules
written as mods against ``torch.compile(torch.nn.attention.flex_attention.flex_attention)``
(inductor's C++ template on the CPU) with the same ``BlockMask``, and against qkv's own argument
for the same rule; and a training step (forward + backward) with a mod against its forward.

The rules, all causal: causal alone, a sliding window of 256, 16 documents, tanh soft-cap 50,
ALiBi (a slope per head), a learned relative-position bias (a captured (H, 2T − 1) table); at
T = 2048 and 4096, float32 and bfloat16, (B, H, D) of the run (1, 8, 64 by default). Medians
of interleaved repetitions, compilation done before timing.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable
from typing import Any

import torch

import qkv
from qkv.bench.cases import Shape
from qkv.bench.timing import interleaved, progress, seconds

LENGTHS = (2048, 4096)
DTYPES = (torch.float32, torch.bfloat16)
WINDOW, DOCUMENTS, CAP = 256, 16, 50.0


def _rules(length: int, heads: int) -> dict[str, tuple[Any, Any, dict[str, Any] | None]]:
    """name: (score_mod, mask_mod, qkv's own arguments for the same rule or None)."""
    ids = torch.arange(length) * DOCUMENTS // length
    slopes = 2.0 ** -torch.arange(1.0, heads + 1)
    table = torch.randn(heads, 2 * length - 1, generator=torch.Generator().manual_seed(1))

    def causal(b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return qi >= kv

    def window(b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return (qi >= kv) & (qi - kv < WINDOW)

    def documents(b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return (qi >= kv) & (ids[qi] == ids[kv])

    def softcap(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return CAP * torch.tanh(score / CAP)

    def alibi(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return score - slopes[h] * (qi - kv)

    def relative(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return score + table[h, qi - kv + length - 1]

    return {
        "causal": (None, causal, {}),
        f"window {WINDOW}": (None, window, {"window": WINDOW}),
        f"{DOCUMENTS} documents": (None, documents, {"segments": ids}),
        "tanh soft-cap": (softcap, causal, {"softcap": CAP}),
        "ALiBi": (alibi, causal, {"alibi_slopes": slopes}),
        "relative bias": (relative, causal, None),
    }


def versus_torch(shape: Shape, repeats: int) -> dict[str, Any]:
    """Every rule × length × dtype: ms of qkv, torch compiled and qkv's argument, the ratios,
    and their geometric means."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):  # one compiled kernel per rule, length, dtype
            setattr(torch._dynamo.config, name, 512)
    compiled = torch.compile(flex_attention, dynamic=False)  # (one kernel per length)
    rows = []
    for length in LENGTHS:
        gen = torch.Generator().manual_seed(0)
        base = [
            torch.randn(shape.batch, shape.heads, length, shape.dim, generator=gen) for _ in "qkv"
        ]
        for name, (score_mod, mask_mod, own) in _rules(length, shape.heads).items():
            block_mask = create_block_mask(mask_mod, None, None, length, length, device="cpu")
            for dtype in DTYPES:
                q, k, v = (x.to(dtype) for x in base)
                steps: dict[str, Callable[[], Any]] = {
                    "qkv": functools.partial(qkv.flex_attention, q, k, v, score_mod, block_mask),
                }
                theirs = functools.partial(
                    compiled, q, k, v, score_mod=score_mod, block_mask=block_mask
                )
                failed = _fails(theirs)
                if failed is None:
                    steps["torch compiled"] = theirs
                if own is not None:
                    steps["qkv argument"] = functools.partial(
                        qkv.attention, q, k, v, causal=True, backend="flash", **own
                    )
                row = _timed(steps, repeats)
                row.update(rule=name, length=length, dtype=str(dtype).removeprefix("torch."))
                if failed is None:
                    row["qkv_over_torch"] = row["ms"]["torch compiled"] / row["ms"]["qkv"]
                else:
                    row["torch_compiled_error"] = failed
                if own is not None:
                    row["mod_over_argument"] = row["ms"]["qkv"] / row["ms"]["qkv argument"]
                progress(_line(row))
                rows.append(row)
    compared = [r["qkv_over_torch"] for r in rows if "qkv_over_torch" in r]
    return {
        "rows": rows,
        "geomean_qkv_over_torch": _geomean(compared),
        "min_qkv_over_torch": min(compared),
        "torch_compiled_failed": sum("torch_compiled_error" in r for r in rows),
        "geomean_mod_over_argument": _geomean(
            [r["mod_over_argument"] for r in rows if "mod_over_argument" in r]
        ),
        "max_mod_over_argument": max(
            r["mod_over_argument"] for r in rows if "mod_over_argument" in r
        ),
        "training": _training(shape, repeats),
    }


def _training(shape: Shape, repeats: int) -> dict[str, Any]:
    """A causal relative-bias mod at T = 2048, float32: forward + backward over forward alone."""
    from torch.nn.attention.flex_attention import create_block_mask

    length = LENGTHS[0]
    score_mod, mask_mod, _ = _rules(length, shape.heads)["relative bias"]
    block_mask = create_block_mask(mask_mod, None, None, length, length, device="cpu")
    q, k, v = (
        torch.randn(shape.batch, shape.heads, length, shape.dim, requires_grad=True) for _ in "qkv"
    )

    def forward() -> None:
        with torch.no_grad():
            qkv.flex_attention(q, k, v, score_mod, block_mask)

    def training() -> None:
        out = qkv.flex_attention(q, k, v, score_mod, block_mask)
        assert isinstance(out, torch.Tensor)
        torch.autograd.backward(out.sum())

    row = _timed({"forward": forward, "forward + backward": training}, max(7, repeats))
    row["training_over_forward"] = row["ms"]["forward + backward"] / row["ms"]["forward"]
    progress(f"training, relative bias, T={length} float32: {row}")
    return row


def _fails(step: Callable[[], Any]) -> str | None:
    """None where ``step`` runs (compiling it), else its error in one line (inductor's C++
    template fails to compile some mods at some lengths)."""
    try:
        step()
    except Exception as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
    return None


def _timed(steps: dict[str, Callable[[], Any]], repeats: int) -> dict[str, Any]:
    for step in steps.values():
        step(), seconds(step)  # warm up (inductor compiles on the first call)
    times = interleaved(steps, repeats)
    return {"ms": {name: statistics.median(t) * 1e3 for name, t in times.items()}}


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in values) / len(values))


def _line(row: dict[str, Any]) -> str:
    ms = row["ms"]
    text = f"{row['rule']:<14} T={row['length']:<5} {row['dtype']:<8} qkv {ms['qkv']:8.1f} ms, "
    if "qkv_over_torch" in row:
        text += f"torch compiled {ms['torch compiled']:8.1f} ms: {row['qkv_over_torch']:.2f}x"
    else:
        text += f"torch compiled failed ({row['torch_compiled_error'][:60]})"
    if "mod_over_argument" in row:
        text += (
            f"; argument {ms['qkv argument']:7.1f} ms, mod/argument {row['mod_over_argument']:.2f}x"
        )
    return text


def format_versus_torch(record: dict[str, Any]) -> str:
    """The comparison as lines of text."""
    lines = ["qkv.flex_attention forward against torch compiled (forward) and qkv's arguments:"]
    lines += ["  " + _line(row) for row in record["rows"]]
    lines.append(
        f"  qkv / torch compiled: geometric mean {record['geomean_qkv_over_torch']:.2f}x, "
        f"lowest {record['min_qkv_over_torch']:.2f}x; mod / argument: geometric mean "
        f"{record['geomean_mod_over_argument']:.2f}x, "
        f"highest {record['max_mod_over_argument']:.2f}x; torch compiled failed in "
        f"{record['torch_compiled_failed']} cases"
    )
    training = record["training"]
    lines.append(
        f"  training (forward + backward) over forward, relative bias T={LENGTHS[0]} float32: "
        f"{training['training_over_forward']:.2f}x"
    )
    return "\n".join(lines)
