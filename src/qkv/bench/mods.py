"""``qkv bench --mods``: your own rule (score_mod / mask_mod) on flash, measured.

Five measurements, each against its baseline in the same run (medians of interleaved
repetitions), (B, H, T, D) float32 on flash:

- block skipping: a forward pass under a document ``mask_mod`` (16 documents at T), against the
  same call with block skipping switched off (every block's mask evaluated);
- the compiled tile step of the exact path (the loop, ``program_call.ENABLED`` off): a forward
  pass with a T5-bucket ``score_mod`` (causal), the step ``torch.compile``d against the plain
  loop (compilation done before timing);
- the gap: a mod that equals one of qkv's own arguments (softcap, ALiBi, a window, documents)
  against the argument (which flash runs on its compiled kernel);
- against torch (``flex_speed.py``): six rules as mods against ``torch.compile(flex_attention)``
  and against qkv's own arguments, T = 2048 and 4096, float32 and bfloat16;
- memory: a causal training step (forward+backward) at T = 16,384 with a learned relative-bias
  ``score_mod``, peak resident memory of the whole process, in a fresh process.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import qkv
from qkv.backends.flash import mods as flash_mods
from qkv.backends.flash import program_call
from qkv.bench import flex_speed
from qkv.bench.cases import Shape
from qkv.bench.memory import process_peak_mib
from qkv.bench.timing import interleaved, progress, seconds

MIB = 2**20
DOCUMENTS = 16


def t5_bucket(relative: torch.Tensor, buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """T5's causal relative-position bucket of q − kv ≥ 0: exact below buckets/2, log beyond."""
    exact = buckets // 2
    distance = relative.clamp(min=0)
    far = exact + (
        torch.log(distance.float().clamp(min=1) / exact)
        / math.log(max_distance / exact)
        * (buckets - exact)
    ).long().clamp(max=buckets - exact - 1)
    return torch.where(distance < exact, distance.long(), far)


