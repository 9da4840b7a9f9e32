"""qkv.MultiheadAttention against torch.nn.MultiheadAttention: same checkpoints, same numbers.

Every combination of the constructor's options and forward's flags, with every kind of mask
(torch's conventions: True = ignore / not allowed; floats added), loads torch's state_dict
strictly and matches torch's outputs and weights wherever torch's are finite. Where torch gives
NaN (a fully padded item, a fully blocked row), qkv gives 0 attention: weights 0, and an output
equal to out_proj's bias.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qkv

E, H, L, S, B = 8, 2, 3, 4, 3  # embed_dim, heads, query length, key length, batch
KDIM, VDIM = 5, 6
ATOL = 1e-5


OPTIONS = list(itertools.product([False, True], repeat=7))
OPTION_IDS = [
    "-".join(name for name, on in zip(("bias", "bkv", "zero", "kvdim", "bf", "nw", "avg"), o) if on)
    or "plain"
    for o in OPTIONS
]


def make_pair(
    *, bias: bool, add_bias_kv: bool, add_zero_attn: bool, kvdim: bool, batch_first: bool
) -> tuple[torch.nn.MultiheadAttention, qkv.MultiheadAttention]:
    """A torch layer with random weights (biases too) and a qkv layer loaded from its state_dict."""
    kwargs = dict(
        bias=bias,
        add_bias_kv=add_bias_kv,
        add_zero_attn=add_zero_attn,
        kdim=KDIM if kvdim else None,
        vdim=VDIM if kvdim else None,
        batch_first=batch_first,
    )
    reference = torch.nn.MultiheadAttention(E, H, **kwargs).eval()
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.normal_()
    ours = qkv.MultiheadAttention(E, H, **kwargs).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours


def padding_masks(generator: torch.Generator) -> dict[str, torch.Tensor | None]:
    """(B, S) key padding masks in torch's convention; item 1 is fully padded."""
    ignore = torch.rand(B, S, generator=generator) < 0.3
    ignore[1] = True
    ignore[0] = False
    additive = torch.zeros(B, S).masked_fill(ignore, float("-inf"))
    additive += torch.randn(B, S, generator=generator) * (~ignore)
    return {"none": None, "bool": ignore, "float": additive}


