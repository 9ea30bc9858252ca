"""Where the ranks wait, when a collective stalls: a desync named within seconds, not at the
timeout.

A rank that waits on a collective longer than ``FDP_STALL_S`` seconds (default 5; 0 turns
the check off) posts what it waits on to the process group's store (the rendezvous store:
no collective, so nothing it could mix up) and reads what the other ranks posted. When
another rank has been waiting all that time on a *different* collective of the group (two
reads a second apart, neither rank moved), neither can finish: they issued different
collectives (a unit called on some ranks only, different numbers of micro-batches or steps
per rank, a call skipped after an error). Both raise ``CollectiveError`` naming the two
collectives and the ranks, instead of waiting for the timeout. A rank that posted nothing is
not waiting in this group (it computes, stalls, or has left the loop): that is only said
when the timeout comes, as the likeliest cause.

Costs nothing while collectives finish in time: a wait that has not stalled makes no store
call. Only gloo collectives (NCCL waits do not block the host; threads as ranks have their
own deadline in ``fdp.testing``). Not gloo's point-to-point exchanges (fully sharded params'
gathers): a timed wait that expires closes their connection, and ``is_completed`` stays
False until they are waited for, so they wait for the timeout; ``FDP_DEBUG`` names a unit
gathered by some ranks only before its gather (``fdp._units``).
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .. import _internals

_POLL_S = 1.0  # how often a stalled rank looks again


def stall_seconds() -> float:
    """``FDP_STALL_S``: seconds a collective may wait before the ranks compare where they wait."""
    try:
        return max(0.0, float(os.environ.get("FDP_STALL_S", "5")))
    except ValueError:
        return 5.0


@dataclass
class _Board:
    """The posts of one process group: this rank's serial, the store (None: none to use)."""

    store: Any
    name: str = ""  # the group's name: the posts' keys (a store may be shared by groups)
    serial: int = 0


_BOARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _board(pg: Any) -> _Board:
    board = _BOARDS.get(pg)
    if board is None:
        try:
            name = str(pg.group_name)
        except Exception:  # noqa: BLE001
            name = ""
        board = _BOARDS[pg] = _Board(_internals.process_group_store(pg), name)
    return board


def _key(board: _Board, rank: int) -> str:
    return f"fdp-waits/{board.name}/{rank}"


@dataclass(frozen=True)
class Sighting:
    """What a stalled rank saw: per other rank, the collective it waits on (None: it posted
    nothing, so it is not waiting in this group)."""

    waits: dict[int, str | None]

    def hint(self) -> str:
        """The likeliest cause, for the timeout's message."""
        absent = [r for r, w in self.waits.items() if w is None]
        same = [r for r, w in self.waits.items() if w is not None]
        if absent:
            return (f"rank(s) {absent} never waited in a collective of this group meanwhile: they are computing, "
                    "stalled, have left the loop, or skipped this collective (a call made on some ranks only)")
        if same:
            return (f"rank(s) {same} wait on this same collective: the transport between the ranks is stuck, not "
                    "the program")
        return ""


class Stalled(Exception):
    """Another rank waits on a different collective: ``(rank, its collective, seconds)``."""


def watch(work: Any, group: Any, what: str) -> Sighting | None:
    """Wait for ``work`` within ``group.timeout``, comparing waits with the other ranks once it
    stalls. Returns None when it completed, or the last ``Sighting`` at the timeout (the
    caller raises). Raises ``Stalled`` on a desync, and the work's own error."""
    stall = stall_seconds()
    timeout = group.timeout.total_seconds()
    board = _board(group.process_group)
    if board.store is None or not stall or stall >= timeout:
        work.wait(group.timeout)
        return None
    t0 = time.monotonic()
    deadline = t0 + timeout
    if _wait(work, min(stall, timeout)):
        return None
    board.serial += 1
    mine = f"{board.serial}|{time.time() - (time.monotonic() - t0):.3f}|{what}"  # (since it began to wait)
    store = board.store
    sighting: Sighting | None = None
    try:
        store.set(_key(board, group.rank), mine)
        previous: dict[int, str] = {}
        while True:
            sighting, posts = _read(board, group)
            for r, post in posts.items():
                if post is None or post.split("|", 2)[2] == what:
                    continue
                if previous.get(r) == post:  # (it has not moved for a whole poll: neither can finish)
                    since = time.time() - float(post.split("|", 2)[1])
                    raise Stalled(r, post.split("|", 2)[2], since)
            previous = {r: p for r, p in posts.items() if p is not None}
            left = deadline - time.monotonic()
            if left <= 0:
                return sighting
            if _wait(work, min(_POLL_S, left)):
                return None
    finally:
        try:
            store.set(_key(board, group.rank), "")
        except Exception:  # noqa: BLE001 - the store may be gone with the group
            pass


def _read(board: _Board, group: Any) -> tuple[Sighting, dict[int, str | None]]:
    store, posts = board.store, {}
    for r in range(group.size):
        if r == group.rank:
            continue
        key = _key(board, r)
        post = None
        try:
            if store.check([key]):
                value = store.get(key).decode()
                post = value or None
        except Exception:  # noqa: BLE001 - a store that cannot say: nothing posted
            post = None
        posts[r] = post
    return Sighting({r: None if p is None else p.split("|", 2)[2] for r, p in posts.items()}), posts


def _wait(work: Any, seconds: float) -> bool:
    """Whether ``work`` completes within ``seconds`` (raises its own error)."""
    try:
        work.wait(timedelta(seconds=seconds))
        return True
    except RuntimeError as e:
        if "timed out" in str(e).lower() and not work.is_completed():
            return False
        raise
