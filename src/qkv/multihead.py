"""``qkv.MultiheadAttention``: a drop-in for ``torch.nn.MultiheadAttention`` on ``qkv.attention``.

Same constructor, forward arguments, argument meanings and ``state_dict`` keys as torch's layer,
so existing code and checkpoints keep working. That includes torch's mask conventions, which
are the opposite of qkv's: here ``key_padding_mask`` True means "ignore this key" and a bool
``attn_mask`` True means "may NOT attend" (float masks are added in both). ``_keep_mask`` turns
them into qkv's convention (True = may attend), in this one place.

The one difference is a fix: a query with no key it may attend (a fully padded item, a fully
blocked row) gets 0 attention output and 0 weights — the output is then ``out_proj``'s bias —
where torch returns NaN.

Legend: B batch, H heads (num_heads), L query length, S key length, E embed_dim, D head size
(E // H), Ek/Ev key/value input features (kdim/vdim).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv import _checks, masks
from qkv.functional import attention


class MultiheadAttention(nn.Module):
    """Multi-head attention with the interface of ``torch.nn.MultiheadAttention``.

    Args (as in torch):
        embed_dim: E, the model width; split over ``num_heads`` heads of size E // num_heads.
        num_heads: H.
        dropout: dropout on the attention weights, in training mode only.
        bias: biases on the input and output projections.
        add_bias_kv: append one learned key and value (``bias_k``, ``bias_v``) to every sequence.
        add_zero_attn: append one all-zero key and value to every sequence.
        kdim, vdim: feature sizes of ``key`` and ``value`` (default E); when either differs from
            E, the projections are ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``
            instead of the fused ``in_proj_weight``.
        batch_first: inputs and outputs are (B, L, E) instead of (L, B, E).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        embed_dim = _checks.positive_int("embed_dim", embed_dim)
        num_heads = _checks.positive_int("num_heads", num_heads)
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim} and "
                f"num_heads={num_heads}"
            )
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else _checks.positive_int("kdim", kdim)
        self.vdim = embed_dim if vdim is None else _checks.positive_int("vdim", vdim)
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = _checks.probability("dropout", dropout)
        self.batch_first = _checks.boolean("batch_first", batch_first)
        self.head_dim = embed_dim // num_heads

        self._make_parameters(bias, add_bias_kv, device, dtype)
        self.add_zero_attn = _checks.boolean("add_zero_attn", add_zero_attn)
        self._reset_parameters()

    def _make_parameters(
        self,
        bias: bool,
        add_bias_kv: bool,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        """Projection parameters and the optional learned key/value."""
        # Parameters are created (and initialised, in _reset_parameters) in torch's order, so a
        # seed gives the same initial weights as torch.nn.MultiheadAttention.
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(
                torch.empty(3 * self.embed_dim, self.embed_dim, device=device, dtype=dtype)
            )
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(
                torch.empty(self.embed_dim, self.embed_dim, device=device, dtype=dtype)
            )
            self.k_proj_weight = nn.Parameter(
                torch.empty(self.embed_dim, self.kdim, device=device, dtype=dtype)
            )
            self.v_proj_weight = nn.Parameter(
                torch.empty(self.embed_dim, self.vdim, device=device, dtype=dtype)
            )
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(
                torch.empty(3 * self.embed_dim, device=device, dtype=dtype)
            )
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(
            self.embed_dim, self.embed_dim, bias=bias, device=device, dtype=dtype
        )
        if add_bias_kv:
            self.bias_k = nn.Parameter(
                torch.empty(1, 1, self.embed_dim, device=device, dtype=dtype)
            )
            self.bias_v = nn.Parameter(
                torch.empty(1, 1, self.embed_dim, device=device, dtype=dtype)
            )
        else:
            self.register_parameter("bias_k", None)
            self.register_parameter("bias_v", None)

    def _reset_parameters(self) -> None:
        """torch's initialisation: Xavier-uniform weights, zero biases, Xavier-normal bias_k/v."""
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, kdim={self.kdim}, "
            f"vdim={self.vdim}, dropout={self.dropout}, batch_first={self.batch_first}"
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of ``query`` over ``key``/``value``, with torch's argument meanings.

        Shapes: query (L, B, E), key (S, B, Ek), value (S, B, Ev); (B, ·, ·) when
        ``batch_first``; or unbatched (L, E), (S, Ek), (S, Ev).

        ``key_padding_mask``: (B, S) or (S,) unbatched; bool True = ignore that key, or float
        (added to the scores). ``attn_mask``: (L, S) or (B * H, L, S); bool True = may NOT
        attend, or float (added). ``is_causal``: a hint, as in torch, that ``attn_mask`` is the
        causal mask; ``attn_mask`` is then required, and when there is no ``key_padding_mask``
        and no weights are asked for, the top-left causal rule is used in its place.

        Returns ``(out, weights)``: out (L, B, E) / (B, L, E) / (L, E); weights None unless
        ``need_weights``, then (B, L, S') averaged over heads or (B, H, L, S') per head if not
        ``average_attn_weights`` (no B when unbatched), S' counting the keys added by
        ``add_bias_kv`` and ``add_zero_attn``. Weights are the softmax before dropout.
        """
        _checks.boolean("need_weights", need_weights)
        _checks.boolean("average_attn_weights", average_attn_weights)
        _checks.boolean("is_causal", is_causal)
        batched = self._check_inputs(query, key, value)
        if is_causal and attn_mask is None:
            raise ValueError(
                "is_causal=True is a hint that attn_mask is the causal mask, so attn_mask must be "
                "given, got None (as in torch.nn.MultiheadAttention); build one with "
                "torch.nn.Transformer.generate_square_subsequent_mask(L)"
            )

        # Work in (B, L, ·) whatever the input layout.
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        b, lq, s = query.shape[0], query.shape[1], key.shape[1]
        keep = self._keep_mask(key_padding_mask, attn_mask, batched, b, lq, s)
        # torch's hint: on its fused path (no padding mask, no weights), is_causal stands in for
        # the mask as the top-left causal rule.
        use_causal_rule = is_causal and key_padding_mask is None and not need_weights
        if use_causal_rule:
            keep = None

        q, k, v = self._heads(query, key, value)  # (B, H, L, D), (B, H, S', D) x 2
        if keep is not None and k.shape[2] > s:
            keep = _allow_extra_keys(keep, k.shape[2] - s)

        result = attention(
            q,
            k,
            v,
            mask=keep,
            causal="top-left" if use_causal_rule else False,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=need_weights,
        )
        out, weights = result if isinstance(result, tuple) else (result, None)
        out = out.transpose(1, 2).reshape(b, lq, self.embed_dim)  # (B, L, E)
        out = self.out_proj(out)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)  # (B, L, S')
        if not batched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)  # (L, B, E)
        return out, weights

    def _heads(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projected, split into heads: (B, H, L, D) and (B, H, S', D) x 2, S' counting the
        keys ``add_bias_kv`` and ``add_zero_attn`` append."""
        b = query.shape[0]
        q, k, v = self._project(query, key, value)  # (B, L, E), (B, S, E), (B, S, E)
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.expand(b, 1, -1)], dim=1)  # (B, S+1, E)
            v = torch.cat([v, self.bias_v.expand(b, 1, -1)], dim=1)
        q, k, v = (self._split_heads(x) for x in (q, k, v))  # (B, H, ·, D)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(b, self.num_heads, 1, self.head_dim)], dim=2)
            v = torch.cat([v, v.new_zeros(b, self.num_heads, 1, self.head_dim)], dim=2)
        return q, k, v

    def _check_inputs(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Check the shapes of query, key and value; True when they are batched."""
        _checks.tensor("query", query, ndims=(2, 3))
        batched = query.dim() == 3
        for name, x in (("key", key), ("value", value)):
            _checks.tensor(name, x, ndims=(query.dim(),))
        for name, x in (("query", query), ("key", key), ("value", value)):
            _checks.floating(name, x)
        for name, x, features in (
            ("query", query, self.embed_dim),
            ("key", key, self.kdim),
            ("value", value, self.vdim),
        ):
            if x.shape[-1] != features:
                raise ValueError(
                    f"{name} must have {features} features (last dim), got shape "
                    f"{_checks.shape_str(x.shape)}"
                )
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                f"key and value must have the same length and batch, got key "
                f"{_checks.shape_str(key.shape)} and value {_checks.shape_str(value.shape)}"
            )
        if batched:
            batch_dim = 0 if self.batch_first else 1
            if query.shape[batch_dim] != key.shape[batch_dim]:
                layout = "(B, L, E)" if self.batch_first else "(L, B, E)"
                raise ValueError(
                    f"query and key must have the same batch size (inputs are {layout}), got "
                    f"query {_checks.shape_str(query.shape)} and key {_checks.shape_str(key.shape)}"
                )
        return batched

    def _keep_mask(
        self,
        key_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
        batched: bool,
        b: int,
        lq: int,
        s: int,
    ) -> torch.Tensor | None:
        """torch's two masks as one qkv mask, broadcastable to (B, H, L, S).

        The one conversion between conventions: torch's bool True means "blocked", qkv's True
        means "may attend", so bool masks are inverted; float masks are added in both.
        """
        keep = None
        if key_padding_mask is not None:
            expected = (b, s) if batched else (s,)
            _check_mask("key_padding_mask", key_padding_mask, expected, "(B, S)", "(S,)", batched)
            padding = key_padding_mask.reshape(b, 1, 1, s)  # (B, 1, 1, S)
            keep = ~padding if padding.dtype == torch.bool else padding
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                shape: tuple[int, ...] = (lq, s)
            else:
                shape = (b * self.num_heads, lq, s) if batched else (self.num_heads, lq, s)
            _check_mask(
                "attn_mask",
                attn_mask,
                shape,
                "(L, S) or (B * num_heads, L, S)",
                "(L, S) or (num_heads, L, S)",
                batched,
            )
            if attn_mask.dim() == 3:
                attn_mask = attn_mask.reshape(b, self.num_heads, lq, s)  # (B, H, L, S)
            blocked = attn_mask
            keep = masks.combine(keep, ~blocked if blocked.dtype == torch.bool else blocked)
        return keep

    def _project(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The input projections: (B, L, E), (B, S, Ek), (B, S, Ev) -> each (B, ·, E)."""
        if self.in_proj_weight is not None:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, E) -> (B, H, S, D)."""
        return x.view(*x.shape[:-1], self.num_heads, self.head_dim).transpose(1, 2)


def _check_mask(
    name: str,
    mask: torch.Tensor,
    expected: tuple[int, ...],
    batched_desc: str,
    unbatched_desc: str,
    batched: bool,
) -> None:
    _checks.tensor(name, mask)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"{name} must be bool (True = ignore/not allowed, torch's convention) or floating "
            f"(added to the scores), got {mask.dtype}"
        )
    if tuple(mask.shape) != expected:
        desc = batched_desc if batched else unbatched_desc
        raise ValueError(
            f"{name} must have shape {desc} = {_checks.shape_str(expected)}, got "
            f"{_checks.shape_str(mask.shape)}"
        )


def _allow_extra_keys(keep: torch.Tensor, extra: int) -> torch.Tensor:
    """Widen a mask (..., S) to (..., S + extra): the appended keys (bias_k/v, zero) are allowed."""
    allowed = keep.new_full((*keep.shape[:-1], extra), True if keep.dtype == torch.bool else 0.0)
    return torch.cat([keep, allowed], dim=-1)
