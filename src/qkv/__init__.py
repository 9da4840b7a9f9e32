"""qkv: self-attention (Q/K/V) from scratch in PyTorch, done right.

**Mask convention: True means "may attend"** (float masks are added to the scores).
"""

from qkv.functional import attention
from qkv.masks import causal_mask, padding_mask, sliding_window_mask
from qkv.modules import KVCache, SelfAttention
from qkv.multihead import MultiheadAttention
from qkv.trace import trace

__all__ = [
    "KVCache",
    "MultiheadAttention",
    "SelfAttention",
    "attention",
    "causal_mask",
    "padding_mask",
    "sliding_window_mask",
    "trace",
]
__version__ = "0.1.0"
