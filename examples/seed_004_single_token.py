"""Seed 004: attention from a single token's point of view, with d_in != d_out.

Run:  python examples/seed_004_single_token.py

Five tokens of d_in = 4 features are projected to queries, keys and values of d_out = 3
features. One token's query is compared with every key, step by step; then every token at once
with ``qkv.attention``; then the same as a small module returning everything it computed.

The scale is 1/sqrt(d_k), where d_k = d_out = 3 is the size of the vectors whose dot products
are the scores, not 1/sqrt(d_in): d_in is the size of the embeddings *before* projection and
plays no part in the dot products. Section 4 shows why the size of the dot product is what
matters.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import qkv

D_IN, D_OUT = 4, 3  # token features; query/key/value features (d_k = d_v = D_OUT)
TOKEN = 2  # the token whose point of view we follow
# Five tokens, one per row, of D_IN features each.
TOKENS = [
    [0.5159, 0.4220, 0.5786, 0.9455],
    [0.8057, 0.6775, 0.6087, 0.6179],
    [0.6932, 0.4354, 0.0353, 0.1908],
    [0.9268, 0.5299, 0.0950, 0.5789],
    [0.9131, 0.0275, 0.1634, 0.3009],
]


def fmt(values: torch.Tensor, digits: int = 4) -> str:
    """A 1-D row of numbers, or a 2-D table, with a fixed number of decimals."""
    if values.dim() == 2:
        return "\n".join("    " + fmt(row, digits) for row in values)
    return "[" + ", ".join(f"{float(x):+.{digits}f}" for x in values) + "]"


class TokenAttention(nn.Module):
    """Single-head self-attention over (L, d_in) tokens with d_out-sized queries, keys, values.

    ``forward`` returns (context (L, d_out), queries, keys, values (L, d_out), weights (L, L)).
    """

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.query = nn.Linear(d_in, d_out)
        self.key = nn.Linear(d_in, d_out)
        self.value = nn.Linear(d_in, d_out)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        queries, keys, values = self.query(tokens), self.key(tokens), self.value(tokens)
        context, weights = qkv.attention(queries, keys, values, return_weights=True)
        return context, queries, keys, values, weights


def one_token(layer: TokenAttention, tokens: torch.Tensor) -> torch.Tensor:
    print(f"1. Token {TOKEN}'s point of view, step by step")
    x = tokens[TOKEN]  # (d_in,)
    query = layer.query(x)  # (d_k,): what token 2 is looking for
    keys = layer.key(tokens)  # (L, d_k): what every token offers
    values = layer.value(tokens)  # (L, d_v): what every token passes on
    print(f"   token {TOKEN} = {fmt(x)}   (d_in = {D_IN})")
    print(f"   its query q = W_q x + b = {fmt(query)}   (d_k = {D_OUT})")
    print(f"   keys of all tokens (rows):\n{fmt(keys)}")
    print(f"   values of all tokens (rows):\n{fmt(values)}")

    scores = keys @ query  # (L,): q · k_j for every key j
    for j, (key, score) in enumerate(zip(keys, scores)):
        terms = " + ".join(f"({float(a):+.3f})({float(b):+.3f})" for a, b in zip(query, key))
        print(f"   q . k_{j} = {terms} = {float(score):+.4f}")

    scale = 1 / math.sqrt(D_OUT)
    print(
        f"   scale = 1/sqrt(d_k) = 1/sqrt({D_OUT}) = {scale:.4f}   "
        f"(not 1/sqrt(d_in) = {1 / math.sqrt(D_IN):.4f})"
    )
    weights = torch.softmax(scores * scale, dim=-1)  # (L,)
    print(f"   weights = softmax(scores * scale) = {fmt(weights)}")
    print(f"   they sum to {float(weights.sum()):.4f}")
    context = weights @ values  # (d_v,): the weighted sum of the values
    print(f"   context = sum_j weight_j * v_j = {fmt(context)}")

    # The same thing as one qkv.attention call: one query (a 1-row matrix) against all keys.
    out, attn = qkv.attention(query[None], keys, values, return_weights=True)
    print(f"   qkv.attention(q[None], K, V) -> weights {fmt(attn[0])}")
    print(f"                                  context {fmt(out[0])}\n")
    return context


def all_tokens(layer: TokenAttention, tokens: torch.Tensor, context_one: torch.Tensor) -> None:
    print("2. Every token at once: the module returns context, queries, keys, values, weights")
    context, queries, keys, values, weights = layer(tokens)
    shapes = ", ".join(str(tuple(t.shape)) for t in (context, queries, keys, values, weights))
    print(f"   shapes: {shapes}")
    print(f"   weights (row i = token i's view; each row sums to 1):\n{fmt(weights)}")
    print(f"   context vectors:\n{fmt(context)}")
    same = torch.allclose(context[TOKEN], context_one, atol=1e-6)
    print(f"   row {TOKEN} equals the step-by-step context: {same}\n")


def wrong_scale(layer: TokenAttention, tokens: torch.Tensor) -> None:
    print("3. Scaling by 1/sqrt(d_in) instead of 1/sqrt(d_k)")
    _, queries, keys, values, weights = layer(tokens)
    out_din, weights_din = qkv.attention(
        queries, keys, values, scale=1 / math.sqrt(D_IN), return_weights=True
    )
    print(f"   token {TOKEN}'s weights, 1/sqrt(d_k = {D_OUT}): {fmt(weights[TOKEN])}")
    print(f"   token {TOKEN}'s weights, 1/sqrt(d_in = {D_IN}): {fmt(weights_din[TOKEN])}")
    print(f"   token {TOKEN}'s context with 1/sqrt(d_in):   {fmt(out_din[TOKEN])}")
    print("   (qkv gives the 1/sqrt(d_in) numbers only when asked: scale=1/sqrt(d_in).)")
    print("   The wrong scale flattens every softmax a little here (sqrt 4 vs sqrt 3); in a")
    print("   model with d_in = 768 and 64-feature heads it would divide by 27.7 instead of 8.\n")


def why_sqrt_dk(generator: torch.Generator) -> None:
    print("4. Why 1/sqrt(d_k): a dot product of d_k unit-variance numbers has variance d_k")
    d_in = 768
    for d_k in (D_OUT, 64):
        q = torch.randn(10_000, d_k, generator=generator, dtype=torch.float64)
        k = torch.randn(10_000, d_k, generator=generator, dtype=torch.float64)
        dots = (q * k).sum(-1)  # 10,000 scores q · k
        std = float(dots.std())
        print(f"   d_k = {d_k:>2}: std(q.k) = {std:.3f}  (sqrt(d_k) = {d_k**0.5:.3f})")
        print(
            f"            std(q.k / sqrt(d_k)) = {float((dots / d_k**0.5).std()):.3f};  "
            f"std(q.k / sqrt(d_in = {d_in})) = {float((dots / d_in**0.5).std()):.3f}"
        )
    print("   Dividing by sqrt(d_k) keeps scores near unit size whatever the head size, so the")
    print("   softmax neither saturates nor flattens. d_in never enters the dot product.")


@torch.no_grad()
def main() -> None:
    torch.manual_seed(123)  # the projections' initial weights
    layer = TokenAttention(D_IN, D_OUT)
    tokens = torch.tensor(TOKENS)  # (L=5, d_in=4)
    context_one = one_token(layer, tokens)
    all_tokens(layer, tokens, context_one)
    wrong_scale(layer, tokens)
    why_sqrt_dk(torch.Generator().manual_seed(0))


if __name__ == "__main__":
    main()
