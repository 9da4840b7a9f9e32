"""``qkv.check``: no false alarms on correct implementations (qkv's layers, torch's, nanoGPT's,
the annotated transformer's, the correct tutorials), adapting to what an implementation takes,
and saying what to pass when it cannot. The planted mistakes are in test_check_diagnosis.py."""

from __future__ import annotations

import math

import planted
import planted_flash
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import qkv
from qkv.checker import CHECK_IDS, CheckError, Report, Result, assert_attention, check, tutorials


def failed(report: Report) -> set[str]:
    return set(report.failed)


def skipped(report: Report) -> set[str]:
    return {r.id for r in report.checks if r.status == "skip"}


class NanoConfig:
    n_embd, n_head, dropout, bias, block_size = 48, 6, 0.0, False, 32


class NanoCausalSelfAttention(nn.Module):
    """nanoGPT's attention block as it is usually written: one config, fused c_attn, a causal
    buffer, torch's fused kernel on one path and the explicit formula on the other."""

    def __init__(self, config: NanoConfig, flash: bool = False) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout, self.flash = (
            config.n_head,
            config.n_embd,
            config.dropout,
            flash,
        )
        tril = torch.tril(torch.ones(config.block_size, config.block_size))
        self.register_buffer("bias", tril.view(1, 1, config.block_size, config.block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = (
            t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            for t in self.c_attn(x).split(self.n_embd, dim=2)
        )  # (B, nh, T, hs)
        if self.flash:
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            y = self.attn_dropout(F.softmax(att, dim=-1)) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class AnnotatedMultiHeaded(nn.Module):
    """The annotated transformer's layer: forward(query, key, value, mask), a functional
    ``attention`` returning (out, p_attn), masked scores filled with -1e9."""

    def __init__(self, h: int, d_model: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.d_k, self.h = d_model // h, h
        self.linears = nn.ModuleList([nn.Linear(d_model, d_model) for _ in range(4)])
        self.dropout = nn.Dropout(p=dropout)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if mask is not None:
            mask = mask.unsqueeze(1)
        batch = query.size(0)
        query, key, value = (
            lin(x).view(batch, -1, self.h, self.d_k).transpose(1, 2)
            for lin, x in zip(self.linears, (query, key, value))
        )
        scores = query @ key.transpose(-2, -1) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        p_attn = self.dropout(scores.softmax(dim=-1))
        x = (p_attn @ value).transpose(1, 2).contiguous().view(batch, -1, self.h * self.d_k)
        return self.linears[-1](x)


class NanoFromConfig(NanoCausalSelfAttention):
    """Built by qkv check itself from a config object with the usual names."""

    def __init__(self, config: NanoConfig) -> None:
        super().__init__(config)


CORRECT = {
    "SelfAttention, 1 head": lambda: qkv.SelfAttention(32, 1),
    "SelfAttention, 4 heads": lambda: qkv.SelfAttention(32, 4),
    "SelfAttention, 4 heads, causal": lambda: qkv.SelfAttention(32, 4, causal=True),
    "SelfAttention, class": lambda: qkv.SelfAttention,
    "SelfAttention, biases, dropout": lambda: qkv.SelfAttention(24, 3, bias=True, dropout=0.2),
    "SelfAttention, grouped-query": lambda: qkv.SelfAttention(32, 4, kv_heads=2),
    "SelfAttention, multi-query, causal": lambda: qkv.SelfAttention(32, 4, kv_heads=1, causal=True),
    "qkv.MultiheadAttention": lambda: qkv.MultiheadAttention(32, 4, batch_first=True),
    "torch MultiheadAttention, sequence first": lambda: nn.MultiheadAttention(32, 4),
    "nanoGPT": lambda: NanoCausalSelfAttention(NanoConfig()),
    "nanoGPT, fused kernel": lambda: NanoCausalSelfAttention(NanoConfig(), flash=True),
    "nanoGPT, built from a config": lambda: NanoFromConfig,
    "qkv.attention": lambda: qkv.attention,
    "planted.Attention (the right one)": lambda: planted.Attention,
}


@pytest.mark.parametrize("name", CORRECT)
def test_correct_implementations_pass_every_check(name: str) -> None:
    report = check(CORRECT[name]())
    assert report.ok, report.text()
    assert [r.id for r in report.checks] == list(CHECK_IDS)
    # What could not apply is skipped with its reason, never silently passed.
    for result in report.checks:
        if result.status == "skip":
            assert result.id in {"weights", "padding", "fully-masked"}, report.text()
            assert "no " in result.detail


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_a_full_featured_layer_has_nothing_skipped(kv_heads: int) -> None:
    report = check(qkv.SelfAttention(32, 4, kv_heads=kv_heads))
    assert not skipped(report)
    assert "4 head(s)" in report["oracle"].detail
    assert report.detected["mask"] == "padding_mask (B, L), bool, True = keep"
    assert report.detected["causal"] == "forward argument causal=True"


def test_the_annotated_transformers_minus_1e9_fill_overflows_float16() -> None:
    """forward(query, key, value, mask) is called with x three times; -1e9 masks well enough in
    float32 (and a row with no key averages the values, finite), but float16 cannot hold it."""
    report = check(AnnotatedMultiHeaded)
    assert failed(report) == {"dtypes"}, report.text()
    assert "overflow" in report["dtypes"].detail and "-inf" in report["dtypes"].detail
    assert report.detected["mask"].startswith("mask (B, 1, L), bool, True = keep")
    assert "linears.0, linears.1, linears.2" in report["oracle"].detail.replace(" (32 → 32)", "")


def test_always_causal_modules_are_detected_as_such() -> None:
    report = check(NanoCausalSelfAttention(NanoConfig()))
    assert report.detected["causal"].startswith("always")
    assert report["causal"].status == "pass"
    assert report["oracle"].status == "pass" and "causal=True" in report["oracle"].detail


def test_torch_multihead_attention_gives_nan_for_a_fully_padded_row_in_inference() -> None:
    """torch's fast path (batch_first, eval, no autograd) returns NaN where every key is padded:
    a real difference from the contract, which qkv.MultiheadAttention fixes. Nothing else
    fails, and its True = ignore key_padding_mask is detected."""
    report = check(nn.MultiheadAttention(32, 4, batch_first=True))
    assert failed(report) == {"fully-masked"}
    assert "NaN" in report["fully-masked"].detail and "no_grad" in report["fully-masked"].detail
    assert report.detected["mask"] == "key_padding_mask (B, L), bool, True = ignore"


@pytest.mark.parametrize(
    "example", [e for e in tutorials.EXAMPLES], ids=lambda e: f"{e.file}:{e.name}"
)
def test_each_tutorial_is_graded_as_its_defect_says(
    example: tutorials.Example, monkeypatch: pytest.MonkeyPatch
) -> None:
    planted_flash.small_and_untimed(monkeypatch)
    report = tutorials.check_example(example)
    assert failed(report) == set(example.fails), report.text()


def test_tutorial_001s_blocked_mask_is_detected() -> None:
    report = tutorials.check_example(
        tutorials.example("tutorial_001_the_cat_sat.py", "MultiHeadAttention")
    )
    assert "True = ignore" in report.detected["mask"]
    assert report["padding"].status == "pass"


# One planted mistake each: (implementation, the check that must fail, words its detail says).
def test_heads_are_found_when_the_module_does_not_say() -> None:
    class Anonymous(planted.Attention):
        def __init__(self) -> None:
            super().__init__(32, 4)
            self.count = self.heads
            del self.heads

        def split(self, x: torch.Tensor) -> torch.Tensor:
            self.heads = self.count
            return super().split(x)

    report = check(Anonymous())
    assert report.ok, report.text()
    assert "4 head(s)" in report["oracle"].detail


def test_without_linear_layers_the_oracle_is_skipped_with_what_to_do() -> None:
    class Raw(nn.Module):
        def __init__(self, d_model: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3 * d_model, d_model) / d_model**0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = F.linear(x, self.weight).chunk(3, dim=-1)
            return qkv.attention(q, k, v)

    report = check(Raw)
    assert report["oracle"].status == "skip" and "nn.Linear" in report["oracle"].detail
    assert report.ok


def test_assert_attention_lists_the_failing_checks() -> None:
    with pytest.raises(
        AssertionError, match=r"(?s)oracle: .*the scale is wrong.*\nscale: Your scale is 1/√32"
    ):
        assert_attention(planted.WrongScale)
    report = assert_attention(qkv.SelfAttention(16, 2))
    assert report.ok


def test_it_adapts_to_constructor_names_and_says_what_to_pass() -> None:
    class NeedsVocabulary(planted.Attention):
        def __init__(self, d_model: int, vocabulary: int) -> None:
            super().__init__(d_model)

    with pytest.raises(CheckError, match="--init vocabulary="):
        check(NeedsVocabulary)
    assert check(NeedsVocabulary, init={"vocabulary": 100}).ok


def test_a_call_that_fails_says_what_to_pass() -> None:
    class WantsTokens(nn.Module):
        d_model = 32

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("expected integer token ids")

    with pytest.raises(CheckError, match=r"(?s)expected integer token ids.*--forward"):
        check(WantsTokens())


def test_an_output_that_is_not_a_tensor_is_explained() -> None:
    class ReturnsDict(planted.Attention):
        def forward(self, x: torch.Tensor, **kwargs: object) -> dict[str, torch.Tensor]:  # type: ignore[override]
            return {"out": super().forward(x)}  # type: ignore[dict-item]

    with pytest.raises(CheckError, match="first item is the output tensor"):
        check(ReturnsDict)


def test_results_have_a_known_id_and_status() -> None:
    with pytest.raises(ValueError, match="id must be one of"):
        Result("speed", "pass", "")
    with pytest.raises(ValueError, match="status must be one of"):
        Result("scale", "ok", "")


def test_the_check_leaves_the_random_state_and_the_module_as_they_were() -> None:
    layer = qkv.SelfAttention(16, 2).train()
    state = torch.get_rng_state()
    weights = {k: v.clone() for k, v in layer.state_dict().items()}
    check(layer)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(v, weights[k]) for k, v in layer.state_dict().items())


@pytest.mark.filterwarnings("ignore:The use of `x.T`")
def test_an_implementation_that_only_runs_unbatched_is_told_why() -> None:
    class KeysDotT(planted.Attention):  # tutorial 004's keys.T works on (L, E) only
        def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:  # type: ignore[override]
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            return torch.softmax(q @ k.T / self.head_dim**0.5, dim=-1) @ v

    with pytest.raises(
        CheckError, match=r"runs on one sequence x \(7, 32\).*\.transpose\(-2, -1\)"
    ):
        check(KeysDotT)


def test_functions_over_one_head_and_every_mask_encoding() -> None:
    def one_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.dim() != 3:
            raise ValueError("q must be (B, L, D)")
        return torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1) @ v

    report = check(one_head)
    assert report.ok and report.detected["inputs"] == "q, k, v (B, L, D)"

    def additive(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        if attn_mask is not None:
            scores = scores + attn_mask
        return torch.softmax(scores, dim=-1) @ v

    report = check(additive)
    assert report.detected["mask"] == "attn_mask (B, 1, 1, L), float 0 / -inf"
    assert failed(report) == {"fully-masked"}  # all -inf rows: NaN

    def ones_and_zeros(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        keep = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        return qkv.attention(q, k, v, mask=keep)

    report = check(ones_and_zeros)
    assert report.ok and report.detected["mask"].startswith("attention_mask (B, L), ")


def test_a_misleading_head_attribute_is_not_trusted() -> None:
    class Layer(planted.Attention):
        n_heads = 2  # read before ``heads`` as the head count; the layer has 4

    report = check(Layer(32, 4))
    assert report.ok, report.text()
    assert "4 head(s)" in report["oracle"].detail
    assert report.detected["heads"] == "4 (its attribute says 2; 4 reproduces its output)"


def test_the_device_option() -> None:
    assert check(planted.Attention, device="cpu").ok
    with pytest.raises(ValueError, match=r"device must be a torch device.*'nowhere'"):
        check(planted.Attention, device="nowhere")


class XTransformersStyle(nn.Module):
    """to_q and a fused to_kv, einsum scores, a -finfo.max fill, causal chosen when built."""

    def __init__(self, dim: int, heads: int = 8, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.causal, self.scale = heads, causal, (dim // heads) ** -0.5
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, 2 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        q, (k, v) = self.to_q(x), self.to_kv(x).chunk(2, dim=-1)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        dots = torch.einsum("bhid,bhjd->bhij", q, k) * self.scale
        blocked = -torch.finfo(dots.dtype).max
        if mask is not None:
            dots = dots.masked_fill(~mask[:, None, None, :], blocked)
        if self.causal:
            future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
            dots = dots.masked_fill(future, blocked)
        out = torch.einsum("bhij,bhjd->bhid", dots.softmax(-1), v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


def test_a_constructor_causal_flag_and_fused_keys_values() -> None:
    """Everything holds but L = 0, where .view(..., -1) cannot infer a size: a real crash."""
    report = check(XTransformersStyle)
    assert report.detected["causal"] == "constructor argument causal=True"
    assert "Q and fused K/V projections to_q (32 → 32), to_kv (32 → 64)" in report["oracle"].detail
    assert report["causal"].status == "pass"
    assert failed(report) == {"empty"}
    assert "view/reshape with -1" in report["empty"].detail


class CausalWithPadding(nn.Module):
    """Always causal, with a (B, L) 1/0 attention_mask, plain -inf fills."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = (
            t.view(b, n, self.heads, e // self.heads).transpose(1, 2)
            for t in self.qkv(x).chunk(3, -1)
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(e // self.heads)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


def test_an_always_causal_layer_with_padding_fails_only_where_no_key_is_left() -> None:
    report = check(CausalWithPadding)
    assert report.detected["causal"].startswith("always")
    assert report.detected["mask"] == "attention_mask (B, L), bool, True = keep"
    assert failed(report) == {"fully-masked"}, report.text()
