"""Seed 001: "The cat sat" — one query's softmax by hand, the functional form, masks, multi-head.

Run:  python examples/seed_001_the_cat_sat.py

1. The worked example: the query of "sat" scores 0.5, 2.1 and 1.3 against the keys of "The",
   "cat" and "sat". Their softmax is about [0.122, 0.606, 0.272] (not [0.08, 0.64, 0.28]).
2. The functional form ``self_attention(x, w_q, w_k, w_v) -> (output, weights)`` is one call to
   ``qkv.attention`` on the three projections.
3. The mask convention. qkv: **True means "may attend"**. A mask built with
   ``triu(ones, diagonal=1)`` marks the *blocked* (future) keys instead: it is the complement of
   ``qkv.causal_mask`` and must be inverted (or replaced by ``causal=True``) before use.
4. A multi-head layer with biases on every projection is ``qkv.SelfAttention(d_model, heads,
   bias=True)``.
"""

from __future__ import annotations

import math

import torch

import qkv

TOKENS = ["The", "cat", "sat"]
SAT_SCORES = [0.5, 2.1, 1.3]  # q_sat · k_The, q_sat · k_cat, q_sat · k_sat
WRONG_WEIGHTS = [0.08, 0.64, 0.28]  # a commonly printed, incorrect softmax of SAT_SCORES


def fmt(values: torch.Tensor | list[float], digits: int = 4) -> str:
    """A 1-D row of numbers, or a 2-D table, with a fixed number of decimals."""
    values = torch.as_tensor(values)
    if values.dim() == 2:
        return "\n".join("    " + fmt(row, digits) for row in values)
    return "[" + ", ".join(f"{float(x):.{digits}f}" for x in values) + "]"


def the_cat_sat() -> None:
    print('1. "The cat sat": what does "sat" attend to?')
    scores = torch.tensor(SAT_SCORES, dtype=torch.float64)
    exps = scores.exp()
    weights = exps / exps.sum()
    for token, score, e in zip(TOKENS, SAT_SCORES, exps):
        print(f"   score(sat -> {token:>3}) = {score:.1f}   exp = {float(e):.4f}")
    print(f"   sum of exps = {float(exps.sum()):.4f}")
    print(f"   softmax = exp / sum = {fmt(weights)}  ~ {fmt(weights, 3)}")

    # The same numbers through qkv.attention. With a key size of 1 the default scale
    # 1/sqrt(d_k) is exactly 1, so the scores qkv softmaxes are exactly the ones above. One-hot
    # values make the output equal to the weights: output = sum_j weight_j * v_j.
    q_sat = torch.tensor([[1.0]], dtype=torch.float64)  # (Lq=1, Dk=1)
    keys = scores[:, None]  # (Lk=3, Dk=1): k_j chosen so that q_sat · k_j = score j
    values = torch.eye(3, dtype=torch.float64)  # (Lk=3, Dv=3): v_The, v_cat, v_sat
    out, attn = qkv.attention(q_sat, keys, values, return_weights=True)
    print(f"   qkv.attention weights = {fmt(attn[0])}")
    terms = " + ".join(f"{float(w):.3f}*v_{t}" for w, t in zip(attn[0], TOKENS))
    print(f"   output = {terms} = {fmt(out[0], 3)}")

    # Why [0.08, 0.64, 0.28] cannot be right: softmax turns score differences into ratios,
    # w_i / w_j = exp(s_i - s_j). "cat" beats "The" by 2.1 - 0.5 = 1.6, a ratio of e^1.6.
    ratio = math.exp(SAT_SCORES[1] - SAT_SCORES[0])
    wrong_gap = math.log(WRONG_WEIGHTS[1] / WRONG_WEIGHTS[0])
    print(f"   Not {fmt(WRONG_WEIGHTS, 2)}: weight(cat)/weight(The) must be e^1.6 = {ratio:.2f},")
    print(f"   but 0.64/0.08 = 8, which would need a score gap of ln 8 = {wrong_gap:.2f}, not 1.6.")
    print('   Still, "sat" attends mostly to "cat".\n')


def functional_form(generator: torch.Generator) -> None:
    print("2. The functional form: project, then one qkv.attention call")
    d_model, d_k = 8, 4
    x = torch.randn(2, 3, d_model, generator=generator)  # (B, L, D): two 3-token sentences
    # Weights of size ~1/sqrt(d_model) keep the projections near unit size, as trained ones are.
    w_q, w_k, w_v = (
        torch.randn(d_model, d_k, generator=generator) / math.sqrt(d_model) for _ in range(3)
    )
    out, weights = qkv.attention(x @ w_q, x @ w_k, x @ w_v, return_weights=True)
    # The formula written out, to compare with:
    scores = (x @ w_q) @ (x @ w_k).transpose(-2, -1) / math.sqrt(d_k)  # (B, L, L)
    by_hand = torch.softmax(scores, dim=-1) @ (x @ w_v)  # (B, L, Dv)
    print(f"   x {tuple(x.shape)} -> output {tuple(out.shape)}, weights {tuple(weights.shape)}")
    print(f"   weights of sentence 0 (each row sums to 1):\n{fmt(weights[0])}")
    print(f"   max |qkv - softmax(QK^T/sqrt(d_k))V| = {float((out - by_hand).abs().max()):.1e}\n")


def mask_convention(generator: torch.Generator) -> None:
    print('3. Masks: in qkv, True means "may attend"')
    length = len(TOKENS)
    blocked = torch.triu(torch.ones(length, length), diagonal=1).bool()  # True = future key
    keep = qkv.causal_mask(length)  # True = may attend
    print(f"   triu(ones, diagonal=1), True = BLOCKED:\n{fmt(blocked.float(), 0)}")
    print(f"   qkv.causal_mask(3), True = MAY ATTEND:\n{fmt(keep.float(), 0)}")
    print(f"   one is the other's complement: {bool(torch.equal(keep, ~blocked))}")

    q, k, v = (torch.randn(length, 4, generator=generator) for _ in range(3))
    _, right = qkv.attention(q, k, v, causal=True, return_weights=True)
    _, inverted = qkv.attention(q, k, v, mask=blocked, return_weights=True)
    print(
        f"   causal=True (same as mask=~blocked): each token sees itself and the past\n{fmt(right)}"
    )
    print("   mask=blocked given to qkv unchanged: each token sees only the FUTURE, and the")
    print(f"   last token sees nothing, so its row is all zeros (never NaN):\n{fmt(inverted)}\n")


def multi_head(generator: torch.Generator) -> None:
    print("4. Multi-head: qkv.SelfAttention(d_model=8, heads=2, bias=True)")
    layer = qkv.SelfAttention(8, heads=2, bias=True)
    x = torch.randn(1, len(TOKENS), 8, generator=generator)  # (B, L, D): "The cat sat"
    out, weights = layer(x, causal=True, return_weights=True)
    print(f"   x {tuple(x.shape)} -> output {tuple(out.shape)}, weights {tuple(weights.shape)}")
    for head in range(layer.heads):
        print(f"   head {head} (rows: {', '.join(TOKENS)}):\n{fmt(weights[0, head])}")
    print("   Each head has its own slice of the projections: its own view of the words.")


@torch.no_grad()
def main() -> None:
    torch.manual_seed(0)  # the layer's initial weights
    generator = torch.Generator().manual_seed(0)  # the example's inputs
    the_cat_sat()
    functional_form(generator)
    mask_convention(generator)
    multi_head(generator)


if __name__ == "__main__":
    main()
