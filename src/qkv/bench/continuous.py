"""Continuous batching: transformers' ``generate_batch`` on qkv against its own "sdpa".

A small random Llama-style model (grouped-query attention, float32) serves the same requests
(mixed prompt lengths, greedy, a fixed number of new tokens each) through transformers'
continuous batching twice per round: with ``attn_implementation="qkv"`` (each step one
``qkv.varlen_attn`` call per layer over the packed requests) and with "sdpa" (each step one
torch call per layer with a dense (T, S) mask over every query and key of the step). The two
take turns, repetition after repetition; generated tokens per second are compared as medians,
and the generated tokens must be the same.

Legend: T query tokens of a step, S key tokens of a step.
"""

from __future__ import annotations

import functools
import logging
import statistics
from typing import Any

import torch

from qkv.bench.timing import interleaved, progress
from qkv.integrations.huggingface import register, require_transformers

IMPLEMENTATIONS = ("qkv", "sdpa")
MODEL = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
)


def prompt_lengths(requests: int, shortest: int, longest: int) -> list[int]:
    """``requests`` prompt lengths spread evenly (geometrically) from ``shortest`` to ``longest``,
    in a shuffled order so that long and short requests share steps."""
    if requests < 1 or not 1 <= shortest <= longest:
        raise ValueError(
            f"need requests >= 1 and 1 <= shortest <= longest, got {requests}, {shortest}, "
            f"{longest}"
        )
    ratio = (longest / shortest) ** (1 / max(1, requests - 1))
    lengths = [round(shortest * ratio**i) for i in range(requests)]
    order = torch.randperm(requests, generator=torch.Generator().manual_seed(0)).tolist()
    return [lengths[i] for i in order]


def _model_and_prompts(lengths: list[int]) -> tuple[Any, list[list[int]]]:
    transformers: Any = require_transformers()
    register()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).eval()
    generator = torch.Generator().manual_seed(1)
    vocab = int(MODEL["vocab_size"])
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]
    return model, prompts


def continuous_benchmark(
    requests: int = 32,
    new_tokens: int = 32,
    shortest: int = 16,
    longest: int = 512,
    repeats: int = 3,
    max_batch_tokens: int = 512,
) -> dict[str, Any]:
    """Time ``generate_batch`` of ``requests`` prompts (lengths ``shortest`` … ``longest``),
    ``new_tokens`` greedy tokens each, on qkv and on "sdpa", ``repeats`` interleaved rounds
    after one warm-up each; returns medians, tokens/s, their ratio and whether every request
    generated the same tokens on both."""
    transformers: Any = require_transformers()

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # psutil notes
    lengths = prompt_lengths(requests, shortest, longest)
    model, prompts = _model_and_prompts(lengths)
    pages = sum(-(-(n + new_tokens) // 16) for n in lengths) + requests
    batching = transformers.ContinuousBatchingConfig(
        page_size=16, num_blocks=pages, max_batch_tokens=max_batch_tokens
    )
    generation = transformers.GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    tokens: dict[str, dict[str, list[int]]] = {}

    def serve(name: str) -> None:
        model.set_attn_implementation(name)
        with torch.inference_mode():
            outputs = model.generate_batch(
                prompts,
                generation_config=generation,
                continuous_batching_config=batching,
                progress_bar=False,
            )
        failed = [key for key, output in outputs.items() if output.error is not None]
        if failed or len(outputs) != requests:
            raise RuntimeError(f"generate_batch on {name}: {len(failed)} requests failed")
        tokens[name] = {key: output.generated_tokens for key, output in outputs.items()}

    for name in IMPLEMENTATIONS:  # warm-up: the kernel build, first allocations
        serve(name)
    progress(f"continuous batching: {requests} requests, {repeats} rounds")
    steps = {name: functools.partial(serve, name) for name in IMPLEMENTATIONS}
    seconds = interleaved(steps, repeats)
    medians = {name: statistics.median(seconds[name]) for name in IMPLEMENTATIONS}
    generated = requests * new_tokens
    return {
        "model": {**MODEL, "dtype": "float32"},
        "requests": requests,
        "prompt_lengths": lengths,
        "new_tokens": new_tokens,
        "max_batch_tokens": max_batch_tokens,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "seconds": medians,
        "seconds_all": seconds,
        "tokens_per_second": {name: generated / medians[name] for name in IMPLEMENTATIONS},
        "speedup": medians["sdpa"] / medians["qkv"],
        "same_tokens": tokens["qkv"] == tokens["sdpa"],
    }


def format_continuous(result: dict[str, Any]) -> str:
    rates = result["tokens_per_second"]
    lengths = result["prompt_lengths"]
    return (
        f"continuous batching (transformers generate_batch), Llama-style "
        f"{result['model']['num_hidden_layers']} layers, {result['model']['num_attention_heads']}"
        f"/{result['model']['num_key_value_heads']} heads, float32, {result['requests']} "
        f"requests (prompts {min(lengths)}-{max(lengths)} tokens), {result['new_tokens']} new "
        f"tokens each, {result['threads']} threads, median of {result['repeats']}: qkv "
        f"{rates['qkv']:.0f} tokens/s, sdpa {rates['sdpa']:.0f} tokens/s: "
        f"{result['speedup']:.2f}x; same tokens: {'yes' if result['same_tokens'] else 'NO'}"
    )