def attention_masks(generator: torch.Generator) -> dict[str, torch.Tensor | None]:
    """(L, S) and (B*H, L, S) masks in torch's convention; query row 0 is fully blocked."""
    blocked = torch.rand(L, S, generator=generator) < 0.3
    blocked[0] = True
    blocked3 = (torch.rand(B, 1, L, S, generator=generator) < 0.3).expand(B, H, L, S).clone()
    blocked3[:, :, 2] = True  # the same row of every head, so the average is 0 too
    blocked3 = blocked3.reshape(B * H, L, S)

    def additive(blocked: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(blocked.shape, generator=generator)
        return noise.masked_fill(blocked, float("-inf"))

    return {
        "none": None,
        "bool2d": blocked,
        "bool3d": blocked3,
        "float2d": additive(blocked),
        "float3d": additive(blocked3),
    }


def inputs(generator: torch.Generator, *, kvdim: bool, batch_first: bool):
    def seq(length: int, features: int) -> torch.Tensor:
        x = torch.randn(B, length, features, generator=generator)
        return x if batch_first else x.transpose(0, 1)

    return seq(L, E), seq(S, KDIM if kvdim else E), seq(S, VDIM if kvdim else E)


def assert_matches(
    ours: tuple[torch.Tensor, torch.Tensor | None],
    theirs: tuple[torch.Tensor, torch.Tensor | None],
    out_bias: torch.Tensor | None,
) -> None:
    """Equal where torch is finite; where torch is NaN: weights 0 and output = out_proj bias."""
    (out, weights), (ref_out, ref_weights) = ours, theirs
    assert out.shape == ref_out.shape
    finite = torch.isfinite(ref_out)
    torch.testing.assert_close(out[finite], ref_out[finite], atol=ATOL, rtol=ATOL)
    assert torch.isfinite(out).all()
    if not finite.all():
        bias = torch.zeros(E) if out_bias is None else out_bias.detach()
        torch.testing.assert_close(out, torch.where(finite, out, bias.expand_as(out)))
    if ref_weights is None:
        assert weights is None
        return
    assert weights is not None and weights.shape == ref_weights.shape
    finite = torch.isfinite(ref_weights)
    torch.testing.assert_close(weights[finite], ref_weights[finite], atol=ATOL, rtol=ATOL)
    assert (weights[~finite] == 0).all()


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_matches_torch_for_every_option_and_mask(options: tuple[bool, ...]) -> None:
    bias, add_bias_kv, add_zero_attn, kvdim, batch_first, need_weights, average = options
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    reference, ours = make_pair(
        bias=bias,
        add_bias_kv=add_bias_kv,
        add_zero_attn=add_zero_attn,
        kvdim=kvdim,
        batch_first=batch_first,
    )
    query, key, value = inputs(generator, kvdim=kvdim, batch_first=batch_first)
    saw_nan = False
    for (kpm_kind, kpm), (mask_kind, mask) in itertools.product(
        padding_masks(generator).items(), attention_masks(generator).items()
    ):
        kwargs = dict(
            key_padding_mask=kpm,
            attn_mask=mask,
            need_weights=need_weights,
            average_attn_weights=average,
        )
        with torch.no_grad():
            theirs = reference(query, key, value, **kwargs)
            got = ours(query, key, value, **kwargs)
        saw_nan |= bool(torch.isnan(theirs[0]).any())
        try:
            assert_matches(got, theirs, reference.out_proj.bias)
        except AssertionError as error:
            raise AssertionError(f"key_padding_mask={kpm_kind}, attn_mask={mask_kind}") from error
    # The masks really produce the NaN that qkv fixes (torch's weights path; its fused path gives
    # 0 like qkv), unless the appended keys are always allowed.
    assert saw_nan == (need_weights and not add_bias_kv and not add_zero_attn)


@pytest.mark.parametrize("batch_first", [False, True])
def test_self_attention_fast_path(batch_first: bool) -> None:
    """query is key is value in eval mode without grad: torch's fused inference path."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(2)
    reference, ours = make_pair(
        bias=True, add_bias_kv=False, add_zero_attn=False, kvdim=False, batch_first=batch_first
    )
    x = torch.randn(B, S, E, generator=generator)
    x = x if batch_first else x.transpose(0, 1)
    kpm = padding_masks(generator)["bool"]  # item 1 fully padded: NaN on torch's fused path
    for need_weights, mask in itertools.product([False, True], [None, kpm]):
        with torch.no_grad():
            theirs = reference(x, x, x, key_padding_mask=mask, need_weights=need_weights)
            got = ours(x, x, x, key_padding_mask=mask, need_weights=need_weights)
        assert_matches(got, theirs, reference.out_proj.bias)


def test_per_head_blocked_rows_average_the_zeros() -> None:
    """A row blocked in one head only: that head's weights are 0 and the average uses them."""
    torch.manual_seed(0)
    reference, ours = make_pair(
        bias=True, add_bias_kv=False, add_zero_attn=False, kvdim=False, batch_first=True
    )
    query, key = torch.randn(B, L, E), torch.randn(B, S, E)
    blocked = torch.zeros(B, H, L, S, dtype=torch.bool)
    blocked[0, 1, 0] = True  # item 0, head 1, query 0 sees no key
    blocked = blocked.reshape(B * H, L, S)
    with torch.no_grad():
        _, ref_heads = reference(query, key, key, attn_mask=blocked, average_attn_weights=False)
        _, heads = ours(query, key, key, attn_mask=blocked, average_attn_weights=False)
        _, mean = ours(query, key, key, attn_mask=blocked)
    assert torch.isnan(ref_heads[0, 1, 0]).all()
    torch.testing.assert_close(heads, ref_heads.nan_to_num(0.0), atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(mean, heads.mean(dim=1))


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_is_causal_hint_matches_torch(kind: str) -> None:
    torch.manual_seed(0)
    reference, ours = make_pair(
        bias=True, add_bias_kv=False, add_zero_attn=False, kvdim=False, batch_first=True
    )
    x = torch.randn(B, S, E)
    blocked = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)
    mask = blocked if kind == "bool" else torch.zeros(S, S).masked_fill(blocked, float("-inf"))
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[2, -1] = True
    kpm = kpm if kind == "bool" else torch.zeros(B, S).masked_fill(kpm, float("-inf"))
    q, k, v = x, x.clone(), x.clone()  # distinct tensors: torch's general path
    for need_weights, padding in itertools.product([False, True], [None, kpm]):
        kwargs = dict(attn_mask=mask, is_causal=True, need_weights=need_weights)
        theirs = reference(q, k, v, key_padding_mask=padding, **kwargs)
        got = ours(q, k, v, key_padding_mask=padding, **kwargs)
        assert_matches(got, theirs, reference.out_proj.bias)


def test_is_causal_needs_attn_mask_like_torch() -> None:
    reference, ours = make_pair(
        bias=True, add_bias_kv=False, add_zero_attn=False, kvdim=False, batch_first=True
    )
    x = torch.randn(B, S, E)
    with pytest.raises(RuntimeError, match="attn_mask"):
        reference(x, x.clone(), x.clone(), is_causal=True)
    with pytest.raises(ValueError, match="attn_mask"):
        ours(x, x.clone(), x.clone(), is_causal=True)


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("mask_kind", ["none", "bool2d", "float2d"])
def test_unbatched_input(mask_kind: str) -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(3)
    reference, ours = make_pair(
        bias=True, add_bias_kv=False, add_zero_attn=True, kvdim=True, batch_first=True
    )
    query = torch.randn(L, E, generator=generator)
    key, value = torch.randn(S, KDIM, generator=generator), torch.randn(S, VDIM)
    kpm = torch.tensor([False, True, False, True])
    mask = attention_masks(generator)[mask_kind]
    heads_mask = torch.rand(H, L, S, generator=generator) < 0.3  # 3-D unbatched: (H, L, S)
    for attn_mask, average in itertools.product([mask, heads_mask], [True, False]):
        kwargs = dict(key_padding_mask=kpm, attn_mask=attn_mask, average_attn_weights=average)
        with torch.no_grad():
            theirs = reference(query, key, value, **kwargs)
            got = ours(query, key, value, **kwargs)
        assert got[0].shape == (L, E)
        assert_matches(got, theirs, reference.out_proj.bias)


def test_fully_padded_item_has_finite_gradients() -> None:
    torch.manual_seed(0)
    _, ours = make_pair(
        bias=True, add_bias_kv=False, add_zero_attn=False, kvdim=False, batch_first=True
    )
    x = torch.randn(B, S, E, requires_grad=True)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1] = True
    out, _ = ours(x, x, x, key_padding_mask=kpm)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters())
    # The padded item's keys and values receive no gradient from the queries of any item.
    out, _ = ours(x.detach(), x, x, key_padding_mask=kpm)
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert (grad[1] == 0).all()


