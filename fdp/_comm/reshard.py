"""The memory schedule of a compiled fully sharded step (``shard="params"``): each unit's params
gathered one unit ahead of its use, gathered again for its backward, and each gradient bucket's
reduce-scatter waited before the next one is issued (an FX pass on the graph Inductor compiles,
after ``fdp/_comm/schedule.py``'s).

The traced step (``fdp/_fused/traced.py``) all-gathers every bucket's slice at the start of the
graph and differentiates the loss in the whole leaves: left as traced, every unit's params
stay gathered from the start of the forward to the end of its backward, and every gradient
bucket's flat buffer until its reduce-scatter is waited for in the update: a compiled fully
sharded step would hold about what DDP holds. The eager step (``fdp/_units/units.py``) gathers
a unit just before its forward (prefetching the next), frees it after
(``reshard_after_forward``), gathers it again when the backward reaches it, and frees each
gradient bucket once reduced. This pass makes the graph do the same:

* **forward**: the param gathers, in the order the forward first uses them; each is issued
  right before the first use of the one before it (one unit of prefetch) and waited right
  before its own first use; the views of the gathered buffer sink to their first users;
* **backward** (unless ``regather`` is off: ``reshard_after_forward=False``): for each unit
  bucket (not the root's, which the eager step keeps gathered too) used both before and after
  the forward's end (the last param gather's first use), the uses after it read a second
  all-gather of the same slice (a copy of the gather's nodes and of the views they go
  through), issued right before the backward's first use of the unit before it in backward
  order (or at the forward's end for the first; with ``prefetch`` off, right before its own
  first use: where Inductor waits for each collective right after launching it anyway, a
  second gather issued early only holds its buffer longer) and waited right before its first use, so the
  forward's gathered buffer dies with its last forward use (a recomputation inside the
  backward, activation checkpointing, reads the second gather too);
* **gradients**: each reduce-scatter's wait goes no later than the next reduce-scatter's
  issue, so one flat gradient bucket is in flight at a time (its input is held until its wait).

The numbers do not change: a second all-gather of the same slice gives the same bits, and
nothing else is added. Every rank runs the same forward and backward, so every rank issues the
param gathers, the second gathers and the reduce-scatters in the same order (the graphs may
differ per rank only in the update, Muon's owners, after all of these).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from .schedule import feeding_only, is_op, is_scatter

__all__ = ["reshard_after_forward"]


def reshard_after_forward(graph: Any, roots: Sequence[bool], regather: bool = True, prefetch: bool = True) -> None:
    """The pass (see the module docstring), on ``graph`` (a ``torch.fx.Graph``) in place.
    ``roots``: per bucket (in the order the step gathers them), whether it is the root's (kept
    gathered for the whole step). ``prefetch``: issue each second gather one unit ahead of
    its use (else right before it). A graph whose param gathers are not one per bucket is
    left as it is."""
    gathers = [n for n in graph.nodes if is_op(n, ("all_gather_into_tensor",))]
    if gathers and len(gathers) == len(roots) and all(_reads_inputs_only(g) for g in gathers):
        _place_gathers(graph, [_Gathered(g, root) for g, root in zip(gathers, roots)], regather, prefetch)
    _bound_reduce_scatters(graph)
    graph.lint()


def _place_gathers(graph: Any, params: list[_Gathered], regather: bool, prefetch: bool) -> None:
    """The forward's gathers one unit ahead, and (``regather``) the second gathers."""
    for p in params:
        p.sink_views(graph)
    order = _order(graph)
    for p in params:
        p.locate(order)
    params = [p for p in params if p.first is not None]
    if not params:
        return
    forward = sorted(params, key=lambda p: order[p.first])
    end = forward[-1].first  # the forward's end: the last param gather's first use
    if regather:
        again = [p for p in forward[:-1] if not p.root and any(order[u] > order[end] for u in p.users)]
        again.sort(key=lambda p: min(order[u] for u in p.users if order[u] > order[end]))
        issue = end
        for p in again:
            issue = p.regather(graph, order, end, issue if prefetch else None)
    # the forward's gathers, one unit ahead: each issued right before the previous one's first use
    for before, p in zip(forward, forward[1:]):
        p.place(before.first)


