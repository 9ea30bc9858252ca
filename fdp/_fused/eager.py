"""``eager_only``: functions torch.compile never traces, without importing torch._dynamo.

``torch.compiler.disable(fn)`` imports torch._dynamo, about a second of CPU; done when fdp is
imported, every process (every rank torchrun starts) would pay it, compiling or not. Nothing
can be compiled before torch._dynamo is imported (``torch.compile`` imports it), so the
disabled function is made when it is: at once if it already is, else right after
torch._dynamo's own import has finished (``fdp._internals.when_dynamo_imported``). Until
then the wrapper calls the function itself; from then on, the disabled one, which dynamo meets whether it inlines the wrapper (a graph break with the reason, or with
``fullgraph=True`` an error giving it) or compiles the wrapper's frame on its own.

(A disabled function made lazily on the first call, as ``torch._disable_dynamo`` does, would
be made under tracing when that call is compiled, and dynamo then reports the call to
``disable`` itself instead of the reason.)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from .. import _internals


def eager_only(reason: str) -> Callable[[Callable], Callable]:
    """A decorator: the function is never traced by torch.compile (``torch.compiler.disable``,
    with ``reason`` where this torch takes one); see the module docstring."""

    def decorate(fn: Callable) -> Callable:
        disabled: list[Callable] = []

        def make() -> None:
            if "reason" in inspect.signature(torch.compiler.disable).parameters:
                disabled.append(torch.compiler.disable(fn, reason=reason))
            else:  # pragma: no cover - torch < 2.6
                disabled.append(torch.compiler.disable(fn))

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if disabled:
                return disabled[0](*args, **kwargs)
            return fn(*args, **kwargs)

        _internals.when_dynamo_imported(make)
        return call

    return decorate


__all__ = ["eager_only"]
