"""qkv's mask function against transformers' own masks: a rule only where it means that mask.

Every request below goes through transformers' mask builders twice: for torch's kernel
("sdpa", its shortcuts off: the dense bool mask) and for qkv. qkv's answer is either a
``RuleMask`` whose rule means exactly the dense mask (its ``materialize()`` is compared), or
the dense mask itself; the cases qkv is expected to recognise are asserted to be rules, so a
recogniser that gave up everywhere would fail too. Then the ``RuleMask`` itself: metadata
never builds the mask, any other operation sees the dense mask, and the attention function runs
a rule as arguments only where the call's sizes are the rule's.
Legend: B batch, Lq query length, Lk key length, P cached positions.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import qkv
from qkv.integrations import huggingface, mask_rules

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed: pip install "qkv[hf]"'
)
from transformers import masking_utils  # noqa: E402  (after the skip above)

NAME = huggingface.register()
WINDOW = 4
BUILDERS = {
    "causal": masking_utils.create_causal_mask,
    "sliding": masking_utils.create_sliding_window_causal_mask,
    "bidirectional": masking_utils.create_bidirectional_mask,
    "bidirectional sliding": masking_utils.create_bidirectional_sliding_window_mask,
}


def config(implementation: str) -> Any:
    """A two-layer config (one sliding, one full layer) on ``implementation``."""
    made = transformers.Gemma3TextConfig(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )
    made._attn_implementation = implementation
    return made


def cache_with(past: int, kind: str, made: Any) -> Any:
    """None (past 0), a dynamic cache holding ``past`` positions, or a static one."""
    if past == 0:
        return None
    if kind == "static":
        cache = transformers.StaticCache(config=made, max_cache_len=16)
    else:
        cache = transformers.DynamicCache(config=made)
    states = torch.randn(2, 1, past, 8)
    for layer in range(2):
        cache.update(states, states, layer)
    return cache


def padding(side: str, past: int, length: int) -> torch.Tensor | None:
    """(B, P + L) 0/1: row 1 has 3 padding tokens on ``side``; None for no padding."""
    if side == "none":
        return None
    mask = torch.ones(2, past + length, dtype=torch.long)
    if side == "left":
        mask[1, :3] = 0
    else:
        mask[1, -3:] = 0
    return mask


def both(
    builder: str, past: int = 0, cache_kind: str = "dynamic", **request: Any
) -> tuple[Any, torch.Tensor]:
    """(qkv's mask, transformers' dense bool mask for torch's kernel) for one request."""
    skip = "allow_is_bidirectional_skip" if "bidirectional" in builder else "allow_is_causal_skip"
    masks = []
    for implementation, extra in ((NAME, {}), ("sdpa", {skip: False})):
        made = config(implementation)
        arguments = dict(request, config=made, **extra)
        if "bidirectional" not in builder:
            arguments["cache"] = cache_with(past, cache_kind, made)
        masks.append(BUILDERS[builder](**arguments))
    ours, dense = masks
    assert isinstance(dense, torch.Tensor) and dense.dtype == torch.bool
    return ours, dense


def keep(mask: Any) -> torch.Tensor:
    """True = may attend, from qkv's mask function's answer."""
    if isinstance(mask, mask_rules.RuleMask) and mask.dtype == torch.bool:
        return mask.materialize()
    if isinstance(mask, mask_rules.RuleMask):
        return mask.materialize() == 0
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
    return mask


@pytest.mark.parametrize("side", ["none", "left", "right"])
@pytest.mark.parametrize("past", [0, 3, 7])
@pytest.mark.parametrize("builder", list(BUILDERS))
def test_a_rule_means_exactly_transformers_mask(builder: str, past: int, side: str) -> None:
    length = 6
    if "bidirectional" in builder and past:
        pytest.skip("bidirectional masks are built without a cache")
    embeds = torch.zeros(2, length, 16)
    ours, dense = both(
        builder, inputs_embeds=embeds, attention_mask=padding(side, past, length), past=past
    )
    assert isinstance(ours, mask_rules.RuleMask)  # (all of these are rules qkv knows)
    assert ours.shape == dense.shape
    assert torch.equal(keep(ours), dense)


@pytest.mark.parametrize("builder", ["causal", "sliding"])
def test_sequences_packed_by_position_ids_are_documents(builder: str) -> None:
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5]]).expand(2, -1)
    embeds = torch.zeros(2, 14, 16)
    ours, dense = both(
        builder, inputs_embeds=embeds, attention_mask=None, position_ids=position_ids
    )
    assert isinstance(ours, mask_rules.RuleMask) and ours.rule.documents is not None
    assert torch.equal(keep(ours), dense)


