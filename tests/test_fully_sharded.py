"""Fully sharded params (``Reducer(shard="params", units=...)``, ZeRO-3): the unsharded fused
step's numbers (bit for bit on two ranks), DDP's and FSDP2's on the same data, 1/world of the
params at rest, each unit gathered only while it runs; with the features users combine it with."""

import re

import pytest
import torch
import torch.nn.functional as F
from models import Block, block_net, tokens
from torch import nn
from trees import assert_trees_equal

import fdp
import fdp.viz

OPTIMIZERS = {
    "adamw-mask-schedule": lambda: fdp.optim.adamw(lr=fdp.optim.schedules.warmup_cosine(1e-2, 2, 10),
                                                   weight_decay=0.1, mask=lambda path, p: p.dim() >= 2),
    "clip-adamw": lambda: fdp.optim.chain(fdp.optim.clip_by_global_norm(0.05), fdp.optim.adamw(lr=1e-2)),
    "sgd-nesterov": lambda: fdp.optim.sgd(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adagrad": lambda: fdp.optim.adagrad(lr=1e-2),
    "two-lrs": lambda: fdp.optim.partition(lambda key, p: "blocks" if key.startswith("blocks") else "rest",
                                           {"blocks": fdp.optim.adamw(lr=1e-2), "rest": fdp.optim.adamw(lr=3e-3)}),
}


def loss_of(apply, buffers):
    def loss(p, x, y):
        return F.cross_entropy(apply(p, buffers, x)[0].flatten(0, 1), y.flatten())
    return loss


def train(group, shard, opt, *, steps=4, seed=0, acc=0, donate=False, mesh=None, **kw):
    """``steps`` fused steps of ``opt`` on a BlockNet (``acc`` micro-batches accumulated before
    each): the params (whole), the per-leaf state, and the last step's record."""
    net = block_net(seed=seed)
    apply, params, buffers = fdp.functionalize(net)
    units = fdp.units(net, Block) if shard == "params" else None
    reducer = fdp.Reducer(params, mesh() if mesh else group, shard=shard, units=units, **kw)
    step = reducer.grad_and_update(loss_of(apply, buffers), opt(), donate=donate)
    state = step.init(params)
    p = {k: v.clone() for k, v in params.items()}
    for i in range(steps):
        for j in range(acc):
            step.accumulate(p, *tokens(group.rank, 100 * i + j))
        p, state, _ = step(p, state, *tokens(group.rank, i))
    whole = p.full() if isinstance(p, fdp.ShardedParams) else p
    return whole, step.state_to_tree(state, p), step.last_step


def both(group, name, **kw):
    return train(group, False, OPTIMIZERS[name], **kw)[:2], train(group, "params", OPTIMIZERS[name], **kw)[:2]


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_two_ranks_equal_the_unsharded_fused_step_bit_for_bit(name, donate):
    for rank, ((p, st), (sp, sst)) in enumerate(fdp.testing.run(both, 2, args=(name,), timeout=120)):
        assert_trees_equal(p, sp, f"rank {rank} params")
        assert_trees_equal(st, sst, f"rank {rank} optimizer state")


def features(group):
    """Accumulation, skip_nonfinite, a bf16 wire, units kept from forward to backward."""
    out = {}
    for name, kw in [("accumulate", dict(acc=2)), ("bf16 wire", dict(reduce_dtype=torch.bfloat16)),
                     ("skip_nonfinite", dict(skip_nonfinite=True)), ("keep", {})]:
        extra = dict(reshard_after_forward=False) if name == "keep" else {}
        a = train(group, False, OPTIMIZERS["clip-adamw"], **kw)[:2]
        b = train(group, "params", OPTIMIZERS["clip-adamw"], **kw, **extra)[:2]
        out[name] = (a, b)
    return out


@pytest.mark.slow  # (four options, on gloo too)
@pytest.mark.parametrize("backend", ["gloo", "threads"])
def test_accumulation_bf16_wire_skip_nonfinite_and_no_reshard_equal_the_unsharded_step(backend):
    for rank, got in enumerate(fdp.testing.run(features, 2, backend=backend, timeout=240)):
        for name, ((p, st), (sp, sst)) in got.items():
            assert_trees_equal(p, sp, f"{name}, rank {rank} params")
            assert_trees_equal(st, sst, f"{name}, rank {rank} state")


def against_ddp_and_fsdp2(group, clip):
    """DDP + torch.optim.AdamW (+ clip_grad_norm_), FSDP2 fully_shard on each block and the root
    + torch.optim.AdamW, and fdp's fully sharded step, from the same start on the same data."""
    from torch.distributed.fsdp import fully_shard

    def torch_run(wrap):
        model = wrap(block_net(seed=7))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for i in range(4):
            x, y = tokens(group.rank, i)
            opt.zero_grad()
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
        return model

    ddp = torch_run(lambda m: nn.parallel.DistributedDataParallel(m)).module
    ddp_params = {k: v.detach().clone() for k, v in ddp.named_parameters()}

    def fsdp2(m):
        for b in m.blocks:
            fully_shard(b)
        return fully_shard(m)

    fsdp = torch_run(fsdp2)
    fsdp_params = {k: v.full_tensor().detach().clone() for k, v in fsdp.named_parameters()}
    opt = fdp.optim.adamw(lr=1e-2, weight_decay=0.1)
    if clip:
        opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(0.05), opt)
    net = block_net(seed=7)
    apply, params, buffers = fdp.functionalize(net)
    step = fdp.Reducer(params, group, shard="params", units=fdp.units(net, Block)).grad_and_update(
        loss_of(apply, buffers), opt)
    state = step.init(params)
    for i in range(4):
        params, state, _ = step(params, state, *tokens(group.rank, i))
    return params.full(), ddp_params, fsdp_params


