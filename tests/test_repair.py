"""The fused step's repair path: one rank's update fails after the others made theirs, and the
next call restores that rank's params and optimizer state from a healthy rank, every part of
the state included (injected hyper-parameters of any pytree shape: a tuple, floats, a 0-d
tensor; an EMA; a partition with Muon; a loss scale), or every rank raises a named error; no
rank is ever left in a collective the others do not enter. Sharded steps (shard=True and
"params"), where no rank holds a whole state to restore from, fail every rank by name and go
on together from a fresh state. (multi_steps and adafactor never reach the fused step: they
are refused by name, tests/test_optim_multi_steps.py.)"""

import pytest
import torch
from models import CAPS, batch, loss_of, mlp
from test_compositions import TransformFault
from trees import assert_trees_equal

import fdp


def hidden(key, p):
    return "muon" if p.dim() == 2 and key not in ("0.weight", "6.weight") else "adamw"


WRAPPERS = {
    "inject-adamw": lambda: fdp.optim.inject_hyperparams(fdp.optim.adamw)(lr=1e-2, betas=(0.8, 0.99),
                                                                         weight_decay=0.1),
    "ema-adamw": lambda: fdp.optim.ema(fdp.optim.adamw(lr=1e-2), decay=0.9),
    "partition-muon-adamw": lambda: fdp.optim.partition(hidden, {"muon": fdp.optim.muon(lr=0.02),
                                                                 "adamw": fdp.optim.adamw(lr=1e-2)}),
    "ema-in-a-partition": lambda: fdp.optim.partition(
        lambda k, p: "a" if p.dim() == 2 else "b",
        {"a": fdp.optim.ema(fdp.optim.sgd(lr=0.1, momentum=0.9), decay=0.9), "b": fdp.optim.adamw(lr=1e-2)}),
    # hyper-parameters as a 0-d tensor, a float and a tuple
    "inject-tensor-lr": lambda: fdp.optim.inject_hyperparams(fdp.optim.adam)(
        lr=torch.tensor(1e-2), betas=(0.85, 0.995), eps=1e-7),
}
# Parts that must come first in the chain (before the clip and the failing transform).
FIRST = {
    "loss-scale": lambda: fdp.optim.loss_scale(init_scale=2.0 ** 4, growth_interval=2),
}


def fails_then_restores(group, wrapper):
    """Rank 1's update fails at step 1 (a transform after the clip raises there); steps 2 and 3
    run on every rank; the plain path beside it never fails."""
    apply, params, buffers = fdp.functionalize(mlp(seed=3))
    loss = loss_of(apply, buffers)
    fault = TransformFault(rank=1)
    first = [FIRST[wrapper]()] if wrapper in FIRST else []
    inner = fdp.optim.adamw(lr=1e-2) if wrapper in FIRST else WRAPPERS[wrapper]()
    opt = fdp.optim.chain(*first, fdp.optim.clip_by_global_norm(0.5), fault.transform, inner)
    plain_opt = fdp.optim.chain(*first, fdp.optim.clip_by_global_norm(0.5), inner)
    reducer = fdp.Reducer(params, group, hook_threshold_bytes=0, **CAPS)
    step = reducer.grad_and_update(loss, opt)
    state, fused = step.init(params), dict(params)
    plain, pstate = dict(params), plain_opt.init(params)
    plain_grad = fdp.Reducer(params, group, **CAPS).grad(loss)  # (its own reducer: never refused)
    errors = []
    for i in range(4):
        fault.armed = i == 1 and group.rank == fault.rank
        try:
            fused, state, _ = step(fused, state, *batch(group.rank, i))
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            errors.append((i, type(e).__name__, str(e)))
        fault.armed = False
        # (step 1 is whole on rank 0, and the next call gives rank 1 rank 0's result)
        plain, pstate = plain_opt.update(plain_grad(plain, *batch(group.rank, i)), pstate, plain)
    tree = step.state_to_tree(state, fused)
    return errors, fused, plain, fdp._tree.leaves(tree), fdp._tree.leaves(pstate)


@pytest.mark.parametrize("wrapper", list(WRAPPERS) + list(FIRST))
@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_a_failed_update_is_restored_with_every_part_of_the_state(wrapper, backend):
    results = fdp.testing.run(fails_then_restores, 2, backend=backend, timeout=60, args=(wrapper,))
    for rank, (errors, fused, plain, tree, pstate) in enumerate(results):
        assert [e[0] for e in errors] == ([1] if rank == 1 else []), errors
        assert_trees_equal(fused, plain, f"{wrapper}, rank {rank}: params")
        assert len(tree) == len(pstate)
        for j, (a, b) in enumerate(zip(tree, pstate)):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), f"{wrapper}, rank {rank}: state leaf {j}"


def fails_sharded(group, wrapper, shard):
    """The same failure in a sharded step: each rank updates its own slice as its bucket lands,
    so no rank holds a whole state to restore the others from: every rank raises at step 1,
    refuses the state at step 2 (named), and goes on together from a fresh one."""
    from models import Block, block_net, tokens
    from test_fully_sharded import loss_of as token_loss

    net = block_net(seed=4)
    apply, params, buffers = fdp.functionalize(net)
    fault = TransformFault(rank=1, reach="element")  # (a slice of a leaf is enough for it)
    first = [FIRST[wrapper]()] if wrapper in FIRST else []
    inner = fdp.optim.adamw(lr=1e-2) if wrapper in FIRST else WRAPPERS[wrapper]()
    opt = fdp.optim.chain(*first, fdp.optim.clip_by_global_norm(0.5), fault.transform, inner)
    kw = {"units": fdp.units(net, Block)} if shard == "params" else {}
    step = fdp.Reducer(params, group, shard=shard, **kw).grad_and_update(token_loss(apply, buffers), opt)
    if shard == "params":
        params = step.shard(params)
    state = step.init(params)
    seen = []
    for i in range(4):
        fault.armed = i == 1 and group.rank == fault.rank
        try:
            params, state, _ = step(params, state, *tokens(group.rank, i))
            seen.append("ok")
        except fdp.CollectiveError as e:
            seen.append(f"CollectiveError: {e}")
        except RuntimeError as e:
            seen.append(f"RuntimeError: {e}")
            if "load a saved state" in str(e):
                state = step.init(params)
        fault.armed = False
    full = params.full() if isinstance(params, fdp.ShardedParams) else params
    return seen, full


@pytest.mark.parametrize("wrapper", ["inject-adamw", "inject-tensor-lr", "ema-adamw", "loss-scale", "partition-muon-adamw"])
@pytest.mark.parametrize("shard", [True, "params"])
def test_a_failed_update_in_a_sharded_step_fails_every_rank_by_name_and_goes_on_from_a_fresh_state(wrapper, shard):
    (seen0, p0), (seen1, p1) = fdp.testing.run(fails_sharded, 2, backend="gloo", timeout=90, args=(wrapper, shard))
    assert seen1[1].startswith("RuntimeError") and "injected" in seen1[1], seen1
    assert seen0[1].startswith("CollectiveError") and "failed on 1 other rank(s)" in seen0[1], seen0
    for seen in (seen0, seen1):
        assert seen[0] == "ok" and seen[3] == "ok", seen
        assert seen[2].startswith("RuntimeError") and "load a saved state" in seen[2], seen
    assert_trees_equal(p0, p1, f"{wrapper}, shard={shard}: the replicas after going on")
