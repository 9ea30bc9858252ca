"""``Program``: what one optimizer (or chain) asks of the fused step, read once from it.

The chain's gradient transforms are sorted by where they can run (their declared
``reach``): the leading element and per-leaf ones (the *prefix*) transform each bucket as
it lands; the whole-tree ones and those between them (the *middle*) run once every bucket
has landed; those after the last whole-tree one (the *suffix*) run per bucket inside its
update. A global scale right after the prefix has its per-leaf statistics measured as
each bucket lands too.

The optimizer is one ``LeafKernel``, or, for ``partition``, one per label (a *part*). Each
leaf gets a key ``(part, group)``: its part, and its hyper-parameter group in that part's
kernel (the mask's); a bucket's update is one kernel call per key over its leaves' runs.
A part whose kernel has a separate decay (``LeafKernel.decay``: AdamW's) and leaves of both
mask groups is *decayed apart*: its group-0 runs are decayed first, then one kernel call
without decay covers the runs of both groups (``Buckets.decays``).

An ``inject_hyperparams`` optimizer keeps its values in the state (``FusedState.hyperparams``):
the layout is that of the optimizer bound to the values it was made with, and each step
runs the kernel of the optimizer bound to the state's values (``kernels``), once per step,
which must keep that layout (the same state fields).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .. import _tree
from ..optim import GradientTransform, LeafKernel, Optimizer
from ..optim._flat import bound, split_chain
from ..optim._inject import Traced


class Part(NamedTuple):
    """One kernel of a program: a partition's label (None for a plain optimizer), its
    optimizer and ``LeafKernel``, and the dtype of its step count (None: it keeps none)."""

    label: Any
    optimizer: Optimizer
    kernel: LeafKernel
    count_dtype: Any


class Program:
    """One optimizer's part of a fused step (see the module docstring).

    Attributes:
      opt: the optimizer or chain. transforms: its gradient transforms. optimizer: the
      optimizer after them (a partition, or one with a ``LeafKernel``). parts: its kernels.
      keys: per leaf, ``(part index, group)``.
      prefix: how many leading transforms run on each bucket as it lands.
      last_tree: the index of the last whole-tree transform (-1: none).
      measure: the global scale whose statistics are measured as buckets land, or None.
      whole_parts: the parts whose kernel takes whole leaves (Muon's).
      whole_tree: whether some transform needs every bucket before any update.
      suffix: the indices of the transforms each bucket's update applies, after the
        whole-tree ones.
      decayed_apart: the parts decayed apart (the module docstring).
      engine_key: what a fused core's layout depends on (keys, whole parts, parts decayed apart).
    """

    def __init__(self, opt: Optimizer, params: Any, name: str, *, sharded: bool) -> None:
        self.opt, self.name = opt, name
        self.transforms, outer = split_chain(opt, name, sharded=sharded)
        # an inject_hyperparams optimizer: its values are the state's, the layout its first values'
        self.injected: Optimizer | None = outer if outer.form.bind is not None else None
        self.optimizer = bound(outer)
        partition = self.optimizer.form.partition
        if partition is None:
            self.parts = [Part(None, self.optimizer, self.optimizer.form.leaf_kernel, _count_dtype(self.optimizer, params))]
            self.keys = tuple((0, int(g)) for g in self.optimizer.form.leaf_kernel.groups(params))
        else:
            leaves, treedef = _tree.flatten(params)
            labels = partition.labels(params)
            keys = partition.keys(params)
            order = list(dict.fromkeys(labels))  # the labels in leaf order of first use
            self.parts = []
            for label in order:
                sub = {keys[i]: leaves[i] for i, lab in enumerate(labels) if lab == label}
                o = partition.optimizers[label]
                self.parts.append(Part(label, o, o.form.leaf_kernel, _count_dtype(o, sub)))
            per_leaf: list[tuple[int, int] | None] = [None] * len(leaves)
            for k, part in enumerate(self.parts):
                idx = [i for i, label in enumerate(labels) if label == part.label]
                groups = part.kernel.groups({keys[i]: leaves[i] for i in idx})
                for i, g in zip(idx, groups):
                    per_leaf[i] = (k, int(g))
            self.keys = tuple(per_leaf)
        # the parts whose kernel takes whole leaves (Muon): part of the layout's key
        self.whole_parts = frozenset(k for k, part in enumerate(self.parts) if part.kernel.whole_leaves)
        self.decayed_apart = frozenset(k for k, part in enumerate(self.parts) if part.kernel.decay is not None
                                       and {(k, 0), (k, 1)} <= set(self.keys))
        self.engine_key = (self.keys, self.whole_parts, self.decayed_apart)
        t = self.transforms
        self.prefix = next((i for i, x in enumerate(t) if x.reach == "tree"), len(t))
        self.last_tree = max((i for i, x in enumerate(t) if x.reach == "tree"), default=-1)
        self.measure: GradientTransform | None = t[self.prefix] if self.prefix < len(t) else None
        self.whole_tree = self.last_tree >= 0
        self.suffix: list[int] = list(range(self.last_tree + 1, len(t))) if self.whole_tree else []
        # the values an injected optimizer was made with, as its state holds them (from an init on empty leaves)
        self.initial: dict | None = None if self.injected is None else self.injected.init(
            _tree.tree_map(lambda t: t.new_empty((0,) * t.dim()), params)).hyperparams
        # the parts' own kernels: what a step without injected values runs (read directly by ``Run``)
        self.default_kernels: list[LeafKernel] = [part.kernel for part in self.parts]
        self._last: tuple[Optimizer, list[LeafKernel]] = (self.optimizer, self.default_kernels)
        # an injected optimizer as a compiled step runs it: set by ``fdp.CompiledStep`` around each call
        self.traced: Traced | None = None

    def kernels(self, hyperparams: dict | None) -> list[LeafKernel]:
        """Each part's kernel for a step whose state holds ``hyperparams`` (``FusedState.hyperparams``):
        the parts' own, or an injected optimizer's bound to the state's values (read on the host:
        once per step, not per bucket).

        Raises:
          ValueError: values the optimizer does not inject, an invalid value, or one that
            changes the state's fields.
        """
        if self.injected is None:
            if hyperparams is not None:
                raise ValueError(f"{self.name}: opt_state holds injected hyper-parameters {sorted(hyperparams)} (a "
                                 "state of an inject_hyperparams optimizer), but this step's optimizer keeps its "
                                 "own; pass the state of this step's optimizer")
            return self.default_kernels
        if hyperparams is None:
            raise ValueError(f"{self.name}: this step's optimizer is an inject_hyperparams one, but opt_state holds "
                             "no hyper-parameters (made by another step?): start from step.init(params) or "
                             "step.state_from_tree(tree_state, params)")
        opt = self.injected.form.bind(hyperparams)
        last = self._last  # (one read: simulated ranks may share a step)
        if opt is last[0]:
            return last[1]
        kernels = [self._checked(opt, hyperparams).form.leaf_kernel]
        self._last = (opt, kernels)
        return kernels

    def for_trace(self, hyperparams: dict) -> Traced:
        """Eagerly, before a compiled step's call: the injected optimizer its graph runs
        (``fdp.optim._inject._Binder.traced``: the ``lr`` read in the graph from
        ``hyperparams``' tensor, the others read here, on the host, and fixed in it), checked
        as ``kernels`` checks the values."""
        binder = self.injected.form.bind
        traced = binder.traced(binder.host_values(hyperparams))
        self._checked(traced.optimizer, hyperparams)
        return traced

    def _checked(self, opt: Optimizer, hyperparams: dict) -> Optimizer:
        """``opt`` (the injected optimizer bound to ``hyperparams``) if its kernel keeps the
        state's layout (the same fields), else a ``ValueError`` naming the values that change it."""
        kernel, first = opt.form.leaf_kernel, self.parts[0].kernel
        if kernel is None or (kernel.fields, kernel.init_value, kernel.whole_leaves) != (
                first.fields, first.init_value, first.whole_leaves):
            changed = {k: v for k, v in hyperparams.items() if not _same(v, self.initial[k])}
            shown = {k: _shown(v) for k, v in changed.items()}
            raise ValueError(
                f"{self.name}: the hyper-parameters {shown} change the optimizer state's layout (its fields "
                f"{first.fields} would be {None if kernel is None else kernel.fields}), which the fused step's "
                "state cannot change between steps; build the optimizer with values that keep it (e.g. sgd's "
                "momentum > 0 from the start), or start a new state (step.init)")
        return opt

    @property
    def partitioned(self) -> bool:
        return self.optimizer.form.partition is not None


def _count_dtype(opt: Optimizer, params: Any) -> Any:
    """The dtype of ``opt``'s step count (from an init over empty leaves), or None."""
    state = opt.init(_tree.tree_map(lambda t: t.new_empty((0,) * t.dim()), params))
    step = getattr(state, "step", None)
    return step.dtype if step is not None else None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and all(
            _same(x, y) for x, y in zip(a, b))
    return float(a) == float(b)


def _shown(v: Any) -> Any:
    return tuple(_shown(x) for x in v) if isinstance(v, tuple) else v.item() if hasattr(v, "item") else v
