"""Bridges from qkv to other libraries; each is imported only when used.

- ``qkv.integrations.huggingface``: ``attn_implementation="qkv"`` for transformers models;
  ``qkv.integrations.hf_paged``: their continuous batching (``generate_batch``) on qkv.
"""
