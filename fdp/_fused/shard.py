"""Sharding the fused step over its buckets (ZeRO-1/2): layout, groups and collectives.

``Reducer(params, group, shard=True)``: each bucket of the fused step is padded to a multiple
of the shard group's size ``n`` and cut into ``n`` equal slices; rank ``r`` owns slice ``r``::

    bucket b, padded:  [ leaf 0 | leaf 1 | leaf 2 ...      | pad ]
    slices:            [ rank 0     | rank 1     | rank 2     ]
                         S elements   S elements   S elements    (S = padded / n)

A step fills the bucket as the unsharded step does (local gradients, prescaled by 1/world),
then *reduce-scatters* it: rank ``r`` receives the sum of slice ``r`` over the ranks. It
updates only its slice of the flat params, with only its slice of the optimizer state (one
kernel call per chunk of the slice), and then *all-gathers* the params: every rank ends the
step with the whole updated params, and holds ``1/n`` of the optimizer state. A
reduce-scatter plus an all-gather move the bytes of one all-reduce.

Leaves may straddle slices (a slice is a byte range of the bucket, not a set of leaves), as
in Megatron's distributed optimizer. The padding's params, gradients and state are zeros
and stay zeros under every fdp optimizer (a zero gradient on a zero param changes nothing).

A 2-D ``DeviceMesh`` with dims ``("replicate", "shard")`` (HSDP) reduce-scatters within
``shard``, all-reduces the slice over ``replicate``, updates, and all-gathers within
``shard``; the optimizer state is ``1/shard`` of the whole on every rank.

Order of collectives: a process group needs every rank to issue the same collectives in the
same order. The reduce-scatters are issued in bucket order from the backward's hooks; the
all-gathers are issued only after the last reduce-scatter (and the step's status), in bucket
order, so no rank interleaves them differently from another, however its backward and its
updates are timed. The replicate all-reduces (2-D) have a process group of their own and are
issued in bucket order too.

How the slices move depends on the backend (``Scatter``): NCCL's own reduce-scatter and
all-gather; point-to-point exchanges on gloo; ``all_to_all_single`` elsewhere. The figures
behind the choice are in docs/performance.md ("The sharded step").
"""

from __future__ import annotations

from typing import Any

import torch

from .._comm import collectives as comm
from .._comm.group import Group
from .._plan.bucket import BucketPlan

__all__ = ["Scatter", "Shards"]


