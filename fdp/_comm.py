"""Collectives with a timeout and an error message that says what failed and where.

Every collective fdp issues goes through here. A world of one (``group.process_group is
None``) never communicates: the calls return their input.
"""

from __future__ import annotations

import collections
import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._errors import CollectiveError, ReplicaMismatchError
from ._group import Group, keep_until_exit, mark_failed
from ._log import debug_mode


class Done:
    """A work handle for something that already happened (world of one, sync backends)."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut


DONE = Done()

# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single (absent before).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# The small tensors of recent collectives (counts, digests, flags), held a little longer than
# their callers hold them. gloo's worker thread drops its reference to a finished collective
# after the caller has seen it complete; when that is the last reference to a tensor made in
# Python, the thread must take the GIL to free it, and at interpreter shutdown it cannot: the
# process aborts ("terminate called without an active exception"; see
# fdp._group.keep_until_exit for the stack). Holding them here makes the main thread the one
# that frees them. Large tensors (buckets) are held by their owners anyway; the bound (64 KiB
# each, 2 MiB in all) covers the RNG states of fdp.rng_state (about 5 KB), which nothing
# else holds once the gather returns.
_RECENT: collections.deque = collections.deque(maxlen=32)
_SMALL_BYTES = 64 * 1024


def _hold(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.numel() * t.element_size() <= _SMALL_BYTES:
            _RECENT.append(t)


def completed(value: Any) -> torch.futures.Future:
    """A Future that already holds ``value``."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def is_completed(handle: Any) -> bool:
    """Whether a work handle or Future has finished (never blocks)."""
    return handle.is_completed() if hasattr(handle, "is_completed") else handle.done()


def collective_error(group: Group, what: str, exc: BaseException) -> CollectiveError:
    """The error for a collective ``what`` that raised ``exc``: names the rank and timeout.

    Also marks the process group as failed, so that the exit hook of ``fdp.init`` does not
    meet the other ranks in a barrier over connections that may be broken.
    """
    mark_failed()
    if debug_mode():  # the advice to set it would be noise; say what it already ruled out
        hint = ("FDP_DEBUG is on, so a Reducer bucket issued differently by another rank would "
                "have been named before it launched: look first for a rank that died or stalled")
    else:
        hint = "set FDP_DEBUG=1 to check collective fingerprints"
    return CollectiveError(
        f"fdp: {what} failed on rank {group.rank} of {group.size} "
        f"(timeout {group.timeout.total_seconds():g}s): {exc}. "
        f"Another rank probably died, skipped this collective, or issued a different one ({hint})."
    )


def wait(work: Any, group: Group, what: str) -> None:
    """Wait for ``work`` within the group's timeout; raise ``CollectiveError`` naming ``what``."""
    try:
        if group.backend == "threaded":
            work.wait()  # the threaded test PG has no timed wait; run() enforces its deadline
        else:
            work.wait(group.timeout)
    except Exception as e:
        if group.backend != "threaded":  # threads share this process: nothing outlives it
            keep_until_exit(work, group)
        raise collective_error(group, what, e) from e


def all_reduce(t: torch.Tensor, group: Group, what: str, *, async_op: bool = False, op: str = "sum") -> Any:
    """All-reduce of ``t`` in place (``op``: ``"sum"`` or ``"max"``). Returns a work handle
    when ``async_op``."""
    if group.process_group is None:
        return DONE if async_op else None
    try:
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        work = dist.all_reduce(t, op=reduce_op, group=group.process_group, async_op=True)
    except Exception as e:
        raise collective_error(group, what, e) from e
    _hold(t)
    if async_op:
        return work
    wait(work, group, what)
    return None


def broadcast(t: torch.Tensor, src: int, group: Group, what: str, *, async_op: bool = False) -> Any:
    """Broadcast ``t`` in place from group rank ``src``."""
    if group.process_group is None:
        return DONE if async_op else None
    try:
        gsrc = dist.get_global_rank(group.process_group, src)
        work = dist.broadcast(t, src=gsrc, group=group.process_group, async_op=True)
    except Exception as e:
        raise collective_error(group, what, e) from e
    _hold(t)
    if async_op:
        return work
    wait(work, group, what)
    return None


def reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group: Group, what: str) -> Any:
    """Launch a SUM reduce-scatter of the 1-D ``flat`` (its length a multiple of the group's
    size) into ``out`` (this rank's slice; may be a view into ``flat``). Returns the work."""
    try:
        return dist.reduce_scatter_tensor(out, flat, group=group.process_group, async_op=True)
    except Exception as e:
        raise collective_error(group, what, e) from e


def all_to_all(out: torch.Tensor, flat: torch.Tensor, group: Group, what: str) -> Any:
    """Launch an all-to-all of equal slices: slice ``j`` of ``flat`` goes to rank ``j``, and
    ``out``'s slice ``i`` receives rank ``i``'s. Returns the work."""
    try:
        return dist.all_to_all_single(out, flat, group=group.process_group, async_op=True)
    except Exception as e:
        raise collective_error(group, what, e) from e


