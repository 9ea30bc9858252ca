"""Activation checkpointing (``torch.utils.checkpoint``, non-reentrant) in every fdp step:
the recompute inside the backward sees the step's own params (docs/concepts.md, "Activation
checkpointing"), so a run with checkpointing equals the same run without it, bit for bit;
reentrant checkpointing is refused with fdp's message."""

import functools

import pytest
import torch
import torch.nn.functional as F
from models import Block, BlockNet, init_, tokens
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from trees import assert_trees_equal

import fdp


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


class InnerCheckpointed(Block):
    """A block that checkpoints its own MLP inside its forward (checkpointing inside a module)."""

    def forward(self, x):
        return x + checkpoint(lambda h: self.fc2(F.gelu(self.fc1(h))), self.ln(x), use_reentrant=False)


def through_a_helper(block, x):
    """Checkpointing called from a function outside the model's classes (which fdp does not
    see in the model's code): covered while one call's graph is differentiated at a time."""
    return checkpoint(block, x, use_reentrant=False)


_RUN = through_a_helper  # (named without the word, as a call into another module reads)


class HelperNet(BlockNet):
    """Each block checkpointed by a function of another module: nothing in this class's code
    names checkpointing."""

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.blocks:
            x = _RUN(b, x)
        return self.head(self.ln(x))


class CkNet(BlockNet):
    """BlockNet (blocks are the units of fully sharded params) run with checkpointing ``how``:
    ``call`` each block at the call site, ``span`` two blocks in one region, ``selective``
    with a ``context_fn`` that keeps the matmuls, ``offloaded`` each region inside a user's
    ``save_on_cpu``, ``inside`` in the block's own forward, ``wrapper`` torch's
    ``checkpoint_wrapper``, ``composable`` torch's composable ``checkpoint(block)``, ``reentrant`` with ``use_reentrant=True``, ``none``
    without."""

    def __init__(self, how, n=3):
        super().__init__(n=n)
        self.how = how
        if how == "inside":
            self.blocks = nn.ModuleList([InnerCheckpointed(16) for _ in range(n)])
        if how == "wrapper":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                apply_activation_checkpointing,
            )
            apply_activation_checkpointing(self, check_fn=lambda m: isinstance(m, Block))
        if how == "composable":
            from torch.distributed._composable import checkpoint as composable

            for b in self.blocks:
                composable(b)

    def forward(self, tokens):
        x = self.emb(tokens)
        how, blocks = self.how, list(self.blocks)
        if how == "span":
            first, second = blocks[:2]
            x = checkpoint(lambda h: second(first(h)), x, use_reentrant=False)
            blocks = blocks[2:]
        for b in blocks:
            if how == "call":
                x = checkpoint(b, x, use_reentrant=False)
            elif how == "reentrant":
                x = checkpoint(b, x, use_reentrant=True)
            elif how == "selective":
                x = checkpoint(b, x, use_reentrant=False,
                               context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls))
            elif how == "offloaded":
                with torch.autograd.graph.save_on_cpu():
                    x = checkpoint(b, x, use_reentrant=False)
            else:
                x = b(x)
        return self.head(self.ln(x))


KINDS = {  # name: (Reducer options, step options)
    "plain": None,
    "local_grad": None,
    "fused": ({}, {}),
    "fused-accumulate": ({}, {"acc": 2}),
    "shard=True": ({"shard": True}, {}),
    "shard=params": ({"shard": "params"}, {}),
    "shard=params-keep": ({"shard": "params", "reshard_after_forward": False}, {}),
    "shard=params-bf16": ({"shard": "params", "param_dtype": torch.bfloat16}, {}),
    "shard=params-accumulate": ({"shard": "params"}, {"acc": 2}),
}


