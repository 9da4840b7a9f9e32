"""Sequences packed by position ids under attn_implementation="qkv": no (L, L) mask.

transformers' flattening collator (``return_position_ids=True``) packs documents into one row
whose positions restart at each document, with no attention mask. Without a cache transformers
builds a dense block-causal mask for that; qkv builds none and passes the documents as
``segments=``. The outputs equal eager's (1e-5, float32) and each document's run alone. With a
cache (or where a model does not hand its position ids to the mask), transformers reads the row
as one sequence, and so does qkv.
Legend: B batch, L length.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import qkv
from qkv.integrations import huggingface

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed: pip install "qkv[hf]"'
)

from test_huggingface_families import (  # noqa: E402  (after the skip above)
    ATOL,
    VOCAB,
    compare_attentions,
    model_pair,
    spy,
)

LENGTHS = (4, 6, 5)  # documents longer than the sliding families' window of 4
PACKING = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "gpt2",
    "granite_swa",
    "vaultgemma",
]


def packed_batch(lengths: tuple[int, ...] = LENGTHS) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, L) token ids of documents side by side, and their (1, L) restarting positions."""
    generator = torch.Generator().manual_seed(4)
    input_ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=generator)
    return input_ids, torch.cat([torch.arange(n) for n in lengths])[None]


def documents(lengths: tuple[int, ...] = LENGTHS) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]


def dense_masks(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every mask transformers' sdpa_mask builds for qkv's mask function."""
    from transformers import masking_utils

    built: list[Any] = []
    original = masking_utils.sdpa_mask

    def recording(*args: Any, **kwargs: Any) -> Any:
        built.append(original(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(masking_utils, "sdpa_mask", recording)
    return built


@pytest.mark.parametrize("name", PACKING)
def test_position_id_packing_builds_no_mask_and_matches_eager(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager, ours = model_pair(name)
    input_ids, position_ids = packed_batch()
    run = dict(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    with torch.no_grad():
        expected = eager(**run, output_attentions=True)
        built, calls = dense_masks(monkeypatch), spy(monkeypatch)
        got = ours(**run, output_attentions=True)
        fast = ours(**run)
    assert built == [] and calls
    for call in calls:
        assert call["mask"] is None and call["causal"]
        assert torch.equal(call["segments"], documents())
    for result in (got, fast):
        torch.testing.assert_close(result.logits, expected.logits, atol=ATOL, rtol=ATOL)
    sinks_apart = name == "granite_swa"  # (its eager weights leave the sink out: see there)
    compare_attentions(got.attentions, expected.attentions, None, sinks_apart)
    # Eager's mask really is per document: the row read as one sequence differs.
    with torch.no_grad():
        one_sequence = eager(input_ids=input_ids, use_cache=False).logits
    assert not torch.allclose(one_sequence, expected.logits, atol=1e-3)


def test_packed_rows_match_each_document_alone() -> None:
    """Two rows packed differently (B = 2); windows of 4 in documents of up to 7 tokens."""
    _, ours = model_pair("mistral")
    rows = [(4, 7, 4), (3, 3, 9)]
    input_ids = torch.cat([packed_batch(lengths)[0] for lengths in rows])
    position_ids = torch.cat([packed_batch(lengths)[1] for lengths in rows])
    with torch.no_grad():
        packed = ours(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        for row, lengths in enumerate(rows):
            starts = torch.tensor((0, *lengths)).cumsum(0).tolist()
            for start, end in itertools.pairwise(starts):
                alone = ours(input_ids=input_ids[row : row + 1, start:end]).logits[0]
                torch.testing.assert_close(packed[row, start:end], alone, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize(("name", "use_cache"), [("llama", True), ("gpt_oss", False)])
def test_rows_transformers_reads_as_one_sequence_stay_one(
    name: str, use_cache: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a cache, transformers looks for no packing; gpt_oss never hands its position ids to
    the mask. Eager attends across the documents there; qkv too (no segments), also after a
    packed forward of the same model."""
    eager, ours = model_pair(name)
    input_ids, position_ids = packed_batch()
    with torch.no_grad():
        ours(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        expected = eager(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache)
        calls = spy(monkeypatch)
        got = ours(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache)
    torch.testing.assert_close(got.logits, expected.logits, atol=ATOL, rtol=ATOL)
    assert calls and all(call["mask"] is None and "segments" not in call for call in calls)


def test_a_mask_with_other_overlays_is_built() -> None:
    """Packing combined with another mask function is not recognised: the mask is built."""
    from transformers.masking_utils import create_causal_mask

    _, ours = model_pair("llama")
    _, position_ids = packed_batch()
    length = position_ids.shape[-1]
    mask = create_causal_mask(
        config=ours.config,
        inputs_embeds=torch.zeros(1, length, 32),
        attention_mask=None,
        cache=None,
        position_ids=position_ids,
        and_mask_function=lambda batch, head, q, kv: kv >= 0,  # (allows every key)
    )
    ids = documents()[0]
    expected = (ids[:, None] == ids[None, :]) & qkv.causal_mask(length, length)
    assert mask is not None and torch.equal(mask, expected[None, None])


class _Layer(torch.nn.Module):
    is_causal = True


def test_a_call_given_no_mask_is_the_layers_causal_rule_whatever_its_positions() -> None:
    """No mask from transformers' mask function (a model that passes none): the layer's causal
    rule, as transformers' sdpa path applies it; restarting position ids are not read as
    documents there (eager would not read them either)."""
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 15, 4, generator=generator) for _ in range(3))
    _, position_ids = packed_batch()
    out, _ = huggingface.attention_forward(_Layer(), q, k, v, None, position_ids=position_ids)
    torch.testing.assert_close(out, qkv.attention(q, k, v, causal=True).transpose(1, 2))


@pytest.mark.parametrize("name", ["llama", "gemma2", "mistral"])
def test_a_training_step_on_the_flattening_collators_batch_matches_eager(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' DataCollatorWithFlattening(return_position_ids=True): the loss and every
    parameter's gradient equal eager's, with no mask built."""
    eager, ours = model_pair(name)
    collator = transformers.DataCollatorWithFlattening(
        return_position_ids=True, return_tensors="pt"
    )
    input_ids, _ = packed_batch()
    starts = torch.tensor((0, *LENGTHS)).cumsum(0).tolist()
    features = [{"input_ids": input_ids[0, a:b].tolist()} for a, b in itertools.pairwise(starts)]
    batch = collator(features)
    assert "attention_mask" not in batch and torch.equal(batch["position_ids"], packed_batch()[1])
    losses, built = [], []
    for model in (eager, ours):
        if model is ours:
            built = dense_masks(monkeypatch)
        model.train()
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        losses.append(loss.detach())
    assert built == []
    torch.testing.assert_close(losses[1], losses[0], atol=ATOL, rtol=ATOL)
    for (param_name, theirs), ours_param in zip(eager.named_parameters(), ours.parameters()):
        assert theirs.grad is not None and ours_param.grad is not None, param_name
        torch.testing.assert_close(ours_param.grad, theirs.grad, atol=ATOL, rtol=ATOL)
