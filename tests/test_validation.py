"""Every bad input is a TypeError or ValueError whose message names the argument and gives what
was expected and what was received; calls too big for memory fail fast with a clear message.

Each case lists words its message must contain: the argument's name, then the expected and the
actual value, shape or dtype. Legend: B batch, H heads, L query length, S key length, D features.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.backends import reference
from qkv.backends.base import Unsupported


def t(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


q4, k4, v4 = t(2, 4, 5, 8), t(2, 2, 6, 8), t(2, 2, 6, 3)  # a valid grouped-query call


def raises(error: type[Exception], words: list[str], call) -> None:
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert type(info.value) is error or issubclass(type(info.value), error)
    for word in words:
        assert word in message, f"{word!r} missing from the message: {message}"


ATTENTION = {
    "q None": (TypeError, ["q", "torch.Tensor", "NoneType"], lambda: qkv.attention(None, k4, v4)),
    "k list": (TypeError, ["k", "torch.Tensor", "list"], lambda: qkv.attention(q4, [1.0], v4)),
    "v number": (TypeError, ["v", "torch.Tensor", "float"], lambda: qkv.attention(q4, k4, 1.0)),
    "q rank 1": (
        ValueError,
        ["q", "at least 2", "got 1", "(8)"],
        lambda: qkv.attention(t(8), k4, v4),
    ),
    "v rank 0": (ValueError, ["v", "at least 2", "got 0"], lambda: qkv.attention(q4, k4, t())),
    "Dk differs": (
        ValueError,
        ["q and k", "Dk", "(2, 4, 5, 8)", "(2, 2, 6, 7)"],
        lambda: qkv.attention(q4, t(2, 2, 6, 7), v4),
    ),
    "Lk differs": (
        ValueError,
        ["k and v", "Lk", "(2, 2, 6, 8)", "(2, 2, 5, 3)"],
        lambda: qkv.attention(q4, k4, t(2, 2, 5, 3)),
    ),
    "heads not a multiple": (
        ValueError,
        ["heads", "multiple", "3 heads", "2 heads"],
        lambda: qkv.attention(t(2, 3, 5, 8), k4, v4),
    ),
    "batch mismatch": (
        ValueError,
        ["batch", "(3, 4, 5, 8)", "(2, 2, 6, 8)"],
        lambda: qkv.attention(t(3, 4, 5, 8), k4, v4),
    ),
    "k, v batch mismatch": (
        ValueError,
        ["k and v", "(2, 2, 6, 8)", "(3, 2, 6, 3)"],
        lambda: qkv.attention(q4, k4, t(3, 2, 6, 3)),
    ),
    "integer q": (
        TypeError,
        ["q", "floating", "torch.int64"],
        lambda: qkv.attention(t(2, 4, 5, 8, dtype=torch.int64), k4, v4),
    ),
    "complex k": (
        TypeError,
        ["k", "floating", "torch.complex64"],
        lambda: qkv.attention(q4, t(2, 2, 6, 8, dtype=torch.complex64), v4),
    ),
    "bool v": (
        TypeError,
        ["v", "floating", "torch.bool"],
        lambda: qkv.attention(q4, k4, t(2, 2, 6, 3, dtype=torch.bool)),
    ),
    "dtypes differ": (
        TypeError,
        ["q, k, v", "one dtype", "q=torch.float32", "v=torch.float64"],
        lambda: qkv.attention(q4, k4, v4.double()),
    ),
    "mask integer": (
        TypeError,
        ["mask", "bool", "floating", "torch.int64"],
        lambda: qkv.attention(q4, k4, v4, mask=t(5, 6, dtype=torch.int64)),
    ),
    "mask complex": (
        TypeError,
        ["mask", "torch.complex64"],
        lambda: qkv.attention(q4, k4, v4, mask=t(5, 6, dtype=torch.complex64)),
    ),
    "mask list": (
        TypeError,
        ["mask", "torch.Tensor", "list"],
        lambda: qkv.attention(q4, k4, v4, mask=[[True]]),
    ),
    "mask not broadcastable": (
        ValueError,
        ["mask", "(5, 5)", "(*batch, Hq, Lq, Lk)", "(2, 4, 5, 6)"],
        lambda: qkv.attention(q4, k4, v4, mask=t(5, 5, dtype=torch.bool)),
    ),
    "mask would grow the output": (
        ValueError,
        ["mask", "(3, 2, 4, 5, 6)", "(2, 4, 5, 6)"],
        lambda: qkv.attention(q4, k4, v4, mask=t(3, 2, 4, 5, 6, dtype=torch.bool)),
    ),
    "mask for unbatched inputs": (
        ValueError,
        ["mask", "(2, 5, 6)", "(5, 6)"],
        lambda: qkv.attention(t(5, 8), t(6, 8), t(6, 3), mask=t(2, 5, 6, dtype=torch.bool)),
    ),
    "dropout negative": (
        ValueError,
        ["dropout_p", "[0, 1)", "-0.1"],
        lambda: qkv.attention(q4, k4, v4, dropout_p=-0.1),
    ),
    "dropout one": (
        ValueError,
        ["dropout_p", "[0, 1)", "1.0"],
        lambda: qkv.attention(q4, k4, v4, dropout_p=1.0),
    ),
    "dropout nan": (
        ValueError,
        ["dropout_p", "[0, 1)", "nan"],
        lambda: qkv.attention(q4, k4, v4, dropout_p=float("nan")),
    ),
    "dropout string": (
        TypeError,
        ["dropout_p", "float", "str"],
        lambda: qkv.attention(q4, k4, v4, dropout_p="0.1"),
    ),
    "unknown backend": (
        ValueError,
        ["backend", "'reference'", "'flash'", "'cuda'"],
        lambda: qkv.attention(q4, k4, v4, backend="cuda"),
    ),
    "unknown causal": (
        ValueError,
        ["causal", "'top-left'", "'bottom-right'", "'bottom_right'"],
        lambda: qkv.attention(q4, k4, v4, causal="bottom_right"),
    ),
    "causal as int": (
        ValueError,
        ["causal", "True", "got 1"],
        lambda: qkv.attention(q4, k4, v4, causal=1),
    ),
    "scale nan": (
        ValueError,
        ["scale", "finite", "nan"],
        lambda: qkv.attention(q4, k4, v4, scale=float("nan")),
    ),
    "scale tensor": (
        TypeError,
        ["scale", "float", "Tensor"],
        lambda: qkv.attention(q4, k4, v4, scale=torch.tensor(1.0)),
    ),
    "return_weights int": (
        TypeError,
        ["return_weights", "bool", "int"],
        lambda: qkv.attention(q4, k4, v4, return_weights=1),
    ),
    "default scale without features": (
        ValueError,
        ["scale", "Dk", "(5, 0)"],
        lambda: qkv.attention(t(5, 0), t(6, 0), t(6, 3)),
    ),
}


@pytest.mark.parametrize("case", list(ATTENTION))
def test_attention_bad_inputs(case):
    error, words, call = ATTENTION[case]
    raises(error, words, call)


def test_devices_must_match():
    # 'meta' stands in for a second device: the check must happen before any computation.
    raises(
        ValueError,
        ["q, k, v", "one device", "q on cpu", "k on meta"],
        lambda: qkv.attention(q4, t(2, 2, 6, 8, device="meta"), v4),
    )
    raises(
        ValueError,
        ["q", "mask", "device", "mask on meta"],
        lambda: qkv.attention(q4, k4, v4, mask=t(5, 6, dtype=torch.bool, device="meta")),
    )
    module = qkv.SelfAttention(8, 2)
    raises(
        ValueError, ["x", "layer weights", "x on meta"], lambda: module(t(2, 5, 8, device="meta"))
    )
    cache = qkv.KVCache()
    raises(
        ValueError,
        ["k, v", "one device", "v on meta"],
        lambda: cache.append(t(1, 1, 2, 3), t(1, 1, 2, 3, device="meta")),
    )


# --- the module --------------------------------------------------------------------------------

CONSTRUCTOR = {
    "d_model zero": (ValueError, ["d_model", "positive", "0"], {"d_model": 0}),
    "d_model negative": (ValueError, ["d_model", "positive", "-4"], {"d_model": -4}),
    "d_model float": (TypeError, ["d_model", "int", "float"], {"d_model": 8.0}),
    "d_model None": (TypeError, ["d_model", "int", "NoneType"], {"d_model": None}),
    "heads zero": (ValueError, ["heads", "positive", "0"], {"heads": 0}),
    "kv_heads zero": (ValueError, ["kv_heads", "positive", "0"], {"kv_heads": 0}),
    "heads not multiple": (
        ValueError,
        ["heads", "multiple of kv_heads", "heads=4", "kv_heads=3"],
        {"heads": 4, "kv_heads": 3},
    ),
    "not divisible": (
        ValueError,
        ["d_model", "divisible by heads", "d_model=8", "heads=3"],
        {"heads": 3},
    ),
    "head_dim zero": (ValueError, ["head_dim", "positive", "0"], {"head_dim": 0}),
    "d_context negative": (ValueError, ["d_context", "positive", "-1"], {"d_context": -1}),
    "dropout one": (ValueError, ["dropout", "[0, 1)", "1"], {"dropout": 1}),
    "dropout negative": (ValueError, ["dropout", "[0, 1)", "-0.5"], {"dropout": -0.5}),
    "causal unknown": (ValueError, ["causal", "'top-left'", "'yes'"], {"causal": "yes"}),
    "backend unknown": (ValueError, ["backend", "'sdpa'", "'fast'"], {"backend": "fast"}),
    "bias string": (TypeError, ["bias", "bool", "str"], {"bias": "yes"}),
    "out_bias int": (TypeError, ["out_bias", "bool", "int"], {"out_bias": 1}),
}


@pytest.mark.parametrize("case", list(CONSTRUCTOR))
def test_constructor_bad_inputs(case):
    error, words, overrides = CONSTRUCTOR[case]
    kwargs = {"d_model": 8, "heads": 2, **overrides}
    raises(error, words, lambda: qkv.SelfAttention(**kwargs))


module = qkv.SelfAttention(8, 2)
cross = qkv.SelfAttention(8, 2, d_context=3)
x = t(2, 5, 8)

FORWARD = {
    "x None": (TypeError, ["x", "torch.Tensor", "NoneType"], lambda: module(None)),
    "x rank 1": (ValueError, ["x", "2 or 3", "got 1"], lambda: module(t(8))),
    "x rank 4": (
        ValueError,
        ["x", "2 or 3", "got 4", "(1, 2, 5, 8)"],
        lambda: module(t(1, 2, 5, 8)),
    ),
    "x features": (ValueError, ["x", "d_model=8", "(2, 5, 7)"], lambda: module(t(2, 5, 7))),
    "x integer": (
        TypeError,
        ["x", "floating", "torch.int64"],
        lambda: module(t(2, 5, 8, dtype=torch.int64)),
    ),
    "x dtype": (
        TypeError,
        ["x", "torch.float32", "torch.float64"],
        lambda: module(t(2, 5, 8, dtype=torch.float64)),
    ),
    "context features": (
        ValueError,
        ["context", "d_context=3", "(2, 4, 8)"],
        lambda: cross(x, t(2, 4, 8)),
    ),
    "context rank": (ValueError, ["context", "3", "got 2"], lambda: cross(x, t(4, 3))),
    "context batch": (
        ValueError,
        ["context", "batch", "(2, 5, 8)", "(3, 4, 3)"],
        lambda: cross(x, t(3, 4, 3)),
    ),
    "context dtype": (
        TypeError,
        ["context", "torch.float32", "torch.float64"],
        lambda: cross(x, t(2, 4, 3, dtype=torch.float64)),
    ),
    "context missing": (ValueError, ["context", "required", "d_context=3"], lambda: cross(x)),
    "padding_mask shape": (
        ValueError,
        ["padding_mask", "(B, S) = (2, 5)", "(2, 4)"],
        lambda: module(x, padding_mask=t(2, 4, dtype=torch.bool)),
    ),
    "padding_mask values": (
        ValueError,
        ["padding_mask", "0 and 1"],
        lambda: module(x, padding_mask=torch.full((2, 5), 2)),
    ),
    "padding_mask list": (
        TypeError,
        ["padding_mask", "torch.Tensor", "list"],
        lambda: module(x, padding_mask=[[1] * 5] * 2),
    ),
    "mask integer": (
        TypeError,
        ["mask", "bool", "torch.int64"],
        lambda: module(x, mask=t(5, 5, dtype=torch.int64)),
    ),
    "mask integer, with padding": (
        TypeError,
        ["mask", "bool", "torch.int64"],
        lambda: module(x, mask=t(5, 5, dtype=torch.int64), padding_mask=t(2, 5) + 1),
    ),
    "mask list, with padding": (
        TypeError,
        ["mask", "torch.Tensor", "list"],
        lambda: module(x, mask=[[True]], padding_mask=t(2, 5) + 1),
    ),
    "mask shape, with padding": (
        ValueError,
        ["mask", "(3, 1, 5, 5)", "(B, heads, L, S)", "(2, 2, 5, 5)"],
        lambda: module(x, mask=t(3, 1, 5, 5, dtype=torch.bool), padding_mask=t(2, 5) + 1),
    ),
    "mask shape": (
        ValueError,
        ["mask", "(5, 4)", "(2, 2, 5, 5)"],
        lambda: module(x, mask=t(5, 4, dtype=torch.bool)),
    ),
    "causal unknown": (
        ValueError,
        ["causal", "'top-left'", "'no'"],
        lambda: module(x, causal="no"),
    ),
    "cache type": (TypeError, ["cache", "KVCache", "dict"], lambda: module(x, cache={})),
    "return_weights": (
        TypeError,
        ["return_weights", "bool", "str"],
        lambda: module(x, return_weights="yes"),
    ),
}


@pytest.mark.parametrize("case", list(FORWARD))
def test_forward_bad_inputs(case):
    error, words, call = FORWARD[case]
    raises(error, words, call)


# --- KVCache ---------------------------------------------------------------------------------


def filled_cache() -> qkv.KVCache:
    cache = qkv.KVCache()
    cache.append(t(1, 2, 3, 4), t(1, 2, 3, 5))
    return cache


CACHE = {
    "k None": (
        TypeError,
        ["k", "torch.Tensor", "NoneType"],
        lambda: qkv.KVCache().append(None, t(1, 2, 3, 4)),
    ),
    "k rank 3": (
        ValueError,
        ["k", "4", "got 3"],
        lambda: qkv.KVCache().append(t(2, 3, 4), t(2, 3, 4)),
    ),
    "v rank 5": (
        ValueError,
        ["v", "4", "got 5"],
        lambda: qkv.KVCache().append(t(1, 2, 3, 4), t(1, 1, 2, 3, 4)),
    ),
    "integer keys": (
        TypeError,
        ["k", "floating", "torch.int64"],
        lambda: qkv.KVCache().append(
            t(1, 2, 3, 4, dtype=torch.int64), t(1, 2, 3, 4, dtype=torch.int64)
        ),
    ),
    "k and v lengths": (
        ValueError,
        ["k and v", "(1, 2, 3, 4)", "(1, 2, 1, 4)"],
        lambda: qkv.KVCache().append(t(1, 2, 3, 4), t(1, 2, 1, 4)),
    ),
    "k and v batch": (
        ValueError,
        ["k and v", "(1, 2, 3, 4)", "(2, 2, 3, 4)"],
        lambda: qkv.KVCache().append(t(1, 2, 3, 4), t(2, 2, 3, 4)),
    ),
    "k and v dtypes": (
        TypeError,
        ["k, v", "torch.float32", "torch.float64"],
        lambda: qkv.KVCache().append(t(1, 2, 3, 4), t(1, 2, 3, 4, dtype=torch.float64)),
    ),
    "heads change": (
        ValueError,
        ["k", "(1, 3, 1, 4)", "does not match the cache", "(1, 2, 3, 4)"],
        lambda: filled_cache().append(t(1, 3, 1, 4), t(1, 3, 1, 5)),
    ),
    "features change": (
        ValueError,
        ["v", "(1, 2, 1, 6)", "does not match the cache", "(1, 2, 3, 5)"],
        lambda: filled_cache().append(t(1, 2, 1, 4), t(1, 2, 1, 6)),
    ),
    "dtype change": (
        TypeError,
        ["k", "torch.float32", "torch.float64"],
        lambda: filled_cache().append(
            t(1, 2, 1, 4, dtype=torch.float64), t(1, 2, 1, 5, dtype=torch.float64)
        ),
    ),
}


@pytest.mark.parametrize("case", list(CACHE))
def test_cache_bad_inputs(case):
    error, words, call = CACHE[case]
    raises(error, words, call)


def test_bad_cache_append_leaves_the_cache_unchanged():
    cache = filled_cache()
    with pytest.raises(ValueError):
        cache.append(t(1, 2, 1, 4), t(1, 2, 2, 5))
    assert len(cache) == 3 and cache.keys.shape == (1, 2, 3, 4)


# --- memory ----------------------------------------------------------------------------------


def test_reference_refuses_what_cannot_fit():
    # Lq = Lk = 2**20 with tiny tensors (expand allocates nothing): 8 heads of 2**40 scores need
    # terabytes. The call must fail at once, naming the size and the backend that can do it.
    q = torch.zeros(1, 1, 1, 8).expand(1, 8, 2**20, 8)
    with pytest.raises(Unsupported) as info:
        qkv.attention(q, q, q, backend="reference")
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "reference" in message and "GiB" in message and 'backend="flash"' in message
    assert "1×8×1048576×1048576" in message
    # "auto" needing weights (only the reference returns them) fails just as clearly.
    with pytest.raises(Unsupported, match='backend="flash"'):
        qkv.attention(q, q, q, return_weights=True)


def test_reference_memory_estimate_uses_available_memory(monkeypatch):
    q = t(2, 4, 64, 8)  # 2*4*64*64 float32 scores at 13 bytes each: 425,984 bytes
    assert qkv.attention(q, q, q, backend="reference").shape == (2, 4, 64, 8)
    monkeypatch.setattr(reference, "available_bytes", lambda device: 400_000)
    with pytest.raises(Unsupported, match=r"0\.0 GiB.*use backend=\"flash\""):
        qkv.attention(q, q, q, backend="reference")
    monkeypatch.setattr(reference, "available_bytes", lambda device: 500_000)
    assert qkv.attention(q, q, q, backend="reference").shape == (2, 4, 64, 8)