def test_same_initialisation_and_state_dict_keys_as_torch() -> None:
    for kvdim, add_bias_kv in itertools.product([False, True], repeat=2):
        kwargs = dict(
            kdim=KDIM if kvdim else None, vdim=VDIM if kvdim else None, add_bias_kv=add_bias_kv
        )
        torch.manual_seed(5)
        theirs = torch.nn.MultiheadAttention(E, H, **kwargs).state_dict()
        torch.manual_seed(5)
        ours = qkv.MultiheadAttention(E, H, **kwargs).state_dict()
        assert list(ours) == list(theirs)
        for name in theirs:
            torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0)
        # and back: a qkv checkpoint loads into torch
        torch.nn.MultiheadAttention(E, H, **kwargs).load_state_dict(ours, strict=True)


def test_dropout_only_in_training() -> None:
    torch.manual_seed(0)
    layer = qkv.MultiheadAttention(E, H, dropout=0.5, batch_first=True)
    reference = torch.nn.MultiheadAttention(E, H, dropout=0.5, batch_first=True)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(B, S, E)
    layer.eval()
    reference.eval()
    torch.testing.assert_close(layer(x, x, x)[0], reference(x, x, x)[0], atol=ATOL, rtol=ATOL)
    layer.train()
    out_a, weights = layer(x, x, x)
    out_b, _ = layer(x, x, x)
    assert not torch.allclose(out_a, out_b)  # a different dropout draw each call
    # weights are the softmax before dropout: each row sums to 1
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, S))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(key_padding_mask=torch.zeros(B, S + 1, dtype=torch.bool)), ValueError, "(3, 4)"),
        (dict(key_padding_mask=torch.zeros(B, S, dtype=torch.long)), TypeError, "int64"),
        (dict(attn_mask=torch.zeros(S, S + 1, dtype=torch.bool)), ValueError, "attn_mask"),
        (dict(attn_mask=torch.zeros(B, S, S, dtype=torch.bool)), ValueError, "(6, 4, 4)"),
    ],
)
def test_bad_masks_name_the_argument(kwargs: dict, error: type, match: str) -> None:
    layer = qkv.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(B, S, E)
    with pytest.raises(error, match=match.replace("(", r"\(").replace(")", r"\)")):
        layer(x, x, x, **kwargs)


