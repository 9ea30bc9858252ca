"""The fused step's optimizer state: flat per bucket (or per slice, sharded), and its per-leaf form.

``FusedState`` holds, per state field, one flat tensor per bucket; under a sharded step
(``Reducer(shard=True)``) one per bucket *slice*, this rank's (for a partition, per label and
field, the label's elements only: ``fdp._slices.geometry``). ``StateLayout`` makes,
checks and converts it: ``to_tree`` gives the per-leaf layout of ``opt.init(params)`` (a
collective when sharded: the slices are gathered), which loads into the plain path, another
bucket plan, another world size or the unsharded step; ``from_tree`` takes it back.
``to_shards`` gives the same layout with each leaf an ``fdp.Shard`` of this rank's elements
(views, no communication: what ``fdp.save_sharded`` writes), and ``from_shards`` takes it
back from Shards of any origin that hold this rank's elements (``fdp.load_sharded``'s, of a
checkpoint saved on another world size).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import _internals, _tree
from .._comm import collectives as comm
from .._comm.group import Group
from .._plan.bucket import BucketPlan
from .._shard import Shard, elements
from .._slices.geometry import Placed, Slices, Spans
from ..optim import ChainState, InjectHyperparamsState, PartitionState
from .program import Program

__all__ = ["FusedState", "StateLayout"]


class FusedState(NamedTuple):
    """The fused step's optimizer state, flat per bucket (save its per-leaf form:
    ``step.state_to_shards`` with ``fdp.save_sharded``, or ``step.state_to_tree`` with
    ``fdp.save``; unsharded, ``fdp.save`` takes it as it is too).

    The state knows its layout: ``layout`` says which bucket plan (leaf paths, order, shapes,
    dtypes, caps and param groups) its flat tensors follow and, sharded, which slice of each
    bucket this rank holds. It travels with every copy, ``fdp.save`` and ``fdp.load``: a
    step refuses a state of another layout (a params dict built in another key order, another
    mask or caps) instead of applying its moments to the wrong leaves, and ``fdp.save`` and
    ``torch.distributed.checkpoint.save`` (at any depth of its state dict) refuse a sharded
    state (one rank's slices are not the state), copies included; save
    ``step.state_to_tree(opt_state, params)`` with either.

    Attributes:
      step: the optimizer's count of updates applied (the tensor the per-leaf state holds).
      buffers: per state field (e.g. ``"exp_avg"``), one flat tensor per bucket (sharded:
        this rank's slice of each bucket).
      transforms: the states of the chain's gradient transforms (e.g. a ``ClipState``).
      layout: an int64 tensor ``[version, shard rank, shard ranks, plan digest x 3]`` (see
        ``describe_layout``); ``shard ranks`` is 1 for an unsharded state.
      hyperparams: an ``inject_hyperparams`` optimizer's values (``{name: value}``, 0-d CPU
        tensors, as ``InjectHyperparamsState.hyperparams``): the next step runs with them;
        change them with ``fdp.optim.set_hyperparams(opt_state, lr=...)``. ``None`` for
        other optimizers.
    """

    step: torch.Tensor
    buffers: dict[str, list[torch.Tensor]]
    transforms: tuple
    layout: torch.Tensor
    hyperparams: dict[str, Any] | None = None

    @property
    def sharded(self) -> bool:
        """Whether ``buffers`` holds one rank's slices of a sharded state (``Reducer(shard=True)``)."""
        return int(self.layout[2]) > 1

    def unsaveable_reason(self) -> str | None:
        """Why ``fdp.save`` must not write this state as it is (None: it may)."""
        if not self.sharded:
            return None
        rank, ranks = (int(v) for v in self.layout[1:3])
        return (f"it is rank {rank}'s slices of a state sharded over {ranks} ranks "
                "(Reducer(shard=True)), and rank 0's slices alone are not the state; save "
                "step.state_to_shards(opt_state, params) with fdp.save_sharded (every rank its own "
                "slices, per leaf), or step.state_to_tree(opt_state, params) with fdp.save (gathered, "
                "per leaf); either loads into any world size")

    def __getattr__(self, name: str) -> Any:
        # torch.distributed.checkpoint asks every value it saves, at any depth of the state
        # dict, for ``__create_write_items__`` (its ``_Checkpointable`` hook: how to write the
        # object; torch 2.13's planner_helpers._create_write_items, looked up with hasattr). A
        # tuple is otherwise one opaque object to DCP: pickled by one rank, and loaded on
        # every rank. Only a sharded state answers, and its answer is a refusal; an unsharded
        # one (the same on every rank) is saved as DCP saves any object.
        if name == _internals.DCP_WRITE_ITEMS and self.sharded:
            return self._refuse_dcp
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _refuse_dcp(self, fqn: str, obj: Any) -> list:
        rank, ranks = (int(v) for v in self.layout[1:3])
        raise ValueError(
            f"fdp: torch.distributed.checkpoint cannot save {fqn!r} (shard rank {rank}): it is this rank's "
            f"slices of a fused optimizer state sharded over {ranks} ranks (Reducer(shard=True)), which DCP "
            "would store as one object from one rank and load on every rank. Put "
            "step.state_to_tree(opt_state, params) there instead (gathered, per leaf: it loads into any world "
            "size; after dcp.load, opt_state = step.state_from_tree(loaded, params)), or save with fdp.save, or "
            "with no gather: fdp.save_sharded of step.state_to_shards(opt_state, params)")

    def check_load(self, like: Any) -> str | None:
        """Why a loaded state cannot stand where ``like`` stood (None: it can)."""
        if isinstance(like, FusedState) and not torch.equal(self.layout.cpu(), like.layout.cpu()):
            return (f"the checkpoint's fused optimizer state has layout {describe_layout(self.layout)}, the "
                    f"train state's {describe_layout(like.layout)}: it was made for another bucket plan "
                    "(params in another key order, another mask, caps or param groups) or sharding; "
                    "save step.state_to_tree(opt_state, params), the per-leaf form, to load it into another layout")
        return None


@_internals.trace_constant
def _expected(layout: StateLayout) -> tuple[tuple[str, ...], int, tuple[tuple[str, tuple], ...]]:
    """What ``layout.check`` compares a state with: the fields, how many transform states, and
    per field each flat tensor's ``(numel, dtype, device)``. In a trace, a constant: dynamo
    guards on the state's tensors, not on each of the layout's numbers."""
    keys = tuple(key for ks in layout.keys for key in ks)
    sizes = tuple((key, tuple((layout.mine.sizes[b.index][k], b.dtype, b.device) for b in layout.plan.buckets))
                  for k in range(len(layout.parts)) for key in layout.keys[k])
    return keys, len(layout.transforms), sizes


LAYOUT_VERSION = 1


def layout_tensor(plan: BucketPlan, slices: Slices, keys: tuple | None = None) -> torch.Tensor:
    """The ``FusedState.layout`` of a state in ``plan``'s buckets cut by ``slices`` (and, for a
    partition, split by its per-leaf ``keys``: the digest covers them too)."""
    fp = plan.fingerprint if keys is None else hashlib.sha256(
        (plan.fingerprint + repr(keys)).encode()).hexdigest()
    words = [int(fp[i:i + 15], 16) for i in (0, 15, 30)]  # 60 bits each: positive int64s
    return torch.tensor([LAYOUT_VERSION, slices.rank, slices.size, *words], dtype=torch.int64)


def describe_layout(layout: torch.Tensor) -> str:
    v = [int(x) for x in layout.tolist()]
    if len(v) != 6 or v[0] != LAYOUT_VERSION:
        return f"unknown ({v})"
    where = "unsharded" if v[2] == 1 else f"slice {v[1]} of {v[2]}"
    return f"plan {v[3]:015x}..., {where}"


class StateLayout:
    """Makes, checks and converts a ``FusedState`` for one program on one core's layout.

    ``FusedState.buffers`` holds, per state field of each part (``"exp_avg"``; for a
    partition ``"label:exp_avg"``), one tensor per bucket: the part's compact state of this
    rank's slice (``fdp._slices.geometry``). ``to_tree`` gives ``opt.init(params)``'s per-leaf
    layout (a collective when sharded: every rank's state is gathered), ``from_tree`` takes it
    back.
    """

    def __init__(self, program: Program, plan: BucketPlan, slices: Slices, group: Group, name: str,
                 spans_of: Callable[[int], Spans]) -> None:
        self.program, self.plan, self.slices, self.group, self.name = program, plan, slices, group, name
        self.opt, self.transforms, self.parts = program.opt, program.transforms, program.parts
        self.mine, self.spans_of = spans_of(slices.rank), spans_of
        # per part: the buffers' keys of its fields, in its kernel's order
        self.keys = [[f if not program.partitioned else f"{part.label}:{f}" for f in part.kernel.fields]
                     for part in self.parts]
        self.layout = layout_tensor(plan, slices, program.keys if program.partitioned else None)

    # ------------------------------------------------------------------ make and check
    def init(self, params: Any) -> FusedState:
        self.plan.leaves_of(params, f"{self.name}: init params")  # checked against the plan
        count = self._count(params)
        buffers = {key: [torch.full((self.mine.sizes[b.index][k],), part.kernel.init_value, dtype=b.dtype,
                                    device=b.device) for b in self.plan.buckets]
                   for k, part in enumerate(self.parts) for key in self.keys[k]}
        return FusedState(count, buffers, tuple(t.init(params) for t in self.transforms), self.layout,
                          self._initial_hyperparams())

    def _initial_hyperparams(self) -> dict | None:
        """An injected optimizer's values as it was made with (a dict of its own), else None."""
        initial = self.program.initial
        return None if initial is None else {k: _cloned(v) for k, v in initial.items()}

    def _count(self, params: Any) -> torch.Tensor:
        """The optimizer's own count (its dtype differs between optimizers), from an init over
        empty leaves of the same dims: a full init would allocate a whole per-leaf state."""
        empty = _tree.tree_map(lambda t: t.new_empty((0,) * t.dim()), params)
        state = self.inner(self.opt.init(empty))
        if isinstance(state, PartitionState):
            counts = [s.step for s in state.states.values() if hasattr(s, "step")]
            return counts[0].clone() if counts else torch.zeros((), dtype=torch.int64)
        return state.step.clone()

    @staticmethod
    def inner(state: Any) -> Any:
        """The optimizer's own state in ``opt.init``'s layout (inside a chain's, an injected one's)."""
        state = state.optimizer if isinstance(state, ChainState) else state
        return state.inner_state if isinstance(state, InjectHyperparamsState) else state

    def _unwrap(self, tree_state: Any, what: str, whose: str) -> tuple[tuple, dict | None, Any]:
        """(transforms' states, injected values, the optimizer's state) of a per-leaf state."""
        transforms, hyperparams = (), None
        if self.opt.form.parts:
            if not isinstance(tree_state, ChainState):
                raise TypeError(f"{what}: expected the ChainState of {whose}, got {type(tree_state).__name__}")
            transforms, tree_state = tuple(tree_state.transforms), tree_state.optimizer
        if self.program.injected is not None:
            if not isinstance(tree_state, InjectHyperparamsState):
                raise TypeError(f"{what}: expected the InjectHyperparamsState of {whose} (the optimizer is an "
                                f"inject_hyperparams one), got {type(tree_state).__name__}")
            self._check_hyperparams(tree_state.hyperparams, what)
            hyperparams = {k: _cloned(v) for k, v in tree_state.hyperparams.items()}
            tree_state = tree_state.inner_state
        return transforms, hyperparams, tree_state

    def _check_hyperparams(self, hyperparams: Any, what: str) -> None:
        initial = self.program.initial
        if initial is None:
            if hyperparams is not None:
                raise ValueError(f"{what}: the state holds injected hyper-parameters, but this step's optimizer is "
                                 "not an inject_hyperparams one")
            return
        if hyperparams is None:
            raise ValueError(f"{what}: this step's optimizer is an inject_hyperparams one, but the state holds no "
                             "hyper-parameters (made for another optimizer?): start from step.init(params) or "
                             "step.state_from_tree(tree_state, params)")
        if not isinstance(hyperparams, dict) or set(hyperparams) != set(initial):
            got = sorted(hyperparams) if isinstance(hyperparams, dict) else repr(hyperparams)
            raise ValueError(f"{what}: the state's hyperparams are {got}; this step's optimizer injects "
                             f"{sorted(initial)}")
        for k, v in hyperparams.items():
            if _arity(v) != _arity(initial[k]):
                raise ValueError(f"{what}: hyperparams[{k!r}] is {v!r}; this optimizer's holds "
                                 f"{_arity(initial[k]) or 'one'} number(s)")

    def check(self, state: Any) -> FusedState:
        if not isinstance(state, FusedState):
            raise TypeError(f"{self.name}: opt_state must be the FusedState of step.init(params) (or "
                            f"step.state_from_tree), got {type(state).__name__}")
        self._check_hyperparams(state.hyperparams, f"{self.name}: opt_state")
        # (in a trace against the layout's numbers taken once as constants: no guard on each)
        compiling = _tree.compiling()
        keys, transforms, sizes = _expected(self) if compiling else (
            [key for ks in self.keys for key in ks], len(self.transforms), None)
        if set(state.buffers) != set(keys) or len(state.transforms) != transforms:
            raise ValueError(f"{self.name}: opt_state has fields {sorted(state.buffers)} and "
                             f"{len(state.transforms)} transform states; this optimizer keeps "
                             f"{sorted(keys)} and {transforms}")
        if compiling:
            for key, want in sizes:
                flats = state.buffers[key]
                if len(flats) != len(want) or any(t.numel() != n or t.dtype != dtype or t.device != device
                                                  for t, (n, dtype, device) in zip(flats, want)):
                    raise ValueError(self._differs(key))
            return state
        layout = state.layout
        # (Under torch.compile, above, the layout tensor's digest is not compared: that reads it
        # on the host. The fields, sizes and dtypes are, at trace time.)
        if layout is not self.layout and not (isinstance(layout, torch.Tensor) and layout.shape == self.layout.shape
                                              and torch.equal(layout.cpu(), self.layout)):
            shown = describe_layout(layout) if isinstance(layout, torch.Tensor) else repr(layout)
            raise ValueError(
                f"{self.name}: opt_state was made for another layout ({shown}; this step: "
                f"{describe_layout(self.layout)}): its flat tensors follow another bucket plan (params in another "
                "key order, another partition, caps or param groups) or another sharding, so its moments would "
                "land on the wrong leaves. Convert it: step.state_from_tree(old_step.state_to_tree(opt_state, "
                "params), params)")
        for k in range(len(self.parts)):
            for key in self.keys[k]:
                flats = state.buffers[key]
                if len(flats) != len(self.plan.buckets) or any(
                        t.numel() != self.mine.sizes[b.index][k] or t.dtype != b.dtype or t.device != b.device
                        for t, b in zip(flats, self.plan.buckets)):
                    raise ValueError(self._differs(key))
        return state

    def _differs(self, key: str) -> str:
        what = "slices" if self.slices.sharded else "buckets"
        return (f"{self.name}: opt_state.buffers[{key!r}] does not match this step's {len(self.plan.buckets)} "
                f"{what} (a state made for another plan, world size or sharding? convert it with "
                "step.state_to_tree / step.state_from_tree)")

    # ------------------------------------------------------------------ per-leaf forms
    # The four conversions are one correspondence, ``Spans.placed``: for each rank, which
    # elements of each leaf its state holds, and where in its compact buffers. ``to_shards``
    # reads this rank's (views); ``to_tree`` reads every rank's after one gather of the
    # buffers; ``from_shards`` and ``from_tree`` write this rank's from whatever holds them
    # (a Shard, or a whole tensor).
    def to_tree(self, state: FusedState, params: Any) -> Any:
        """``opt.init(params)``'s layout with whole tensors (a collective when sharded: every
        rank's state is gathered)."""
        state = self.check(state)
        template = self.inner(self.opt.init(params))
        slots, keys = self.plan.slots, self.program.keys
        wholes = {key: [torch.zeros(s.shape, dtype=s.dtype, device=s.device) if keys[i][0] == k else None
                        for i, s in enumerate(slots)]
                  for k in range(len(self.parts)) for key in self.keys[k]}
        for rank, buffers in self._every_rank(state.buffers):
            for at in filter(None, self.spans_of(rank).placed):
                for key in self.keys[at.part]:
                    wholes[key][at.leaf].view(-1)[at.start:at.stop] = _held(buffers[key], at)
        values = [{f: wholes[key] for f, key in zip(part.kernel.fields, self.keys[k])}
                  for k, part in enumerate(self.parts)]
        return self._per_leaf(template, values, state, params, "state_to_tree")

    def to_shards(self, state: FusedState, params: Any) -> Any:
        """``to_tree``'s layout with an ``fdp.Shard`` of this rank's elements for each leaf of
        the state's fields (views of ``state``'s buffers, no copy); the count and the
        transforms' states as they are (replicated). No communication."""
        state = self.check(state)
        # The layout's types from an init on meta tensors: no memory, the structure of opt.init(params).
        template = self.inner(self.opt.init(_tree.tree_map(_on_meta, params)))
        slots, placed, keys = self.plan.slots, self.mine.placed, self.program.keys

        def shard(i: int, key: str) -> Shard:
            slot, at = slots[i], placed[i]
            if at is None:  # (none of this leaf's elements are in this rank's state)
                return Shard(tuple(slot.shape), slot.dtype, (), state.buffers[key][slot.bucket][:0])
            return Shard(tuple(slot.shape), slot.dtype, ((at.start, at.stop),), _held(state.buffers[key], at))

        values = [{f: [shard(i, key) if keys[i][0] == k else None for i in range(len(slots))]
                   for f, key in zip(part.kernel.fields, self.keys[k])} for k, part in enumerate(self.parts)]
        return self._per_leaf(template, values, state, params, "state_to_shards", live=True)

    def _per_leaf(self, template: Any, values: list[dict[str, list]], state: FusedState, params: Any,
                  what: str, live: bool = False) -> Any:
        """``opt.init(params)``'s layout (``template``'s types) holding ``values``: per part, per
        field, each leaf's value in the plan's leaf order (the part's leaves only). ``live``:
        the count and hyper-parameters are ``state``'s own tensors, as ``values`` are views of
        its buffers, so every field reads the same moment (copies otherwise)."""
        own = (lambda t: t) if live else _cloned
        # In params' own structure: a dict given in another key order than the plan's gets
        # its state in its own order, as opt.init(params) lays it out.
        want = _tree.structure(params)

        def in_params_order(leaves: list) -> list:
            if want == self.plan.treedef:
                return leaves
            return _tree.in_order_of(want, self.plan.treedef, leaves, f"{self.name}: {what} params")

        if not self.program.partitioned:
            fields = {f: _tree.unflatten(want, in_params_order(v)) for f, v in values[0].items()}
            tree = template._replace(step=own(state.step), **fields)
        else:
            tree = self._partition_tree(template, values, state.step, params, in_params_order, own)
        if self.program.injected is not None:
            tree = InjectHyperparamsState({k: own(v) for k, v in state.hyperparams.items()}, tree)
        if self.opt.form.parts:
            return ChainState(tuple(state.transforms), tree)
        return tree

    def _partition_tree(self, template: Any, values: list, count: torch.Tensor, params: Any,
                        in_params_order: Callable[[list], list], own: Callable[[Any], Any]) -> Any:
        partition = self.program.optimizer.form.partition
        labels, keys = partition.labels(params), partition.keys(params)
        part_of = {part.label: k for k, part in enumerate(self.parts)}
        states = {}
        for label, sub in template.states.items():
            k = part_of[label]
            if not hasattr(sub, "step"):  # (frozen: no state)
                states[label] = sub
                continue
            per_field = {f: in_params_order(v) for f, v in values[k].items()}
            fields = {f: {keys[i]: v[i] for i in range(len(labels)) if labels[i] == label}
                      for f, v in per_field.items()}
            step = count if count.dtype == sub.step.dtype else count.to(sub.step.dtype)
            states[label] = sub._replace(step=own(step), **fields)
        return PartitionState(states)

    def _every_rank(self, buffers: dict[str, list[torch.Tensor]]) -> list[tuple[int, dict[str, list[torch.Tensor]]]]:
        """``(rank, its state buffers)`` for every rank of the shard group: this rank's own when
        unsharded, else gathered (one all-gather per field and bucket, each rank's compact
        buffer padded to the longest)."""
        s = self.slices
        if not s.sharded:
            return [(s.rank, buffers)]
        sizes = [self.spans_of(r).sizes for r in range(s.size)]
        out: list[dict[str, list[torch.Tensor]]] = [{} for _ in range(s.size)]
        for k in range(len(self.parts)):
            for key in self.keys[k]:
                per_rank: list[list[torch.Tensor]] = [[] for _ in range(s.size)]
                for b, mine in enumerate(buffers[key]):
                    longest = max(sz[b][k] for sz in sizes)
                    padded = mine.new_zeros(longest)
                    padded[:mine.numel()] = mine
                    rows = padded.new_empty(s.size * longest)
                    what = f"{self.name}: gathering bucket {b}'s optimizer state"
                    comm.wait(comm.all_gather_into(rows, padded, self.group, what), self.group, what)
                    for r, row in enumerate(rows.view(s.size, -1)):
                        per_rank[r].append(row)
                for r in range(s.size):
                    out[r][key] = per_rank[r]
        return list(enumerate(out))

    def from_tree(self, tree_state: Any, params: Any) -> FusedState:
        """This rank's ``FusedState`` from ``opt.init(params)``'s layout with whole tensors."""
        return self._from_leaves(tree_state, params, f"{self.name}: state_from_tree", "opt.init(params)")

    def from_shards(self, tree_state: Any, params: Any) -> FusedState:
        """This rank's ``FusedState`` from ``to_shards``'s layout (e.g. loaded by
        ``fdp.load_sharded``): each leaf's Shard (or whole tensor) must hold this rank's
        elements of it; they are copied into fresh flat buffers."""
        return self._from_leaves(tree_state, params, f"{self.name}: state_from_shards", "step.state_to_shards")

    def _from_leaves(self, tree_state: Any, params: Any, what: str, whose: str) -> FusedState:
        transforms, hyperparams, tree_state = self._unwrap(tree_state, what, whose)
        buffers = {key: [torch.zeros(self.mine.sizes[b.index][k], dtype=b.dtype, device=b.device)
                         for b in self.plan.buckets]
                   for k, part in enumerate(self.parts) for key in self.keys[k]}
        if not self.program.partitioned:
            count = tree_state.step.clone()
            for f, key in zip(self.parts[0].kernel.fields, self.keys[0]):
                leaves, treedef = _tree.flatten(getattr(tree_state, f))
                if treedef != self.plan.treedef:
                    leaves = _tree.in_order_of(self.plan.treedef, treedef, leaves, f"{what}: .{f}")
                for i, leaf in enumerate(leaves):
                    self._put(buffers[key], i, leaf, f"{what}: .{f}")
            return FusedState(count, buffers, transforms, self.layout, hyperparams)
        if not isinstance(tree_state, PartitionState):
            raise TypeError(f"{what}: expected the PartitionState of {whose}, got {type(tree_state).__name__}")
        partition = self.program.optimizer.form.partition
        labels, keys = partition.labels(params), partition.keys(params)
        # each plan leaf's index in params' own order
        order = list(range(len(labels)))
        want = _tree.structure(params)
        if want != self.plan.treedef:
            order = _tree.in_order_of(self.plan.treedef, want, order, f"{what}: params")
        counts = {label: s.step for label, s in tree_state.states.items() if hasattr(s, "step")}
        if len({int(c) for c in counts.values()}) > 1:
            raise ValueError(f"{what}: the partition's labels have different step counts {counts}; the "
                             "fused step updates every label at each step, so their counts must agree")
        count = next(iter(counts.values())).clone() if counts else self._count(params)
        for k, part in enumerate(self.parts):
            for f, key in zip(part.kernel.fields, self.keys[k]):
                sub = getattr(tree_state.states[part.label], f)
                for i, j in enumerate(order):
                    if labels[j] == part.label:
                        self._put(buffers[key], i, sub[keys[j]], f"{what}: .states[{part.label!r}].{f}")
        return FusedState(count, buffers, transforms, self.layout, hyperparams)

    def _put(self, flats: list[torch.Tensor], i: int, leaf: Any, what: str) -> None:
        """Plan leaf ``i``'s elements on this rank from ``leaf`` (a Shard, or the whole tensor)
        into its place in ``flats`` (per bucket, one field's state buffers)."""
        slot, at = self.plan.slots[i], self.mine.placed[i]
        if not isinstance(leaf, torch.Tensor | Shard):
            raise TypeError(f"{what}{slot.path} is a {type(leaf).__name__}; expected an fdp.Shard or a tensor")
        if tuple(leaf.shape) != tuple(slot.shape) or leaf.dtype != slot.dtype:
            raise ValueError(f"{what}{slot.path} has shape {tuple(leaf.shape)} and dtype {leaf.dtype}; the param "
                             f"has shape {tuple(slot.shape)} and dtype {slot.dtype}")
        if at is None:
            return
        got = elements(leaf, at.start, at.stop)
        if got is None:
            where = "slice" if self.slices.sharded else "state"
            raise ValueError(f"{what}{slot.path} holds elements {[list(r) for r in leaf.ranges]} of the leaf, but "
                             f"this rank's {where} ({self.slices.rank} of {self.slices.size}) needs its elements "
                             f"{at.start}:{at.stop} (load it with step.state_to_shards(step.init(params), params) "
                             "as like)")
        _held(flats, at).copy_(got)


def _held(flats: list[torch.Tensor], at: Placed) -> torch.Tensor:
    """The elements ``at`` places in a rank's state buffers (``flats``: per bucket), a view."""
    return flats[at.bucket][at.at:at.at + (at.stop - at.start)]


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _cloned(v: Any) -> Any:
    """A hyper-parameter value of its own (a 0-d tensor, or a tuple of them)."""
    if isinstance(v, tuple | list):
        return tuple(_cloned(x) for x in v)
    return v.clone() if isinstance(v, torch.Tensor) else v


def _arity(v: Any) -> int:
    """0 for one number, else how many a tuple holds."""
    return len(v) if isinstance(v, tuple | list) else 0
