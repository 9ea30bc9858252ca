"""The sharded fused step (``Reducer(shard=True)``, ZeRO-1/2): the unsharded step's numbers
(bit for bit on two ranks), 1/world of the optimizer state per rank, on 1-D groups and on a
2-D (replicate, shard) mesh, with every feature of the unsharded step."""

import optree
import pytest
import torch
from models import CAPS, FailOnce, batch, loss_of, mlp
from test_fused import OPTIMIZERS, fused_vs_ddp, resumed
from torch import nn
from trees import assert_trees_equal

import fdp


def state_numel(state):
    return sum(t.numel() for ts in state.buffers.values() for t in ts)


def both(group, name, *, steps=4, donate=False, mesh=None, hook=None, seed=0):
    """The unsharded and the sharded fused step from the same start, on the same batches."""
    apply, params, buffers = fdp.functionalize(mlp(seed=seed))
    loss = loss_of(apply, buffers)
    out = []
    for g, shard in ((group, False), (mesh() if mesh else group, True)):
        reducer = fdp.Reducer(params, g, shard=shard, comm_hook=hook, hook_threshold_bytes=0, **CAPS)
        step = reducer.grad_and_update(loss, OPTIMIZERS[name](), donate=donate)
        state = step.init(params)
        p = {k: v.clone() for k, v in params.items()}
        for i in range(steps):
            p, state, _ = step(p, state, *batch(group.rank, i))
        out.append((p, step.state_to_tree(state, p), state_numel(state), len(step.plan.buckets)))
    return out


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_two_ranks_equal_the_unsharded_step_bit_for_bit_with_half_the_state(name, donate):
    for rank, ((p, st, n, _), (sp, sst, sn, nb)) in enumerate(fdp.testing.run(both, 2, args=(name,),)):
        assert_trees_equal(p, sp, f"rank {rank} params")
        assert_trees_equal(st, sst, f"rank {rank} optimizer state (gathered)")
        fields = max(1, len(fdp._tree.leaves(st)) // len(p) - 1)  # state tensors per param, besides step
        assert sn <= n / 2 + fields * nb, f"rank {rank}: {sn} state elements of {n}"


def more_ranks(group):
    from torch.distributed.device_mesh import init_device_mesh

    out = {"1-D": both(group, "adamw-mask-schedule", steps=50)}
    if group.size == 4:
        mesh = lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # noqa: E731
        out["2x2"] = both(group, "adamw-mask-schedule", steps=50, mesh=mesh)
        g = {"w": torch.full((5,), float(group.rank))}  # the plain path over a 2-D mesh: all its ranks
        out["mean"] = fdp.Reducer(g, mesh()).all_reduce(g)["w"]
    return out


@pytest.mark.slow  # (50 steps on gloo)
def test_fifty_adamw_steps_on_two_gloo_ranks_equal_the_unsharded_step_bit_for_bit():
    results = fdp.testing.run(more_ranks, 2, backend="gloo", timeout=120)
    for rank, ((p, st, _, _), (sp, sst, _, _)) in enumerate(r["1-D"] for r in results):
        assert_trees_equal(p, sp, f"rank {rank} params")
        assert_trees_equal(st, sst, f"rank {rank} state")


@pytest.mark.slow  # (3 and 4 gloo ranks on 2 cores)
@pytest.mark.parametrize("world", [3, 4])
def test_more_ranks_and_a_2x2_mesh_match_the_unsharded_step_within_rounding(world):
    # More than two addends: the sharded sum (this rank's slice, then the received ones in
    # rank order) and gloo's ring all-reduce add in different orders, so the last bits of a
    # gradient may differ; after 50 steps the params still agree to 1e-6.
    results = fdp.testing.run(more_ranks, world, backend="gloo", timeout=120)
    for r in results:
        if world == 4:
            assert torch.equal(r.pop("mean"), torch.full((5,), 1.5))
    for kind in results[0]:
        for rank, ((p, _, n, nb), (sp, _, sn, _)) in enumerate(r[kind] for r in results):
            for k in p:
                torch.testing.assert_close(sp[k], p[k], rtol=1e-6, atol=1e-7, msg=f"{kind} rank {rank} {k!r}")
                assert torch.equal(sp[k], results[0][kind][1][0][k]), f"{kind}: rank {rank} is not a replica"
            shard = world if kind == "1-D" else 2
            assert sn <= n / shard + 2 * nb * shard, f"{kind} rank {rank}: {sn} state elements of {n}"


@pytest.mark.parametrize("world, mesh", [pytest.param(2, False, id="2"),  # (`make test`: two ranks)
                                         *(pytest.param(w, m, id=i, marks=pytest.mark.slow)
                                           for w, m, i in ((3, False, "3"), (4, False, "4"), (4, True, "2x2")))])
def test_adamw_with_decay_groups_equals_ddp_and_torch_adamw_on_gloo_ranks(world, mesh):
    # Bit for bit on two ranks; on more, DDP's ring all-reduce and fdp's sharded sum add the
    # ranks' gradients in different orders.
    for rank, (fused, ddp) in enumerate(fdp.testing.run(fused_vs_ddp, world, backend="gloo", timeout=120,
                                                        args=(5, True, mesh))):
        for k in ddp:
            if world == 2:
                assert torch.equal(fused[k], ddp[k]), f"rank {rank}, param {k!r}"
            torch.testing.assert_close(fused[k], ddp[k], rtol=1e-6, atol=1e-7, msg=f"rank {rank}, {k!r}")


def clipped_both_ways(group, opt, steps, clip):
    """Unsharded, then sharded: (params, norm of the chain's transform ``clip``) after ``steps``."""
    apply, params, buffers = fdp.functionalize(mlp(seed=3))
    loss = loss_of(apply, buffers)
    out = []
    for shard in (False, True):
        step = fdp.Reducer(params, group, shard=shard, **CAPS).grad_and_update(loss, opt)
        state, p = step.init(params), dict(params)
        for i in range(steps):
            p, state, _ = step(p, state, *batch(group.rank, i))
        out.append((p, state.transforms[clip].norm))
    return out


def clipped(group, norm_type):
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(0.05, norm_type), fdp.optim.adamw(lr=1e-2))
    return clipped_both_ways(group, opt, 5, 0)


