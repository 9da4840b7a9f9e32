"""Padded batches of causal models under attn_implementation="qkv": key padding, no (Lq, Lk) mask.

A padded prefill's mask is the layer's causal rule (and window) with padded keys blocked. qkv's
mask function builds only the (B, 1, 1, Lk) key padding; the attention function applies the
causal rule and window itself. Left and right padding equal eager (1e-5, float32) on the real
tokens; a static cache's prefill (queries not the last of its keys) keeps its full mask.
``test_huggingface_families.py`` checks generation with dynamic and static caches.
Legend: B batch, Lq query length, Lk key length.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.integrations import huggingface

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed: pip install "qkv[hf]"'
)

from test_huggingface_families import (  # noqa: E402  (after the skip above)
    ATOL,
    compare_attentions,
    model_pair,
    padded_batch,
    spy,
)

CAUSAL = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "gpt_oss",
    "granite_swa",
    "vaultgemma",
    "phi3",
    "gpt2",
]


def batch(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, 9) token ids and 0/1 mask, 1 and 3 padding tokens on the given side."""
    input_ids, attention_mask = padded_batch()
    if side == "right":
        attention_mask = attention_mask.flip(-1)
        input_ids = torch.where(attention_mask.bool(), input_ids.flip(-1), 0)
    return input_ids, attention_mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", CAUSAL)
def test_padded_prefill_passes_key_padding_and_matches_eager(
    name: str, side: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager, ours = model_pair(name)
    input_ids, attention_mask = batch(side)
    run = dict(input_ids=input_ids, attention_mask=attention_mask)
    with torch.no_grad():
        expected = eager(**run, output_attentions=True)
        calls = spy(monkeypatch)
        got = ours(**run, output_attentions=True)
        fast = ours(**run)
    assert calls
    for call in calls:
        assert call["mask"].shape == (3, 1, 1, 9) and call["causal"]
        assert torch.equal(call["mask"][:, 0, 0], attention_mask.bool())
    real = attention_mask.bool()
    for result in (got, fast):
        torch.testing.assert_close(result.logits[real], expected.logits[real], atol=ATOL, rtol=ATOL)
    sinks_apart = name in ("granite_swa",)  # (its eager weights leave the sink out)
    compare_attentions(got.attentions, expected.attentions, real, sinks_apart)


class _Layer(torch.nn.Module):
    def __init__(self, is_causal: bool) -> None:
        super().__init__()
        self.is_causal = is_causal


@pytest.mark.parametrize("is_causal", [True, False])
def test_a_mask_qkv_did_not_describe_means_what_it_means_to_eager(is_causal: bool) -> None:
    """A (B, 1, 1, Lk) mask a model built itself (not qkv's mask function's rule) is key
    padding alone, as eager adds it: the layer's causal rule and window are not added to it."""
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(2, 2, 3, 4, generator=generator)
    k, v = (torch.randn(2, 2, 5, 4, generator=generator) for _ in range(2))
    keys = torch.ones(2, 5, dtype=torch.bool)
    keys[1, 3] = False
    padding = keys[:, None, None, :]  # (B, 1, 1, Lk)
    out, _ = huggingface.attention_forward(_Layer(is_causal), q, k, v, padding, sliding_window=2)
    torch.testing.assert_close(out, qkv.attention(q, k, v, mask=padding).transpose(1, 2))


def test_a_static_caches_prefill_reads_its_valid_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    _, ours = model_pair("llama")
    input_ids, attention_mask = padded_batch()
    calls = spy(monkeypatch)
    ours.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=3,  # (the cache holds 11 keys; prefill 9 queries)
        do_sample=False,
        cache_implementation="static",
    )
    # The cache's valid prefix: the 9 prompt keys under the causal rule, with the padding.
    prefill = calls[0]["mask"]
    assert prefill.shape == (3, 1, 1, 9) and calls[0]["causal"] is True
