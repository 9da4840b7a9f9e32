"""Combining attention over two sets of keys by their log-sum-exps, in one place.

Attention over keys A ∪ B is a softmax over both, whose denominator is the sum of each set's:
with lse_x = log Σ_{j in x} exp(s_j), set x holds the share exp(lse_x − lse) of every row's
weight, where lse = log(exp(lse_a) + exp(lse_b)). So::

    out = exp(lse_a − lse) · out_a + exp(lse_b − lse) · out_b

``qkv.merge`` does this for two results, ring attention folds its key blocks in one at a time,
and flash adds sinks (a set whose output is 0). Legend: L query length, Dv value features.
"""

from __future__ import annotations

import torch


def shares(
    lse_a: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, share_a, share_b), each (..., L): the log-sum-exp over both sets and each set's
    share of a row's weight. A row with no key in either set (both −inf) keeps lse = −inf and
    gets shares 0, never NaN; NaN in either input propagates."""
    lse = torch.logaddexp(lse_a, lse_b)
    # Subtracting the merged lse keeps the exponents <= 0. A row with no key on either side has
    # lse = -inf, and exp(-inf - (-inf)) would be NaN: subtract 0 there, so both shares are 0.
    reference = lse.masked_fill(lse == float("-inf"), 0.0)
    return lse, torch.exp(lse_a - reference), torch.exp(lse_b - reference)
