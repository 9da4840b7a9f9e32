"""Seed 003: three levels of self-attention — separate projections, one fused projection, and a
full layer with a padding mask, dropout and an output projection.

Run:  python examples/seed_003_three_levels.py

V1  three projections (with biases) and ``qkv.attention``.
V2  one fused projection whose weight is [W_q; W_k; W_v] stacked: the same numbers, one matmul.
V3  ``qkv.SelfAttention(hidden, bias=True, dropout=p)``: the fused projection ``qkv_proj``,
    attention with a mask, dropout on the weights in training only, and ``out_proj``.

Masked scores must become -inf before the softmax. Filling them with a tiny number such as 1e-20
masks nothing: 1e-20 is a score of about 0, an ordinary score, so the padding keeps its share of
the weight. And a query with no key at all to attend to must give zeros, not NaN (-inf everywhere
makes softmax compute 0/0) and not a uniform average of padding.
"""

from __future__ import annotations

import torch
from torch import nn

import qkv

HIDDEN = 4  # single head, so d_k = HIDDEN and the scale 1/sqrt(HIDDEN) is right
# 1 = real token, 0 = padding (qkv's convention too: true/1 means "may attend").
ATTENTION_MASK = [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]


def fmt(values: torch.Tensor, digits: int = 4) -> str:
    """A 1-D row of numbers, or a 2-D table, with a fixed number of decimals."""
    if values.dim() == 2:
        return "\n".join("    " + fmt(row, digits) for row in values)
    return "[" + ", ".join(f"{float(x):+.{digits}f}" for x in values) + "]"


def v1_separate(x: torch.Tensor) -> tuple[list[nn.Linear], torch.Tensor]:
    print("V1. Three separate projections, then qkv.attention")
    projections = [nn.Linear(HIDDEN, HIDDEN) for _ in range(3)]  # W_q, W_k, W_v with biases
    q, k, v = (proj(x) for proj in projections)  # (B, L, D) each
    out = qkv.attention(q, k, v)  # (B, L, D): softmax(q kᵀ / sqrt(D)) v
    print(f"   x {tuple(x.shape)} -> q, k, v {tuple(q.shape)} -> output {tuple(out.shape)}")
    print(f"   output of sentence 0:\n{fmt(out[0])}\n")
    return projections, out


def v2_fused(x: torch.Tensor, projections: list[nn.Linear], out_v1: torch.Tensor) -> nn.Linear:
    print("V2. One fused projection: weight [W_q; W_k; W_v], output split in three")
    fused = nn.Linear(HIDDEN, 3 * HIDDEN)
    fused.weight.copy_(torch.cat([p.weight for p in projections]))  # (3D, D)
    fused.bias.copy_(torch.cat([p.bias for p in projections]))  # (3D,)
    q, k, v = fused(x).split(HIDDEN, dim=-1)  # (B, L, 3D) -> 3 x (B, L, D)
    out = qkv.attention(q, k, v)
    print(f"   fused weight {tuple(fused.weight.shape)}; one matmul gives {tuple(fused(x).shape)}")
    gap = float((out - out_v1).abs().max())
    print(f"   max |V2 - V1| = {gap:.1e}  (the same products, summed in another order)\n")
    return fused


def v3_layer(x: torch.Tensor, fused: nn.Linear) -> qkv.SelfAttention:
    print("V3. qkv.SelfAttention(hidden, bias=True, dropout=0.1): mask, dropout, out_proj")
    layer = qkv.SelfAttention(HIDDEN, bias=True, dropout=0.1)
    layer.qkv_proj.load_state_dict(fused.state_dict())  # the V2 projection, unchanged
    print(f"   {layer.qkv_proj}  <- the fused projection")
    print(f"   {layer.out_proj}  <- the output projection")

    layer.eval()  # dropout is off outside training
    first, second = layer(x), layer(x)
    print(f"   eval mode:  two calls differ by {float((first - second).abs().max()):.1e}")
    layer.train()  # dropout drops attention weights (survivors scaled by 1/(1-p))
    first, second = layer(x), layer(x)
    print(f"   train mode: two calls differ by {float((first - second).abs().max()):.1e}")
    layer.eval()
    print()
    return layer


def masking(x: torch.Tensor, layer: qkv.SelfAttention) -> None:
    print("Masks: padding must get -inf, not 1e-20")
    attention_mask = torch.tensor(ATTENTION_MASK)  # (B, L): 1 = real token
    print("   attention_mask (B, L), 1 = real token:")
    for row in ATTENTION_MASK:
        print(f"    {row}")
    q, k, _ = layer.qkv_proj(x).split(HIDDEN, dim=-1)
    scores = q @ k.transpose(-2, -1) / HIDDEN**0.5  # (B, L, L)
    padded = attention_mask[:, None, :] == 0  # (B, 1, L): True at padding keys
    tiny = torch.softmax(scores.masked_fill(padded, 1e-20), dim=-1)
    blocked = torch.softmax(scores.masked_fill(padded, float("-inf")), dim=-1)
    _, weights = layer(x, padding_mask=attention_mask, return_weights=True)  # (B, H=1, L, L)

    print("   sentence 1 has two real tokens; the weights of its first query:")
    print(f"     fill 1e-20:  {fmt(tiny[1, 0])}  <- padding still gets weight")
    print(f"     fill -inf:   {fmt(blocked[1, 0])}")
    print(f"     qkv:         {fmt(weights[1, 0, 0])}")
    print("   sentence 2 is all padding, so its queries have no key to attend to:")
    print(f"     fill 1e-20:  {fmt(tiny[2, 0])}  <- a uniform average of padding")
    print(f"     fill -inf:   {fmt(blocked[2, 0])}  <- 0/0")
    print(f"     qkv:         {fmt(weights[2, 0, 0])}  <- no key, no weight")
    q, k, v = (t[:, None] for t in layer.qkv_proj(x).split(HIDDEN, dim=-1))  # (B, H=1, L, D)
    keep = qkv.padding_mask(attention_mask)  # (B, 1, 1, L) bool, True = may attend
    attended = qkv.attention(q, k, v, mask=keep)  # (B, 1, L, D)
    print(f"   its attention output (before out_proj) is exactly zero:\n{fmt(attended[2, 0])}")
    print("   (after out_proj those rows equal out_proj's bias: zero input, bias added)")


@torch.no_grad()
def main() -> None:
    torch.manual_seed(0)  # initial weights and dropout
    x = torch.randn(len(ATTENTION_MASK), 4, HIDDEN)  # (B=3, L=4, D=4)
    projections, out_v1 = v1_separate(x)
    fused = v2_fused(x, projections, out_v1)
    layer = v3_layer(x, fused)
    masking(x, layer)


if __name__ == "__main__":
    main()