class Batch:
    """Work handles of several point-to-point operations, completed and waited as one."""

    __slots__ = ("works",)

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout: timedelta | None = None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group: Group,
             what: str, tag: int) -> Batch:
    """Launch a send of each ``(tensor, peer)`` of ``sends`` and a receive into each of ``recvs``
    (peers are group ranks; ``tag`` tells concurrent exchanges apart). Returns one handle."""
    pg = group.process_group
    try:
        works = [dist.isend(t, dist.get_global_rank(pg, j), group=pg, tag=tag) for t, j in sends]
        works += [dist.irecv(t, dist.get_global_rank(pg, j), group=pg, tag=tag) for t, j in recvs]
    except Exception as e:
        raise collective_error(group, what, e) from e
    return Batch(works)


def all_gather_into(out: torch.Tensor, mine: torch.Tensor, group: Group, what: str) -> Any:
    """Launch an all-gather of every rank's ``mine`` into ``out`` in rank order (``mine`` may be
    this rank's slice of ``out``). Returns the work."""
    try:
        return _all_gather_single(out, mine, group=group.process_group, async_op=True)
    except Exception as e:
        raise collective_error(group, what, e) from e


def all_gather(t: torch.Tensor, group: Group, what: str) -> torch.Tensor:
    """Gather equal-shaped tensors: returns ``[group.size, *t.shape]``."""
    work, out = all_gather_start(t, group, what)
    wait(work, group, what)
    return out


def all_gather_start(t: torch.Tensor, group: Group, what: str) -> tuple[Any, torch.Tensor]:
    """Launch an all-gather of ``t``; returns ``(work, out)``: ``out`` is ``[group.size, *t.shape]``
    and holds every rank's ``t`` once ``wait(work, group, what)`` returns."""
    if group.process_group is None:
        return DONE, t.unsqueeze(0).clone()
    out = t.new_empty(group.size * t.numel())
    src = t.contiguous().view(-1)
    try:
        work = _all_gather_single(out, src, group=group.process_group, async_op=True)
    except Exception as e:
        raise collective_error(group, what, e) from e
    _hold(src, out)
    return work, out.view(group.size, *t.shape)


def all_gather_object(obj: Any, group: Group, what: str) -> list[Any]:
    """Gather a picklable object from every rank (two tensor collectives, with timeouts).

    Only fdp's own metadata goes through here (never data loaded from disk).
    """
    if group.process_group is None:
        return [obj]
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = all_gather(torch.tensor([payload.numel()], dtype=torch.int64), group, what)
    longest = int(sizes.max())
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: payload.numel()] = payload
    gathered = all_gather(buf, group, what)
    return [
        pickle.loads(gathered[r, : int(sizes[r, 0])].numpy().tobytes()) for r in range(group.size)
    ]


def any_rank(flag: bool, group: Group, what: str = "fdp.any_rank") -> bool:
    """True on every rank if ``flag`` is true on at least one rank (one tiny all-reduce)."""
    return count_ranks(flag, group, what) > 0


def count_ranks(flag: bool, group: Group, what: str = "fdp.count_ranks") -> int:
    """How many ranks passed a true ``flag`` (the same number on every rank)."""
    if group.process_group is None:
        return int(bool(flag))
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=group.device)
    all_reduce(t, group, what)
    return int(t.item())


def wait_future(fut: torch.futures.Future, group: Group, what: str) -> Any:
    """The value of a comm hook's Future; a failure raises ``CollectiveError`` naming ``what``.

    Futures have no timed wait: the collectives behind them carry the process group's own
    timeout (the one ``fdp.init`` sets), which fails the Future when it expires.
    """
    try:
        return fut.wait()
    except Exception as e:
        raise collective_error(group, what, e) from e


# ---------------------------------------------------------------------------- traced (torch.compile)
# Functional collectives are the graph-visible form torch.compile traces (and Inductor can
# reorder for overlap); the eager path above uses c10d's work handles, which dynamo cannot
# trace. Both are torch's public-by-convention distributed APIs as of 2.13.


def traced_all_reduce(flat: torch.Tensor, group: Group) -> torch.Tensor:
    """SUM all-reduce as graph nodes (``all_reduce -> wait``); the identity in a world of one."""
    if group.process_group is None:
        return flat
    import torch.distributed._functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(flat, "sum", group.process_group))


def traced_broadcast(flat: torch.Tensor, src: int, group: Group) -> torch.Tensor:
    """Broadcast from group rank ``src`` as graph nodes; the identity in a world of one."""
    if group.process_group is None:
        return flat
    import torch.distributed._functional_collectives as funcol

    return funcol.wait_tensor(funcol.broadcast(flat, src, group.process_group))


def count_and_check_active(active: bool | None, group: Group, what: str) -> int:
    """Number of active ranks for ``all_reduce(active=...)``, checking that every rank passed it.

    One 2-element all-reduce carries (active, passed); ranks that passed ``active=`` and
    ranks that did not would otherwise issue different collectives and hang until the
    timeout. Raises ``ReplicaMismatchError`` on every rank when they disagree.
    """
    if group.process_group is None:
        return 1 if active is None else int(bool(active))
    t = torch.tensor([1 if active is None or active else 0, 0 if active is None else 1],
                     dtype=torch.int64, device=group.device)
    all_reduce(t, group, what)
    n, passed = (int(v) for v in t.tolist())
    if 0 < passed < group.size:
        mine = "passed active=" if active is not None else "did not pass active="
        raise ReplicaMismatchError(
            f"fdp: {what}: {passed} of {group.size} ranks passed active= and the others did not; "
            f"every rank must pass it, or none (rank {group.rank} {mine})"
        )
    return n
