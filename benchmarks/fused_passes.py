"""What compiling flash's per-tile passes would buy: one float32 tile of the forward, timed as
torch operations (what flash runs), as one kernel compiled by ``torch.compile`` (inductor's C++
code), and its two matrix products alone. Prints nanoseconds per score on one thread.

    python benchmarks/fused_passes.py > benchmarks/fused_passes.txt

Legend: H heads, a tile of QUERY_TILE queries against KEY_TILE keys, D features per head.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from qkv.backends.flash import KEY_TILE, QUERY_TILE

H, D = 8, 64


def passes(s: torch.Tensor, m: torch.Tensor, row_sum: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The online-softmax update of one score tile s (H, QUERY_TILE, KEY_TILE), in base 2."""
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))  # running row maximum
    p = torch.exp2(s - m_new)
    alpha = torch.exp2(m - m_new)  # rescales what was summed under the old maximum
    return p, m_new, row_sum * alpha + p.sum(-1, keepdim=True), alpha


def passes_in_place(
    s: torch.Tensor, m: torch.Tensor, row_sum: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """``passes`` as flash runs them: torch operations writing into a reused tile buffer p."""
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))
    torch.sub(s, m_new, out=p).exp2_()
    alpha = torch.exp2(m - m_new)
    return p, m_new, row_sum * alpha + p.sum(-1, keepdim=True), alpha


def ns_per_score(functions: dict[str, Any], rounds: int = 9, calls: int = 20) -> dict[str, float]:
    """Median time per score of each function, the functions' repetitions interleaved."""
    times: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(rounds):
        for name, function in functions.items():
            start = time.perf_counter()
            for _ in range(calls):
                function()
            times[name].append((time.perf_counter() - start) / calls)
    scores = H * QUERY_TILE * KEY_TILE
    return {name: statistics.median(t) / scores * 1e9 for name, t in times.items()}


def main() -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    s = torch.randn(H, QUERY_TILE, KEY_TILE, generator=generator)
    m = torch.full((H, QUERY_TILE, 1), -1e30)
    row_sum = torch.zeros(H, QUERY_TILE, 1)
    q = torch.randn(H, QUERY_TILE, D, generator=generator)
    k = torch.randn(H, KEY_TILE, D, generator=generator)
    v = torch.randn(H, KEY_TILE, D, generator=generator)

    p = torch.empty_like(s)
    start = time.perf_counter()
    compiled = torch.compile(passes, dynamic=False)
    compiled(s, m, row_sum)
    compile_seconds = time.perf_counter() - start
    ns = ns_per_score(
        {
            "eager": lambda: passes_in_place(s, m, row_sum, p),
            "fused": lambda: compiled(s, m, row_sum),
            "products": lambda: torch.bmm(torch.bmm(q, k.transpose(1, 2)), v),
        }
    )
    print(f"float32 tile {H}x{QUERY_TILE}x{KEY_TILE}, D={D}, one thread, ns per score (medians):")
    print(f"  max/subtract/exp2/sum passes as torch operations (flash): {ns['eager']:.2f}")
    print(f"  the same passes compiled into one kernel (torch.compile): {ns['fused']:.2f}")
    print(f"  the two matrix products alone:                            {ns['products']:.2f}")
    print(f"  (compiling took {compile_seconds:.0f} s)")


if __name__ == "__main__":
    main()