def train(group, how, kind, *, meta=False, steps=3):
    """``steps`` steps of clipped AdamW on a CkNet (``how="helper"``: a HelperNet), the whole
    params after them (the same start on every rank and for every ``how``), and the last
    step's record."""
    net = init_(HelperNet() if how == "helper" else CkNet(how), 0)
    apply, params, _ = fdp.functionalize(net)

    def loss(p, x, y):
        return F.cross_entropy(apply(p, {}, x)[0].flatten(0, 1), y.flatten())

    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(0.05), fdp.optim.adamw(lr=1e-2))
    if KINDS[kind] is None:
        grad = fdp.local_grad(loss) if kind == "local_grad" else fdp.Reducer(params, group).grad(loss)
        state = opt.init(params)
        if meta:
            net.to("meta")
        for i in range(steps):
            params, state = opt.update(grad(params, *tokens(group.rank, i)), state, params)
        return params, None
    options, run = KINDS[kind]
    if options.get("shard") == "params":
        options = {**options, "units": fdp.units(net, Block)}
    step = fdp.Reducer(params, group, **options).grad_and_update(loss, opt)
    state = step.init(params)
    if options.get("shard") == "params":
        params = step.shard(params)
    if meta:
        net.to("meta")  # (the recompute must not read the module's own tensors)
    for i in range(steps):
        for j in range(run.get("acc", 0)):
            step.accumulate(params, *tokens(group.rank, 100 * i + j))
        params, state, _ = step(params, state, *tokens(group.rank, i))
    whole = params.full() if isinstance(params, fdp.ShardedParams) else params
    return whole, step.last_step


def with_and_without(group, how, kind, **kw):
    return train(group, "none", kind, **kw)[0], train(group, how, kind, **kw)[0]


@pytest.mark.parametrize("kind", list(KINDS))
def test_checkpointing_each_block_equals_the_run_without_it_in_every_step_kind(kind):
    for rank, (want, got) in enumerate(fdp.testing.run(with_and_without, 2, args=("call", kind), timeout=120)):
        assert_trees_equal(got, want, f"{kind}, rank {rank}")


@pytest.mark.parametrize("how", ["span", "selective", "offloaded", "inside", "wrapper", "composable", "helper"])
@pytest.mark.parametrize("kind", ["fused", "shard=params"])
def test_every_way_of_checkpointing_equals_the_run_without_it(how, kind):
    for rank, (want, got) in enumerate(fdp.testing.run(with_and_without, 2, args=(how, kind), timeout=120)):
        assert_trees_equal(got, want, f"{how}, {kind}, rank {rank}")


@pytest.mark.parametrize("kind", ["plain", "fused", "shard=params", "shard=params-bf16"])
def test_the_recompute_reads_the_step_params_after_the_module_went_to_meta(kind):
    """(``model.to("meta")`` frees the module's own copy, as the README says; a recompute that
    read the module's tensors would fail on meta tensors.)"""
    for rank, (want, got) in enumerate(fdp.testing.run(with_and_without, 2, args=("call", kind),
                                                       kwargs={"meta": True}, timeout=120)):
        assert_trees_equal(got, want, f"{kind}, rank {rank}")


def gathers(group):
    """Fully sharded params with two blocks in one checkpointed region: each block's gathers
    (its forward, its backward; the recompute finds it gathered) as without checkpointing."""
    return ({b.index: len(b.gathers) for b in train(group, "none", "shard=params")[1].timeline.buckets},
            {b.index: len(b.gathers) for b in train(group, "span", "shard=params")[1].timeline.buckets})


def test_a_recompute_under_fully_sharded_params_gathers_no_more_than_the_backward_does():
    for rank, (want, got) in enumerate(fdp.testing.run(gathers, 2, timeout=120)):
        assert got == want, f"rank {rank}: gathers per bucket {got}, without checkpointing {want}"


def two_calls(group, how):
    """A loss that runs the model twice before its backward: the student with checkpointing and
    an EMA-style teacher on other params (no graph), then the student again on scaled params
    (a graph of its own): each recompute sees its own call's params."""
    net = init_(CkNet(how), 0)
    apply, params, _ = fdp.functionalize(net)
    teacher = {k: v * 0.5 for k, v in params.items()}

    def loss(p, x, y):
        out = apply(p, {}, x)[0]
        with torch.no_grad():
            target = apply.eval()(teacher, {}, x)[0].softmax(-1)
        again = apply({k: v * 1.5 for k, v in p.items()}, {}, x)[0]
        return F.cross_entropy(out.flatten(0, 1), target.flatten(0, 1)) + F.cross_entropy(
            again.flatten(0, 1), y.flatten())

    step = fdp.Reducer(params, group).grad_and_update(loss, fdp.optim.adamw(lr=1e-2))
    state = step.init(params)
    for i in range(3):
        params, state, _ = step(params, state, *tokens(group.rank, i))
    return params


def test_each_recompute_sees_its_own_call_when_a_loss_runs_the_model_several_times():
    for rank, (want, got) in enumerate(fdp.testing.run(lambda g: (two_calls(g, "none"), two_calls(g, "call")), 2)):
        assert_trees_equal(got, want, f"rank {rank}")


