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
  bucket (not the root's, which the eager step keeps gathered too, nor the forward's last
  unit's, whose backward comes next: kept gathered, it saves a gather and holds nothing longer
  that matters, as FSDP2 users set ``reshard_after_forward=False`` on the last block) used
  both before and after the forward's end (the last param gather's first use), the uses after
  it read a second all-gather of the same slice (a copy of the gather's nodes and of the views
  they go through), issued right before the backward's first use of the unit before it in
  backward order (or at the forward's end for the first; with ``prefetch`` off, right before
  its own first use: where Inductor waits for each collective right after launching it anyway,
  a second gather issued early only holds its buffer longer) and waited right before its first
  use, so the forward's gathered buffer dies with its last forward use (a recomputation inside
  the backward, activation checkpointing, reads the second gather too);
* **gradients**: each reduce-scatter's wait goes no later than the next reduce-scatter's
  issue, so one flat gradient bucket is in flight at a time (its input is held until its wait);
  a bucket's fill (the nodes that feed only its reduce-scatter) runs after its unit's second
  gather (Inductor writes the fill's parts straight into the flat bucket, allocated at the first
  write, and would compute a bias's gradient, a sum of the residual stream's, one unit early:
  a third bucket alive), kept there by Inductor's ``control_deps`` (``schedule.in_order``);
* **updates**: each bucket's update right after its reduce-scatter's wait, as early as what it
  reads allows, so its reduced slice dies before the next reduce-scatter is issued (as traced,
  every update follows the last reduce-scatter and every reduced slice lives until then).

On the bench's GPT (``python -m fdp.bench sharded --tensors``) the step then holds at most two
units gathered and two flat gradient buckets at once, and its peak of live tensors is the eager
step's (which keeps one flat bucket and one staging slice for good instead).

The numbers do not change: a second all-gather of the same slice gives the same bits, nothing
else is added, and the nodes that move compute what they did. Every rank runs the same
forward and backward, so every rank issues the param gathers, the second gathers and the
reduce-scatters in the same order (the graphs may differ per rank only in the update, Muon's
owners, after all of these).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from .schedule import COLLECTIVES, feeding_only, is_op, is_scatter

__all__ = ["reshard_after_forward"]


def reshard_after_forward(graph: Any, roots: Sequence[bool], regather: bool = True, prefetch: bool = True
                          ) -> dict[Any, list[Any]]:
    """The pass (see the module docstring), on ``graph`` (a ``torch.fx.Graph``) in place.
    ``roots``: per bucket (in the order the step gathers them), whether it is the root's (kept
    gathered for the whole step). ``prefetch``: issue each second gather one unit ahead of
    its use (else right before it). A graph whose param gathers are not one per bucket is
    left as it is."""
    gathers = [n for n in graph.nodes if is_op(n, ("all_gather_into_tensor",))]
    params: list[_Gathered] = []
    if gathers and len(gathers) == len(roots) and all(_reads_inputs_only(g) for g in gathers):
        params = [_Gathered(g, root) for g, root in zip(gathers, roots)]
        _place_gathers(graph, params, regather, prefetch)
    _bound_reduce_scatters(graph)
    _updates_early(graph)
    after = _fills_after_regathers(graph, params)
    graph.lint()
    return after


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
        units = [p for p in forward if not p.root]
        # (the forward's last unit stays gathered into its backward, which comes next: FSDP2 users'
        # reshard_after_forward=False on the last block)
        again = [p for p in units[:-1] if any(order[u] > order[end] for u in p.users)]
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
        self.again: Any = None  # the second gather's (waited) result, once made

    def sink_views(self, graph: Any) -> None:
        """Each view right before its first user (so the gather may move down to its use)."""
        order = _Positions(graph)
        for v in sorted(self.views, key=order.__getitem__, reverse=True):
            if v.users:
                first = min(v.users, key=order.__getitem__)
                first.prepend(v)
                order.moved(v)

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
        self.again = copies[gathered]

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
    order = _Positions(graph)
    for n, after in zip(scatters, scatters[1:]):
        waits = _waits(n)
        if waits and order[waits[0]] > order[after]:
            for w in waits:
                after.prepend(w)
                order.moved(w)


