"""Accumulation with each micro-batch reduced as it goes (``Reducer(..., reduce_micro_batches=True)``):
FSDP2's numbers with gradient sync on every micro-batch (its default) bit for bit, in
``shard=True`` and ``shard="params"`` (resharded after the forward or not, bf16 params), a
slice of the sum held instead of the whole, every rank adding nothing of a micro-batch that
fails on one, and the closing step's failure handled as in the usual accumulation."""

import pytest
import torch
import torch.nn.functional as F
from models import Block, FailOnce, block_net, tokens
from trees import assert_trees_equal

import fdp

STEPS, MICRO = 3, 3  # steps, micro-batches per step (the last one the step's own)

KINDS = {
    "shard=True": dict(shard=True),
    "shard=params": dict(shard="params"),
    "shard=params, keep gathered": dict(shard="params", reshard_after_forward=False),
    "shard=params, bf16": dict(shard="params", param_dtype=torch.bfloat16),
    "shard=True, bf16": dict(shard=True, param_dtype=torch.bfloat16),
}


def loss_of(apply, buffers):
    def loss(p, x, y):
        return F.cross_entropy(apply(p, buffers, x)[0].float().flatten(0, 1), y.flatten())
    return loss


def fdp_run(group, kind, clip, seed=5, fail=None):
    """``STEPS`` steps of ``MICRO`` micro-batches, each accumulated but the last; ``fail``:
    ``(step, micro-batch)`` whose backward raises on rank 1 (what each rank's call raised is
    returned)."""
    kw = dict(KINDS[kind])
    net = block_net(seed=seed)
    if fail is not None:
        net.blocks[0].register_forward_pre_hook(lambda m, args: (FailOnce.apply(args[0]),))
    apply, params, buffers = fdp.functionalize(net)
    if kw["shard"] == "params":
        kw["units"] = fdp.units(net, Block)
    reducer = fdp.Reducer(params, group, reduce_micro_batches=True, bucket_cap_mb=0.004, first_bucket_cap_mb=0.004,
                          **kw)
    opt = fdp.optim.adamw(lr=1e-2, weight_decay=0.1)
    if clip:
        opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(0.05), opt)
    step = reducer.grad_and_update(loss_of(apply, buffers), opt)
    if kw["shard"] == "params":
        params = step.shard(params)
    state = step.init(params)
    raised, kinds, held = [], [], []
    for i in range(STEPS):
        for j in range(MICRO - 1):
            if (i, j) == fail:
                FailOnce.arm(group.rank == 1)
                try:
                    step.accumulate(params, *tokens(group.rank, 10 * i + j))
                except RuntimeError as e:
                    raised.append(f"{type(e).__name__}: {e}")
                continue
            step.accumulate(params, *tokens(group.rank, 10 * i + j))
            kinds.append(reducer.last_step.kind)
            held.append(step.memory().accumulation)
        params, state, _ = step(params, state, *tokens(group.rank, 10 * i + MICRO - 1))
        held.append(step.memory().accumulation)
    whole = params.full() if isinstance(params, fdp.ShardedParams) else dict(params)
    return whole, raised, kinds, held, reducer.steps


