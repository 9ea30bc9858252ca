"""Collectives with a timeout and an error message that says what failed and where.

Every collective fdp issues goes through here. A world of one (``group.process_group is
None``) never communicates: the calls return their input.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._errors import CollectiveError
from .._log import debug_mode
from .group import Group, pg_timeout
from .lifetime import RECENT, SMALL_BYTES, keep_until_exit, mark_failed
from .stall import Stalled, named_desync, stall_seconds, watch


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

def completed(value: Any) -> torch.futures.Future:
    """A Future that already holds ``value``."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def is_completed(handle: Any) -> bool:
    """Whether a work handle or Future has finished (never blocks)."""
    return handle.is_completed() if hasattr(handle, "is_completed") else handle.done()


def collective_error(group: Group, what: str, exc: BaseException, seen: str = "") -> CollectiveError:
    """The error for a collective ``what`` that raised ``exc``: names the rank and timeout, and
    ``seen``, what the stall check saw of the other ranks (``fdp._comm.stall``), if anything.

    Also marks the process group as failed, so that the exit hook of ``fdp.init`` does not
    meet the other ranks in a barrier over connections that may be broken.
    """
    mark_failed()
    if seen:
        cause = f"While it waited, {seen}"
    else:
        cause = "Another rank probably died, skipped this collective, or issued a different one"
    if debug_mode():  # the advice to set it would be noise; say what it already ruled out
        hint = ("FDP_DEBUG is on, so a bucket or unit gather issued differently by another rank would "
                "have been named before it launched")
    else:
        hint = "set FDP_DEBUG=1 to check collective fingerprints"
    return CollectiveError(
        f"fdp: {what} failed on rank {group.rank} of {group.size} "
        f"(timeout {group.timeout.total_seconds():g}s): {exc}. {cause} ({hint})."
    )


def _outlive(work: Any, group: Group) -> None:
    """A collective given up on stays referenced until it can no longer touch its tensors."""
    keep_until_exit(work, max(group.timeout, pg_timeout(group.process_group, group.device)))


def wait(work: Any, group: Group, what: str) -> None:
    """Wait for ``work`` within the group's timeout; raise ``CollectiveError`` naming ``what``.
    On gloo, a wait that stalls compares with the other ranks' (``fdp._comm.stall``): a rank
    waiting on a different collective is named within seconds."""
    try:
        if group.backend == "threaded":
            work.wait()  # the threaded test PG has no timed wait; run() enforces its deadline
        elif group.backend == "gloo" and isinstance(work, (dist.Work, Batch)) and not work.is_completed():
            sighting = watch(work, group, what, timed=not isinstance(work, Batch))
            if sighting is not None:
                _outlive(work, group)
                raise collective_error(group, what, TimeoutError(
                    f"not done after {group.timeout.total_seconds():g}s"), sighting.hint())
        else:
            work.wait(group.timeout)
    except CollectiveError:
        raise
    except Stalled as s:
        rank, theirs, since = s.args
        _outlive(work, group)
        mark_failed()
        raise CollectiveError(_desync(group, f"rank {group.rank} of {group.size} waits on {what}, while rank {rank} "
                                             f"has waited {since:.0f}s on {theirs}")) from None
    except Exception as e:
        if group.backend != "threaded":  # threads share this process: nothing outlives it
            _outlive(work, group)
        found = named_desync(group)
        if found:  # (the rank that found it left the group: this collective failed as it closed)
            mark_failed()
            raise CollectiveError(_desync(group, f"{found}; then {what} failed on rank {group.rank} of {group.size} "
                                                 f"as the group closed ({str(e).split('. ')[0]})")) from e
        raise collective_error(group, what, e) from e


def _desync(group: Group, which: str) -> str:
    return (f"fdp: the ranks issued different collectives: {which}. Neither can finish: look at what the ranks ran "
            "before (a unit or a branch called on some ranks only, a different number of micro-batches or steps per "
            f"rank, a call skipped after an error on one rank). Named after {stall_seconds():g}s of waiting "
            f"(FDP_STALL_S), not at the {group.timeout.total_seconds():g}s timeout.")


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
    if t.numel() * t.element_size() <= SMALL_BYTES:  # see lifetime.RECENT
        RECENT.append(t)
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
    if t.numel() * t.element_size() <= SMALL_BYTES:  # see lifetime.RECENT
        RECENT.append(t)
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


def all_to_all(out: torch.Tensor, flat: torch.Tensor, group: Group, what: str, *,
               out_splits: list[int] | None = None, in_splits: list[int] | None = None) -> Any:
    """Launch an all-to-all: slice ``j`` of ``flat`` goes to rank ``j``, and ``out``'s slice
    ``i`` receives rank ``i``'s; equal slices, or the sizes ``in_splits`` (of ``flat``) and
    ``out_splits`` (of ``out``). Returns the work (``DONE`` in a world of one)."""
    if group.process_group is None:
        out.copy_(flat)
        return DONE
    try:
        return dist.all_to_all_single(out, flat, out_splits, in_splits, group=group.process_group, async_op=True)
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
    if out.numel() * out.element_size() <= SMALL_BYTES:  # see lifetime.RECENT (src is out's size / world)
        RECENT.extend((src, out))
    return work, out.view(group.size, *t.shape)


def all_gather_object(obj: Any, group: Group, what: str) -> list[Any]:
    """Gather a picklable object from every rank (two tensor collectives, with timeouts).

    Only fdp's own metadata goes through here (never data loaded from disk). The bytes travel
    on the group's device (NCCL carries no CPU tensors).
    """
    if group.process_group is None:
        return [obj]
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = all_gather(torch.tensor([payload.numel()], dtype=torch.int64, device=group.device), group, what).cpu()
    longest = int(sizes.max())
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: payload.numel()] = payload
    gathered = all_gather(buf.to(group.device), group, what).cpu()
    return [
        pickle.loads(gathered[r, : int(sizes[r, 0])].numpy().tobytes()) for r in range(group.size)
    ]


def wait_future(fut: torch.futures.Future, group: Group, what: str) -> Any:
    """The value of a comm hook's Future; a failure raises ``CollectiveError`` naming ``what``.

    Futures have no timed wait: the collectives behind them carry the process group's own
    timeout (the one ``fdp.init`` sets), which fails the Future when it expires.
    """
    try:
        return fut.wait()
    except Exception as e:
        raise collective_error(group, what, e) from e
