"""Simulated ranks: run a function on N ranks in one call, for tests of your own train_step.

    >>> import fdp, fdp.testing
    >>> def step(group):
    ...     x = torch.full((3,), float(group.rank))
    ...     return fdp.Reducer({"x": x}, group).all_reduce({"x": x})["x"]
    >>> fdp.testing.run(step, world_size=2)          # one result per rank, in rank order
    [tensor([0.5000, 0.5000, 0.5000]), tensor([0.5000, 0.5000, 0.5000])]

Two backends:

``"threads"`` (default): every rank is a thread of this process, over torch's threaded
  process group (``torch.testing._internal.distributed.multi_threaded_pg``). Starts in
  milliseconds. The ranks take turns: one runs at a time, and a rank hands over only where
  it waits for the others (in a collective, or while a process group is created). At each
  hand-over the global CPU RNG state is saved for the rank that stops and restored for the
  one that resumes, so **each rank has its own torch RNG stream**, starting, as a gloo
  child's does, from the caller's state when ``run`` was called: ``torch.manual_seed(0);
  Model()`` inside ``fn`` gives the same model on every rank and every run, and unseeded
  draws are as reproducible as the caller's seed. What still differs from real processes:
  * ranks never run at the same time, and the threaded group's "async" collectives block
    until every rank has joined them, so no communication ever overlaps compute (and ranks
    that issue collectives in different orders deadlock until the timeout);
  * other process state (globals, CUDA RNG, ``torch.set_num_threads``) is shared, and a
    rank that blocks on anything but a collective (a sleep, a lock another rank holds)
    stalls the others.

  Its SUM all-reduce adds the ranks' tensors in rank order.

``"gloo"``: every rank is a real process (forked, ``OMP_NUM_THREADS=1``) talking gloo over
  127.0.0.1 (after a rendezvous through a file in a temporary folder). Asynchrony and overlap are real. ``fn``, ``args`` and the results cross process
  boundaries by pickling; ``fn`` may be a closure (fork copies the parent's memory). Each
  child starts with the parent's RNG state. Because the ranks are forked, the calling process
  must not have started autograd's worker threads: on CUDA builds of torch a
  ``torch.compile`` or a CUDA backward in the caller does, and the ranks' first backward
  then fails (fdp's error says so); compile inside ``fn`` instead. Nor may another thread of
  the caller be inside torch when it forks: a child inherits the locks that thread holds
  (MKL's memory lock, freed by a thread in its teardown: the child spins in its first
  matmul). ``run`` waits for its own thread ranks to be gone before forking; join threads
  of your own that ran torch ops before calling it. A rank that never reports is asked for
  its threads' Python stacks (SIGUSR1), which the error then shows.

In both, an exception on any rank is re-raised here (same type, message prefixed with the
rank, remote traceback attached), and nothing runs past ``timeout`` seconds: collectives
get the timeout, and ranks still running at the deadline are stopped with a ``TimeoutError``
that names them. A rank stopped in an fdp collective by another rank's failure raises
``fdp.CollectiveError`` on both (threads: the group's stop is raised as ``RanksStopped``,
which fdp's collectives name; gloo: the closed connection). On threads, ranks that all wait
for one another with none able to go on (a collective that some rank never joins because
it returned, failed or issued fewer) are stopped after a second with "the ranks deadlocked",
naming where each waits; on gloo the stall check (``FDP_STALL_S``) names ranks waiting on
different collectives.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import inspect
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import _internals
from ._comm.group import Group
from ._comm.lifetime import tune_malloc

__all__ = ["RanksStopped", "run"]

_threads_lock = threading.Lock()
# The OS ids of rank threads (backend="threads") whose Python part has ended: the OS thread
# still runs its C-level teardown (thread-local destructors: MKL's buffers, autograd's queues)
# for a moment after ``join`` returns, holding locks a process forked then would inherit
# held (its first matmul then waits forever). ``_settle`` waits for them to be gone.
_ending: list[int] = []
_TASKS = "/proc/self/task"
# How long the other ranks get to report after the first failure (their errors are usually
# consequences of it: a closed connection, a terminated collective).
_GRACE_S = 2.0


def run(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "threads",
    timeout: float = 60.0,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> list[Any]:
    """Run ``fn(group, *args, **kwargs)`` on ``world_size`` simulated ranks; return results in
    rank order.

    Args:
      fn: called once per rank with that rank's ``fdp.Group``, ``*args`` and ``**kwargs``.
      world_size: number of ranks (>= 1).
      backend: ``"threads"`` or ``"gloo"`` (see the module docstring for the differences).
      timeout: seconds; applied to every collective, and to the whole run.
      args: extra positional arguments, the same for every rank.
      kwargs: extra keyword arguments, the same for every rank.

    Returns:
      ``[result_of_rank_0, result_of_rank_1, ...]``.

    Raises:
      Exception: the lowest failing rank's exception, re-raised here (same type, message
        prefixed ``[rank r]``; the other failing ranks' errors are added as notes).
      TimeoutError: ranks still running after ``timeout`` seconds (names them).
      ValueError: ``world_size < 1`` or an unknown ``backend``.
      RuntimeError: ``backend="threads"`` while torch.distributed is already initialised in
        this process.

    Example:
      >>> def step(group):
      ...     g = {"w": torch.full((3,), float(group.rank))}
      ...     r = fdp.Reducer(g, group)
      ...     mean = r.all_reduce(g)["w"]
      ...     uneven = r.all_reduce(g if group.rank == 1 else None, active=group.rank == 1)["w"]
      ...     return mean, uneven
      >>> (mean0, uneven0), (mean1, uneven1) = fdp.testing.run(step, world_size=2)
      >>> mean0, uneven0  # only rank 1 was active in the second call
      (tensor([0.5000, 0.5000, 0.5000]), tensor([1., 1., 1.]))
    """
    __tracebackhide__ = True  # (pytest starts the report at the rank's error, not in this harness)
    if world_size < 1:
        raise ValueError(f"fdp.testing.run: world_size must be >= 1, got {world_size}")
    if backend == "threads":
        return _run_threads(_with_kwargs(fn, kwargs), world_size, float(timeout), tuple(args))
    if backend == "gloo":
        return _run_gloo(_with_kwargs(fn, kwargs), world_size, float(timeout), tuple(args))
    raise ValueError(f"fdp.testing.run: backend must be 'threads' or 'gloo', got {backend!r}")


def _tag(exc: BaseException, rank: int, remote_tb: str | None = None) -> BaseException:
    prefix = f"[rank {rank}] "
    if exc.args and isinstance(exc.args[0], str):
        if not exc.args[0].startswith(prefix):
            exc.args = (prefix + exc.args[0], *exc.args[1:])
    else:
        exc.add_note(f"(raised on rank {rank})")
    if remote_tb:
        exc.add_note(f"Traceback on rank {rank}:\n{remote_tb}")
    return exc


# --------------------------------------------------------------------------------- threads


class _Turns:
    """One rank runs at a time; each keeps its own global-RNG state across its turns.

    Threads share torch's one CPU generator, so ranks running concurrently draw from a single
    stream in whatever order the OS schedules them: a seeded test is then flaky. Instead a rank
    runs only while it holds the turn and gives it up exactly where it has to wait for other
    ranks (a collective, a process group's creation barrier); the RNG state travels with the
    turn.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder: int | None = None
        self.start = torch.get_rng_state()
        self._states: dict[int, torch.Tensor] = {}
        self._local = threading.local()
        self.blocked: set[int] = set()  # the ranks waiting for the others (in ``waiting``)
        self.queued: set[int] = set()  # the ranks waiting for their turn
        self.moved = time.monotonic()  # when a rank last began or ended such a wait
        self.stopped = "another rank failed"  # what a rank stopped in a collective is told

    def take(self, rank: int) -> None:
        with self._cond:
            self.queued.add(rank)
            self._cond.wait_for(lambda: self._holder is None)
            self.queued.discard(rank)
            self._holder = rank
        torch.set_rng_state(self._states.get(rank, self.start))
        self._local.rank = rank

    @property
    def holder(self) -> int | None:
        """The rank running now (None: none)."""
        return self._holder

    def give(self) -> int | None:
        """Give up the turn (if this thread holds it); returns the rank to ``take`` it back."""
        rank = getattr(self._local, "rank", None)
        if rank is None:
            return None
        self._local.rank = None
        self._states[rank] = torch.get_rng_state()
        with self._cond:
            self._holder = None
            self._cond.notify_all()
        return rank

    def waiting(self, wait: Callable) -> Callable:
        """``wait`` (a blocking call of torch's threaded group) run without the turn. When the
        group ends it (another rank failed, or the ranks deadlocked), the rank raises
        ``RanksStopped`` (fdp's collectives turn it into a ``CollectiveError`` naming what they
        waited for, as a closed connection on gloo), not the group's ``SystemExit``."""
        def wrapped(*a: Any, **kw: Any) -> Any:
            rank = self.give()
            if rank is not None:
                self.blocked.add(rank)
                self.moved = time.monotonic()
            whats = _whats_of(a[0] if a else None)
            if whats is not None and rank is not None:
                whats[rank] = _what_here()
            try:
                out = wait(*a, **kw)
            except SystemExit:  # (the threaded group's way to end a collective: not the rank's own exit)
                raise RanksStopped(self.stopped) from None
            except Exception as e:  # (data of different collectives, mixed: a size mismatch, say)
                mixed = _mixed(whats)
                if mixed:
                    raise RanksStopped(mixed) from e
                raise
            else:
                mixed = _mixed(whats)
                if mixed:  # (paired by order and of equal sizes: the data were mixed silently)
                    raise RanksStopped(mixed)
                return out
            finally:
                if rank is not None:
                    self.blocked.discard(rank)
                    self.moved = time.monotonic()
                    self.take(rank)
        return wrapped

    def deadlocked(self, alive: list[int], after: float) -> bool:
        """Whether every rank still running has waited for the others, none moving, for
        ``after`` seconds: none can go on (the threaded group completes a collective as soon as
        every rank has joined it, so they wait for a rank that has ended or never joins)."""
        return bool(alive) and self.blocked >= set(alive) and time.monotonic() - self.moved >= after


class RanksStopped(RuntimeError):
    """A rank of ``backend="threads"`` stopped in a collective: another rank failed, or the
    ranks deadlocked (the message says which). fdp's collectives raise it as a
    ``CollectiveError`` that names the collective, as gloo's closed connections are."""


def _whats_of(coll: Any) -> dict[int, str] | None:
    """The ``what`` each rank joined a collective of torch's threaded group with (kept on the
    collective: one per round), or None for a wait that is not a collective's."""
    if coll is None or not hasattr(coll, "_data") or not hasattr(coll, "_count"):
        return None
    whats = coll.__dict__.get("_fdp_whats")
    if whats is None:
        whats = coll.__dict__["_fdp_whats"] = {}
    return whats


def _what_here() -> str:
    """``_waiting_on`` for the calling thread."""
    return _what_in(inspect.currentframe())


def _what_in(frame: Any) -> str:
    """The ``what`` of the innermost call of ``fdp._comm.collectives`` on the stack from
    ``frame`` out (how fdp names the collective), or ``"a collective"``."""
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("_comm", "collectives.py")):
            what = frame.f_locals.get("what")
            if isinstance(what, str):
                return what
        frame = frame.f_back
    return "a collective"


