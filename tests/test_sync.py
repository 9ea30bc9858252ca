"""Replica consistency: broadcast, sync_buffers, shape/replica checks, debug mode, join."""

import multiprocessing

import pytest
import torch
import torch.nn.functional as F
from models import batch, cnn, mlp
from torch import nn

import fdp
import fdp._comm.agree
import fdp._plan.buffers
import fdp._step.machine

BACKENDS = ["threads", "gloo"]


def mixed_tree(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": [torch.randn(3, 4, generator=g) for _ in range(20)],   # many small leaves
        "h": torch.randn(5, generator=g).to(torch.float16),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "d": torch.randn(2, 2, generator=g).double(),
        "n": torch.randint(0, 100, (4,), generator=g),
        "flag": torch.rand(3, generator=g) > 0.5,
        "s": torch.tensor(float(seed)),
        "e": torch.zeros(0),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("src", [0, 1])
def test_broadcast_makes_every_rank_equal_to_src(backend, src):
    def body(group):
        tree = mixed_tree(seed=group.rank)
        before = fdp._tree.leaves(tree)
        snapshot = [t.clone() for t in before]
        out = fdp.broadcast(tree, src=src, group=group)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, snapshot))
        return out, unchanged

    res = fdp.testing.run(body, 3, backend=backend)
    expected = fdp._tree.leaves(mixed_tree(seed=src))
    for rank, (out, unchanged) in enumerate(res):
        assert unchanged, f"rank {rank}: broadcast wrote into its input"
        for (path, got), want in zip(zip(fdp._tree.paths(fdp._tree.structure(out)), fdp._tree.leaves(out)), expected):
            assert got.dtype == want.dtype and torch.equal(got, want), f"rank {rank}, leaf {path}"


