"""Learning-rate (and weight-decay) schedules: functions of the number of updates applied.

A schedule is called with the step count ``t`` (0 for the first update, as ``LambdaLR``
sees it). Called with a Python int it returns a float. ``step_decay`` computes StepLR's
running product (the previous lr times gamma), so it equals ``scheduler.get_last_lr()``
after ``t`` calls of ``scheduler.step()`` bit for bit. ``linear`` and ``cosine`` use the
expression of torch's closed form (``_get_closed_form_lr`` in
``torch/optim/lr_scheduler.py``), which equals it bit for bit and equals the same formula
written as a ``LambdaLR`` multiplier; torch's ``LinearLR`` and ``CosineAnnealingLR`` step in
their chainable form (the previous lr times a ratio), whose values differ from the closed
form in the last bits (within 1e-12 relative). ``LambdaLR`` has no recursion and is matched
bit for bit.

Called with a tensor (the optimizer's step counter, under ``torch.compile``), a schedule
returns a float64 tensor computed by the same formula in torch ops: the step is a graph
input, so a compiled train step runs every step without recompiling. A user's own schedule
(any ``lambda t: ...`` made of arithmetic) works the same way.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["Schedule", "constant", "cosine", "join", "linear", "step_decay", "warmup_cosine"]


class Schedule(abc.ABC):
    """Base of fdp's schedules: ``schedule(t)`` for an int ``t`` (float) or a tensor ``t``
    (float64 tensor). Subclasses implement ``host`` and ``traced``."""

    def __call__(self, t: int | Tensor) -> float | Tensor:
        if isinstance(t, Tensor):
            return self.traced(t.to(torch.float64))
        t = int(t)
        if t < 0:
            raise ValueError(f"fdp.optim.schedules: {self!r} was called with step {t}; a schedule's "
                             "step is the number of updates already applied (0 for the first), >= 0")
        return self.host(t)

    @abc.abstractmethod
    def host(self, t: int) -> float:
        """The value at step ``t`` on the host (eager)."""

    @abc.abstractmethod
    def traced(self, t: Tensor) -> Tensor:
        """The value at step ``t`` as tensor math (under ``torch.compile``)."""


class _Constant(Schedule):
    def __init__(self, value: float) -> None:
        self.value = float(value)

    def host(self, t: int) -> float:
        return self.value

    def traced(self, t: Tensor) -> Tensor:
        return torch.full_like(t, self.value)

    def __repr__(self) -> str:
        return f"constant({self.value})"


class _Linear(Schedule):
    def __init__(self, value: float, start_factor: float, end_factor: float, steps: int) -> None:
        if steps <= 0:
            raise ValueError(f"fdp.optim.schedules.linear: steps must be > 0, got {steps}")
        self.value, self.start, self.end, self.steps = float(value), start_factor, end_factor, steps

    def host(self, t: int) -> float:
        # torch's LinearLR closed form: base_lr * (start + (end - start) * min(total, t) / total)
        return self.value * (self.start + (self.end - self.start) * min(self.steps, t) / self.steps)

    def traced(self, t: Tensor) -> Tensor:
        return self.value * (self.start + (self.end - self.start) * t.clamp(max=self.steps) / self.steps)

    def __repr__(self) -> str:
        return f"linear({self.value}, {self.start}, {self.end}, {self.steps})"


class _Cosine(Schedule):
    def __init__(self, value: float, steps: int, final: float) -> None:
        if steps <= 0:
            raise ValueError(f"fdp.optim.schedules.cosine: steps must be > 0, got {steps}")
        self.value, self.steps, self.final = float(value), steps, float(final)

    def host(self, t: int) -> float:
        # torch's CosineAnnealingLR closed form, held at `final` after `steps` (torch's
        # scheduler climbs back up after T_max; optax's cosine_decay_schedule holds).
        t = min(t, self.steps)
        return self.final + (self.value - self.final) * (1 + math.cos(math.pi * t / self.steps)) / 2

    def traced(self, t: Tensor) -> Tensor:
        t = t.clamp(max=self.steps)
        return self.final + (self.value - self.final) * (1 + torch.cos(math.pi * t / self.steps)) / 2

    def __repr__(self) -> str:
        return f"cosine({self.value}, {self.steps}, final={self.final})"


class _StepDecay(Schedule):
    """``StepLR``'s values: the lr after ``k`` decays is ``((value * gamma) * gamma) ...``, the
    running product torch's chainable form computes (``gamma ** k`` rounds differently when
    gamma is not a power of two). Memoised: the last value, and every ``EVERY``-th, so steps
    in order cost O(1) each and any step at most ``EVERY`` multiplications."""

    EVERY = 1024
    TABLE = 4096  # decays the traced form holds exactly (past them: the closed form)

    def __init__(self, value: float, step_size: int, gamma: float) -> None:
        if step_size <= 0:
            raise ValueError(f"fdp.optim.schedules.step_decay: step_size must be > 0, got {step_size}")
        self.value, self.step_size, self.gamma = float(value), step_size, float(gamma)
        self._marks = {0: self.value}     # i -> the value after EVERY * i decays (setdefault: idempotent)
        self._last = (0, self.value)      # (decays, value): one tuple, swapped whole
        # made now, not when first traced: a compiled step then never sees it change
        self._table = torch.tensor([self.decayed(k) for k in range(self.TABLE)], dtype=torch.float64)

    def decayed(self, k: int) -> float:
        """The value after ``k`` decays, as StepLR's running product."""
        done, v = self._last
        if k < done:
            i = k // self.EVERY
            while i not in self._marks:  # (marks stop where the value stopped changing)
                i -= 1
            done, v = i * self.EVERY, self._marks[i]
        while done < k:
            nxt = v * self.gamma
            if nxt == v:  # 0, inf, gamma 1: it stays there
                break
            v, done = nxt, done + 1
            if done % self.EVERY == 0:
                self._marks.setdefault(done // self.EVERY, v)
        self._last = (k, v)
        return v

    def host(self, t: int) -> float:
        return self.decayed(t // self.step_size)

    def traced(self, t: Tensor) -> Tensor:
        # The running product of the first TABLE decays as a constant of the graph, indexed by
        # the step; past it (a schedule still changing after 4096 decays) the closed form.
        table = self._table.to(t.device)
        k = torch.div(t, self.step_size, rounding_mode="floor")
        exact = table.gather(0, k.clamp(0, self.TABLE - 1).long().reshape(1)).reshape(k.shape)
        past = table[-1] * torch.pow(self.gamma, k - (self.TABLE - 1))
        return torch.where(k < self.TABLE, exact, past)

    def __repr__(self) -> str:
        return f"step_decay({self.value}, {self.step_size}, {self.gamma})"


class _Join(Schedule):
    def __init__(self, schedules: Sequence[Schedule], boundaries: Sequence[int]) -> None:
        if len(boundaries) != len(schedules) - 1:
            raise ValueError(f"fdp.optim.schedules.join: {len(schedules)} schedules need "
                             f"{len(schedules) - 1} boundaries, got {len(boundaries)}")
        if list(boundaries) != sorted(boundaries) or any(b < 0 for b in boundaries):
            raise ValueError(f"fdp.optim.schedules.join: boundaries must be increasing and "
                             f">= 0, got {list(boundaries)}")
        self.schedules, self.boundaries = list(schedules), [0, *boundaries]

    def host(self, t: int) -> float:
        for schedule, start in zip(reversed(self.schedules), reversed(self.boundaries)):
            if t >= start:
                return float(schedule(t - start))
        raise AssertionError("unreachable: the first boundary is 0")  # pragma: no cover

    def traced(self, t: Tensor) -> Tensor:
        out = torch.as_tensor(self.schedules[0](t), dtype=torch.float64)
        for schedule, start in zip(self.schedules[1:], self.boundaries[1:]):
            later = torch.as_tensor(schedule(t - start), dtype=torch.float64)
            out = torch.where(t >= start, later, out)
        return out

    def __repr__(self) -> str:
        return f"join({self.schedules}, {self.boundaries[1:]})"


def constant(value: float) -> Schedule:
    """The same value at every step (``torch.optim``'s default: no scheduler).

    Args:
      value: the learning rate (or weight decay).

    Returns:
      A ``Schedule``.

    Example:
      >>> fdp.optim.schedules.constant(0.1)(7)
      0.1
    """
    return _Constant(value)


def linear(value: float, start_factor: float, end_factor: float = 1.0, steps: int = 5) -> Schedule:
    """``value`` times a factor going linearly from ``start_factor`` to ``end_factor`` over
    ``steps`` updates, then held: ``torch.optim.lr_scheduler.LinearLR`` (a linear warm-up with
    the defaults ``end_factor=1``).

    Args:
      value: the base learning rate (torch's ``lr`` of the optimizer).
      start_factor, end_factor, steps: as ``LinearLR``'s ``start_factor``, ``end_factor``,
        ``total_iters``.

    Returns:
      A ``Schedule``.

    Example:
      >>> warmup = fdp.optim.schedules.linear(1.0, start_factor=0.25, steps=3)
      >>> [warmup(t) for t in range(5)]
      [0.25, 0.5, 0.75, 1.0, 1.0]
    """
    return _Linear(value, start_factor, end_factor, steps)


def cosine(value: float, steps: int, final: float = 0.0) -> Schedule:
    """Cosine decay from ``value`` to ``final`` over ``steps`` updates, then held:
    ``CosineAnnealingLR(T_max=steps, eta_min=final)`` up to ``T_max``.

    Args:
      value: the starting (base) learning rate.
      steps: the decay length (torch's ``T_max``).
      final: the value reached at ``steps`` (torch's ``eta_min``).

    Returns:
      A ``Schedule``.

    Example:
      >>> [round(fdp.optim.schedules.cosine(1.0, 4)(t), 4) for t in range(6)]
      [1.0, 0.8536, 0.5, 0.1464, 0.0, 0.0]
    """
    return _Cosine(value, steps, final)


def step_decay(value: float, step_size: int, gamma: float = 0.1) -> Schedule:
    """``value`` multiplied by ``gamma`` every ``step_size`` updates:
    ``torch.optim.lr_scheduler.StepLR``, bit for bit.

    The value after ``k = t // step_size`` decays is the running product ``value * gamma *
    gamma ...`` (k times, in Python floats), as StepLR multiplies the previous lr each
    period; the closed form ``value * gamma ** k`` differs from it in the last bit when
    ``gamma`` is not a power of two. Memoised: a step costs O(1) in order. Under
    ``torch.compile`` (a tensor step) the first 4,096 decays are the same values; after
    4,096 decays (and only if the value still changes then) the closed form continues.

    Args:
      value: the starting (base) learning rate.
      step_size, gamma: as ``StepLR``'s.

    Returns:
      A ``Schedule``.

    Example:
      >>> [fdp.optim.schedules.step_decay(1.0, 2, 0.5)(t) for t in range(5)]
      [1.0, 1.0, 0.5, 0.5, 0.25]
    """
    return _StepDecay(value, step_size, gamma)


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Schedules one after another: from ``boundaries[i - 1]`` on, schedule ``i`` is called
    with ``t - boundaries[i - 1]`` (``SequentialLR(milestones=boundaries)``,
    ``optax.join_schedules``).

    Args:
      schedules: n schedules (fdp's or any callable of the step).
      boundaries: n - 1 increasing steps at which the next schedule starts.

    Returns:
      A ``Schedule``.

    Example:
      >>> s = fdp.optim.schedules
      >>> sched = s.join([s.constant(0.1), s.step_decay(1.0, 1, 0.5)], [2])
      >>> [sched(t) for t in range(5)]
      [0.1, 0.1, 1.0, 0.5, 0.25]
    """
    return _Join(schedules, boundaries)


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int, *, final: float = 0.0,
                  start_factor: float = 0.0) -> Schedule:
    """Linear warm-up to ``peak`` over ``warmup_steps``, then cosine decay to ``final`` at
    ``total_steps`` (nanoGPT's and most transformer recipes' schedule).

    It is ``join([linear(peak, start_factor, 1, warmup_steps), cosine(peak, total_steps -
    warmup_steps, final)], [warmup_steps])``: torch's ``SequentialLR(LinearLR,
    CosineAnnealingLR)``. With ``final=0`` it also equals, bit for bit, ``LambdaLR`` with the
    multiplier ``start + (1 - start) * t / w`` then ``(1 + cos(pi * (t - w) / (T - w))) / 2``.

    Args:
      peak: the learning rate at the end of the warm-up.
      warmup_steps: length of the warm-up (> 0).
      total_steps: the step at which ``final`` is reached (> warmup_steps).
      final: the value after the decay.
      start_factor: the first step's lr as a fraction of ``peak`` (optax's
        ``warmup_cosine_decay_schedule`` starts at ``init_value``, 0 by default).

    Returns:
      A ``Schedule``.

    Example:
      >>> sched = fdp.optim.schedules.warmup_cosine(1.0, warmup_steps=2, total_steps=4)
      >>> [sched(t) for t in range(5)]
      [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    if not 0 < warmup_steps < total_steps:
        raise ValueError(f"fdp.optim.schedules.warmup_cosine: need 0 < warmup_steps < total_steps, "
                         f"got {warmup_steps} and {total_steps}")
    return _Join([_Linear(peak, start_factor, 1.0, warmup_steps),
                  _Cosine(peak, total_steps - warmup_steps, final)], [warmup_steps])