def module_after(group):
    net = init_(CkNet("call"), 0)
    own = {k: v.detach().clone() for k, v in net.named_parameters()}
    apply, params, _ = fdp.functionalize(net)
    step = fdp.Reducer(params, group).grad_and_update(
        lambda p, x, y: F.cross_entropy(apply(p, {}, x)[0].flatten(0, 1), y.flatten()), fdp.optim.adamw(lr=1e-2))
    state = step.init(params)
    params, state, _ = step(params, state, *tokens(group.rank, 0))
    now = dict(net.named_parameters())
    return all(type(now[k]) is nn.Parameter and torch.equal(now[k], own[k]) for k in own), len(own) == len(now)


def test_the_module_holds_its_own_parameters_again_after_the_step():
    for rank, (same, count) in enumerate(fdp.testing.run(module_after, 2)):
        assert same and count, f"rank {rank}: the module still holds the step's tensors"


def test_saved_tensor_hooks_of_the_user_around_apply_keep_working():
    """``save_on_cpu`` around the whole loss packs every saved tensor, fdp's hooks included."""
    net = init_(CkNet("call"), 0)
    apply, params, _ = fdp.functionalize(net)
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t.detach()

    def loss(p, x, y):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return F.cross_entropy(apply(p, {}, x)[0].flatten(0, 1), y.flatten())

    x, y = tokens(0)
    got = fdp.local_grad(loss)(params, x, y)
    want = fdp.local_grad(lambda p, x, y: F.cross_entropy(apply(p, {}, x)[0].flatten(0, 1), y.flatten()))(params, x, y)
    assert packed, "the user's pack hook never ran"
    assert_trees_equal(got, want, "gradients")


def reentrant(group, kind):
    with pytest.raises(RuntimeError, match="use_reentrant=False") as e:
        train(group, "reentrant", kind, steps=1)
    return str(e.value)


@pytest.mark.parametrize("kind", ["plain", "fused", "shard=params"])
def test_reentrant_checkpointing_is_refused_with_the_way_out(kind):
    for message in fdp.testing.run(reentrant, 2, args=(kind,), timeout=120):
        assert message.startswith("fdp: reentrant activation checkpointing"), message


def against_ddp_and_fsdp2(group):
    """DDP and FSDP2 (blocks and root ``fully_shard``-ed) with each block checkpointed and
    torch.optim.AdamW; fdp's fused and fully sharded steps with the same model."""
    from torch.distributed.fsdp import fully_shard

    def torch_run(wrap):
        model = wrap(init_(CkNet("call"), 0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for i in range(3):
            x, y = tokens(group.rank, i)
            opt.zero_grad()
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
        return model

    ddp = {k: v.detach().clone() for k, v in torch_run(nn.parallel.DistributedDataParallel).module.named_parameters()}

    def fsdp2(m):
        for b in m.blocks:
            fully_shard(b)
        return fully_shard(m)

    fsdp = {k: v.full_tensor().detach().clone() for k, v in torch_run(fsdp2).named_parameters()}
    mine = {}
    for shard in (False, "params"):
        net = init_(CkNet("call"), 0)
        apply, params, _ = fdp.functionalize(net)
        units = fdp.units(net, Block) if shard else None
        step = fdp.Reducer(params, group, shard=shard, units=units).grad_and_update(
            lambda p, x, y, apply=apply: F.cross_entropy(apply(p, {}, x)[0].flatten(0, 1), y.flatten()),
            fdp.optim.adamw(lr=1e-2, weight_decay=0.1))
        state = step.init(params)
        for i in range(3):
            params, state, _ = step(params, state, *tokens(group.rank, i))
        mine[shard] = params.full() if shard else params
    return mine[False], mine["params"], ddp, fsdp


@pytest.mark.slow  # (DDP and FSDP2 beside, on gloo)
def test_checkpointed_fused_and_fully_sharded_steps_equal_ddp_and_fsdp2_checkpointed():
    for rank, (fused, sharded, ddp, fsdp) in enumerate(fdp.testing.run(against_ddp_and_fsdp2, 2, backend="gloo",
                                                                          timeout=180)):
        assert_trees_equal(fused, ddp, f"rank {rank}: fused vs DDP")
        assert_trees_equal(sharded, ddp, f"rank {rank}: shard='params' vs DDP")
        assert_trees_equal(sharded, fsdp, f"rank {rank}: shard='params' vs FSDP2")
