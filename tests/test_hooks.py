"""Comm hooks: compression and PowerSGD equal DDP's hooks; user hooks; bad hooks."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import batch, mlp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

import fdp


def train_both(group, fdp_hook, ddp_hook, ddp_state, steps, world_lr=0.05, one_bucket=False, warmup=False,
               resync=False):
    """Train the same model with DDP+hook and fdp+hook on the same per-rank data.

    ``warmup``: one DDP backward without an update first. DDP reduces everything as a single
    bucket in its first iteration and only then builds its real buckets; with more than two
    ranks a low-precision sum depends on the bucket layout (gloo's ring splits buffers by
    position), so layouts must agree for a bit-exact comparison.
    """
    width = 24
    ddp = nn.parallel.DistributedDataParallel(mlp(width=width, seed=11), bucket_cap_mb=1 if one_bucket else 0.001)
    ddp.register_comm_hook(ddp_state(group) if callable(ddp_state) else ddp_state, ddp_hook)
    apply, params, buffers = fdp.functionalize(mlp(width=width, seed=11))
    caps = dict(bucket_cap_mb=1, first_bucket_cap_mb=1) if one_bucket else dict(bucket_cap_mb=0.001, first_bucket_cap_mb=0.001)
    reducer = fdp.Reducer(params, group, comm_hook=fdp_hook, **caps)
    grad_fn = reducer.grad(lambda p, x, y: F.cross_entropy(apply(p, buffers, x)[0], y))
    opt = torch.optim.SGD(ddp.parameters(), lr=world_lr)
    if warmup:
        x, y = batch(group.rank, 99, shape=(8,))
        F.cross_entropy(ddp(x), y).backward()
    history = []
    for step in range(steps):
        x, y = batch(group.rank, step, shape=(8,))
        x = x * 40  # gradients well inside fp16's normal range
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        grads = grad_fn(params, x, y)
        ddp_grads = {k: p.grad.clone() for k, p in ddp.module.named_parameters()}
        history.append((grads, ddp_grads))
        opt.step()
        params = {k: p.clone().add_(grads[k], alpha=-world_lr) for k, p in params.items()}
        if resync:  # compare each step's reduction on identical inputs
            params = {k: p.detach().clone() for k, p in ddp.module.named_parameters()}
    return history


def pg(group):
    return group.process_group


def ddp_bf16_hook(state, bucket):
    """DDP's own bf16_compress_hook. DDP refuses to register it off CUDA/NCCL by checking the
    function's name only; gloo reduces bf16 on CPU fine, so call it under another name."""
    return default_hooks.bf16_compress_hook(state, bucket)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_compression_hooks_equal_ddp_hooks(name, world_size):
    fdp_hook = {"bf16": fdp.hooks.bf16_compress, "fp16": fdp.hooks.fp16_compress}[name]
    ddp_hook = {"bf16": ddp_bf16_hook, "fp16": default_hooks.fp16_compress_hook}[name]
    for rank, history in enumerate(fdp.testing.run(train_both, world_size, backend="gloo",
                                                   args=(fdp_hook, ddp_hook, pg, 3, 0.05, False, True,
                                                         name == "fp16"),
                                                   timeout=60)):
        for step, (mine, theirs) in enumerate(history):
            for k in theirs:
                assert_same_compressed(mine[k], theirs[k], name, world_size,
                                       f"rank {rank}, step {step}, leaf {k!r}")


def assert_same_compressed(mine, theirs, name, world_size, where):
    """bf16: bit-exact. fp16: bit-exact except where a rank's share was an fp16 subnormal.

    DDP casts to fp16 and then divides by the world size in fp16, which rounds a second
    time when the quotient is subnormal (< 2**-14); fdp multiplies in fp32 and rounds once
    (the closer value). A share may then differ by one subnormal step (2**-24); with two
    ranks that is all; with more, the fp16 partial sums of gloo's ring can round the other
    way too (a few fp16 ulps of the partial sums). Everything else is bit-exact.
    """
    if name == "bf16":
        assert torch.equal(mine, theirs), where
        return
    diff = (mine - theirs).abs()
    if world_size == 2:
        ulp = torch.finfo(torch.float16).eps * theirs.abs()
        assert bool((diff <= 2 * 2**-24 + ulp).all()), f"{where}: max diff {diff.max()}"
    else:
        torch.testing.assert_close(mine, theirs, rtol=2**-8, atol=2**-12, msg=where)
    assert (diff == 0).float().mean() > 0.8, where  # the first layer has many tiny gradients