class _Gathered:
    """One param gather: the all-gather with its fill (the slice's cast), its waits, and the
    views of the gathered buffer (``views``) the forward and backward read."""

    def __init__(self, gather: Any, root: bool) -> None:
        self.gather, self.root = gather, root
        self.chain = feeding_only(gather)
        self.waits = _waits(gather)
        self.views = _views(self.waits[-1] if self.waits else gather)
        self.users: list[Any] = []
        self.first: Any = None

    def sink_views(self, graph: Any) -> None:
        """Each view right before its first user (so the gather may move down to its use)."""
        order = _order(graph)
        for v in sorted(self.views, key=order.__getitem__, reverse=True):
            if v.users:
                first = min(v.users, key=order.__getitem__)
                first.prepend(v)
                order = _order(graph)

    def locate(self, order: dict) -> None:
        """The nodes that compute with the gathered params (not views), and the first of them."""
        views = set(self.views)
        users = {u for v in (self.waits[-1:] or [self.gather]) + self.views for u in v.users if u not in views}
        self.users = sorted(users, key=order.__getitem__)
        self.first = self.users[0] if self.users else None

    def place(self, issue: Any) -> None:
        """The gather issued right before ``issue``, its waits right before its first view or use."""
        graph_order = _order_of(issue)
        first_read = min([*self.views, *self.users], key=graph_order.__getitem__)
        if graph_order[issue] > graph_order[first_read]:
            issue = first_read
        for n in sorted(self.chain, key=graph_order.__getitem__):
            issue.prepend(n)
        for w in self.waits:
            first_read.prepend(w)

    def regather(self, graph: Any, order: dict, end: Any, issue: Any) -> Any:
        """The uses after ``end`` read a second gather of the same slice, issued right before
        ``issue``; returns the first of those uses."""
        late = [u for u in self.users if order[u] > order[end]]
        first = late[0]
        if issue is None:
            issue = first
        copies: dict[Any, Any] = {}
        with graph.inserting_before(issue):
            for n in sorted(self.chain, key=order.__getitem__):
                copies[n] = graph.node_copy(n, lambda a: copies.get(a, a))
        with graph.inserting_before(first):
            for w in self.waits:
                copies[w] = graph.node_copy(w, lambda a: copies.get(a, a))
        gathered = self.waits[-1] if self.waits else self.gather

        def again(v: Any) -> Any:  # the view ``v`` of the second gather (made once, before ``first``)
            if v is gathered:
                return copies[v]
            if v not in copies:
                for a in v.all_input_nodes:
                    if a is gathered or a in self.views:
                        again(a)
                with graph.inserting_before(first):
                    copies[v] = graph.node_copy(v, lambda a: copies.get(a, a))
            return copies[v]

        read = {gathered, *self.views}
        for u in late:
            for a in u.all_input_nodes:
                if a in read:
                    u.replace_input_with(a, again(a))
        kept = []
        for v in sorted(self.views, key=order.__getitem__, reverse=True):  # views only the backward read
            if v.users:
                kept.append(v)
            else:
                graph.erase_node(v)
        self.views = kept[::-1]
        return first


def _bound_reduce_scatters(graph: Any) -> None:
    """Each reduce-scatter waited for no later than the next one's issue."""
    scatters = [n for n in graph.nodes if is_scatter(n)]
    for n, after in zip(scatters, scatters[1:]):
        order = _order(graph)
        waits = _waits(n)
        if waits and order[waits[0]] > order[after]:
            for w in waits:
                after.prepend(w)


def _reads_inputs_only(gather: Any) -> bool:
    """A param gather: its fill reads nothing but the graph's inputs (the slices)."""
    chain = feeding_only(gather)
    return all(a.op == "placeholder" for n in chain for a in n.all_input_nodes if a not in chain)


def _waits(collective: Any) -> list[Any]:
    """The collective's ``wait_tensor`` and any wait of that wait, in order."""
    out, n = [], collective
    while True:
        w = [u for u in n.users if is_op(u, ("wait_tensor",))]
        if len(w) != 1:
            return out
        out.append(w[0])
        n = w[0]


def _views(base: Any) -> list[Any]:
    """The nodes that only look at ``base``'s memory (views of it, of them, ...), in graph order."""
    out, todo = [], [base]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in out and _is_view(u):
                out.append(u)
                todo.append(u)
    order = _order_of(base)
    return sorted(out, key=order.__getitem__)


def _is_view(node: Any) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    return bool(getattr(node.target, "is_view", False))


def _order(graph: Any) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


def _order_of(node: Any) -> dict:
    return _order(node.graph)
