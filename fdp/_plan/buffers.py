"""``BucketBuffers``: the one owner of the flat buffers a Reducer's steps fill and hand out.

Two policies (the Reducer's ``grad_views``):

* handed over (default): a bucket filled in the gradients' own dtype, once reduced,
  *becomes* the returned gradients (views into it, no copy); the caller owns it from then
  on. Its memory is filled again for a later step only once the caller has dropped every
  view of it (``held_elsewhere``), so a loop that rebinds ``grads`` each step cycles through
  two sets of buffers and allocates nothing in steady state, as DDP reuses its buckets.
* reuse (``grad_views=True``, DDP's ``gradient_as_bucket_view``): every buffer is allocated
  once and reused each step; the returned gradients are views into it, valid until the next
  call.

Buckets that travel in another dtype than the gradients (``reduce_dtype``, compressing
hooks) always fill a persistent wire buffer (scratch), and the result is cast into fresh
tensors (or into persistent result buffers under reuse).

A third policy serves fully sharded params (``Reducer(shard="params")``), where a buffer per
bucket would be a whole set of gradients on every rank: *transient* buffers, a few shared by
the buckets in flight (``transient=n``: at most ``n`` per wire dtype, each the largest
padded bucket's size). ``wire(b)`` lends one (None when all are lent: the step machine then
waits for its oldest collective), ``release(b)`` takes it back once the bucket's reduced
slice has been copied out.
"""

from __future__ import annotations

import torch

from .._internals import storage_use_count
from .bucket import BucketPlan

# References a tensor that nothing else refers to shows (``t`` and the storage object held while
# counting): measured, not assumed, as it has changed between torch releases. (None: torch
# cannot count, ``fdp._internals.storage_use_count``, and nothing is reused.)
_ALONE = storage_use_count(torch.empty(1))


def held_elsewhere(t: torch.Tensor, known: int = 0) -> bool:
    """Whether anything besides ``t`` itself (and ``known`` references of fdp's own to its
    memory: views it keeps for its own reads) refers to its memory (a view, a detached alias,
    a numpy array): then fdp must not write into it. True when torch cannot tell."""
    if _ALONE is None:
        return True
    return storage_use_count(t) > _ALONE + known


# Handed-over buffers tracked per bucket: the one the caller holds while the next step runs
# (``grads`` is rebound only after the call returns) and the one that step fills.
POOL_SIZE = 2


class Pool:
    """Flat buffers handed out to callers, filled again once nothing outside refers to them."""

    __slots__ = ("numel", "dtype", "device", "held")

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.held: list[torch.Tensor] = []

    def take(self) -> torch.Tensor:
        for t in self.held:
            if not held_elsewhere(t):
                return t
        t = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.held.append(t)
        if len(self.held) > POOL_SIZE:  # the caller keeps old gradients: stop tracking the oldest
            self.held.pop(0)
        return t


class BucketBuffers:
    """Flat buffers for ``plan``'s buckets, travelling in ``wire`` dtypes (one per bucket)."""

    def __init__(self, plan: BucketPlan, wire: list[torch.dtype], *, reuse: bool,
                 padded: list[int] | None = None, transient: int = 0) -> None:
        self.plan, self.wire_dtypes, self.reuse = plan, list(wire), reuse
        # Wire lengths: the buckets' own, or (a sharded step) rounded up to a multiple of the
        # shard group's size; the padding is zeros, never filled (only with ``reuse``).
        self.padded = padded if padded is not None else [b.numel for b in plan.buckets]
        if padded is not None and not reuse:
            raise ValueError("BucketBuffers: padded buffers must be reused (their padding stays zero)")
        self._wire: list[torch.Tensor | None] = [None] * len(plan.buckets)
        self._results: list[torch.Tensor | None] = [None] * len(plan.buckets)
        self._handed = [Pool(b.numel, w, b.device) for b, w in zip(plan.buckets, self.wire_dtypes)]
        self._casts = [Pool(b.numel, b.dtype, b.device) for b in plan.buckets]
        # transient: the buffers made so far per wire dtype, the free ones, and which is lent to whom
        self.transient = transient
        self._made: dict[torch.dtype, int] = {}
        self._free: dict[torch.dtype, list[torch.Tensor]] = {}
        self._lent: list[torch.Tensor | None] = [None] * len(plan.buckets)

    def wire(self, b: int) -> torch.Tensor | None:
        """The 1-D buffer bucket ``b`` is filled in this step (transient: None when every
        buffer is lent)."""
        bucket = self.plan.buckets[b]
        dtype = self.wire_dtypes[b]
        n = self.padded[b]
        if self.transient:
            return self._lend(b, bucket, dtype, n)
        if self.reuse or dtype != bucket.dtype:
            buf = self._wire[b]
            if buf is None:
                make = torch.zeros if n != bucket.numel else torch.empty
                buf = self._wire[b] = make(n, dtype=dtype, device=bucket.device)
            return buf
        return self._handed[b].take()

    def _lend(self, b: int, bucket, dtype: torch.dtype, n: int) -> torch.Tensor | None:
        buf = self._lent[b]
        if buf is not None:
            return buf[:n]
        free = self._free.setdefault(dtype, [])
        if free:
            buf = free.pop()
        elif self._made.get(dtype, 0) < self.transient:
            self._made[dtype] = self._made.get(dtype, 0) + 1
            buf = torch.empty(max(p for p, w in zip(self.padded, self.wire_dtypes) if w == dtype), dtype=dtype,
                              device=bucket.device)
        else:
            return None
        self._lent[b] = buf
        if n != bucket.numel:
            buf[bucket.numel:n].zero_()  # the padding (shared with other buckets' longer data)
        return buf[:n]

    def release(self, b: int) -> None:
        """Bucket ``b``'s transient buffer is free again (no-op otherwise)."""
        buf = self._lent[b] if self.transient else None
        if buf is not None:
            self._lent[b] = None
            self._free[buf.dtype].append(buf)

    def release_all(self) -> None:
        """A new step: every transient buffer is free (a failed step may have left some lent)."""
        if self.transient:
            for b in range(len(self._lent)):
                self.release(b)

    def nbytes(self) -> int:
        """Bytes of every buffer held (each storage once)."""
        held = [*self._wire, *self._results, *(t for p in (*self._handed, *self._casts) for t in p.held),
                *(t for ts in self._free.values() for t in ts), *self._lent]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held if t is not None}
        return sum(storages.values())

    def grads(self, results: list[torch.Tensor], flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per bucket, the flat tensor in the gradients' dtype that the returned gradients view."""
        outs = []
        for b, (bucket, r, f) in enumerate(zip(self.plan.buckets, results, flats)):
            ours = r.untyped_storage().data_ptr() == f.untyped_storage().data_ptr()
            if r.dtype == bucket.dtype and ours:
                outs.append(r)  # fresh this step (handed over), or the reused buffer itself
            elif not self.reuse:
                # A hook's own memory is never handed out (it may reuse it), nor is the wire
                # buffer of a cast: the values go into a buffer of the caller's own.
                outs.append(self._casts[b].take().copy_(r))
            else:
                res = self._results[b]
                if res is None:
                    res = self._results[b] = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
                outs.append(res.copy_(r))
        return outs
