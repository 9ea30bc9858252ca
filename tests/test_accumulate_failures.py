"""Failures inside gradient accumulation (``step.accumulate``) and in the step that closes a
cycle, on every step kind: a failed micro-batch adds nothing, every rank learns of a failed
step in that same call, and a retry of the closing step alone is refused on every rank
(redoing the cycle is exact). Real gloo ranks: the fully sharded step's gathers pair there
whatever the order, so a failed rank can issue what the others still expect of it."""

import pytest
import torch
import torch.nn.functional as F
from models import Block, FailOnce, block_net, tokens
from trees import assert_trees_equal

import fdp

KINDS = {
    "replicated": {},
    "shard=True": {"shard": True},
    "shard=params": {"shard": "params"},
}


def make_step(group, kind, *, clip=False, hook_threshold_bytes=0):
    net = block_net(seed=21)
    # The failure sits at the first block's input: its backward runs after every block's,
    # the final norm's and the head's gradients have been produced (only the embedding's are
    # left), so a failed backward has reached most leaves.
    net.blocks[0].register_forward_pre_hook(lambda m, args: (FailOnce.apply(args[0]),))
    apply, params, buffers = fdp.functionalize(net)
    kw = dict(KINDS[kind])
    if kw.get("shard") == "params":
        kw["units"] = fdp.units(net, Block)
    reducer = fdp.Reducer(params, group, bucket_cap_mb=0.002, first_bucket_cap_mb=0.002,
                          hook_threshold_bytes=hook_threshold_bytes, **kw)

    def loss(p, x, y, scale=1.0):
        return F.cross_entropy(apply(p, buffers, x)[0].flatten(0, 1), y.flatten()) * scale

    opt = fdp.optim.adamw(lr=1e-2)
    if clip:
        opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(0.1), opt)
    step = reducer.grad_and_update(loss, opt)
    if kw.get("shard") == "params":
        params = step.shard(params)
    return step, params, step.init(params)


def full(params):
    return params.full() if isinstance(params, fdp.ShardedParams) else {k: v.clone() for k, v in params.items()}


def micro_batch_fails(group, kind, failed_run, which=1):
    """Two cycles of three micro-batches; in the first, rank 1's micro-batch ``which`` fails in
    its backward (``failed_run``) or is fed with its loss times zero (the reference: the same
    collectives, a zero gradient added)."""
    step, params, state = make_step(group, kind)
    outcome = []
    for cycle in range(2):
        for j in range(2):
            x, y = tokens(group.rank, 10 * cycle + j)
            hit = cycle == 0 and j == which and group.rank == 1
            if hit and failed_run:
                FailOnce.arm()
                try:
                    step.accumulate(params, x, y)
                    outcome.append("no error")
                except RuntimeError as e:
                    outcome.append(str(e))
            else:
                step.accumulate(params, x, y, 0.0 if hit else 1.0)
        params, state, _ = step(params, state, *tokens(group.rank, 10 * cycle + 2))
    return outcome, full(params)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("which", [0, 1])
def test_a_micro_batch_whose_backward_fails_adds_nothing(kind, which):
    """The failed micro-batch's backward had reached most leaves before it raised; the sum is
    the one without it, bit for bit (before: the leaves it reached stayed added). The first
    micro-batch too: with fully sharded params the failed rank issues the gathers the others
    still expect of it (before: they waited for the timeout)."""
    failed = fdp.testing.run(micro_batch_fails, 2, backend="gloo", timeout=120, args=(kind, True, which))
    clean = fdp.testing.run(micro_batch_fails, 2, backend="gloo", timeout=120, args=(kind, False, which))
    assert failed[1][0] == ["injected failure in the backward"], failed[1][0]
    for rank in range(2):
        assert_trees_equal(failed[rank][1], clean[rank][1], f"{kind}, rank {rank}")
    assert_trees_equal(failed[0][1], failed[1][1], f"{kind}: the replicas")