def assert_clipped_exactly(results, must_clip=True):
    for rank, ((p, norm), (sp, snorm)) in enumerate(results):
        assert norm > 0.05 or not must_clip, "the test must clip"
        assert torch.equal(snorm, norm), f"rank {rank}: norm {snorm} != {norm}"
        for k in p:
            assert torch.equal(sp[k], p[k]), f"rank {rank}, {k!r}"


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 0.0, float("inf"), float("-inf")])
def test_global_norm_clipping_equals_the_unsharded_step_bit_for_bit(norm_type):
    """Each leaf's norm is computed on one rank, whole (a leaf that crosses a slice boundary
    is sent to the rank holding its first element), then gathered: the norm of norms in leaf
    order is the unsharded step's (and clip_grad_norm_'s), for every norm type. The caps
    make buckets that straddle the slice boundary (the test checks it does)."""
    # (the -inf "norm" is the smallest |gradient|: it never clips, but it must be torch's)
    assert_clipped_exactly(fdp.testing.run(clipped, 2, args=(norm_type,)), must_clip=norm_type != float("-inf"))


def clipped_after_a_value_clip(group):
    # a whole-tree transform after an element one: its statistics are measured after the
    # value clip, as each bucket lands
    opt = fdp.optim.chain(fdp.optim.clip_by_value(-0.5, 0.5), fdp.optim.clip_by_global_norm(0.05),
                          fdp.optim.adamw(lr=1e-2))
    return clipped_both_ways(group, opt, 4, 1)


def test_a_global_norm_after_a_value_clip_is_sharded_exactly():
    assert_clipped_exactly(fdp.testing.run(clipped_after_a_value_clip, 2))


def clipped_twice(group):
    # two global scales: the second's statistics are taken after the first's product
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(0.2), fdp.optim.clip_by_global_norm(0.05, 1.0),
                          fdp.optim.adamw(lr=1e-2))
    return clipped_both_ways(group, opt, 3, 1)


def test_two_global_scales_are_sharded_exactly():
    assert_clipped_exactly(fdp.testing.run(clipped_twice, 2))


