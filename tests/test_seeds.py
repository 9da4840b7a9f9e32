"""The five seed tutorials' systems, rebuilt here and compared number for number with qkv.

For each tutorial the module it describes is written out below (in this file's own words), its
weights are copied into the qkv equivalent, and the outputs must agree. Where a tutorial is
wrong, the test asserts qkv's correct result instead and says why. The last tests run every
script in examples/ and check the numbers they print.

Legend: B batch, H heads, L query length, S key length, D features.
"""

from __future__ import annotations

import math
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import qkv

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
F64 = torch.float64


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-12) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def _load_fused(layer: qkv.SelfAttention, q: nn.Linear, k: nn.Linear, v: nn.Linear) -> None:
    """Copy three separate projections into qkv's fused ``qkv_proj`` ([W_q; W_k; W_v])."""
    assert layer.qkv_proj is not None
    with torch.no_grad():
        layer.qkv_proj.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
        if layer.qkv_proj.bias is not None:
            layer.qkv_proj.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))


def _load(target: nn.Linear, source: nn.Linear) -> None:
    target.load_state_dict(source.state_dict())


# --- seed 000: single head, bias-free Q/K/V, output projection with bias, optional causal ------


class SingleHead000(nn.Module):
    """One head of width d; scores / sqrt(d); future keys at -inf when causal; dropout on the
    weights; returns (W_o(weights @ V), weights after dropout)."""

    def __init__(self, d: int, dropout: float) -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.to_out = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)  # (B, L, D)
        scores = q @ k.transpose(1, 2) / math.sqrt(x.shape[-1])  # (B, L, L)
        if causal:
            future = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
            scores = scores.masked_fill(future, -math.inf)
        weights = self.drop(scores.softmax(-1))
        return self.to_out(weights @ v), weights


def _seed_000_pair(dropout: float, dtype: torch.dtype) -> tuple[SingleHead000, qkv.SelfAttention]:
    torch.manual_seed(0)
    theirs = SingleHead000(16, dropout).to(dtype)
    ours = qkv.SelfAttention(16, out_bias=True, dropout=dropout, backend="reference", dtype=dtype)
    _load_fused(ours, theirs.to_q, theirs.to_k, theirs.to_v)
    _load(ours.out_proj, theirs.to_out)
    return theirs, ours


@pytest.mark.parametrize("causal", [False, True])
def test_seed_000_single_head_matches(causal: bool) -> None:
    theirs, ours = _seed_000_pair(0.1, F64)
    theirs.eval()
    ours.eval()
    x = torch.randn(2, 7, 16, dtype=F64)
    out, weights = theirs(x, causal=causal)
    our_out, our_weights = ours(x, causal=causal, return_weights=True)
    _close(our_out, out)
    _close(our_weights[:, 0], weights)  # qkv's weights carry a head dim: (B, H=1, L, L)
    if causal:
        assert our_weights[..., ~qkv.causal_mask(7)].eq(0).all()


def test_seed_000_training_dropout_same_draw_but_weights_before_dropout() -> None:
    theirs, ours = _seed_000_pair(0.3, torch.float32)
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        theirs.eval()
        clean = theirs(x, causal=True)[1]
        theirs.train()
        ours.train()
        with torch.random.fork_rng():
            torch.manual_seed(7)
            out, dropped = theirs(x, causal=True)
        with torch.random.fork_rng():
            torch.manual_seed(7)  # the reference backend draws one dropout mask of this shape
            our_out, our_weights = ours(x, causal=True, return_weights=True)
    torch.testing.assert_close(our_out, out)  # same mask drawn: dropout acts the same way
    # The tutorial returns weights *after* dropout, whose rows no longer sum to 1 in training.
    # qkv returns the softmax probabilities before dropout (rows sum to 1, as its doc says).
    assert not torch.allclose(dropped.sum(-1), torch.ones(2, 6))
    torch.testing.assert_close(our_weights[:, 0], clean)
    torch.testing.assert_close(our_weights.sum(-1), torch.ones(2, 1, 6))


# --- seed 001: functional self-attention, "The cat sat", triu mask (True = blocked), MHA ------