def mods_benchmark(length: int, shape: Shape, repeats: int) -> dict[str, Any]:
    """The three timed measurements at T = ``length`` (see the module doc)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(shape.batch, shape.heads, length, shape.dim, generator=gen) for _ in "qkv"
    )
    ids = torch.arange(length) * DOCUMENTS // length

    def documents(b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return ids[qi] == ids[kv]

    skipping = _ratio(
        {
            "with block skipping": lambda: _forward(q, k, v, mask_mod=documents),
            "without": lambda: _forward(q, k, v, mask_mod=documents, skip=False),
        },
        repeats,
    )
    progress(f"block skipping: {skipping}")
    bias = torch.randn(shape.heads, 32, generator=gen)

    def t5(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return score + bias[h, t5_bucket(qi - kv)]

    _forward(q, k, v, score_mod=t5, causal=True, compile="1")  # compile before timing
    compiled = _ratio(
        {
            "compiled": lambda: _forward(q, k, v, score_mod=t5, causal=True, compile="1"),
            "plain loop": lambda: _forward(q, k, v, score_mod=t5, causal=True, compile="0"),
        },
        repeats,
    )
    progress(f"compiled tile step, whole forward: {compiled}")
    step = _tile_step(t5, shape)
    progress(f"compiled tile step, one tile: {step}")
    return {
        "length": length,
        "shape": f"B={shape.batch} H={shape.heads} T={length} D={shape.dim}",
        "block_skipping": skipping,
        "compiled_tile_step": compiled,
        "compiled_tile_step_alone": step,
        "gap_to_arguments": _gaps(q, k, v, ids, repeats),
        "versus_torch": flex_speed.versus_torch(shape, repeats),
    }


def _tile_step(score_mod: Callable[..., Any], shape: Shape) -> dict[str, Any]:
    """The score_mod step on one full (B, H, 256, 512) tile, compiled against plain."""
    from qkv import mods as own

    tile = torch.randn(shape.batch, shape.heads, 256, 512)
    index = own.indices(shape.batch, shape.heads, 0, 256, 512, 1024, tile.device)
    plain = flash_mods.base2_step(score_mod)
    compiled = flash_mods.compiled_step(score_mod, plain)
    if compiled is None:  # compiling it failed (a warning said so): nothing to time
        nan = float("nan")
        return {"ms": {"compiled": nan, "plain": nan}, "speedup": nan, "failed": True}
    with torch.no_grad():
        return _ratio(
            {
                "compiled": lambda: tile.copy_(compiled(tile, *index)),
                "plain": lambda: tile.copy_(plain(tile, *index)),
            },
            20,
        )


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> None:
    skip, compile_ = kwargs.pop("skip", True), kwargs.pop("compile", None)
    saved = program_call.ENABLED
    program_call.ENABLED = compile_ is None  # the compiled tile step: on the loop
    try:
        with torch.no_grad(), flash_mods.settings(skip=skip, compile=compile_ or "auto"):
            qkv.attention(q, k, v, backend="flash", **kwargs)
    finally:
        program_call.ENABLED = saved


def _ratio(steps: dict[str, Callable[[], Any]], repeats: int) -> dict[str, Any]:
    """Median ms of each step, and the second's over the first's ("speedup")."""
    for step in steps.values():
        seconds(step)  # warm up
    times = interleaved(steps, repeats)
    medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    first, second = list(medians)
    return {"ms": medians, "speedup": medians[second] / medians[first]}


def _gaps(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, repeats: int
) -> dict[str, Any]:
    """Each mod against the qkv argument it equals (forward, causal): ms and mod/argument."""
    heads, length = q.shape[1], q.shape[2]
    slopes = 2.0 ** -torch.arange(1.0, heads + 1)
    width = max(1, length // 32)

    def capped(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return 50.0 * torch.tanh(score / 50.0)

    def alibi(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return score - slopes[h] * (qi - kv)

    def window(b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return qi - kv < width

    def documents(b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return ids[qi] == ids[kv]

    pairs: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "softcap=50": ({"softcap": 50.0}, {"score_mod": capped}),
        "alibi_slopes": ({"alibi_slopes": slopes}, {"score_mod": alibi}),
        f"window={width}": ({"window": width}, {"mask_mod": window}),
        f"{DOCUMENTS} documents": ({"segments": ids}, {"mask_mod": documents}),
    }
    gaps = {}
    for name, (argument, mod) in pairs.items():
        result = _ratio(
            {
                "argument": functools.partial(_forward, q, k, v, causal=True, **argument),
                "mod": functools.partial(_forward, q, k, v, causal=True, **mod),
            },
            repeats,
        )
        gaps[name] = {"ms": result["ms"], "mod_over_argument": result["speedup"]}
        progress(f"gap {name}: {gaps[name]}")
    return gaps


# --- memory: a fresh process ----------------------------------------------------------------------


def memory_check(length: int, shape: Shape, threads: int | None) -> dict[str, Any]:
    """Peak resident memory of a fresh process running one causal float32 training step
    (forward+backward) with a learned relative-bias score_mod at T = ``length``."""
    spec: dict[str, Any] = {"length": length, "batch": shape.batch, "heads": shape.heads}
    spec["dim"] = shape.dim
    spec["threads"] = threads
    command = [sys.executable, "-m", "qkv.bench.mods", json.dumps(spec)]
    completed = subprocess.run(command, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(completed.stdout.strip().splitlines()[-1])
    return result


def memory_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """The fresh process's side: one training step, then the process's peak."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    b, h, t, d = spec["batch"], spec["heads"], spec["length"], spec["dim"]
    baseline = process_peak_mib()
    q, k, v, grad = (torch.randn(b, h, t, d) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    table = torch.zeros(h, 2 * t - 1, requires_grad=True)  # learned: one bias per head and q − kv

    def relative_bias(score: Any, bi: Any, hi: Any, qi: Any, kv: Any) -> Any:
        return score + table[hi, qi - kv + t - 1]

    start = time.perf_counter()
    out = qkv.attention(q, k, v, causal=True, score_mod=relative_bias, backend="flash")
    torch.autograd.backward(out, grad)
    took = time.perf_counter() - start
    assert table.grad is not None and bool(table.grad.isfinite().all())
    peak = process_peak_mib()
    return {
        "shape": f"B={b} H={h} T={t} D={d}",
        "pass": "forward+backward, causal, learned relative-bias score_mod, float32",
        "peak_process_mib": peak,
        "baseline_process_mib": baseline,
        "naive_scores_mib": b * h * t * t * 4 / MIB,
        "seconds": took,
    }


def format_mods(record: dict[str, Any]) -> str:
    """The measurements as lines of text."""
    skipping, compiled = record["block_skipping"], record["compiled_tile_step"]
    lines = [
        f"flash with score_mod / mask_mod, float32 forward, {record['shape']}:",
        f"  {DOCUMENTS}-document mask_mod: {skipping['ms']['with block skipping']:.1f} ms with "
        f"block skipping, {skipping['ms']['without']:.1f} ms without: "
        f"{skipping['speedup']:.1f}x faster",
        f"  causal + T5-bucket score_mod: {compiled['ms']['compiled']:.1f} ms compiled, "
        f"{compiled['ms']['plain loop']:.1f} ms plain loop: {compiled['speedup']:.1f}x faster",
        f"    its step alone on one (B, H, 256, 512) tile: "
        f"{record['compiled_tile_step_alone']['ms']['compiled']:.2f} ms compiled, "
        f"{record['compiled_tile_step_alone']['ms']['plain']:.2f} ms plain: "
        f"{record['compiled_tile_step_alone']['speedup']:.1f}x faster",
        "  a mod against the qkv argument it equals (causal): mod ms / argument ms",
    ]
    for name, gap in record["gap_to_arguments"].items():
        lines.append(
            f"    {name:<16} {gap['ms']['mod']:>9.1f} / {gap['ms']['argument']:>8.1f} ms = "
            f"{gap['mod_over_argument']:.1f}x"
        )
    if "versus_torch" in record:
        lines.append(flex_speed.format_versus_torch(record["versus_torch"]))
    memory = record.get("memory")
    if memory is not None:
        lines.append(
            f"  memory: {memory['pass']}, {memory['shape']}: peak {memory['peak_process_mib']:.0f}"
            f" MiB for the whole process (Python and torch alone: "
            f"{memory['baseline_process_mib']:.0f} MiB; (B, H, T, T) float32 scores alone: "
            f"{memory['naive_scores_mib']:.0f} MiB); {memory['seconds']:.1f} s"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # the fresh process of memory_check
    print(json.dumps(memory_worker(json.loads(sys.argv[1]))))