def closing_step_fails(group, kind, where, clip):
    """A cycle of three micro-batches whose closing step fails on rank 1 (in its forward, or
    in its backward before any bucket launched); then the step alone is retried (refused),
    then the whole cycle is redone. Where some rank had updated part of its state before the
    failure was known (updates on arrival, without a clipping chain), every rank refuses the
    state first: a fresh one is made, and the same call is made again."""
    step, params, state = make_step(group, kind, clip=clip)
    batches = [tokens(group.rank, j) for j in range(3)]
    outcome = []

    def attempt(micro_batches, fail=False):
        nonlocal params, state
        try:
            for x, y in micro_batches:
                step.accumulate(params, x, y)
            x, y = batches[2]
            if fail and group.rank == 1:
                if where == "forward":
                    x = x.float()  # the embedding raises in the forward
                else:
                    FailOnce.arm()
            params, state, _ = step(params, state, x, y)
            outcome.append("ok")
        except fdp.CollectiveError as e:
            outcome.append(f"CollectiveError: {e}")
        except RuntimeError as e:
            outcome.append(f"RuntimeError: {e}")

    attempt(batches[:2], fail=True)
    attempt([])  # the step alone
    if "load a saved state" in outcome[-1]:
        outcome[-1] = "state refused"
        state = step.init(params)
        attempt([])
    attempt(batches[:2])  # the whole cycle
    return outcome, full(params)


def clean_cycle(group, kind, clip):
    step, params, state = make_step(group, kind, clip=clip)
    for j in range(2):
        step.accumulate(params, *tokens(group.rank, j))
    params, state, _ = step(params, state, *tokens(group.rank, 2))
    return full(params)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_failed_closing_step_fails_on_every_rank_and_a_retry_alone_is_refused(kind, where):
    """Every rank learns of the failure in the failing call (before: a rank that failed before
    launching a bucket issued nothing, and its retry was paired with the others' step,
    averaging a gradient without its micro-batches); the retry of the step alone is refused
    on every rank in that call; the cycle redone equals a clean run bit for bit."""
    clip = kind == "shard=True"  # (a chain that waits for every bucket: another status timing)
    res = fdp.testing.run(closing_step_fails, 2, backend="gloo", timeout=120, args=(kind, where, clip))
    clean = fdp.testing.run(clean_cycle, 2, backend="gloo", timeout=120, args=(kind, clip))
    (out0, p0), (out1, p1) = res
    assert out1[0].startswith("RuntimeError:") and ("injected" in out1[0] or "indices" in out1[0]), out1
    assert out0[0].startswith("CollectiveError") and "failed on 1 other rank" in out0[0], out0
    refused = out0[1] == "state refused"
    assert (out1[1] == "state refused") == refused, (out0, out1)  # (every rank, or none)
    out0, out1 = [o for o in out0 if o != "state refused"], [o for o in out1 if o != "state refused"]
    for out in (out0, out1):  # every rank's micro-batches went with the failed step
        assert out[1].startswith("RuntimeError:") and "Redo the whole cycle" in out[1], out
        assert "summed 2 micro-batch(es)" in out[1], out
    assert out0[2] == out1[2] == "ok", (out0, out1)
    if clip:  # (the updates waited for every bucket: nothing was updated, the state goes on)
        assert not refused
    for rank, p in enumerate((p0, p1)):
        assert_trees_equal(p, clean[rank], f"{kind}, rank {rank}: the cycle redone")


def fails_before_any_bucket(group):
    """reducer.grad without accumulation: rank 1 raises in its forward at step 0."""
    torch.manual_seed(0)
    net = block_net(seed=22)
    apply, params, buffers = fdp.functionalize(net)
    reducer = fdp.Reducer(params, group)

    def loss(p, x, y):
        return F.cross_entropy(apply(p, buffers, x)[0].flatten(0, 1), y.flatten())

    outcome = []
    x, y = tokens(group.rank, 0)
    try:
        reducer.grad(loss)(params, x.float() if group.rank == 1 else x, y)
        outcome.append("ok")
    except fdp.CollectiveError as e:
        outcome.append(f"CollectiveError: {e}")
    except RuntimeError as e:
        outcome.append(f"RuntimeError: {e}")
    x, y = tokens(group.rank, 1)
    got = reducer.grad(loss)(params, x, y)
    return outcome, got, torch.func.grad(loss)(params, x, y), reducer.steps


def test_a_rank_failing_in_its_forward_fails_the_step_on_every_rank_in_that_call():
    """Before: the failed rank issued nothing, so the others kept waiting and summed its next
    call's gradients into their failed step's."""
    (out0, got0, local0, steps0), (out1, got1, local1, steps1) = fdp.testing.run(
        fails_before_any_bucket, 2, backend="gloo", timeout=60)
    assert out1[0].startswith("RuntimeError"), out1
    assert out0[0].startswith("CollectiveError") and "failed on 1 other rank" in out0[0], out0
    assert steps0 == steps1 == 2
    for got in (got0, got1):
        for k in got:
            assert torch.equal(got[k], local0[k] * 0.5 + local1[k] * 0.5), k
