"""attn_implementation="qkv" against "eager" on every model family transformers declares.

One case per family (its id: the model type), swept by ``hf_sweep``: its tiny model generated
from its config class (``hf_tiny``), against eager in float32 in the checks of ``hf_checks``
(outputs without padding, with left and with right padding, attention weights, greedy
generation with a dynamic and a static cache, packed documents, a prefix LM's prefix). A
family passes as ``equal``, ``upstream`` (sdpa differs from eager too), ``refused`` (by name, at
load), ``not on qkv`` or ``not text``; it is skipped where no tiny model can be built;
``differs`` and ``error`` fail.

By default a fixed sample runs: families chosen for what their attention does (below). Set
``QKV_HF_SWEEP=all`` for every family, or ``QKV_HF_SWEEP=gemma3,exaone4`` for some:

    QKV_HF_SWEEP=all .venv/bin/python -m pytest -n 2 tests/test_huggingface_sweep.py
    .venv/bin/python tests/hf_sweep.py              # the table of outcomes, every family
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import qkv
from qkv.integrations import huggingface

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed: pip install "qkv[hf]"'
)

import hf_sweep  # noqa: E402  (after the skip above)
from hf_checks import difference  # noqa: E402
from hf_tiny import VOCAB, WINDOW, tiny_config  # noqa: E402

SAMPLE = {
    "llama": "the plain decoder",
    "mistral": "a sliding window in every layer",
    "qwen2": "sliding and full layers by layer_types",
    "cohere2": "sliding layers with rotary, full layers without",
    "gemma2": "soft-capping and sliding layers",
    "gemma3": "sliding/full alternation in a composite (image-text) model",
    "exaone4": "layer_types alternation; full layers keep the config's sliding_window",
    "exaone4_5": "exaone4's language model inside an image-text model",
    "exaone_moe": "exaone4's attention with experts",
    "kolibri1": "sliding/full alternation",
    "gpt_oss": "one sink logit per head",
    "granite_swa": "sinks whose share eager's weights leave out",
    "inkling2_text": "one sink logit per query row",
    "deepseek_v4": "compressed keys and sinks",
    "deepseek_v32": "keys chosen per query by an indexer",
    "qwen3_next": "attention beside linear-attention layers",
    "jamba": "attention beside state-space layers",
    "gpt2": "absolute positions, no rotary",
    "bert": "a bidirectional encoder",
    "modernbert": "an encoder with local attention",
    "t5": "seq2seq with a relative position bias",
    "bart": "seq2seq with cross-attention",
    "t5gemma": "seq2seq with soft-capping and sliding layers",
    "paligemma": "a prefix LM: its prefix attended both ways",
    "hrm_text": "a prefix LM marked the other way round",
    "got_ocr2": "a language model beside a vision tower outside the interface",
    "granite_speech": "a language model beside an audio encoder",
    "granite_speech_plus": "granite_speech's successor",
    "bloom": "attention outside the interface: refused",
    "mamba": "no attention at all",
    "clip": "text and image together: not text",
}


def selected() -> list[str]:
    """The families to sweep: ``QKV_HF_SWEEP`` ("all", or model types with commas), else
    the sample."""
    chosen = os.environ.get("QKV_HF_SWEEP", "")
    if chosen == "all":
        return hf_sweep.family_names()
    return [name.strip() for name in chosen.split(",") if name.strip()] or list(SAMPLE)


@pytest.fixture(scope="module", autouse=True)
def _quiet() -> Iterator[None]:
    """transformers' logs off while the families are swept (its warnings: by the mark below)."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


@pytest.mark.filterwarnings("ignore")  # (transformers' notes; qkv's land in the result)
@pytest.mark.parametrize("model_type", selected())
def test_family_runs_on_qkv_as_on_eager(model_type: str) -> None:
    result = hf_sweep.sweep(model_type)
    if result.outcome == "cannot build":
        pytest.skip(result.report())
    assert result.outcome in hf_sweep.PASSING, result.report()


def test_every_family_of_the_auto_mappings_is_swept() -> None:
    from transformers.models.auto import modeling_auto

    names = hf_sweep.family_names()
    assert len(names) == len(set(names)) > 400
    for mapping in (
        "MODEL_MAPPING_NAMES",
        "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
        "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    ):
        assert set(getattr(modeling_auto, mapping)) <= set(names)
    assert set(SAMPLE) <= set(names)


def test_a_tiny_config_keeps_both_kinds_of_layers_and_its_tokens_in_the_vocabulary() -> None:
    for model_type in ("gemma3", "exaone4", "cohere2"):
        config, reserved = tiny_config(model_type)
        text = config.get_text_config()
        assert set(text.layer_types) == {"sliding_attention", "full_attention"}
        assert text.sliding_window == WINDOW and text.num_hidden_layers == 2
        assert text.hidden_size == 32 and text.vocab_size <= VOCAB
        assert reserved and all(0 <= token < VOCAB for token in reserved)


def _wrong(*args: Any, **kwargs: Any) -> Any:
    """qkv.attention that attends every key: no mask, no causal rule, no window."""
    for name in ("mask", "window", "segments"):
        kwargs.pop(name, None)
    return qkv.attention(*args, **{**kwargs, "causal": False})


def test_a_wrong_attention_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface, "attention", _wrong)
    result = hf_sweep.sweep("llama")
    assert result.outcome == "differs"
    statuses = {check.name: check.status for check in result.checks}
    assert statuses["no padding"] == statuses["left padding"] == "differs"
    assert statuses["packed"] == "differs"


def test_qkv_wrong_where_sdpa_is_wrong_too_is_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same mistake in sdpa: the family's own code would be at fault, shown without qkv."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def wrong_sdpa(*args: Any, **kwargs: Any) -> Any:
        return sdpa(*args, **{**kwargs, "is_causal": False})

    def no_mask(module: Any, query: Any, key: Any, value: Any, mask: Any, **kwargs: Any) -> Any:
        return wrong_sdpa(module, query, key, value, None, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", no_mask)
    monkeypatch.setattr(huggingface, "attention", _wrong)
    result = hf_sweep.sweep("llama")
    assert result.outcome == "upstream", result.report()


def test_a_refused_family_is_named_with_the_reason() -> None:
    result = hf_sweep.sweep("bloom")
    assert result.outcome == "refused"
    assert "BloomForCausalLM" in result.detail and '"bloom"' in result.detail


def test_checks_that_compare_nothing_cannot_pass() -> None:
    """Different shapes or tokens are infinitely apart; equal tensors are 0 apart."""
    tensor = torch.ones(2, 3)
    assert difference({"a": tensor}, {"a": tensor}) == (True, 0.0, "a")
    assert difference({"a": tensor[:1]}, {"a": tensor})[:2] == (False, float("inf"))
    assert difference({}, {"a": tensor})[:2] == (False, float("inf"))
    tokens = torch.tensor([[1, 2]])
    assert difference({"t": tokens + 1}, {"t": tokens})[:2] == (False, float("inf"))
    close, gap, where = difference({"a": tensor + 1e-3}, {"a": tensor})
    assert not close and gap == pytest.approx(1e-3, rel=1e-3) and where == "a"
    assert difference({"a": tensor + 1e-5}, {"a": tensor})[0]
