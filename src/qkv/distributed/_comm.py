"""Passing tensors one step around a ring of processes, with a deadline on every wait.

Each rank sends to the next rank and receives from the previous one, with ``torch.distributed``
point-to-point operations (``batch_isend_irecv``, which NCCL needs to pair sends and receives
without deadlock and gloo runs as plain ``isend``/``irecv``). A transfer starts in the background
and is waited for later, so that the block of work in between overlaps with the communication.

A peer that dies or hangs must not hang the others: every wait has a deadline, and a failed or
late transfer raises an error that names the peer rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist


class Ring:
    """This rank's place on a ring over the ranks of ``group`` (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: timedelta | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.timeout = timeout
        # Point-to-point operations address peers by their global rank.
        self.next = self._global((self.rank + 1) % self.size)
        self.previous = self._global((self.rank - 1) % self.size)

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def shift(self, tensors: Sequence[torch.Tensor], *, what: str, tag: int) -> Transfer:
        """Start sending ``tensors`` to the next rank and receiving the previous rank's tensors
        of the same shapes; ``Transfer.wait`` returns the received ones. ``tag`` tells apart
        transfers in flight at once (gloo matches by tag; NCCL by order, the same on all ranks).
        """
        if self.size == 1:
            return Transfer(self, [], [], list(tensors), what)
        sends = [t.contiguous() for t in tensors]
        received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in sends]
        ops = [
            dist.P2POp(dist.isend, t, self.next, self.group, tag + i) for i, t in enumerate(sends)
        ] + [
            dist.P2POp(dist.irecv, t, self.previous, self.group, tag + i)
            for i, t in enumerate(received)
        ]
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as error:  # gloo fails at once when a peer's connection is closed
            raise _failure(self, f"exchange {what} with", self.neighbours, error) from error
        return Transfer(self, ops, works, received, what)

    @property
    def neighbours(self) -> str:
        if self.next == self.previous:
            return f"rank {self.next}"
        return f"rank {self.previous} or rank {self.next}"


class Transfer:
    """One shift in flight: its works, and the buffers its receives fill."""

    def __init__(
        self,
        ring: Ring,
        ops: list[dist.P2POp],
        works: list[dist.Work],
        received: list[torch.Tensor],
        what: str,
    ) -> None:
        self.ring, self.ops, self.works, self.received, self.what = ring, ops, works, received, what

    def wait(self) -> list[torch.Tensor]:
        """The tensors received from the previous rank, once every send and receive is done.

        Raises ``TimeoutError`` when one is not done within the ring's timeout, and
        ``RuntimeError`` when the transport fails (e.g. the peer's process exited); both name the
        peer. The process group cannot be used after such an error.
        """
        ring = self.ring
        for index, work in enumerate(self.works):
            if len(self.works) == len(self.ops):
                receiving = self.ops[index].op is dist.irecv
                peer = f"rank {ring.previous}" if receiving else f"rank {ring.next}"
                action = f"receive {self.what} from" if receiving else f"send {self.what} to"
            else:  # the backend coalesced the operations into one work
                peer = ring.neighbours
                action = f"exchange {self.what} with"
            try:
                done = work.wait() if ring.timeout is None else work.wait(ring.timeout)
            except RuntimeError as error:
                raise _failure(ring, action, peer, error) from error
            if done is False:
                raise _failure(ring, action, peer, None)
        # Done: let go of the tensors sent, so that their memory is free for the next step.
        self.ops, self.works = [], []
        return self.received


def _failure(ring: Ring, action: str, peer: str, error: RuntimeError | None) -> Exception:
    global_rank = dist.get_rank()
    me = f"rank {global_rank}"
    detail = "" if error is None else str(error).splitlines()[0]
    if error is None or "timed out" in detail.lower() or "timeout" in detail.lower():
        limit = (
            "the process group's timeout"
            if ring.timeout is None
            else f"{ring.timeout.total_seconds():g} s"
        )
        return TimeoutError(
            f"ring_attention: {me} could not {action} {peer} within {limit}; "
            f"{peer} has died, hung or stopped calling ring_attention ({detail or 'aborted'})"
        )
    return RuntimeError(
        f"ring_attention: {me} could not {action} {peer}; {peer} has probably exited or "
        f"crashed ({detail})"
    )
