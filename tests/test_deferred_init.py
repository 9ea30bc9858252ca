"""A model built on the meta device, given its values by ``fdp.deferred_init``: module by module,
unit by unit under ``shard="params"`` (no rank holds the whole model), the same numbers at any
world size and in every step kind; HF models through their own ``_init_weights``."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hf_models import MODELS, batch, lm_loss
from models import Block, BlockNet, tokens
from torch import nn
from trees import assert_trees_equal

import fdp


def meta_net(**kw) -> BlockNet:
    with torch.device("meta"):
        return BlockNet(**kw)


def whole(seed=0, **kw):
    net = meta_net(**kw)
    _, params, _ = fdp.functionalize(net)
    return fdp.deferred_init(net, seed=seed).materialize(params, device="cpu")


def sharded_full(group, seed=0, units=True):
    net = meta_net()
    apply, params, buffers = fdp.functionalize(net)
    reducer = fdp.Reducer(params, group, shard="params", units=fdp.units(net, Block) if units else None)
    step = reducer.grad_and_update(lambda p, x, y: F.cross_entropy(apply(p, buffers, x)[0].flatten(0, 1), y.flatten()),
                                   fdp.optim.adamw(lr=1e-3))
    sharded = step.shard(fdp.deferred_init(net, seed=seed))
    assert all(t.is_meta for t in net.parameters())  # the module keeps its meta tensors
    return sharded.full()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_same_seed_gives_the_same_model_at_any_world_size(world):
    want = whole(seed=7)
    assert not any(t.isnan().any() for t in want.values())
    for rank, got in enumerate(fdp.testing.run(sharded_full, world, args=(7,))):
        assert_trees_equal(got, want, f"world {world}, rank {rank}")


def test_values_do_not_depend_on_the_units_and_differ_by_seed():
    a = fdp.testing.run(sharded_full, 2, args=(3, True))[0]
    b = fdp.testing.run(sharded_full, 2, args=(3, False))[0]
    assert_trees_equal(a, b, "units or none")
    c = whole(seed=4)
    assert not torch.equal(a["blocks.0.fc1.weight"], c["blocks.0.fc1.weight"])


def test_each_module_is_initialised_by_its_own_reset_parameters_and_the_callers_rng_is_untouched():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    got = whole(seed=0)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(got["blocks.0.ln.weight"], torch.ones(16))  # LayerNorm.reset_parameters
    assert torch.equal(got["blocks.0.ln.bias"], torch.zeros(16))
    bound = 1 / 16 ** 0.5  # Linear.reset_parameters: kaiming_uniform with a=sqrt(5) -> U(-1/sqrt(fan_in), ...)
    assert got["blocks.0.fc1.weight"].abs().max() <= bound
    # A module's values are those of its reset_parameters() under its own seed.
    from fdp._sources.deferred import module_seed
    torch.manual_seed(module_seed(0, "blocks.1.fc2"))
    ref = nn.Linear(32, 16)
    assert torch.equal(got["blocks.1.fc2.weight"], ref.weight.detach())
    assert torch.equal(got["blocks.1.fc2.bias"], ref.bias.detach())


def train(group, kind, steps=3):
    """A meta-built BlockNet trained from its deferred init: whole leaves for the unsharded and
    ZeRO steps, unit by unit for fully sharded params."""
    net = meta_net()
    apply, params, buffers = fdp.functionalize(net)
    options = {"fused": {}, "shard=True": {"shard": True},
               "shard=params": {"shard": "params", "units": fdp.units(net, Block)}}[kind]
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(lr=1e-2, weight_decay=0.1))
    step = fdp.Reducer(params, group, **options).grad_and_update(
        lambda p, x, y: F.cross_entropy(apply(p, buffers, x)[0].flatten(0, 1), y.flatten()), opt)
    init = fdp.deferred_init(net, seed=1)
    params = step.shard(init) if kind == "shard=params" else init.materialize(params)
    state = step.init(params)
    for i in range(steps):
        params, state, _ = step(params, state, *tokens(group.rank, i))
    return params.full() if isinstance(params, fdp.ShardedParams) else params


def test_training_from_a_deferred_init_is_the_same_in_every_step_kind():
    want = fdp.testing.run(train, 2, args=("fused",))
    for kind in ("shard=True", "shard=params"):
        for rank, got in enumerate(fdp.testing.run(train, 2, args=(kind,))):
            assert_trees_equal(got, want[rank], f"{kind}, rank {rank}")


def test_a_reducer_lays_meta_params_out_on_its_groups_device():
    net = meta_net()
    _, params, _ = fdp.functionalize(net)
    reducer = fdp.Reducer(params)
    assert {b.device.type for b in reducer.plan.buckets} == {"cpu"}
    step = reducer.grad_and_update(lambda p: sum(v.sum() for v in p.values()), fdp.optim.sgd(lr=0.1))
    with pytest.raises(TypeError, match="materialize"):
        step.shard(fdp.deferred_init(net))


class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.inner = nn.Linear(3, 3)

    def forward(self, x):
        return self.inner(x) * self.w


def test_a_module_without_reset_parameters_is_named_and_an_unwritten_tensor_is_refused():
    with torch.device("meta"):
        m = NoReset()
    _, params, _ = fdp.functionalize(m)
    with pytest.raises(TypeError, match=r"module '\(the root\)' \(NoReset\) holds \['w'\].*init="):
        fdp.deferred_init(m).materialize(params, device="cpu")

    def half(module):  # writes the Linear's weight but forgets its bias, and the root's w
        if isinstance(module, nn.Linear):
            module.weight.zero_()
    with pytest.raises(ValueError, match=r"'inner.bias' \(Linear\) was not written"):
        fdp.deferred_init(m, init=half).materialize({"inner.bias": params["inner.bias"]}, device="cpu")

    def full(module):
        for t in module.parameters(recurse=False):
            t.fill_(2.0)
    got = fdp.deferred_init(m, init=full).materialize(params, device="cpu")
    assert all(torch.equal(v, torch.full_like(v, 2.0)) for v in got.values())


def test_a_constant_left_on_meta_is_named_at_the_call():
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(4, 4))
        net.register_buffer("mask", torch.ones(4), persistent=False)
    apply, params, buffers = fdp.functionalize(net)
    init = fdp.deferred_init(net, init=lambda m: [t.fill_(1.0) for t in (*m.parameters(False), *m.buffers(False))])
    params = init.materialize(params, device="cpu")
    with pytest.raises(RuntimeError, match="constant 'mask'.*meta device.*with_constants"):
        apply(params, buffers, torch.ones(2, 4))
    apply = apply.with_constants(init.materialize(apply.constants, device="cpu"))
    out, _ = apply(params, buffers, torch.ones(2, 4))
    assert torch.equal(out, torch.full((2, 4), 5.0))


def hf_train(group, model_name, kind, steps=2):
    """A HF model built on meta, initialised by its own ``_init_weights`` (rotary buffers
    included), trained by fdp's fused step or fully sharded."""
    with torch.device("meta"):
        model, block = MODELS[model_name]()
    apply, params, buffers = fdp.functionalize(model)
    init = fdp.deferred_init(model, seed=0, init=model._init_weights)
    apply = apply.with_constants(init.materialize(apply.constants))
    buffers = init.materialize(buffers)
    options = {"shard": "params", "units": fdp.units(model, block)} if kind == "shard=params" else {}
    step = fdp.Reducer(params, group, **options).grad_and_update(lm_loss(apply, buffers), fdp.optim.adamw(lr=1e-2))
    params = step.shard(init) if kind == "shard=params" else init.materialize(params)
    state = step.init(params)
    for i in range(steps):
        params, state, _ = step(params, state, *batch(group.rank, i))
    return params.full() if isinstance(params, fdp.ShardedParams) else params


