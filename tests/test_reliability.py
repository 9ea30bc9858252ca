"""Reliability, round 3 (issue 28): where two features meet, the right numbers or a named
error on every rank. One test per case, grouped by the issue's numbering; every number is
checked against the plain path (``reducer.grad`` + ``opt.update``), DDP + torch.optim, or
torch's own functions, on simulated ranks (threads, and gloo processes where it matters)."""

import math
import os
import re

import optree
import pytest
import torch
import torch.nn.functional as F
from models import batch, mlp
from test_fused import CAPS, loss_of
from torch import nn

import fdp


def assert_trees_equal(a, b, what):
    la, lb = fdp._tree.leaves(a), fdp._tree.leaves(b)
    assert len(la) == len(lb), f"{what}: {len(la)} leaves against {len(lb)}"
    for path, x, y in zip(fdp._tree.paths(fdp._tree.structure(a)), la, lb):
        assert torch.equal(x, y), f"{what}: leaf {path} differs (max {(x - y).abs().max().item():.3g})"


def square(seed=0):
    """A model whose weight is square (so ``w.t()`` has its shape) and a loss of it."""
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(4, 4, generator=g), "b": torch.randn(4, generator=g)}

    def loss(p, x):
        return (torch.tanh(x @ p["w"] + p["b"]) ** 2).sum() + (p["w"] @ p["w"]).sum() * 0.1

    return params, loss


# ----------------------------------------------------------------------------- case 1
def other_views(group, make_view):
    params, loss = square()
    opt = fdp.optim.adam(lr=0.1)
    reducer = fdp.Reducer(params, group)
    step = reducer.grad_and_update(loss, opt)
    state = step.init(params)
    plain, pstate = dict(params), opt.init(params)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(group.rank))
    fused, state, _ = step(params, state, x)
    plain, pstate = opt.update(reducer.grad(loss)(plain, x), pstate, plain)
    # Hand back another view of the memory the step returned: same data pointer, other values.
    # (The plain path gets the same values contiguous: a transposed operand changes how the
    # matmul sums, and the fused step packs the values into its contiguous buffers.)
    returned = fused["w"]
    fused = {**fused, "w": make_view(returned)}
    assert fused["w"].data_ptr() == returned.data_ptr() and fused["w"].shape == returned.shape
    plain = {**plain, "w": make_view(plain["w"]).contiguous()}
    for _ in range(2):
        fused, state, _ = step(fused, state, x)
        plain, pstate = opt.update(reducer.grad(loss)(plain, x), pstate, plain)
    return fused, plain


@pytest.mark.parametrize("backend", ["threads", "gloo"])
@pytest.mark.parametrize("view", ["transpose", "expand"])
def test_1_another_view_of_the_returned_memory_is_packed_not_taken_as_unchanged(view, backend):
    make_view = {"transpose": lambda w: w.t(), "expand": lambda w: w[0].expand(4, 4)}[view]
    for rank, (fused, plain) in enumerate(fdp.testing.run(other_views, 2, backend=backend, args=(make_view,))):
        assert_trees_equal(fused, plain, f"rank {rank}, params after a {view} view was passed back")


# ----------------------------------------------------------------------------- case 2
class KernelFault:
    """An optimizer whose ``LeafKernel`` raises on one rank, from its ``nth`` call of an armed
    step on (so that rank has updated some buckets first): out of memory in the update."""

    def __init__(self, opt, rank, nth=1):
        self.calls, self.armed, self.rank, self.nth = 0, False, rank, nth
        kernel = opt.leaf_kernel

        def step(*args):
            if self.armed:
                self.calls += 1
                if self.calls > self.nth:
                    raise RuntimeError(f"injected failure in the optimizer's kernel (call {self.calls})")
            return kernel.step(*args)

        self.opt = opt._replace(leaf_kernel=kernel._replace(step=step))


WHERE = {  # how a step's updates come after its backward
    "clip": dict(clip=True),
    "skip_nonfinite": dict(skip_nonfinite=True),
    "sharded-clip": dict(clip=True, shard=True),
    "sharded-skip_nonfinite": dict(skip_nonfinite=True, shard=True),
}


