"""Seed 002: multi-head causal self-attention, its tensor shapes, and a heatmap of its weights.

Run:  python examples/seed_002_causal_heatmap.py [--out DIR_OR_PNG]

The layer is ``qkv.SelfAttention(d_model, heads, causal=True)``: one fused projection to Q, K and
V without biases, ``heads`` heads of size ``d_model // heads``, an output projection, dropout in
training only. The example follows every shape from (B, T, C) to (B, nh, T, hs) and back, checks
that the weights above the diagonal are exactly zero, and draws them as a heatmap
(``seed_002_causal_heatmap.png`` in the current directory unless ``--out`` says otherwise).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # write files; never open a window
import matplotlib.pyplot as plt
import torch

import qkv

B, T, C, HEADS = 1, 8, 32, 4  # batch, tokens, model width (d_model), heads
FILENAME = "seed_002_causal_heatmap.png"


def shapes(layer: qkv.SelfAttention, x: torch.Tensor) -> torch.Tensor:
    """Follow the layer step by step; return its weights (B, nh, T, T)."""
    print("1. Shapes (B batch, T tokens, C width, nh heads, hs = C // nh head size)")
    hs = layer.head_dim
    fused = layer.qkv_proj(x)  # (B, T, 3C): Q, K and V in one matmul
    q, k, v = fused.split(C, dim=-1)  # 3 x (B, T, C)
    q, k, v = (t.view(B, T, HEADS, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
    per_head, weights = qkv.attention(q, k, v, causal=True, return_weights=True)
    merged = per_head.transpose(1, 2).reshape(B, T, C)  # (B, T, C): heads side by side
    out = layer.out_proj(merged)  # (B, T, C)
    for name, tensor in (
        ("x", x),
        ("qkv_proj(x)", fused),
        ("q, k, v split into heads", q),
        ("weights", weights),
        ("output of each head", per_head),
        ("heads merged", merged),
        ("out_proj (the layer's output)", out),
    ):
        print(f"   {name:<30} {tuple(tensor.shape)}")
    print(
        f"   the layer in one call gives the same: max diff "
        f"{float((layer(x) - out).abs().max()):.1e}\n"
    )
    return weights


def check(weights: torch.Tensor) -> None:
    print("2. The causal rule: query t may attend keys 0..t (qkv.causal_mask, True = may attend)")
    keep = qkv.causal_mask(T)  # (T, T) bool
    for row in keep[:4, :4]:
        print(f"   {[int(x) for x in row]} ...")
    above = weights[..., ~keep]  # every weight on a future key, all heads
    print(f"   largest weight above the diagonal: {float(above.max())}")
    sums = weights.sum(-1)
    print(f"   row sums: min {float(sums.min()):.6f}, max {float(sums.max()):.6f}")
    print(f"   head 0, last query: {[round(float(w), 3) for w in weights[0, 0, -1]]}\n")


def heatmap(weights: torch.Tensor, path: Path) -> None:
    """Save one panel per head: rows are queries, columns keys, colour the weight."""
    fig, axes = plt.subplots(1, HEADS, figsize=(3.2 * HEADS, 3.6), constrained_layout=True)
    for head, ax in enumerate(axes):
        image = ax.imshow(weights[0, head].numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_title(f"head {head}")
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        ax.set_xticks(range(T))
        ax.set_yticks(range(T))
    fig.colorbar(image, ax=axes, label="attention weight", shrink=0.8)
    fig.suptitle("Causal self-attention weights: zero above the diagonal (no peeking ahead)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"3. Heatmap of every head's weights saved to {path}")


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("."),
        help=f"directory for {FILENAME} (default: current directory), or a .png path",
    )
    args = parser.parse_args(argv)
    path = args.out if args.out.suffix == ".png" else args.out / FILENAME

    torch.manual_seed(0)  # initial weights and input
    layer = qkv.SelfAttention(C, heads=HEADS, causal=True).eval()
    x = torch.randn(B, T, C)  # (B, T, C)
    weights = shapes(layer, x)
    check(weights)
    heatmap(weights, path)


if __name__ == "__main__":
    main()
