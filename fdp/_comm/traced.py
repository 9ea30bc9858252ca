"""Collectives as graph nodes: what a compiled step (``torch.compile``) communicates with.

Functional collectives (``torch.distributed._functional_collectives``) are the graph-visible
form torch.compile traces and Inductor can reorder for overlap (the eager path,
``collectives.py``, uses c10d's work handles, which dynamo cannot trace). Each function here
returns its result after its wait (``wait_tensor``), and is the identity in a world of one.

On gloo, the all-gather and the reduce-scatter are fdp's own ops instead, which send and
receive point to point into place, as the eager step does (``fdp/_slices/exchange.py``):
torch's functional collectives on gloo copy through temporaries. Its all-gather gathers into a
buffer of the output's size and copies it out (a 12 MiB bucket gathered holds 24 MiB until the
copy), and its reduce-scatter is a whole all-reduce and a copy (17 ms for a 12 MiB bucket on
2 ranks, as long as the all-reduce); an ``all_to_all_single`` of the parts (10 ms) receives
every rank's part whole, the bucket's size where the slice's would do. In a fully sharded
compiled step these buffers are most of what it holds at its peak. The ops:

* ``fdp::all_gather_into_tensor(shard, group_size, group_name, tag)``: every rank's ``shard``
  concatenated in rank order, each peer's part received into its place of the output;
* ``fdp::reduce_scatter_tensor(input, reduce_op, group_size, group_name, tag)``: this rank's
  part of the sum: its own part, then each peer's added in rank order, as the eager step adds
  them (the same bits); the first peer's part is received into the output itself, so with
  two ranks nothing but the output is allocated;
* ``fdp::all_to_all_single(input, output_split_sizes, input_split_sizes, group_size,
  group_name, tag)``: each rank's part of ``input`` sent to it, each peer's received into its
  place of the output (clipping's statistics of leaves that straddle slices, Muon's whole
  matrices to and from their owners). torch's own has a schema (``Any group_name``) that
  Inductor's C++ wrapper cannot call (torch 2.13: "arg type Any is not yet supported by
  custom_op_wrapper"), which made ``options={"cpp_wrapper": True}`` fail on such steps.

Each has the signature and meaning of the ``_c10d_functional`` op it stands for, plus the
point-to-point ``tag``, and is used as they are: ``wait_tensor`` of its output before reading
it. The op posts the sends and receives and registers a work for its output in torch's
registry, which ``wait_tensor`` reads; that wait waits within the group's timeout
(``collectives.wait``: a stall names the other ranks' collective) and, for the reduce-scatter,
adds the peers' parts in. Inductor lowers both as it lowers torch's own collectives
(``_internals.lower_as_collective``), so a collective's input is held, never reused or
written, until its wait; fdp's graph passes treat them as the ops they stand for
(``schedule.is_op``). Every rank issues a graph's collectives in the same order (``schedule``),
so each pair of ranks matches its sends and receives in that order.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from .. import _internals
from .collectives import exchange, wait
from .group import Group

__all__ = ["NAMESPACE", "traced_all_gather", "traced_all_reduce", "traced_all_to_all", "traced_broadcast",
           "traced_reduce_scatter"]

NAMESPACE = "fdp"


def traced_all_reduce(flat: torch.Tensor, group: Group) -> torch.Tensor:
    """SUM all-reduce (``all_reduce -> wait``)."""
    if group.process_group is None:
        return flat
    funcol = _internals.functional_collectives()
    return funcol.wait_tensor(funcol.all_reduce(flat, "sum", group.process_group))


def traced_broadcast(flat: torch.Tensor, src: int, group: Group) -> torch.Tensor:
    """Broadcast from group rank ``src``."""
    if group.process_group is None:
        return flat
    funcol = _internals.functional_collectives()
    return funcol.wait_tensor(funcol.broadcast(flat, src, group.process_group))


def traced_reduce_scatter(flat: torch.Tensor, group: Group, tag: int = 0) -> torch.Tensor:
    """SUM reduce-scatter of ``flat`` (a multiple of the group's size) into this rank's equal
    part (on gloo, ``fdp::reduce_scatter_tensor``, point to point with ``tag``)."""
    if group.process_group is None:
        return flat
    funcol = _internals.functional_collectives()
    if not _point_to_point(flat, group):
        scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor  # (torch 2.13 names)
        return funcol.wait_tensor(scatter(flat, "sum", 0, group.process_group))
    out = torch.ops.fdp.reduce_scatter_tensor(flat, "sum", group.size, group.process_group.group_name, tag)
    return funcol.wait_tensor(out)


def traced_all_gather(flat: torch.Tensor, group: Group, tag: int = 0) -> torch.Tensor:
    """Every rank's ``flat``, concatenated in rank order (on gloo, ``fdp::all_gather_into_tensor``,
    point to point with ``tag``)."""
    if group.process_group is None:
        return flat
    funcol = _internals.functional_collectives()
    if not _point_to_point(flat, group):
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # (torch 2.13 names)
        return funcol.wait_tensor(gather(flat, 0, group.process_group))
    return funcol.wait_tensor(torch.ops.fdp.all_gather_into_tensor(flat, group.size, group.process_group.group_name,
                                                                    tag))


def traced_all_to_all(flat: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: Group) -> torch.Tensor:
    """``all_to_all_single``: ``in_sizes[j]`` elements of ``flat`` to rank ``j``, ``out_sizes[k]``
    from rank ``k``, received in rank order (on gloo, ``fdp::all_to_all_single``, point to point
    with ``ALL_TO_ALL_TAG``)."""
    funcol = _internals.functional_collectives()
    if not _point_to_point(flat, group):
        return funcol.wait_tensor(funcol.all_to_all_single(flat, out_sizes, in_sizes, group.process_group))
    return funcol.wait_tensor(torch.ops.fdp.all_to_all_single(flat, out_sizes, in_sizes, group.size,
                                                               group.process_group.group_name, ALL_TO_ALL_TAG))


def _point_to_point(flat: torch.Tensor, group: Group) -> bool:
    """Whether ``flat`` goes through fdp's ops (gloo, CPU tensors, a torch whose
    ``wait_tensor`` can wait for them)."""
    return group.backend == "gloo" and flat.device.type == "cpu" and _REGISTERS_WORKS


_REGISTERS_WORKS = _internals.registers_works()
# The point-to-point tag of the all-to-alls (the buckets' gathers and reduce-scatters use 2b and
# 2b + 1): every rank issues them in the same order, so each pair matches them in that order.
ALL_TO_ALL_TAG = 1 << 24


# ---------------------------------------------------------------------------- fdp's ops (gloo)
_LIB = torch.library.Library(NAMESPACE, "DEF")
_LIB.define("all_gather_into_tensor(Tensor shard, int group_size, str group_name, int tag) -> Tensor")
_LIB.define("reduce_scatter_tensor(Tensor input, str reduce_op, int group_size, str group_name, int tag) -> Tensor")
_LIB.define("all_to_all_single(Tensor input, int[] output_split_sizes, int[] input_split_sizes, int group_size, "
            "str group_name, int tag) -> Tensor")

# The fdp Group of each process group the ops ran on, by name (made from the process group:
# its ranks, its timeout), with the process group it was made from (a name is reused by a
# group made after one destroyed).
_GROUPS: dict[str, tuple[Any, Group]] = {}


def _group(name: str, size: int) -> Group:
    pg = _internals.process_group_named(name)
    known = _GROUPS.get(name)
    if known is None or known[0] is not pg:
        known = _GROUPS[name] = (pg, Group.from_process_group(pg))
    if known[1].size != size:
        raise RuntimeError(f"fdp: a compiled graph's collective expects {size} ranks in process group {name!r}, "
                           f"which has {known[1].size}")
    return known[1]


def _gather(shard: torch.Tensor, group_size: int, group_name: str, tag: int) -> torch.Tensor:
    group = _group(group_name, group_size)
    src = shard.contiguous().view(-1)
    n, me = src.numel(), group.rank
    out = src.new_empty(group_size * n)
    out[me * n:(me + 1) * n].copy_(src)
    peers = [j for j in range(group_size) if j != me]
    what = f"all-gather of a compiled step's bucket (tag {tag})"
    works = [exchange([(src, j) for j in peers], [(out[j * n:(j + 1) * n], j) for j in peers], group, what, tag)]

    def done(timeout: Any) -> bool:
        wait(works.pop(), group, what)  # (and let go of its buffers: torch may keep this work a while)
        return True

    _internals.register_work(out, done)
    return out


def _scatter(flat: torch.Tensor, reduce_op: str, group_size: int, group_name: str, tag: int) -> torch.Tensor:
    if reduce_op != "sum":
        raise ValueError(f"fdp::reduce_scatter_tensor sums; got reduce_op={reduce_op!r}")
    group = _group(group_name, group_size)
    src = flat.contiguous().view(-1)
    n, me = src.numel() // group_size, group.rank
    peers = [j for j in range(group_size) if j != me]
    # The first peer's part is received into the output, and this rank's own added to it
    # (b + a is a + b, bit for bit): no copy of the own part; the later peers' parts land in
    # staging, one part each.
    out = src.new_empty(n)
    staged = src.new_empty((len(peers) - 1) * n)
    parts = [out] + [staged[k * n:(k + 1) * n] for k in range(len(peers) - 1)]
    what = f"reduce-scatter of a compiled step's bucket (tag {tag})"
    held = [exchange([(src[j * n:(j + 1) * n], j) for j in peers], list(zip(parts, peers)), group, what, tag),
            src[me * n:(me + 1) * n]]  # (the input is the graph's until the wait: Inductor's collective input)

    def done(timeout: Any) -> bool:
        work, own = held
        held.clear()  # (let go of the buffers: torch may keep this work a while)
        wait(work, group, what)
        first, *rest = parts
        parts.clear()
        first.add_(own)  # this rank's own part first, then the peers' in rank order
        for part in rest:
            first.add_(part)
        return True

    _internals.register_work(out, done)
    return out


def _all_to_all(flat: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group_size: int,
                group_name: str, tag: int) -> torch.Tensor:
    group = _group(group_name, group_size)
    src = flat.contiguous().view(-1)
    me = group.rank
    ins, outs = (list(itertools.accumulate(sizes, initial=0)) for sizes in (input_split_sizes, output_split_sizes))
    out = src.new_empty(outs[-1])
    out[outs[me]:outs[me + 1]].copy_(src[ins[me]:ins[me + 1]])
    peers = [j for j in range(group_size) if j != me]
    what = f"all-to-all of a compiled step's parts (tag {tag})"
    # (a part of no elements is neither sent nor received: its size is the same on both sides)
    works = [exchange([(src[ins[j]:ins[j + 1]], j) for j in peers if input_split_sizes[j]],
                      [(out[outs[j]:outs[j + 1]], j) for j in peers if output_split_sizes[j]], group, what, tag)]

    def done(timeout: Any) -> bool:
        wait(works.pop(), group, what)
        return True

    _internals.register_work(out, done)
    return out


def _gather_fake(shard: torch.Tensor, group_size: int, group_name: str, tag: int) -> torch.Tensor:
    return shard.new_empty(group_size * shard.numel())


def _scatter_fake(flat: torch.Tensor, reduce_op: str, group_size: int, group_name: str, tag: int) -> torch.Tensor:
    return flat.new_empty(flat.numel() // group_size)


_LIB.impl("all_gather_into_tensor", _gather, "CPU")
_LIB.impl("reduce_scatter_tensor", _scatter, "CPU")
_LIB.impl("all_to_all_single", _all_to_all, "CPU")
torch.library.register_fake(f"{NAMESPACE}::all_gather_into_tensor", _gather_fake, lib=_LIB)
torch.library.register_fake(f"{NAMESPACE}::reduce_scatter_tensor", _scatter_fake, lib=_LIB)
torch.library.register_fake(f"{NAMESPACE}::all_to_all_single",
                            lambda flat, output_split_sizes, *_: flat.new_empty(sum(output_split_sizes)), lib=_LIB)
# (issued on every rank even where a rank's graph does not use the value: the peers wait for it)
torch.fx.node.has_side_effect(torch.ops.fdp.all_gather_into_tensor.default)
torch.fx.node.has_side_effect(torch.ops.fdp.reduce_scatter_tensor.default)
torch.fx.node.has_side_effect(torch.ops.fdp.all_to_all_single.default)
_internals.when_imported("torch._inductor.lowering", lambda: _internals.lower_as_collective(
    [torch.ops.fdp.all_gather_into_tensor, torch.ops.fdp.reduce_scatter_tensor, torch.ops.fdp.all_to_all_single]))
