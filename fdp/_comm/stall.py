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

The rank that names the desync first also posts it, so that a rank whose collective then
fails (the first one left, closing its connections) says what the other found
(``named_desync``) rather than "connection closed".

Costs nothing while collectives finish in time: a wait that has not stalled makes no store
call. Only gloo collectives (NCCL waits do not block the host; threads as ranks have their
own deadline in ``fdp.testing``). Gloo's point-to-point exchanges (fully sharded params'
gathers, sharded state's reduce-scatters on gloo) cannot be waited for a while and looked at
again: a timed wait that expires closes the group's connections, and ``is_completed`` stays
False until they are waited for. So the rank's thread waits for them whole, and a watchdog
thread (one per process, waking every half second; ``_Dog``) does the comparing once the
wait has stalled; on a desync it ends the wait the only way gloo offers, a timed wait of its
own that expires (the group is then closed, as after any desync), and the rank raises what
the watchdog found.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .. import _internals

_POLL_S = 1.0  # how often a stalled rank looks again


def stall_seconds() -> float:
    """``FDP_STALL_S``: seconds a collective may wait before the ranks compare where they wait
    (an invalid value: 5, said once in a warning)."""
    raw = os.environ.get("FDP_STALL_S", "5")
    try:
        return max(0.0, float(raw))
    except ValueError:
        if raw not in _WARNED:
            _WARNED.add(raw)
            warnings.warn(f"fdp: FDP_STALL_S={raw!r} is not a number of seconds; using 5", stacklevel=2)
        return 5.0


_WARNED: set[str] = set()


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


def watch(work: Any, group: Any, what: str, *, timed: bool = True) -> Sighting | None:
    """Wait for ``work`` within ``group.timeout``, comparing waits with the other ranks once it
    stalls. Returns None when it completed, or the last ``Sighting`` at the timeout (the
    caller raises). Raises ``Stalled`` on a desync, and the work's own error. ``timed=False``:
    the work cannot be waited for a while and then again (gloo's point-to-point exchanges), so
    this thread waits for it whole and the watchdog compares (``_Dog``)."""
    stall = stall_seconds()
    timeout = group.timeout.total_seconds()
    board = _board(group.process_group)
    if board.store is None or not stall or stall >= timeout:
        work.wait(group.timeout)
        return None
    if not timed:
        return _Dog.watch(work, group, what, board)
    t0 = time.monotonic()
    if _wait(work, min(stall, timeout)):
        return None
    return _compare(board, group, what, t0, lambda seconds: _wait(work, seconds))


def _compare(board: _Board, group: Any, what: str, t0: float, wait_more: Any,
             seen: Any = None) -> Sighting | None:
    """Post this rank's wait (begun at monotonic ``t0``) and compare it with the others' every
    ``_POLL_S``, waiting with ``wait_more(seconds) -> done`` between reads, until the wait ends
    (None), a desync (``Stalled``) or the timeout (the last ``Sighting``). ``seen(sighting)``
    is told each read's."""
    deadline = t0 + group.timeout.total_seconds()
    board.serial += 1
    mine = f"{board.serial}|{time.time() - (time.monotonic() - t0):.3f}|{what}"  # (since it began to wait)
    store = board.store
    sighting: Sighting | None = None
    try:
        store.set(_key(board, group.rank), mine)
        previous: dict[int, str] = {}
        while True:
            sighting, posts = _read(board, group)
            if seen is not None:
                seen(sighting)
            for r, post in posts.items():
                if post is None or post.split("|", 2)[2] == what:
                    continue
                if previous.get(r) == post:  # (it has not moved for a whole poll: neither can finish)
                    since = time.time() - float(post.split("|", 2)[1])
                    theirs = post.split("|", 2)[2]
                    _post_named(board, group, f"rank {group.rank} waited on {what}, rank {r} on {theirs}")
                    raise Stalled(r, theirs, since)
            previous = {r: p for r, p in posts.items() if p is not None}
            left = deadline - time.monotonic()
            if left <= 0:
                return sighting
            if wait_more(min(_POLL_S, left)):
                return None
    finally:
        try:
            store.set(_key(board, group.rank), "")
        except Exception:  # noqa: BLE001 - the store may be gone with the group
            pass