@pytest.mark.parametrize("model_name", ["gpt2", "llama-tied"])
def test_hf_models_built_on_meta_train_the_same_fully_sharded_as_whole(model_name):
    want = fdp.testing.run(hf_train, 2, args=(model_name, "fused"), timeout=120)
    got = fdp.testing.run(hf_train, 2, args=(model_name, "shard=params"), timeout=120)
    for rank in range(2):
        assert_trees_equal(got[rank], want[rank], f"{model_name}, rank {rank}")


def test_hf_rotary_constants_are_those_of_a_model_built_normally():
    with torch.device("meta"):
        model, _ = MODELS["llama"]()
    apply, _, _ = fdp.functionalize(model)
    got = fdp.deferred_init(model, init=model._init_weights).materialize(apply.constants, device="cpu")
    ref, _ = MODELS["llama"]()
    assert torch.equal(got["model.rotary_emb.inv_freq"], ref.model.rotary_emb.inv_freq)


MEMORY = r"""
import ctypes, json, sys, torch, torch.nn as nn, torch.nn.functional as F
sys.path.insert(0, "tests")
import fdp
from fdp.bench.rss import reset_peak_rss, rss

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
    def forward(self, h):
        return h + self.fc2(torch.relu(self.fc1(h)))

def rank(group):
    torch.set_num_threads(1)
    # Every allocation of 64 KiB or more its own mapping, returned to the OS when freed: the
    # resident memory is then the memory in use (glibc's M_MMAP_THRESHOLD, fixed).
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)
    def build(d, n):
        with torch.device("meta"):
            net = nn.Sequential(*[Block(d) for _ in range(n)])
        apply, params, _ = fdp.functionalize(net)
        step = fdp.Reducer(params, group, shard="params", units=fdp.units(net, Block)).grad_and_update(
            lambda p, x: apply(p, {}, x)[0].sum(), fdp.optim.sgd(lr=0.1))
        sharded = step.shard(fdp.deferred_init(net, seed=0))
        step.init(sharded)
        return params, sharded
    build(16, 2)  # once on a tiny model: imports and one-time setup are not the model's memory
    n = 8
    base = rss()[0]
    reset_peak_rss()
    # Everything from here to the sharded params counts: the Reducer, the step, its state.
    params, sharded = build(512, n)  # 8 blocks of 2.1M params: 64 MiB of fp32 params
    peak = rss()[1] - base
    total = sum(p.numel() * 4 for p in params.values())
    unit = total // n
    return {"peak": peak, "total": total, "unit": unit, "world": group.size}

print(json.dumps(fdp.testing.run(rank, 2, backend="gloo", timeout=300)))
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rank_never_holds_more_than_its_slices_and_one_unit_while_it_is_initialised():
    """Peak resident memory of ``step.shard(fdp.deferred_init(...))`` on 2 gloo ranks, in a
    fresh process with the allocator giving memory back to the OS (``FDP_MALLOC=os``):
    at most params/world + the largest unit + 5% (the whole model is 64 MiB)."""
    env = {"FDP_MALLOC": "os", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", MEMORY], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for r in json.loads(out.stdout.strip().splitlines()[-1]):
        bound = (r["total"] / r["world"] + r["unit"]) * 1.05
        assert r["peak"] <= bound, f"peak {r['peak'] / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"
        assert r["peak"] < 0.75 * r["total"]


def sharded_run(group, folder, start, stop, save):
    """Fully sharded BlockNet steps ``start:stop``: from the deferred init at 0, else resumed
    from the sharded checkpoint in ``folder`` on a model built on meta (no whole params)."""
    net = meta_net()
    apply, params, buffers = fdp.functionalize(net)
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(lr=1e-2, weight_decay=0.1))
    step = fdp.Reducer(params, group, shard="params", units=fdp.units(net, Block)).grad_and_update(
        lambda p, x, y: F.cross_entropy(apply(p, buffers, x)[0].flatten(0, 1), y.flatten()), opt)
    if start == 0:
        params = step.shard(fdp.deferred_init(net, seed=2))
        state = step.init(params)
    else:
        like = {"params": step.param_shards(), "opt": step.state_to_shards(step.init(params), params)}
        got = fdp.load_sharded(folder, like)
        params = step.shard(got["params"])
        state = step.state_from_shards(got["opt"], params)
    for i in range(start, stop):
        params, state, _ = step(params, state, *tokens(group.rank, i))
    if save:
        fdp.save_sharded(folder, {"params": params.shards(), "opt": step.state_to_shards(state, params)})
    return params.full(), step.state_to_tree(state, params)


def test_a_model_built_on_meta_resumes_from_a_sharded_checkpoint_at_any_world_size(tmp_path):
    folder = str(tmp_path / "ckpt")
    whole_run = fdp.testing.run(sharded_run, 2, args=(folder, 0, 4, False))
    saved = fdp.testing.run(sharded_run, 2, args=(folder, 0, 2, True))
    for rank, (params, state) in enumerate(fdp.testing.run(sharded_run, 3, args=(folder, 2, 2, False))):
        assert_trees_equal(params, saved[0][0], f"loaded on 3 ranks, rank {rank}")
        assert_trees_equal(state, saved[0][1], f"state loaded on 3 ranks, rank {rank}")
    for rank, (params, _) in enumerate(fdp.testing.run(sharded_run, 2, args=(folder, 2, 4, False))):
        assert_trees_equal(params, whole_run[rank][0], f"resumed, rank {rank}")
