"""The private torch APIs fdp leans on, each behind one function of this module.

Each entry says what it is for and the torch versions it was checked on; docs/architecture.md
lists them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as _checkpoint_module

# The file whose frames run a checkpointed region again inside the backward (torch 2.4-2.13:
# ``_checkpoint_hook.unpack_hook`` -> ``_CheckpointFrame.get_inputs``, or ``ctx.saved_tensors``
# of ``_NoopSaveInputs`` on torch < 2.6; the reentrant ``CheckpointFunction.backward``).
_CHECKPOINT_FILE = _checkpoint_module.noop_context_fn.__code__.co_filename


# The segments wrapper modules add to the names of what they wrap: ``checkpoint_wrapper``'s
# ``_checkpoint_wrapped_module`` (torch.distributed.algorithms._checkpoint.checkpoint_wrapper,
# whose state-dict hooks drop it; torch 2.4-2.13) and torch.compile's ``_orig_mod``
# (``OptimizedModule``).
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod")


def saved_tensors_hooks_top() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None:
    """The (pack, unpack) pair of the innermost ``torch.autograd.graph.saved_tensors_hooks``
    active on this thread (``save_on_cpu``'s, say), or None: a pair fdp pushes calls them, so a
    user's offloading keeps working inside fdp's own hooks.
    ``torch._C._autograd._top_saved_tensors_default_hooks`` (torch 2.4-2.13)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def saved_tensors_hooks_enabled() -> bool:
    """Whether saved-tensor hooks may be pushed now (torch.func's grad transforms disable them).
    ``torch._C._autograd._saved_tensors_hooks_is_enabled`` (torch 2.4-2.13)."""
    return torch._C._autograd._saved_tensors_hooks_is_enabled()


def unpacked_for_recompute(_frame: Callable[[int], Any] = sys._getframe, _file: str = _CHECKPOINT_FILE) -> bool:
    """Called from a saved-tensor unpack hook: whether the tensor being unpacked is an input of
    a checkpointed region that ``torch.utils.checkpoint`` is about to run again (its
    recomputation inside the backward): the hook is then called from checkpoint's own Python
    frames. Checked on torch 2.4 (``_NoopSaveInputs``, reentrant ``CheckpointFunction``) and
    2.13 (``_CheckpointFrame.get_inputs``); ``sys._getframe`` is CPython's. Runs once per saved
    tensor: kept to one frame lookup (the defaults are bound once)."""
    try:
        return _frame(2).f_code.co_filename == _file
    except ValueError:  # no Python frame under the hook (an autograd worker thread)
        return False


def in_functorch_transform() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, ...) is running on this thread.
    ``torch._C._functorch.peek_interpreter_stack`` (torch 2.4-2.13)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def make_subclass(cls: type, t: torch.Tensor) -> torch.Tensor:
    """``t`` as an instance of the tensor subclass ``cls`` (no copy, no grad): the way torch's
    own subclasses are made. ``torch.Tensor._make_subclass`` (torch 2.4-2.13)."""
    return torch.Tensor._make_subclass(cls, t, False)


def torch_function_subclass_disabled() -> Any:
    """A context in which a subclass's ``__torch_function__`` is not called again (its own
    fallback to the plain op). ``torch._C.DisableTorchFunctionSubclass`` (torch 2.4-2.13)."""
    return torch._C.DisableTorchFunctionSubclass()


def at_backward_end(fn: Callable[[], None]) -> bool:
    """Run ``fn`` when the backward running on this thread finishes (autograd's own queue of
    end-of-graph callbacks, as FSDP uses); False when no backward is running here.
    ``torch._C._current_graph_task_id``, ``Variable._execution_engine.queue_callback``
    (torch 2.4-2.13)."""
    if torch._C._current_graph_task_id() == -1:
        return False
    torch.autograd.Variable._execution_engine.queue_callback(fn)
    return True