@pytest.mark.parametrize("length", [1, 5])
@pytest.mark.parametrize("side", ["none", "left", "right"])
@pytest.mark.parametrize("past", [3, 7])
def test_a_static_caches_mask_is_the_causal_rule_over_its_valid_prefix(
    past: int, side: str, length: int
) -> None:
    """A static cache of 16 keys holding ``past``: its keys past the last query are blocked for
    every query, the causal rule holds over the first past + L; one query row's ``RuleMask``
    holds the mask's own values (transformers asks for it unskippable then)."""
    embeds = torch.zeros(2, length, 16)
    ours, dense = both(
        "causal",
        inputs_embeds=embeds,
        attention_mask=padding(side, past, length),
        past=past,
        cache_kind="static",
    )
    assert isinstance(ours, mask_rules.RuleMask)
    assert ours.rule.used == past + length and ours.rule.lk == 16
    assert ours.shape == dense.shape
    assert torch.equal(keep(ours), dense)
    if length == 1:  # (asked for unskippable: the very mask, as transformers builds it)
        assert ours.dtype == torch.bool
        assert torch.equal(~ours, ~dense) and type(~ours) is torch.Tensor
        with torch._C.DisableTorchFunctionSubclass():
            assert torch.equal(ours, dense)


@pytest.mark.parametrize(
    "request_kind", ["static and overlay", "or overlay", "and overlay", "blocks", "materialised"]
)
def test_masks_that_are_no_rule_of_qkvs_are_built(request_kind: str) -> None:
    """Overlays (also one that makes a hole in a static cache's mask), prefix-LM blocks and a
    caller that asks for the mask itself are transformers' dense mask, exactly."""
    embeds = torch.zeros(2, 5, 16)
    request: dict[str, Any] = dict(inputs_embeds=embeds, attention_mask=padding("left", 0, 5))
    if request_kind == "static and overlay":
        request.update(past=3, cache_kind="static", attention_mask=None)
        request["and_mask_function"] = lambda b, h, q, kv: kv != 1
    elif request_kind == "or overlay":
        request["or_mask_function"] = lambda b, h, q, kv: kv == 0
    elif request_kind == "and overlay":
        request["and_mask_function"] = lambda b, h, q, kv: kv != 1
    elif request_kind == "blocks":
        request["block_sequence_ids"] = torch.tensor([[0, 0, 0, -1, -1]]).expand(2, -1)
    else:
        request["allow_is_causal_skip"] = False
    ours, dense = both("causal", **request)
    assert not isinstance(ours, mask_rules.RuleMask)
    assert torch.equal(keep(ours), dense)


