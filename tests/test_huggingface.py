"""Hugging Face models (tiny configs of GPT-2 and LLaMA) in fdp's steps, with HF's own
activation checkpointing (``activation_checkpointing_enable``): the same numbers as the run
without it, in the fused step and with fully sharded params (bf16 included), and DDP's."""

import pytest
import torch
import torch.nn.functional as F
from hf_models import MODELS, batch, lm_loss
from torch import nn
from trees import assert_trees_equal

import fdp

STEPS = {  # name: Reducer options
    "fused": {},
    "shard=True": {"shard": True},
    "shard=params": {"shard": "params"},
    "shard=params-bf16": {"shard": "params", "param_dtype": torch.bfloat16},
}


def train(group, model_name, kind, checkpointing, steps=3):
    model, block = MODELS[model_name]()
    if checkpointing:
        model.activation_checkpointing_enable()
    model.train()
    apply, params, buffers = fdp.functionalize(model)
    options = dict(STEPS[kind])
    if options.get("shard") == "params":
        options["units"] = fdp.units(model, block)
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(lr=1e-2, weight_decay=0.1))
    step = fdp.Reducer(params, group, **options).grad_and_update(lm_loss(apply, buffers), opt)
    state = step.init(params)
    if options.get("shard") == "params":
        params = step.shard(params)
        model.to("meta")
    for i in range(steps):
        params, state, _ = step(params, state, *batch(group.rank, i))
    return params.full() if isinstance(params, fdp.ShardedParams) else params


def with_and_without(group, model_name, kind):
    return train(group, model_name, kind, False), train(group, model_name, kind, True)


@pytest.mark.parametrize("kind", list(STEPS))
@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_hf_activation_checkpointing_equals_the_run_without_it(model_name, kind):
    for rank, (want, got) in enumerate(fdp.testing.run(with_and_without, 2, args=(model_name, kind), timeout=120)):
        assert_trees_equal(got, want, f"{model_name}, {kind}, rank {rank}")


def against_ddp(group, model_name):
    """DDP + torch.optim.AdamW with HF's checkpointing on, beside fdp's fused and fully
    sharded steps with it on."""
    model, _ = MODELS[model_name]()
    model.activation_checkpointing_enable()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for i in range(3):
        x, y = batch(group.rank, i)
        opt.zero_grad()
        F.cross_entropy(ddp(input_ids=x).logits.flatten(0, 1), y.flatten()).backward()
        opt.step()
    want = {k: v.detach().clone() for k, v in model.named_parameters()}
    got = {}
    for kind in ("fused", "shard=params"):
        m, block = MODELS[model_name]()
        m.activation_checkpointing_enable()
        apply, params, buffers = fdp.functionalize(m)
        options = {"shard": "params", "units": fdp.units(m, block)} if kind == "shard=params" else {}
        step = fdp.Reducer(params, group, **options).grad_and_update(
            lm_loss(apply, buffers), fdp.optim.adamw(lr=1e-2, weight_decay=0.1))
        state = step.init(params)
        for i in range(3):
            params, state, _ = step(params, state, *batch(group.rank, i))
        got[kind] = params.full() if isinstance(params, fdp.ShardedParams) else params
    return want, got


@pytest.mark.slow  # (DDP beside, on gloo)
@pytest.mark.parametrize("model_name", ["gpt2", "llama-tied"])
def test_hf_checkpointed_steps_equal_ddp_checkpointed(model_name):
    for rank, (want, got) in enumerate(fdp.testing.run(against_ddp, 2, backend="gloo", args=(model_name,),
                                                      timeout=180)):
        for kind, params in got.items():
            assert_trees_equal(params, want, f"{model_name}, {kind} vs DDP, rank {rank}")


def reduced_against_fsdp2(group, model_name):
    """Two micro-batches per step, HF's checkpointing on: FSDP2 (each block and the root
    ``fully_shard``-ed, gradient sync on every micro-batch) + torch.optim.AdamW, beside fdp's
    fully sharded step with ``reduce_micro_batches=True`` and the model moved to meta."""
    from torch.distributed.fsdp import fully_shard

    model, block = MODELS[model_name]()
    model.activation_checkpointing_enable()
    for m in model.modules():
        if isinstance(m, block):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for i in range(3):
        for j in range(2):
            x, y = batch(group.rank, 10 * i + j)
            F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    want = {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()}
    m, block = MODELS[model_name]()
    m.activation_checkpointing_enable()
    apply, params, buffers = fdp.functionalize(m)
    step = fdp.Reducer(params, group, shard="params", units=fdp.units(m, block),
                       reduce_micro_batches=True).grad_and_update(
        lm_loss(apply, buffers), fdp.optim.adamw(lr=1e-2, weight_decay=0.1))
    params = step.shard(params)
    m.to("meta")
    state = step.init(params)
    for i in range(3):
        step.accumulate(params, *batch(group.rank, 10 * i))
        params, state, _ = step(params, state, *batch(group.rank, 10 * i + 1))
    return want, params.full()


@pytest.mark.slow  # (FSDP2 beside, on gloo)
@pytest.mark.parametrize("model_name", ["gpt2", "llama-tied"])
def test_hf_reduced_micro_batches_with_checkpointing_equal_fsdp2_syncing_every_micro_batch(model_name):
    for rank, (want, got) in enumerate(fdp.testing.run(reduced_against_fsdp2, 2, backend="gloo", args=(model_name,),
                                                      timeout=180)):
        assert_trees_equal(got, want, f"{model_name}, reduced micro-batches vs FSDP2, rank {rank}")
