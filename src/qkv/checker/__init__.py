"""``qkv check``: grade anyone's self-attention against qkv's contract, and say what is wrong.

Point it at an ``nn.Module`` (self-attention over x (B, L, E)) or a function ``f(q, k, v)``.
It adapts to the usual constructor and forward names, finds the mask layout and polarity, reads
the implementation's own Q, K, V from its Linear layers and recomputes the attention in float64
with ``qkv.attention``; when they differ it names the mistake (scale, softmax axis, head split or
merge, mask fill, causal rule, padding axis). Twelve checks, each ``pass``/``fail``/``skip``.

One module per job:

- ``target``: building and calling the implementation; ``inputs``: what it is fed.
- ``capture``: its Q, K, V from forward hooks; ``probe``: its mask layout and polarity.
- ``diagnose``: the usual mistakes, recomputed, to name the one that matches.
- ``context``: what the checks share; ``checks`` and ``robustness``: the twelve checks.
- ``report``: ``Report``, JSON and the card; ``run``: ``check``, ``assert_attention``, ``load``.
- ``command``: the ``qkv check`` command line; ``tutorials``: ``qkv check --examples``.

``flash``: the package of ``qkv.check(obj, flash=True)`` (``--flash``), which grades a flash
attention instead, against float64 in out, lse and gradients, and for linear memory and skipped
causal work.
"""

from qkv.checker.report import CHECK_IDS, Report, Result
from qkv.checker.run import assert_attention, check, load
from qkv.checker.target import CheckError

__all__ = ["CHECK_IDS", "CheckError", "Report", "Result", "assert_attention", "check", "load"]
