"""``python -m fdp.bench micro``: the per-leaf costs behind fdp's design choices, measured here.

Each row times one way of doing a per-leaf operation against the way fdp does it, over
``--leaves`` small tensors, and prints microseconds per leaf (median of ``--reps``). The
comments in the code cite these rows instead of quoting numbers from one machine.

  hook       ``Tensor.register_hook`` vs assigning ``_backward_hooks`` (fdp/_internals.py)
  flatten    optree's flatten of a dict of tensors vs fdp's cached dict structure (fdp/_tree.py)
  views      slicing a flat buffer in Python vs one ``unflatten_dense_tensors`` call (fdp/_plan/bucket.py)
  view(-1)   ``t.view(-1)`` alone, the floor of any per-leaf Python work (kernels/_torch.py)
  apply      ``torch.func.functional_call`` vs ``fdp.functionalize``'s apply (its parameter
             swap), on a module of ``--leaves`` parameters (fdp/_functional.py)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import optree
import torch

from .. import _internals, _tree, kernels
from .._functional import functionalize
from .table import Table


def _time(fn: Callable[[], object], reps: int) -> float:
    fn()
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


class _Many(torch.nn.Module):
    """``n`` parameters and a forward that does nothing: only the swap in and out is timed."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4, bias=False) for _ in range(n))

    def forward(self) -> None:
        return None


def rows(leaves: int, reps: int) -> list[tuple[str, str, float, str, float]]:
    """(row, their way, us/leaf, fdp's way, us/leaf) for each measured choice."""
    ts = [torch.randn(16) for _ in range(leaves)]
    tree = {f"layer{i}.weight": t for i, t in enumerate(ts)}
    flat = torch.randn(16 * leaves)
    meta = [torch.empty(16, device="meta") for _ in range(leaves)]
    per = 1e6 / leaves

    def register() -> None:
        for t in ts:
            t.detach().requires_grad_().register_hook(lambda g: None)

    def assign() -> None:
        for t in ts:
            _internals.set_leaf_hook(t.detach().requires_grad_(), lambda g: None)

    def slicing() -> None:
        [flat[i * 16 : (i + 1) * 16].view(16) for i in range(leaves)]

    out = [
        ("hook", "register_hook", _time(register, reps) * per, "_backward_hooks", _time(assign, reps) * per),
        ("flatten", "optree.tree_flatten", _time(lambda: optree.tree_flatten(tree, namespace=_tree.NAMESPACE), reps) * per,
         "fdp cached dict", _time(lambda: _tree.flatten(tree), reps) * per),
        ("views", "python slicing", _time(slicing, reps) * per,
         "kernels.views", _time(lambda: kernels.views(flat, meta), reps) * per),
        ("view(-1)", "t.view(-1)", _time(lambda: [t.view(-1) for t in ts], reps) * per, "-", 0.0),
    ]
    module = _Many(leaves)
    apply, params, buffers = functionalize(module)
    call = {**params, **buffers}
    out.append(("apply", "functional_call", _time(lambda: torch.func.functional_call(module, call, ()), reps) * per,
                "fdp apply", _time(lambda: apply(params, buffers), reps) * per))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fdp.bench micro", description=__doc__.split("\n\n")[0])
    p.add_argument("--leaves", type=int, default=2000)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    table = Table(f"per-leaf costs over {args.leaves} leaves, median of {args.reps} (us per leaf)",
                  ["row", "their way", "us", "fdp", "fdp us"], keys=2, text=["fdp"])
    for row, theirs, t_theirs, ours, t_ours in rows(args.leaves, args.reps):
        table.row(row, theirs, f"{t_theirs:.3f}", ours, f"{t_ours:.3f}")
    print(table.render())
    return 0
