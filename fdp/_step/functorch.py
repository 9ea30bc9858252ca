"""The private torch APIs behind the overlapped backward, kept in one place.

Checked on torch 2.4 and 2.13 (the versions CI and the package floor cover):

* ``Tensor._backward_hooks``: a leaf's tensor hooks live in this dict, which the autograd
  engine calls with the leaf's gradient; assigning a one-entry dict to a fresh leaf is what
  ``Tensor.register_hook`` does, without its Python bookkeeping, which is most of the
  per-leaf cost of a hook (``python -m fdp.bench micro``, row "hook"; docs/performance.md).

* ``torch._C._functorch.is_functorch_wrapped_tensor`` / ``get_unwrapped``: inside
  ``torch.func.grad`` a tensor hook receives a functorch-wrapped gradient; unwrapping it
  (repeatedly, one level per transform) gives the plain tensor that holds the values.
* ``torch._functorch.pyfunctorch.temporarily_clear_interpreter_stack``: writing into a
  buffer created outside the transform (the Reducer's bucket) raises "mutate a captured
  Tensor" unless done with the functorch interpreter stack cleared.
* ``torch._C._functorch.peek_interpreter_stack``: whether a transform is active right now.

If any of them is missing (a future torch), ``AVAILABLE`` is False and the Reducer uses its
non-overlapped path: ``torch.func.grad`` first, then a bucketed all-reduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

try:
    from torch._C._functorch import (
        get_unwrapped,
        is_functorch_wrapped_tensor,
        peek_interpreter_stack,
    )
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised only on a torch without these APIs
    AVAILABLE = False


def set_leaf_hook(t: torch.Tensor, hook: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
    """Make ``hook`` the only backward hook of ``t``, a fresh leaf that requires grad."""
    t._backward_hooks = {0: hook}


def unwrap(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under any number of functorch wrappers."""
    while AVAILABLE and is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
    return t


def in_transform() -> bool:
    """True while a torch.func transform (grad, vmap, ...) is running on this thread."""
    return AVAILABLE and peek_interpreter_stack() is not None


@contextlib.contextmanager
def outside_transforms() -> Iterator[None]:
    """Run plain-tensor code (bucket copies, collectives) as if no transform were active."""
    if in_transform():
        with temporarily_clear_interpreter_stack():
            yield
    else:
        yield
