"""attention-gym's ALiBi + document masking, ported to qkv and trained on the CPU.

FlexAttention code runs on qkv by changing one import:

    from torch.nn.attention.flex_attention import flex_attention      # forward only on the CPU
    from qkv import flex_attention                                    # forward and backward

The rule is attention-gym's: a causal mask inside each packed document (``mask_mod``, turned
into a ``BlockMask`` by torch's ``create_block_mask``) and ALiBi (``score_mod``) — here with
learned slopes, so the gradient has to reach a tensor the score_mod captures. A one-layer model
learns to copy the token one position back within each document; the loss falls, the slopes move.

    python examples/flex_alibi_documents.py [--steps 60]
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

from qkv import flex_attention

VOCAB, DIM, HEADS, LENGTH, DOCUMENTS = 32, 32, 4, 384, 6


def document_ids(length: int, documents: int, generator: torch.Generator) -> torch.Tensor:
    """(length,) int: the document each position belongs to (random lengths, packed)."""
    cuts = torch.randperm(length - 1, generator=generator)[: documents - 1] + 1
    starts = torch.zeros(length, dtype=torch.long)
    starts[cuts] = 1
    return starts.cumsum(0)


class AlibiDocumentAttention(nn.Module):
    """One attention layer whose rule is written as FlexAttention mods."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.position = nn.Embedding(LENGTH, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, VOCAB)
        # ALiBi's slopes 2^(-8h/H), learned from there (log-parametrised: they stay positive)
        start = torch.tensor([-8.0 * (h + 1) / HEADS * math.log(2.0) for h in range(HEADS)])
        self.log_slopes = nn.Parameter(start)

    def forward(self, tokens: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, VOCAB) for packed documents ``ids`` (T,)."""
        b, t = tokens.shape
        x = self.embed(tokens) + self.position(torch.arange(t))
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        slopes = self.log_slopes.exp()

        def alibi(score, b, h, q_idx, kv_idx):  # attention-gym's score_mod, slopes learned
            return score + slopes[h] * (kv_idx - q_idx)

        def causal_documents(b, h, q_idx, kv_idx):  # attention-gym's document mask_mod
            return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

        block_mask = create_block_mask(causal_documents, None, None, t, t, device="cpu")
        y = flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask)
        return self.out(y.transpose(1, 2).reshape(b, t, DIM))


def batch(generator: torch.Generator, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and their targets: the previous token of the same document (0 at a start)."""
    tokens = torch.randint(1, VOCAB, (8, LENGTH), generator=generator)
    previous = torch.cat([torch.zeros(8, 1, dtype=torch.long), tokens[:, :-1]], dim=1)
    starts = torch.cat([torch.tensor([True]), ids[1:] != ids[:-1]])
    return tokens, previous.masked_fill(starts, 0)


def agrees_with_torch(model: AlibiDocumentAttention, ids: torch.Tensor) -> float:
    """Largest difference between qkv's and torch's forward on this rule (torch: eager CPU)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, HEADS, LENGTH, 8, generator=gen) for _ in range(3))
    slopes = model.log_slopes.detach().exp()

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def causal_documents(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(causal_documents, None, None, LENGTH, LENGTH, device="cpu")
    with warnings.catch_warnings():  # torch warns that its CPU path is unfused
        warnings.simplefilter("ignore", UserWarning)
        theirs = torch_flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask)
    ours = flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask)
    return float((ours - theirs).abs().max())


def main(steps: int = 60) -> dict[str, float]:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    ids = document_ids(LENGTH, DOCUMENTS, generator)
    model = AlibiDocumentAttention()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    slopes_before = model.log_slopes.detach().exp().clone()
    losses = []
    for step in range(steps):
        tokens, targets = batch(generator, ids)
        loss = nn.functional.cross_entropy(model(tokens, ids).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}")
    moved = float((model.log_slopes.detach().exp() - slopes_before).abs().max())
    difference = agrees_with_torch(model, ids)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; ALiBi slopes moved by up to {moved:.4f}")
    print(
        f"qkv.flex_attention vs torch's flex_attention (forward): max difference {difference:.1e}"
    )
    return {"first": losses[0], "last": losses[-1], "moved": moved, "difference": difference}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    main(parser.parse_args().steps)