def _updates_early(graph: Any) -> None:
    """Each node computed from a reduce-scatter's result (the update) moved up to right after
    the last node it reads, in graph order; a write into an input (the optimizer's state, the
    donated slices) also after every other reader of that input (or of a view of it).
    Collectives and their waits stay where they are. As traced, every bucket's update follows
    the last reduce-scatter, so every bucket's reduced slice stays alive until then; the eager
    step updates each bucket from the backward's hooks as soon as its slice is reduced."""
    waits = [w for n in graph.nodes if is_scatter(n) for w in _waits(n)[-1:]]
    if not waits:
        return
    down = set(waits)
    order = _Positions(graph)
    for n in list(graph.nodes):
        if n in down or order[n] < order[waits[0]]:
            continue
        if any(a in down for a in n.all_input_nodes):
            down.add(n)
    for n in [n for n in graph.nodes if n in down]:
        if n.op != "call_function" or is_op(n, (*COLLECTIVES, "wait_tensor")):
            continue
        deps = list(n.all_input_nodes)
        if _mutates(n) and n.args and hasattr(n.args[0], "users"):  # (after every reader of what it writes)
            target = n.args[0]
            deps += [u for v in (target, *_views(target, order)) for u in v.users if u is not n]
        if not deps:
            continue
        anchor = max(deps, key=order.__getitem__)
        if order[anchor] < order[n] and anchor.next is not n:
            anchor.append(n)
            order.moved(n)


def _fills_after_regathers(graph: Any, params: list[_Gathered]) -> dict[Any, list[Any]]:
    """A bucket's gradient fill (the nodes that feed only its reduce-scatter) after its unit's
    second gather: Inductor writes the fill's parts straight into the flat bucket, which it
    allocates at the first write, and a part computed early (a bias's gradient, a sum of the
    residual stream's, is ready one unit ahead) would hold a third flat bucket beside the one
    in flight and the one being filled. Moved in the graph, and returned as the nodes each
    must follow (Inductor fuses across the graph's order: see ``in_order``)."""
    scatters = [n for n in graph.nodes if is_scatter(n)]
    if len(scatters) != len(params):
        return {}
    after: dict[Any, list[Any]] = {}
    order = _Positions(graph)
    for p, scatter in zip(params, scatters):
        if p.again is None:
            continue
        chain = feeding_only(scatter) - {scatter}
        ready: dict[Any, int] = {}  # how early each could run: after what it reads outside the chain
        for n in sorted(chain, key=order.__getitem__):
            ready[n] = max((ready[a] if a in chain else order[a] for a in n.all_input_nodes), default=-1)
        early = [n for n in sorted(chain, key=order.__getitem__) if order[n] < order[p.again]]
        anchor = p.again
        for n in early:
            anchor.append(n)
            order.moved(n)
            anchor = n
        for n in chain:
            if ready[n] < order[p.again] and not _is_view(n):
                after[n] = [p.again]
    return after


def _mutates(node: Any) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


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


def _views(base: Any, order: Any = None) -> list[Any]:
    """The nodes that only look at ``base``'s memory (views of it, of them, ...), in graph order
    (``order``: the graph's, if the caller keeps one)."""
    out, todo = [], [base]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in out and _is_view(u):
                out.append(u)
                todo.append(u)
    if order is None:
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


class _Positions:
    """Each node's place in ``graph``, kept as the pass moves nodes one at a time: a moved node
    is numbered between its new neighbours (the graph is numbered with gaps, and numbered
    again only when a gap is used up), so a pass that moves every node of the update does
    not count the whole graph again after each move (quadratic in the graph's size)."""

    GAP = 1 << 16

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self._number()

    def _number(self) -> None:
        self.at = {n: i * self.GAP for i, n in enumerate(self.graph.nodes)}
        self.end = len(self.at) * self.GAP

    def __getitem__(self, node: Any) -> int:
        return self.at[node]

    def moved(self, node: Any) -> None:
        """``node`` was just moved (or inserted) in the graph."""
        lo = self.at.get(node.prev, -self.GAP)  # (the graph's root, before the first node and after the last, has no place)
        hi = self.at.get(node.next, self.end)
        if node.next not in self.at and lo >= self.end - 1:
            self.end += self.GAP
            hi = self.end
        if hi - lo < 2:
            self._number()
        else:
            self.at[node] = (lo + hi) // 2


def _order_of(node: Any) -> dict:
    return _order(node.graph)
