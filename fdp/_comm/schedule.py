"""Where the collectives of a compiled step go: each issued as early as its inputs allow, and
waited as late as its users allow (an FX pass on the graph Inductor compiles).

The traced fused step (``fdp/_fused/traced.py``) is written bucket after bucket once the
gradients are in: the fill of a bucket (its gradients concatenated, scaled, cast) and its
collective follow the whole backward in the graph, although the backward produces the last
bucket's gradients first. Inductor's own reordering (``reorder_for_compute_comm_overlap``)
moves a collective but not the fill that feeds it. This pass moves both: for every collective
(``torch.ops._c10d_functional``'s all_reduce, reduce_scatter, all_gather, all_to_all, and fdp's
own on gloo) the pure
nodes that feed only it (its *chain*) go, in their order, right after the last node they read
from outside the chain (and after the collective before it: the ranks issue their collectives
in the same order, also where their graphs differ, e.g. Muon's owners), with the collective
after them; then each ``wait_tensor`` goes right before its first user. The graph stays in a topological order, nothing is added or removed,
and the numbers do not change (the same ops on the same inputs); what changes is how much of
the backward runs between a collective's launch and its wait (``python -m fdp.bench overlap``).

``in_order``, run last, then chains the collectives (Inductor's ``control_deps``), so that
Inductor's own reordering cannot issue them in another order on a rank whose graph differs;
and it holds each collective's overlap: the first matrix product (or convolution) after a
collective in the graph runs after its launch, and its wait after the last one before it (as
Inductor's own overlap scheduler does with ``insert_overlap_deps``). Without that hold,
Inductor's ``reorder_for_peak_memory`` (on by default) waits for each collective right after
launching it, which costs the compiled step the overlap this pass made.
"""

from __future__ import annotations

from typing import Any

from .. import _internals
from .traced import NAMESPACE

__all__ = ["COLLECTIVES", "COMPUTE", "feeding_only", "in_order", "is_op", "is_scatter", "issue_early"]

COLLECTIVE_NAMESPACES = ("_c10d_functional", NAMESPACE)
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single")
# The ops that hide a collective: each is its own kernel (never fused away), so a dependency on
# it costs nothing
COMPUTE = ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward")


def is_op(node: Any, names: tuple[str, ...], namespace: str | None = None) -> bool:
    """A call of one of the ops ``names`` of ``namespace``; by default, a collective's: of
    ``_c10d_functional``, or fdp's own that stand for them on gloo (``fdp/_comm/traced.py``)."""
    schema = getattr(node.target, "_schema", None)  # (an OpOverload's)
    if node.op != "call_function" or schema is None:
        return False
    space, _, name = schema.name.partition("::")
    return name in names and (space in COLLECTIVE_NAMESPACES if namespace is None else space == namespace)


def is_scatter(node: Any) -> bool:
    """A reduce-scatter (torch's, or fdp's on gloo)."""
    return is_op(node, ("reduce_scatter_tensor",))


def _pure(node: Any) -> bool:
    """A node that may move: a call of a functional op (no mutation, no side effect)."""
    target = node.target
    if node.op != "call_function" or node.is_impure():
        return False
    schema = getattr(target, "_schema", None)
    return schema is None or not schema.is_mutable


def issue_early(graph: Any) -> None:
    """The pass (see the module docstring), on ``graph`` (a ``torch.fx.Graph``) in place."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = None  # the collective before (every rank issues the collectives in the graph's order)
    for c in [n for n in graph.nodes if is_op(n, COLLECTIVES)]:
        chain = feeding_only(c)
        outside = [i for n in chain for i in n.all_input_nodes if i not in chain]
        if last is not None:
            outside.append(last)
        last = c
        if not outside:
            continue
        anchor = max(outside, key=order.__getitem__)
        for n in sorted(chain, key=order.__getitem__, reverse=True):  # (each right after the anchor: in order)
            if order[n] > order[anchor]:
                anchor.append(n)
        order = {n: i for i, n in enumerate(graph.nodes)}
    for w in [n for n in graph.nodes if is_op(n, ("wait_tensor",))]:
        if w.users:
            first = min(w.users, key=order.__getitem__)
            if order[first] > order[w] + 1:
                first.prepend(w)
    graph.lint()


def feeding_only(collective: Any) -> set[Any]:
    """The collective and the pure nodes that feed only it (through each other)."""
    chain = {collective}
    grown = True
    while grown:
        grown = False
        for n in list(chain):
            for p in n.all_input_nodes:
                if p not in chain and _pure(p) and not is_op(p, (*COLLECTIVES, "wait_tensor")) \
                        and p.users and all(u in chain for u in p.users):
                    chain.add(p)
                    grown = True
    return chain


def in_order(graph: Any, hold: bool = True, after: dict[Any, list[Any]] | None = None) -> None:
    """Each collective of ``graph`` made to depend on the one before it (Inductor's
    ``control_deps``), so that no later reordering (Inductor's ``reorder_for_peak_memory``
    chooses among several topological orders by estimated memory, on each rank's graph)
    changes the order every rank issues them in. ``hold``: also each collective's overlap as
    the graph has it (see ``_held``). Run last: the collectives are then wrapped nodes, which
    the passes above no longer see as collectives. ``after``: more nodes to keep after others
    (node: the nodes it follows)."""
    collectives = [n for n in graph.nodes if is_op(n, COLLECTIVES)]
    deps: dict[Any, list[Any]] = {c: [before] for before, c in zip(collectives, collectives[1:])}
    if hold:
        for node, held in _held(graph, collectives).items():
            deps.setdefault(node, []).extend(held)
    for node, held in (after or {}).items():
        deps.setdefault(node, []).extend(held)
    _internals.keep_node_order(graph, deps)


def _held(graph: Any, collectives: list[Any]) -> dict[Any, list[Any]]:
    """For each collective with compute (``COMPUTE``) between its launch and its wait in the
    graph's order: the first of those after the launch, and the wait after the last of them."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    after: dict[Any, list[Any]] = {}
    for c in collectives:
        waits = [u for u in c.users if is_op(u, ("wait_tensor",))]
        if len(waits) != 1:
            continue
        hiding = [n for n in nodes[order[c] + 1:order[waits[0]]] if is_op(n, COMPUTE, "aten")]
        if hiding:
            after.setdefault(hiding[0], []).append(c)
            after.setdefault(waits[0], []).append(hiding[-1])
    return after
