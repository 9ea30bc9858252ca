"""fdp.testing.run: simulated ranks on threads and on gloo processes."""

import threading

import pytest
import torch
import torch.distributed as dist

import fdp
import fdp._comm.collectives
import fdp.testing

BACKENDS = ["threads", "gloo"]


def sum_of_ranks(group):
    t = torch.tensor([float(group.rank + 1)])
    dist.all_reduce(t, group=group.process_group)
    return group.rank, group.size, t.item()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_come_back_in_rank_order(backend, world_size):
    results = fdp.testing.run(sum_of_ranks, world_size, backend=backend)
    total = world_size * (world_size + 1) / 2
    assert results == [(r, world_size, total) for r in range(world_size)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_args_are_passed_to_every_rank(backend):
    out = fdp.testing.run(lambda g, a, b: (g.rank, a + b), 2, backend=backend, args=(3, 4))
    assert out == [(0, 7), (1, 7)]


class Boom(ValueError):
    pass


def fail_on_rank_2(group):
    if group.rank == 2:
        raise Boom("bad batch")
    t = torch.ones(1)
    dist.all_reduce(t, group=group.process_group)  # the others wait here for rank 2
    return t


@pytest.mark.parametrize("backend", BACKENDS)
def test_exception_on_rank_2_surfaces_with_its_rank(backend):
    with pytest.raises(Boom, match=r"\[rank 2\] bad batch"):
        fdp.testing.run(fail_on_rank_2, 4, backend=backend, timeout=20)


def skip_collective_on_rank_1(group):
    if group.rank == 1:
        if group.backend == "gloo":  # alive but never joins, never returns: only the deadline ends the run
            threading.Event().wait()
        return "skipped"  # (a thread rank returns: rank 0 is left waiting alone)
    t = torch.ones(1)
    fdp._comm.collectives.all_reduce(t, group, "bucket 0")
    return "done"


def test_a_collective_skipped_by_a_thread_rank_is_named_as_a_deadlock_not_at_the_timeout():
    """Threads backend: rank 1 returns while rank 0 waits in a collective. Every rank still
    running waits for the others: fdp.testing says so after a second, naming the collective
    (fdp's name for it) and how the other rank ended, long before the 60 s timeout."""
    with pytest.raises(fdp.CollectiveError) as info:
        fdp.testing.run(skip_collective_on_rank_1, 2, backend="threads", timeout=60)
    msg = str(info.value)
    assert msg.startswith("[rank 0] fdp: bucket 0 failed on rank 0 of 2"), msg
    assert "the ranks deadlocked: rank 0 waits in bucket 0; rank 1 has returned" in msg, msg
    assert "not at the timeout" in msg, msg


COMPUTING = threading.Event()  # set by the test once the run has ended


def busy_on_rank_1(group):
    if group.rank == 1:
        COMPUTING.wait()  # computes (holding its turn: the threads take turns) until the test says
        return "done computing"
    fdp._comm.collectives.all_reduce(torch.ones(1), group, "bucket 0")
    return "done"


# Only the run's timeout ends these runs (on gloo, the collective's, a little earlier): a rank
# that computes cannot be told from a stuck one.
@pytest.mark.slow  # (1 s, the timeout)
def test_a_rank_that_never_joins_ends_at_the_timeout_on_threads():
    """The ranks still running are named, with where they are (each thread's stack from its fn
    on) and what rank 0 waits for: the collective, or its turn while rank 1 computes (which of
    the two depends on which rank the threads let run first)."""
    COMPUTING.clear()
    before = set(threading.enumerate())
    try:
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[0, 1\]") as info:
            fdp.testing.run(busy_on_rank_1, 2, backend="threads", timeout=1)
    finally:  # rank 1 stops computing, and its thread ends (a rank stopped at the deadline may stay blocked)
        COMPUTING.set()
        for t in set(threading.enumerate()) - before:
            t.join(5)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert ("rank 0: waits in bucket 0; its thread was at:" in notes or
            "rank 0: waits for its turn (rank 1 runs: the ranks take turns)" in notes), notes
    assert "rank 1: its thread was at:" in notes and "COMPUTING.wait()" in notes, notes


@pytest.mark.slow  # (3 s, the timeout)
def test_skipped_collective_times_out_on_gloo():
    with pytest.raises((fdp.CollectiveError, TimeoutError), match=r"rank 0|\[0\]"):
        fdp.testing.run(skip_collective_on_rank_1, 2, backend="gloo", timeout=3)


def return_on_rank_1(group):
    if group.rank == 1:
        return "skipped"  # ends fn while rank 0 still expects it in a collective
    fdp._comm.collectives.all_reduce(torch.ones(1), group, "bucket 0")
    return "done"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_that_returned_early_is_said_to_have_returned(backend):
    """Rank 0's collective fails (gloo: the closed connection; threads: the deadlock), and the
    error says that rank 1 had simply returned from fn."""
    with pytest.raises(fdp.CollectiveError) as info:
        fdp.testing.run(return_on_rank_1, 2, backend=backend, timeout=60)
    text = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))
    assert "rank 1 had returned from fn normally" in text or "rank 1 has returned" in text, text


