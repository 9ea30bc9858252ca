"""Multi-tensor flatten/unflatten with stock torch ops (every device; the CPU path).

Why it is shaped like this (``python -m fdp.bench kernels`` and ``micro``; the figures are in
docs/measurements.md):

* Every torch op costs microseconds of dispatch, and so does every tensor made from
  Python (``t.view(-1)`` alone: ``micro``'s row "view(-1)"), so the work is organised to need few per-leaf
  Python operations: a run of leaves goes to one ``torch._chunk_cat`` call, which flattens
  tensors of any shape in C++, and which leaves form which run is planned once per tuple of
  sizes and cached.
* On CPU, ``cat`` uses a tight memcpy loop only when its output has fewer than 32768
  elements (ATen's GRAIN_SIZE) or torch runs one thread; otherwise it builds a
  TensorIterator per input, a few us each. With several threads, runs of small leaves are
  therefore cut into groups of fewer than 32768 elements; with one, a plain flatten is a
  single call whatever the leaves.
* A scale in the leaves' own dtype (fp32 -> fp32, fp64 -> fp64) is a gather and then one
  in-place multiply of the whole bucket: the second pass over the bytes costs less than an
  op per leaf (the "flatten+scale" row of ``python -m fdp.bench kernels``).
  Only when every leaf is contiguous: ``_chunk_cat`` copies a strided leaf into a temporary
  before gathering it (all of them at once, which raised the peak memory of the benchmark MLP,
  whose weight gradients are transposes), while a multiply per leaf reads it in place. For
  the same reason a plain copy with strided leaves goes through ``_foreach_copy_`` into the
  leaves' views of ``out``.
  With a cast (fp32 -> bf16, 16-bit sources), a big leaf is multiplied straight into
  ``out`` in one op (TensorIterator's casting loop, measured no slower here than a multiply
  into an L2-resident scratch plus a vectorised cast-copy, and one op instead of two).
  Small leaves stream through a scratch chunk that stays in L2: gather, multiply in
  place, one cast-copy into ``out``, so only the last pass touches memory.

The numerics are the reference's exactly: the product is formed in the compute dtype
``c = promote(promote(src, out), float32)`` (16-bit values are widened exactly first) and
rounded once to ``out``'s dtype by torch's own conversion.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# (absolute imports: this folder is also importable as a top-level "kernels" from the checkout)
from fdp import _internals
from fdp._lru import LRU

# cat's memcpy loop runs below this many output elements (ATen's internal GRAIN_SIZE).
_SERIAL_CAT = 32768
# Leaves under this many elements are gathered in groups of at least _MIN_GROUP leaves
# (fewer than _SERIAL_CAT elements per group): each group is one call, its copies one
# tight loop. Bigger leaves, and small ones too few in a row to be worth a call of their
# own, go through one cat per run: a few us per leaf, small next to their bytes.
_SMALL_LEAF = 8192
_MIN_GROUP = 4
# Elements per scratch chunk on CPU: 2 MiB of fp32, about one core's L2 on the dev VM, so a
# chunk is still cached when it is multiplied and cast (measured best of 128 K .. 1 M).
_CHUNK = 524288
_PLAN_CACHE_SIZE = 256
_PLANS: LRU[tuple, _Plan] = LRU(_PLAN_CACHE_SIZE)
_SCRATCH = threading.local()  # simulated ranks are threads: one scratch set per thread


def _probe_chunk_cat_strided() -> bool:
    """Whether ``_chunk_cat`` takes sources that cannot be viewed flat (torch 2.4 views them)."""
    try:
        _internals.chunk_cat([torch.zeros(2, 2).t()], 0, 1, out=torch.empty(1, 4))
    except RuntimeError:
        return False
    return True


def _probe_unflatten_keeps_empty_shapes() -> bool:
    """Whether ``unflatten_dense_tensors`` shapes an empty segment like its tensor (torch 2.4
    returns a 1-D ``[0]`` tensor for every empty one)."""
    return _internals.unflatten_dense_tensors(torch.empty(0), [torch.empty(0, 1)])[0].shape == (0, 1)


_CHUNK_CAT_STRIDED = _probe_chunk_cat_strided()
_CHUNK_CAT_DTYPES: dict[torch.dtype, bool] = {}


def _chunk_cat_takes(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``_chunk_cat`` copies ``dtype`` on ``device`` (torch 2.4's CPU kernel has no
    float8: "cat_serial_kernel" not implemented for 'Float8_e4m3fn'). Probed once per dtype."""
    if device.type != "cpu":
        return True
    ok = _CHUNK_CAT_DTYPES.get(dtype)
    if ok is None:
        try:
            _internals.chunk_cat([torch.zeros(1, dtype=dtype)], 0, 1, out=torch.empty(1, 1, dtype=dtype))
            ok = True
        except RuntimeError:
            ok = False
        _CHUNK_CAT_DTYPES[dtype] = ok
    return ok
