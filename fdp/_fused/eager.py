"""``eager_only``: functions torch.compile never traces, without importing torch._dynamo.

``torch.compiler.disable(fn)`` imports torch._dynamo, about a second of CPU; done when fdp is
imported, every process (every rank torchrun starts) would pay it, compiling or not. Nothing
can be compiled before torch._dynamo is imported (``torch.compile`` imports it), so the
disabled function is made when it is: at once if it already is, else by a watcher on
``sys.meta_path`` that runs right after torch._dynamo's own import has finished and then
leaves. Until then the wrapper calls the function itself; from then on, the disabled one,
which dynamo meets whether it inlines the wrapper (a graph break with the reason, or with
``fullgraph=True`` an error giving it) or compiles the wrapper's frame on its own.

(A disabled function made lazily on the first call, as ``torch._disable_dynamo`` does, would
be made under tracing when that call is compiled, and dynamo then reports the call to
``disable`` itself instead of the reason.)
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import warnings
from collections.abc import Callable
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from typing import Any

import torch

DYNAMO = "torch._dynamo"


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

        _WATCHER.when_imported(make)
        return call

    return decorate


class _Watcher(MetaPathFinder):
    """Runs callbacks once torch._dynamo is imported (at once if it is already). On the
    import's way through ``sys.meta_path`` it finds the module's spec with the other finders
    and wraps that loader's ``exec_module``, so the callbacks run after the module's code."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []
        self.lock = threading.Lock()

    def when_imported(self, callback: Callable[[], None]) -> None:
        with self.lock:
            if DYNAMO not in sys.modules:
                self.callbacks.append(callback)
                if self not in sys.meta_path:
                    sys.meta_path.insert(0, self)
                return
        callback()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if fullname != DYNAMO:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, run = spec.loader, spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            self._imported(loader)

        loader.exec_module = exec_module  # (this loader object serves torch._dynamo only)
        return spec

    def _imported(self, loader: Any) -> None:
        with self.lock:
            callbacks, self.callbacks = self.callbacks, []
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        loader.__dict__.pop("exec_module", None)
        for callback in callbacks:
            try:
                callback()
            except Exception as e:  # pragma: no cover - never seen; the import must not fail for it
                warnings.warn(f"fdp: could not keep a function out of torch.compile ({e!r}); compiling a "
                              "function that calls the fused step may trace into it", RuntimeWarning, stacklevel=2)


_WATCHER = _Watcher()

__all__ = ["eager_only"]
