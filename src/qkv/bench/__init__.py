"""``qkv bench``: qkv's attention backends against PyTorch's, measured in one run.

One module per job:

- ``cases``: what is measured (``Case``: level, pass, dtype, mask, T; ``Shape``: B, H, D) and
  the work each case does (``Shape.flops``).
- ``timing``: interleaved repetitions and their medians; the matrix-multiply rate probe.
- ``runs``: the functional and module cases, each implementation's step, and the timed table.
- ``memory``: the peak memory a case adds; a fresh worker process for one long causal step.
- ``decode``: token-by-token decoding with a ``qkv.KVCache`` against recomputing the prefix.
- ``auto``: every backend on the calls that decide what ``backend="auto"`` picks.
- ``compile``: training steps of a small GPT-style model under ``torch.compile`` and eager,
  qkv's attention against torch's ``scaled_dot_product_attention``; graph breaks counted.
- ``report``: the machine, the text tables, JSON and the plot.
- ``command``: the ``qkv bench`` command line.

Legend: B batch, H heads, T sequence length (queries = keys), D features per head, E = H·D.
"""
