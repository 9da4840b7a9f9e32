"""qkv: self-attention (Q/K/V) from scratch in PyTorch, done right.

**Mask convention: True means "may attend"** (float masks are added to the scores).
"""

from qkv.cache import KVCache
from qkv.checker import check
from qkv.flex import flex_attention
from qkv.functional import attention, attention_with_cache, merge
from qkv.masks import (
    causal_mask,
    cu_seqlens_from_segments,
    padding_mask,
    segments_from_cu_seqlens,
    sliding_window_mask,
)
from qkv.modules import SelfAttention
from qkv.multihead import MultiheadAttention
from qkv.paged import PagedKVCache
from qkv.trace import trace
from qkv.varlen import varlen_attn

__all__ = [
    "KVCache",
    "MultiheadAttention",
    "PagedKVCache",
    "SelfAttention",
    "attention",
    "attention_with_cache",
    "causal_mask",
    "check",
    "cu_seqlens_from_segments",
    "flex_attention",
    "merge",
    "padding_mask",
    "segments_from_cu_seqlens",
    "sliding_window_mask",
    "trace",
    "varlen_attn",
]
__version__ = "0.1.0"

# Submodules with heavier dependencies load on first use: qkv.viz (matplotlib), qkv.distributed.
_LAZY_SUBMODULES = ("distributed", "integrations", "pretrained", "viz")


def __getattr__(name: str) -> object:
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"qkv.{name}")
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")
