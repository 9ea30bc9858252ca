"""``fdp.deferred_init``: a model built on the meta device, initialised module by module when a
step asks for its leaves, the same at any world size.

FSDP2's recipe builds the model under ``torch.device("meta")``, shards it, then calls
``to_empty`` and each module's ``reset_parameters()`` on the shards. fdp does it the other way
round, so no rank ever holds the whole model and the result does not depend on how it is
cut: when a fully sharded step cuts a unit (``step.shard(init)``), every rank makes that
unit's modules' tensors whole on its device, runs their init (the module's own
``reset_parameters()``, or the ``init`` given), keeps its slice and drops the rest; the next
unit reuses the memory. Each module's init runs under its own seed, drawn from ``seed`` and
the module's name, so a module's values do not depend on the world size, the units, which
other modules were made first, or the step kind: ``init.materialize(tree)`` (whole leaves,
for an unsharded step or ``shard=True``) gives the same numbers.

Every tensor is made filled with NaN (integers: their least value) before its module's init
runs, and checked after: a parameter or buffer its module's init does not write is an
error naming it, never uninitialised memory trained on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import _internals
from .._functional import clean_name
from .trees import name_of, whole_tree

__all__ = ["DeferredInit", "deferred_init"]

NAME = "fdp.deferred_init"


def module_seed(seed: int, name: str) -> int:
    """The seed of module ``name``'s init: a hash of (``seed``, ``name``), the same on every
    rank, world size and process."""
    digest = hashlib.blake2b(f"{int(seed)}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _fill_unwritten(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


def _unwritten(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():  # (a NaN anywhere makes the sum NaN: no tensor-sized temporary)
        return bool(torch.isnan(t.sum()))
    if t.dtype == torch.bool:
        return False
    return bool((t == torch.iinfo(t.dtype).min).any())


class DeferredInit:
    """The values of a model built on the meta device, made module by module on request
    (``fdp.deferred_init``). Pass it to a fully sharded step's ``step.shard(init)``, or read
    whole trees with ``materialize``.

    Attributes:
      module: the model (its own tensors stay on meta).
      seed: the seed every module's init is drawn from.
    """

    def __init__(self, module: nn.Module, *, seed: int = 0, init: Callable[[nn.Module], Any] | None = None) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"{NAME}: expects an nn.Module, got {type(module).__name__}")
        if init is not None and not callable(init):
            raise TypeError(f"{NAME}: init must be a callable of a module, got {init!r}")
        inner = _internals.compiled_inner(module)
        self.module = module if inner is None else inner
        self.seed, self.init = int(seed), init
        # Each tensor under its first clean name (the key functionalize gives it), with the
        # module that holds it directly (a tied tensor: the module of its first name).
        self._owner: dict[str, tuple[str, nn.Module, str]] = {}
        seen: set[int] = set()
        for raw, m in self.module.named_modules():
            name = clean_name(raw)
            for attr, t in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)):
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                self._owner[f"{name}.{attr}" if name else attr] = (name, m, attr)

    # ------------------------------------------------------------------ reading (ParamSource)
    def read(self, leaves: Sequence[tuple[Any, tuple[int, ...], torch.dtype]], ranges: Sequence[tuple[int, int]],
             device: torch.device) -> list[torch.Tensor]:
        """The whole tensors of ``leaves`` (key, shape, dtype) on ``device``: each module holding
        one is made and initialised once for this call."""
        wanted: dict[int, tuple[str, nn.Module, list[tuple[int, str]]]] = {}
        for j, (key, shape, dtype) in enumerate(leaves):
            name = name_of(key)
            if name not in self._owner:
                raise KeyError(f"{NAME}: {name!r} is not a parameter or buffer of {type(self.module).__name__} "
                               f"(the params' keys must be the module's names, as fdp.functionalize gives them)")
            mname, m, attr = self._owner[name]
            meta = getattr(m, attr)
            if tuple(meta.shape) != tuple(shape) or meta.dtype != dtype:
                raise ValueError(f"{NAME}: {name!r} is {tuple(meta.shape)} {meta.dtype} in the module, the step "
                                 f"expects {tuple(shape)} {dtype}")
            wanted.setdefault(id(m), (mname, m, []))[2].append((j, attr))
        out: list[Any] = [None] * len(leaves)
        for mname, m, picks in wanted.values():
            made = self._make(mname, m, torch.device(device))
            for j, attr in picks:
                out[j] = made[attr]
        return out

    def materialize(self, tree: Any, device: torch.device | str | None = None) -> Any:
        """``tree``'s leaves (params, buffers or ``apply.constants`` from ``fdp.functionalize``
        of the meta model) made whole on ``device`` (default: the current CUDA device, else the
        CPU), each by its module's init: the same numbers ``step.shard(init)`` cuts."""
        return whole_tree(self, tree, device, NAME)

    # ------------------------------------------------------------------ one module
    def _make(self, name: str, m: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
        """Module ``m``'s own parameters and buffers made on ``device`` and initialised under
        its seed; the module keeps its meta tensors."""
        params = dict(m.named_parameters(recurse=False))
        buffers = {k: b for k, b in m.named_buffers(recurse=False) if b is not None}
        saved = {**params, **buffers}
        try:
            with torch.no_grad():
                for attr, p in params.items():
                    fresh = torch.empty(p.shape, dtype=p.dtype, device=device)
                    _fill_unwritten(fresh)
                    setattr(m, attr, nn.Parameter(fresh, requires_grad=p.requires_grad))
                for attr, b in buffers.items():
                    fresh = torch.empty(b.shape, dtype=b.dtype, device=device)
                    _fill_unwritten(fresh)
                    setattr(m, attr, fresh)
            devices = [device] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                torch.manual_seed(module_seed(self.seed, name))
                if self.init is not None:
                    self.init(m)
                elif callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
                else:
                    raise TypeError(
                        f"{NAME}: module {name or '(the root)'!r} ({type(m).__name__}) holds "
                        f"{sorted(saved)} but has no reset_parameters(); pass init=fn, called with each module "
                        "that holds parameters or buffers (a HF model: init=model._init_weights)")
            made = {attr: getattr(m, attr).detach() for attr in saved}
        finally:
            for attr, t in saved.items():
                setattr(m, attr, t)
        for attr, t in made.items():
            if _unwritten(t):
                key = f"{name}.{attr}" if name else attr
                what = "init" if self.init is not None else "reset_parameters()"
                raise ValueError(f"{NAME}: {key!r} ({type(m).__name__}) was not written by its module's {what}; "
                                 "make the init write every parameter and buffer of the module it is given")
        return made

    def __repr__(self) -> str:
        return f"fdp.DeferredInit({type(self.module).__name__}, {len(self._owner)} tensors, seed={self.seed})"


def deferred_init(module: nn.Module, *, seed: int = 0, init: Callable[[nn.Module], Any] | None = None) -> DeferredInit:
    """The values of a model built on the meta device, made module by module when asked: no
    rank ever holds the whole model.

    Build the model under ``torch.device("meta")``, functionalize it and make the step as
    usual (a Reducer lays meta params out on its group's device), then::

        init = fdp.deferred_init(model, seed=0)
        params = step.shard(init)                        # shard="params": unit by unit
        buffers = init.materialize(buffers)
        apply = apply.with_constants(init.materialize(apply.constants))

    ``init.materialize(params)`` gives whole leaves instead (the unsharded step, ``shard=True``).

    Each module that holds parameters or buffers of its own is made on the device, filled
    with NaN, and initialised by ``init(module)`` if given, else by its
    ``reset_parameters()``, under a seed drawn from ``seed`` and the module's name (with
    ``torch.manual_seed``, in a forked RNG state: the caller's RNG is untouched). So the
    same ``seed`` gives the same model at any world size, with any units, in every step
    kind. A module's init sees only that module's own tensors made (its children stay on
    meta), as with FSDP2's ``reset_parameters()`` recipe.

    Args:
      module: the model, built on the meta device (or anywhere: its tensors are not read).
      seed: the seed every module's is drawn from.
      init: ``fn(module)``, called with each module that holds tensors (in place of its
        ``reset_parameters()``); a HF model's ``model._init_weights`` is one.

    Raises:
      TypeError: a module holding tensors has no ``reset_parameters()`` and no ``init`` is
        given (raised when its tensors are first asked for, naming it).
      ValueError: a module's init leaves one of its tensors unwritten (names it).

    Example:
      >>> with torch.device("meta"):
      ...     net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
      >>> apply, params, _ = fdp.functionalize(net)
      >>> whole = fdp.deferred_init(net, seed=0).materialize(params, device="cpu")
      >>> whole["0.weight"].device, bool(whole["0.weight"].isnan().any())
      (device(type='cpu'), False)
    """
    return DeferredInit(module, seed=seed, init=init)
