"""``qkv check`` on the command line: exit 0 / 1 / 2, the JSON report, ``--init`` and
``--forward``, ``--examples``, plain text without rich, and never a traceback."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import planted_flash
import pytest

from qkv import cli
from qkv.checker import CHECK_IDS, command
from qkv.checker.report import FLASH_CHECK_IDS

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "examples" / "tutorials"
PLANTED = Path(__file__).with_name("planted.py")


def qkv_check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["check", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_correct_implementation_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = qkv_check(capsys, f"{TUTORIALS / 'tutorial_002_causal.py'}:CausalSelfAttention")
    assert code == 0
    assert "qkv check · ok" in out and "always" in out


def test_a_planted_mistake_exits_1_and_says_what_is_wrong(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = qkv_check(capsys, f"{PLANTED}:WrongScale")
    assert code == 1
    assert "failed" in out
    assert "1/√d_model" in " ".join(out.split())  # the card may wrap lines


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("no_such_file.py:Attention", "no such file"),
        ("attention.py", "expected FILE.py:NAME"),
        (f"{PLANTED}:Missing", "defines no 'Missing'; it defines: Attention"),
    ],
)
def test_what_cannot_be_run_exits_2_with_the_reason(
    capsys: pytest.CaptureFixture[str], spec: str, says: str
) -> None:
    code, out, err = qkv_check(capsys, spec)
    assert code == 2
    assert says in " ".join(err.split())
    assert "Traceback" not in out + err


def test_a_file_that_fails_to_import_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\nraise RuntimeError('needs a GPU')\n")
    code, out, err = qkv_check(capsys, f"{broken}:Attention")
    assert code == 2
    assert "needs a GPU" in err and "Traceback" not in out + err


def test_init_and_forward_supply_what_it_cannot_guess(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    source = tmp_path / "custom.py"
    source.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(PLANTED.parent)!r})\n"
        "from planted import Attention\n"
        "class Custom(Attention):\n"
        "    def __init__(self, d_model, vocabulary):\n"
        "        super().__init__(d_model, 2)\n"
        "    def forward(self, x, mask=None, causal=False, return_weights=False, *, mode):\n"
        "        assert mode == 'fast'\n"
        "        return super().forward(x, mask, causal, return_weights)\n"
    )
    code, _, err = qkv_check(capsys, f"{source}:Custom")
    assert code == 2 and "--init vocabulary=..." in " ".join(err.split())
    code, _, err = qkv_check(capsys, f"{source}:Custom", "--init", "vocabulary=100")
    assert code == 2 and "--forward" in " ".join(err.split())
    code, out, _ = qkv_check(
        capsys, f"{source}:Custom", "--init", "vocabulary=100", "--forward", "mode='fast'"
    )
    assert code == 0, out
    code, _, err = qkv_check(capsys, f"{source}:Custom", "--init", "vocabulary")
    assert code == 2 and "name=value" in err


def test_the_json_report(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    code, _, _ = qkv_check(capsys, f"{PLANTED}:TinyMaskFill", "--json", str(path))
    report = json.loads(path.read_text())
    assert code == 1
    assert set(report) == {"target", "ok", "checks", "detected"}
    assert report["ok"] is False
    assert [c["id"] for c in report["checks"]] == list(CHECK_IDS)
    assert all(set(c) == {"id", "status", "detail"} for c in report["checks"])
    assert {c["status"] for c in report["checks"]} <= {"pass", "fail", "skip"}
    padding = next(c for c in report["checks"] if c["id"] == "padding")
    assert padding["status"] == "fail" and "1e-20" in padding["detail"]
    assert report["detected"]["mask"].startswith("mask (B, L), bool, True = keep")


def test_json_to_stdout_keeps_stdout_pure_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = qkv_check(capsys, f"{PLANTED}:Attention", "--json", "-")
    assert code == 0
    assert json.loads(out)["ok"] is True
    assert "qkv check" in err  # the card went to stderr


def test_without_rich_the_card_is_plain_text(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(command, "_console", lambda stderr=False: None)
    code, out, _ = qkv_check(capsys, f"{PLANTED}:NoScale")
    assert code == 1
    assert "✗ scale" in out and "1 (no scale at all)" in out


def test_examples_grade_every_tutorial_as_expected(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    planted_flash.small_and_untimed(monkeypatch)
    code, out, _ = qkv_check(capsys, "--examples")
    text = " ".join(out.split())
    assert code == 0
    assert "13 of 13 implementations graded as expected" in text
    assert "Masked scores are filled with a tiny number (like 1e-20)" in text
    assert "1/√32 = 1/√d_in" in text
    assert "The running sum l is not rescaled when the maximum grows" in text


def test_flash_exits_0_on_the_right_tutorial_and_1_on_the_wrong_one(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    planted_flash.small_and_untimed(monkeypatch)
    code, out, _ = qkv_check(
        capsys, f"{TUTORIALS / 'flash_attention.py'}:FlashAttention", "--flash"
    )
    assert code == 0, out
    assert "qkv check · ok" in out and "bottom-right" in out
    wrong = f"{TUTORIALS / 'flash_attention_no_rescale.py'}:FlashAttention"
    code, out, _ = qkv_check(capsys, wrong, "--flash", "--json", "-")
    report = json.loads(out)
    assert code == 1 and report["ok"] is False
    assert [c["id"] for c in report["checks"]] == list(FLASH_CHECK_IDS)
    oracle = next(c for c in report["checks"] if c["id"] == "oracle")
    assert "not rescaled" in oracle["detail"] and "key tiles of 64" in oracle["detail"]


def test_nothing_to_check_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = qkv_check(capsys)
    assert code == 2 and "FILE.py:NAME" in err


NANOGPT = textwrap.dedent(
    """
    from dataclasses import dataclass

    from torch import nn
    from torch.nn import functional as F


    @dataclass
    class GPTConfig:
        block_size: int = 64
        n_embd: int = 48
        n_head: int = 6
        dropout: float = 0.1
        bias: bool = True


    class CausalSelfAttention(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
            self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
            self.n_head, self.n_embd = config.n_head, config.n_embd
            self.dropout = config.dropout

        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            q, k, v = (
                t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v)
            )
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
    """
)


def test_a_nanogpt_file_with_a_dataclass_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    source = tmp_path / "model.py"
    source.write_text(NANOGPT)
    code, out, _ = qkv_check(capsys, f"{source}:CausalSelfAttention", "--json", "-")
    report = json.loads(out)
    assert code == 0, report
    assert report["detected"]["causal"].startswith("always")
    dropout = next(c for c in report["checks"] if c["id"] == "dropout")
    assert "dropout=0.5" in dropout["detail"] and "it drops" in dropout["detail"]
