"""``Program``: what one optimizer (or chain) asks of the fused step, read once from it.

The chain's gradient transforms are sorted by where they can run (their declared
``reach``): the leading element and per-leaf ones (the *prefix*) transform each bucket as
it lands; the whole-tree ones and those between them (the *middle*) run once every bucket
has landed; those after the last whole-tree one (the *suffix*) run per bucket inside its
update. A global scale right after the prefix has its per-leaf statistics measured as
each bucket lands too. The optimizer's ``LeafKernel`` updates each bucket, per run of
leaves of one hyper-parameter group.
"""

from __future__ import annotations

from typing import Any

from ..optim import GradientTransform, LeafKernel, Optimizer
from ..optim._flat import split_chain


class Program:
    """One optimizer's part of a fused step (see the module docstring).

    Attributes:
      opt: the optimizer or chain. transforms: its gradient transforms. kernel: its
      ``LeafKernel``. groups: per leaf, its hyper-parameter group (the mask's).
      prefix: how many leading transforms run on each bucket as it lands.
      last_tree: the index of the last whole-tree transform (-1: none).
      measure: the global scale whose statistics are measured as buckets land, or None.
      whole_tree: whether some transform needs every bucket before any update.
      suffix: the indices of the transforms each bucket's update applies, after the
        whole-tree ones.
    """

    def __init__(self, opt: Optimizer, params: Any, name: str, *, sharded: bool) -> None:
        self.opt = opt
        self.transforms, optimizer = split_chain(opt, name, sharded=sharded)
        self.kernel: LeafKernel = optimizer.leaf_kernel
        self.groups = tuple(int(g) for g in self.kernel.groups(params))
        t = self.transforms
        self.prefix = next((i for i, x in enumerate(t) if x.reach == "tree"), len(t))
        self.last_tree = max((i for i, x in enumerate(t) if x.reach == "tree"), default=-1)
        self.measure: GradientTransform | None = t[self.prefix] if self.prefix < len(t) else None
        self.whole_tree = self.last_tree >= 0  # some transform needs every bucket before any update
        # the transforms each bucket's update applies after the whole-tree ones
        self.suffix: list[int] = list(range(self.last_tree + 1, len(t))) if self.whole_tree else []
