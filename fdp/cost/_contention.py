"""Contention: what the collectives on the wire take from a backward that shares their cores.

On a machine whose transport runs on the same cores as the backward (gloo on CPU), a
collective issued during the backward slows it down. A collective on the wire is a ``span``:
``(start, seconds, backward lost, bytes)``, the backward losing ``contention`` seconds per
byte, at most the collective's whole time. ``lost`` is what the spans took by a wall time,
``reached`` its inverse: when a backward that loses that much has done its own work.
``StepProfile.with_contention`` measures ``contention``; ``predict`` applies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._step.record import Timeline


def span(start: float, seconds: float, nbytes: int, contention: float) -> tuple[float, float, float, int]:
    """A collective on the wire: ``(start, seconds, backward lost, bytes)``, the backward
    losing ``contention`` per byte (at most the collective's whole time)."""
    return start, seconds, min(contention * nbytes, seconds), nbytes


def on_the_wire(tl: Timeline, contention: float) -> list[tuple[float, float, float, int]]:
    """A measured step's collectives as ``span``s: each starts on the wire when issued and the
    one before it is done (they go one at a time)."""
    out, free = [], 0.0
    for bt in tl.buckets:
        if bt.launch is None or bt.done is None:
            continue
        start = max(bt.launch, free)
        free = max(start, bt.done)
        out.append(span(start, free - start, bt.nbytes, contention))
    return out


def share(start: float, seconds: float, t: float) -> float:
    """The fraction of a collective over ``[start, start + seconds]`` done by ``t``."""
    if t <= start:
        return 0.0
    return 1.0 if seconds <= 0 or t >= start + seconds else (t - start) / seconds


def lost(wire: Sequence[tuple[float, float, float, Any]], t: float) -> float:
    """Backward time the collectives of ``wire`` took by wall time ``t``."""
    return sum(stolen * share(s, d, t) for s, d, stolen, _ in wire)


def reached(wire: Sequence[tuple[float, float, float, Any]], f: float) -> float:
    """The wall time at which a backward that loses ``lost(wire, t)`` by ``t`` has done ``f``
    seconds of its own work (``wire`` in start order, one collective at a time)."""
    behind = 0.0
    for s, d, stolen, _ in wire:
        t = f + behind
        if t <= s:
            return t
        r = stolen / d if d > 0 else 0.0
        if r < 1:  # inside: t - behind - r (t - s) = f
            t = (f + behind - r * s) / (1 - r)
            if t <= s + d:
                return t
        behind += stolen
    return f + behind
