"""Seed 000: a single-head self-attention layer, with and without causal weights.

Run:  python examples/seed_000_single_head.py

The layer: bias-free query, key and value projections, an output projection with a bias, dropout
on the attention weights, an optional causal rule, and the weights returned for inspection. In
qkv that is ``qkv.SelfAttention(d_model, heads=1, out_bias=True, dropout=0.1)``.

Two things differ from a hand-written version of the same layer, both on purpose:
- dropout acts only in training mode, and the weights returned are the softmax probabilities
  *before* dropout, so every row sums to exactly 1 even while training;
- bad input (None, wrong shape, integers) is refused with a message that names the argument,
  and a query with no key to attend to gets zeros, never NaN.
"""

from __future__ import annotations

import torch

import qkv

D_MODEL, LENGTH = 64, 10


def fmt(values: torch.Tensor, digits: int = 2) -> str:
    """A 1-D row of numbers, or a 2-D table, with a fixed number of decimals."""
    if values.dim() == 2:
        return "\n".join("    " + fmt(row, digits) for row in values)
    return "[" + " ".join(f"{float(x):.{digits}f}" for x in values) + "]"


def build() -> qkv.SelfAttention:
    print("1. The layer")
    layer = qkv.SelfAttention(D_MODEL, heads=1, out_bias=True, dropout=0.1)
    print(f"   {layer}".replace("\n", "\n   "))
    print(f"   qkv_proj.weight {tuple(layer.qkv_proj.weight.shape)} is [W_q; W_k; W_v] stacked:")
    print(f"   one matmul gives Q, K and V; one head, so d_k = {layer.head_dim} and the")
    print(f"   scores are divided by sqrt({layer.head_dim}) = {layer.head_dim**0.5:.0f}.\n")
    return layer


def full_attention(layer: qkv.SelfAttention, x: torch.Tensor) -> None:
    print("2. Every token attends to every token")
    layer.eval()  # inference: no dropout
    out, weights = layer(x, return_weights=True)  # (B, L, D), (B, H=1, L, L)
    print(f"   x {tuple(x.shape)} -> output {tuple(out.shape)}, weights {tuple(weights.shape)}")
    w = weights[0, 0]  # (L, L) of sentence 0
    print(
        f"   weights[0, 0, 5, 3] = {float(w[5, 3]):.4f}: in sentence 0, token 5 gives "
        f"{100 * float(w[5, 3]):.1f}% of its attention to token 3"
    )
    print(f"   row 5 = {fmt(w[5])}, sum = {float(w[5].sum()):.4f}")

    layer.train()  # a new module starts in training mode: dropout is active
    first, second = layer(x), layer(x)
    _, train_weights = layer(x, return_weights=True)
    print(
        f"   in training mode two calls differ (dropout): max diff "
        f"{float((first - second).abs().max()):.2f}"
    )
    print(
        f"   but the returned weights are taken before dropout: row sums "
        f"{float(train_weights.sum(-1).min()):.4f} to {float(train_weights.sum(-1).max()):.4f}"
    )
    layer.eval()
    print()


def causal_attention(layer: qkv.SelfAttention, x: torch.Tensor) -> None:
    print("3. Causal: token i attends only to tokens 0..i")
    _, weights = layer(x, causal=True, return_weights=True)
    w = weights[0, 0]
    print(f"   weights of sentence 0 (row = query, column = key):\n{fmt(w)}")
    future = ~qkv.causal_mask(LENGTH)  # True above the diagonal
    print(
        f"   weights[0, 0, 5, 6] = {float(w[5, 6])}; largest weight on a future key: "
        f"{float(weights[..., future].max())}"
    )

    # Causality as a fact about outputs: changing token 7 cannot change outputs 0..6.
    changed = x.clone()
    changed[:, 7] += 1.0
    out, out_changed = layer(x, causal=True), layer(changed, causal=True)
    past = float((out_changed[:, :7] - out[:, :7]).abs().max())
    later = float((out_changed[:, 7:] - out[:, 7:]).abs().max())
    print(f"   change token 7: outputs 0..6 move by {past}, outputs 7..9 by {later:.3f}\n")


def edge_cases(layer: qkv.SelfAttention, x: torch.Tensor) -> None:
    print("4. Edge cases")
    for label, bad in (
        ("None", None),
        ("wrong feature size", torch.randn(2, LENGTH, D_MODEL + 1)),
        ("integer tokens", torch.ones(2, LENGTH, D_MODEL, dtype=torch.long)),
    ):
        try:
            layer(bad)
        except (TypeError, ValueError) as error:
            print(f"   {label}: {type(error).__name__}: {error}")
    # Padding every key of sentence 1 leaves its queries with nothing to attend to.
    no_keys = torch.tensor([[True] * LENGTH, [False] * LENGTH])  # (B, S), True = real token
    _, weights = layer(x, padding_mask=no_keys, return_weights=True)
    print(
        f"   sentence 1 all padding: its weights sum to {float(weights[1].sum())}, "
        f"NaN anywhere: {bool(weights.isnan().any())}"
    )
    q = k = v = torch.randn(1, 0, D_MODEL)  # (H, L=0, D): an empty sequence
    print(
        f"   empty sequence: qkv.attention gives an output of shape "
        f"{tuple(qkv.attention(q, k, v).shape)}"
    )


@torch.no_grad()
def main() -> None:
    torch.manual_seed(0)  # initial weights, inputs and dropout
    layer = build()
    x = torch.randn(2, LENGTH, D_MODEL)  # (B, L, D)
    full_attention(layer, x)
    causal_attention(layer, x)
    edge_cases(layer, x)


if __name__ == "__main__":
    main()
