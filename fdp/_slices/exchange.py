"""What sharded steps exchange over the shard group, slice by slice: the reduce-scatter and the
all-gather (``Scatter``), the replica all-reduces of a 2-D mesh (``Replicas``), the leaves that
cross a slice boundary for an exact norm (``Straddles``), and whole leaves to and from their
owner rank (``Owners``: Muon's matrices). The slices themselves are ``fdp._slices.geometry``.

A step fills a bucket as the unsharded step does (local gradients, prescaled by 1/world), then
*reduce-scatters* it: rank ``r`` receives the sum of slice ``r`` over the ranks. It updates
only its slice, with only its slice of the optimizer state, and then (``shard=True``)
*all-gathers* the params: a reduce-scatter plus an all-gather move the bytes of one
all-reduce. A 2-D ``DeviceMesh`` with dims ``("replicate", "shard")`` (HSDP) reduce-scatters
within ``shard``, all-reduces the slice over ``replicate``, updates, and all-gathers within
``shard``.

Order of collectives: a process group needs every rank to issue the same collectives in the
same order. The reduce-scatters are issued in bucket order from the backward's hooks; the
all-gathers only after the last reduce-scatter (and the step's status), in bucket order, so
no rank interleaves them differently from another, however its backward and its updates are
timed. The replicate all-reduces (2-D) have a process group of their own and are issued in
bucket order too.

How the slices move depends on the backend (``Scatter``): NCCL's own reduce-scatter and
all-gather; point-to-point exchanges on gloo; ``all_to_all_single`` elsewhere (the figures
behind the choice: docs/measurements.md, "The sharded step (ZeRO-1/2)").
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch

from .._comm import collectives as comm
from .._comm.group import Group
from .._plan.bucket import BucketPlan
from .geometry import Slices

__all__ = ["InTurn", "Owners", "Replicas", "Scatter", "Straddles"]


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
    own slice one peer at a time into a staging buffer of one slice, adding each as it lands
    (``InTurn``); for the gather it
    sends its updated slice to every rank and receives theirs straight into the bucket, or,
    ``apart=True``, through a staging buffer copied into the bucket when the gather is done:
    gloo keeps references to the tensors of its last point-to-point exchanges long after they
    completed, and a bucket of a param set with references that fdp cannot account for is one
    the pure sharded step may not write again (it would make a new set each step). Other
    backends (the threaded test group has no point-to-point): one ``all_to_all_single`` each
    way through a bucket-sized staging buffer. Staging buffers are pooled, as many as are ever
    in flight at once, each as large as any bucket needs for its use: one slice of the largest
    bucket for a gloo reduce-scatter, the largest bucket otherwise.
    """

    def __init__(self, slices: Slices, group: Group) -> None:
        self.slices, self.group = slices, group
        self.mode = {"nccl": "native", "gloo": "p2p"}.get(group.backend, "all_to_all")
        self.peers = [j for j in range(slices.size) if j != slices.rank]
        self.staged: list[torch.Tensor | None] = [None] * len(slices.padded)  # per bucket in flight
        self.spare: list[torch.Tensor] = []
        self.into: list[torch.Tensor | None] = [None] * len(slices.padded)  # (apart) where a gather lands
        # a reduce-scatter's staging on gloo: one peer's copy of this rank's slice of the largest bucket
        self._one = max((slices.numel(c) for c in range(len(slices.padded))), default=0)

    def _stage(self, b: int, like: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """A staging buffer of ``n`` elements (default: ``like``'s) in ``like``'s dtype for
        bucket ``b`` (a view of a pooled one)."""
        n = like.numel() if n is None else n
        fits = [i for i, t in enumerate(self.spare) if t.numel() >= n and t.dtype == like.dtype]
        if fits:  # the smallest that fits (popped by index: tensors compare elementwise)
            buf = self.spare.pop(min(fits, key=lambda i: self.spare[i].numel()))
        else:  # as large as any bucket needs for the same use: any bucket can use it later
            size = self._one if n <= self._one else max(self.slices.padded)
            buf = torch.empty(size, dtype=like.dtype, device=like.device)
        self.staged[b] = buf
        return buf[:n]

    def _unstage(self, b: int, n: int) -> torch.Tensor:
        """Bucket ``b``'s staging buffer back to the pool; returns its first ``n`` elements."""
        buf, self.staged[b] = self.staged[b], None
        self.spare.append(buf)
        return buf[:n]

    def _slice(self, b: int, flat: torch.Tensor, j: int) -> torch.Tensor:
        size = self.slices.numel(b)
        return flat[j * size:(j + 1) * size]

    def launch(self, b: int, flat: torch.Tensor) -> Any:
        group, s = self.group, self.slices
        what = f"reduce-scatter of bucket {b}"
        if group.process_group is None:
            return comm.DONE
        if self.mode == "native":
            return comm.reduce_scatter(s.mine(b, flat), flat, group, what)
        if self.mode == "all_to_all":
            return comm.all_to_all(self._stage(b, flat), flat, group, what)
        sends = comm.exchange([(self._slice(b, flat, j), j) for j in self.peers], [], group, what, tag=2 * b)
        return InTurn(sends.works, s.mine(b, flat), self._stage(b, flat, s.numel(b)), self.peers, group, what, 2 * b)

    def finish(self, b: int, flat: torch.Tensor) -> torch.Tensor:
        """This rank's reduced slice (in ``flat``), once ``launch``'s work has completed."""
        s = self.slices
        mine = s.mine(b, flat)
        if self.mode == "native" or self.group.process_group is None:
            return mine
        if self.mode == "all_to_all":  # slice r of every rank, in rank order
            torch.sum(self._unstage(b, s.padded[b]).view(s.size, -1), dim=0, out=mine)
            return mine
        self._unstage(b, 0)  # (``InTurn`` has added the peers' parts in)
        return mine

    def gather(self, b: int, flat: torch.Tensor, apart: bool = False) -> Any:
        """Start the all-gather of bucket ``b`` into ``flat``; ``apart``: the backend never holds
        ``flat`` itself (gloo: through a staging buffer; see the class docstring)."""
        group, s = self.group, self.slices
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
        target = flat
        if apart:
            target = self._stage(b, flat)
            s.mine(b, target).copy_(mine)
            self.into[b] = flat
        return comm.exchange([(s.mine(b, target), j) for j in self.peers],
                             [(self._slice(b, target, j), j) for j in self.peers], group, what, tag=2 * b + 1)

    def gathered(self, b: int) -> None:
        into, self.into[b] = self.into[b], None
        if into is not None:  # (apart) the staging buffer holds the whole bucket now
            into.copy_(self.staged[b][:into.numel()])
        if self.staged[b] is not None:
            self._unstage(b, 0)


class InTurn(comm.Batch):
    """A gloo reduce-scatter's work (``Scatter.launch``): the sends of the other ranks' slices,
    all posted at once, and the receives of this rank's slice from each peer, one at a time
    into one slice of staging, each added into ``mine`` as it lands: this rank's own part
    first, then the peers' in rank order (for two ranks: a + b, the all-reduce's one addition,
    so the unsharded step's bits). The first receive is posted at launch, each next one once
    the one before has been waited for and added, so the staging is one slice, not
    ``world - 1``.

    It advances only in ``wait`` (gloo's point-to-point works read as complete only once
    waited for, and waiting for one twice waits for a second message). Ranks wait for a
    bucket's reduce-scatter at the same point of the step (the step machine needs the buffer,
    or the step ends), and every rank posts all its sends at launch: a rank waiting here for
    its own sends needs only that each peer reaches the same wait, never anything a peer
    issues after it."""

    __slots__ = ("sends", "mine", "got", "peers", "group", "what", "tag", "k", "recv")

    def __init__(self, sends: list[Any], mine: torch.Tensor, got: torch.Tensor, peers: list[int], group: Group,
                 what: str, tag: int) -> None:
        self.sends, self.mine, self.got, self.peers = sends, mine, got, peers
        self.group, self.what, self.tag = group, what, tag
        self.k = 0
        self.recv: comm.Batch | None = self._post()
        super().__init__([*self.recv.works, *sends])

    def _post(self) -> comm.Batch:
        return comm.exchange([], [(self.got, self.peers[self.k])], self.group, self.what, self.tag)

    def is_completed(self) -> bool:
        return self.recv is None and all(w.is_completed() for w in self.sends)

    def wait(self, timeout: timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()

        def left() -> timedelta | None:
            return None if deadline is None else timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        while self.recv is not None:
            self.recv.wait(left())
            self.mine.add_(self.got)
            self.k += 1
            self.recv = self._post() if self.k < len(self.peers) else None
            self.works = [*(self.recv.works if self.recv is not None else ()), *self.sends]
        return super().wait(left())


class Replicas:
    """The replica all-reduces of a 2-D mesh (HSDP): each bucket's reduced slice is summed
    over ``replicate`` too, issued in bucket order as slices arrive (its own process group,
    so it never interleaves with the shard group's collectives)."""

    def __init__(self, group: Group, nb: int) -> None:
        self.group = group
        self.slices: list[torch.Tensor | None] = [None] * nb
        self.works: list[Any] = [None] * nb
        self.issued = 0  # buckets whose replica all-reduce was issued (in order)
        self.landed = 0  # ... and of those, whose all-reduce is done (in order)

    def arrive(self, b: int, mine: torch.Tensor) -> list[int]:
        """Bucket ``b``'s slice is reduced over the shard group: issue what is next in order;
        returns the buckets whose replica sum has landed since (in order)."""
        self.slices[b] = mine
        self._issue()
        out = []
        while self.landed < self.issued and self.works[self.landed].is_completed():
            out.append(self._land())
        return out

    def _issue(self, fill: Any = None) -> None:
        nb = len(self.slices)
        while self.issued < nb and (self.slices[self.issued] is not None or fill is not None):
            b = self.issued
            if self.slices[b] is None:
                self.slices[b] = fill(b)
            self.works[b] = comm.all_reduce(self.slices[b], self.group, f"replica all-reduce of bucket {b}",
                                            async_op=True)
            self.issued += 1

    def _land(self) -> int:
        b = self.landed
        self.works[b] = None
        self.landed += 1
        return b

    def wait_all(self) -> list[int]:
        """Wait for the replica sums still in flight; returns their buckets in order."""
        out = []
        while self.landed < self.issued:
            comm.wait(self.works[self.landed], self.group, f"replica all-reduce of bucket {self.landed}")
            out.append(self._land())
        return out

    def drain(self, zeros: Any) -> None:
        """A failed step: issue this rank's share of every replica all-reduce the others may
        be waiting in (``zeros(b)`` for slices that never arrived), and wait for them."""
        self._issue(fill=zeros)
        for b in range(self.landed, self.issued):
            try:
                comm.wait(self.works[b], self.group, f"replica all-reduce of bucket {b}")
            except Exception:  # noqa: BLE001 - the step's own error is the one to raise
                pass
        self.landed = self.issued


class Straddles:
    """Per-leaf statistics of a sharded step (the norm of each leaf, for an exact global norm).

    A leaf belongs to the rank whose slice holds its first element. Leaves inside their
    owner's slice are measured there as their bucket lands. A leaf that crosses a slice
    boundary is sent whole to its owner first: each other rank holding part of it sends that
    part (one ``all_to_all_single`` of bytes per bucket that has such leaves, ``buckets``:
    a rank holds one bucket's straddling leaves whole at a time, not every bucket's: 57 MiB
    less at the peak of ``bench large`` at 4 ranks). Then each leaf's statistic is
    computed by exactly one rank, on the whole leaf, as the unsharded step computes it, and
    ``gather`` puts every rank's statistics together with one all-reduce in which each leaf
    has one non-zero contribution (exact: ``x + 0 = x``).
    """

    def __init__(self, plan: BucketPlan, slices: Slices) -> None:
        self.plan, self.slices = plan, slices
        n, me = slices.size, slices.rank
        self.inside: list[list[tuple[int, int]]] = []  # per bucket: (leaf, its offset in my slice)
        # Per bucket: the straddling leaves I own, ``(leaf, its offset in the bucket)``; the parts I send to rank j and receive from
        # rank k, ``(leaf, lo, hi)``; and the buckets with any straddling leaf (every rank's
        # plan is known, so every rank finds the same ones), in order.
        nb = len(plan.buckets)
        self.mine: list[list[tuple[int, int]]] = [[] for _ in range(nb)]
        self.sends: list[list[list[tuple[int, int, int]]]] = [[[] for _ in range(n)] for _ in range(nb)]
        self.recvs: list[list[list[tuple[int, int, int]]]] = [[[] for _ in range(n)] for _ in range(nb)]
        self.buckets: list[int] = []
        for b in plan.buckets:
            per = slices.padded[b.index] // n
            inside = []
            for i, off, numel in zip(b.leaves, b.offsets, b.numels):
                if numel == 0:
                    continue
                owner, last = off // per, (off + numel - 1) // per
                if owner == last:
                    if owner == me:
                        inside.append((i, off - me * per))
                    continue
                if not self.buckets or self.buckets[-1] != b.index:
                    self.buckets.append(b.index)
                if owner == me:
                    self.mine[b.index].append((i, off))
                for k in range(owner + 1, last + 1):
                    lo, hi = max(off, k * per), min(off + numel, (k + 1) * per)
                    if k == me:
                        self.sends[b.index][owner].append((i, lo, hi))
                    if owner == me:
                        self.recvs[b.index][k].append((i, lo, hi))
            self.inside.append(inside)

    def inside_views(self, b: int, mine: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
        """Bucket ``b``'s leaves inside this rank's slice ``mine``, as views shaped like them."""
        slots = self.plan.slots
        leaves = [i for i, _ in self.inside[b]]
        views = [mine[o:o + slots[i].numel].view(slots[i].shape) for i, o in self.inside[b]]
        return leaves, views

    def exchange(self, grads: list[torch.Tensor], group: Group, bucket: int) -> tuple[list[int], list[torch.Tensor]]:
        """The straddling leaves of ``bucket`` (one of ``buckets``) this rank owns, whole
        (``grads``: every bucket's reduced slice, in the params' dtype). A collective over the
        shard group."""
        if group.process_group is None:
            return [], []
        s, slots, b = self.slices, self.plan.slots, bucket
        sends, recvs = self.sends[b], self.recvs[b]

        def part(lo: int, hi: int) -> torch.Tensor:
            return grads[b][lo - s.lo[b]:hi - s.lo[b]].reshape(-1).view(torch.uint8)

        out_parts = [part(lo, hi) for j in range(s.size) for i, lo, hi in sends[j]]
        send = torch.cat(out_parts) if out_parts else torch.empty(0, dtype=torch.uint8, device=group.device)
        in_sizes = [sum((hi - lo) * slots[i].dtype.itemsize for i, lo, hi in sends[j]) for j in range(s.size)]
        out_sizes = [sum((hi - lo) * slots[i].dtype.itemsize for i, lo, hi in recvs[k]) for k in range(s.size)]
        recv = torch.empty(sum(out_sizes), dtype=torch.uint8, device=send.device)
        what = f"exchange of bucket {b}'s leaves that cross a slice boundary (per-leaf statistics)"
        comm.wait(comm.all_to_all(recv, send, group, what, out_splits=out_sizes, in_splits=in_sizes), group, what)
        del send, out_parts
        got: dict[int, list[torch.Tensor]] = {}
        pos = 0
        for k in range(s.size):
            for i, lo, hi in recvs[k]:
                nbytes = (hi - lo) * slots[i].dtype.itemsize
                got.setdefault(i, []).append(recv[pos:pos + nbytes].view(slots[i].dtype))
                pos += nbytes
        leaves, wholes = [], []
        for i, off in self.mine[b]:
            own = grads[b][off - s.lo[b]:s.hi[b] - s.lo[b]]
            leaves.append(i)
            wholes.append(torch.cat([own, *got[i]]).view(slots[i].shape))
        return leaves, wholes

    def gather(self, stats: dict[int, torch.Tensor], group: Group) -> list[torch.Tensor]:
        """Every leaf's statistic on every rank, in leaf order (``stats``: this rank's, by
        leaf; each leaf on exactly one rank). One all-reduce of float64 values."""
        slots = self.plan.slots
        vec = torch.zeros(len(slots), dtype=torch.float64, device=group.device)
        dtypes: list[torch.dtype | None] = [None] * len(slots)
        for i, v in stats.items():
            vec[i] = v.to(device=vec.device, dtype=torch.float64)
            dtypes[i] = v.dtype
        comm.all_reduce(vec, group, "all-reduce of the per-leaf statistics")
        # A statistic has its leaf's dtype (a norm does); float64 holds every such value exactly.
        return [vec[i].to(dtypes[i] or slots[i].dtype) for i in range(len(slots))]


class Owners:
    """Whole leaves in a sharded step (Muon's matrices): each has one owner rank, which
    updates it whole with its own state (the state of a matrix lives on its owner only).

    Owners are chosen greedily by cost (``rows * cols * min(rows, cols)``, a Newton-Schulz
    iteration's), the costliest leaf first, each to the least loaded rank, so every rank's
    share of the work (and of the state) is within one matrix of 1/world. A step moves each
    owned leaf's reduced gradient to its owner (``to_owners``: every part held in another
    rank's slice, one ``all_to_all_single`` of bytes for all of them) and, once the owner has
    updated it, the parts of the new params back to the ranks whose slices hold them
    (``to_holders``), before the params' all-gather.
    """

    def __init__(self, plan: BucketPlan, slices: Slices, leaves: list[int]) -> None:
        self.plan, self.slices = plan, slices
        n, me = slices.size, slices.rank
        slots = plan.slots
        load = [0] * n
        self.owner: dict[int, int] = {}
        for i in sorted(leaves, key=lambda i: (-_cost(slots[i].shape), i)):
            r = min(range(n), key=lambda r: (load[r], r))
            self.owner[i] = r
            load[r] += _cost(slots[i].shape)
        # per leaf: its parts (bucket, lo, hi, holder), the slices of the bucket it crosses
        self.parts: dict[int, list[tuple[int, int, int, int]]] = {}
        for i in leaves:
            s = slots[i]
            b = s.bucket
            per = slices.padded[b] // n
            self.parts[i] = [(b, max(s.offset, r * per), min(s.offset + s.numel, (r + 1) * per), r)
                             for r in range(n) if max(s.offset, r * per) < min(s.offset + s.numel, (r + 1) * per)]
        self.mine = sorted(i for i, r in self.owner.items() if r == me)
        self.any = bool(leaves) and n > 1

    def _bytes(self, i: int, lo: int, hi: int) -> int:
        return (hi - lo) * self.plan.slots[i].dtype.itemsize

    def in_bucket(self, b: int) -> list[int]:
        """The whole leaves of bucket ``b`` (each exchanged with its owner)."""
        return [i for i in sorted(self.parts) if self.plan.slots[i].bucket == b]

    def to_owners(self, grads: list[torch.Tensor], group: Group, b: int | None = None) -> dict[int, torch.Tensor]:
        """Every leaf this rank owns (of bucket ``b`` only, if given), whole, in its shape, from
        the ranks' slices (``grads``: this rank's slice of each bucket, the params' dtype: the
        reduced gradients, or the params of a fully sharded step). A collective."""
        s, me, slots = self.slices, self.slices.rank, self.plan.slots
        sends = [[] for _ in range(s.size)]
        recvs = [[] for _ in range(s.size)]
        for i, parts in sorted(self.parts.items()):
            if b is not None and slots[i].bucket != b:
                continue
            o = self.owner[i]
            for c, lo, hi, r in parts:
                if r == me and o != me:
                    sends[o].append(grads[c][lo - s.lo[c]:hi - s.lo[c]].reshape(-1).view(torch.uint8))
                if o == me and r != me:
                    recvs[r].append((i, lo, hi))
        mine = [i for i in self.mine if b is None or slots[i].bucket == b]
        out = {i: torch.empty(slots[i].numel, dtype=slots[i].dtype, device=grads[0].device if grads else None)
               for i in mine}
        for i in mine:  # this rank's own parts
            for c, lo, hi, r in self.parts[i]:
                if r == me:
                    off = slots[i].offset
                    out[i][lo - off:hi - off] = grads[c][lo - s.lo[c]:hi - s.lo[c]]
        got = self._exchange(sends, recvs, group, "exchange of whole leaves' gradients to their owners")
        for (i, lo, hi), part in got:
            off = slots[i].offset
            out[i][lo - off:hi - off] = part.view(slots[i].dtype)
        return {i: t.view(slots[i].shape) for i, t in out.items()}

    def to_holders(self, flats: list[torch.Tensor], group: Group,
                   wholes: dict[int, torch.Tensor] | None = None, b: int | None = None) -> None:
        """The owners' updated leaves into the slices of the ranks that hold their parts. A
        collective. ``flats``: this rank's whole buckets (the leaves updated in them, before
        the all-gather: ``shard=True``); or, with ``wholes`` (the owned leaves, updated apart),
        this rank's slices of each bucket, its own parts copied in too (fully sharded params)."""
        s, me, slots = self.slices, self.slices.rank, self.plan.slots
        sliced = wholes is not None

        def at(b: int, lo: int, hi: int) -> torch.Tensor:  # elements lo:hi of bucket b in ``flats``
            return flats[b][lo - s.lo[b]:hi - s.lo[b]] if sliced else flats[b][lo:hi]

        def new(i: int, b: int, lo: int, hi: int) -> torch.Tensor:  # the owner's updated elements
            off = slots[i].offset
            return wholes[i].reshape(-1)[lo - off:hi - off] if sliced else flats[b][lo:hi]

        sends = [[] for _ in range(s.size)]
        recvs = [[] for _ in range(s.size)]
        for i, parts in sorted(self.parts.items()):
            if b is not None and slots[i].bucket != b:
                continue
            o = self.owner[i]
            for c, lo, hi, r in parts:
                if o == me and r != me:
                    sends[r].append(new(i, c, lo, hi).reshape(-1).view(torch.uint8))
                if r == me and o != me:
                    recvs[o].append((i, lo, hi))
                if sliced and r == me and o == me:
                    at(c, lo, hi).copy_(new(i, c, lo, hi))
        got = self._exchange(sends, recvs, group, "exchange of whole leaves' new params to their slices")
        for (i, lo, hi), part in got:
            at(slots[i].bucket, lo, hi).copy_(part.view(slots[i].dtype))

    def _exchange(self, sends: list[list[torch.Tensor]], recvs: list[list[tuple[int, int, int]]], group: Group,
                  what: str) -> list[tuple[tuple[int, int, int], torch.Tensor]]:
        device = group.device
        parts = [t for per in sends for t in per]
        send = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
        in_sizes = [sum(t.numel() for t in per) for per in sends]
        out_sizes = [sum(self._bytes(i, lo, hi) for i, lo, hi in per) for per in recvs]
        recv = torch.empty(sum(out_sizes), dtype=torch.uint8, device=device)
        comm.wait(comm.all_to_all(recv, send, group, what, out_splits=out_sizes, in_splits=in_sizes), group, what)
        out, pos = [], 0
        for per in recvs:
            for i, lo, hi in per:
                n = self._bytes(i, lo, hi)
                out.append(((i, lo, hi), recv[pos:pos + n]))
                pos += n
        return out


def _cost(shape: tuple[int, ...]) -> int:
    """A Newton-Schulz iteration's cost on a matrix of ``shape``: rows * cols * min(rows, cols)."""
    m, n = (shape[0], shape[1]) if len(shape) == 2 else (max(1, shape[0] if shape else 1), 1)
    return m * n * min(m, n)
