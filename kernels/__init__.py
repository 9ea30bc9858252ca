"""fdp.kernels: multi-tensor flatten/unflatten with a fused scale and dtype cast.

Where it lives: the repository's top-level ``kernels/`` folder (the project's chosen layout
keeps kernels apart from the Python library), installed as the subpackage ``fdp.kernels`` by
``[tool.setuptools.package-dir]`` in pyproject.toml. There is no top-level ``kernels``
module; inside fdp, ``from . import kernels`` resolves to this package. fdp uses only the
names in ``__all__`` below; ``_torch`` and ``_triton`` are this package's own.

``flatten(srcs, out, scale=s)`` writes ``(src.to(c) * s).to(out.dtype)`` for every source,
back to back, into the 1-D ``out``, where ``c`` is the widest of fp32 and the two dtypes:
"multiply in fp32 (fp64 for fp64), round once to the bucket dtype". For the usual case
(fp32 leaves, fp32/bf16/fp16 bucket) that is bit-identical to ``(x.float() * s).to(dtype)``.
``unflatten(flat, outs)`` copies consecutive segments of ``flat`` into ``outs`` (casting to
each output's dtype).

Two implementations, bit-identical to each other:

* ``"triton"``: one launch per call over a table of tensor pointers and offsets (the
  multi_tensor_apply pattern), used for CUDA tensors when Triton is installed;
* ``"torch"``: stock torch ops (``_chunk_cat(out=)``, ``mul(out=)`` through a cached scratch,
  ``_foreach_copy_``), used everywhere else.

``impl=`` or the environment variable ``FDP_KERNELS=torch|triton`` forces one. Under
``TRITON_INTERPRET=1`` (set before this module is imported) the Triton kernels run on CPU
tensors, which is how the tests compare the two paths on a machine without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from . import _torch

__all__ = ["block_size", "flatten", "flattener", "unflatten", "views", "select", "triton_available"]

_IMPLS = ("torch", "triton")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_problem(device: torch.device | None) -> str | None:
    """Why the Triton path cannot run on ``device`` here (any device if None), or None."""
    try:
        from . import _triton
    except ImportError as e:
        return f"triton is not importable ({e})"
    if _triton.interpreted():
        if device is not None and device.type != "cpu":
            return (f"TRITON_INTERPRET=1 was set when fdp.kernels loaded Triton, and the interpreter "
                    f"runs on CPU tensors only, not {device}")
        return _triton.interpreter_problem()
    if device is not None and device.type != "cuda":
        return (f"Triton needs CUDA tensors, got {device} (set TRITON_INTERPRET=1 before importing "
                "fdp.kernels to interpret Triton on CPU tensors)")
    if not torch.cuda.is_available():
        return "no CUDA device is available (and TRITON_INTERPRET=1 was not set at import)"
    return None


def block_size() -> int:
    """Elements one Triton program of the copy kernels handles (its ``BLOCK``): a leaf several
    blocks long exercises the kernels' inner loop (the GPU bench's correctness cases)."""
    from . import _triton

    return _triton.BLOCK


def triton_available(device: torch.device | None = None) -> bool:
    """Whether the Triton path can run here: Triton importable, and CUDA present or the
    interpreter on; with ``device``, whether it can run on tensors of that device."""
    return _triton_problem(device) is None


def select(device: torch.device, impl: str | None = None) -> str:
    """The implementation used for tensors on ``device`` ("torch" or "triton").

    Raises:
      ValueError: an unknown ``impl``. RuntimeError: ``impl="triton"`` where Triton cannot
        run on ``device`` (the message says why).
    """
    impl = impl or os.environ.get("FDP_KERNELS") or "auto"
    if impl not in (*_IMPLS, "auto"):
        raise ValueError(f"fdp.kernels: impl must be 'torch', 'triton' or 'auto', got {impl!r}")
    if impl == "auto":
        if device.type == "cuda" and not _interpreting() and triton_available(device):
            return "triton"
        return "torch"
    if impl == "triton":
        problem = _triton_problem(device)
        if problem is not None:
            raise RuntimeError(f"fdp.kernels: impl='triton' cannot run here: {problem}")
    return impl


def flatten(
    srcs: Sequence[torch.Tensor],
    out: torch.Tensor,
    *,
    scale: float | None = None,
    impl: str | None = None,
) -> torch.Tensor:
    """Copy ``srcs`` (one dtype and device) back to back into the 1-D ``out``, scaled and cast.

    Sources may be non-contiguous, 0-d or empty. ``out.numel()`` must equal the sum of the
    sources' numels. Returns ``out``.
    """
    if impl != "torch" and select(out.device, impl) == "triton":
        from . import _triton

        return _triton.flatten(srcs, out, scale)
    return _torch.flatten(srcs, out, scale)


def unflatten(
    flat: torch.Tensor,
    outs: Sequence[torch.Tensor],
    *,
    impl: str | None = None,
) -> Sequence[torch.Tensor]:
    """Copy consecutive segments of the 1-D ``flat`` into ``outs`` (casting). Returns ``outs``."""
    if impl != "torch" and select(flat.device, impl) == "triton":
        from . import _triton

        _triton.unflatten(flat, outs)
        return outs
    _torch.unflatten(flat, outs)
    return outs


# ``views(flat, like)``: views into consecutive segments of the 1-D ``flat``, shaped like
# ``like`` (no copy; ``like`` may be storage-less ``device="meta"`` tensors: only their shapes
# are read). One C++ call makes every view (torch's ``unflatten_dense_tensors``), which is why
# fdp's bucket plans use it rather than slicing in Python. (The torch path's own function:
# there is one implementation, and a step calls it per bucket.)
views = _torch.unflatten_views


def flattener(device: torch.device, impl: str | None = None) -> Callable[..., torch.Tensor]:
    """``flatten`` for tensors on ``device``, its implementation chosen now (as ``select``):
    ``f(srcs, out, scale)``. A step machine takes one when it is built and calls it per
    bucket, without choosing again."""
    if select(device, impl) == "triton":
        from . import _triton

        return _triton.flatten
    return _torch.flatten
