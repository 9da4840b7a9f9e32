"""transformers' continuous batching (``generate_batch``, the continuous batching manager) on qkv.

Small random models, float32, no network. qkv against transformers' own continuous batching
("sdpa", which masks each step with a dense (T, S) mask) gives the same greedy tokens and the
same log-probabilities of each token; with prompts chunked (``max_batch_tokens`` below the
longest prompt), so that a step holds prefill chunks whose queries are the last of their keys
beside one-token decodes. A sliding-window model (every layer sliding) runs too, and Gemma 2
(softcap) and gpt-oss (sinks), sliding and full layers, against ordinary greedy generation on
"eager". One packed step is checked
against a float64 oracle per request, and shown to differ from the top-left alignment.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from qkv.integrations import hf_paged, huggingface

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed: pip install "qkv[hf]"'
)
NAME = huggingface.register()
VOCAB = 96
PROMPTS = (3, 17, 5, 40, 9, 25, 1, 12)  # prompt lengths, one request each
LOGPROB_ATOL = 1e-4
logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)


def _config(**overrides: Any) -> dict[str, Any]:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        head_dim=16,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return {**base, **overrides}


def _model(model_class: Any, config: Any) -> Any:
    torch.manual_seed(0)
    return model_class(config).eval()


def _prompts(lengths: tuple[int, ...] = PROMPTS) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _batching(max_batch_tokens: int = 256) -> Any:
    return transformers.ContinuousBatchingConfig(
        page_size=16, num_blocks=64, max_batch_tokens=max_batch_tokens, return_logprobs=True
    )


def _generation(new_tokens: int = 12) -> Any:
    return transformers.GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )


def _generate_batch(
    model: Any, implementation: str, prompts: list[list[int]], max_batch_tokens: int = 256
) -> dict[str, Any]:
    model.set_attn_implementation(implementation)
    outputs = model.generate_batch(
        prompts,
        generation_config=_generation(),
        continuous_batching_config=_batching(max_batch_tokens),
        progress_bar=False,
    )
    assert model.config._attn_implementation == implementation  # kept, not switched
    assert len(outputs) == len(prompts)
    for output in outputs.values():
        assert output.error is None, output.error
    return dict(outputs)


def assert_same_generation(
    ours: dict[str, Any], theirs: dict[str, Any], atol: float = LOGPROB_ATOL
) -> None:
    """Same tokens and, token by token, the same log-probabilities (float32 tolerance)."""
    assert ours.keys() == theirs.keys()
    for request_id in ours:
        assert ours[request_id].generated_tokens == theirs[request_id].generated_tokens, request_id
        torch.testing.assert_close(
            torch.tensor(ours[request_id].logprobs),
            torch.tensor(theirs[request_id].logprobs),
            atol=atol,
            rtol=0,
        )


@pytest.mark.parametrize(
    ("max_batch_tokens", "dtype"),
    [(256, torch.float32), (16, torch.float32), (16, torch.float16)],
    ids=["whole-prompts", "chunked", "chunked-float16"],
)
def test_generate_batch_matches_sdpa(max_batch_tokens: int, dtype: torch.dtype) -> None:
    config = transformers.LlamaConfig(**_config())
    model = _model(transformers.LlamaForCausalLM, config).to(dtype)
    prompts = _prompts()
    theirs = _generate_batch(model, "sdpa", prompts, max_batch_tokens)
    ours = _generate_batch(model, NAME, prompts, max_batch_tokens)
    atol = LOGPROB_ATOL if dtype == torch.float32 else 2e-3  # float16: its rounding, twice
    assert_same_generation(ours, theirs, atol)
    assert all(len(output.generated_tokens) == 12 for output in ours.values())


def test_sliding_window_model_matches_sdpa() -> None:
    """Every layer slides over 6 keys (prompts up to 40 tokens, chunked by 16): the cache keeps
    each request's last 5 tokens, and chunks must still be windowed per query."""
    config = transformers.MistralConfig(**_config(sliding_window=6))
    model = _model(transformers.MistralForCausalLM, config)
    prompts = _prompts()
    theirs = _generate_batch(model, "sdpa", prompts, max_batch_tokens=16)
    ours = _generate_batch(model, NAME, prompts, max_batch_tokens=16)
    assert_same_generation(ours, theirs)


def _gemma2() -> Any:
    config = transformers.Gemma2Config(
        **_config(sliding_window=5, attn_logit_softcapping=1.0, initializer_range=0.3)
    )
    return _model(transformers.Gemma2ForCausalLM, config)


def _gpt_oss() -> Any:
    config = transformers.GptOssConfig(
        **_config(sliding_window=5, num_local_experts=4, num_experts_per_tok=2),
        initializer_range=0.3,
    )
    model = _model(transformers.GptOssForCausalLM, config)
    with torch.no_grad():  # sinks that matter (they start at 0)
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(2))
    return model