@pytest.mark.parametrize(
    "change",
    ["kv_offset", "float offset", "sliding window", "past the cache", "offset per row", "none"],
)
def test_a_static_prefix_needs_transformers_plain_causal_request(change: str) -> None:
    """Requests like a static cache's that mean another mask are no rule: keys offset, a
    window (which a prefix does not express), queries past the cache, an offset that is not
    one integer."""
    request: dict[str, Any] = dict(
        batch_size=1,
        q_length=1,
        kv_length=16,
        q_offset=torch.tensor(6),
        kv_offset=0,
        mask_function=masking_utils.causal_mask_function,
        attention_mask=None,
        allow_is_causal_skip=False,
    )
    if change == "kv_offset":
        request["kv_offset"] = 2
    elif change == "float offset":
        request["q_offset"] = torch.tensor(6.0)
    elif change == "sliding window":
        request["mask_function"] = masking_utils.sliding_window_causal_mask_function(4)
    elif change == "past the cache":
        request["q_offset"] = torch.tensor(16)
    elif change == "offset per row":
        request["q_offset"] = torch.tensor([6, 6])
    rule = mask_rules.rule_of(request)
    if change == "none":
        assert rule is not None and rule.used == 7 and rule.causal and rule.window is None
        return
    assert rule is None


def rule_mask(lq: int = 3, lk: int = 5) -> mask_rules.RuleMask:
    keys = torch.tensor([[True] * lk, [False] + [True] * (lk - 1)])  # (B, Lk)
    rule = mask_rules.Rule(True, (1, 0), None, keys, 2, lq, lk)
    return mask_rules.RuleMask(rule, torch.float32, torch.device("cpu"))


def test_metadata_never_builds_the_mask_and_any_operation_sees_it_dense() -> None:
    mask = rule_mask()
    assert mask.shape == (2, 1, 3, 5) and mask.dtype == torch.float32 and mask.ndim == 4
    assert mask.size(-1) == 5 and mask.dim() == 4 and mask.device.type == "cpu"
    assert mask.detach() is mask and mask._dense is None
    keys = torch.tensor([True, True, True, True, True, False, True, True, True, True])
    allowed = qkv.sliding_window_mask(3, 5, window=2) & keys.view(2, 1, 1, 5)
    expected = torch.where(allowed, 0.0, float("-inf"))  # (B, 1, Lq, Lk)
    extra = torch.zeros(2, 1, 3, 2)
    for derived, reference in [
        (torch.cat([mask, extra], dim=-1), torch.cat([expected, extra], dim=-1)),
        (mask[:, :, :, :4], expected[..., :4]),
        (mask + 1.0, expected + 1.0),
        (mask.to(torch.float64), expected.double()),
        (torch.nn.functional.pad(mask, (0, 1)), torch.nn.functional.pad(expected, (0, 1))),
    ]:
        assert type(derived) is torch.Tensor
        torch.testing.assert_close(derived, reference)


def test_a_rule_runs_as_arguments_only_at_its_own_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return qkv.attention(*args, **kwargs)

    monkeypatch.setattr(huggingface, "attention", recording)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 3, 4, generator=generator)
    k, v = (torch.randn(2, 1, 5, 4, generator=generator) for _ in range(2))
    mask = rule_mask()
    layer = torch.nn.Module()
    out, _ = huggingface.attention_forward(layer, q, k, v, mask)
    assert calls[-1]["causal"] is True and calls[-1]["window"] == (1, 0)
    assert calls[-1]["mask"].shape == (2, 1, 1, 5)  # the key padding alone
    dense = qkv.attention(q, k, v, mask=mask.materialize()).transpose(1, 2)
    torch.testing.assert_close(out, dense)
    # Keys of another length than the rule's: the dense mask, as eager would add it.
    with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 3, 5\)"):
        huggingface.attention_forward(layer, q, k[..., :4, :], v[..., :4, :], mask)
    assert calls[-1]["causal"] is False and calls[-1]["mask"].shape == (2, 1, 3, 5)


def test_a_models_mask_combined_with_its_own_bias_stays_the_eager_mask() -> None:
    """A model that adds a bias to its mask before attention (as eager models do) gets the
    rule's dense additive mask plus the bias: the same numbers as eager."""
    mask = rule_mask()
    bias = torch.randn(2, 1, 3, 5)
    torch.testing.assert_close(mask + bias, mask.materialize() + bias)
    assert torch.isinf(mask.materialize()).any()  # (the rule does block keys)
