"""The seams a value crosses between fdp's rooms without the room that made it being imported:
``typing.Protocol``s, checked with ``isinstance`` where a value of any type may come.

* ``GathersUnits``: params whose units are gathered on demand (``fdp.ShardedParams``, and the
  ``Gathering`` a fully sharded step hands the loss). ``fdp.Apply`` runs the forward unit by
  unit through their ``units_view()``, a ``UnitsView``.
* ``HasTemplate``: params that are not a tree of whole tensors (``fdp.ShardedParams``) give
  the tree of their leaves' shapes and dtypes that masks and ``opt.init`` read.
* ``ParamSource``: params read a few leaves at a time (a deferred init, a safetensors
  checkpoint): a fully sharded step cuts them unit by unit, so no rank holds the whole model.
* ``FlatOptState``: an optimizer state kept flat per bucket (``FusedState``), which
  ``fdp.optim.inspect`` reads without ``fdp.optim`` importing the fused step.
* ``Unsaveable``, ``PerRank``, ``ChecksLoad``: what a state tells ``fdp.save``/``fdp.load``
  about itself (a sharded ``FusedState`` is one rank's slices; an ``RngState`` holds a row
  per rank; a ``FusedState`` knows the layout it fits).

Literals name the small closed sets some APIs take: ``Reach`` (where a gradient transform
can run), ``StepKind`` (a step record's kind), ``Engine`` (how local gradients are computed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import torch

Reach = Literal["element", "leaf", "tree"]
StepKind = Literal["grad", "all_reduce", "accumulate"]
Engine = Literal["autograd", "functorch"]


class UnitsView(Protocol):
    """What ``fdp.Apply`` needs to run a forward unit by unit: per leaf its key, real tensor
    and placeholder and its unit, per unit its module name, and the calls around a unit's
    forward (``fdp._units.units.UnitsView`` is the one implementation)."""

    keys: Sequence[Any]
    tensors: Sequence[torch.Tensor]
    placeholders: Sequence[torch.Tensor]
    unit_of: Sequence[int]
    names: Sequence[str]
    root: int | None
    layout: object

    def enter(self, u: int) -> None: ...

    def exit(self, u: int, output: Any) -> None: ...

    def gathered(self, u: int) -> bool: ...

    def recomputing(self) -> None: ...

    def done(self) -> None: ...


@runtime_checkable
class GathersUnits(Protocol):
    """Params gathered unit by unit (see the module docstring)."""

    def units_view(self) -> UnitsView: ...


@runtime_checkable
class HasTemplate(Protocol):
    """Params that give the tree of their leaves' shapes and dtypes (tensors that hold no data)."""

    def template(self) -> Any: ...


@runtime_checkable
class ParamSource(Protocol):
    """Where params come from without a whole tree on any rank (``fdp.deferred_init``,
    ``fdp.safetensors_params``): asked for some leaves at a time, it makes each (by key, with
    the shape and dtype the step expects, on ``device``) as a whole tensor or as an
    ``fdp.Shard`` holding at least the element range asked for (``(a, z)`` of the leaf's
    flattening), and nothing else."""

    def read(self, leaves: Sequence[tuple[Any, tuple[int, ...], torch.dtype]],
             ranges: Sequence[tuple[int, int]], device: torch.device) -> list[Any]: ...


@runtime_checkable
class Unsaveable(Protocol):
    """A state that may not be written by ``fdp.save`` as it is: the reason, or None."""

    def unsaveable_reason(self) -> str | None: ...


@runtime_checkable
class PerRank(Protocol):
    """A state whose leaves hold a row per rank (tied to the world size of the run that saved it)."""

    def per_rank(self) -> bool: ...


@runtime_checkable
class ChecksLoad(Protocol):
    """A state that says whether a loaded one fits where ``like`` stood: the reason, or None."""

    def check_load(self, like: Any) -> str | None: ...


@runtime_checkable
class FlatOptState(Protocol):
    """An optimizer state kept flat per bucket (the fused step's ``FusedState``): its count,
    its chain's transforms' states, and an injected optimizer's values (None: none)."""

    step: torch.Tensor
    buffers: dict
    transforms: tuple
    hyperparams: dict | None


def template_of(params: Any) -> Any:
    """``params``, or the template of params that give one (``HasTemplate``)."""
    return params.template() if type(params) is not dict and isinstance(params, HasTemplate) else params


def units_of(params: Any) -> UnitsView | None:
    """The units view of params gathered unit by unit, else None (a dict: at once)."""
    if type(params) is dict or not isinstance(params, GathersUnits):
        return None
    return params.units_view()


__all__ = ["ChecksLoad", "Engine", "FlatOptState", "GathersUnits", "HasTemplate", "ParamSource", "PerRank", "Reach", "StepKind", "Unsaveable",
           "UnitsView", "template_of", "units_of"]
