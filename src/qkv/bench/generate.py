"""Greedy generation in transformers after a long prompt: ``attn_implementation="qkv"`` against
its own "sdpa", with the default dynamic cache and with ``cache_implementation="static"``.

A random Llama-style model (4 layers, d_model 512, 8 query / 2 key-value heads, float32, eager:
transformers' own compilation off) generates ``new_tokens`` greedy tokens after a prompt of
``prompt`` tokens. A logits processor stamps the clock at every step; the time between two
consecutive stamps is one generated token (one forward of one query token through the model),
so the prompt's prefill is not in it. The four runs (qkv / sdpa × dynamic / static) take turns,
repetition after repetition; the median step time of each is compared, and the generated tokens
must be the same on qkv and sdpa (else the benchmark fails). One extra run per implementation
and cache times the calls of the attention function alone: the attention's share of a step,
and so the ceiling: sdpa's step over qkv's step less its attention, what an attention of 0 ms
would give (the model's other work and the cache's own copies bound every implementation). An
attention must still read the whole cache once per token: one more run per cache replaces
flash's decoding kernel by ``torch.sum`` over the keys and values it is handed (zeros out), and
the wall ceiling puts that attention in qkv's place: what qkv would give with a kernel that reads
the cache at the rate torch reads memory there, in that step, and computes nothing.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from qkv.bench.timing import interleaved, progress
from qkv.integrations.huggingface import register, require_transformers

IMPLEMENTATIONS = ("qkv", "sdpa")
CACHES = ("dynamic", "static")
# the fewest rounds a run takes: the step's time outside attention (the model, the cache's copies)
# moves by ±15 % from round to round on a shared machine
ROUNDS = 7
MODEL = dict(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
)


class StepClock:
    """A transformers logits processor that changes nothing and stamps the clock at each step."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores

    def steps(self) -> list[float]:
        """Seconds between consecutive stamps: one per generated token after the first."""
        return [later - earlier for earlier, later in zip(self.stamps, self.stamps[1:])]


def make_model(prompt: int, new_tokens: int) -> tuple[Any, torch.Tensor]:
    """The random model (seeded) and a random prompt (1, ``prompt``) of token ids."""
    transformers: Any = require_transformers()
    register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**MODEL, max_position_embeddings=prompt + new_tokens)
    model = transformers.LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, int(MODEL["vocab_size"]), (1, prompt), generator=generator)
    return model, ids


def generate(
    model: Any, ids: torch.Tensor, implementation: str, cache: str, new_tokens: int
) -> tuple[list[int], list[float]]:
    """Greedy ``new_tokens`` after ``ids`` on ``implementation`` with a ``cache`` cache: the
    generated tokens and the seconds of each step after the first."""
    transformers: Any = require_transformers()
    model.set_attn_implementation(implementation)
    clock = StepClock()
    options = {"cache_implementation": "static"} if cache == "static" else {}
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            disable_compile=True,
            logits_processor=transformers.LogitsProcessorList([clock]),
            **options,
        )
    return out[0, ids.shape[1] :].tolist(), clock.steps()