def test_compressed_reduction_really_travels_in_low_precision():
    def body(group):
        params = {"w": torch.full((1000,), 1.0 + 2**-12)}  # not representable in bf16
        return fdp.Reducer(params, group, comm_hook=fdp.hooks.bf16_compress).all_reduce(params)["w"]

    for out in fdp.testing.run(body, 2):
        assert out.dtype == torch.float32
        assert torch.equal(out, torch.ones(1000))  # rounded on the wire


def powersgd_state(group):
    return psgd.PowerSGDState(process_group=group.process_group, matrix_approximation_rank=1,
                              start_powerSGD_iter=2, random_seed=0)


def test_powersgd_equals_ddp_powersgd_hook():
    hook = fdp.hooks.powersgd(rank=1, start_iter=2)
    res = fdp.testing.run(train_both, 2, backend="gloo",
                          args=(hook, psgd.powerSGD_hook, powersgd_state, 5, 0.05, True), timeout=60)
    for rank, history in enumerate(res):
        for step, (mine, theirs) in enumerate(history):
            for k in theirs:
                assert torch.equal(mine[k], theirs[k]), f"rank {rank}, step {step}, leaf {k!r}"
    # and it really compressed after start_iter: rank-1 updates of the 24x24 matrices
    last_grads = res[0][-1][0]
    assert torch.linalg.matrix_rank(last_grads["2.weight"]) == 1


def test_powersgd_allows_start_iter_zero():
    def body(group):
        _, params, _ = fdp.functionalize(mlp(width=24, seed=3))
        hook = fdp.hooks.powersgd(rank=2, start_iter=0)
        reducer = fdp.Reducer(params, group, comm_hook=hook)
        out = reducer.all_reduce(params)
        return torch.linalg.matrix_rank(out["2.weight"]).item(), hook.state.iter

    assert fdp.testing.run(body, 2, backend="gloo") == [(2, 1), (2, 1)]


def test_user_hook_sees_prescaled_bucket_and_its_result_is_used():
    seen = []

    def max_hook(bucket, flat, group):
        seen.append((bucket.index, bucket.paths))
        work = dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group.process_group, async_op=True)
        return work.get_future().then(lambda f: f.value()[0])

    def body(group):
        params = {"a": torch.full((3,), float(group.rank + 1)), "b": torch.full((2,), 10.0 * (group.rank + 1))}
        return fdp.Reducer(params, group, comm_hook=max_hook).all_reduce(params)

    for out in fdp.testing.run(body, 2):
        assert torch.equal(out["a"], torch.full((3,), 1.0))   # max(1, 2) * 1/2
        assert torch.equal(out["b"], torch.full((2,), 10.0))
    assert seen[0][1] == ("['b']", "['a']")

    def unscaled(group):
        params = {"a": torch.full((3,), float(group.rank + 1))}
        hook = fdp.hooks.CommHook(max_hook, prescale=False)
        return fdp.Reducer(params, group, comm_hook=hook).all_reduce(params)["a"]

    assert [t.tolist() for t in fdp.testing.run(unscaled, 2)] == [[2.0] * 3] * 2


def test_noop_hook_keeps_local_scaled_gradients():
    def body(group):
        params = {"a": torch.full((3,), float(group.rank + 1))}
        return fdp.Reducer(params, group, comm_hook=fdp.hooks.noop).all_reduce(params)["a"]

    out = fdp.testing.run(body, 2)
    assert torch.equal(out[0], torch.full((3,), 0.5)) and torch.equal(out[1], torch.full((3,), 1.0))


@pytest.mark.parametrize("bad,match", [
    (lambda b, f, g: f, r"returned Tensor for bucket 0; it must return a torch.futures.Future"),
    (lambda b, f, g: _done("nope"), r"returned a str for bucket 0; expected a floating tensor of 5"),
    (lambda b, f, g: _done(torch.zeros(4)), r"returned a torch.float32 tensor of shape \(4,\) for bucket 0"),
])
def test_a_hook_returning_the_wrong_thing_is_a_clear_error(bad, match):
    params = {"a": torch.zeros(5)}
    with pytest.raises(TypeError, match=match):
        fdp.Reducer(params, comm_hook=bad).all_reduce(params)


def _done(value):
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def test_hook_and_reduce_dtype_must_agree():
    with pytest.raises(ValueError, match="conflicts"):
        fdp.Reducer({"a": torch.zeros(2)}, comm_hook=fdp.hooks.bf16_compress, reduce_dtype=torch.float16)
    with pytest.raises(TypeError, match="callable"):
        fdp.hooks.CommHook(3)