def others_catch(group):
    if group.rank == 2:
        return "left"  # skips the collective and ends (on gloo its process exits)
    try:
        fdp.Reducer({"w": torch.ones(2)}, group).all_reduce({"w": torch.ones(2)})
        return "no error"
    except fdp.CollectiveError as e:
        return type(e).__name__


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_other_ranks_see_the_same_error_type_on_both_backends(backend):
    """A rank that leaves while the others wait in an fdp collective: on gloo its connections
    close, on threads fdp.testing finds the deadlock; either way the waiting ranks raise
    fdp.CollectiveError (catchable as an Exception, which the threaded group's SystemExit
    was not)."""
    assert fdp.testing.run(others_catch, 3, backend=backend, timeout=60) == ["CollectiveError", "CollectiveError",
                                                                              "left"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_stopped_by_another_ranks_failure_are_named_in_the_error(backend):
    """The ranks stopped in a collective when rank 2 fails are listed in the error's notes, with
    what stopped them (threads: fdp.testing.RanksStopped; gloo: the closed connection)."""
    with pytest.raises(Boom) as info:
        fdp.testing.run(fail_on_rank_2, 3, backend=backend, timeout=20)
    notes = getattr(info.value, "__notes__", [])
    stopped = [n for n in notes if n.startswith(("rank 0 also raised", "rank 1 also raised"))]
    assert len(stopped) == 2, notes
    if backend == "threads":
        assert all("RanksStopped: another rank failed" in n for n in stopped), notes


def test_threads_world_can_run_again_after_a_failure():
    with pytest.raises(Boom):
        fdp.testing.run(fail_on_rank_2, 3, backend="threads", timeout=10)
    assert fdp.testing.run(sum_of_ranks, 3)[2] == (2, 3, 6.0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        fdp.testing.run(sum_of_ranks, 0)
    with pytest.raises(ValueError, match="backend"):
        fdp.testing.run(sum_of_ranks, 2, backend="mpi")


def _autograd_fork_error(group):
    # What a forked rank raises on its first backward when the parent process had started
    # autograd's device threads (CUDA builds of torch, after a torch.compile or a CUDA
    # backward in the parent); a CPU build never starts them, so the error is raised as is.
    raise RuntimeError("Unable to handle autograd's threading in combination with fork-based multiprocessing. See https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork")


def test_autograd_fork_error_says_what_to_do():
    with pytest.raises(RuntimeError, match="Autograd-and-Fork") as info:
        fdp.testing.run(_autograd_fork_error, 1, backend="gloo", timeout=30)
    assert any("inside fn, on the ranks" in note for note in info.value.__notes__)


def seeded_init_across_a_collective(group):
    # Seed, wait for the other ranks, then draw: ranks sharing one generator would each take
    # a different slice of one stream here.
    torch.manual_seed(0)
    dist.barrier(group=group.process_group)
    model = torch.nn.Linear(16, 16)
    dist.barrier(group=group.process_group)
    unseeded = torch.randn(4)  # the rank's own stream, continued
    return {k: v.detach() for k, v in model.state_dict().items()}, unseeded


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_init_inside_fn_is_the_same_on_every_rank_and_run(backend):
    runs = [fdp.testing.run(seeded_init_across_a_collective, 4, backend=backend) for _ in range(3)]
    torch.manual_seed(0)
    want = torch.nn.Linear(16, 16).state_dict()
    want_next = torch.randn(4)
    for run, results in enumerate(runs):
        for rank, (state, unseeded) in enumerate(results):
            for k in want:
                assert torch.equal(state[k], want[k]), f"run {run}, rank {rank}: {k} differs from a seeded init"
            assert torch.equal(unseeded, want_next), f"run {run}, rank {rank}: its RNG stream was not its own"


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_rank_starts_from_the_callers_rng_state_and_leaves_it_alone(backend):
    torch.manual_seed(123)
    expected = torch.randn(3)
    torch.manual_seed(123)
    out = fdp.testing.run(lambda g: torch.randn(3), 3, backend=backend)
    assert all(torch.equal(o, expected) for o in out)
    assert torch.equal(torch.randn(3), expected), "run() consumed the caller's random stream"


def waits_forever_on_rank_1(group):
    import threading

    if group.rank == 1:
        threading.Event().wait()  # never reaches the collective below
    fdp.pmean({"x": torch.ones(1)}, group)
    return group.rank


def test_a_gloo_rank_that_never_reports_says_where_it_waits():
    """A forked rank stuck before its first collective (a lock inherited over the fork, say):
    the run fails with the other rank's collective error, and a note gives the silent rank's
    Python stack, so the hang is named, not only timed out."""
    with pytest.raises(Exception) as e:
        fdp.testing.run(waits_forever_on_rank_1, 2, backend="gloo", timeout=6)
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert "rank 1" in notes and "its threads were at" in notes and "waits_forever_on_rank_1" in notes, notes


def _matmuls(group):
    a = torch.randn(96, 96)
    for _ in range(10):
        a = torch.nn.functional.linear(a, a).tanh()  # MKL gives this thread buffers of its own
    return float(a.sum())


def _one_linear(group):
    return float(torch.nn.functional.linear(torch.randn(8, 16), torch.randn(64, 16)).sum())


@pytest.mark.slow
def test_a_gloo_run_right_after_a_threads_run_does_not_inherit_a_dying_rank_threads_lock():
    """The suite's intermittent hang: a threads run's rank thread, its Python part over
    (``join`` returned), still frees MKL's per-thread buffers in its C-level teardown, holding
    MKL's memory lock; a gloo rank forked at that moment inherits the lock held and spins
    forever in its first matmul (``mkl_serv_allocate``, seen with py-spy --native). Measured
    beside two CPU burners: 4 hangs in 19 alternations before the fix, 0 in 600 after it
    (``fdp.testing`` now waits for those threads to be gone before forking). Two busy
    processes run beside the loop here, as on a loaded CI machine."""
    import subprocess
    import sys

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for i in range(40):
            fdp.testing.run(_matmuls, 2)
            assert fdp.testing.run(_one_linear, 2, backend="gloo", timeout=30)[0] is not None, i
    finally:
        for p in burners:
            p.kill()
            p.wait()


def test_a_threads_run_leaves_the_processs_excepthook_as_it_was():
    """Each thread rank's init_process_group installs torch's excepthook, which would prefix
    every later uncaught exception of the process with "[rank0]: [rank1]: "."""
    import sys

    hook = sys.excepthook
    fdp.testing.run(lambda g: g.rank, 2)
    assert sys.excepthook is hook