def fsdp2_run(group, bf16, clip, seed=5, skip=None):
    """FSDP2 (``fully_shard`` on each block and the root), gradient sync on every micro-batch,
    torch.optim.AdamW: the reference. ``skip``: a ``(step, micro-batch)`` left out on every rank."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    model = block_net(seed=seed)
    for b in model.blocks:
        fully_shard(b, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for i in range(STEPS):
        for j in range(MICRO):
            if (i, j) == skip:
                continue
            x, y = tokens(group.rank, 10 * i + j)
            F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    return {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()}


def against_fsdp2(group, kind, clip):
    return fdp_run(group, kind, clip), fsdp2_run(group, "bf16" in kind, clip)


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_micro_batch_reduced_equals_fsdp2_syncing_every_micro_batch(kind):
    """The sum of the micro-batches' means, in FSDP2's order: its params bit for bit (2 gloo
    ranks: a sum of two is the same whichever rank's part comes first); a slice of the sum
    held between micro-batches, nothing after the step; each micro-batch a step of its own."""
    for rank, ((mine, raised, kinds, held, steps), theirs) in enumerate(
            fdp.testing.run(against_fsdp2, 2, backend="gloo", timeout=180, args=(kind, False))):
        assert raised == [] and kinds == ["accumulate"] * (STEPS * (MICRO - 1))
        assert steps == STEPS * MICRO
        for k in mine:
            assert torch.equal(mine[k], theirs[k]), f"{kind}, rank {rank}: {k!r} differs from FSDP2's"
        whole = sum(v.numel() * 4 for v in mine.values())
        sums = [h for i, h in enumerate(held) if i % MICRO != MICRO - 1]
        assert all(0 < h < whole * 0.6 for h in sums), (sums, whole)  # (this rank's slices: half, and padding)
        assert held[MICRO - 1::MICRO] == [0] * STEPS  # (the step took them)


@pytest.mark.slow  # (FSDP2 beside, on gloo)
def test_with_clipping_it_equals_fsdp2_to_its_clipping_rounding():
    for (mine, *_), theirs in fdp.testing.run(against_fsdp2, 2, backend="gloo", timeout=180,
                                              args=("shard=params", True)):
        for k in mine:  # FSDP2's clip_grad_norm_ sums each rank's squares of its shards: another rounding
            torch.testing.assert_close(mine[k], theirs[k], rtol=1e-5, atol=1e-6)


def failing_micro_batch(group, kind):
    return fdp_run(group, kind, False, fail=(1, 0)), fsdp2_run(group, False, False, skip=(1, 0))


@pytest.mark.parametrize("kind", ["shard=True", "shard=params"])
def test_a_micro_batch_failing_on_one_rank_adds_nothing_on_every_rank(kind):
    """Rank 1's backward raises in step 1's first micro-batch: rank 1 raises its error, rank 0
    a CollectiveError saying so, in that call; neither adds any of it (the sums reduced
    before stay as they were), and the cycle goes on: FSDP2 without that micro-batch."""
    for rank, ((mine, raised, *_), theirs) in enumerate(
            fdp.testing.run(failing_micro_batch, 2, backend="gloo", timeout=180, args=(kind,))):
        assert len(raised) == 1, raised
        if rank == 1:
            assert raised[0] == "RuntimeError: injected failure in the backward", raised
        else:
            assert raised[0].startswith("CollectiveError:") and "micro-batch 1 (step 3) failed on 1 rank(s)" in \
                raised[0] and "adds nothing" in raised[0], raised
        for k in mine:
            assert torch.equal(mine[k], theirs[k]), f"{kind}, rank {rank}: {k!r}"


def closing_step_fails(group, kind):
    """Two micro-batches reduced, then rank 1's closing step fails in its backward: the retry
    of the step alone is refused on every rank, and the cycle redone goes on exactly."""
    kw = dict(KINDS[kind])
    net = block_net(seed=6)
    net.blocks[0].register_forward_pre_hook(lambda m, args: (FailOnce.apply(args[0]),))
    apply, params, buffers = fdp.functionalize(net)
    if kw["shard"] == "params":
        kw["units"] = fdp.units(net, Block)
    reducer = fdp.Reducer(params, group, reduce_micro_batches=True, **kw)
    step = reducer.grad_and_update(loss_of(apply, buffers), fdp.optim.chain(
        fdp.optim.clip_by_global_norm(0.05), fdp.optim.adamw(lr=1e-2)))
    if kw["shard"] == "params":
        params = step.shard(params)
    state = step.init(params)
    outcome = []

    def cycle(n, fail=False):
        nonlocal params, state
        try:
            for j in range(n):
                step.accumulate(params, *tokens(group.rank, j))
            FailOnce.arm(fail and group.rank == 1)
            params, state, _ = step(params, state, *tokens(group.rank, 2))
            outcome.append("ok")
        except RuntimeError as e:
            outcome.append(f"{type(e).__name__}: {e}")

    cycle(2, fail=True)
    cycle(0)
    cycle(2)
    return outcome, params.full() if isinstance(params, fdp.ShardedParams) else dict(params)


@pytest.mark.parametrize("kind", ["shard=True", "shard=params"])
def test_a_failed_closing_step_takes_the_reduced_micro_batches_and_a_retry_alone_is_refused(kind):
    res = fdp.testing.run(closing_step_fails, 2, backend="gloo", timeout=180, args=(kind,))
    (out0, p0), (out1, p1) = res
    assert out1[0] == "RuntimeError: injected failure in the backward", out1
    assert out0[0].startswith("CollectiveError:") and "failed on 1 other rank" in out0[0], out0
    for out in (out0, out1):
        assert out[1].startswith("RuntimeError:") and "summed 2 micro-batch(es)" in out[1], out
        assert out[2] == "ok", out
    assert_trees_equal(p0, p1, f"{kind}: the replicas")


def refusals(group):
    params = {"w": torch.zeros(4, 4)}
    out = []
    try:
        fdp.Reducer(params, group, reduce_micro_batches=True)
    except ValueError as e:
        out.append(str(e))
    reducer = fdp.Reducer(params, group, shard=True, reduce_micro_batches=True)
    step = reducer.grad_and_update(lambda p, x: (p["w"] @ x).sum(), fdp.optim.sgd(lr=0.1), uneven=True)
    try:
        step.accumulate(params, torch.ones(4))
    except ValueError as e:
        out.append(str(e))
    return out


def test_without_a_sharded_step_or_with_uneven_inputs_it_is_refused_saying_why():
    for out in fdp.testing.run(refusals, 2):
        assert len(out) == 2, out
        assert "needs a sharded step: pass shard=True or shard='params'" in out[0]
        assert "uneven=True averages over the ranks that still have data" in out[1]


def on_a_2x2_mesh(group):
    """HSDP (``("replicate", "shard")``): each micro-batch reduce-scattered over the shard group
    and all-reduced over the replicas as it goes; beside the unsharded step's whole sums."""
    from torch.distributed.device_mesh import init_device_mesh

    out = []
    for reduced in (False, True):
        net = block_net(seed=9)
        apply, params, buffers = fdp.functionalize(net)
        if reduced:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            reducer = fdp.Reducer(params, mesh, shard="params", units=fdp.units(net, Block), reduce_micro_batches=True)
        else:
            reducer = fdp.Reducer(params, group)
        step = reducer.grad_and_update(loss_of(apply, buffers), fdp.optim.adamw(lr=1e-2))
        p = step.shard(params) if reduced else params
        state = step.init(p)
        for i in range(3):
            step.accumulate(p, *tokens(group.rank, 10 * i))
            p, state, _ = step(p, state, *tokens(group.rank, 10 * i + 1))
        out.append(p.full() if reduced else dict(p))
    return out


@pytest.mark.slow  # (4 gloo ranks on 2 cores)
def test_on_a_2x2_mesh_the_replicas_agree_and_equal_the_unsharded_step_within_rounding():
    res = fdp.testing.run(on_a_2x2_mesh, 4, backend="gloo", timeout=300)
    for rank, (whole, reduced) in enumerate(res):
        for k in whole:  # (four ranks' means summed in another order: rounding)
            torch.testing.assert_close(reduced[k], whole[k], rtol=1e-5, atol=1e-6)
        assert_trees_equal(reduced, res[0][1], f"rank {rank}: the replicas")


def muon_both_kinds(group):
    """Muon (the blocks' matrices, each on its owner) and AdamW, clipped, with micro-batches
    reduced, in ``shard=True`` and ``shard="params"``."""
    out = []
    for shard in (True, "params"):
        net = block_net(seed=11)
        apply, params, buffers = fdp.functionalize(net)
        kw = dict(units=fdp.units(net, Block)) if shard == "params" else {}
        reducer = fdp.Reducer(params, group, shard=shard, reduce_micro_batches=True, **kw)
        hidden = lambda key, p: "muon" if p.dim() == 2 and key.startswith("blocks") else "adamw"  # noqa: E731
        opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(0.05), fdp.optim.partition(
            hidden, {"muon": fdp.optim.muon(lr=0.02), "adamw": fdp.optim.adamw(lr=1e-2)}))
        step = reducer.grad_and_update(loss_of(apply, buffers), opt)
        p = step.shard(params) if shard == "params" else params
        state = step.init(p)
        for i in range(3):
            for j in range(2):
                step.accumulate(p, *tokens(group.rank, 10 * i + j))
            p, state, _ = step(p, state, *tokens(group.rank, 10 * i + 2))
        out.append(p.full() if shard == "params" else dict(p))
    moved = [k for k, v in dict(fdp.functionalize(block_net(seed=11))[1]).items() if not torch.equal(v, out[0][k])]
    return out, moved


