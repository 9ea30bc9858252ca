"""fdp.functionalize: a module as a pure function that matches the module bit for bit."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fdp


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.mid(self.emb(idx))))


def snapshot(tree):
    return {k: v.clone() for k, v in tree.items()}


def assert_same(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: leaf {k!r} differs"


@pytest.mark.parametrize("make,inp", [
    (mlp, lambda: torch.randn(5, 8)),
    (CNN, lambda: torch.randn(4, 3, 6, 6)),
    (Tied, lambda: torch.randint(0, 11, (7,))),
])
@pytest.mark.parametrize("train", [True, False])
def test_apply_equals_eager_forward_and_backward_bitwise(make, inp, train):
    model = make()
    model.train(train)
    eager = copy.deepcopy(model)
    x = inp()
    apply, params, buffers = fdp.functionalize(model)
    p0, b0 = snapshot(params), snapshot(buffers)

    out, new_buffers = apply(params, buffers, x)
    ref = eager(x)
    assert torch.equal(out, ref)
    # new buffers equal the eager module's buffers after its forward (BN stats updated in train)
    assert_same(new_buffers, dict(eager.named_buffers()), "new buffers")
    # inputs unchanged
    assert_same(params, p0, "params after apply")
    assert_same(buffers, b0, "buffers after apply")

    # torch.func.grad through apply == eager autograd
    def loss_fn(p, b, x):
        out, nb = apply(p, b, x)
        return out.square().mean(), nb

    eager2 = copy.deepcopy(make())
    eager2.load_state_dict({**p0, **b0}, strict=False)
    eager2.train(train)
    eager2.zero_grad()
    eager2(x).square().mean().backward()
    grads, nb = torch.func.grad(loss_fn, has_aux=True)(params, buffers, x)
    named = dict(eager2.named_parameters())
    for k, g in grads.items():
        assert torch.equal(g, named[k].grad), f"grad of {k!r}"
    assert_same(buffers, b0, "buffers after grad")


def test_tied_weights_appear_once_and_stay_tied():
    model = Tied()
    apply, params, _ = fdp.functionalize(model)
    assert "emb.weight" in params and "out.weight" not in params
    x = torch.randint(0, 11, (9,))
    p2 = dict(params)
    p2["emb.weight"] = torch.zeros_like(params["emb.weight"])
    out, _ = apply(p2, {}, x)
    # with the shared matrix zeroed, the tied output projection is zero too
    assert torch.equal(out, torch.zeros_like(out))
    g = torch.func.grad(lambda p: apply(p, {}, x)[0].sum())(params)
    assert g["emb.weight"].abs().sum() > 0


def test_registration_order_and_frozen_names():
    model = CNN()
    apply, params, buffers = fdp.functionalize(model, frozen=["conv1", "fc.bias"])
    names = [n for n, _ in model.named_parameters()]
    assert list(params) == [n for n in names if not n.startswith("conv1.") and n != "fc.bias"]
    assert list(apply.constants) == ["conv1.weight", "conv1.bias", "fc.bias"]
    assert list(buffers) == [n for n, _ in model.named_buffers()]  # only the module's state
    x = torch.randn(2, 3, 4, 4)
    out, nb = apply(params, buffers, x)
    assert torch.equal(out, copy.deepcopy(model)(x))  # the constants are used
    g = torch.func.grad(lambda p: apply(p, buffers, x)[0].sum())(params)
    assert set(g) == set(params)


def test_requires_grad_false_is_frozen():
    model = mlp()
    model[0].weight.requires_grad_(False)
    apply, params, buffers = fdp.functionalize(model)
    assert "0.weight" not in params and "0.weight" not in buffers and "0.weight" in apply.constants


class Causal(nn.Module):
    """A causal mask registered persistent=False, as nanoGPT's attention does."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(5)
        self.register_buffer("mask", torch.tril(torch.ones(5, 5)), persistent=False)

    def forward(self, x):  # x: (batch, 5, 4)
        scores = (self.proj(x) @ x.transpose(1, 2)).masked_fill(self.mask == 0, -1e9)
        return self.norm(scores.softmax(-1) @ x)


