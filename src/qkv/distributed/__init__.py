"""Attention over sequences split across processes: ring attention on ``torch.distributed``.

    import torch.distributed as dist
    from qkv.distributed import ring_attention, shard, unshard

    dist.init_process_group("gloo")           # or "nccl"; torchrun sets rank and world size
    rank, world = dist.get_rank(), dist.get_world_size()
    q_r, k_r, v_r = (shard(x, rank, world) for x in (q, k, v))     # (B, H, T/P, D) each
    out_r = ring_attention(q_r, k_r, v_r, causal=True)             # (B, H, T/P, D)
    out = unshard(out_r)                                            # (B, H, T, D) on every rank

See ``ring_attention`` for the algorithm and its options, ``layout`` for the contiguous and the
load-balanced zigzag layouts, and ``ring_work`` for the work each rank does.
"""

from qkv.distributed.layout import LAYOUTS, RingWork, ring_work, shard, unshard
from qkv.distributed.ring import merge_, ring_attention

__all__ = ["LAYOUTS", "RingWork", "merge_", "ring_attention", "ring_work", "shard", "unshard"]