_UNFLATTEN_KEEPS_EMPTY_SHAPES = _probe_unflatten_keeps_empty_shapes()


def unflatten_views(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``unflatten_dense_tensors(flat, like)``: views of consecutive segments of ``flat``
    shaped like ``like``, empty segments included on every supported torch."""
    views = _internals.unflatten_dense_tensors(flat, list(like))
    if not _UNFLATTEN_KEEPS_EMPTY_SHAPES:
        views = [v if v.shape == t.shape else v.view(t.shape) for v, t in zip(views, like)]
    return views


@dataclass
class _Run:
    """Leaves ``i..j-1`` (none empty or 0-d) at ``out[a:a + n]``: one ``_chunk_cat``."""

    i: int
    j: int
    a: int
    n: int


@dataclass
class _Chunk:
    """Small leaves at ``out[a:a + n]`` (``n <= _CHUNK``), gathered by ``parts``: tuples
    ``(i, j, lo, hi)`` of leaves ``i..j-1`` going to ``[lo, hi)`` of the chunk, each part
    under ``_SERIAL_CAT`` elements. A 0-d leaf is a part of its own (``_chunk_cat`` crashes
    on a list of only 0-d tensors and rejects them next to others)."""

    a: int
    n: int
    parts: list[tuple[int, int, int, int]]


@dataclass(frozen=True)
class _Plan:
    total: int
    steps: list[_Run | _Chunk]
    scalars: frozenset[int]  # indices of 0-d leaves
    whole: bool  # no empty or 0-d leaf: one ``_chunk_cat`` can take them all


@dataclass(frozen=True)
class _Limits:
    small: int  # leaves under this many elements may be grouped
    serial: int  # a group has fewer elements than this
    min_group: int  # and at least this many leaves
    chunk: int  # a chunk has at most this many elements


# With one thread, cat's memcpy loop runs at any size: a group may fill its chunk.
# Off the CPU there is no cache to stream through and every op is a kernel launch: all
# leaves form one group in one chunk (one gather, one multiply, one cast).
_CPU = _Limits(_SMALL_LEAF, _SERIAL_CAT, _MIN_GROUP, _CHUNK)
_CPU_1_THREAD = _Limits(_SMALL_LEAF, _CHUNK, _MIN_GROUP, _CHUNK)
_DEVICE = _Limits(1 << 62, 1 << 62, 1, 1 << 62)


def _build_plan(sizes: Sequence[int], scalars: Sequence[int], lim: _Limits) -> _Plan:
    """Cut the leaves into runs and chunks (empty leaves are skipped; they move nothing)."""
    steps: list[_Run | _Chunk] = []
    scalar_set = frozenset(scalars)

    def run(i: int, j: int, a: int, n: int) -> None:
        last = steps[-1] if steps else None
        if isinstance(last, _Run) and last.j == i:  # leaf i follows the run: extend it
            last.j, last.n = j, last.n + n
        else:
            steps.append(_Run(i, j, a, n))

    def part(i: int, j: int, a: int, n: int) -> None:
        last = steps[-1] if steps else None
        if not (isinstance(last, _Chunk) and last.a + last.n == a and last.n + n <= lim.chunk):
            last = _Chunk(a, 0, [])
            steps.append(last)
        last.parts.append((i, j, last.n, last.n + n))
        last.n += n

    pending = None  # [first leaf, offset, elements] of the small leaves not yet placed

    def flush(k: int) -> None:
        nonlocal pending
        if pending is not None:
            i, a, n = pending
            (part if k - i >= lim.min_group else run)(i, k, a, n)
            pending = None

    a = 0
    for k, n in enumerate(sizes):
        if n == 0:
            flush(k)
        elif k in scalar_set:
            flush(k)
            part(k, k + 1, a, 1)
        elif n < lim.small:
            if pending is not None and pending[2] + n >= lim.serial:
                flush(k)
            if pending is None:
                pending = [k, a, 0]
            pending[2] += n
        else:
            flush(k)
            run(k, k + 1, a, n)
        a += n
    flush(len(sizes))
    return _Plan(a, steps, scalar_set, not scalar_set and 0 not in sizes)


def _plan(srcs: Sequence[torch.Tensor], device: torch.device) -> _Plan:
    # The key costs two C-level passes over the leaves: at 2,000 small leaves that is already
    # a noticeable fraction of a copy of their bytes, so nothing more is looked at.
    sizes = tuple(map(torch.Tensor.numel, srcs))
    dims = tuple(map(torch.Tensor.dim, srcs))
    scalars = tuple(k for k, d in enumerate(dims) if not d) if 0 in dims else ()
    limits = _DEVICE if device.type != "cpu" else _CPU_1_THREAD if torch.get_num_threads() == 1 else _CPU
    key = (sizes, scalars, limits)
    plan = _PLANS.table.get(key)
    return plan if plan is not None else _PLANS.put(key, _build_plan(sizes, scalars, limits))


def _scratch(dtype: torch.dtype, n: int, device: torch.device) -> torch.Tensor:
    """``n`` elements of scratch: a per-thread buffer reused across calls on CPU."""
    if device.type != "cpu":
        return torch.empty(n, dtype=dtype, device=device)
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < n:
        buf = bufs[dtype] = torch.empty(max(n, _CHUNK), dtype=dtype)
    return buf[:n]


def _gather(plan: _Plan, srcs: Sequence[torch.Tensor], chunk: _Chunk, dst: torch.Tensor) -> None:
    """Copy the chunk's leaves back to back into ``dst`` (casting to its dtype)."""
    # Every part's view of `dst` from one call, before the first copy (as in _scaled).
    views = dst.view(1, -1).split([hi - lo for _, _, lo, hi in chunk.parts], dim=1)
    for (i, j, _, _), view in zip(chunk.parts, views):
        if i in plan.scalars:
            view.copy_(srcs[i].view(1, 1))
        else:
            _internals.chunk_cat(srcs[i:j], 0, 1, out=view)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def flatten(srcs: Sequence[torch.Tensor], out: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Write ``(src.to(c) * scale).to(out.dtype)`` for all ``srcs`` back to back into ``out``.

    Args:
      srcs: tensors of one dtype on ``out``'s device; any shapes and strides.
      out: a 1-D tensor with as many elements as all sources together.
      scale: the factor, or None for a plain copy/cast.

    Returns:
      ``out``.
    """
    if not srcs:
        if out.numel():
            raise ValueError(f"fdp.kernels.flatten: no sources for an out of {out.numel()} elements")
        return out
    if not _CHUNK_CAT_STRIDED:
        srcs = [t if t.is_contiguous() else t.reshape(-1) for t in srcs]
    plan = _plan(srcs, out.device)
    if plan.total != out.numel():
        raise ValueError(f"fdp.kernels.flatten: out has {out.numel()} elements, the sources {plan.total}")
    if not out.is_contiguous():  # e.g. a strided 1-D view: go through a contiguous buffer
        tmp = flatten(srcs, torch.empty(out.shape, dtype=out.dtype, device=out.device), scale)
        return out.copy_(tmp)
    with torch.no_grad():
        if not _chunk_cat_takes(srcs[0].dtype, out.device):
            # A dtype cat cannot gather here: one copy per leaf into its view of ``out``
            # (scaled in the widened dtype first, as _scaled computes it).
            if scale is not None:
                compute = torch.promote_types(torch.promote_types(srcs[0].dtype, out.dtype), torch.float32)
                srcs = [t.to(compute) for t in srcs]
                torch._foreach_mul_(srcs, scale)
            torch._foreach_copy_(unflatten_views(out, srcs), list(srcs))
        elif scale is None:
            if all(map(torch.Tensor.is_contiguous, srcs)):
                _copy(plan, srcs, out)
            else:  # strided leaves are read in place (_chunk_cat would copy each one first)
                torch._foreach_copy_(unflatten_views(out, srcs), list(srcs))
        elif (out.dtype == srcs[0].dtype and out.dtype in (torch.float32, torch.float64)
              and all(map(torch.Tensor.is_contiguous, srcs))):
            # The product is formed in the leaves' own dtype: gather, then one in-place
            # multiply (see the module docstring; 2,000 leaves: 2.0x instead of 2.7-2.8x).
            # Only for contiguous leaves: the gather would copy a strided one (a Linear's
            # weight gradient is a transpose) into a temporary first, where a multiply reads
            # it in place.
            _copy(plan, srcs, out)
            out.mul_(scale)
        else:
            _scaled(plan, srcs, out, scale)
    return out


def _copy(plan: _Plan, srcs: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    src_dtype = srcs[0].dtype
    if plan.whole and out.dtype == src_dtype and (out.device.type != "cpu" or torch.get_num_threads() == 1):
        # One call: with one thread (or off the CPU) cat's fast path takes any number of leaves.
        _internals.chunk_cat(srcs, 0, 1, out=out.view(1, -1))
        return
    for step in plan.steps:
        o = out[step.a : step.a + step.n]
        if isinstance(step, _Run):
            _internals.chunk_cat(srcs[step.i : step.j], 0, 1, out=o.view(1, -1))
        elif out.dtype == src_dtype:
            _gather(plan, srcs, step, o)
        else:
            # A casting cat cannot use the memcpy loop: gather into scratch, then one
            # vectorised cast-copy.
            tmp = _scratch(src_dtype, step.n, out.device)
            _gather(plan, srcs, step, tmp)
            o.copy_(tmp)


def _scaled(plan: _Plan, srcs: Sequence[torch.Tensor], out: torch.Tensor, scale: float) -> None:
    src_dtype, out_dtype, device = srcs[0].dtype, out.dtype, out.device
    compute = torch.promote_types(torch.promote_types(src_dtype, out_dtype), torch.float32)
    piece = _CHUNK if device.type == "cpu" else 1 << 62
    for step in plan.steps:
        o = out[step.a : step.a + step.n]
        if isinstance(step, _Chunk):
            # Gather in the source dtype (memcpy loop), widen exactly if the source is
            # 16-bit, multiply in place, cast once into `out`: all but the last pass in L2.
            t = o if out_dtype == src_dtype else _scratch(src_dtype, step.n, device)
            _gather(plan, srcs, step, t)
            if src_dtype != compute:
                w = o if out_dtype == compute else _scratch(compute, step.n, device)
                w.copy_(t)
                t = w
            t.mul_(scale)
            if t is not o:
                o.copy_(t)
            continue
        run = srcs[step.i : step.j]
        if src_dtype == compute:
            # One op per leaf, straight into `out`: the product is formed in the source
            # dtype and rounded once to `out`'s. (Measured: for leaves this big, the casting
            # loop of an fp32 -> bf16 multiply is no slower than multiplying into an L2
            # scratch and cast-copying, and it is one op instead of two. The views of `out`
            # come from one C++ call, made before the first multiply: measurably faster
            # than making each between two multiplies.)
            for src, view in zip(run, _internals.unflatten_dense_tensors(o, list(run))):
                torch.mul(src, scale, out=view)
            continue
        a = 0
        for src in run:
            # A 16-bit source: torch would multiply in its own dtype, so widen it exactly
            # in scratch, piece by piece, multiply there, cast once into `out`.
            n = src.numel()
            flat = _flat(src)
            for p in range(0, n, piece):
                q = min(n, p + piece)
                _scale_piece(flat[p:q], o[a + p : a + q], scale, compute)
            a += n


def _scale_piece(x: torch.Tensor, o: torch.Tensor, scale: float, compute: torch.dtype) -> None:
    """``o = (x.to(compute) * scale).to(o.dtype)`` for a 16-bit piece that fits the scratch."""
    w = o if o.dtype == compute else _scratch(compute, x.numel(), x.device)
    w.copy_(x)
    w.mul_(scale)
    if w is not o:
        o.copy_(w)


def unflatten(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    """Copy consecutive segments of the 1-D ``flat`` into ``outs``, each cast to its dtype.

    ``unflatten_dense_tensors`` makes every segment's view, shaped like its output, in one
    C++ call, and ``_foreach_copy_`` copies (and casts) them in another: no per-leaf Python.

    Args:
      flat: a 1-D tensor with as many elements as all outputs together.
      outs: tensors of any shapes, strides and dtypes on ``flat``'s device.
    """
    if not outs:
        if flat.numel():
            raise ValueError(f"fdp.kernels.unflatten: flat has {flat.numel()} elements, no outputs")
        return
    total = sum(map(torch.Tensor.numel, outs))
    if total != flat.numel():
        raise ValueError(f"fdp.kernels.unflatten: flat has {flat.numel()} elements, the outputs {total}")
    with torch.no_grad():
        torch._foreach_copy_(list(outs), unflatten_views(flat, outs))