@contextmanager
def timed_attention(implementation: str, seconds: list[float]) -> Iterator[None]:
    """Within: every call of ``implementation``'s attention function adds its duration to
    ``seconds``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original: Callable[..., Any] = ALL_ATTENTION_FUNCTIONS[implementation]

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = original(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return result

    ALL_ATTENTION_FUNCTIONS[implementation] = timed
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS._local_mapping.pop(implementation)  # (the global one again)


def attention_per_step(
    model: Any, ids: torch.Tensor, implementation: str, cache: str, new_tokens: int
) -> float:
    """Median seconds per generated token spent in the attention function (all layers)."""
    calls: list[float] = []
    with timed_attention(implementation, calls):
        generate(model, ids, implementation, cache, new_tokens)
    layers = int(MODEL["num_hidden_layers"])
    per_step = [sum(calls[i : i + layers]) for i in range(layers, len(calls), layers)]
    return statistics.median(per_step)  # (the first group of calls is the prefill)


def generate_benchmark(
    prompt: int = 8192, new_tokens: int = 32, repeats: int = ROUNDS
) -> dict[str, Any]:
    """Median ms per generated token of qkv and sdpa with each cache (``repeats`` interleaved
    generations after one warm-up each), their ratios, whether the tokens are the same, and the
    attention's ms per token."""
    model, ids = make_model(prompt, new_tokens)
    runs = [(name, cache) for cache in CACHES for name in IMPLEMENTATIONS]
    tokens: dict[str, list[int]] = {}
    steps: dict[str, list[float]] = {f"{name} {cache}": [] for name, cache in runs}

    def run(name: str, cache: str) -> None:
        generated, seconds = generate(model, ids, name, cache, new_tokens)
        tokens[f"{name} {cache}"] = generated
        steps[f"{name} {cache}"].extend(seconds)

    for name, cache in runs:  # warm-up: the kernel build, first allocations
        run(name, cache)
    for values in steps.values():
        values.clear()
    progress(f"generate: prompt {prompt} tokens, {new_tokens} new, {repeats} rounds")
    interleaved({f"{n} {c}": functools.partial(run, n, c) for n, c in runs}, repeats)
    ms = {key: statistics.median(values) * 1e3 for key, values in steps.items()}
    attention = {
        f"{name} {cache}": attention_per_step(model, ids, name, cache, new_tokens) * 1e3
        for name, cache in runs
    }
    same = {cache: tokens[f"qkv {cache}"] == tokens[f"sdpa {cache}"] for cache in CACHES}
    with reading_kernel():
        reading = {c: attention_per_step(model, ids, "qkv", c, new_tokens) * 1e3 for c in CACHES}
    result: dict[str, Any] = {
        "model": {**MODEL, "dtype": "float32"},
        "prompt": prompt,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "ms_per_token": ms,
        "attention_ms_per_token": attention,
        "speedup": {cache: ms[f"sdpa {cache}"] / ms[f"qkv {cache}"] for cache in CACHES},
        "ceiling": {cache: _ceiling(ms, attention, cache) for cache in CACHES},
        "reading_attention_ms_per_token": reading,
        "wall_ceiling": {cache: _ceiling(ms, attention, cache, reading[cache]) for cache in CACHES},
        "same_tokens": same,
    }
    if not all(same.values()):
        raise RuntimeError(f"qkv and sdpa generated different tokens:\n{format_generate(result)}")
    return result


def _ceiling(
    ms: dict[str, float], attention: dict[str, float], cache: str, least: float = 0.0
) -> float | None:
    """The most an attention taking ``least`` ms per token could give with ``cache``: sdpa's
    step over qkv's step with that in place of its attention (None where the attention's own
    median is not below the step's: no reading)."""
    rest = ms[f"qkv {cache}"] - attention[f"qkv {cache}"]
    return ms[f"sdpa {cache}"] / (rest + least) if rest > 0 else None


@contextmanager
def reading_kernel() -> Iterator[None]:
    """Within: flash's decoding kernel (``kernel.decode``, which a decoding step of qkv's
    attention function runs) only sums the keys and values it is handed and returns zeros."""
    from qkv.backends.flash import kernel

    def read(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None
    ) -> torch.Tensor:
        k.sum(), v.sum()
        return torch.zeros(*q.shape[:-1], v.shape[-1])

    original = kernel.decode
    kernel.decode = read
    try:
        yield
    finally:
        kernel.decode = original


def format_generate(result: dict[str, Any]) -> str:
    model, ms, attention = result["model"], result["ms_per_token"], result["attention_ms_per_token"]
    lines = [
        f"greedy generate (transformers, eager), Llama-style {model['num_hidden_layers']} layers, "
        f"d_model {model['hidden_size']}, {model['num_attention_heads']}/"
        f"{model['num_key_value_heads']} heads, float32, prompt {result['prompt']} tokens, "
        f"{result['new_tokens']} new, {result['threads']} threads, median ms per token of "
        f"{result['repeats']} runs (attention's share of it):"
    ]
    for cache in CACHES:
        qkv_, sdpa = f"qkv {cache}", f"sdpa {cache}"
        lines.append(
            f"  {cache:<8} qkv {ms[qkv_]:.2f} ms ({attention[qkv_]:.2f}), sdpa {ms[sdpa]:.2f} ms "
            f"({attention[sdpa]:.2f}): {result['speedup'][cache]:.2f}x (an attention of 0 ms: "
            f"{_times(result['ceiling'][cache])}; a kernel that only reads the cache: "
            f"{_times(result['wall_ceiling'][cache])}); same tokens: "
            f"{'yes' if result['same_tokens'][cache] else 'NO'}"
        )
    return "\n".join(lines)


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"