def test_the_clipping_test_model_has_leaves_across_the_slice_boundary():
    apply, params, buffers = fdp.functionalize(mlp(seed=3))
    plan = fdp.Reducer(params, **CAPS).plan
    straddling = [b.index for b in plan.buckets for off, n in zip(b.offsets, b.numels)
                  if off < (-(-b.numel // 2)) < off + n]
    assert straddling, "no leaf crosses a slice boundary: the exact-norm exchange would go untested"


def nonfinite_in_one_slice(group):
    # One bucket of two leaves: each rank's slice is all of one of them ("b" comes first in the
    # bucket: backward order). Only the rank holding "b"'s slice sees rank 1's inf; no rank may update.
    params = {"a": torch.zeros(8), "b": torch.zeros(8)}
    reducer = fdp.Reducer(params, group, shard=True, skip_nonfinite=True)
    step = reducer.grad_and_update(lambda p, s: (p["a"] * 2).sum() + (p["b"] * s).sum(), fdp.optim.adam(lr=0.1))
    state = step.init(params)
    params, state, _ = step(params, state, torch.ones(8))
    before = {k: v.clone() for k, v in params.items()}
    s = torch.ones(8)
    if group.rank == 1:
        s[3] = float("inf")
    params, state, _ = step(params, state, s)
    ranges = [s.ranges for s in step.state_to_shards(state, params).exp_avg.values()]
    return before, params, int(state.step), step.last_step.finite, ranges


def test_a_nonfinite_gradient_in_one_ranks_slice_updates_nothing_on_any_rank():
    for rank, (before, after, count, finite, ranges) in enumerate(fdp.testing.run(nonfinite_in_one_slice, 2)):
        held = [(), ((0, 8),)] if rank == 0 else [((0, 8),), ()]  # (a, b): rank 0 holds b, rank 1 holds a
        assert ranges == held, f"the layout this test relies on: rank {rank} holds {ranges}"
        assert not finite and count == 1, f"rank {rank}"
        for k in before:
            assert torch.equal(before[k], after[k]), f"rank {rank}, param {k!r} moved on a skipped step"


def features(group):
    """Accumulation, a bf16 wire, uneven inputs: the sharded step against the unsharded one."""
    apply, params, buffers = fdp.functionalize(mlp(seed=4))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.adamw(lr=1e-2)
    out = []
    for shard in (False, True):
        reducer = fdp.Reducer(params, group, shard=shard, comm_hook=fdp.hooks.bf16_compress, **CAPS)
        state, p = None, dict(params)
        for i in range(4):
            x, y = batch(group.rank, i)
            if i < 2:  # two micro-batches, the first accumulated locally
                acc = torch.func.grad(loss)(p, *batch(group.rank, 100 + i))
                step = reducer.grad_and_update(loss, opt, accumulate=acc)
                state = step.init(p) if state is None else state
                p, state, _ = step(p, state, x, y)
            else:  # uneven inputs: rank 1 has no data at step 3
                active = not (group.rank == 1 and i == 3)
                g = torch.func.grad(loss)(p, x, y) if active else None
                p, state = step.update(g, state, p, active=active)
            assert p["0.weight"].dtype == torch.float32
        out.append(p)
    return out


@pytest.mark.filterwarnings(r"ignore:fdp.Reducer.grad_and_update\(..., accumulate=\) is built again")  # (the old recipe, on purpose)
def test_accumulation_bf16_wire_and_uneven_inputs_equal_the_unsharded_step():
    for rank, (p, sp) in enumerate(fdp.testing.run(features, 2, backend="gloo", timeout=120)):
        assert_trees_equal(p, sp, f"rank {rank}")


def test_a_world_of_one_shards_over_itself():
    ((p, st, n, _), (sp, sst, sn, _)), = fdp.testing.run(both, 1, args=("adam",))
    assert_trees_equal(p, sp, "params")
    assert_trees_equal(st, sst, "state")
    assert sn == n


def saved(group, tmp):
    apply, params, buffers = fdp.functionalize(mlp(seed=10))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.chain(fdp.optim.clip_by_value(-0.05, 0.05), fdp.optim.adamw(lr=1e-2))
    step = fdp.Reducer(params, group, shard=True, **CAPS).grad_and_update(loss, opt)
    state = step.init(params)
    for i in range(2):
        params, state, _ = step(params, state, *batch(0, i))  # every rank the same data
    with pytest.raises(fdp.CheckpointError, match=r"\['opt'\] cannot be saved.*slices of a state sharded over 2"):
        fdp.save(f"{tmp}/wrong.pt", {"opt": state}, group)
    # The shard fact travels with the state's type: a copy is refused the same way.
    copy = optree.tree_map(torch.clone, state)
    assert isinstance(copy, fdp.FusedState) and copy.sharded
    with pytest.raises(fdp.CheckpointError, match="slices of a state sharded over 2"):
        fdp.save(f"{tmp}/wrong.pt", {"opt": copy}, group)
    fdp.save(f"{tmp}/ckpt.pt", {"params": params, "opt": step.state_to_tree(state, params)}, group)
    for i in range(2, 4):
        params, state, _ = step(params, state, *batch(0, i))
    return params


def test_a_sharded_checkpoint_resumes_bit_exactly_unsharded_and_on_another_world_size(tmp_path):
    straight = fdp.testing.run(saved, 2, args=(str(tmp_path),))[0]
    for world, shard in ((1, False), (4, True)):
        for rank, again in enumerate(fdp.testing.run(resumed, world, args=(str(tmp_path), shard))):
            assert_trees_equal(straight, again, f"resumed on {world} ranks (shard={shard}), rank {rank}")


def disagree(group):
    params = {"w": torch.zeros(4)}
    return fdp.Reducer(params, group, shard=group.rank == 0)


def test_ranks_that_disagree_on_sharding_are_named_at_construction():
    with pytest.raises(fdp.ReplicaMismatchError, match="shard=.state."):
        fdp.testing.run(disagree, 2)


def test_ranks_that_disagree_on_the_mesh_are_named_at_construction():
    def mixed(group):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # every rank makes it
        return fdp.Reducer({"w": torch.zeros(4)}, mesh if group.rank == 0 else group, shard=True)

    with pytest.raises(fdp.ReplicaMismatchError, match="shard group of"):
        fdp.testing.run(mixed, 4, backend="gloo", timeout=60)


def refusals(group):
    params = {"w": torch.zeros(4)}
    with pytest.raises(TypeError, match="summing hook"):
        fdp.Reducer(params, group, shard=True, comm_hook=fdp.hooks.powersgd(1))
    reducer = fdp.Reducer(params, group, shard=True)
    per_leaf = fdp.optim.GradientTransform(
        init=lambda p: (), update=lambda g, s, p: (g, s), reach="leaf", apply=lambda gs, s: s)
    with pytest.raises(TypeError, match="a slice cuts leaves"):
        reducer.grad_and_update(lambda p: p["w"].sum(), fdp.optim.chain(per_leaf, fdp.optim.sgd(lr=0.1)))
    whole_tree = fdp.optim.GradientTransform(init=lambda p: (), update=lambda g, s, p: (g, s))
    with pytest.raises(TypeError, match="not a global scale"):
        reducer.grad_and_update(lambda p: p["w"].sum(), fdp.optim.chain(whole_tree, fdp.optim.sgd(lr=0.1)))


def test_what_cannot_shard_is_refused_with_the_way_out():
    fdp.testing.run(refusals, 2)


def failing(group, use_mesh):
    from torch.distributed.device_mesh import init_device_mesh

    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    apply, params, buffers = fdp.functionalize(model)
    g = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if use_mesh else group
    reducer = fdp.Reducer(params, g, shard=True, hook_threshold_bytes=0, **CAPS)

    def loss(p, x, fail):
        p = {**p, "0.weight": FailOnce.apply(p["0.weight"])}  # its backward runs last
        return apply(p, buffers, x)[0].square().mean()

    step = reducer.grad_and_update(loss, fdp.optim.sgd(lr=0.1))
    state = step.init(params)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(group.rank))
    FailOnce.arm(group.rank == 1)
    try:
        step(params, state, x, True)
        raised = None
    except Exception as e:  # noqa: BLE001
        raised = type(e).__name__
    # Ranks that did not fail may have updated some slices on arrival: a fresh state (as the
    # unsharded step asks); the params passed in (pure) are untouched.
    state = step.init(params)
    params, state, _ = step(params, state, x, False)  # the ranks are still in step
    return raised, params


@pytest.mark.parametrize("use_mesh", [False, True], ids=["1-D", "2x2"])
def test_a_rank_failing_mid_step_fails_the_step_everywhere_and_the_next_one_runs(use_mesh):
    results = fdp.testing.run(failing, 4, backend="gloo", timeout=120, args=(use_mesh,))
    for rank, (raised, params) in enumerate(results):
        assert raised == ("RuntimeError" if rank == 1 else "CollectiveError"), f"rank {rank}: {raised}"
        assert_trees_equal(params, results[0][1], f"rank {rank} is not a replica")


def test_mesh_dims_must_be_named_replicate_and_shard():
    def bad(group):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        return fdp.Reducer({"w": torch.zeros(2)}, mesh, shard=True)

    with pytest.raises(ValueError, match="'replicate', 'shard'"):
        fdp.testing.run(bad, 2, backend="gloo", timeout=60)


def test_reduce_scatters_overlap_the_backward_and_elementwise_updates_run_on_arrival():
    def timed(group):
        model = nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 10))
        apply, params, buffers = fdp.functionalize(model)
        reducer = fdp.Reducer(params, group, shard=True, bucket_cap_mb=0.05, first_bucket_cap_mb=0.05,
                              hook_threshold_bytes=0)
        step = reducer.grad_and_update(loss_of(apply, buffers), fdp.optim.adamw(lr=1e-3))
        state = step.init(params)
        for _ in range(2):
            params, state, _ = step(params, state, torch.randn(32, 128), torch.randint(0, 10, (32,)))
        return step.last_step.timeline

    for tl in fdp.testing.run(timed, 2):
        assert len(tl.buckets) >= 2
        assert tl.buckets[0].launch < tl.backward_end, "the first reduce-scatter waited for the backward"
        assert all(b.update_start is not None for b in tl.buckets)