def test_bad_construction_and_inputs() -> None:
    with pytest.raises(ValueError, match="divisible"):
        qkv.MultiheadAttention(7, 2)
    layer = qkv.MultiheadAttention(E, H, kdim=KDIM, vdim=VDIM)
    with pytest.raises(ValueError, match="key must have 5 features"):
        layer(torch.randn(L, B, E), torch.randn(S, B, E), torch.randn(S, B, VDIM))
    with pytest.raises(ValueError, match="batch size"):
        layer(torch.randn(L, B, E), torch.randn(S, B + 1, KDIM), torch.randn(S, B + 1, VDIM))


@given(
    lengths=st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=3),
    heads=st.sampled_from([1, 2, 4]),
    batch_first=st.booleans(),
)
def test_padded_batch_equals_each_sequence_alone(
    lengths: list[int], heads: int, batch_first: bool
) -> None:
    """Padding keys (True = ignore) changes nothing for the real queries of any item."""
    layer = qkv.MultiheadAttention(E, heads, kdim=KDIM, vdim=VDIM, batch_first=True).eval()
    generator = torch.Generator().manual_seed(sum(lengths))
    s = max(lengths)
    query = torch.randn(len(lengths), L, E, generator=generator)
    key = torch.randn(len(lengths), s, KDIM, generator=generator)
    value = torch.randn(len(lengths), s, VDIM, generator=generator)
    ignore = torch.arange(s)[None, :] >= torch.tensor(lengths)[:, None]  # (B, S)
    layer.batch_first = batch_first
    inputs = (
        (query, key, value)
        if batch_first
        else tuple(x.transpose(0, 1) for x in (query, key, value))
    )
    with torch.no_grad():
        out, weights = layer(*inputs, key_padding_mask=ignore)
        out = out if batch_first else out.transpose(0, 1)
        layer.batch_first = True
        for i, n in enumerate(lengths):
            alone, alone_weights = layer(query[i], key[i, :n], value[i, :n])
            torch.testing.assert_close(out[i], alone, atol=ATOL, rtol=ATOL)
            torch.testing.assert_close(weights[i, :, :n], alone_weights, atol=ATOL, rtol=ATOL)
            assert (weights[i, :, n:] == 0).all()