@pytest.mark.slow  # (DDP and FSDP2 beside, on gloo)
@pytest.mark.parametrize("clip", [False, True], ids=["adamw", "clip-adamw"])
def test_two_gloo_ranks_equal_ddp_and_fsdp2_with_torch_adamw(clip):
    for rank, (mine, ddp, fsdp2) in enumerate(fdp.testing.run(against_ddp_and_fsdp2, 2, backend="gloo",
                                                                 timeout=180, args=(clip,))):
        for k in mine:
            assert torch.equal(mine[k], ddp[k]), f"rank {rank}: {k!r} differs from DDP"
            if clip:  # FSDP2's clip_grad_norm_ sums each rank's squares of its shards: another rounding
                torch.testing.assert_close(mine[k], fsdp2[k], rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(mine[k], fsdp2[k]), f"rank {rank}: {k!r} differs from FSDP2"


def more_ranks(group):
    from torch.distributed.device_mesh import init_device_mesh

    out = {"1-D": both(group, "clip-adamw", steps=6)}
    if group.size == 4:
        mesh = lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # noqa: E731
        out["2x2"] = (train(group, False, OPTIMIZERS["clip-adamw"], steps=6)[:2],
                      train(group, "params", OPTIMIZERS["clip-adamw"], steps=6, mesh=mesh)[:2])
    return out


@pytest.mark.slow  # (3 and 4 gloo ranks on 2 cores)
@pytest.mark.parametrize("world", [3, 4])
def test_more_ranks_and_a_2x2_mesh_match_the_unsharded_step_within_rounding(world):
    """On more than two ranks a reduce-scatter sums a slice in another order than the
    all-reduce's ring: the same numbers to rounding, and every rank holds the same params."""
    results = fdp.testing.run(more_ranks, world, backend="gloo", timeout=240)
    for kind in results[0]:
        for rank, got in enumerate(results):
            (p, st), (sp, sst) = got[kind]
            for k in p:
                torch.testing.assert_close(sp[k], p[k], rtol=1e-5, atol=1e-6, msg=f"{kind}, rank {rank}, {k!r}")
            assert_trees_equal(sp, results[0][kind][1][0], f"{kind}: rank {rank} against rank 0")


def test_a_world_of_one_is_the_unsharded_step():
    ((p, st), (sp, sst)), = fdp.testing.run(both, 1, args=("adamw-mask-schedule",))
    assert_trees_equal(p, sp, "params")
    assert_trees_equal(st, sst, "state")


def memory(group):
    net = block_net(seed=1, d=32)
    apply, params, buffers = fdp.functionalize(net)
    reducer = fdp.Reducer(params, group, shard="params", units=fdp.units(net, Block))
    step = reducer.grad_and_update(loss_of(apply, buffers), fdp.optim.adamw(lr=1e-2))
    state = step.init(params)
    params = step.shard(params)  # this rank's slices; the whole tree can go
    net.to("meta")
    for i in range(3):
        params, state, _ = step(params, state, *tokens(group.rank, i))
    held = step.memory()
    slices = sum(t.numel() for t in params.local)
    state_numel = sum(t.numel() for ts in state.buffers.values() for t in ts)
    whole = sum(t.numel() for t in params.template().values())
    return held, slices, state_numel, whole, step.last_step.timeline


def test_each_rank_holds_its_slice_and_gathers_at_most_two_units_beside_the_root(tmp_path):
    for rank, (held, slices, state_numel, whole, timeline) in enumerate(
            fdp.testing.run(memory, 2, backend="gloo", timeout=120)):
        assert held.gathered == 0, f"rank {rank}: gathered params left after the step: {held}"
        assert held.param_sets <= 2 and held.params <= 2 * 4 * slices, held  # this rank's slices only
        assert slices <= whole / 2 + 2 * len(timeline.buckets), (slices, whole)  # (+ each bucket's padding)
        assert state_numel == 2 * slices  # AdamW's two moments of this rank's slice
        # each block gathered twice (its forward, its backward), the root's buckets once
        gathers = {b.index: len(b.gathers) for b in timeline.buckets}
        assert sorted(gathers.values()) == [1, 1, 2, 2, 2], gathers  # (two root buckets: emb, ln)
        units = sorted(b.gather_nbytes for b in timeline.buckets if len(b.gathers) == 2)
        root = sum(b.gather_nbytes for b in timeline.buckets if len(b.gathers) == 1)
        peak = timeline.peak_gathered
        assert peak <= root + units[-1] + units[-2], (peak, root, units)
        assert peak < root + sum(units), "every unit was gathered at once"
        assert all(g.freed is not None for b in timeline.buckets for g in b.gathers), "a gather never freed"
        assert timeline.exposed_gather >= 0
    fig = fdp.viz.plot_timeline(timeline, tmp_path / "zero3.png")
    assert (tmp_path / "zero3.png").read_bytes().startswith(b"\x89PNG")
    assert "all-gather waits" in fig.axes[0].get_title()


def inference(group):
    net = block_net(seed=2)
    apply, params, buffers = fdp.functionalize(net)
    reducer = fdp.Reducer(params, group, shard="params", units=fdp.units(net, Block))
    step = reducer.grad_and_update(loss_of(apply, buffers), fdp.optim.sgd(lr=0.1))
    state = step.init(params)
    params, state, _ = step(params, state, *tokens(group.rank))
    x, _ = tokens(0, 9)
    with torch.no_grad():
        out, _ = apply.eval()(params, buffers, x)
        want, _ = apply.eval()(params.full(), buffers, x)
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        apply(params, buffers, x)
    with pytest.raises(fdp.CheckpointError, match="fully sharded"):
        fdp.save("/tmp/fdp-never-written.pt", {"params": params}, group)
    return torch.equal(out, want), step.memory().gathered, repr(params)


def test_inference_gathers_unit_by_unit_and_equals_the_whole_params():
    for rank, (same, held, text) in enumerate(fdp.testing.run(inference, 2, timeout=120)):
        assert same, f"rank {rank}"
        assert held == 0, f"rank {rank}: {held} bytes still gathered after inference"
        assert "ShardedParams(" in text and "slice" in text


def penalty(group):
    """A loss that reads params directly (an L2 penalty on one block's weight): the unit is
    gathered on the read and kept for the backward."""
    out = []
    for shard in (False, "params"):
        net = block_net(seed=3)
        apply, params, buffers = fdp.functionalize(net)
        base = loss_of(apply, buffers)

        def loss(p, x, y, base=base):
            return base(p, x, y) + 0.01 * (p["blocks.1.fc1.weight"] ** 2).sum()

        units = fdp.units(net, Block) if shard else None
        step = fdp.Reducer(params, group, shard=shard, units=units).grad_and_update(loss, fdp.optim.adam(lr=1e-2))
        state = step.init(params)
        for i in range(3):
            params, state, _ = step(params, state, *tokens(group.rank, i))
        out.append(params.full() if shard else params)
    return out


def test_a_loss_that_reads_a_param_directly_equals_the_unsharded_step():
    for rank, (p, sp) in enumerate(fdp.testing.run(penalty, 2, timeout=120)):
        assert_trees_equal(p, sp, f"rank {rank}")


class Peeker(nn.Module):
    """A model whose forward reads a block's weight outside that block's forward."""

    def __init__(self):
        super().__init__()
        self.block = Block(4)

    def forward(self, x):
        return self.block(x) @ self.block.fc1.weight[:4, :4]


def test_what_cannot_be_fully_sharded_is_refused_with_the_way_out():
    net = block_net()
    apply, params, buffers = fdp.functionalize(net)
    with pytest.raises(ValueError, match="'nope' holds no trainable param"):
        fdp.Reducer(params, shard="params", units=["nope"])
    with pytest.raises(ValueError, match="units= is for params gathered unit by unit"):
        fdp.Reducer(params, units=fdp.units(net, Block))
    with pytest.raises(ValueError, match="param_dtype must be a floating dtype"):
        fdp.Reducer(params, shard=True, param_dtype=torch.int8)
    with pytest.raises(ValueError, match="nothing to choose"):
        fdp.Reducer(params, shard="params", bucket_cap_mb="auto")
    with pytest.raises(ValueError, match="shard must be"):
        fdp.Reducer(params, shard="everything")
    with pytest.raises(ValueError, match="no submodule of type Conv2d"):
        fdp.units(net, nn.Conv2d)
    # a tied param must lie inside one unit: the head tied to the embedding, the embedding a unit
    reducer = fdp.Reducer(params, shard="params", units=["emb"])
    step = reducer.grad_and_update(loss_of(apply, buffers), fdp.optim.sgd(lr=0.1))
    with pytest.raises(ValueError, match="'emb.weight' of unit 'emb' is also the module's 'head.weight'"):
        step(params, step.init(params), *tokens(0))
    # a param read outside its unit's forward is a meta placeholder there: an error, not a read of freed memory
    peek = Peeker()
    apply, params, buffers = fdp.functionalize(peek)
    step = fdp.Reducer(params, shard="params", units=["block"]).grad_and_update(
        lambda p, x: apply(p, buffers, x)[0].sum(), fdp.optim.sgd(lr=0.1))
    with pytest.raises(RuntimeError, match="param .block.fc1.weight. of unit .block. was used outside its unit"):
        step(params, step.init(params), torch.randn(2, 4))


def resume(group, tmp, phase):
    """Two steps, a gathered checkpoint (params.full(), state_to_tree), two more steps; or, on
    another world size, the checkpoint loaded and the two steps after it."""
    net = block_net(seed=5)
    apply, params, buffers = fdp.functionalize(net)
    step = fdp.Reducer(params, group, shard="params", units=fdp.units(net, Block)).grad_and_update(
        loss_of(apply, buffers), OPTIMIZERS["clip-adamw"]())
    state = step.init(params)
    if phase == "save":
        for i in range(2):
            params, state, _ = step(params, state, *tokens(0, i))
        fdp.save(f"{tmp}/ckpt.pt", {"params": params.full(), "opt": step.state_to_tree(state, params)}, group)
    else:
        like = {"params": params, "opt": step.state_to_tree(state, params)}
        loaded = fdp.load(f"{tmp}/ckpt.pt", like=like, group=group)
        params, state = loaded["params"], step.state_from_tree(loaded["opt"], loaded["params"])
    for i in range(2, 4):
        params, state, _ = step(params, state, *tokens(0, i))  # every rank the same data
    return params.full()


def test_a_gathered_checkpoint_resumes_bit_exactly_on_another_world_size(tmp_path):
    straight = fdp.testing.run(resume, 2, args=(str(tmp_path), "save"), timeout=120)[0]
    for rank, again in enumerate(fdp.testing.run(resume, 4, args=(str(tmp_path), "load"), timeout=120)):
        assert_trees_equal(straight, again, f"resumed on 4 ranks, rank {rank}")


def mixed_precision(group):
    """bf16 compute from fp32 master slices: fdp's param_dtype=bf16 and FSDP2's
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), from the same start."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = block_net(seed=8)
    for b in model.blocks:
        fully_shard(b, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for i in range(4):
        x, y = tokens(group.rank, i)
        opt.zero_grad()
        F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).backward()
        opt.step()
    theirs = {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()}
    net = block_net(seed=8)
    apply, params, buffers = fdp.functionalize(net)
    reducer = fdp.Reducer(params, group, shard="params", units=fdp.units(net, Block), param_dtype=torch.bfloat16)

    def loss(p, x, y):
        return F.cross_entropy(apply(p, buffers, x)[0].float().flatten(0, 1), y.flatten())

    step = reducer.grad_and_update(loss, fdp.optim.adamw(lr=1e-2, weight_decay=0.1))
    state = step.init(params)
    for i in range(4):
        params, state, _ = step(params, state, *tokens(group.rank, i))
    with torch.no_grad():
        out, _ = apply(params, buffers, tokens(0, 9)[0])
    return params.full(), theirs, out.dtype, [t.dtype for t in params.local]


def test_bf16_compute_from_fp32_master_slices_equals_fsdp2_mixed_precision():
    for rank, (mine, theirs, out_dtype, kept) in enumerate(
            fdp.testing.run(mixed_precision, 2, backend="gloo", timeout=180)):
        assert out_dtype == torch.bfloat16 and set(kept) == {torch.float32}
        for k in mine:
            assert mine[k].dtype == torch.float32
            assert torch.equal(mine[k], theirs[k]), f"rank {rank}: {k!r} differs from FSDP2's mixed precision"


def uneven(group):
    """Rank 1 runs out of data after two steps: it calls step.idle (its gradients count as
    zeros, the mean is over rank 0), unsharded and fully sharded; against the fused step given
    gradients with active= (the mean over the active ranks)."""
    out = []
    for shard in (False, "params"):
        net = block_net(seed=9)
        apply, params, buffers = fdp.functionalize(net)
        units = fdp.units(net, Block) if shard else None
        step = fdp.Reducer(params, group, shard=shard, units=units).grad_and_update(
            loss_of(apply, buffers), OPTIMIZERS["clip-adamw"](), uneven=True)
        state, p = step.init(params), {k: v.clone() for k, v in params.items()}
        for i in range(4):
            if group.rank == 1 and i >= 2:
                p, state, _ = step.idle(p, state, *tokens(1, 1))  # a stand-in batch
            else:
                p, state, _ = step(p, state, *tokens(group.rank, i))
        out.append(p.full() if shard else p)
    net = block_net(seed=9)
    apply, params, buffers = fdp.functionalize(net)
    loss = loss_of(apply, buffers)
    step = fdp.Reducer(params, group).grad_and_update(loss, OPTIMIZERS["clip-adamw"]())
    state, p = step.init(params), {k: v.clone() for k, v in params.items()}
    for i in range(4):
        active = not (group.rank == 1 and i >= 2)
        g = fdp.local_grad(loss)(p, *tokens(group.rank, i)) if active else None
        p, state = step.update(g, state, p, active=active)
    with pytest.raises(TypeError, match="uneven=True"):
        step.idle(p, state, *tokens(0))
    return out, p


def test_uneven_inputs_a_rank_without_data_idles_and_the_mean_is_over_the_others():
    for rank, ((plain, fully), given) in enumerate(fdp.testing.run(uneven, 2, backend="gloo", timeout=180)):
        assert_trees_equal(plain, given, f"rank {rank}: the unsharded step with idle")
        assert_trees_equal(fully, given, f"rank {rank}: the fully sharded step with idle")


def failing(group, where):
    """Rank 1 fails in its forward or backward at step 1; with fully sharded params the others
    are in the middle of the step's gathers, which that rank issues on its way out."""
    from models import FailOnce

    net = block_net(seed=11)
    apply, params, buffers = fdp.functionalize(net)
    step = fdp.Reducer(params, group, shard="params", units=fdp.units(net, Block)).grad_and_update(
        lambda p, x, y: loss_of(apply, buffers)(p, x, y) if where != "backward" or group.rank != 1
        else F.cross_entropy(FailOnce.apply(apply(p, buffers, x)[0]).flatten(0, 1), y.flatten()),
        fdp.optim.adamw(lr=1e-2))
    state = step.init(params)
    got = []
    for i in range(4):
        fail = group.rank == 1 and i == 1
        if fail and where == "backward":
            FailOnce.arm()
        args = tokens(group.rank, i)
        if fail and where == "forward":
            args = (args[0].float(), args[1])  # float tokens: the embedding raises, in the forward
        try:
            params, state, _ = step(params, state, *args)
            got.append("ok")
        except fdp.CollectiveError:
            got.append("other rank failed")
        except RuntimeError as e:
            if "load a saved state" in str(e):
                got.append("refused")
                state = step.init(params)  # a fresh state: the ranks go on together
            elif "injected" in str(e) or "indices" in str(e):
                got.append("own failure")
            else:
                raise
    return got, params.full()


@pytest.mark.parametrize("where", ["backward", "forward"])
def test_a_rank_failing_in_its_forward_or_backward_fails_the_step_everywhere_at_once(where):
    """On gloo the failed rank issues the gathers the others still expect of it, so every rank
    learns of the failure from the step's status (not a timeout: the run's timeout is 60 s,
    and the group stays usable), and refuses the partly updated state until a fresh one."""
    (got0, p0), (got1, p1) = fdp.testing.run(failing, 2, backend="gloo", timeout=60, args=(where,))
    assert got0 == ["ok", "other rank failed", "refused", "ok"], got0
    assert got1 == ["ok", "own failure", "refused", "ok"], got1
    assert_trees_equal(p0, p1, "the replicas after the failure")


def sharded_checkpoint(group, tmp, phase):
    """Fully sharded params and state saved without a gather (params.shards(),
    step.state_to_shards), loaded on another world size (Shards of its own slices) and on one
    rank into the unsharded fused step (whole tensors)."""
    net = block_net(seed=12)
    apply, params, buffers = fdp.functionalize(net)
    shard = "params" if phase != "load-unsharded" else False
    units = fdp.units(net, Block) if shard else None
    step = fdp.Reducer(params, group, shard=shard, units=units).grad_and_update(
        loss_of(apply, buffers), OPTIMIZERS["clip-adamw"]())
    state = step.init(params)
    if phase == "save":
        params = step.shard(params)
        for i in range(2):
            params, state, _ = step(params, state, *tokens(0, i))
        with pytest.raises(fdp.CheckpointError, match="params.shards"):
            fdp.save(f"{tmp}/wrong.pt", {"params": params}, group)
        fdp.save_sharded(f"{tmp}/ckpt", {"params": params.shards(), "opt": step.state_to_shards(state, params),
                                         "step": 2}, group)
    elif phase == "load":
        params = step.shard(params)  # (any values: the layout is what like describes)
        got = fdp.load_sharded(f"{tmp}/ckpt", {"params": params.shards(), "opt": step.state_to_shards(state, params),
                                               "step": 0}, group)
        assert got["step"] == 2
        params, state = step.shard(got["params"]), step.state_from_shards(got["opt"], params)
    else:  # one rank, unsharded: whole tensors
        got = fdp.load_sharded(f"{tmp}/ckpt", {"params": params, "opt": step.state_to_tree(state, params), "step": 0},
                               group)
        params, state = got["params"], step.state_from_tree(got["opt"], got["params"])
    for i in range(2, 4):
        params, state, _ = step(params, state, *tokens(0, i))  # every rank the same data
    return params.full() if shard else params


@pytest.mark.slow  # (worlds of 1, 2 and 3)
def test_a_sharded_checkpoint_of_fully_sharded_params_resumes_on_any_world_size(tmp_path):
    """Saved on 2 ranks; every rank trains on the same data, so the mean is exact on 1, 2 and
    4 ranks (halves and quarters) and the resumed runs equal the straight one bit for bit;
    on 3 ranks a third of a sum rounds: equal to rounding."""
    straight = fdp.testing.run(sharded_checkpoint, 2, args=(str(tmp_path), "save"), backend="gloo", timeout=120)[0]
    for world, phase in ((4, "load"), (1, "load-unsharded"), (3, "load")):
        for rank, again in enumerate(fdp.testing.run(sharded_checkpoint, world, args=(str(tmp_path), phase),
                                                     backend="gloo", timeout=120)):
            if world == 3:
                for k in straight:
                    torch.testing.assert_close(again[k], straight[k], rtol=1e-5, atol=1e-6)
            else:
                assert_trees_equal(straight, again, f"resumed on {world} ranks ({phase}), rank {rank}")


def transformed_loss(group, kind, sharded):
    """An MLP of blocks trained 3 steps with a loss that runs a ``torch.func`` transform through
    the model: per-example losses under ``vmap``, an input-gradient penalty under ``grad``, a
    Jacobian-vector penalty under ``jvp``."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), Block(16), Block(16), nn.Linear(16, 4))
    apply, params, _ = fdp.functionalize(net)
    options = {"shard": "params", "units": fdp.units(net, Block)} if sharded else {}

    def base(p, x, y):
        return F.cross_entropy(apply(p, {}, x)[0], y)

    def loss(p, x, y):
        if kind == "vmap":
            return torch.func.vmap(lambda xi, yi: base(p, xi[None], yi[None]))(x, y).mean()
        if kind == "grad":
            return base(p, x, y) + (torch.func.grad(lambda xx: base(p, xx, y))(x) ** 2).sum()
        _, tangent = torch.func.jvp(lambda xx: apply(p, {}, xx)[0], (x,), (torch.ones_like(x),))
        return base(p, x, y) + 0.1 * (tangent ** 2).mean()

    step = fdp.Reducer(params, group, **options).grad_and_update(loss, fdp.optim.adamw(lr=1e-2))
    state = step.init(params)
    if sharded:
        params = step.shard(params)
    g = torch.Generator().manual_seed(group.rank)
    for _ in range(3):
        params, state, _ = step(params, state, torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g))
    return params.full() if sharded else params


@pytest.mark.parametrize("kind", ["vmap", "grad"])
def test_vmap_and_grad_inside_the_loss_run_fully_sharded_with_the_unsharded_numbers(kind):
    want = fdp.testing.run(transformed_loss, 2, args=(kind, False))
    for rank, got in enumerate(fdp.testing.run(transformed_loss, 2, args=(kind, True))):
        assert_trees_equal(got, want[rank], f"{kind}, rank {rank}")


# torch registers its jvp decompositions with torch.jit.script on the first jvp of an nll_loss,
# which warns that torch.jit.script is deprecated: torch's warning, not fdp's.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_jvp_through_a_unit_inside_the_loss_is_refused_by_name_on_every_rank():
    fdp.testing.run(transformed_loss, 2, args=("jvp", False))  # the unsharded step runs it

    def refused(group):
        try:
            transformed_loss(group, "jvp", True)
        except RuntimeError as e:
            return str(e)
    for message in fdp.testing.run(refused, 2, timeout=60):
        assert re.search(r"torch.func.jvp .* fully sharded params .* shard=True", message), message


def grads_of_sharded(group):
    net = block_net(seed=0)
    apply, params, buffers = fdp.functionalize(net)
    reducer = fdp.Reducer(params, group, shard="params", units=fdp.units(net, Block))
    loss = loss_of(apply, buffers)
    sharded = reducer.grad_and_update(loss, fdp.optim.sgd(lr=0.1)).shard(params)
    errors = []
    for call in (lambda: reducer.grad(loss)(sharded, *tokens(0)), lambda: fdp.local_grad(loss)(sharded, *tokens(0))):
        try:
            call()
        except TypeError as e:
            errors.append(str(e))
    return errors


def test_reducer_grad_and_local_grad_given_sharded_params_say_what_to_use():
    for errors in fdp.testing.run(grads_of_sharded, 2):
        assert len(errors) == 2
        assert errors[0].startswith("fdp.Reducer.grad got fdp.ShardedParams") and "grad_and_update" in errors[0]
        assert errors[1].startswith("fdp.local_grad got fdp.ShardedParams") and "params.full()" in errors[1]


def averaged(group, fully, with_muon):
    """An EMA of AdamW (or of Muon, in a partition beside AdamW) over 3 steps, read with
    ``step.ema_params``: ShardedParams when fully sharded, evaluated with ``apply``."""
    net = block_net(seed=0)
    apply, params, buffers = fdp.functionalize(net)
    if with_muon:
        opt = fdp.optim.partition(lambda k, p: "m" if p.dim() == 2 and k.startswith("blocks") else "a",
                                  {"m": fdp.optim.ema(fdp.optim.muon(lr=0.02), decay=0.9),
                                   "a": fdp.optim.adamw(lr=1e-2)})
    else:
        opt = fdp.optim.ema(fdp.optim.adamw(lr=1e-2), decay=0.9)
    options = {"shard": "params", "units": fdp.units(net, Block)} if fully else {}
    step = fdp.Reducer(params, group, **options).grad_and_update(loss_of(apply, buffers), opt)
    state = step.init(params)
    if fully:
        params = step.shard(params)
    before = step.ema_params(state, params)
    for i in range(3):
        params, state, _ = step(params, state, *tokens(group.rank, i))
    average = step.ema_params(state, params)
    assert isinstance(average, fdp.ShardedParams) == fully
    with torch.no_grad():
        logits = apply.eval()(average, buffers, tokens(0, 9)[0])[0]
    whole = (lambda p: p.full()) if fully else (lambda p: p)
    if fully:
        with pytest.raises(TypeError, match="step.ema_params"):
            fdp.optim.ema_params(step.state_to_shards(state, params), params)
    return whole(before), whole(average), whole(params), logits


@pytest.mark.parametrize("with_muon", [False, True], ids=["ema-adamw", "ema-muon-in-a-partition"])
def test_the_ema_of_fully_sharded_params_is_sharded_params_equal_to_the_fused_steps_average(with_muon):
    want = fdp.testing.run(averaged, 2, args=(False, with_muon))
    for rank, (before, average, params, logits) in enumerate(fdp.testing.run(averaged, 2, args=(True, with_muon))):
        assert_trees_equal(average, want[rank][1], f"average, rank {rank}")
        assert_trees_equal(before, want[rank][0], f"before any update, rank {rank}")
        assert torch.equal(logits, want[rank][3])
        assert not torch.equal(average["blocks.0.fc1.weight"], params["blocks.0.fc1.weight"])


def test_a_hook_that_is_not_a_sum_is_refused_naming_shard_params():
    net = block_net(seed=1)
    _, params, _ = fdp.functionalize(net)
    with pytest.raises(TypeError, match=r"shard='params' reduce-scatters buckets .* noop is not one"):
        fdp.Reducer(params, None, shard="params", units=fdp.units(net, Block), comm_hook=fdp.hooks.noop)


def test_a_units_gathered_params_are_freed_before_its_gradients_take_a_flat_buffer(monkeypatch):
    # Once every gradient of a unit is in, nothing needs its params: they are freed before the
    # step machine takes a (transient) flat buffer for the gradients and copies them in, so the
    # gathered unit and the buffer are never held together (``StepSpec.on_complete``).
    import threading

    from fdp._plan.buffers import BucketBuffers
    from fdp._units.units import Units, UnitState

    made, seen = {}, []  # (the ranks are threads: each rank's units by its thread)
    init, wire = Units.__init__, BucketBuffers.wire

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made[threading.get_ident()] = self

    def recording_wire(self, b):
        seen.append(made[threading.get_ident()].state[b])
        return wire(self, b)

    monkeypatch.setattr(Units, "__init__", recording_init)
    monkeypatch.setattr(BucketBuffers, "wire", recording_wire)
    records = fdp.testing.run(lambda g: train(g, "params", OPTIMIZERS["sgd-nesterov"], steps=2)[2], 2)
    assert len(seen) >= 2 * 2 * len(records[0].timeline.buckets)
    assert all(s is UnitState.FREE for s in seen), seen