def test_muon_owners_with_reduced_micro_batches_are_the_same_in_both_sharded_kinds():
    """Each Muon matrix's reduced sum brought whole to its owner, orthogonalised, sent back:
    ``shard=True`` and ``shard="params"`` cut the buckets differently, and on two ranks give
    the same bits."""
    for rank, ((sliced, units), moved) in enumerate(fdp.testing.run(muon_both_kinds, 2, backend="gloo", timeout=180)):
        assert len(moved) == len(sliced), moved  # (every leaf trained)
        assert_trees_equal(units, sliced, f"rank {rank}: shard='params' against shard=True")


def bf16_wire(group):
    """A bf16 wire (``comm_hook=fdp.hooks.bf16_compress``): each micro-batch reduce-scattered
    in bf16, its slice cast to fp32 and summed in fp32, in both sharded kinds; and by hand."""
    out = []
    for shard in (True, "params"):
        net = block_net(seed=12)
        apply, params, buffers = fdp.functionalize(net)
        kw = dict(units=fdp.units(net, Block)) if shard == "params" else {}
        reducer = fdp.Reducer(params, group, shard=shard, reduce_micro_batches=True,
                              comm_hook=fdp.hooks.bf16_compress, **kw)
        step = reducer.grad_and_update(loss_of(apply, buffers), fdp.optim.sgd(lr=0.1))
        p = step.shard(params) if shard == "params" else params
        state = step.init(p)
        for j in range(2):
            step.accumulate(p, *tokens(group.rank, j))
        p, state, _ = step(p, state, *tokens(group.rank, 2))
        out.append(p.full() if shard == "params" else dict(p))
    # by hand: each micro-batch's mean in bf16 (halved, then summed over the two ranks), cast
    # to fp32 and added in fp32; sgd's update
    net = block_net(seed=12)
    apply, params, buffers = fdp.functionalize(net)
    total = None
    for j in range(3):
        g = torch.func.grad(loss_of(apply, buffers))(params, *tokens(group.rank, j))
        mean = {k: (v.to(torch.bfloat16) * 0.5) for k, v in g.items()}
        for v in mean.values():
            torch.distributed.all_reduce(v, group=group.process_group)
        mean = {k: v.float() for k, v in mean.items()}
        total = mean if total is None else {k: total[k] + mean[k] for k in total}
    out.append({k: params[k].add(total[k], alpha=-0.1) for k in params})  # (torch.optim.SGD's add)
    return out


