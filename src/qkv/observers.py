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
# How many observers are active in any context: while none is, a call reads no ContextVar (which
# torch.compile cannot trace; it reads this integer, and recompiles if it changes).
_COUNT = 0


def current() -> Observer | None:
    """The active observer, or None."""
    return _ACTIVE.get() if _COUNT else None


def activate(observer: Observer) -> Token[Observer | None]:
    """Make ``observer`` the active one until ``deactivate`` with the returned token."""
    global _COUNT
    _COUNT += 1
    return _ACTIVE.set(observer)


def deactivate(token: Token[Observer | None]) -> None:
    """Restore the observer that was active before ``activate`` returned ``token``."""
    global _COUNT
    _COUNT -= 1
    _ACTIVE.reset(token)
