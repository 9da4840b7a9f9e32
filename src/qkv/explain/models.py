"""The models ``qkv explain`` runs under ``qkv.trace()``: the real all-MiniLM-L6-v2 (through
``qkv.attention``) or a toy, a randomly initialised ``qkv.SelfAttention`` over word tokens.

Texts longer than the model reads (512 tokens) are truncated to their first 512 tokens, with a
warning saying how many were dropped.
Legend: L tokens, E model width.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import qkv
from qkv.trace import Trace

MAX_TOKENS = 512  # all-MiniLM-L6-v2's position embeddings; the toy model keeps the same limit
MINILM = "all-MiniLM-L6-v2"
INSTALL_EXPLAIN = 'pip install "qkv[explain]"'
ALL_ROWS = 40  # score tables longer than this show only the most attended keys
SHOWN_ROWS = 24


class ExplainError(Exception):
    """Bad input for ``qkv explain``: the message says what was wrong and what to do."""


@dataclass
class ModelRun:
    """What ``qkv explain`` needs from a model: its tokens and the trace of one forward pass."""

    model_name: str
    tokens: list[str]  # L
    special: list[bool]  # L: True for tokens the model adds ([CLS], [SEP])
    trace: Trace
    layers: int
    heads: int
    text: str
    model: Any = None
    inputs: Any = None
    warnings: tuple[str, ...] = ()


def load_minilm() -> tuple[Any, Any]:
    """``(tokenizer, model)`` of all-MiniLM-L6-v2 on qkv, or ``ExplainError`` naming the
    install command when a package is missing."""
    from qkv import pretrained

    try:
        pretrained.minilm_dir()  # the weights' package
        import transformers

        transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        return pretrained.load_minilm(attn_implementation="qkv")
    except ImportError as error:
        raise ExplainError(
            f"the default model needs packages that are not installed ({error}). Install them "
            f"with: {INSTALL_EXPLAIN}   — or run the toy model, which needs nothing more: "
            "qkv explain TEXT --model random"
        ) from None
    except (OSError, ValueError) as error:  # damaged install or weights failing their sha256
        raise ExplainError(f"cannot load {MINILM}: {error}") from None


def run_minilm(text: str, tokenizer: Any, model: Any) -> ModelRun:
    """Tokenise ``text`` (truncating past 512 tokens, with a warning) and trace the model."""
    warnings = []
    ids = tokenizer(text, truncation=False, verbose=False)["input_ids"]
    limit = min(MAX_TOKENS, int(model.config.max_position_embeddings))
    if len(ids) > limit:
        warnings.append(
            f"TEXT has {len(ids)} tokens but {MINILM} reads at most {limit}: keeping the first "
            f"{limit} (the last {len(ids) - limit} are dropped)"
        )
    inputs = tokenizer(text, truncation=True, max_length=limit, return_tensors="pt")
    ids = inputs["input_ids"][0]
    tokens = tokenizer.convert_ids_to_tokens(ids.tolist())
    special = [i in set(tokenizer.all_special_ids) for i in ids.tolist()]
    if all(special):
        raise ExplainError(f"TEXT {text!r} has no tokens the model knows; give words")
    with torch.no_grad(), qkv.trace(model) as trace:
        model(**inputs)
    trace.tokens = tokens
    return ModelRun(
        model_name=MINILM,
        tokens=tokens,
        special=special,
        trace=trace,
        layers=int(model.config.num_hidden_layers),
        heads=int(model.config.num_attention_heads),
        text=text,
        model=model,
        inputs=inputs,
        warnings=tuple(warnings),
    )


# the toy model: a word-level tokenizer and one randomly initialised qkv.SelfAttention

TOY_WIDTH, TOY_HEADS = 16, 2


def toy_tokens(text: str) -> list[str]:
    """Words and punctuation marks: "The cat sat." -> ["The", "cat", "sat", "."]."""
    return re.findall(r"\w+|[^\w\s]", text)


def toy_embeddings(tokens: Sequence[str], width: int = TOY_WIDTH) -> torch.Tensor:
    """(L, E) inputs X: a fixed random vector per distinct token (seeded by its text) plus
    sinusoidal position codes, so that equal words at different places differ."""
    rows = []
    for token in tokens:
        seed = int.from_bytes(hashlib.sha256(token.encode()).digest()[:8], "little")
        rows.append(torch.randn(width, generator=torch.Generator().manual_seed(seed)))
    x = torch.stack(rows) if rows else torch.empty(0, width)
    position = torch.arange(len(tokens), dtype=torch.float32)[:, None]
    frequency = torch.exp(-math.log(10000.0) * torch.arange(0, width, 2) / width)
    x[:, 0::2] += torch.sin(position * frequency)
    x[:, 1::2] += torch.cos(position * frequency)
    return x


def toy_model(*, causal: bool = False, seed: int = 0) -> qkv.SelfAttention:
    """A randomly initialised ``qkv.SelfAttention(16, heads=2, bias=True)`` (seeded)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return qkv.SelfAttention(TOY_WIDTH, TOY_HEADS, bias=True, causal=causal).eval()


def run_random(text: str, *, causal: bool = False, seed: int = 0) -> ModelRun:
    """Trace the toy model on ``text`` (truncated to 512 tokens, with a warning)."""
    tokens = toy_tokens(text)
    if not tokens:
        raise ExplainError(f"TEXT {text!r} has no words or punctuation to attend between")
    warnings = []
    if len(tokens) > MAX_TOKENS:
        warnings.append(
            f"TEXT has {len(tokens)} tokens but the toy model reads at most {MAX_TOKENS}: "
            f"keeping the first {MAX_TOKENS} (the last {len(tokens) - MAX_TOKENS} are dropped)"
        )
        tokens = tokens[:MAX_TOKENS]
    model = toy_model(causal=causal, seed=seed)
    x = toy_embeddings(tokens)[None]  # (1, L, E)
    with torch.no_grad(), qkv.trace(model) as trace:
        model(x)
    trace.tokens = tokens
    name = f"random qkv.SelfAttention({TOY_WIDTH}, heads={TOY_HEADS}, causal={causal})"
    return ModelRun(
        model_name=name,
        tokens=tokens,
        special=[False] * len(tokens),
        trace=trace,
        layers=1,
        heads=TOY_HEADS,
        text=text,
        model=model,
        inputs=x,
        warnings=tuple(warnings),
    )
