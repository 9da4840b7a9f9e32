"""softcap, sinks and window in ``qkv.SelfAttention``, ``qkv.trace`` and ``qkv explain``; what
``"auto"`` picks for them; dropout with them. Legend: B batch, H heads, L length, E width."""

from __future__ import annotations

import io
import math

import pytest
import torch

import qkv
from qkv import explain
from qkv.backends import dispatch
from qkv.canonical import canonical_call

f64 = torch.float64


def layer() -> qkv.SelfAttention:
    torch.manual_seed(0)
    attention = qkv.SelfAttention(16, heads=2, causal=True, softcap=2.0, sinks=True, window=3)
    attention = attention.double().eval()
    with torch.no_grad():
        attention.sinks.copy_(torch.tensor([0.5, -1.0], dtype=f64))
    return attention


def test_self_attention_passes_softcap_sinks_and_window_to_attention() -> None:
    attention = layer()
    x = torch.randn(2, 6, 16, dtype=f64)
    out = attention(x)
    q, k, v = attention.qkv_proj(x).view(2, 6, 6, 8).transpose(1, 2).split(2, dim=1)
    expected = qkv.attention(
        q, k, v, causal=True, softcap=2.0, sinks=attention.sinks, window=3
    )  # (B, H, L, D)
    expected = attention.out_proj(expected.transpose(1, 2).reshape(2, 6, 16))
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    out.sum().backward()
    assert attention.sinks.grad is not None and attention.sinks.grad.abs().sum() > 0
    assert "sinks" in attention.state_dict()
    assert "softcap=2.0, sinks=True, window=3" in repr(attention)


def test_self_attention_alibi_uses_the_papers_slopes() -> None:
    torch.manual_seed(0)
    attention = qkv.SelfAttention(16, heads=4, causal=True, alibi=True).double()
    assert attention.alibi_slopes.tolist() == [2**-2, 2**-4, 2**-6, 2**-8]
    assert "alibi_slopes" in attention.state_dict() and "alibi=True" in repr(attention)
    x = torch.randn(1, 5, 16, dtype=f64)
    q, k, v = attention.qkv_proj(x).view(1, 5, 12, 4).transpose(1, 2).split(4, dim=1)
    expected = qkv.attention(q, k, v, causal=True, alibi_slopes=attention.alibi_slopes)
    expected = attention.out_proj(expected.transpose(1, 2).reshape(1, 5, 16))
    torch.testing.assert_close(attention(x), expected, atol=1e-12, rtol=1e-12)


def test_self_attention_checks_the_new_arguments() -> None:
    with pytest.raises(ValueError, match=r"window=4 .* needs causal=True"):
        qkv.SelfAttention(16, heads=2, window=4)
    with pytest.raises(ValueError, match="softcap must be > 0"):
        qkv.SelfAttention(16, heads=2, softcap=-1.0)
    with pytest.raises(TypeError, match="sinks must be a bool"):
        qkv.SelfAttention(16, heads=2, sinks=1)
    with pytest.raises(TypeError, match="alibi must be a bool"):
        qkv.SelfAttention(16, heads=2, alibi="yes")


def test_cached_decoding_with_sinks_softcap_and_window_equals_one_pass() -> None:
    attention = layer()
    x = torch.randn(1, 7, 16, dtype=f64)
    cache = qkv.KVCache()
    steps = [attention(x[:, i : i + 1], cache=cache) for i in range(7)]
    torch.testing.assert_close(torch.cat(steps, dim=1), attention(x), atol=1e-12, rtol=1e-12)


def test_trace_records_softcap_sinks_window_and_their_scores_mask_and_weights() -> None:
    attention = layer()
    x = torch.randn(1, 6, 16, dtype=f64)
    with qkv.trace(attention) as trace:
        attention(x)
    (record,) = trace
    assert record.softcap == 2.0 and record.sinks.tolist() == [0.5, -1.0]
    assert torch.equal(record.mask.reshape(6, 6), qkv.sliding_window_mask(6, window=3))
    raw = record.q @ record.k.transpose(-2, -1) / math.sqrt(8)
    torch.testing.assert_close(record.scores, 2.0 * torch.tanh(raw / 2.0))
    keep = record.mask
    scores = torch.cat(
        [
            record.scores.masked_fill(~keep, -math.inf),
            record.sinks.view(1, 2, 1, 1).expand(1, 2, 6, 1),
        ],
        dim=-1,
    )
    torch.testing.assert_close(record.weights, torch.softmax(scores, -1)[..., :6])


def test_explain_shows_soft_capping_and_the_sink() -> None:
    rich = pytest.importorskip("rich.console")
    attention = layer().float()
    tokens = explain.toy_tokens("The cat sat on the mat .")
    x = explain.toy_embeddings(tokens)[None].float()
    with torch.no_grad(), qkv.trace(attention) as trace:
        attention(x)
    trace.tokens = tokens
    run = explain.ModelRun("toy", tokens, [False] * 7, trace, 1, 2, "The cat sat on the mat .")
    walk = explain.walkthrough(run, layer=0, head=0, token="sat")
    assert walk.softcap == 2.0 and walk.sink == 0.5
    console = rich.Console(file=io.StringIO(), width=120)
    explain.render(walk, run, console)
    printed = console.file.getvalue()
    assert "Soft-capped: score = 2 · tanh(score / 2)" in printed
    sink_weight = 1 - float(walk.weights.sum())
    assert "Sink: this head's sink, a key of logit 0.5000" in printed
    assert f"takes weight {sink_weight:.6f}" in printed and sink_weight > 0


def call_of(**kwargs: object) -> object:
    q = torch.randn(1, 2, 300, 8)
    plain = dict(mask=None, scale=None, dropout_p=0.0, return_weights=False, backend="auto")
    call, _ = canonical_call(q, q, q, **{**plain, **kwargs})
    return call


def test_auto_picks_flash_for_windows_and_segments() -> None:
    """flash skips the tiles a window or segments block; torch's kernel would need them as a
    dense (Lq, Lk) mask."""
    assert dispatch.choose(call_of(causal=True, window=64)) == "flash"
    assert dispatch.choose(call_of(causal=False, segments=torch.arange(300) // 50)) == "flash"
    assert dispatch.choose(call_of(causal=True, softcap=30.0)) == "flash"  # sdpa cannot cap


def test_dropout_with_sinks_and_softcap_runs_on_the_reference() -> None:
    q = torch.randn(1, 2, 5, 4, dtype=f64)
    sinks = torch.tensor([0.3, -0.2], dtype=f64)
    torch.manual_seed(1)
    out = qkv.attention(q, q, q, sinks=sinks, softcap=1.0, dropout_p=0.5)
    torch.manual_seed(1)
    expected = qkv.attention(q, q, q, sinks=sinks, softcap=1.0, dropout_p=0.5, backend="reference")
    torch.testing.assert_close(out, expected)
    plain = qkv.attention(q, q, q, sinks=sinks, softcap=1.0)
    assert not torch.allclose(out, plain)