@pytest.mark.parametrize("make", [_gemma2, _gpt_oss], ids=["gemma2-softcap", "gpt_oss-sinks"])
def test_sliding_and_full_layers_match_greedy_generation(make: Any) -> None:
    """Gemma 2 (scores soft-capped) and gpt-oss (a sink per head): sliding (window 5) and full
    layers, weights large enough for the cap and sinks to matter; each request generated alone
    with transformers' ordinary greedy loop on "eager" is the truth, tokens and
    log-probabilities (transformers' paged eager drops the softcap; its sdpa takes neither)."""
    model = make()
    assert list(model.config.layer_types) == ["sliding_attention", "full_attention"]
    prompts = _prompts((3, 11, 7, 16))
    ours = _generate_batch(model, NAME, prompts, max_batch_tokens=8)
    model.set_attn_implementation("eager")
    for output, prompt in zip(ours.values(), prompts, strict=True):
        alone = model.generate(
            torch.tensor([prompt]),
            generation_config=_generation(),
            return_dict_in_generate=True,
            output_logits=True,
        )
        tokens = alone.sequences[0, len(prompt) :]
        assert output.generated_tokens == tokens.tolist()
        logits = torch.cat(alone.logits).log_softmax(-1)  # (new tokens, vocab)
        logprobs = logits.gather(-1, tokens[:, None])[:, 0]
        torch.testing.assert_close(
            torch.tensor(output.logprobs), logprobs, atol=LOGPROB_ATOL, rtol=0
        )


def test_continuous_batching_manager_runs_on_qkv() -> None:
    model = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**_config()))
    prompts = _prompts()
    theirs = _generate_batch(model, "sdpa", prompts)
    model.set_attn_implementation(NAME)
    manager = model.init_continuous_batching(
        generation_config=_generation(), continuous_batching_config=_batching()
    )
    manager.start()
    try:
        ids = [manager.add_request(p, request_id=f"req_{i}") for i, p in enumerate(prompts)]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=60)
            assert result is not None, "the manager stopped before every request finished"
            results[result.request_id] = result
    finally:
        manager.stop(block=True)
    assert model.config._attn_implementation == NAME
    assert_same_generation(results, theirs)


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer_idx = 0


# (query tokens, keys) per request: a prefill, a decode, a chunk after 4 cached tokens, a
# request with no query this step (cu_seq_lens plateau), a decode against one key.
STEP = ((5, 5), (1, 9), (3, 7), (0, 0), (1, 1))