def self_attention_001(
    x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(XW_q (XW_k)ᵀ / sqrt(d_k)) XW_v, with d_k the width of the queries."""
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v, weights


class MultiHead001(nn.Module):
    """Biased W_q, W_k, W_v, W_o; heads of d_model // heads; ``mask`` True = BLOCKED."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, x: torch.Tensor, blocked: torch.Tensor | None = None) -> torch.Tensor:
        batch, length, width = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, L, D) -> (B, H, L, D / H)
            return t.reshape(batch, length, self.heads, -1).permute(0, 2, 1, 3)

        q, k, v = heads(self.w_q(x)), heads(self.w_k(x)), heads(self.w_v(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, L, L)
        if blocked is not None:
            scores = scores.masked_fill(blocked, -math.inf)
        mixed = torch.softmax(scores, dim=-1) @ v  # (B, H, L, D / H)
        return self.w_o(mixed.permute(0, 2, 1, 3).reshape(batch, length, width))


def test_seed_001_the_cat_sat_true_softmax() -> None:
    scores = [0.5, 2.1, 1.3]  # q_sat · k_The, q_sat · k_cat, q_sat · k_sat
    total = sum(math.exp(s) for s in scores)
    oracle = torch.tensor([math.exp(s) / total for s in scores], dtype=F64)
    # Key size 1, so the default scale 1/sqrt(d_k) = 1 leaves the scores as given.
    q, k = torch.ones(1, 1, dtype=F64), torch.tensor(scores, dtype=F64)[:, None]
    out, weights = qkv.attention(q, k, torch.eye(3, dtype=F64), return_weights=True)
    _close(weights[0], oracle)
    _close(out[0], oracle)  # one-hot values: the output is the weights
    assert weights[0].tolist() == pytest.approx([0.122, 0.606, 0.272], abs=5e-4)
    # The tutorial prints [0.08, 0.64, 0.28]: wrong, since w_cat / w_The must be
    # e^(2.1 - 0.5) ≈ 4.95, not 8. qkv gives the true softmax.
    assert not torch.allclose(weights[0], torch.tensor([0.08, 0.64, 0.28], dtype=F64), atol=0.01)


def test_seed_001_functional_matches() -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 8, generator=generator, dtype=F64)
    w_q, w_k = (torch.randn(8, 4, generator=generator, dtype=F64) for _ in range(2))
    w_v = torch.randn(8, 6, generator=generator, dtype=F64)  # d_v != d_k
    out, weights = self_attention_001(x, w_q, w_k, w_v)
    our_out, our_weights = qkv.attention(x @ w_q, x @ w_k, x @ w_v, return_weights=True)
    _close(our_out, out)
    _close(our_weights, weights)


def test_seed_001_multi_head_and_mask_convention() -> None:
    torch.manual_seed(1)
    theirs = MultiHead001(12, heads=3).double()
    ours = qkv.SelfAttention(12, heads=3, bias=True, dtype=F64)
    _load_fused(ours, theirs.w_q, theirs.w_k, theirs.w_v)
    _load(ours.out_proj, theirs.w_o)
    x = torch.randn(2, 5, 12, dtype=F64)
    blocked = torch.ones(5, 5, dtype=torch.bool).triu(1)  # the tutorial's mask: True = blocked
    with torch.no_grad():
        _close(ours(x), theirs(x))
        causal = theirs(x, blocked)
        # qkv's convention is the opposite (True = may attend): the same rule is ~blocked,
        # or simply causal=True.
        _close(ours(x, mask=~blocked), causal)
        _close(ours(x, causal=True), causal)
        # Handing qkv the tutorial's mask unchanged means "attend only to the future": a
        # different result, and the last token has no key left. qkv gives that row zero
        # attention (so the output is out_proj's bias) where -inf everywhere gives NaN.
        inverted = ours(x, mask=blocked)
        assert not torch.allclose(inverted, causal)
        _close(inverted[:, -1], ours.out_proj.bias.expand(2, 12))
        assert theirs(x, ~blocked)[:, -1].isnan().all()


# --- seed 002: causal multi-head attention with one fused bias-free projection --------------


