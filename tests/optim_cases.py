"""What the optimizer tests share: a tree of leaves of every rank (0-d to 3-d) and seeded
gradients for it, exact equality of two trees, the usual decay mask, and a sharded run
checkpointed and resumed into the fused step and the plain path."""

from __future__ import annotations

from typing import Any

import torch
from models import CAPS, batch, loss_of, mlp

import fdp

SHAPES = ((6, 4), (6,), (), (3, 5, 4), (1, 7))


def params_of(dtype: torch.dtype, seed: int = 0, shapes: tuple = SHAPES) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.{'weight' if len(s) >= 2 else 'bias'}": torch.randn(s, generator=g, dtype=dtype)
            for i, s in enumerate(shapes)}


def grads_for(params: dict, step: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {k: scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()}


def assert_equal(got: dict, want: dict, what: str) -> None:
    """Every leaf of ``want`` equal to ``got``'s, bit for bit."""
    for k in want:
        assert torch.equal(got[k], want[k]), (
            f"{what}: [{k!r}] differs: max |diff| {(got[k] - want[k]).abs().max().item():.3g}")


def assert_same_tree(got: dict, want: dict, what: str) -> None:
    """The same keys in the same order, and ``assert_equal``."""
    assert list(got) == list(want), f"{what}: keys {list(got)} vs {list(want)}"
    assert_equal(got, want, what)


def decays(path: Any, p: torch.Tensor) -> bool:
    return p.dim() >= 2


def resumed_runs(group: fdp.Group, opt: fdp.optim.Optimizer, path: str) -> dict[str, tuple]:
    """Ten sharded fused steps of ``opt``, ``fdp.save`` of the per-leaf state, ``fdp.load`` into
    the unsharded fused step and the plain path; ten more steps each, beside ten more sharded
    steps. Returns {track: (step, state, params)}; the plain track's step is None."""
    apply, params, buffers = fdp.functionalize(mlp(seed=5))
    loss = loss_of(apply, buffers)
    reducer = fdp.Reducer(params, group, **CAPS)
    sharded = fdp.Reducer(params, group, shard=True, **CAPS).grad_and_update(loss, opt)
    p, s = dict(params), sharded.init(params)
    for i in range(10):
        p, s, _ = sharded(p, s, *batch(group.rank, i))
    fdp.save(path, {"params": p, "opt": sharded.state_to_tree(s, p)}, group=group)
    loaded = fdp.load(path, like={"params": params, "opt": opt.init(params)}, group=group)
    fused = reducer.grad_and_update(loss, opt)
    fp, fs = loaded["params"], fused.state_from_tree(loaded["opt"], loaded["params"])
    pp, ps = {k: v.clone() for k, v in loaded["params"].items()}, loaded["opt"]
    for i in range(10, 20):
        x, y = batch(group.rank, i)
        p, s, _ = sharded(p, s, x, y)
        fp, fs, _ = fused(fp, fs, x, y)
        pp, ps = opt.update(reducer.grad(loss)(pp, x, y), ps, pp)
    return {"sharded": (sharded, s, p), "fused": (fused, fs, fp), "plain": (None, ps, pp)}