def bn_parity(group, steps=5, lr=0.05):
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(cnn(seed=3), bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    apply, params, buffers = fdp.functionalize(cnn(seed=3))
    params, buffers = fdp.broadcast((params, buffers), group=group)
    reducer = fdp.Reducer(params, group, bucket_cap_mb=0.001, first_bucket_cap_mb=0.001)

    def loss_fn(p, b, x, y):
        out, nb = apply(p, b, x)
        return F.cross_entropy(out, y), nb

    grad_fn = reducer.grad(loss_fn, has_aux=True)
    for step in range(steps):
        x, y = batch(group.rank, step, n=4, shape=(3, 6, 6))
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        # DDP broadcasts buffers from rank 0 before each forward; fdp's explicit step goes
        # right after the gradient step (equivalent: each forward starts from rank 0's state)
        buffers = fdp.sync_buffers(buffers, group=group)
        grads, buffers = grad_fn(params, buffers, x, y)
        params = {k: p.clone().add_(grads[k], alpha=-lr) for k, p in params.items()}
    # DDP's buffers after the last forward are per-rank; its next forward would broadcast
    ddp_buffers = {k: v.clone() for k, v in ddp.module.named_buffers()}
    buffers = fdp.sync_buffers(buffers, group=group)
    ddp_buffers = fdp.broadcast(ddp_buffers, group=group)
    return params, buffers, dict(ddp.module.named_parameters()), ddp_buffers


def test_batchnorm_training_equals_torch_ddp_params_and_buffers():
    for rank, (p, b, dp, db) in enumerate(fdp.testing.run(bn_parity, 2, backend="gloo", timeout=60)):
        for k in dp:
            assert torch.equal(p[k], dp[k].detach()), f"rank {rank}: param {k!r} differs from DDP"
        for k in db:
            assert torch.equal(b[k], db[k]), f"rank {rank}: buffer {k!r} differs from DDP"


@pytest.mark.parametrize("backend", BACKENDS)
def test_mean_mode_averages_floats_and_takes_src_counters(backend):
    def body(group):
        buffers = {
            "running_mean": torch.full((3,), float(group.rank)),
            "running_var": torch.full((2,), 2.0 ** group.rank),
            "num_batches_tracked": torch.tensor(10 + group.rank),
        }
        return fdp.sync_buffers(buffers, mode="mean", src=1, group=group)

    for out in fdp.testing.run(body, 2, backend=backend):
        assert torch.equal(out["running_mean"], torch.full((3,), 0.5))
        assert torch.equal(out["running_var"], torch.full((2,), 1.5))
        assert out["num_batches_tracked"].dtype == torch.int64 and out["num_batches_tracked"].item() == 11


def test_sync_buffers_reads_replaced_tensors_and_returns_new_ones():
    def body(group):
        buffers = {"x": torch.zeros(2)}
        buffers = {"x": torch.full((2,), float(group.rank + 5))}  # replaced, not mutated
        out = fdp.sync_buffers(buffers, group=group)
        return out["x"], out["x"] is buffers["x"]

    for x, same in fdp.testing.run(body, 2):
        assert torch.equal(x, torch.full((2,), 5.0)) and not same


def test_sync_buffers_world_of_one_and_bad_mode():
    b = {"x": torch.ones(2)}
    assert fdp.sync_buffers(b) is b
    with pytest.raises(ValueError, match="mode"):
        fdp.sync_buffers(b, mode="max")
    with pytest.raises(ValueError, match="src=3"):
        fdp.sync_buffers(b, src=3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shape_mismatch_is_reported_on_all_ranks(backend):
    def body(group):
        tree = {"a": torch.zeros(2), "w": torch.zeros(4, 8 if group.rank != 1 else 9)}
        try:
            fdp.assert_same_shapes(tree, group)
        except fdp.ReplicaMismatchError as e:
            return str(e)
        return None

    msgs = fdp.testing.run(body, 3, backend=backend, timeout=20)
    for rank, msg in enumerate(msgs):
        assert msg is not None, f"rank {rank} did not raise"
        assert "leaf ['w'] has shape (4, 8) float32 on rank 0 but (4, 9) float32 on rank 1" in msg


@pytest.mark.parametrize("backend", BACKENDS)
def test_leaf_count_mismatch_is_reported_on_all_ranks(backend):
    def body(group):
        tree = {"a": torch.zeros(2), "b": torch.zeros(3)}
        if group.rank == 1:
            tree["extra"] = torch.zeros(1)
        try:
            fdp.broadcast(tree, group=group)
        except fdp.ReplicaMismatchError as e:
            return str(e)
        return None

    for rank, msg in enumerate(fdp.testing.run(body, 2, backend=backend, timeout=20)):
        assert msg is not None and "rank 0 has 2 leaves but rank 1 has 3" in msg and "['extra']" in msg, (rank, msg)


@pytest.mark.parametrize("backend", BACKENDS)
def test_drift_is_found_and_named(backend):
    def body(group):
        _, params, buffers = fdp.functionalize(cnn(seed=1))
        state = {"params": params, "buffers": buffers}
        fdp.assert_replicas_equal(state, group)  # identical: passes
        if group.rank == 1:
            params["conv2.weight"] = params["conv2.weight"].clone()
            params["conv2.weight"][0, 0, 0, 0] += 1e-7
            buffers["bn1.num_batches_tracked"] = buffers["bn1.num_batches_tracked"] + 1
        try:
            fdp.assert_replicas_equal(state, group)
        except fdp.ReplicaMismatchError as e:
            return str(e)

    for msg in fdp.testing.run(body, 3, backend=backend, timeout=20):
        assert "2 of" in msg
        assert "leaf ['params']['conv2.weight'] differs on rank(s) [1]" in msg
        assert "leaf ['buffers']['bn1.num_batches_tracked'] differs on rank(s) [1]" in msg


def test_debug_mode_turns_a_skipped_bucket_into_an_error_on_every_rank():
    def body(group):
        _, params, _ = fdp.functionalize(mlp(seed=1))
        reducer = fdp.Reducer(params, group, bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0005, debug=True)
        reducer.all_reduce(params)  # a healthy step passes the checks
        if group.rank == 1:
            # Simulate a desync bug: rank 1 skips bucket 0 and launches from bucket 1.
            machine = fdp._step.machine.StepMachine(reducer.plan, group, reducer.hook,
                                            fdp._plan.buffers.BucketBuffers(reducer.plan, [torch.float32] * 99, reuse=False),
                                            debug=True)
            machine.steps.completed = reducer.steps
            step = machine.start(fdp._step.machine.StepSpec("all_reduce", scale=0.5))
            step.give(list(fdp._tree.leaves(params)))
            step.next = 1
            step.launch_ready(force=True)
            return None
        reducer.grad(lambda p: sum(t.sum() for t in p.values()))(params)  # bucket 0 first

    # the fingerprints disagree before bucket 0 is waited for (a timeout would be a CollectiveError)
    with pytest.raises(fdp.ReplicaMismatchError, match=r"rank 0: \(seq=1, bucket=0.*rank 1: \(seq=1, bucket=1"):
        fdp.testing.run(body, 2, backend="gloo", timeout=30)


def join_parity(group):
    """DDP's join (divide_by_initial_world_size=False) vs fdp's active=False, uneven data."""
    nbatches = 4 if group.rank == 0 else 2
    data = [batch(group.rank, s) for s in range(nbatches)]
    lr = 0.1
    ddp = nn.parallel.DistributedDataParallel(mlp(seed=5))
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    with ddp.join(divide_by_initial_world_size=False):
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()

    apply, params, buffers = fdp.functionalize(mlp(seed=5))
    reducer = fdp.Reducer(params, group)
    loss = lambda p, x, y: F.cross_entropy(apply(p, buffers, x)[0], y)  # noqa: E731
    it = iter(data)
    steps = 0
    while True:
        xy = next(it, None)
        if not fdp.any_rank(xy is not None, group):
            break
        grads = torch.func.grad(loss)(params, *xy) if xy is not None else None
        grads = reducer.all_reduce(grads, active=xy is not None)
        params = {k: p.clone().add_(grads[k], alpha=-lr) for k, p in params.items()}
        steps += 1
    return params, dict(ddp.module.named_parameters()), steps


def test_active_false_matches_ddp_join_and_loops_end_together():
    res = fdp.testing.run(join_parity, 2, backend="gloo", timeout=60)
    assert [r[2] for r in res] == [4, 4]
    for rank, (mine, theirs, _) in enumerate(res):
        for k in theirs:
            assert torch.equal(mine[k], theirs[k].detach()), f"rank {rank}, leaf {k!r}"
    for k in res[0][0]:
        assert torch.equal(res[0][0][k], res[1][0][k]), "replicas must stay identical"


def test_asynchronous_replica_check_reports_drift_when_waited():
    def body(group):
        state = {"w": torch.ones(4), "b": torch.zeros(2)}
        ok = fdp.assert_replicas_equal(state, group, wait=False)
        ok.wait()
        if group.rank == 1:
            state["b"] = torch.tensor([0.0, 1e-9])
        pending = fdp.assert_replicas_equal(state, group, wait=False)  # returns at once
        try:
            pending.wait()
        except fdp.ReplicaMismatchError as e:
            return str(e)

    for msg in fdp.testing.run(body, 2, backend="gloo"):
        assert msg is not None and "leaf ['b'] differs on rank(s) [1]" in msg


def test_replica_check_of_different_layouts_names_the_leaf():
    def body(group):
        fdp.assert_replicas_equal({"w": torch.ones(3 + group.rank)}, group)

    with pytest.raises(fdp.ReplicaMismatchError, match=r"leaf \['w'\] has shape \(3,\) float32 on rank 0 but \(4,\)"):
        fdp.testing.run(body, 2)


# ------------------------------------------------------ sync_buffers checks every call


def _mixed_calls(group, second):
    """Both trees (and both modes) are seen on every rank first; then the ranks differ."""
    floats, ints = {"m": torch.ones(4)}, {"m": torch.ones(4, dtype=torch.int32)}
    fdp.sync_buffers(floats, group=group)
    fdp.sync_buffers(ints, group=group)
    fdp.sync_buffers(floats, mode="mean", group=group)
    try:
        second(group, floats, ints)
    except fdp.ReplicaMismatchError as e:
        return str(e)
    return None


@pytest.mark.parametrize("backend", BACKENDS)
def test_sync_buffers_of_a_float_tree_and_an_int_tree_seen_before_is_an_error(backend):
    def second(group, floats, ints):
        fdp.sync_buffers(floats if group.rank == 0 else ints, group=group)

    for rank, msg in enumerate(fdp.testing.run(_mixed_calls, 2, backend=backend, timeout=20, args=(second,))):
        assert msg is not None, f"rank {rank}: a float32 tree was synced with an int32 tree silently"
        assert "leaf ['m'] has shape (4,) float32 on rank 0 but (4,) int32 on rank 1" in msg, (rank, msg)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sync_buffers_with_different_modes_seen_before_is_an_error_not_a_hang(backend):
    def second(group, floats, ints):
        fdp.sync_buffers(floats, mode="mean" if group.rank == 1 else "broadcast", group=group)

    # every rank returns the mismatch's message: at a timeout it would raise a CollectiveError
    for rank, msg in enumerate(fdp.testing.run(_mixed_calls, 2, backend=backend, timeout=20, args=(second,))):
        assert msg is not None and "rank 0 uses mode=broadcast src=0 but rank 1 uses mode=mean" in msg, (rank, msg)


def test_sync_buffers_with_different_src_is_an_error():
    def second(group, floats, ints):
        fdp.sync_buffers(floats, src=group.rank, group=group)

    for rank, msg in enumerate(fdp.testing.run(_mixed_calls, 2, backend="gloo", timeout=20, args=(second,))):
        assert msg is not None and "rank 0 uses mode=broadcast src=0 but rank 1 uses mode=broadcast src=1" in msg, (
            rank, msg)


# ------------------------------------------- replica check: position-sensitive, no cancelling


def _swap_rows(w):
    return w[[1, 0, 2, 3]]


def _flip_two_signs(w):
    w = w.clone()
    # two sign bits that a wrapping word sum cannot see: each adds 2**63 to one int64 word
    w[0, 3], w[1, 3] = -w[0, 3], -w[1, 3]
    return w


def _negate_half(w):
    return torch.cat([w[:2], -w[2:]])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change", [_swap_rows, _flip_two_signs, _negate_half])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_replicas_that_differ_by_reordered_or_cancelling_changes_are_found(backend, change, dtype):
    def body(group):
        w = (torch.arange(16, dtype=torch.float64).view(4, 4) + 1).to(dtype)
        state = {"b": torch.zeros(2), "w": change(w) if group.rank == 1 else w}
        try:
            fdp.assert_replicas_equal(state, group)
        except fdp.ReplicaMismatchError as e:
            return str(e)

    for rank, msg in enumerate(fdp.testing.run(body, 2, backend=backend, timeout=20)):
        assert msg is not None, f"rank {rank}: {change.__name__} of a {dtype} leaf went unnoticed"
        assert "1 of 2 leaves differ" in msg and "leaf ['w'] differs on rank(s) [1]" in msg, (rank, msg)


def test_replica_check_does_not_depend_on_memory_layout_or_offset():
    def body(group):
        base = torch.arange(13, dtype=torch.float16)
        # rank 1 holds the same values as a view at an odd offset of a bigger storage, and
        # a transposed (non-contiguous) copy of the matrix
        x = base[1:] if group.rank == 0 else torch.cat([torch.zeros(1, dtype=torch.float16), base])[2:]
        m = torch.arange(12.0).view(3, 4)
        m = m if group.rank == 0 else m.t().contiguous().t()
        fdp.assert_replicas_equal({"x": x, "m": m, "flag": torch.tensor([True, False, True])}, group)
        return True

    assert fdp.testing.run(body, 2) == [True, True]


def test_replica_check_finds_a_swap_between_far_apart_blocks_of_a_big_leaf():
    n = 2 * 256 * 4096 + 5  # more than one pass of the hash, and a partial last row

    def body(group):
        w = torch.arange(n, dtype=torch.float32)
        if group.rank == 1:
            w[[5, n - 2]] = w[[n - 2, 5]]
        try:
            fdp.assert_replicas_equal({"w": w}, group)
        except fdp.ReplicaMismatchError as e:
            return str(e)

    for rank, msg in enumerate(fdp.testing.run(body, 2)):
        assert msg is not None and "leaf ['w'] differs on rank(s) [1]" in msg, (rank, msg)


def test_debug_fingerprint_mismatch_names_a_dtype_only_the_peer_used():
    def body(group):
        dtype = torch.float32 if group.rank == 0 else torch.float8_e5m2  # never used on rank 0
        fdp._comm.agree.check_collective(group, 3, 0, 16, dtype, "bucket 0")

    with pytest.raises(fdp.ReplicaMismatchError,
                       match=r"rank 0: \(seq=3, bucket=0, numel=16, dtype=float32\); "
                             r"rank 1: \(seq=3, bucket=0, numel=16, dtype=float8_e5m2\)"):
        fdp.testing.run(body, 2, backend="gloo", timeout=20)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dtypes_a_backend_cannot_carry_are_broadcast_as_bytes_and_float8_averaged_in_float32(backend):
    def tree(rank):
        return {"f8": torch.tensor([0.5, -2.0, 448.0]).mul(rank + 1).clamp(max=448).to(torch.float8_e4m3fn),
                "u16": torch.tensor([1, 2, 65535 - rank], dtype=torch.uint16),
                "c": torch.tensor([1 + 2j, 3 - 1j]) * (rank + 1),
                "w": torch.full((2,), float(rank))}

    def body(group):  # checked in the rank: torch cannot pickle uint16 tensors back (2.13)
        got = fdp.broadcast(tree(group.rank), src=1, group=group)
        mean = fdp.sync_buffers(tree(group.rank), mode="mean", group=group)
        want, bad = tree(1), []
        for k in want:
            if got[k].dtype != want[k].dtype or not torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)):
                bad.append(f"broadcast of leaf {k!r}")
        expected_f8 = ((tree(0)["f8"].float() + tree(1)["f8"].float()) / 2).to(torch.float8_e4m3fn)
        if mean["f8"].dtype != torch.float8_e4m3fn or not torch.equal(mean["f8"].float(), expected_f8.float()):
            bad.append("mean of leaf 'f8'")
        if not torch.equal(mean["w"], torch.full((2,), 0.5)) or not torch.equal(mean["u16"], tree(0)["u16"]):
            bad.append("mean of leaves 'w', 'u16'")
        return bad

    for rank, bad in enumerate(fdp.testing.run(body, 2, backend=backend, timeout=20)):
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.slow  # (waits for a collective's timeout)
@pytest.mark.parametrize("debug", ["1", "0"])
def test_a_collective_error_suggests_fdp_debug_only_when_it_is_off(monkeypatch, debug):
    import dataclasses
    from datetime import timedelta

    monkeypatch.setenv("FDP_DEBUG", debug)
    gave_up = multiprocessing.get_context("fork").Event()  # shared by the forked ranks

    def body(group):
        if group.rank == 1:  # never joins the broadcast below; leaves once rank 0 has given up on it
            gave_up.wait(15)
            return None
        try:
            fdp.broadcast({"x": torch.ones(2)}, group=dataclasses.replace(group, timeout=timedelta(seconds=0.5)))
        except fdp.CollectiveError as e:
            return str(e)
        finally:
            gave_up.set()

    msg = fdp.testing.run(body, 2, backend="gloo", timeout=20)[0]
    assert msg is not None and "failed on rank 0 of 2 (timeout 0.5s)" in msg, msg
    if debug == "1":
        assert "set FDP_DEBUG=1" not in msg and "FDP_DEBUG is on" in msg, msg
    else:
        assert "set FDP_DEBUG=1 to check collective fingerprints" in msg, msg
