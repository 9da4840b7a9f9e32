"""Observers of attention calls: what ``qkv.trace`` uses to see every call ``qkv.attention`` makes.

``qkv.attention`` tells the active observer (if any) about each call after it ran: the canonical
``Call``, its output, and its weights when the backend returned them. Observing never changes
which backend runs or what it computes. One observer is active per context (the innermost
``with qkv.trace()``), kept in a ``ContextVar`` so threads and async tasks do not see each
other's.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Protocol

import torch

from qkv.backends.base import Call


class Observer(Protocol):
    def record(self, call: Call, out: torch.Tensor, weights: torch.Tensor | None) -> None:
        """One call: its canonical arguments, its output and its weights (None if not returned)."""


_ACTIVE: ContextVar[Observer | None] = ContextVar("qkv_observer", default=None)


def current() -> Observer | None:
    """The active observer, or None."""
    return _ACTIVE.get()


def activate(observer: Observer) -> Token[Observer | None]:
    """Make ``observer`` the active one until ``deactivate`` with the returned token."""
    return _ACTIVE.set(observer)


def deactivate(token: Token[Observer | None]) -> None:
    """Restore the observer that was active before ``activate`` returned ``token``."""
    _ACTIVE.reset(token)