class CausalSelfAttention002(nn.Module):
    """Fused bias-free (D -> 3D) projection, causal heads of D // H, bias-free output."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.fused = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length, width = x.shape
        q, k, v = (
            t.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # (B, H, L, D / H)
            for t in self.fused(x).chunk(3, dim=-1)
        )
        scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
        allowed = torch.ones(length, length, dtype=torch.bool).tril()
        weights = self.drop(scores.masked_fill(~allowed, -math.inf).softmax(-1))
        mixed = (weights @ v).transpose(1, 2).reshape(batch, length, width)
        return self.out(mixed), weights


def _seed_002_pair(dtype: torch.dtype) -> tuple[CausalSelfAttention002, qkv.SelfAttention]:
    torch.manual_seed(2)
    theirs = CausalSelfAttention002(32, heads=4, dropout=0.2).to(dtype)
    ours = qkv.SelfAttention(32, heads=4, dropout=0.2, causal=True, backend="reference")
    ours = ours.to(dtype)
    _load(ours.qkv_proj, theirs.fused)  # the same layout: [W_q; W_k; W_v] along the outputs
    _load(ours.out_proj, theirs.out)
    return theirs, ours


def test_seed_002_causal_multi_head_matches() -> None:
    theirs, ours = _seed_002_pair(F64)
    theirs.eval()
    ours.eval()
    x = torch.randn(3, 8, 32, dtype=F64)
    out, weights = theirs(x)
    our_out, our_weights = ours(x, return_weights=True)
    _close(our_out, out)
    _close(our_weights, weights)
    assert our_weights[..., ~qkv.causal_mask(8)].eq(0).all()  # exactly 0 above the diagonal
    _close(our_weights.sum(-1), torch.ones(3, 4, 8, dtype=F64))


def test_seed_002_training_dropout_matches() -> None:
    theirs, ours = _seed_002_pair(torch.float32)
    theirs.train()
    ours.train()
    x = torch.randn(2, 8, 32)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(5)
        out, _ = theirs(x)
        torch.manual_seed(5)  # the reference backend draws one dropout mask of (B, H, L, L)
        our_out = ours(x)
    torch.testing.assert_close(our_out, out)


# --- seed 003: V1 separate projections, V2 fused, V3 mask + dropout + output projection -----


class SelfAttentionV1(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).mT / math.sqrt(self.hidden)  # (B, L, L)
        return scores.softmax(-1) @ self.v(x)


class SelfAttentionV2(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.fused = nn.Linear(hidden, 3 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.fused(x).chunk(3, dim=-1)
        return (q @ k.mT / math.sqrt(self.hidden)).softmax(-1) @ v


class SelfAttentionV3(SelfAttentionV2):
    """V2 plus dropout on the weights, an output projection, and ``attention_mask`` (1 = keep)
    whose blocked scores are filled with ``fill`` (the tutorial uses 1e-20)."""

    def __init__(self, hidden: int, dropout: float, fill: float = 1e-20) -> None:
        super().__init__(hidden)
        self.fill = fill
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.fused(x).chunk(3, dim=-1)
        scores = q @ k.mT / math.sqrt(self.hidden)  # (B, L, L)
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask == 0, self.fill)
        return self.out(self.drop(scores.softmax(-1)) @ v)


def test_seed_003_v1_and_v2_match() -> None:
    torch.manual_seed(3)
    v1, v2 = SelfAttentionV1(6).double(), SelfAttentionV2(6).double()
    x = torch.randn(2, 5, 6, dtype=F64)
    with torch.no_grad():
        _close(qkv.attention(v1.q(x), v1.k(x), v1.v(x)), v1(x))
        _close(qkv.attention(*v2.fused(x).chunk(3, dim=-1)), v2(x))
        # V2 is V1 with the three weights stacked into one: the same numbers.
        v2.fused.weight.copy_(torch.cat([v1.q.weight, v1.k.weight, v1.v.weight]))
        v2.fused.bias.copy_(torch.cat([v1.q.bias, v1.k.bias, v1.v.bias]))
        _close(v2(x), v1(x))


def _seed_003_pair(fill: float, dtype: torch.dtype) -> tuple[SelfAttentionV3, qkv.SelfAttention]:
    torch.manual_seed(3)
    theirs = SelfAttentionV3(6, dropout=0.25, fill=fill).to(dtype)
    ours = qkv.SelfAttention(6, bias=True, dropout=0.25, backend="reference").to(dtype)
    _load(ours.qkv_proj, theirs.fused)
    _load(ours.out_proj, theirs.out)
    return theirs, ours


def test_seed_003_v3_matches_without_padding() -> None:
    theirs, ours = _seed_003_pair(1e-20, F64)
    theirs.eval()
    ours.eval()
    x = torch.randn(2, 5, 6, dtype=F64)
    everything = torch.ones(2, 1, 5, dtype=torch.long)  # nothing masked: 1e-20 is never used
    with torch.no_grad():
        _close(ours(x), theirs(x))
        _close(ours(x, padding_mask=everything[:, 0]), theirs(x, everything))


def test_seed_003_v3_mask_must_be_minus_inf_and_empty_rows_zero() -> None:
    tiny, ours = _seed_003_pair(1e-20, F64)
    right, _ = _seed_003_pair(-math.inf, F64)  # the same weights, masked scores at -inf
    for module in (tiny, right, ours):
        module.eval()
    x = torch.randn(3, 5, 6, dtype=F64)
    real = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])  # (B, S)
    with torch.no_grad():
        our_out, weights = ours(x, padding_mask=real, return_weights=True)
        tiny_out, right_out = tiny(x, real[:, None, :]), right(x, real[:, None, :])
    # 1e-20 is an ordinary score (about 0), so padding keeps a share of the weight and the
    # output changes; masked scores must be -inf, which gives padding exactly 0 weight.
    assert weights[1, 0, :, 3:].eq(0).all()
    assert not torch.allclose(tiny_out[1], our_out[1])
    _close(our_out[:2], right_out[:2])
    # A query with no real key: -inf everywhere gives NaN, 1e-20 everywhere a uniform average
    # of padding. qkv gives zero weights, so the attention output is 0 and the layer's output
    # is exactly out_proj's bias.
    assert right_out[2].isnan().all()
    assert weights[2].eq(0).all()
    _close(our_out[2], ours.out_proj.bias.expand(5, 6))
    assert not torch.allclose(tiny_out[2], our_out[2])


def test_seed_003_v3_training_dropout_matches() -> None:
    theirs, ours = _seed_003_pair(1e-20, torch.float32)
    theirs.train()
    ours.train()
    x = torch.randn(2, 5, 6)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(9)
        out = theirs(x)
        torch.manual_seed(9)  # the reference backend draws one dropout mask of (B, H, L, L)
        our_out = ours(x)
    torch.testing.assert_close(our_out, out)


# --- seed 004: a single token's view, d_in != d_out, scaled by sqrt(d_in) --------------------


class TokenAttention004(nn.Module):
    """Biased (d_in -> d_out) projections; scores / sqrt(d_in) (the tutorial's scale);
    returns (context, queries, keys, values, weights)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.d_in = d_in
        self.q, self.k, self.v = (nn.Linear(d_in, d_out) for _ in range(3))

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        queries, keys, values = self.q(tokens), self.k(tokens), self.v(tokens)
        weights = torch.softmax(queries @ keys.T / self.d_in**0.5, dim=-1)  # (L, L)
        return weights @ values, queries, keys, values, weights


@pytest.mark.parametrize(("d_in", "d_out"), [(4, 3), (16, 5)])
def test_seed_004_scale_is_one_over_sqrt_dk(d_in: int, d_out: int) -> None:
    torch.manual_seed(4)
    module = TokenAttention004(d_in, d_out).double()
    tokens = torch.rand(5, d_in, dtype=F64)
    with torch.no_grad():
        context, queries, keys, values, weights = module(tokens)
    # qkv reproduces the tutorial exactly when given its scale ...
    tutorial = qkv.attention(queries, keys, values, scale=d_in**-0.5, return_weights=True)
    _close(tutorial[0], context)
    _close(tutorial[1], weights)
    # ... but its default is 1/sqrt(d_k), d_k = d_out the query/key size: the scores are dot
    # products of d_out-sized vectors, so their spread grows with d_out, never with d_in.
    our_out, our_weights = qkv.attention(queries, keys, values, return_weights=True)
    oracle = torch.softmax(queries @ keys.T / math.sqrt(d_out), dim=-1)
    _close(our_weights, oracle)
    _close(our_out, oracle @ values)
    assert not torch.allclose(our_weights, weights, atol=1e-6)
    # One token's view (one query against every key) is row i of the full computation.
    one_out, one_weights = qkv.attention(queries[2:3], keys, values, return_weights=True)
    _close(one_out[0], our_out[2])
    _close(one_weights[0], our_weights[2])


# --- the example scripts ----------------------------------------------------------------------

_NUMBER = r"[-+]?(?:\d+\.\d*|nan)(?:e[-+]?\d+)?"


def _run_example(name: str, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    path = EXAMPLES / name
    argv = sys.argv
    sys.argv = [str(path), *args]
    try:
        with torch.random.fork_rng():  # the scripts seed the global generator
            runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = argv
    return capsys.readouterr().out


def _numbers(output: str, label: str) -> list[float]:
    """The numbers of the first ``[...]`` that follows ``label`` in ``output``."""
    match = re.search(re.escape(label) + r"[^\[]*\[([^\]]*)\]", output)
    assert match, f"{label!r} not found in the output"
    return [float(x) for x in re.findall(_NUMBER, match.group(1))]


def _table(output: str, label: str) -> list[list[float]]:
    """The rows of the ``[...]`` table printed on the lines after the line holding ``label``."""
    lines = output.split(label, 1)[1].splitlines()[1:]
    rows = []
    for line in lines:
        if not line.strip().startswith("["):
            break
        rows.append([float(x) for x in re.findall(_NUMBER, line)])
    assert rows, f"no table after {label!r}"
    return rows


def _value(output: str, label: str) -> float:
    match = re.search(re.escape(label) + r"\s*(" + _NUMBER + ")", output)
    assert match, f"{label!r} not found in the output"
    return float(match.group(1))


def test_example_000_single_head(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_example("seed_000_single_head.py", capsys)
    assert _value(out, "largest weight on a future key:") == 0.0
    assert _value(out, "outputs 0..6 move by") == 0.0
    assert _value(out, "outputs 7..9 by") > 0.0
    row = _numbers(out, "row 5 =")
    assert len(row) == 10 and abs(sum(row) - 1) < 0.05  # two decimals each
    assert "row sums 1.0000 to 1.0000" in out  # weights before dropout, even in training
    assert "None: TypeError: x must be a torch.Tensor" in out
    assert "NaN anywhere: False" in out


def test_example_001_the_cat_sat(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_example("seed_001_the_cat_sat.py", capsys)
    exps = [math.exp(s) for s in (0.5, 2.1, 1.3)]
    true = [e / sum(exps) for e in exps]
    for label in ("softmax = exp / sum =", "qkv.attention weights ="):
        assert _numbers(out, label) == pytest.approx(true, abs=6e-5)
    assert _numbers(out, "~") == pytest.approx([0.122, 0.606, 0.272], abs=1e-9)
    assert _value(out, "max |qkv - softmax(QK^T/sqrt(d_k))V| =") < 1e-6
    assert "complement: True" in out
    inverted = _table(out, "so its row is all zeros")  # the tutorial's mask given to qkv
    assert inverted[2] == [0.0, 0.0, 0.0] and inverted[0][0] == 0.0 and inverted[0][1] > 0


def test_example_002_causal_heatmap(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import matplotlib.image

    out = _run_example("seed_002_causal_heatmap.py", capsys, "--out", str(tmp_path))
    assert _value(out, "largest weight above the diagonal:") == 0.0
    assert _value(out, "row sums: min") == pytest.approx(1.0, abs=1e-6)
    png = tmp_path / "seed_002_causal_heatmap.png"
    assert str(png) in out
    image = matplotlib.image.imread(png)  # (height, width, RGBA) floats in [0, 1]
    assert image.shape[0] > 200 and image.shape[1] > 600
    colours = image[..., :3].reshape(-1, 3)
    assert colours.std() > 0.1  # not a blank canvas
    assert len({tuple(c) for c in colours[::7].round(2).tolist()}) > 50  # a real heatmap


def test_example_003_three_levels(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_example("seed_003_three_levels.py", capsys)
    # The fused matmul may block its sums differently from three separate ones (CPU-dependent):
    # the two agree to float32 rounding, not bit for bit.
    assert _value(out, "max |V2 - V1| =") <= 16 * torch.finfo(torch.float32).eps
    assert _value(out, "eval mode:  two calls differ by") == 0.0
    assert _value(out, "train mode: two calls differ by") > 0.0
    padded, empty = out.split("sentence 2 is all padding")
    right = _numbers(padded, "fill -inf:")
    printed = 1e-4  # the example prints 4 decimals
    assert _numbers(padded, "qkv:") == pytest.approx(right, abs=printed) and right[2:] == [0, 0]
    assert sum(_numbers(padded, "fill 1e-20:")[2:]) > 0.1  # 1e-20 leaves weight on padding
    assert _numbers(empty, "fill 1e-20:") == [0.25] * 4
    assert all(math.isnan(x) for x in _numbers(empty, "fill -inf:"))
    assert _numbers(empty, "qkv:") == [0.0] * 4


def test_example_004_single_token(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_example("seed_004_single_token.py", capsys)
    scores = [float(re.findall(_NUMBER, line)[-1]) for line in out.splitlines() if "q . k_" in line]
    step = _numbers(out, "weights = softmax(scores * scale) =")
    expected = torch.softmax(torch.tensor(scores, dtype=F64) / math.sqrt(3), dim=-1)
    assert step == pytest.approx(expected.tolist(), abs=2e-4)  # 1/sqrt(d_k), d_k = 3
    assert _numbers(out, "qkv.attention(q[None], K, V) -> weights") == pytest.approx(step, abs=1e-4)
    assert "row 2 equals the step-by-step context: True" in out
    wrong = _numbers(out, "weights, 1/sqrt(d_in = 4):")
    assert wrong != step
    assert wrong == pytest.approx(torch.softmax(torch.tensor(scores) / 2, -1).tolist(), abs=2e-4)
    for d_k in (3, 64):
        assert _value(out, f"d_k = {d_k:>2}: std(q.k) =") == pytest.approx(math.sqrt(d_k), rel=0.05)
    assert _value(out, "std(q.k / sqrt(d_k)) =") == pytest.approx(1.0, abs=0.05)
