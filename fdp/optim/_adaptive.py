"""More of torch.optim's element-wise optimizers: ``nadam``, ``radam``, ``adamax``, ``adadelta``.

Each is ``build`` over the torch.optim functional kernel its class calls (``_kernels``), so
its numbers are torch.optim's bit for bit, and its ``LeafKernel`` lets the fused and sharded
steps (``reducer.grad_and_update``) run it per bucket. The state fields are torch's
per-parameter names; torch's per-parameter ``step`` is one count, as in every fdp optimizer,
and NAdam's ``mu_product`` is derived from it (``_MuProducts`` says why).
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import _kernels
from ._base import Optimizer
from ._build import Hyper, Mask, Spec, build, check_betas, check_hyper

__all__ = ["AdadeltaState", "AdamaxState", "NAdamState", "RAdamState", "adadelta", "adamax",
           "nadam", "radam"]


class NAdamState(NamedTuple):
    """State of ``nadam``: ``step`` (a float CPU scalar, torch.optim's dtype for its
    per-parameter ``step``), ``exp_avg`` and ``exp_avg_sq`` (trees like params). torch's
    ``mu_product`` is a function of ``step`` and is recomputed from it (see ``nadam``)."""

    step: Tensor
    exp_avg: Any
    exp_avg_sq: Any


class RAdamState(NamedTuple):
    """State of ``radam``: ``step``, ``exp_avg`` and ``exp_avg_sq`` (trees like params)."""

    step: Tensor
    exp_avg: Any
    exp_avg_sq: Any


class AdamaxState(NamedTuple):
    """State of ``adamax``: ``step``, ``exp_avg`` and ``exp_inf`` (trees like params)."""

    step: Tensor
    exp_avg: Any
    exp_inf: Any


class AdadeltaState(NamedTuple):
    """State of ``adadelta``: ``step``, ``square_avg`` and ``acc_delta`` (trees like params)."""

    step: Tensor
    square_avg: Any
    acc_delta: Any


def _check_decoupled(name: str, kernel: str, decoupled_weight_decay: bool) -> None:
    if decoupled_weight_decay and not _kernels.supports(kernel, "decoupled_weight_decay"):
        raise ValueError(f"{name}: decoupled_weight_decay needs a torch whose {kernel} kernel has it "
                         f"(this is torch {torch.__version__})")


class _MuProducts:
    """torch's NAdam ``mu_product`` after ``t`` updates, computed as torch computes it: a CPU
    scalar of the step count's dtype, starting at 1, multiplied in place by each update's
    ``mu = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))`` (a Python float).

    Why it is derived and not kept in the state: torch keeps a ``mu_product`` per param, but
    every param of a group has the same one (they share the step count), and it depends on
    the count alone (given ``beta1`` and ``momentum_decay``, fixed at construction). fdp's
    state is trees like params plus one count, and the fused step keeps each state field as
    one flat tensor per bucket (a bucket holds many params; a sharded step only a slice of
    one): a per-param scalar fits neither layout, and one scalar per bucket would repeat what
    the count already says (and need a layout of its own). Recomputed with torch's multiplies
    in torch's order, it is the value torch's state would hold, bit for bit, for any state:
    resumed, converted with ``step.state_to_tree``, or a fused one.

    Cost: one scalar multiply per update (the last value is kept, per dtype); a state
    resumed at step t costs at most ``EVERY`` multiplies (a value is kept every ``EVERY``).
    Thread-safe: simulated ranks are threads that may share an optimizer.
    """

    EVERY = 1024

    def __init__(self, beta1: float, momentum_decay: float) -> None:
        self.beta1, self.momentum_decay = beta1, momentum_decay
        self._lock = threading.Lock()
        self._anchors: dict[torch.dtype, list[float]] = {}   # value at 0, EVERY, 2 * EVERY, ...
        self._last: dict[torch.dtype, tuple[int, float]] = {}

    def mu(self, t: int) -> float:
        """The coefficient of update ``t`` (1 for the first), torch's expression."""
        return self.beta1 * (1.0 - 0.5 * (0.96 ** (float(t) * self.momentum_decay)))

    def at(self, t: int, dtype: torch.dtype) -> Tensor:
        """The product after ``t`` updates, as a fresh CPU scalar of ``dtype``."""
        with self._lock:
            anchors = self._anchors.setdefault(dtype, [1.0])
            k = min(t // self.EVERY, len(anchors) - 1)
            start, value = k * self.EVERY, anchors[k]
            last = self._last.get(dtype)
            if last is not None and start <= last[0] <= t:
                start, value = last
            x = torch.tensor(value, dtype=dtype)
            for i in range(start + 1, t + 1):
                x *= self.mu(i)  # torch's `mu_product *= mu`
                if i % self.EVERY == 0 and i // self.EVERY == len(anchors):
                    anchors.append(x.item())
            self._last[dtype] = (t, x.item())
            return x


def nadam(lr: Hyper = 2e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: Hyper = 0.0, momentum_decay: float = 4e-3, decoupled_weight_decay: bool = False,
          *, maximize: bool = False, mask: Mask | None = None, donate: bool = False) -> Optimizer:
    """NAdam (Adam with Nesterov momentum) with ``torch.optim.NAdam``'s arguments and numbers.

    torch keeps a ``mu_product`` per param (the product of every update's momentum
    coefficient so far); it is a function of the step count, the same for every param, so
    fdp's state does not hold it: each update recomputes it from ``state.step`` with torch's
    own multiplies (bit for bit torch's value; one multiply per update). The fused and
    sharded steps need nothing per param or per bucket beyond ``exp_avg`` and ``exp_avg_sq``.
    Not under torch.compile (the product needs the count on the host).

    Args:
      lr, weight_decay: floats or schedules of the step count.
      betas, eps, momentum_decay, maximize: as in ``torch.optim.NAdam``.
      decoupled_weight_decay: as in ``torch.optim.NAdam``: multiply the params by
        ``1 - lr * weight_decay`` (NAdamW) instead of adding the decay to the grad.
      mask: which leaves get weight decay (a tree of bools or ``(path, leaf) -> bool``).
      donate: update params and state in place and return them.

    Returns:
      An ``Optimizer`` with ``NAdamState`` as its state.

    Raises:
      ValueError: an lr, eps, weight decay or momentum_decay below 0, or a beta outside [0, 1).

    Example:
      >>> params = {"w": torch.ones(2)}
      >>> opt = fdp.optim.nadam(lr=0.1)
      >>> opt.update({"w": torch.ones(2)}, opt.init(params), params)[0]["w"]
      tensor([0.8944, 0.8944])
    """
    name = "fdp.optim.nadam"
    check_hyper(name, lr=lr, eps=eps, weight_decay=weight_decay, momentum_decay=momentum_decay)
    check_betas(name, betas)
    _check_decoupled(name, "nadam", decoupled_weight_decay)
    beta1, beta2 = betas
    products = _MuProducts(beta1, momentum_decay)

    def kernel(p, g, state, count, step, lr_now, wd_now):
        m, v = state
        _kernels.nadam_group(p, g, m, v, products.at(step, count.dtype), count, lr=lr_now,
                             beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd_now,
                             momentum_decay=momentum_decay,
                             decoupled_weight_decay=decoupled_weight_decay, maximize=maximize)

    spec = Spec(name, NAdamState, {"exp_avg": True, "exp_avg_sq": True}, 0.0, False, kernel,
                host_step="NAdam's mu_product (a product over every update so far)", torch_class=torch.optim.NAdam,
                fixed={"betas": tuple(betas), "eps": eps, "momentum_decay": momentum_decay,
                       "decoupled_weight_decay": decoupled_weight_decay, "maximize": maximize})
    return build(spec, lr, weight_decay, mask, donate)


def radam(lr: Hyper = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: Hyper = 0.0, decoupled_weight_decay: bool = False, *, maximize: bool = False,
          mask: Mask | None = None, donate: bool = False) -> Optimizer:
    """RAdam (rectified Adam) with ``torch.optim.RAdam``'s arguments and numbers.

    Args:
      lr, weight_decay: floats or schedules of the step count.
      betas, eps, maximize: as in ``torch.optim.RAdam``.
      decoupled_weight_decay: as in ``torch.optim.RAdam``: multiply the params by
        ``1 - lr * weight_decay`` (AdamW's decay) instead of adding the decay to the grad.
      mask: which leaves get weight decay.
      donate: update params and state in place and return them.

    Returns:
      An ``Optimizer`` with ``RAdamState`` as its state.

    Raises:
      ValueError: an lr, eps or weight decay below 0, or a beta outside [0, 1).

    Example:
      >>> params = {"w": torch.ones(2)}
      >>> opt = fdp.optim.radam(lr=0.1)
      >>> opt.update({"w": torch.ones(2)}, opt.init(params), params)[0]["w"]  # SGD-like warm-up
      tensor([0.9000, 0.9000])
    """
    name = "fdp.optim.radam"
    check_hyper(name, lr=lr, eps=eps, weight_decay=weight_decay)
    check_betas(name, betas)
    _check_decoupled(name, "radam", decoupled_weight_decay)
    beta1, beta2 = betas

    def kernel(p, g, state, count, step, lr_now, wd_now):
        m, v = state
        _kernels.radam_group(p, g, m, v, count, lr=lr_now, beta1=beta1, beta2=beta2, eps=eps,
                             weight_decay=wd_now, decoupled_weight_decay=decoupled_weight_decay,
                             maximize=maximize)

    spec = Spec(name, RAdamState, {"exp_avg": True, "exp_avg_sq": True}, 0.0, False, kernel,
                torch_class=torch.optim.RAdam,
                fixed={"betas": tuple(betas), "eps": eps, "decoupled_weight_decay": decoupled_weight_decay,
                       "maximize": maximize})
    return build(spec, lr, weight_decay, mask, donate)


def adamax(lr: Hyper = 2e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
           weight_decay: Hyper = 0.0, *, maximize: bool = False, mask: Mask | None = None,
           donate: bool = False) -> Optimizer:
    """Adamax (Adam with the infinity norm) with ``torch.optim.Adamax``'s arguments and numbers.

    Args:
      lr, weight_decay: floats or schedules of the step count (L2 decay added to the grad).
      betas, eps, maximize: as in ``torch.optim.Adamax``.
      mask: which leaves get weight decay.
      donate: update params and state in place and return them.

    Returns:
      An ``Optimizer`` with ``AdamaxState`` as its state.

    Raises:
      ValueError: an lr, eps or weight decay below 0, or a beta outside [0, 1).

    Example:
      >>> params = {"w": torch.ones(2)}
      >>> opt = fdp.optim.adamax(lr=0.1)
      >>> opt.update({"w": torch.ones(2)}, opt.init(params), params)[0]["w"]
      tensor([0.9000, 0.9000])
    """
    name = "fdp.optim.adamax"
    check_hyper(name, lr=lr, eps=eps, weight_decay=weight_decay)
    check_betas(name, betas)
    beta1, beta2 = betas

    def kernel(p, g, state, count, step, lr_now, wd_now):
        m, u = state
        _kernels.adamax_group(p, g, m, u, count, lr=lr_now, beta1=beta1, beta2=beta2, eps=eps,
                              weight_decay=wd_now, maximize=maximize)

    spec = Spec(name, AdamaxState, {"exp_avg": True, "exp_inf": True}, 0.0, False, kernel,
                torch_class=torch.optim.Adamax, fixed={"betas": tuple(betas), "eps": eps, "maximize": maximize})
    return build(spec, lr, weight_decay, mask, donate)


def adadelta(lr: Hyper = 1.0, rho: float = 0.9, eps: float = 1e-6, weight_decay: Hyper = 0.0, *,
             maximize: bool = False, mask: Mask | None = None, donate: bool = False) -> Optimizer:
    """Adadelta with ``torch.optim.Adadelta``'s arguments and numbers.

    Args:
      lr, weight_decay: floats or schedules of the step count (L2 decay added to the grad).
      rho, eps, maximize: as in ``torch.optim.Adadelta``.
      mask: which leaves get weight decay.
      donate: update params and state in place and return them.

    Returns:
      An ``Optimizer`` with ``AdadeltaState`` as its state.

    Raises:
      ValueError: an lr, eps or weight decay below 0, or a rho outside [0, 1].

    Example:
      >>> params = {"w": torch.ones(2)}
      >>> opt = fdp.optim.adadelta(lr=1.0)
      >>> opt.update({"w": torch.ones(2)}, opt.init(params), params)[0]["w"]
      tensor([0.9968, 0.9968])
    """
    name = "fdp.optim.adadelta"
    check_hyper(name, lr=lr, eps=eps, weight_decay=weight_decay)
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"{name}: invalid rho {rho} (must be in [0, 1])")

    def kernel(p, g, state, count, step, lr_now, wd_now):
        square_avg, acc_delta = state
        _kernels.adadelta_group(p, g, square_avg, acc_delta, count, lr=lr_now, rho=rho, eps=eps,
                                weight_decay=wd_now, maximize=maximize)

    spec = Spec(name, AdadeltaState, {"square_avg": True, "acc_delta": True}, 0.0, False, kernel,
                torch_class=torch.optim.Adadelta, fixed={"rho": rho, "eps": eps, "maximize": maximize})
    return build(spec, lr, weight_decay, mask, donate)