class Shards:
    """How each bucket of ``plan`` is cut over ``size`` ranks, from ``rank``'s point of view.

    ``padded[b]``: the bucket's length rounded up to a multiple of ``size``; ``lo[b]:hi[b]``:
    this rank's slice of it. ``Shards(plan, 1, 0)`` is the unsharded layout (the whole bucket).
    """

    __slots__ = ("size", "rank", "padded", "lo", "hi")

    def __init__(self, plan: BucketPlan, size: int, rank: int) -> None:
        self.size, self.rank = size, rank
        self.padded = [-(-b.numel // size) * size for b in plan.buckets]
        per = [p // size for p in self.padded]
        self.lo = [rank * s for s in per]
        self.hi = [(rank + 1) * s for s in per]

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def numel(self, b: int) -> int:
        """Elements of bucket ``b``'s slice (the per-rank optimizer state's length)."""
        return self.hi[b] - self.lo[b]

    def mine(self, b: int, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of bucket ``b``'s padded flat tensor (a view; ``flat`` itself when
        unsharded)."""
        if self.size == 1 and flat.numel() == self.hi[b]:
            return flat
        return flat[self.lo[b]:self.hi[b]]


# ---------------------------------------------------------------------------- collectives
class Scatter:
    """The reduce-scatter of a bucket over the shard group, and the all-gather back.

    ``launch(b, flat)`` starts summing the padded ``flat`` over the shard group into this
    rank's slice of it (returns a work handle); ``finish(b, flat)`` completes the sum once
    that work is done (adds the received slices where the backend has no native
    reduce-scatter). ``gather(b, flat)`` starts the all-gather of every rank's slice of the
    padded ``flat`` into the whole of it; ``gathered(b)`` once that work is done.

    Three ways, by backend. NCCL: its native reduce-scatter and all-gather. gloo: its
    ``reduce_scatter_tensor`` is a whole all-reduce and a copy, and its
    ``all_gather_into_tensor`` makes a bucket-sized temporary on every call (8,195 page
    faults per 32 MiB gather, measured), so fdp exchanges the slices point to point: each
    rank sends slice ``j`` of its bucket to rank ``j`` and receives the others' copies of its
    own slice (a staging buffer of ``world - 1`` slices), then adds them; for the gather it
    sends its updated slice to every rank and receives theirs straight into the bucket (no
    staging). Other backends (the threaded test group has no point-to-point): one
    ``all_to_all_single`` each way through a bucket-sized staging buffer. Staging buffers
    are pooled, each the largest bucket's size, as many as are ever in flight at once.
    """

    def __init__(self, shards: Shards, group: Group) -> None:
        self.shards, self.group = shards, group
        self.mode = {"nccl": "native", "gloo": "p2p"}.get(group.backend, "all_to_all")
        self.peers = [j for j in range(shards.size) if j != shards.rank]
        self.staged: list[torch.Tensor | None] = [None] * len(shards.padded)  # per bucket in flight
        self.spare: list[torch.Tensor] = []

    def _stage(self, b: int, like: torch.Tensor) -> torch.Tensor:
        """A staging buffer shaped like ``like`` for bucket ``b`` (a view of a pooled one)."""
        n = like.numel()
        fits = [i for i, t in enumerate(self.spare) if t.numel() >= n and t.dtype == like.dtype]
        if fits:  # the smallest that fits (popped by index: tensors compare elementwise)
            buf = self.spare.pop(min(fits, key=lambda i: self.spare[i].numel()))
        else:  # the largest bucket's size: any bucket can use it later
            buf = torch.empty(max(self.shards.padded), dtype=like.dtype, device=like.device)
        self.staged[b] = buf
        return buf[:n]

    def _unstage(self, b: int, n: int) -> torch.Tensor:
        """Bucket ``b``'s staging buffer back to the pool; returns its first ``n`` elements."""
        buf, self.staged[b] = self.staged[b], None
        self.spare.append(buf)
        return buf[:n]

    def _slice(self, b: int, flat: torch.Tensor, j: int) -> torch.Tensor:
        size = self.shards.numel(b)
        return flat[j * size:(j + 1) * size]

    def launch(self, b: int, flat: torch.Tensor) -> Any:
        group, s = self.group, self.shards
        what = f"reduce-scatter of bucket {b}"
        if group.process_group is None:
            return comm.DONE
        if self.mode == "native":
            return comm.reduce_scatter(s.mine(b, flat), flat, group, what)
        if self.mode == "all_to_all":
            return comm.all_to_all(self._stage(b, flat), flat, group, what)
        got = self._stage(b, flat).narrow(0, 0, len(self.peers) * s.numel(b)).view(len(self.peers), -1)
        return comm.exchange([(self._slice(b, flat, j), j) for j in self.peers],
                              list(zip(got.unbind(0), self.peers)), group, what, tag=2 * b)

    def finish(self, b: int, flat: torch.Tensor) -> torch.Tensor:
        """This rank's reduced slice (in ``flat``), once ``launch``'s work has completed."""
        s = self.shards
        mine = s.mine(b, flat)
        if self.mode == "native" or self.group.process_group is None:
            return mine
        if self.mode == "all_to_all":  # slice r of every rank, in rank order
            torch.sum(self._unstage(b, s.padded[b]).view(s.size, -1), dim=0, out=mine)
            return mine
        # this rank's own part, then the others' in rank order (for two ranks: a + b, the
        # all-reduce's one addition, so the unsharded step's bits)
        for part in self._unstage(b, len(self.peers) * s.numel(b)).view(len(self.peers), -1):
            mine.add_(part)
        return mine

    def gather(self, b: int, flat: torch.Tensor) -> Any:
        group, s = self.group, self.shards
        what = f"all-gather of bucket {b}'s params"
        if group.process_group is None:
            return comm.DONE
        mine = s.mine(b, flat)
        if self.mode == "native":
            return comm.all_gather_into(flat, mine, group, what)
        if self.mode == "all_to_all":
            send = self._stage(b, flat)
            send.view(s.size, -1).copy_(mine.expand(s.size, -1))  # this rank's slice, for every rank
            return comm.all_to_all(flat, send, group, what)
        return comm.exchange([(mine, j) for j in self.peers], [(self._slice(b, flat, j), j) for j in self.peers],
                              group, what, tag=2 * b + 1)

    def gathered(self, b: int) -> None:
        if self.staged[b] is not None:
            self._unstage(b, 0)