def _post_named(board: _Board, group: Any, text: str) -> None:
    try:
        board.store.set(f"fdp-desync/{board.name}/{group.rank}", text)
    except Exception:  # noqa: BLE001 - only a courtesy to the other ranks
        pass


def named_desync(group: Any) -> str:
    """What a rank of ``group`` (this one included) found when it named a desync (``""``: none
    did). Read only after a collective failed: a rank that names a desync leaves the group, so
    the others' collectives fail (and this rank's next one, if its watchdog found it while the
    rank had moved on)."""
    if group.backend != "gloo" or group.process_group is None or not stall_seconds():
        return ""
    board = _board(group.process_group)
    if board.store is None:
        return ""
    for r in range(group.size):
        key = f"fdp-desync/{board.name}/{r}"
        try:
            if board.store.check([key]):
                return f"rank {r} found them ({board.store.get(key).decode()})"
        except Exception:  # noqa: BLE001 - a store that cannot say: nothing found
            return ""
    return ""


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


@dataclass(eq=False)
class _Slot:
    """The wait the rank's thread is in, for the watchdog: what it learnt, for that thread."""

    work: Any
    group: Any
    what: str
    board: _Board
    t0: float
    stalled: tuple | None = None  # Stalled's args, once a desync was found
    sighting: Sighting | None = None  # the last look at the others' posts
    compared: bool = False  # the watchdog is done with this wait


class _Dog:
    """The watchdog of a process's point-to-point waits: every half second it looks at the wait
    the rank's thread is in (``slot``: set and cleared by that thread, nothing else on the fast
    path) and, once it has lasted ``FDP_STALL_S``, compares it with the other ranks' posts.
    A desync ends the wait (see the module's docstring)."""

    _current: _Dog | None = None

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.slot: _Slot | None = None
        threading.Thread(target=self._run, name="fdp-stall-watch", daemon=True).start()

    @classmethod
    def watch(cls, work: Any, group: Any, what: str, board: _Board) -> Sighting | None:
        dog = cls._current
        if dog is None or dog.pid != os.getpid():  # (a forked child has no watchdog thread)
            dog = cls._current = cls()
        slot = dog.slot = _Slot(work, group, what, board, time.monotonic())
        try:
            work.wait(group.timeout)
            return None
        except Exception as e:
            if slot.stalled is not None:
                raise Stalled(*slot.stalled) from None
            if slot.sighting is not None and "timed out" in str(e).lower():
                return slot.sighting
            raise
        finally:
            dog.slot = None

    def _run(self) -> None:
        while True:
            time.sleep(_POLL_S / 2)
            slot = self.slot
            if slot is None or slot.compared or time.monotonic() - slot.t0 < stall_seconds():
                continue

            def wait_more(seconds: float, slot: _Slot = slot) -> bool:
                time.sleep(seconds)
                return self.slot is not slot

            def seen(sighting: Sighting, slot: _Slot = slot) -> None:
                slot.sighting = sighting

            try:
                _compare(slot.board, slot.group, slot.what, slot.t0, wait_more, seen)
            except Stalled as s:
                slot.stalled = s.args
                if self.slot is not slot:  # (it ended meanwhile: the next wait will stall in turn)
                    continue
                for w in getattr(slot.work, "works", [slot.work]):  # a timed wait that expires closes the group
                    try:
                        w.wait(timedelta(milliseconds=1))
                    except Exception:  # noqa: BLE001 - expected: that is how the wait ends
                        break
            except Exception:  # noqa: BLE001 - a watchdog that fails leaves the wait to its timeout
                pass
            finally:
                slot.compared = True
