"""The private torch APIs fdp leans on, each behind one name of this module.

No other module of fdp (nor ``fdp.kernels``) reaches into torch's private names:
``tests/test_architecture.py`` checks it, and that ``CATALOGUE`` (what each is, where fdp
uses it, why, and the torch versions it was checked on) lists every one;
docs/architecture.md's table is generated from ``CATALOGUE`` (``python docs/gen_api.py``).
Where an API may be missing on a supported torch, its function says what fdp does instead.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from typing import Any

import torch
import torch.utils.checkpoint as _checkpoint_module
from torch import nn


@dataclass(frozen=True)
class Use:
    """One private torch API: ``api`` as torch spells it, ``name`` the fdp name behind which it
    is used, ``why`` fdp needs it, ``checked`` the torch versions it was checked on."""

    api: str
    name: str
    why: str
    checked: str = "2.4, 2.13"


CATALOGUE: list[Use] = []


def _use(api: str, why: str, checked: str = "2.4, 2.13", name: str | None = None) -> Callable[[Any], Any]:
    def register(obj: Any) -> Any:
        CATALOGUE.append(Use(api, name or obj.__name__, why, checked))
        return obj
    return register


def _constant(api: str, name: str, why: str, checked: str = "2.4, 2.13") -> None:
    CATALOGUE.append(Use(api, name, why, checked))


# ---------------------------------------------------------------------------- autograd and functorch
try:
    from torch._C._functorch import (
        TransformType,
        get_interpreter_stack,
        get_unwrapped,
        is_batchedtensor,
        is_functorch_wrapped_tensor,
        peek_interpreter_stack,
    )
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    FUNCTORCH = True
except ImportError:  # pragma: no cover - exercised only on a torch without these APIs
    FUNCTORCH = False
_constant("torch._C._functorch.{TransformType, get_interpreter_stack, get_unwrapped, is_batchedtensor, "
          "is_functorch_wrapped_tensor, peek_interpreter_stack}, "
          "torch._functorch.pyfunctorch.temporarily_clear_interpreter_stack", "FUNCTORCH",
          "leaf hooks inside torch.func.grad (the overlapped functorch engine); without them the Reducer uses "
          "its non-overlapped path: torch.func.grad first, then a bucketed all-reduce")


@_use("Tensor._backward_hooks", "a leaf's tensor hooks live in this dict; assigning a one-entry dict to a fresh "
      "leaf is what Tensor.register_hook does, without its Python bookkeeping (most of a hook's per-leaf cost: "
      "python -m fdp.bench micro, row \"hook\")")
def set_leaf_hook(t: torch.Tensor, hook: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
    """Make ``hook`` the only backward hook of ``t``, a fresh leaf that requires grad."""
    t._backward_hooks = {0: hook}


def unwrap(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under any number of functorch wrappers (a hook inside ``torch.func.grad``
    receives a wrapped gradient)."""
    while FUNCTORCH and is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
    return t


def unbatched(t: torch.Tensor) -> torch.Tensor:
    """The tensor under ``torch.func.vmap``'s batching wrappers (not under a grad transform's):
    the one whose graph the enclosing backward runs (a hook on a batched tensor never fires)."""
    while FUNCTORCH and is_batchedtensor(t):
        t = get_unwrapped(t)
    return t


def in_forward_ad() -> bool:
    """Whether a ``torch.func.jvp`` (forward-mode AD) transform is running on this thread."""
    if not FUNCTORCH or peek_interpreter_stack() is None:
        return False
    return any(i.key() == TransformType.Jvp for i in get_interpreter_stack() or ())


def in_functorch_transform() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, ...) is running on this thread."""
    return FUNCTORCH and peek_interpreter_stack() is not None


@contextlib.contextmanager
def outside_transforms() -> Iterator[None]:
    """Run plain-tensor code (bucket copies, collectives) as if no transform were active: writing
    into a buffer made outside the transform raises "mutate a captured Tensor" otherwise."""
    if in_functorch_transform():
        with temporarily_clear_interpreter_stack():
            yield
    else:
        yield


@_use("torch._C._autograd._top_saved_tensors_default_hooks", "fdp's saved-tensor hooks call a user's own "
      "(save_on_cpu around apply keeps working)")
def saved_tensors_hooks_top() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None:
    """The (pack, unpack) pair of the innermost ``torch.autograd.graph.saved_tensors_hooks``
    active on this thread, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


