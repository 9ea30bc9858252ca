"""fdp.kernels: multi-tensor flatten/unflatten with a fused scale and dtype cast.

``flatten(srcs, out, scale=s)`` writes ``(src.to(c) * s).to(out.dtype)`` for every source,
back to back, into the 1-D ``out``, where ``c`` is the widest of fp32 and the two dtypes:
"multiply in fp32 (fp64 for fp64), round once to the bucket dtype". For the usual case
(fp32 leaves, fp32/bf16/fp16 bucket) that is bit-identical to ``(x.float() * s).to(dtype)``.
``unflatten(flat, outs)`` copies consecutive segments of ``flat`` into ``outs`` (casting to
each output's dtype).

Two implementations, bit-identical to each other:

* ``"triton"``: one launch per call over a table of tensor pointers and offsets (the
  multi_tensor_apply pattern), used for CUDA tensors when Triton is installed;
* ``"torch"``: stock torch ops (``cat(out=)``, ``mul(out=)``, ``split_with_sizes_copy``),
  used everywhere else.

``impl=`` or the environment variable ``FDP_KERNELS=torch|triton`` forces one. Under
``TRITON_INTERPRET=1`` (set before this module is imported) the Triton kernels run on CPU
tensors, which is how the tests compare the two paths on a machine without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from . import _torch

__all__ = ["flatten", "unflatten", "select", "triton_available"]

_IMPLS = ("torch", "triton")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool:
    """Whether the Triton path can run here (Triton importable; CUDA or the interpreter)."""
    try:
        from . import _triton  # noqa: F401
    except ImportError:
        return False
    return True


def select(device: torch.device, impl: str | None = None) -> str:
    """The implementation used for tensors on ``device`` ("torch" or "triton")."""
    impl = impl or os.environ.get("FDP_KERNELS") or "auto"
    if impl not in (*_IMPLS, "auto"):
        raise ValueError(f"fdp.kernels: impl must be 'torch', 'triton' or 'auto', got {impl!r}")
    if impl == "auto":
        if device.type == "cuda" and not _interpreting() and triton_available():
            return "triton"
        return "torch"
    if impl == "triton" and not triton_available():
        raise RuntimeError("fdp.kernels: impl='triton' was requested but triton is not importable")
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
