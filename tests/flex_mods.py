"""FlexAttention's own mods as test cases: the score_mods and mask_mods of torch's
test/inductor/test_flex_attention.py and test_flex_decoding.py (their module-level lists and
the mods written inside their tests) and every mask and mod of attention-gym (attn_gym/masks,
attn_gym/mods), ported as they are written there, each under a comment naming its source.
Tables they capture are sized for the call (torch's tests size them for S = 2048) and seeded.

``cases(sizes)`` -> name -> Case(score_mod, mask_mod, learned): ``learned`` are the captured
tensors a gradient test differentiates (they require grad when ``sizes.learned``).
Legend: B batch, H query heads, L query length, S key length, N = max(L, S).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks

Mod = Callable[..., Any] | None


class Case(NamedTuple):
    score_mod: Mod
    mask_mod: Mod
    learned: tuple[torch.Tensor, ...] = ()


@dataclass
class Sizes:
    batch: int
    heads: int
    lq: int
    lk: int
    learned: bool = False
    gen: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(7))

    @property
    def n(self) -> int:
        return max(self.lq, self.lk)

    def randn(self, *shape: int, learned: bool = False) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.gen, dtype=torch.float64)
        return x.requires_grad_() if learned and self.learned else x

    def randint(self, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.gen, dtype=torch.int32)


# --- torch test/inductor/test_flex_attention.py and test_flex_decoding.py, module level ------


def _identity(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:  # flex_attention._identity
    return score


def _causal(score: Any, batch: Any, head: Any, token_q: Any, token_kv: Any) -> Any:
    return torch.where(token_q >= token_kv, score, float("-inf"))


def _rel_bias(score: Any, batch: Any, head: Any, token_q: Any, token_kv: Any) -> Any:
    return score + (token_q - token_kv)


def _rel_causal(score: Any, batch: Any, head: Any, token_q: Any, token_kv: Any) -> Any:
    return torch.where(token_q >= token_kv, score + (token_q - token_kv), float("-inf"))


def _generate_alibi_bias(num_heads: int) -> Callable[..., Any]:
    def _alibi_bias(score: Any, batch: Any, head: Any, token_q: Any, token_kv: Any) -> Any:
        scale = torch.exp2(-((head + 1) * 8.0 / num_heads))
        return score + (token_kv - token_q) * scale

    return _alibi_bias


def _inverse_causal(score: Any, b: Any, h: Any, m: Any, n: Any) -> Any:
    return torch.where(m <= n, score, float("-inf"))


def _times_two(score: Any, b: Any, h: Any, m: Any, n: Any) -> Any:
    return score * 2


def _squared(score: Any, b: Any, h: Any, m: Any, n: Any) -> Any:
    return score * score


def _head_offset(head_offset: torch.Tensor) -> Callable[..., Any]:  # "Captured Buffer"
    def score_mod(score: Any, b: Any, h: Any, m: Any, n: Any) -> Any:
        return score * head_offset[h]

    return score_mod


def _trig(score: Any, b: Any, h: Any, m: Any, n: Any) -> Any:
    return torch.sin(torch.cos(score)) + torch.tan(b)


def _trig2(score: Any, b: Any, h: Any, m: Any, n: Any) -> Any:
    cos_score = torch.cos(score)
    sin_score = torch.sin(score)
    z = cos_score * sin_score + torch.tan(b)
    return z


def _causal_mask(batch: Any, head: Any, token_q: Any, token_kv: Any) -> Any:
    return token_q >= token_kv


def _inverse_causal_mask(batch: Any, head: Any, token_q: Any, token_kv: Any) -> Any:
    return token_q <= token_kv


def _generate_windowed(offset: int) -> Callable[..., Any]:  # test_flex_decoding.py
    def _windowed(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return torch.where(q + offset >= kv, score, float("-inf"))

    return _windowed


def torch_lists(s: Sizes) -> dict[str, Case]:
    """test_score_mods, test_score_mask_mod_map, captured_buffers_map (both files)."""
    head_offset = torch.rand(s.heads, generator=s.gen, dtype=torch.float64)
    head_offset.requires_grad_(s.learned)
    return {
        "torch _identity": Case(_identity, None),
        "torch _times_two": Case(_times_two, None),
        "torch _squared": Case(_squared, None),
        "torch _causal": Case(_causal, None),
        "torch _inverse_causal": Case(_inverse_causal, None),
        "torch _rel_bias": Case(_rel_bias, None),
        "torch _rel_causal": Case(_rel_causal, None),
        "torch _generate_alibi_bias(8)": Case(_generate_alibi_bias(8), None),
        "torch _generate_windowed(1000)": Case(_generate_windowed(1000), None),
        "torch _generate_windowed(-20)": Case(_generate_windowed(-20), None),
        "torch _head_offset": Case(_head_offset(head_offset), None, (head_offset,)),
        "torch _trig": Case(_trig, None),
        "torch _trig2": Case(_trig2, None),
        "torch _identity + noop_mask": Case(_identity, noop_mask),
        "torch _causal + _causal_mask": Case(_causal, _causal_mask),
        "torch _inverse_causal + _inverse_causal_mask": Case(_inverse_causal, _inverse_causal_mask),
        "torch _rel_causal + _causal_mask": Case(_rel_causal, _causal_mask),
    }


# --- torch test/inductor/test_flex_attention.py, mods written inside its tests ---------------


def torch_captured(s: Sizes) -> dict[str, Case]:
    """test_captured_buffers_all_dims, test_index_*, test_load_*, the learnable-bias tests."""
    n, b_, h_ = s.n, s.batch, s.heads
    head_scale, batch_scale, tok_scale = s.randn(h_, learned=True), s.randn(b_), s.randn(n)
    bias_bn, bias_weird1, bias_weird2 = s.randn(b_, n, learned=True), s.randn(4, b_, h_, n), None
    bias_weird2 = s.randn(b_, h_, 4, n)
    which_bias = torch.tensor(0)
    bias_nn, bias_bnn = s.randn(n, n, learned=True), s.randn(b_, n, n)
    bias_bhnn, rel_bias = s.randn(b_, h_, n, n), s.randn(2 * n, learned=True)
    bias_hnn, bias_1d = s.randn(h_, n, n, learned=True), s.randn(2 * n, learned=True)
    offset_q, offset_kv, multiplier = s.randn(n, learned=True), s.randn(n), s.randn(n)
    realized = s.randn(n) * 2  # test_inputs_are_realized
    modular = (2 * s.randn(b_, n, n, h_)).view(b_, h_, n, n).contiguous()  # test_modular_indexing

    def all_bias(score: Any, batch: Any, head: Any, token_q: Any, token_kv: Any) -> Any:
        score = score + tok_scale[token_q]
        score = score + batch_scale[batch]
        score = score + head_scale[head]
        return score

    return {
        "torch all_bias": Case(all_bias, None, (head_scale,)),
        "torch index_multiple": Case(lambda sc, b, h, q, kv: sc + bias_bn[b][q], None, (bias_bn,)),
        "torch index_weird1": Case(lambda sc, b, h, q, kv: sc + bias_weird1[0][b, h][q], None),
        "torch index_weird2": Case(
            lambda sc, b, h, q, kv: sc + bias_weird2[b][h][which_bias, q], None
        ),
        "torch bias_mod seq": Case(lambda sc, b, h, q, kv: sc + bias_nn[q, kv], None, (bias_nn,)),
        "torch bias_mod seq batch": Case(lambda sc, b, h, q, kv: sc + bias_bnn[b, q, kv], None),
        "torch bias_mod head seq batch": Case(
            lambda sc, b, h, q, kv: sc + bias_bhnn[b, h, q, kv], None
        ),
        "torch load_rel_bias": Case(
            lambda sc, b, h, q, kv: sc + rel_bias[(q - kv) + n], None, (rel_bias,)
        ),
        "torch rel_pos_1d": Case(lambda sc, b, h, q, kv: sc + bias_1d[q + kv], None, (bias_1d,)),
        "torch rel_pos_2d index multiple": Case(
            lambda sc, b, h, q, kv: sc + bias_nn[q][kv], None, (bias_nn,)
        ),
        "torch rel_pos_2d_transposed": Case(
            lambda sc, b, h, q, kv: sc + bias_nn[kv, q], None, (bias_nn,)
        ),
        "torch rel_pos_3d_transposed": Case(
            lambda sc, b, h, q, kv: sc + bias_hnn[h, kv, q], None, (bias_hnn,)
        ),
        "torch offset_q offset_kv + causal": Case(
            lambda sc, b, h, q, kv: sc + offset_q[q] + offset_kv[kv], _causal_mask, (offset_q,)
        ),
        "torch apply_multiplicative_bias": Case(lambda sc, b, h, q, kv: sc * multiplier[q], None),
        "torch inputs_are_realized": Case(lambda qk, b, h, q, kv: qk + realized[q], None),
        "torch modular_indexing": Case(
            lambda score, batch, head, q_idx, k_idx: score + modular[batch, head, q_idx, k_idx],
            None,
        ),
    }


def torch_inline_scores(s: Sizes) -> dict[str, Case]:
    """score_mods written inside test_flex_attention.py's tests (masking ones included)."""
    n, width = s.n, 16
    document_id = torch.arange(n, dtype=torch.int32) // 64  # test_doc_mask_sparse (256 there)
    seq_idx = torch.zeros(n, dtype=torch.bool)
    seq_idx[n // 2 :] = 1  # test_seq_masking
    num_bidirectional = s.randint(n, s.batch)
    seq_len = torch.arange(s.batch, dtype=torch.int32) + 1  # test_padded_dense_causal
    scale = torch.ones((), dtype=torch.int32)  # test_captured_scale
    offsets = torch.tensor([0, n // 2, n // 2 + n // 4, n], dtype=torch.int32)  # test_njt_causal
    njt_idx = torch.zeros(n, dtype=torch.int32)
    for idx in range(len(offsets) - 1):
        njt_idx[offsets[idx] : offsets[idx + 1]] = idx
    means, length_scales = s.randn(n, 3), torch.logspace(0.001, 0.1, s.heads, dtype=torch.float64)

    def document_masking_causal(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        causal_mask = q_idx >= kv_idx
        document_mask = document_id[q_idx] == document_id[kv_idx]
        return torch.where(causal_mask & document_mask, score, -float("inf"))

    def bias_mod(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:  # dependent_causal_bidi.
        causal_attention = q >= kv
        cur_num_bidirectional = num_bidirectional[b]
        bidirectional_attention_on_video = (q <= cur_num_bidirectional) & (
            kv <= cur_num_bidirectional
        )
        return torch.where(
            bidirectional_attention_on_video | causal_attention, score, -float("inf")
        )

    def natten_mask(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:  # test_natten_2d
        q_x, q_y = q / width, q % width
        kv_x, kv_y = kv / width, kv % width
        return torch.where(
            ((q_x - kv_x).abs() <= 3) | ((q_y - kv_y).abs() <= 3), score, float("-inf")
        )

    def njt_score_mod(qk: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:  # test_njt_causal
        q_nested = q - offsets[njt_idx[q]]
        kv_nested = kv - offsets[njt_idx[kv]]
        return _causal(qk, b, h, q_nested, kv_nested)

    def euclidean_dist_pos_embed(score: Any, b: Any, h: Any, q_idx: Any, k_idx: Any) -> Any:
        q_pos = means[q_idx]
        k_pos = means[k_idx]
        dist = (q_pos - k_pos).pow(2).sum(-1).sqrt()
        inv_dist = torch.exp(-dist / length_scales[h])
        return inv_dist * score

    return {
        "torch document_masking_causal": Case(document_masking_causal, None),
        "torch skip_odd_keys": Case(
            lambda score, b, h, q, kv: torch.where(kv % 2 == 0, score, float("-inf")), None
        ),
        "torch composed_score_mod": Case(
            lambda score, b, h, m, n_: _inverse_causal(_rel_bias(score, b, h, m, n_), b, h, m, n_),
            None,
        ),
        "torch seq_mask_mod": Case(
            lambda score, b, h, q, kv: torch.where(seq_idx[q] == seq_idx[kv], score, float("-inf")),
            None,
        ),
        "torch dependent_causal_bidirectional": Case(bias_mod, None),
        "torch natten_2d": Case(natten_mask, None),
        "torch score_mod_func": Case(lambda score, b, h, q, kv: score - q // (1 + kv), None),
        "torch silu_score": Case(lambda score, b, h, q, kv: torch.nn.functional.silu(score), None),
        "torch padded_dense causal": Case(
            lambda qk, b, h, q, kv: torch.where(
                qk <= seq_len[b], _causal(qk, b, h, q, kv), -float("inf")
            ),
            None,
        ),
        "torch score_mod_scale": Case(lambda qk, b, h, q, kv: qk + scale, None),
        "torch njt_causal": Case(njt_score_mod, None),
        "torch euclidean_dist_pos_embed": Case(euclidean_dist_pos_embed, None),
        "torch symbol closure": Case(lambda s_, b, h, q, k: s_ + s.batch, None),
    }


def torch_inline_masks(s: Sizes) -> dict[str, Case]:
    """mask_mods written inside test_flex_attention.py's tests (TestBlockMask's included)."""
    n = s.n
    window_size, sliding = 32, 64  # test_multiple_mask_calls, test_lse_masked_output
    document_masks = torch.zeros(s.batch, n, dtype=torch.int32)
    document_masks[:, n // 3 :] = 1  # test_document_masking_edge_case (64 of 128 there)
    seq = torch.arange(n) // 128  # test_block_mask_non_divisible
    seq127 = torch.arange(n) // 127  # test_compiling_create_block_mask
    attn_mask = torch.ones(s.batch, 1, s.lq, s.lk, dtype=torch.bool).tril()  # new_empty_mask_mod
    rand_mask = torch.randint(0, 2, (s.batch, n), generator=s.gen).bool()
    input_lengths = s.randint(n, s.batch)
    offset = torch.arange(s.batch)  # TestBlockMask (offset[b] * 128)
    doc_ids = torch.repeat_interleave(torch.arange(5, dtype=torch.int32), n // 5 + 1)[: n - 3]

    def _flex_attention_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any, lengths: Any) -> Any:
        return (q_idx < lengths[b]) & (kv_idx < lengths[b])

    def doc_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # doc_mask_clamped
        return (
            doc_ids[q_idx.clamp(0, doc_ids.shape[0] - 1)]
            == doc_ids[kv_idx.clamp(0, doc_ids.shape[0] - 1)]
        )

    def h_zero(h: Any) -> Any:
        return h.new_zeros(h.shape)

    import functools

    return {
        "torch causal_mask_slidewindow_mod": Case(
            None, lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx <= kv_idx + window_size)
        ),
        "torch and_masks(causal, sliding_window)": Case(
            None, and_masks(_causal_mask, lambda b, h, q, kv: (q - kv) <= 512)
        ),
        "torch and_masks(causal, neg_causal)": Case(
            None, and_masks(_causal_mask, lambda b, h, q, kv: q < kv)
        ),
        "torch or_masks(causal, neg_causal)": Case(
            None, or_masks(_causal_mask, lambda b, h, q, kv: q < kv)
        ),
        "torch new_empty_mask_mod": Case(
            lambda score, b, h, q_idx, kv_idx: score + attn_mask[b, h_zero(h), q_idx, kv_idx],
            lambda b, h, q_idx, kv_idx: attn_mask[b, h_zero(h), q_idx, kv_idx],
        ),
        "torch block_mask_reuse mask": Case(None, lambda b, h, q, kv: (kv < 25) | (kv >= 200)),
        "torch document_masking_edge_case": Case(
            None, lambda b, h, q, kv: document_masks[b, q] == document_masks[b, kv]
        ),
        "torch fully_masked_out_rows": Case(
            lambda score, b, h, q_idx, kv_idx: score, lambda b, h, q, kv: q < n // 2
        ),
        "torch block_mask_non_divisible": Case(None, lambda b, h, q, kv: seq[q] == seq[kv]),
        "torch sliding_window_causal": Case(
            None, lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= sliding)
        ),
        "torch global_causal": Case(
            None, lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx > sliding)
        ),
        "torch batch_flip_causal": Case(
            None, lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (b % 2 == 0)
        ),
        "torch ~rand_mask[b, q_idx]": Case(None, lambda b, h, q_idx, kv_idx: ~rand_mask[b, q_idx]),
        "torch _flex_attention_mask partial": Case(
            None, functools.partial(_flex_attention_mask, lengths=input_lengths)
        ),
        "torch causal offset[b] mask": Case(
            None, lambda b, h, q, kv: (q + (offset[b] * 128)) >= kv
        ),
        "torch seq[q] == seq[kv] causal": Case(
            None, lambda b, h, q, kv: (q >= kv) & (seq127[q] == seq127[kv])
        ),
        "torch doc_mask_clamped": Case(None, doc_mask_mod),
    }


def torch_decoding(s: Sizes) -> dict[str, Case]:
    """Mods written inside test_flex_decoding.py's tests (those not above); its tables sized
    for one query (q_scale, bias of (1, S)) are sized for the call's queries here."""
    n = s.n
    head_offset = torch.rand(s.heads, generator=s.gen, dtype=torch.float64)
    head_scale, batch_scale = s.randn(s.heads), s.randn(s.batch, learned=True)
    kv_scale, q_scale = s.randn(n), s.randn(n)
    offset_tensor = torch.tensor(n // 2 - 3, dtype=torch.int32)
    offset_192 = torch.tensor(192, dtype=torch.int32)
    head_type = torch.tensor([i % s.heads != 0 for i in range(s.heads)], dtype=torch.bool)

    def all_bias(score: Any, batch: Any, head: Any, token_q: Any, token_kv: Any) -> Any:
        score = score + kv_scale[token_kv]
        score = score + q_scale[token_q]
        score = score + head_scale[head]
        score = score + batch_scale[batch]
        return score

    def head_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        bi_mask = head_type[h]
        causal_mask = q_idx >= kv_idx
        return bi_mask & causal_mask

    return {
        "decoding captured_buffers": Case(lambda score, b, h, m, n_: score + head_offset[h], None),
        "decoding all_bias": Case(all_bias, None, (batch_scale,)),
        "decoding causal_offset_mask": Case(
            None, lambda b, h, q_idx, kv_idx: (offset_192 + q_idx) >= kv_idx
        ),
        "decoding non_divisible_offset_mask": Case(
            None, lambda b, h, q, kv: kv >= q + offset_tensor
        ),
        "decoding offset_kv + offset mask": Case(
            lambda score, b, h, q, kv: score + kv_scale[kv],
            lambda b, h, q, kv: kv >= q + offset_tensor,
        ),
        "decoding head_attention_mod": Case(None, head_mask_mod),
        "decoding windowed mask + _windowed": Case(
            _generate_windowed(1000), lambda b, h, q, kv: q + 1000 >= kv
        ),
    }