@_use("torch._C._autograd._saved_tensors_hooks_is_enabled", "torch.func's grad transforms refuse saved-tensor "
      "hooks: apply pushes none there")
def saved_tensors_hooks_enabled() -> bool:
    """Whether saved-tensor hooks may be pushed now."""
    return torch._C._autograd._saved_tensors_hooks_is_enabled()


def records_plain_graph(_grad: Callable[[], bool] = torch.is_grad_enabled,
                        _hooks: Callable[[], bool] = torch._C._autograd._saved_tensors_hooks_is_enabled) -> bool:
    """Whether a forward now records a plain autograd graph: grad mode on, and outside any
    ``torch.func`` transform (whose wrapped tensors must not outlive it in a module, and whose
    grad transforms refuse saved-tensor hooks). On every ``apply`` call: one frame."""
    return _grad() and _hooks() and (not FUNCTORCH or peek_interpreter_stack() is None)


# The file whose frames run a checkpointed region again inside the backward (torch 2.4-2.13:
# ``_checkpoint_hook.unpack_hook`` -> ``_CheckpointFrame.get_inputs``, or ``ctx.saved_tensors``
# of ``_NoopSaveInputs`` on torch < 2.6; the reentrant ``CheckpointFunction.backward``).
_CHECKPOINT_FILE = _checkpoint_module.noop_context_fn.__code__.co_filename


@_use("sys._getframe on torch/utils/checkpoint.py's frames", "the unpack of a checkpointed region's inputs is "
      "the moment before torch runs it again: apply binds the call's tensors then (activation checkpointing)")
def unpacked_for_recompute(_frame: Callable[[int], Any] = sys._getframe, _file: str = _CHECKPOINT_FILE) -> bool:
    """Called from a saved-tensor unpack hook: whether the tensor being unpacked is an input of
    a checkpointed region that ``torch.utils.checkpoint`` is about to run again (the hook is then
    called from checkpoint's own Python frames). Runs once per saved tensor: kept to one frame
    lookup (the defaults are bound once)."""
    try:
        return _frame(2).f_code.co_filename == _file
    except ValueError:  # no Python frame under the hook (an autograd worker thread)
        return False


@_use("torch._C._current_graph_task_id, Variable._execution_engine.queue_callback", "put the module's own "
      "tensors back when the backward that recomputed with a call's tensors ends (as FSDP's end-of-backward)")
def at_backward_end(fn: Callable[[], None]) -> bool:
    """Run ``fn`` when the backward running on this thread finishes; False when no backward is
    running here."""
    if torch._C._current_graph_task_id() == -1:
        return False
    torch.autograd.Variable._execution_engine.queue_callback(fn)
    return True


# ---------------------------------------------------------------------------- tensors and storages
@_use("Tensor._make_subclass", "placeholders of unit params (a meta tensor of the param's shape that raises on use)")
def make_subclass(cls: type, t: torch.Tensor) -> torch.Tensor:
    """``t`` as an instance of the tensor subclass ``cls`` (no copy, no grad)."""
    return torch.Tensor._make_subclass(cls, t, False)


@_use("torch._C.DisableTorchFunctionSubclass", "a placeholder's metadata read without calling its "
      "__torch_function__ again")
def torch_function_subclass_disabled() -> Any:
    """A context in which a subclass's ``__torch_function__`` is not called again."""
    return torch._C.DisableTorchFunctionSubclass()


version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")
_constant("Tensor._version (a view shares its base's)", "version",
          "whether the params passed to a fused step are the views it handed out, unchanged")

_use_count = getattr(torch._C, "_storage_Use_Count", None)
_constant("torch._C._storage_Use_Count, UntypedStorage._cdata", "storage_use_count",
          "whether a flat buffer is still referred to outside fdp (fdp writes only free ones); without it "
          "nothing is reused")


