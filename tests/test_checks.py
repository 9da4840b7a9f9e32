"""qkv._checks: the shared argument checks."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from qkv import _checks

shapes = st.lists(st.sampled_from([0, 1, 2, 3]), max_size=4).map(tuple)


@given(st.lists(shapes, min_size=1, max_size=3))
def test_broadcast_shape_follows_torch(shape_list):
    try:
        expected = tuple(torch.broadcast_shapes(*shape_list))
    except RuntimeError:
        expected = None
    assert _checks.broadcast_shape(*shape_list) == expected