def test_non_persistent_buffers_are_constants_and_state_dict_loads_back():
    model = Causal()
    ref = copy.deepcopy(model)
    apply, params, buffers = fdp.functionalize(model)
    assert "mask" not in buffers and "mask" in apply.constants
    x = torch.randn(3, 5, 4)
    out, buffers = apply(params, buffers, x)
    assert torch.equal(out, ref(x))  # the mask is applied
    params = {k: v * 2 for k, v in params.items()}  # "trained"
    fresh = Causal()
    fresh.load_state_dict(apply.state_dict(params, buffers))  # strict: exactly the module's keys
    assert torch.equal(fresh.proj.weight, params["proj.weight"])
    assert torch.equal(fresh.norm.running_mean, buffers["norm.running_mean"])


def test_state_dict_names_tied_and_frozen_parameters_as_the_module_does():
    model = Tied()
    apply, params, buffers = fdp.functionalize(model, frozen=["mid"])
    sd = apply.state_dict(params, buffers)
    assert list(sd) == list(model.state_dict())  # out.weight too, and the frozen mid.*
    assert sd["out.weight"] is params["emb.weight"] and sd["mid.bias"] is apply.constants["mid.bias"]
    Tied().load_state_dict(sd)


def test_freezing_a_tied_alias_freezes_the_shared_tensor():
    model = Tied()
    apply, params, buffers = fdp.functionalize(model, frozen=["out"])  # out.weight is emb.weight
    assert "emb.weight" not in params and list(apply.constants) == ["emb.weight"]
    assert list(params) == ["mid.weight", "mid.bias"]


def constants_on_ranks(group):
    torch.manual_seed(group.rank)  # ranks initialise differently
    apply, params, buffers = fdp.functionalize(CNN(), frozen=["conv1"])
    before = apply.constants
    apply = apply.with_constants(fdp.broadcast(apply.constants, src=0, group=group))
    buffers = fdp.sync_buffers(apply(params, buffers, torch.randn(2, 3, 4, 4))[1], group=group)
    return list(buffers), before, apply.constants


def test_frozen_parameters_are_not_synced_and_are_broadcast_once_on_request():
    res = fdp.testing.run(constants_on_ranks, 2)
    for keys, _, _ in res:
        assert not any(k.startswith("conv1.") for k in keys), "frozen weights are synced every step"
    assert not torch.equal(res[0][1]["conv1.weight"], res[1][1]["conv1.weight"])
    for k, v in res[0][2].items():
        assert torch.equal(v, res[1][2][k]), f"constant {k!r} differs after the broadcast"


def test_train_eval_is_explicit():
    model = CNN()
    apply, params, buffers = fdp.functionalize(model)
    assert apply.training
    x = torch.randn(4, 3, 5, 5)
    _, nb_train = apply(params, buffers, x)
    out_eval, nb_eval = apply.eval()(params, buffers, x)
    assert not torch.equal(nb_train["bn1.running_mean"], buffers["bn1.running_mean"])
    assert_same(nb_eval, buffers, "eval leaves buffers alone")
    ref = copy.deepcopy(model).eval()
    ref.load_state_dict({**params, **buffers})
    assert torch.equal(out_eval, ref(x))
    assert apply.eval().train().training


def test_vmap_over_apply_gives_per_sample_grads():
    model = mlp()
    apply, params, buffers = fdp.functionalize(model)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))

    def loss(p, xi, yi):
        out, _ = apply(p, buffers, xi[None])
        return F.cross_entropy(out, yi[None])

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for i in range(6):
        gi = torch.func.grad(loss)(params, x[i], y[i])
        for k in params:
            torch.testing.assert_close(per_sample[k][i], gi[k])


def test_lazy_module_is_rejected():
    with pytest.raises(ValueError, match="uninitialised.*'0.weight'|'0.weight'.*uninitialised"):
        fdp.functionalize(nn.Sequential(nn.LazyLinear(4)))


def test_module_without_parameters_is_rejected():
    with pytest.raises(ValueError, match="no parameters"):
        fdp.functionalize(nn.ReLU())
    with pytest.raises(ValueError, match="no trainable parameters"):
        fdp.functionalize(nn.Linear(2, 2), frozen=["weight", "bias"])


def test_unknown_frozen_name_is_rejected():
    with pytest.raises(ValueError, match="'decoder'"):
        fdp.functionalize(mlp(), frozen=["decoder"])