# fdp's collectives of a step (buckets, unit gathers): their names say which one, the same on
# every rank that issues it, so two of them joined together are two different collectives.
_STEP_COLLECTIVE = re.compile(r"(all-gather|all-reduce|reduce-scatter) of (unit|bucket) ")


def _mixed(whats: dict[int, str] | None) -> str:
    """The message for ranks that joined different step collectives together ("": they did not)."""
    if not whats or len(set(whats.values())) < 2 or not all(_STEP_COLLECTIVE.match(w) for w in whats.values()):
        return ""
    shown = "; ".join(f"rank {r} in {w}" for r, w in sorted(whats.items()))
    return (f"the ranks issued different collectives, which torch's threaded group paired by order: {shown}. "
            "Look at what the ranks ran before (a unit or a branch called on some ranks only, a different number "
            "of micro-batches or steps per rank)")


def _waiting_on(thread: threading.Thread) -> str:
    """The collective a rank thread waits in, as fdp names it (``_what_in``)."""
    return _what_in(sys._current_frames().get(thread.ident))


def _thread_stack(thread: threading.Thread) -> str:
    """Where a rank thread is now (its Python stack, innermost last), as the gloo backend's
    ``_silent_stacks`` says it for a process."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return "it had ended"
    lines = traceback.format_stack(frame)
    start = max((i + 1 for i, line in enumerate(lines) if __file__ in line and "in worker" in line), default=0)
    return "its thread was at:\n" + "".join(lines[start:]).rstrip()  # (from the rank's fn on)


# Every rank left waiting for the others this long, none moving: a deadlock (threads).
_DEADLOCK_S = 1.0


def _collective_running(pg_class: Any) -> bool:
    """Whether a collective of torch's threaded group has every rank in and is running (its
    rank 0 copies the data around): slow, not stuck."""
    for coll in list(getattr(pg_class, "_cur_coll_on_pgs", {}).values()):
        if getattr(coll, "_count", 0) == getattr(coll, "_world_size", -1) and not getattr(coll, "_done", True):
            return True
    return False


def _deadlock(alive: list[int], threads: list[threading.Thread], errors: dict[int, BaseException],
              finished: list[bool]) -> str:
    """What a deadlock of thread ranks looks like: where each rank waits, or how it ended."""
    parts = []
    for r in range(len(threads)):
        if r in alive:
            parts.append(f"rank {r} waits in {_waiting_on(threads[r])}")
        elif r in errors:
            parts.append(f"rank {r} raised {type(errors[r]).__name__}")
        elif finished[r]:
            parts.append(f"rank {r} has returned")
    return (f"the ranks deadlocked: {'; '.join(parts)}. Every rank still running waits for the others (found "
            f"by fdp.testing after {_DEADLOCK_S:g}s of it, not at the timeout): a collective issued on some ranks "
            "only, or a different number of them per rank")


def _with_kwargs(fn: Callable, kwargs: Mapping[str, Any] | None) -> Callable:
    return functools.partial(fn, **kwargs) if kwargs else fn


@contextlib.contextmanager
def _keep_excepthook() -> Any:
    """``sys.excepthook`` as it was: each rank's ``init_process_group`` installs torch's, which
    prefixes every later uncaught exception of the process with ``[rank0]: [rank1]: ``."""
    hook = sys.excepthook
    try:
        yield
    finally:
        sys.excepthook = hook


def _run_threads(fn: Callable, world_size: int, timeout: float, args: tuple) -> list[Any]:
    __tracebackhide__ = True
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    with _threads_lock, _keep_excepthook():
        if dist.is_initialized():
            raise RuntimeError(
                "fdp.testing.run(backend='threads') needs a process without an initialised "
                "torch.distributed default group"
            )
        ProcessLocalGroup.reset()
        turns = _Turns()
        # The two places a rank of torch's threaded group blocks for the others (checked on
        # torch 2.13): a collective's rendezvous, and the store barrier that creates a
        # group (DeviceMesh and new_group inside fn). Patched for this run only.
        patched = [(owner, name) for owner, name in ((mtpg.Collective, "join"), (mtpg, "_store_based_barrier"))
                   if hasattr(owner, name)]
        originals = [getattr(owner, name) for owner, name in patched]
        for (owner, name), orig in zip(patched, originals):
            setattr(owner, name, turns.waiting(orig))
        world = _install_threaded_pg()
        _internals.thread_isolation(True)
        store = dist.HashStore()
        results: list[Any] = [None] * world_size
        errors: dict[int, BaseException] = {}
        finished = [False] * world_size
        first_error = threading.Event()
        pg_timeout = timedelta(seconds=timeout)

        def worker(rank: int) -> None:
            initialised = False
            try:
                dist.init_process_group(
                    "threaded", rank=rank, world_size=world_size, store=store, timeout=pg_timeout
                )
                initialised = True
                group = Group.from_process_group(
                    dist.group.WORLD, device="cpu", timeout=pg_timeout
                )
                turns.take(rank)
                results[rank] = fn(group, *args)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                errors[rank] = e
                first_error.set()
                ProcessLocalGroup.exception_handle(e)  # wake ranks blocked in a collective
            finally:
                turns.give()
                finished[rank] = True
                if initialised and dist.distributed_c10d._world is world:
                    try:
                        dist.destroy_process_group()
                    except Exception:  # noqa: BLE001
                        pass

        threads = [
            threading.Thread(target=worker, args=(r,), name=f"fdp-rank-{r}", daemon=True)
            for r in range(world_size)
        ]
        try:
            for t in threads:
                t.start()
            deadline = time.monotonic() + timeout
            stuck: list[int] = []
            while True:
                alive = [r for r, t in enumerate(threads) if t.is_alive()]
                if not alive:
                    break
                if turns.deadlocked(alive, _DEADLOCK_S) and not _collective_running(ProcessLocalGroup):
                    # every rank left waits for the others: say so now, not at the deadline
                    turns.stopped = _deadlock(alive, threads, errors, finished)
                    ProcessLocalGroup.exception_handle(RanksStopped(turns.stopped))
                    for t in threads:
                        t.join(max(1.0, deadline - time.monotonic()))
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    stuck = alive
                    break
                threads[alive[0]].join(min(left, 0.1))
            where = {r: _thread_stack(threads[r]) for r in stuck}  # (before they are woken)
            for r in stuck:
                if r in turns.blocked:
                    where[r] = f"waits in {_waiting_on(threads[r])}; {where[r]}"
                elif r in turns.queued:
                    where[r] = f"waits for its turn (rank {turns.holder} runs: the ranks take turns); {where[r]}"
            if stuck:
                ProcessLocalGroup.exception_handle(TimeoutError("fdp.testing.run timeout"))
                for t in threads:
                    t.join(1.0)
            _ending.extend(t.native_id for t in threads if t.native_id is not None and not t.is_alive())
            _settle()
        finally:
            for (owner, name), orig in zip(patched, originals):
                setattr(owner, name, orig)
            torch.set_rng_state(turns.start)  # the caller's stream is not consumed (as with gloo)
            _internals.thread_isolation(False)
            _uninstall_threaded_pg()
            ProcessLocalGroup.reset()

        real = {r: e for r, e in errors.items() if not isinstance(e, SystemExit)}
        if real:
            rank = min(real, key=lambda r: _error_rank_order(real[r], r))
            exc = _tag(real[rank], rank)
            for r in sorted(real):
                if r != rank:
                    exc.add_note(f"rank {r} also raised {type(real[r]).__name__}: {real[r]}")
            for r in sorted(set(errors) - set(real)):
                # (a SystemExit of the rank's own, e.g. sys.exit() in fn)
                exc.add_note(f"rank {r} exited ({type(errors[r]).__name__}: {errors[r]})")
            for r in range(world_size):
                if finished[r] and r not in errors:
                    exc.add_note(f"rank {r} had returned from fn normally")
            raise exc
        if stuck:
            error = TimeoutError(
                f"fdp.testing.run: rank(s) {stuck} of {world_size} did not finish within "
                f"{timeout:g}s (a rank waiting for a collective that another rank never issued?)"
            )
            for r in stuck:
                error.add_note(f"rank {r}: {where[r]}")
            raise error
        if errors:  # only SystemExit from terminated collectives: should not happen
            rank = min(errors)
            raise RuntimeError(f"[rank {rank}] terminated: {errors[rank]}")
        return results


# ----------------------------------------------------------------------------------- gloo


def _stack_path(store_path: str, rank: int) -> str:
    return os.path.join(os.path.dirname(store_path), f"stack-{rank}.txt")


def _child(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple, timeout: float, conn) -> None:
    code = 0
    # First of all: on SIGUSR1 this rank writes every thread's Python stack where the parent
    # finds it, so a rank that never reports can still say where it waits (_silent_stacks).
    stacks = open(_stack_path(store_path, rank), "w")  # noqa: SIM115 - open until os._exit
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        pg_timeout = timedelta(seconds=timeout)
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(pg_timeout)
        tune_malloc()  # as fdp.init does, before gloo's threads start
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=pg_timeout)
        # Every rank's gloo mesh is up before any rank runs `fn`: a rank that finishes `fn`
        # and exits at once must not close connections a slower rank is still opening.
        dist.barrier()
        group = Group.from_process_group(dist.group.WORLD, device="cpu", timeout=pg_timeout)
        try:
            payload = ("ok", fn(group, *args))
            blob = pickle.dumps(payload)
        except BaseException as e:  # noqa: BLE001 - sent to the parent
            tb = traceback.format_exc()
            try:
                blob = pickle.dumps(("err", e, tb))
                pickle.loads(blob)
            except Exception:  # noqa: BLE001 - unpicklable exception
                blob = pickle.dumps(("err", RuntimeError(f"{type(e).__name__}: {e}"), tb))
        conn.send_bytes(blob)
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    except BaseException:  # noqa: BLE001
        try:
            conn.send_bytes(pickle.dumps(("err", RuntimeError("rank setup failed"), traceback.format_exc())))
        except Exception:  # noqa: BLE001
            pass
        code = 1
    finally:
        conn.close()
        os._exit(code)


def _settle(timeout: float = 2.0) -> None:
    """Wait (at most ``timeout`` seconds) until the OS threads of finished thread ranks have
    exited (``_ending``; Linux: ``/proc/self/task``), so that a fork does not copy a lock one
    of them holds in its teardown. Found as the suite's intermittent hang: a gloo rank forked
    right after a threads run waited forever in its first ``F.linear``."""
    if not _ending or not os.path.isdir(_TASKS):
        _ending.clear()
        return
    deadline = time.monotonic() + timeout
    while True:
        _ending[:] = [t for t in _ending if os.path.exists(f"{_TASKS}/{t}")]
        if not _ending or time.monotonic() > deadline:
            return
        time.sleep(0.0005)


def _run_gloo(fn: Callable, world_size: int, timeout: float, args: tuple) -> list[Any]:
    __tracebackhide__ = True
    _settle()  # (before forking: no thread of a threads run is still tearing down)
    ctx = mp.get_context("fork")
    # The rendezvous is a FileStore: it needs no server thread in this process. (A TCPStore
    # server here would be running a thread while we fork, and a child that inherits a lock
    # that thread held deadlocks before it can join the group.) Gloo itself still talks TCP
    # over 127.0.0.1.
    store_dir = tempfile.mkdtemp(prefix="fdp-testing-")
    store_path = os.path.join(store_dir, "store")
    # Collectives time out a little before the whole run does, so a stuck rank reports
    # its own error instead of being killed silently.
    coll_timeout = max(1.0, timeout * 0.8)
    procs, conns = [], {}
    for rank in range(world_size):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_child, args=(rank, world_size, store_path, fn, args, coll_timeout, send),
            name=f"fdp-rank-{rank}", daemon=True,
        )
        p.start()
        send.close()
        procs.append(p)
        conns[recv] = rank
    results: dict[int, Any] = {}
    errors: dict[int, tuple[BaseException, str]] = {}
    first_error_at = 0.0
    deadline = time.monotonic() + timeout
    try:
        while conns:
            left = deadline - time.monotonic()
            if errors:
                left = min(left, first_error_at + _GRACE_S - time.monotonic())
            if left <= 0:
                break
            for c in mp.connection.wait(list(conns), timeout=left):
                rank = conns.pop(c)
                try:
                    msg = pickle.loads(c.recv_bytes())
                except EOFError:
                    procs[rank].join(5)  # the pipe closes just before the process is reaped
                    msg = ("err", RuntimeError(f"process exited with code {procs[rank].exitcode} "
                                               "without reporting a result"), "")
                c.close()
                if msg[0] == "ok":
                    results[rank] = msg[1]
                else:
                    if not errors:
                        first_error_at = time.monotonic()
                    errors[rank] = (msg[1], msg[2])
    finally:
        silent = _silent_stacks(procs, sorted(conns.values()), store_path)
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(5)
        shutil.rmtree(store_dir, ignore_errors=True)
    if errors:
        rank = min(errors, key=lambda r: _error_rank_order(errors[r][0], r))
        exc, tb = errors[rank]
        exc = _tag(exc, rank, tb)
        if _AUTOGRAD_FORK in str(exc):
            exc.add_note(
                "fdp.testing.run(backend='gloo') forks its ranks, and this process had already "
                "started autograd's worker threads, which a forked child cannot use (on CUDA builds "
                "of torch, running torch.compile or a CUDA backward here starts them). Do that work "
                "inside fn, on the ranks, or run this test in a fresh process."
            )
        for r in sorted(errors):
            if r != rank:
                exc.add_note(f"rank {r} also raised {type(errors[r][0]).__name__}: {errors[r][0]}")
        for r, where in silent.items():
            exc.add_note(f"rank {r} reported nothing; {where}")
        for r in sorted(results):  # (a rank that ended fn closes its connections: the others' "connection reset")
            exc.add_note(f"rank {r} had returned from fn normally (its connections closed when it ended)")
        raise exc
    if conns:
        stuck = sorted(conns.values())
        error = TimeoutError(
            f"fdp.testing.run: rank(s) {stuck} of {world_size} did not finish within "
            f"{timeout:g}s (a rank waiting for a collective that another rank never issued?)"
        )
        for r, where in silent.items():
            error.add_note(f"rank {r}: {where}")
        raise error
    return [results[r] for r in range(world_size)]


def _silent_stacks(procs: list, ranks: list[int], store_path: str) -> dict[int, str]:
    """Where each rank that has not reported is (its threads' Python stacks, written on
    SIGUSR1 by ``_child``): the rank that waits, and on what, when a run hangs."""
    asked = []
    for r in ranks:
        if procs[r].is_alive():
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
                asked.append(r)
            except ProcessLookupError:
                pass
    if asked:
        time.sleep(0.5)  # (faulthandler writes from the signal handler at once)
    out = {}
    for r in ranks:
        if r not in asked:
            out[r] = "its process had exited"
            continue
        try:
            with open(_stack_path(store_path, r)) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        out[r] = (f"its threads were at:\n{text}" if text else
                  "it wrote no stack (stuck before it could register its handler: right after the fork)")
    return out


# torch's error in a forked child whose parent had started autograd's device threads.
_AUTOGRAD_FORK = "Unable to handle autograd's threading in combination with fork-based multiprocessing"

# What gloo says when the *other* end of a collective went away: a consequence, not a cause.
_PEER_FAILURES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                  "remote worker", "Timed out waiting", "the ranks deadlocked", "another rank failed")


def _error_rank_order(exc: BaseException, rank: int) -> tuple[int, int]:
    # Report a rank's own error before a collective failure caused by another rank's exit.
    from ._errors import CollectiveError

    consequential = isinstance(exc, CollectiveError) or any(p in str(exc) for p in _PEER_FAILURES)
    return (1 if consequential else 0, rank)
