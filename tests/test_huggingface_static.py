"""transformers' static cache on qkv: the attention function gets the whole preallocated cache
and a mask; qkv recognises the causal rule over the cache's valid prefix and hands the kernel
only those keys (a view of the cache), else runs the dense path.

Tiny random Llama, float32, no network: the recognised call equals the dense path, greedy tokens
and logits equal sdpa's (with padding too), each step reads past + 1 keys of the cache, and a
mask with a hole runs the dense path over the whole cache. Then ``qkv bench --generate`` at a
tiny size.
Legend: B batch, Lq queries, Lk keys (the cache's length), P tokens held.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from oracle import TOLERANCE

import qkv
from qkv.integrations import huggingface, mask_rules

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed: pip install "qkv[hf]"'
)
from transformers import masking_utils  # noqa: E402  (after the skip above)

NAME = huggingface.register()
ATOL, RTOL = TOLERANCE[torch.float32]


def _model() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Per qkv.attention call of the integration: its keyword arguments, the keys' length and
    the length of the buffer they are a view of (their head stride over D)."""
    calls: list[dict[str, Any]] = []

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
        calls.append({**kwargs, "keys": k.shape[-2], "buffer": k.stride(-3) // k.stride(-2)})
        return qkv.attention(q, k, v, **kwargs)

    monkeypatch.setattr(huggingface, "attention", recording)
    return calls


@pytest.mark.parametrize("padded", [False, True])
def test_static_generation_reads_the_valid_prefix_and_matches_sdpa(
    monkeypatch: pytest.MonkeyPatch, padded: bool
) -> None:
    model = _model()
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :2] = 0  # row 1: two tokens of left padding
    options = dict(
        attention_mask=mask,
        max_new_tokens=5,
        do_sample=False,
        cache_implementation="static",
        disable_compile=True,
        return_dict_in_generate=True,
        output_logits=True,
    )
    outputs = {}
    for name in ("sdpa", NAME):
        model.set_attn_implementation(name)
        calls = _spy(monkeypatch) if name == NAME else []
        with torch.no_grad():
            outputs[name] = model.generate(ids, **options)
    assert torch.equal(outputs[NAME].sequences, outputs["sdpa"].sequences)
    for got, expected in zip(outputs[NAME].logits, outputs["sdpa"].logits, strict=True):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    # The cache holds 6 + 5 - 1 = 10 positions (the last token is never fed back); step t (of 4
    # after the prompt) reads 7 + t of them, as a view of the cache, under the causal rule (with
    # the padding as key padding).
    decoding = calls[2:]
    assert [call["keys"] for call in decoding] == [7, 7, 8, 8, 9, 9, 10, 10]
    assert all(call["buffer"] == 10 and call["causal"] is True for call in decoding)
    assert all((call["mask"] is not None) == padded for call in calls)


@pytest.mark.parametrize(("past", "length"), [(3, 1), (7, 1), (4, 5)])
def test_the_recognised_call_equals_the_dense_path(
    monkeypatch: pytest.MonkeyPatch, past: int, length: int
) -> None:
    """The attention function on a static cache's ``RuleMask`` (16 keys, P held, left padding
    in row 1) against the same call on its dense mask: the first P + Lq keys only, one
    result."""
    config = _model().config
    config._attn_implementation = NAME
    cache = transformers.StaticCache(config=config, max_cache_len=16)
    generator = torch.Generator().manual_seed(2)
    for layer in range(2):
        cache.update(
            torch.randn(2, 2, past, 16, generator=generator), torch.zeros(2, 2, past, 16), layer
        )
    padding = torch.ones(2, past + length, dtype=torch.long)
    padding[1, :2] = 0
    mask = masking_utils.create_causal_mask(
        config=config, inputs_embeds=torch.zeros(2, length, 64), attention_mask=padding, cache=cache
    )
    assert isinstance(mask, mask_rules.RuleMask) and mask.rule.used == past + length
    q = torch.randn(2, 4, length, 16, generator=generator)
    k, v = (torch.randn(2, 2, 16, 16, generator=generator) for _ in range(2))
    calls = _spy(monkeypatch)
    layer = torch.nn.Module()
    out, _ = huggingface.attention_forward(layer, q, k, v, mask)
    dense, _ = huggingface.attention_forward(layer, q, k, v, mask.materialize())
    assert calls[0]["keys"] == past + length and calls[0]["causal"] is True
    assert calls[1]["keys"] == 16 and calls[1]["mask"] is not None
    torch.testing.assert_close(out, dense, atol=ATOL, rtol=RTOL)


def test_a_mask_with_a_hole_runs_the_dense_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A static cache's causal mask with one key taken out is no rule: the whole cache and
    transformers' own mask go to qkv.attention, and the result is torch's on that mask."""
    config = _model().config
    config._attn_implementation = NAME
    cache = transformers.StaticCache(config=config, max_cache_len=16)
    for layer in range(2):
        cache.update(torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16), layer)
    mask = masking_utils.create_causal_mask(
        config=config,
        inputs_embeds=torch.zeros(1, 1, 64),
        attention_mask=None,
        cache=cache,
        and_mask_function=lambda b, h, q, kv: kv != 1,
    )
    assert type(mask) is torch.Tensor and mask.dtype == torch.bool
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 1, 16, generator=generator)
    k, v = (torch.randn(1, 2, 16, 16, generator=generator) for _ in range(2))
    calls = _spy(monkeypatch)
    out, _ = huggingface.attention_forward(torch.nn.Module(), q, k, v, mask)
    assert calls[0]["keys"] == 16 and calls[0]["mask"] is mask
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask
    )
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=ATOL, rtol=RTOL)


def test_the_generate_benchmark_runs_and_agrees() -> None:
    """``qkv bench --generate`` at a tiny size: every run times its steps, the tokens agree."""
    from qkv.bench import generate

    result = generate.generate_benchmark(prompt=8, new_tokens=3, repeats=1)
    assert result["same_tokens"] == {"dynamic": True, "static": True}
    assert set(result["ms_per_token"]) == {
        "qkv dynamic",
        "sdpa dynamic",
        "qkv static",
        "sdpa static",
    }
    assert all(ms > 0 for ms in result["ms_per_token"].values())
    assert all(ms > 0 for ms in result["attention_ms_per_token"].values())
    # without its attention's time, qkv's step can only be shorter: the ceiling is above the ratio
    assert all(result["ceiling"][c] > result["speedup"][c] for c in ("dynamic", "static"))
    # reading the cache takes time: the wall ceiling is below the ceiling of an attention of 0 ms
    assert all(result["wall_ceiling"][c] < result["ceiling"][c] for c in ("dynamic", "static"))
    assert all(ms > 0 for ms in result["reading_attention_ms_per_token"].values())
    assert "same tokens: yes" in generate.format_generate(result)


def test_the_generate_ceiling_is_sdpa_over_qkv_without_its_attention() -> None:
    """The ceiling reads sdpa's step over qkv's step less its attention; where the attention's
    own median is not below the step's there is no reading (None, printed as n/a)."""
    from qkv.bench.generate import _ceiling, _times

    ms = {"qkv dynamic": 10.0, "sdpa dynamic": 15.0}
    assert _ceiling(ms, {"qkv dynamic": 4.0}, "dynamic") == pytest.approx(2.5)
    assert _ceiling(ms, {"qkv dynamic": 10.0}, "dynamic") is None
    assert (_times(2.5), _times(None)) == ("2.50x", "n/a")
    # an attention that takes 1.5 ms (reading its cache at the read rate) in place of qkv's 4
    assert _ceiling(ms, {"qkv dynamic": 4.0}, "dynamic", 1.5) == pytest.approx(2.0)


def test_a_reading_kernel_reads_what_the_kernel_is_handed_and_gives_zeros(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wall ceiling's kernel: qkv's decoding step with flash's decoding kernel replaced by
    sums over its keys and values; the kernel is back afterwards."""
    from qkv.backends import dispatch
    from qkv.backends.flash import kernel
    from qkv.bench.generate import reading_kernel

    if kernel.load() is None:
        pytest.skip("flash's compiled kernel is not available")
    q, k, v = torch.randn(1, 8, 1, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 12)
    read: list[int] = []
    summed = torch.Tensor.sum

    def spy(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        read.append(x.data_ptr())
        return summed(x, *args, **kwargs)

    with reading_kernel():
        monkeypatch.setattr(torch.Tensor, "sum", spy)
        out = dispatch.plain_decoding(q, k, v, True, None, "auto")
        monkeypatch.undo()
    assert out is not None and out.shape == (1, 8, 1, 12) and not out.any()
    assert read == [k.data_ptr(), v.data_ptr()]
    after = dispatch.plain_decoding(q, k, v, True, None, "auto")
    assert after is not None and after.abs().sum() > 0  # (the kernel again)