def test_apply_names_missing_extra_and_misshaped_keys():
    apply, params, buffers = fdp.functionalize(CNN())
    x = torch.randn(2, 3, 4, 4)
    p = dict(params)
    del p["fc.bias"]
    with pytest.raises(ValueError, match="missing key 'fc.bias'"):
        apply(p, buffers, x)
    with pytest.raises(ValueError, match="unexpected key 'extra'"):
        apply({**params, "extra": torch.zeros(1)}, buffers, x)
    with pytest.raises(ValueError, match=r"`params\['fc.weight'\]` has shape \(4, 9\), expected \(4, 8\)"):
        apply({**params, "fc.weight": torch.zeros(4, 9)}, buffers, x)
    b = dict(buffers)
    del b["bn2.running_var"]
    with pytest.raises(ValueError, match="`buffers` is missing key 'bn2.running_var'"):
        apply(params, b, x)


def test_the_module_is_left_as_it_was_even_when_the_forward_raises():
    model = Tied()
    originals = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    apply, params, buffers = fdp.functionalize(model)
    with pytest.raises(IndexError):
        apply(params, buffers, torch.tensor([99]))  # out of the embedding's range
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == originals.keys()
    assert all(after[n] is originals[n] for n in after), "a swapped-in tensor stayed in the module"
    assert model.out.weight is model.emb.weight


def test_apply_and_its_variants_fill_a_tied_module_after_it_went_to_meta():
    """``model.to("meta")`` (to free the module's copy) unties shared parameters in the module;
    ``apply`` and the variants made from it afterwards still bind every name of a tied tensor."""
    model = Tied()
    apply, params, buffers = fdp.functionalize(model)
    x = torch.tensor([1, 2, 3])
    want = apply.eval()(params, buffers, x)[0]
    model.to("meta")
    assert model.out.weight is not model.emb.weight  # (torch's to("meta") made two tensors)
    for variant in (apply, apply.eval(), apply.train(), apply.eval().train().eval()):
        got = variant(params, buffers, x)[0]
        assert got.device.type == "cpu" and torch.equal(got, want), variant


def test_wrapped_blocks_keep_the_unwrapped_names():
    """A block wrapped by ``checkpoint_wrapper`` or ``torch.compile`` is named as it is
    unwrapped: the keys, units and state dict match the unwrapped model's."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), nn.Linear(8, 2))

    plain, wrapped = make(), make()
    wrapped[1] = checkpoint_wrapper(wrapped[1])
    _, want, _ = fdp.functionalize(plain)
    apply, params, buffers = fdp.functionalize(wrapped)
    assert list(params) == list(want)
    assert fdp.units(wrapped, nn.LayerNorm) == fdp.units(plain, nn.LayerNorm) == ["1.1"]
    fresh = make()
    fresh.load_state_dict(apply.state_dict({k: v + 1 for k, v in params.items()}, buffers))
    assert torch.equal(fresh[1][0].weight, params["1.0.weight"] + 1)


def bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def test_functionalize_of_a_compiled_module_has_the_models_names_and_stays_compiled():
    graphs = []

    def backend(gm, example_inputs):  # counts what dynamo compiles
        graphs.append(gm)
        return gm.forward

    model = bn_net()
    apply, params, buffers = fdp.functionalize(torch.compile(model, backend=backend))
    plain_apply, plain_params, plain_buffers = fdp.functionalize(bn_net())
    assert list(params) == list(plain_params) == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]
    assert list(buffers) == list(plain_buffers)
    x = torch.randn(5, 4)
    out, new = apply(params, buffers, x)
    want, want_new = plain_apply(params, buffers, x)
    assert graphs, "apply did not run the compiled module"
    assert torch.allclose(out, want) and torch.equal(new["1.running_mean"], want_new["1.running_mean"])
    eval_out, _ = apply.eval()(params, buffers, x)
    assert torch.allclose(eval_out, plain_apply.eval()(params, buffers, x)[0])
    fresh = bn_net()
    fresh.load_state_dict(apply.state_dict(params, buffers))  # no "_orig_mod." prefix: strict load
    grads = fdp.Reducer(params).grad(lambda p, b: apply(p, b, x)[0].sum())(params, buffers)
    assert list(grads) == list(params)