def _oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    top_left: bool = False,
    window: int | None = None,
) -> torch.Tensor:
    """float64, one request: q (Hq, Lq, D), k/v (Hkv, Lk, D) → (Lq, Hq, D)."""
    group = q.shape[0] // k.shape[0]
    k, v = (x.double().repeat_interleave(group, 0) for x in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    lq, lk = scores.shape[-2:]
    i = torch.arange(lq)[:, None] + (0 if top_left else lk - lq)
    j = torch.arange(lk)[None, :]
    allowed = (j <= i) & (j > i - window if window is not None else True)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (weights @ v).transpose(0, 1)


def _step(generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    total_q, total_k = sum(s[0] for s in STEP), sum(s[1] for s in STEP)
    q = torch.randn(1, 4, total_q, 8, generator=generator)
    k, v = (torch.randn(1, 2, total_k, 8, generator=generator) for _ in range(2))
    cu_q = torch.tensor([0, *torch.tensor([s[0] for s in STEP]).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor([s[1] for s in STEP]).cumsum(0).tolist()])
    return q, k, v, cu_q, cu_k


# dtype: the tolerance of its output against float64 (a few units of its last place)
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("window", [None, 3])
def test_one_packed_step_against_float64_per_request(
    window: int | None, dtype: torch.dtype
) -> None:
    """Each request's queries are the last of its keys (bottom-right), grouped-query heads, in
    every dtype; top-left alignment (each request's first query against its first key) differs."""
    generator = torch.Generator().manual_seed(3)
    q, k, v, cu_q, cu_k = (x.to(dtype) if x.is_floating_point() else x for x in _step(generator))
    kwargs = dict(
        cu_seq_lens_q=cu_q,
        cu_seq_lens_k=cu_k,
        max_length_q=5,
        max_length_k=9,
        write_index=[torch.zeros(0)],
        sliding_window=window,
    )
    out, weights = huggingface.attention_forward(_Layer(), q, k, v, None, scaling=0.3, **kwargs)
    assert weights is None and out.shape == (1, q.shape[2], 4, 8) and out.dtype == dtype
    wrong, tolerance = False, TOLERANCE[dtype]
    for i, (lq, _) in enumerate(STEP):
        if lq == 0:
            continue
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        parts = (q[0, :, a:b], k[0, :, c:d], v[0, :, c:d])
        expected = _oracle(*parts, 0.3, window=window)
        torch.testing.assert_close(out[0, a:b].double(), expected, atol=tolerance, rtol=tolerance)
        top_left = _oracle(*parts, 0.3, window=window, top_left=True)
        wrong |= not torch.allclose(top_left, expected, atol=1e-3)
    assert wrong, "the step cannot tell bottom-right from top-left alignment"


def test_softcap_and_sinks_reach_the_packed_step() -> None:
    generator = torch.Generator().manual_seed(4)
    q, k, v, cu_q, cu_k = _step(generator)
    kwargs: dict[str, Any] = dict(
        cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=5, max_length_k=9, write_index=[]
    )
    plain, _ = huggingface.attention_forward(_Layer(), q, k, v, None, **kwargs)
    capped, _ = huggingface.attention_forward(_Layer(), q, k, v, None, softcap=0.5, **kwargs)
    sinks = torch.full((4,), 3.0)
    sunk, _ = huggingface.attention_forward(_Layer(), q, k, v, None, s_aux=sinks, **kwargs)
    assert not torch.allclose(plain, capped, atol=1e-3)
    # A sink joins each row's softmax: every output shrinks by that row's sink share, < 1.
    assert bool((sunk.norm(dim=-1) < plain.norm(dim=-1) + 1e-6).all())
    assert not torch.allclose(plain, sunk, atol=1e-3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(block_table=torch.zeros(1, 1, 2)), "block_table"),
        (dict(attention_mask=torch.zeros(1, 1, 10, 10)), "attention_mask"),
        (dict(dropout=0.1), "dropout"),
        (dict(output_attentions=True), "attention weights"),
        (dict(is_causal=False), "causal"),
        (dict(cu_seq_lens_k={"full_attention": torch.zeros(2)}), "cu_seq_lens_k"),
    ],
)
def test_refusals_name_what_continuous_batching_on_qkv_cannot_do(
    change: dict[str, Any], message: str
) -> None:
    generator = torch.Generator().manual_seed(5)
    q, k, v, cu_q, cu_k = _step(generator)
    arguments: dict[str, Any] = dict(
        attention_mask=None,
        cu_seq_lens_q=cu_q,
        cu_seq_lens_k=cu_k,
        max_length_q=5,
        max_length_k=9,
        write_index=[],
    )
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        huggingface.attention_forward(_Layer(), q, k, v, **arguments)


def test_a_padded_step_is_refused() -> None:
    """CUDA graphs pad a step with queries past the last request (cu_seq_lens_q stops short)."""
    generator = torch.Generator().manual_seed(6)
    q, k, v, cu_q, cu_k = _step(generator)
    padded = torch.cat([q, q[:, :, :2]], dim=2)  # two queries of no request
    arguments = dict(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=5, max_length_k=9)
    with pytest.raises(ValueError, match="cu_seq_q"):
        huggingface.attention_forward(_Layer(), padded, k, v, None, write_index=[], **arguments)


def test_paged_prefix_means_the_same_name() -> None:
    """transformers 5.x dropped its "paged|" prefix (but for paged|eager): "paged|qkv" loads as
    "qkv", with transformers' own deprecation warning."""
    config = transformers.LlamaConfig(**_config(num_hidden_layers=1))
    with pytest.warns(FutureWarning, match="paged"):
        model = transformers.LlamaForCausalLM._from_config(
            config, attn_implementation=f"paged|{NAME}"
        )
    assert model.config._attn_implementation == NAME


def test_a_step_is_known_by_its_write_indices() -> None:
    assert hf_paged.is_continuous_batching({"write_index": [], "cu_seq_lens_q": torch.zeros(1)})
    assert not hf_paged.is_continuous_batching(
        {"cu_seq_lens_q": torch.zeros(1)}
    )  # packed, no cache


def test_the_continuous_batching_benchmark_runs_and_compares_tokens() -> None:
    from qkv.bench import continuous

    lengths = continuous.prompt_lengths(5, 4, 64)
    assert sorted(lengths) == [4, 8, 16, 32, 64]
    with pytest.raises(ValueError, match="shortest"):
        continuous.prompt_lengths(3, 8, 4)
    result = continuous.continuous_benchmark(3, new_tokens=2, shortest=2, longest=9, repeats=1)
    assert result["same_tokens"] is True
    assert set(result["tokens_per_second"]) == {"qkv", "sdpa"}
    assert "tokens/s" in continuous.format_continuous(result)