def kernel_fails_on_one_rank(group, where):
    cfg = WHERE[where]
    apply, params, buffers = fdp.functionalize(mlp(seed=12))
    loss = loss_of(apply, buffers)
    adamw = fdp.optim.adamw(lr=1e-2, weight_decay=0.1, mask=lambda path, p: p.dim() >= 2)
    fault = KernelFault(adamw, rank=1)
    clip = (fdp.optim.clip_by_global_norm(0.5),) if cfg.get("clip") else ()
    opt, plain_opt = fdp.optim.chain(*clip, fault.opt), fdp.optim.chain(*clip, adamw)
    reducer = fdp.Reducer(params, group, skip_nonfinite=cfg.get("skip_nonfinite", False),
                          shard=cfg.get("shard", False), hook_threshold_bytes=0, **CAPS)
    step = reducer.grad_and_update(loss, opt)
    state = step.init(params)
    fused = {k: v.clone() for k, v in params.items()}
    fused, state, _ = step(fused, state, *batch(group.rank, 0))
    fault.armed = group.rank == fault.rank
    try:
        step(fused, state, *batch(group.rank, 1))
        failed = None
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        failed = (type(e).__name__, str(e))
    fault.armed = False
    try:  # the partly updated state is refused (before any collective: no rank waits)
        step(fused, state, *batch(group.rank, 1))
        refused = None
    except Exception as e:  # noqa: BLE001
        refused = (type(e).__name__, str(e))
    # A fresh state goes on; the pure step left `fused` as it was: the plain path from here.
    state = step.init(fused)
    plain, pstate = dict(fused), plain_opt.init(fused)
    for i in range(2, 4):
        fused, state, _ = step(fused, state, *batch(group.rank, i))
        plain, pstate = plain_opt.update(reducer.grad(loss)(plain, *batch(group.rank, i)), pstate, plain)
    return failed, refused, fused, plain


@pytest.mark.parametrize("backend", ["threads", "gloo"])
@pytest.mark.parametrize("where", list(WHERE))
def test_2_a_kernel_failure_after_the_backward_fails_the_step_on_every_rank_and_refuses_the_state(where, backend):
    # A short timeout: a rank left waiting in a collective would end in a timeout error,
    # which the messages below do not match.
    results = fdp.testing.run(kernel_fails_on_one_rank, 2, backend=backend, timeout=30, args=(where,))
    for rank, (failed, refused, fused, plain) in enumerate(results):
        assert failed is not None, f"rank {rank}: the step reported success while rank 1's update failed"
        if rank == 1:
            assert failed[0] == "RuntimeError" and "injected failure" in failed[1], f"rank 1: {failed}"
        else:
            assert failed[0] == "CollectiveError", f"rank {rank}: {failed}"
            assert re.search(r"failed on 1 other rank\(s\) of 2 after the backward.*this is rank 0", failed[1]), failed[1]
            assert "timeout" not in failed[1].split("this is rank")[0], failed[1]
        # Every rank had updated something (rank 1 its first kernel call's leaves) before the
        # failure was known: each refuses the state, naming what happened.
        assert refused is not None and refused[0] == "RuntimeError", f"rank {rank}: a partly updated state was used"
        assert re.search(r"updated .*optimizer state in place", refused[1]), refused[1]
        assert_trees_equal(fused, plain, f"rank {rank}, after a fresh state")
        assert_trees_equal(fused, results[0][2], f"rank {rank} is not a replica of rank 0")


# ----------------------------------------------------------------------------- case 3
def under_inference_mode(group):
    apply, params, buffers = fdp.functionalize(mlp(seed=13))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.adamw(lr=1e-2)
    x, y = batch(group.rank, 0)
    local = torch.func.grad(loss)(params, x, y)  # torch's own gradient of this rank, outside
    with torch.inference_mode():
        reducer = fdp.Reducer(params, group, **CAPS)  # made inside too: its buffers are used outside
        grads = reducer.grad(loss)(params, x, y)
        inside = torch.func.grad(loss)(params, x, y)
        step = reducer.grad_and_update(loss, opt)
        fused, state, _ = step(params, step.init(params), x, y)
    want = fdp.psum({k: g / group.size for k, g in local.items()}, group)
    plain = opt.update(reducer.grad(loss)(params, x, y), opt.init(params), params)[0]
    return grads, inside, local, want, fused, plain


@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_3_inference_mode_gives_the_right_gradients_and_updates(backend):
    for rank, (grads, inside, local, want, fused, plain) in enumerate(
            fdp.testing.run(under_inference_mode, 2, backend=backend)):
        assert_trees_equal(inside, local, f"rank {rank}: torch.func.grad inside inference_mode")
        for k in want:  # the mean of torch.func.grad's over the ranks (two ranks: one rounding)
            torch.testing.assert_close(grads[k], want[k], rtol=1e-6, atol=1e-7, msg=f"rank {rank}, grad {k!r}")
            assert grads[k].abs().sum() > 0, f"rank {rank}: zero gradient for {k!r}"
        assert_trees_equal(fused, plain, f"rank {rank}: fused step inside inference_mode")