def storage_use_count(t: torch.Tensor) -> int | None:
    """torch's count of references to ``t``'s storage (every tensor or view on it holds one), or
    None on a torch without it. The storage object is kept alive across the call: on torch 2.4
    a temporary one is freed (and its reference dropped) as soon as ``._cdata`` is read."""
    if _use_count is None:
        return None
    storage = t.untyped_storage()
    return _use_count(storage._cdata)


@_use("torch._amp_foreach_non_finite_check_and_unscale_", "AMP's fused finite check (skip_nonfinite, loss scale)")
def non_finite_check(tensors: list[torch.Tensor], found: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Set ``found`` to 1 if any element of ``tensors`` is not finite (and multiply them by
    ``inv_scale``, 1.0 to leave them as they are): one pass per list of one dtype."""
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv_scale)


@_use("torch._amp_update_scale_", "GradScaler.update's own backoff/growth kernel (loss_scale's numbers are "
      "GradScaler's)")
def amp_update_scale(scale: torch.Tensor, tracker: torch.Tensor, found_inf: torch.Tensor, growth_factor: float,
                     backoff_factor: float, growth_interval: int) -> None:
    torch._amp_update_scale_(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval)


chunk_cat: Callable[..., torch.Tensor] = torch._chunk_cat  # (an alias: no frame in the copy's hot path)
_constant("torch._chunk_cat", "chunk_cat", "one-call multi-tensor flatten (fdp.kernels' torch path)")


unflatten_dense_tensors: Callable[[torch.Tensor, list[torch.Tensor]], list[torch.Tensor]] = \
    torch._C._nn.unflatten_dense_tensors
_constant("torch._C._nn.unflatten_dense_tensors", "unflatten_dense_tensors",
          "one C++ call makes every leaf's view of a flat buffer (fdp.kernels.views)")


# ---------------------------------------------------------------------------- torch.optim and its utilities
from torch.utils import _foreach_utils  # noqa: E402 - (with its uses)

# ``group_by_device_and_dtype([tensors], with_indices=...)`` and ``has_foreach_support(tensors,
# device)``: torch's own functions (aliases: no frame of fdp's on the clipping path)
group_by_device_and_dtype: Callable[..., dict] = _foreach_utils._group_tensors_by_device_and_dtype
has_foreach_support: Callable[..., bool] = _foreach_utils._has_foreach_support
_constant("torch.utils._foreach_utils._group_tensors_by_device_and_dtype", "group_by_device_and_dtype",
          "clip_grad_norm_'s own grouping and order (fdp's norm is torch's, bit for bit)")
_constant("torch.utils._foreach_utils._has_foreach_support", "has_foreach_support",
          "clip_grad_norm_'s choice of the foreach norm")


@_use("torch.optim._adafactor.adafactor", "torch.optim.Adafactor's own kernel (fdp.optim.adafactor's numbers); "
      "None before torch 2.5", checked="2.5, 2.13")
def torch_adafactor() -> Callable | None:
    try:
        from torch.optim._adafactor import adafactor
    except ImportError:  # pragma: no cover - torch 2.4
        return None
    return adafactor


@_use("torch.optim._muon.muon", "torch.optim.Muon's own kernel (fdp.optim.muon's numbers); torch >= 2.9",
      checked="2.9, 2.13")
def torch_muon() -> Callable:
    from torch.optim._muon import muon

    return muon


# ---------------------------------------------------------------------------- torch.distributed
@_use("torch.distributed._functional_collectives", "collectives torch.compile can trace (public by convention)")
def functional_collectives() -> Any:
    import torch.distributed._functional_collectives as funcol

    return funcol


@_use("torch._C._distributed_c10d.{PythonCallbackWork, _register_work}", "fdp's point-to-point collectives in "
      "a compiled graph (fdp/_comm/traced.py) are waited for by torch's wait_tensor, which reads this registry",
      checked="2.13")
def register_work(out: torch.Tensor, wait: Callable[[Any], bool]) -> None:
    """``wait_tensor(out)`` calls ``wait(timeout)`` (once)."""
    from torch._C._distributed_c10d import PythonCallbackWork, _register_work

    _register_work(out, PythonCallbackWork(wait))


def registers_works() -> bool:
    """Whether this torch has what ``register_work`` uses (2.13 has; older ones may not: fdp's
    compiled steps on gloo then issue torch's own collectives)."""
    try:
        from torch._C._distributed_c10d import PythonCallbackWork, _register_work  # noqa: F401
    except ImportError:  # pragma: no cover - an older torch
        return False
    return True


@_use("torch._inductor.lowering.register_lowering, torch._inductor.ir._CollectiveKernel.create_out_of_place",
      "Inductor lowers fdp's point-to-point collectives (fdp/_comm/traced.py) as its own: their inputs are held, "
      "never reused or written, until their wait_tensor", checked="2.13")
def lower_as_collective(ops: list[Any]) -> None:
    """Register Inductor's lowering of torch's out-of-place collectives for each op of ``ops``
    (each an ``OpOverloadPacket`` whose output is a new tensor, waited with ``wait_tensor``)."""
    from torch._inductor import ir
    from torch._inductor.lowering import register_lowering

    for op in ops:
        def lower(*args: Any, _op: Any = op.default) -> Any:
            return ir.TensorBox.create(ir._CollectiveKernel.create_out_of_place(_op, *args))

        register_lowering(op)(lower)


@_use("torch.distributed.distributed_c10d._resolve_process_group", "a compiled graph names its process group "
      "(fdp/_comm/traced.py's ops find theirs)", checked="2.13")
def process_group_named(name: str) -> Any:
    """The process group named ``name``."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


@_use("ProcessGroup._get_backend(device).options._timeout", "the timeout a process group was made with")
def backend_timeout(pg: Any, device: torch.device) -> timedelta | None:
    """The timeout ``pg``'s backend for ``device`` was made with (None: it does not say)."""
    try:
        t = pg._get_backend(device).options._timeout
    except Exception:  # noqa: BLE001 - backends without options (the threaded test group)
        return None
    return t if isinstance(t, timedelta) else None


@_use("torch.distributed.distributed_c10d._get_process_group_store", "the rendezvous store of a group, where a "
      "stalled collective's ranks post what they wait on (fdp._comm.stall: a desync named without a collective)")
def process_group_store(pg: Any) -> Any:
    """``pg``'s store (None: torch does not say, or the group has none)."""
    try:
        import torch.distributed.distributed_c10d as c10d

        return c10d._get_process_group_store(pg)
    except Exception:  # noqa: BLE001 - an older torch, or a group made without a store
        return None


FUTURE: type = torch._C.Future
_constant("torch._C.Future", "FUTURE", "what a comm hook's Future is (torch.futures.Future and c10d's own)")


@_use("torch._C._distributed_c10d._set_thread_isolation_mode", "threads as ranks (fdp.testing's threaded group)")
def thread_isolation(on: bool) -> None:
    torch._C._distributed_c10d._set_thread_isolation_mode(on)


# ---------------------------------------------------------------------------- nn.Module
def tensor_dicts(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """The dicts that hold ``module``'s own parameters and buffers (``apply`` puts a call's
    tensors into them: torch.func.functional_call's own way, without its bookkeeping)."""
    return module._parameters, module._buffers


_constant("Module._parameters, Module._buffers", "tensor_dicts",
          "apply binds a call's tensors into the module's own dicts (functional_call's way, minus its bookkeeping)")


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """The names of ``module``'s own buffers registered with ``persistent=False``."""
    return module._non_persistent_buffers_set


_constant("Module._non_persistent_buffers_set", "non_persistent_buffers",
          "non-persistent buffers (a causal mask) are constants of apply, not state")


def module_hooks(module: nn.Module) -> list[Callable]:
    """``module``'s own forward pre-hooks and forward hooks."""
    return [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]


_constant("Module._forward_pre_hooks, Module._forward_hooks", "module_hooks",
          "whether torch's composable checkpoint(module) is on a module (apply's saved-tensor hooks)")


def compiled_inner(module: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile(module)`` wrapper wraps, or None when ``module`` is not one.
    ``OptimizedModule`` is read from ``sys.modules``: importing torch._dynamo costs about a
    second, and a process that never imported it holds no compiled module."""
    frame = sys.modules.get("torch._dynamo.eval_frame")
    if frame is not None and isinstance(module, frame.OptimizedModule):
        return module._orig_mod
    return None


_constant("torch._dynamo.eval_frame.OptimizedModule, OptimizedModule._orig_mod (read from sys.modules: never "
          "imported by fdp)", "compiled_inner", "functionalize(torch.compile(model)): the model's own keys")

# The segments wrapper modules add to the names of what they wrap: ``checkpoint_wrapper``'s
# ``_checkpoint_wrapped_module`` (whose state-dict hooks drop it) and torch.compile's ``_orig_mod``.
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod")
_constant("checkpoint_wrapper's _checkpoint_wrapped_module and torch.compile's _orig_mod name segments",
          "WRAPPER_SEGMENTS", "keys, units and state dicts named as the unwrapped model's")

# torch.distributed.checkpoint's ``_Checkpointable`` hook, looked up on every value it saves
# (``planner_helpers._create_write_items``, with hasattr): a sharded FusedState answers it with a refusal.
DCP_WRITE_ITEMS = "__create_write_items__"
_constant("DCP's _Checkpointable hook __create_write_items__ (planner_helpers._create_write_items)",
          "DCP_WRITE_ITEMS", "a sharded FusedState refuses dcp.save at any depth of the state dict", checked="2.13")


# ---------------------------------------------------------------------------- torch._dynamo, lazily
class _Watcher(MetaPathFinder):
    """Runs callbacks once a module is imported (at once if it is already). On the import's way
    through ``sys.meta_path`` it finds the module's spec with the other finders and wraps that
    loader's ``exec_module``, so the callbacks run after the module's code, then leaves."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.callbacks: list[Callable[[], None]] = []
        self.lock = threading.Lock()
        self.finding = threading.local()  # (another finder like this one asks the others too: not us again)

    def when_imported(self, callback: Callable[[], None]) -> None:
        with self.lock:
            if self.module not in sys.modules:
                self.callbacks.append(callback)
                if self not in sys.meta_path:
                    sys.meta_path.insert(0, self)
                return
        callback()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if fullname != self.module or getattr(self.finding, "now", False):
            return None
        spec = None
        self.finding.now = True
        try:
            for finder in sys.meta_path:
                if finder is not self and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            self.finding.now = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, run = spec.loader, spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            self._imported(loader)

        loader.exec_module = exec_module  # (this loader object serves this module only)
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
                warnings.warn(f"fdp: a callback on the import of {self.module} failed ({e!r})", RuntimeWarning,
                              stacklevel=2)


_WATCHERS: dict[str, _Watcher] = {}
_WATCHERS_LOCK = threading.Lock()
_constant("a sys.meta_path watcher that wraps a torch module's loader's exec_module once", "when_imported",
          "the fused step's torch.compiler.disable is made right after torch._dynamo's import, and fdp's "
          "collectives' Inductor lowering right after torch._inductor.lowering's, not at import fdp (about a "
          "second per process)")


def when_imported(module: str, callback: Callable[[], None]) -> None:
    """Run ``callback`` once ``module`` is imported (at once if it already is)."""
    with _WATCHERS_LOCK:
        watcher = _WATCHERS.setdefault(module, _Watcher(module))
    watcher.when_imported(callback)


def when_dynamo_imported(callback: Callable[[], None]) -> None:
    """Run ``callback`` once torch._dynamo is imported (at once if it already is)."""
    when_imported("torch._dynamo", callback)


@_use("torch._dynamo.config.trace_autograd_ops", "the traced fused step differentiates with torch.autograd.grad "
      "where dynamo traces it (torch.func refuses activation checkpointing's saved-tensor hooks)", checked="2.13")
def dynamo_traces_autograd() -> bool:
    """Whether dynamo traces ``torch.autograd.grad`` now (read while tracing: a constant there)."""
    import torch._dynamo.config as config

    return bool(getattr(config, "trace_autograd_ops", False))


@_use("torch._dynamo.config.patch(trace_autograd_ops=True)", "step.compile() traces the fused step with "
      "torch.autograd.grad, so activation checkpointing inside the loss compiles", checked="2.13")
def tracing_autograd() -> Any:
    """A context in which dynamo traces ``torch.autograd.grad`` (where this torch can; else nothing).

    Set and put back directly (dynamo's settings are per thread: each thread rank holds its
    own), not with ``config.patch``, which makes a class on every call of a compiled step."""
    import torch._dynamo.config as config

    if not hasattr(config, "trace_autograd_ops"):  # pragma: no cover - torch < 2.9
        return contextlib.nullcontext()
    return _setting(config, "trace_autograd_ops", True)


# This torch's (major, minor)
_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2] if x.isdigit())
# Whether dynamo takes an object argument of an ``assume_constant_result`` function by its
# identity (torch 2.13 does; the earlier torch versions fdp compiles on were not checked)
_CONSTANT_OBJECTS = _TORCH >= (2, 13)


@_use("torch._dynamo.assume_constant_result (its mark, the function's _dynamo_marked_constant)",
      "fdp's own immutable bookkeeping (a plan's leaf shapes, an engine's update orders) read inside a traced "
      "step without a guard per value, which dynamo would check before every call of the compiled step; "
      "torch >= 2.13 (which takes an object argument by identity), elsewhere the reads are guarded as before",
      checked="2.13")
def trace_constant(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` marked as dynamo's ``assume_constant_result`` (without importing dynamo): inside
    a trace dynamo calls it at trace time and takes its result as a constant, guarding only on
    its arguments (an object argument by identity), not on anything the result is read for."""
    if _CONSTANT_OBJECTS:
        fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@trace_constant
def frozen(owner: Any, attr: str) -> Any:
    """A copy of ``owner.attr``. Inside a trace (torch >= 2.13) it is taken once as a constant:
    before each call of the compiled function dynamo checks only that ``owner`` is the same
    object, not every value read from the copy (a copy: dynamo would otherwise guard through
    the attribute wherever the traced code also reads it). For fdp's own bookkeeping that never
    changes once made (a bucket plan, an engine's update orders); never for anything that holds
    tensors or state a call changes. (Where it is not a constant, the attribute itself.)"""
    value = getattr(owner, attr)
    return copy.deepcopy(value) if _CONSTANT_OBJECTS else value


# What ``library_guards_dropped`` counts as library code: these packages (fdp's benchmarks
# stand for a user's code), and Python's builtins
_LIBRARIES = ("torch", "optree", "fdp")
_NOT_LIBRARIES = ("fdp.bench",)
# dynamo's name for an object it installed as a global under its id (kept: what it is, unknown)
_INSTALLED = re.compile(r"_\d+_c\d+")
# The guards that check which object a global name holds (a function, its closure, a class, a
# module, a builtin, a registry's keys), as against a value the traced code read from it (a
# number, a flag, a length: CONSTANT_MATCH, EQUALS_MATCH, ...; those are kept)
_IDENTITY_GUARDS = frozenset(("ID_MATCH", "TYPE_MATCH", "CLASS_MATCH", "MODULE_MATCH", "CLOSURE_MATCH",
                              "FUNCTION_MATCH", "BUILTIN_MATCH", "DICT_CONTAINS", "DICT_NOT_CONTAINS",
                              "DICT_KEYS_MATCH", "HASATTR", "DUPLICATE_INPUT"))


@_use("torch.compile(options={'guard_filter_fn': ...}) entries' orig_guard (originating_source, create_fn's "
      "source_b), torch._dynamo.source.GlobalSource / GlobalWeakRefSource",
      "step.compile() drops dynamo's checks that the functions, classes and modules of torch, optree and fdp "
      "which the traced step reached through module globals are still the same objects: before every call, on "
      "caches the step's compute has just emptied, they were about half of the guards' time (docs/compile.md, "
      "\"Each call's cost\"); torch >= 2.13, elsewhere every guard is kept", checked="2.13")
def library_guards_dropped(frame_module: str) -> Callable[[list[Any]], list[bool]] | None:
    """A ``guard_filter_fn`` for ``torch.compile`` of a function of ``frame_module`` (one of
    fdp's): it keeps every guard except those that check the identity of library code reached
    through a global (``_IDENTITY_GUARDS`` on a global of torch, optree, fdp, Python's builtins
    or ``frame_module`` itself). The values the traced code read from such globals stay
    guarded (a flag of ``torch._dynamo.config``, a constant), and so does everything reached
    from the user's own modules, the inputs and the model. None where this torch was not
    checked (every guard kept)."""
    if _TORCH < (2, 13):  # pragma: no cover - (the guard entries' fields were read on 2.13)
        return None
    from torch._dynamo.source import GlobalSource, GlobalWeakRefSource

    own = vars(sys.modules[frame_module])

    def library(source: Any) -> bool:
        while getattr(source, "base", None) is not None:
            source = source.base
        if not isinstance(source, (GlobalSource, GlobalWeakRefSource)):
            return False
        name = source.global_name
        if name.startswith("__builtins_dict__"):
            return True
        if name.startswith("__import_"):  # (dynamo's name for an imported module: dots as "_dot_")
            module = name[len("__import_"):].replace("_dot_", ".")
            return module.split(".")[0] in _LIBRARIES and not module.startswith(_NOT_LIBRARIES)
        if _INSTALLED.fullmatch(name):
            return False
        return name in own  # (a global of the compiled function's module)

    def keep(entries: list[Any]) -> list[bool]:
        out = []
        for entry in entries:
            guard = getattr(entry, "orig_guard", None)
            source = getattr(guard, "originating_source", None)
            drop = entry.guard_type in _IDENTITY_GUARDS and source is not None and library(source)
            if drop and entry.guard_type == "DUPLICATE_INPUT":  # (both of the objects library code)
                other = (getattr(guard.create_fn, "keywords", None) or {}).get("source_b")
                drop = other is not None and library(other)
            out.append(not drop)
        return out

    return keep


@_use("torch._inductor.list_mode_options", "step.compile(mode=...) passes the mode's own options with fdp's "
      "(torch.compile takes either a mode or options)", checked="2.13")
def inductor_mode_options(mode: str, dynamic: bool | None = None) -> dict[str, Any]:
    """The Inductor options ``torch.compile(mode=mode)`` stands for."""
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode, dynamic))


@contextlib.contextmanager
def _setting(config: Any, name: str, value: Any) -> Iterator[None]:
    before = getattr(config, name)
    setattr(config, name, value)
    try:
        yield
    finally:
        setattr(config, name, before)


@_use("torch._inductor.utils.run_and_get_code", "python -m fdp.bench overlap reads the code Inductor generated "
      "for a compiled step", checked="2.13")
def inductor_code(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``fn()`` and the source of the code Inductor generated while it ran."""
    from torch._inductor.utils import run_and_get_code

    return run_and_get_code(fn)


@_use("torch._dynamo.reset", "a benchmark compiles the same code afresh for each configuration", checked="2.13")
def dynamo_reset() -> None:
    import torch._dynamo

    torch._dynamo.reset()


@_use("torch._inductor.fx_passes.control_dependencies.preserve_node_ordering",
      "a compiled step's collectives keep fdp's order whatever Inductor's own reordering "
      "(reorder_for_peak_memory) makes of the rest: ranks whose graphs differ (Muon's owners) must issue them "
      "alike (fdp/_comm/schedule.py: in_order)", checked="2.13")
def keep_node_order(graph: Any, after: dict[Any, Any]) -> bool:
    """Make each node of ``after`` (an FX graph's node: its key) run after the nodes its value
    names, through Inductor's ``control_deps``. Returns False where this torch has none."""
    try:
        from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
        from torch.utils._ordered_set import OrderedSet
    except ImportError:  # pragma: no cover - a torch before 2.13
        return False
    preserve_node_ordering(graph, {n: OrderedSet(deps) for n, deps in after.items()})
    return True


@_use("torch._inductor.custom_graph_pass.CustomGraphPass, torch._inductor.config.post_grad_custom_post_pass",
      "step.compile() gives Inductor fdp's pass that issues each collective as early as its inputs allow and "
      "waits as late as its users allow (fdp/_comm/schedule.py), and with fully sharded params its reshard pass "
      "(fdp/_comm/reshard.py)", checked="2.13")
def inductor_post_grad_pass(fn: Callable[[Any], None], uuid: str) -> Any:
    """``fn`` (a function of an FX graph, changing it in place) as the pass Inductor runs after
    its post-grad passes (``options={"post_grad_custom_post_pass": ...}``); ``uuid`` names it in
    Inductor's cache key."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Pass(CustomGraphPass):
        def __call__(self, graph: Any) -> None:
            fn(graph)

        def uuid(self) -> str:
            return uuid

    return Pass()


@_use("torch._inductor.config.cpp_wrapper", "python -m fdp.bench loop/sharded --cpp-wrapper compile every "
      "compiled kind, fdp's and the peers', with Inductor's C++ wrapper (users pass "
      "options={'cpp_wrapper': True} to torch.compile or step.compile)", checked="2.13")
def inductor_cpp_wrapper() -> None:
    """Every graph Inductor compiles from now on in this process has its wrapper (the code that
    calls the kernels) compiled to C++ instead of run as Python: what ``torch.compile(...,
    options={"cpp_wrapper": True})`` does for one function, for all of them."""
    import torch._inductor.config as inductor

    inductor.cpp_wrapper = True


@_use("torch._inductor.config.cpp_wrapper (as torch.compile's option), torch._inductor.exc.InductorError, "
      "torch._dynamo.exc.BackendCompilerFailed",
      "step.compile() compiles a CPU step's wrapper (the code that calls the kernels) to C++ by default, and "
      "compiles a graph again with the Python wrapper where Inductor fails to compile it with that one (an op "
      "its wrapper cannot call); torch >= 2.13, elsewhere the Python wrapper as torch's default",
      checked="2.13")
def cpp_wrapper_by_default(device: torch.device) -> bool:
    """Whether ``step.compile()`` asks Inductor for its C++ wrapper on ``device``: on CPU, with
    a torch whose wrapper fdp's steps were tested under (docs/compile.md, "Each call's cost")."""
    return device.type == "cpu" and _TORCH >= (2, 13)


def inductor_compile_errors() -> tuple[type[BaseException], ...]:
    """The errors a ``torch.compile``-d function raises when Inductor fails to compile a graph
    (before any of it ran): not the graph's own errors at run time."""
    from torch._dynamo.exc import BackendCompilerFailed

    try:
        from torch._inductor.exc import InductorError
    except ImportError:  # pragma: no cover - a torch before 2.7 (its Inductor raised BackendCompilerFailed)
        return (BackendCompilerFailed,)
    return (BackendCompilerFailed, InductorError)


@_use("torch._dynamo.config.optimize_ddp='python_reducer', torch._dynamo.compiled_autograd._enable, "
      "torch._inductor.config._fuse_ddp_communication, the logger torch._dynamo.variables.ctx_manager",
      "python -m fdp.bench loop/sharded --compiled time DDP "
      "under compiled autograd, the peer torch documents for a whole compiled DDP step", checked="2.13")
def ddp_compiled_autograd(module: nn.Module, process_group: Any) -> tuple[nn.Module, Callable[[], Any]]:
    """``DistributedDataParallel(module)`` built for compiled autograd (dynamo's
    ``optimize_ddp="python_reducer"``: its forward one graph, each gradient's all-reduce traced
    into the compiled backward, Inductor bucketing them by DDP's cap) and a function giving the
    context to run its forward and backward in (``torch.compile`` of the DDP module and
    ``loss.backward()`` inside it). DDP sets the Inductor settings of its bucketing for the
    whole process when built; they are put back here and set inside that context only, so
    other code compiled in this process is compiled as without it."""
    import torch._dynamo
    import torch._inductor.config as inductor
    from torch._dynamo import compiled_autograd

    names = ("_fuse_ddp_communication", "_fuse_ddp_bucket_size")
    before = {n: getattr(inductor, n) for n in names}
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        ddp = nn.parallel.DistributedDataParallel(module, process_group=process_group)
    own = {n: getattr(inductor, n) for n in names}
    for n, v in before.items():
        setattr(inductor, n, v)

    @contextlib.contextmanager
    def running() -> Iterator[None]:
        with torch._dynamo.config.patch(optimize_ddp="python_reducer"), inductor.patch(own), \
                compiled_autograd._enable(torch.compile):
            yield

    # (dynamo notes once per process that it ignores the record_function DDP's forward opens:
    # nothing the benchmarks report, so not said in their output)
    logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(_RECORD_FUNCTION_NOTE)
    return ddp, running


class _NoRecordFunctionNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Profiler record function")


_RECORD_FUNCTION_NOTE = _NoRecordFunctionNote()
