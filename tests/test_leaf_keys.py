"""What a user's callable of ``(path, leaf)`` receives as ``path`` (``mask=``, ``partition``'s
labels): the parameter name for a flat dict of params (``fdp.functionalize``'s), the tuple of
keys from the root for any other tree (dict keys, list indices, NamedTuple fields)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

import fdp


def seen_by_mask(params) -> list:
    """The paths ``adamw(mask=...)`` hands its callable, in leaf order."""
    seen = []

    def mask(path, p):
        seen.append(path)
        return True

    opt = fdp.optim.adamw(0.1, mask=mask)
    opt.update(params, opt.init(params), params)
    return seen


def seen_by_labels(params) -> list:
    seen = []

    def labels(path, p):
        seen.append(path)
        return "all"

    fdp.optim.partition(labels, {"all": fdp.optim.sgd(0.1)}).init(params)
    return seen


def test_a_flat_dict_from_functionalize_gives_the_parameter_names():
    _, params, _ = fdp.functionalize(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)))
    names = ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert seen_by_mask(params) == names
    assert seen_by_labels(params) == names


def test_a_nested_dict_gives_key_tuples():
    params = {"enc": {"w": torch.ones(2, 2), "b": torch.ones(2)}, "head": torch.ones(2)}
    expected = [("enc", "w"), ("enc", "b"), ("head",)]  # insertion order, one kind per tree
    assert seen_by_mask(params) == expected
    assert seen_by_labels(params) == expected


def test_lists_and_named_tuples_give_indices_and_field_names():
    class Layer(NamedTuple):
        w: torch.Tensor
        b: torch.Tensor

    params = {"layers": [Layer(torch.ones(2, 2), torch.ones(2)), Layer(torch.ones(2, 2), torch.ones(2))]}
    expected = [("layers", 0, "w"), ("layers", 0, "b"), ("layers", 1, "w"), ("layers", 1, "b")]
    assert seen_by_mask(params) == expected
    assert seen_by_mask([torch.ones(1), torch.ones(2)]) == [(0,), (1,)]


def test_a_mask_by_name_selects_the_leaves_torch_param_groups_would():
    """``"bias" not in path`` on names: the decayed leaves are exactly the named ones."""
    _, params, _ = fdp.functionalize(nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3)))
    opt = fdp.optim.adamw(0.1, weight_decay=0.5, mask=lambda path, p: not path.endswith("bias"))
    zero = {k: torch.zeros_like(v) for k, v in params.items()}  # only the decay moves a leaf
    new, _ = opt.update(zero, opt.init(params), params)
    moved = sorted(k for k in params if not torch.equal(new[k], params[k]))
    assert moved == ["0.weight", "1.weight"]


def test_partition_hands_each_label_its_leaves_under_the_same_keys():
    """A label's optimizer sees a dict keyed by the keys ``labels`` saw, so its own mask can
    select by them too (nested tree: key tuples)."""
    params = {"enc": {"w": torch.ones(2, 2), "b": torch.ones(2)}, "head": {"w": torch.ones(1, 2)}}
    inner = []

    def mask(path, p):
        inner.append(path)
        return path[-1] == "w"

    opt = fdp.optim.partition(lambda path, p: "enc" if path[0] == "enc" else "head",
                              {"enc": fdp.optim.adamw(0.1, mask=mask), "head": fdp.optim.sgd(0.1)})
    state = opt.init(params)
    assert list(state.states["enc"].exp_avg) == [("enc", "w"), ("enc", "b")]
    grads = fdp._tree.tree_map(torch.ones_like, params)
    new, state = opt.update(grads, state, params)
    assert inner == [("enc", "w"), ("enc", "b")]
    assert not torch.equal(new["head"]["w"], params["head"]["w"])


def test_the_fused_step_groups_by_the_same_names():
    """``reducer.grad_and_update`` splits buckets by the mask, called with the names."""
    _, params, _ = fdp.functionalize(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)))
    seen = []

    def mask(path, p):
        seen.append(path)
        return "weight" in path

    step = fdp.Reducer(params).grad_and_update(
        lambda p, x: sum((v * x).sum() for v in p.values()), fdp.optim.adamw(0.1, mask=mask))
    step.init(params)
    assert set(seen) == set(params) and all(isinstance(k, str) for k in seen)