def test_a_bf16_wire_reduces_each_micro_batch_in_bf16_and_sums_in_fp32():
    for rank, (sliced, units, by_hand) in enumerate(fdp.testing.run(bf16_wire, 2, backend="gloo", timeout=180)):
        assert_trees_equal(units, sliced, f"rank {rank}: shard='params' against shard=True")
        assert_trees_equal(sliced, by_hand, f"rank {rank}: against the sum by hand")


@pytest.mark.slow  # (3 gloo ranks, FSDP2 beside)
@pytest.mark.parametrize("kind", ["shard=True", "shard=params"])
def test_on_three_ranks_with_clipping_and_a_failing_micro_batch_it_equals_fsdp2_within_rounding(kind):
    # Three ranks: each reduce-scatter receives from two peers in turn (``InTurn``), in rank
    # order, where gloo's reduce-scatter (FSDP2's) sums in its own order: rounding apart.
    for rank, ((mine, *_), theirs) in enumerate(
            fdp.testing.run(against_fsdp2, 3, backend="gloo", timeout=300, args=(kind, True))):
        for k in mine:
            torch.testing.assert_close(mine[k], theirs[k], rtol=1e-5, atol=1e-6, msg=f"{kind}, rank {rank}, {k!r}")
    results = fdp.testing.run(failing_micro_batch, 3, backend="gloo", timeout=300, args=(kind,))
    for rank, ((mine, raised, *_), theirs) in enumerate(results):
        assert len(raised) == 1 and ("RuntimeError" if rank == 1 else "CollectiveError") in raised[0], raised
        for k in mine:
            torch.testing.assert_close(mine[k], theirs[k], rtol=1e-5, atol=1e-6, msg=f"{kind}, rank {rank}, {k!r}")
        same = [torch.equal(mine[k], results[0][0][0][k]) for k in mine]
        assert all(same), f"{kind}: rank {rank}'s params differ from rank 0's"
