"""``param_dtype=`` in every fused step kind: the loss runs on the params cast to bf16, the
masters, gradients' buckets and optimizer state stay fp32, and floating inputs are cast to the
params' dtype by ``apply`` (FSDP2's ``cast_forward_inputs``). Against torch itself: a bf16 copy
of an fp32 master model, its gradients cast to fp32 and averaged, ``torch.optim.AdamW``."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import Block
from torch import nn
from trees import assert_trees_equal

import fdp

KINDS = {"fused": {}, "shard=True": {"shard": True}, "shard=params": {"shard": "params"}}


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Block(16), Block(16), nn.Linear(16, 4))


def data(rank: int, i: int):
    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def fdp_bf16(group, kind, clip=False, accumulate=False, steps=3):
    net = build()
    apply, params, _ = fdp.functionalize(net)
    options = dict(KINDS[kind])
    if kind == "shard=params":
        options["units"] = fdp.units(net, Block)
    opt = fdp.optim.adamw(lr=1e-2, weight_decay=0.1)
    if clip:
        opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(0.5), opt)

    def loss(p, x, y):  # x is fp32: apply casts it to the params' bf16
        return F.cross_entropy(apply(p, {}, x)[0].float(), y)

    step = fdp.Reducer(params, group, param_dtype=torch.bfloat16, **options).grad_and_update(loss, opt)
    state = step.init(params)
    if kind == "shard=params":
        params = step.shard(params)
    for i in range(steps):
        if accumulate:
            step.accumulate(params, *data(group.rank, 50 + i))
        params, state, _ = step(params, state, *data(group.rank, i))
    whole = params.full() if kind == "shard=params" else params
    assert all(t.dtype == torch.float32 for t in whole.values())  # the masters
    return whole


def torch_bf16(group, clip=False, accumulate=False, steps=3):
    """A bf16 copy of the fp32 master model runs each micro-batch; its gradients are cast to
    fp32, summed, averaged over the ranks; AdamW updates the masters."""
    master = build()
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.1)
    for i in range(steps):
        low = copy.deepcopy(master).to(torch.bfloat16)
        batches = ([data(group.rank, 50 + i)] if accumulate else []) + [data(group.rank, i)]
        grads = None
        for x, y in batches:
            F.cross_entropy(low(x.to(torch.bfloat16)).float(), y).backward()
            now = [p.grad.float() for p in low.parameters()]
            grads = now if grads is None else [a + b for a, b in zip(grads, now)]
            low.zero_grad()
        for p, g in zip(master.parameters(), grads):
            dist.all_reduce(g, group=group.process_group)
            p.grad = g / group.size
        if clip:
            nn.utils.clip_grad_norm_(master.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in master.named_parameters()}


@pytest.mark.parametrize("kind", list(KINDS))
def test_bf16_params_from_fp32_masters_equal_torchs_bf16_copy_in_every_step_kind(kind):
    want = fdp.testing.run(torch_bf16, 2)
    for rank, got in enumerate(fdp.testing.run(fdp_bf16, 2, args=(kind,))):
        assert_trees_equal(got, want[rank], f"{kind}, rank {rank}")


@pytest.mark.parametrize("kind", ["fused", "shard=True"])
def test_bf16_with_clipping_and_accumulation_equals_torch(kind):
    want = fdp.testing.run(torch_bf16, 2, args=(True, True))
    for rank, got in enumerate(fdp.testing.run(fdp_bf16, 2, args=(kind, True, True))):
        assert_trees_equal(got, want[rank], f"{kind}, rank {rank}")


def test_the_fully_sharded_bf16_step_with_clipping_and_accumulation_equals_the_fused_one():
    want = fdp.testing.run(fdp_bf16, 2, args=("fused", True, True))
    for rank, got in enumerate(fdp.testing.run(fdp_bf16, 2, args=("shard=params", True, True))):
        assert_trees_equal(got, want[rank], f"rank {rank}")


def test_apply_casts_floating_inputs_to_lower_precision_params_and_can_be_told_not_to():
    net = build()
    apply, params, _ = fdp.functionalize(net)
    low = {k: v.to(torch.bfloat16) for k, v in params.items()}
    x = torch.randn(3, 8)
    out, _ = apply(low, {}, x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, apply(low, {}, x.to(torch.bfloat16))[0])
    assert apply(params, {}, x)[0].dtype == torch.float32  # params in the module's own dtype: nothing cast
    with pytest.raises(RuntimeError, match="dtype"):
        apply.cast_inputs(False)(low, {}, x)
    assert apply.cast_inputs(False).eval().cast_inputs().eval()(low, {}, x)[0].dtype == torch.bfloat16
