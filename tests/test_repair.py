"""The fused step's repair path: one rank's update fails after the others made theirs, and the
next call restores that rank's params and optimizer state from a healthy rank, every part of
the state included (injected hyper-parameters of any pytree shape, an EMA, a partition with
Muon, a loss scale, multi-step accumulation), or every rank raises a named error; no rank is
ever left in a collective the others do not enter."""

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
}


def fails_then_restores(group, wrapper):
    """Rank 1's update fails at step 1 (a transform after the clip raises there); steps 2 and 3
    run on every rank; the plain path beside it never fails."""
    apply, params, buffers = fdp.functionalize(mlp(seed=3))
    loss = loss_of(apply, buffers)
    fault = TransformFault(rank=1)
    inner = WRAPPERS[wrapper]()
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(0.5), fault.transform, inner)
    plain_opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(0.5), inner)
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


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
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
