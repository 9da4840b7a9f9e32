"""The checks of ``hf_sweep``: a family's tiny model on eager and on another implementation.

``Setup`` builds a family's tiny model (``hf_tiny``) on eager and the inputs every check uses;
each check in ``CHECKS`` runs a model and returns the tensors to compare (named), or raises
``NotApplicable``; ``difference`` compares two such results within ``ATOL``.

The checks: outputs (logits, else the last hidden state; real tokens only: a padding query that
attends no key gets 0 from qkv where eager averages the blocked keys) without padding, with left
and with right padding; the attention weights (``output_attentions=True``, real query rows);
greedy ``generate`` with a dynamic and with a static cache (the same new tokens and logits);
for decoder-only models taking position ids, documents packed into one row with restarting
positions and no mask, as transformers' ``DataCollatorWithFlattening`` makes them; and a prefix
LM's outputs and generation with its prefix marked.
Legend: B batch, L length, H heads, Lq query length, Lk key length, V vocabulary.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch
from hf_tiny import VOCAB, tiny_config

# float32 on both sides: eager's matmul-then-softmax and qkv's kernels sum in different orders.
# Over every family that runs on qkv the outputs agree to 1e-5 (median ~1e-7; the T5 family,
# without a scale on its scores, reaches ~8e-6), where a wrong mask, window, sink or scale moves
# them by 1e-3 or more: 1e-4 sits between, an order of magnitude from each.
ATOL = RTOL = 1e-4
BATCH, LENGTH, NEW_TOKENS = 3, 10, 4
PADDED = {1: 3, 2: 1}  # row: its padding tokens (row 0 has none)
DOCUMENTS = (4, 6, 5)  # packed documents, each longer than the tiny sliding window (4)
PREFIX, PREFIX_LM = 6, {"paligemma": 0, "hrm_text": 1}  # (the token type of a prefix token)
MAX_PARAMETERS = 150_000_000  # (an image or audio tower the generic rule could not shrink)


class NotApplicable(Exception):
    """A check that does not apply to a family."""


class TextFails(Exception):
    """Eager fails on the family's tiny model given text alone."""