def test_steady_state_reuses_the_staging_buffers_of_the_all_to_alls():
    # gloo's own all-gather makes a bucket-sized temporary per call; fdp's all-to-all path
    # (``fdp._slices.exchange.Scatter``) stages through pooled buffers, so after the first
    # step no bucket-sized memory is new.
    from fdp._slices.exchange import Scatter
    from fdp._slices.geometry import Slices

    def steps(group):
        _, params, _ = fdp.functionalize(mlp(seed=1, width=64))
        plan = fdp.Reducer(params, group, **CAPS).plan
        scatter = Scatter(Slices(plan, group.size, group.rank), group)
        flats = [torch.ones(-(-b.numel // group.size) * group.size) for b in plan.buckets]
        seen = []
        for _ in range(5):  # each step: every bucket reduce-scattered, then all-gathered, one in flight
            for b, flat in enumerate(flats):
                fdp._comm.collectives.wait(scatter.launch(b, flat), group, "test")
                scatter.finish(b, flat)
            for b, flat in enumerate(flats):
                fdp._comm.collectives.wait(scatter.gather(b, flat), group, "test")
                scatter.gathered(b)
            seen.append(sorted(t.data_ptr() for t in scatter.spare))
        return seen, len(plan.buckets), scatter.mode

    for seen, nb, mode in fdp.testing.run(steps, 2):
        assert mode == "all_to_all" and nb >= 3
        assert seen[1:] == seen[:1] * 4, "staging buffers were made anew after the first step"
        assert len(seen[0]) <= 2, f"{len(seen[0])} staging buffers for {nb} buckets"


def test_a_gloo_reduce_scatter_stages_one_slice_and_adds_the_peers_in_rank_order():
    # On gloo each rank receives the others' copies of its slice one peer at a time into one
    # slice of staging (``fdp._slices.exchange.InTurn``), not ``world - 1`` slices at once,
    # adding each as it lands: its own part first, then the peers' in rank order. Two buckets
    # in flight at once, waited in order, as the step machine does.
    from fdp._comm.collectives import wait
    from fdp._slices.exchange import Scatter
    from fdp._slices.geometry import Slices

    def reduce(group):
        _, params, _ = fdp.functionalize(mlp(seed=1, width=64))
        plan = fdp.Reducer(params, group, **CAPS).plan
        slices = Slices(plan, group.size, group.rank)
        scatter = Scatter(slices, group)
        every = [[torch.randn(slices.padded[b], generator=torch.Generator().manual_seed(100 * r + b))
                  for b in range(len(plan.buckets))] for r in range(group.size)]
        flats = [t.clone() for t in every[group.rank]]
        works = [scatter.launch(b, flat) for b, flat in enumerate(flats[:2])]
        for work in works:
            wait(work, group, "test")
        mine = [scatter.finish(b, flat).clone() for b, flat in enumerate(flats[:2])]
        n, r = slices.numel, group.rank
        by_hand = []
        for b in range(2):
            want = every[r][b][r * n(b):(r + 1) * n(b)].clone()
            for j in range(group.size):
                if j != r:
                    want.add_(every[j][b][r * n(b):(r + 1) * n(b)])
            by_hand.append(want)
        return (scatter.mode, [torch.equal(m, w) for m, w in zip(mine, by_hand)],
                [t.numel() for t in scatter.spare], max(n(b) for b in range(len(plan.buckets))))

    for mode, equal, spare, largest in fdp.testing.run(reduce, 4, backend="gloo"):
        assert mode == "p2p"
        assert equal == [True, True]
        assert spare and max(spare) == largest, f"staging {spare} for slices of at most {largest} elements"