def short(error: BaseException, limit: int = 300) -> str:
    """``error``'s type and message on one line, at most ``limit`` characters."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Setup:
    """A family's tiny config, its eager model and the inputs every check uses."""

    def __init__(self, model_type: str, task: str, model_class: Any, grouped: bool) -> None:
        self.model_type, self.task, self.model_class = model_type, task, model_class
        config, reserved = tiny_config(model_type, grouped)
        self.config = _config_for(self.model_class, config)
        self.eager = self.load("eager", state=None)
        self.state = self.eager.state_dict()
        text_config = self.eager.config.get_text_config()
        text = getattr(text_config, "vocab_size", None) or VOCAB
        try:  # (its embedding table, where the model says which it is)
            embeddings = getattr(self.eager.get_input_embeddings(), "num_embeddings", text)
        except NotImplementedError:
            embeddings = text
        tokens = range(3, min(text, embeddings, VOCAB))
        self.allowed = torch.tensor([i for i in tokens if i not in reserved])
        pad = getattr(text_config, "pad_token_id", None)
        self.pad = pad if isinstance(pad, int) and 0 <= pad < text else 0
        self.encoder_decoder = bool(getattr(self.eager.config, "is_encoder_decoder", False))
        self.forward = inspect.signature(type(self.eager).forward).parameters
        try:
            outputs(self, self.eager, "none")
        except Exception as error:
            raise TextFails(short(error)) from error

    def load(self, implementation: str, state: dict[str, torch.Tensor] | None = None) -> Any:
        """The family's model on ``implementation``, in eval mode, with ``state``'s weights
        (None: fresh ones, seeded, and zero-initialised parameters made random: a zero sink,
        bias or gate would hide a difference in the attention)."""
        config = copy.deepcopy(self.config)
        if state is None:
            with torch.device("meta"):
                sizes = {n: p.numel() for n, p in self.model_class(config).named_parameters()}
            if sum(sizes.values()) > MAX_PARAMETERS:
                largest = sorted(sizes, key=sizes.__getitem__)[-2:]
                raise ValueError(f"{sum(sizes.values()):,} parameters after shrinking: {largest}")
            torch.manual_seed(0)
        model = self.model_class._from_config(config, attn_implementation=implementation).eval()
        if state is not None:
            model.load_state_dict(state)
            return model
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.is_floating_point() and not parameter.any():
                    parameter.copy_(torch.randn(parameter.shape, generator=generator))
        return model

    def tokens(self, batch: int, length: int, seed: int) -> torch.Tensor:
        """(batch, length) ids of ordinary tokens (no special or image token)."""
        generator = torch.Generator().manual_seed(seed)
        picks = torch.randint(len(self.allowed), (batch, length), generator=generator)
        return self.allowed[picks]

    def batch(self, side: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L) ids and their 0/1 mask, rows 1 and 2 padded on ``side`` ("left", "right" or
        "none")."""
        input_ids = self.tokens(BATCH, LENGTH, seed=0)
        mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
        for row, count in PADDED.items():
            if side == "left":
                mask[row, :count] = 0
            elif side == "right":
                mask[row, LENGTH - count :] = 0
        input_ids[mask == 0] = self.pad
        return input_ids, mask

    def call(self, model: Any, side: str, **kwargs: Any) -> tuple[Any, torch.Tensor]:
        """The model's output on ``batch(side)`` and the batch's real tokens (B, L) bool."""
        input_ids, mask = self.batch(side)
        if self.encoder_decoder:
            kwargs["decoder_input_ids"] = self.tokens(BATCH, 5, seed=1)
        with torch.no_grad():
            return model(input_ids=input_ids, attention_mask=mask, **kwargs), mask.bool()


def _config_for(model_class: type, config: Any) -> Any:
    """The config ``model_class`` takes: ``config``, or its sub-config of the class's config
    class (the language model of a composite family), as transformers' auto classes pick."""
    wanted = getattr(model_class, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    for name in getattr(config, "sub_configs", {}):
        if isinstance(getattr(config, name, None), wanted):
            return getattr(config, name)
    return config


def _rows(tensor: Any, real: torch.Tensor) -> Any:
    """The tensor's rows of real tokens where its first two dimensions are (B, L)."""
    if isinstance(tensor, torch.Tensor) and tensor.shape[:2] == real.shape:
        return tensor[real]
    return tensor


def outputs(setup: Setup, model: Any, side: str) -> dict[str, Any]:
    """Logits (else the last hidden state) on real tokens; an encoder's last state too."""
    out, real = setup.call(model, side)
    main = next((key for key in ("logits", "last_hidden_state") if key in out), 0)
    found = {"output": _rows(out[main], real)}
    if isinstance(out.get("encoder_last_hidden_state"), torch.Tensor):
        found["encoder"] = _rows(out["encoder_last_hidden_state"], real)
    return found


def weights(setup: Setup, model: Any) -> dict[str, Any]:
    """Every layer's attention weights (B, H, Lq, Lk) on the left-padded batch, real query rows
    only where the queries are the batch's tokens."""
    out, real = setup.call(model, "left", output_attentions=True)
    found = {}
    for key in out:
        if "attentions" not in key or not out[key]:
            continue
        for layer, tensor in enumerate(out[key]):
            if isinstance(tensor, torch.Tensor):
                queries = key in ("attentions", "encoder_attentions") and tensor.ndim == 4
                found[f"{key}[{layer}]"] = (
                    _rows(tensor.transpose(1, 2), real) if queries else tensor
                )
    if not found:
        raise NotApplicable("the model returns no attention weights")
    return found


def generated(setup: Setup, model: Any, cache: str, **kwargs: Any) -> dict[str, Any]:
    """Greedy ``generate`` of NEW_TOKENS tokens after the left-padded batch: the new tokens and
    each step's logits."""
    if not model.can_generate():
        raise NotApplicable(f"{type(model).__name__} does not generate")
    input_ids, mask = setup.batch("left")
    starts = (model.generation_config.decoder_start_token_id, model.generation_config.bos_token_id)
    if setup.encoder_decoder and starts == (None, None):
        kwargs["decoder_start_token_id"] = setup.pad  # (as T5 starts, where the config names none)
    out = model.generate(
        input_ids,
        attention_mask=mask,
        **kwargs,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        num_beams=1,
        cache_implementation=cache,
        pad_token_id=setup.pad,
        return_dict_in_generate=True,
        output_logits=True,
    )
    found = {"new tokens": out.sequences[:, -NEW_TOKENS:]}
    return found | {f"logits[{step}]": logits for step, logits in enumerate(out.logits)}


def packed(setup: Setup, model: Any) -> dict[str, Any]:
    """(1, L, V) logits of DOCUMENTS packed in one row, positions restarting, no mask."""
    if setup.task != "causal LM" or setup.encoder_decoder or "position_ids" not in setup.forward:
        raise NotApplicable("not a decoder-only model taking position_ids")
    input_ids = setup.tokens(1, sum(DOCUMENTS), seed=2)
    position_ids = torch.cat([torch.arange(n) for n in DOCUMENTS])[None]
    with torch.no_grad():
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    return {"logits": out.logits}


def prefix_lm(setup: Setup, model: Any) -> dict[str, Any]:
    """A prefix LM's outputs and generation with its first PREFIX positions marked as the prefix
    (``token_type_ids``: attended both ways), on the left-padded batch."""
    if setup.model_type not in PREFIX_LM:
        raise NotApplicable("no prefix marked by token types")
    marks = torch.arange(LENGTH).expand(BATCH, LENGTH) < PREFIX
    prefix_type = PREFIX_LM[setup.model_type]
    token_type_ids = torch.where(marks, prefix_type, 1 - prefix_type)
    out, real = setup.call(model, "left", token_type_ids=token_type_ids)
    found = {"output": _rows(out.logits, real)}
    if model.can_generate():
        found |= generated(setup, model, "dynamic", token_type_ids=token_type_ids)
    return found


def documents_alone(setup: Setup, model: Any) -> dict[str, Any]:
    """(1, L, V) logits of each of ``packed``'s documents run alone, side by side."""
    parts = setup.tokens(1, sum(DOCUMENTS), seed=2).split(DOCUMENTS, dim=1)
    with torch.no_grad():
        return {"logits": torch.cat([model(input_ids=part).logits for part in parts], dim=1)}


CHECKS: dict[str, Callable[[Setup, Any], dict[str, Any]]] = {
    "no padding": lambda setup, model: outputs(setup, model, "none"),
    "left padding": lambda setup, model: outputs(setup, model, "left"),
    "right padding": lambda setup, model: outputs(setup, model, "right"),
    "weights": weights,
    "generate dynamic": lambda setup, model: generated(setup, model, "dynamic"),
    "generate static": lambda setup, model: generated(setup, model, "static"),
    "packed": packed,
    "prefix LM": prefix_lm,
}


def difference(got: dict[str, Any], expected: dict[str, Any]) -> tuple[bool, float, str]:
    """(whether every named tensor of ``got`` is close to ``expected``'s (``ATOL``, ``RTOL``;
    tokens equal), the largest |got − expected| (inf: other shapes or tokens), where it is)."""
    close, worst, where = True, 0.0, ""
    for name, theirs in expected.items():
        ours = got.get(name)
        if not isinstance(theirs, torch.Tensor):
            continue
        if not isinstance(ours, torch.Tensor) or ours.shape != theirs.shape:
            return False, float("inf"), f"{name}: shape {getattr(ours, 'shape', None)}"
        if not theirs.is_floating_point():
            if not torch.equal(ours, theirs):
                return False, float("inf"), f"{name}: {ours.tolist()} != {theirs.tolist()}"
            continue
        ours, theirs = ours.float(), theirs.float()
        close &= torch.allclose(ours, theirs, atol=ATOL, rtol=RTOL, equal_nan=True)
        gap = float((ours - theirs).abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).max())
        worst, where = max((worst, where), (gap, name))
    return close, worst, where


def without_sink_share(got: dict[str, Any]) -> dict[str, Any]:
    """Weights renormalised over the keys alone: qkv gives a sink its share of each row, where
    some families' eager code (granite_swa) returns the softmax over the keys and scales the
    output by the sink afterwards."""
    return {name: w / w.sum(-1, keepdim=True).clamp_min(1e-30) for name, w in got.items()}
