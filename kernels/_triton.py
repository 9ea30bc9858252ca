"""Multi-tensor flatten/unflatten in Triton: one launch over a table of tensor pointers.

This is apex's ``multi_tensor_apply`` (and the pointer tables of Triton's grouped-GEMM
tutorial): the host writes one int64 table holding, per tensor, its data pointer, its
element count and its element offset in the flat buffer, then, per block of ``BLOCK``
elements, the tensor it belongs to and its chunk index inside that tensor. The grid is the
number of blocks; each program moves one chunk of one tensor. The table lives in device
memory (no 4 KB kernel-argument limit) and is cached per layout, keyed on every data pointer
and size, so a bucket whose tensors stay where they are costs no host-to-device copy.

Numerics follow ``kernels.flatten``: ``(src.to(c) * scale).to(out.dtype)`` with
``c = promote(promote(src, out), float32)``, rounding exactly as torch does. fp32 -> bf16
is rounded to nearest even with integer arithmetic on the bits, because the interpreter's
own ``.to(tl.bfloat16)`` truncates; 16-bit outputs of fp64 values go through fp32, as
torch's conversions do.

Triton runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set before
this module is imported: ``@triton.jit`` reads it). The interpreter is not thread-safe
(it patches ``triton.language`` for each launch), so every launch holds ``_LOCK``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.language import constexpr
from triton.runtime.interpreter import InterpretedFunction

from fdp._lru import LRU

__all__ = ["flatten", "unflatten", "interpreted", "BLOCK"]

BLOCK = 4096  # elements per program: 16 KiB of fp32, and few programs for the interpreter
# Fusion is off so that no multiply is ever contracted into an FMA: results equal torch's.
_LAUNCH = {"num_warps": 4, "enable_fp_fusion": False}
_ALIGN = 16  # bytes: the widest (128-bit) vector access

# One launch at a time: the interpreter is not thread-safe, and the table cache is shared.
_LOCK = threading.Lock()
TABLE_CACHE_SIZE = 64
TABLES: LRU[tuple, _Table] = LRU(TABLE_CACHE_SIZE)
_SCALES: LRU[tuple, torch.Tensor] = LRU(TABLE_CACHE_SIZE)

_TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


# constexpr parameters are annotated with the bare name: under postponed annotations the
# annotation is a string, and Triton 3.0's interpreter only treats "constexpr" (not
# "tl.constexpr") as a compile-time constant.
@triton.jit
def _round_to(y, OUT: constexpr):
    """``y`` (fp32 or fp64) rounded once to ``OUT`` the way torch rounds it."""
    if OUT == tl.bfloat16:
        y = y.to(tl.float32)  # fp64 goes through fp32, as torch's BFloat16(float) does
        bits = y.to(tl.uint32, bitcast=True)
        rne = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        # A NaN must stay a NaN (the bias could carry it into Inf): keep its top bits, quiet it.
        quiet_nan = (bits >> 16) | 0x40
        half = tl.where(y != y, quiet_nan, rne)
        return half.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif OUT == tl.float16:
        return y.to(tl.float32).to(tl.float16)
    else:
        return y.to(OUT)


@triton.jit
def _widen(x, COMPUTE: constexpr):
    """``x`` exactly in ``COMPUTE`` (fp32 or fp64)."""
    if x.dtype == tl.bfloat16:
        # bf16 is the top half of an fp32: widen by shifting the bits. The interpreter's own
        # conversion flushes bf16 subnormals to zero.
        x = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(COMPUTE)


@triton.jit
def _entry(table, n_tensors, n_blocks, pid):
    """Program ``pid``'s chunk index and its tensor's address, element count and flat offset."""
    t = tl.load(table + 3 * n_tensors + pid)
    chunk = tl.load(table + 3 * n_tensors + n_blocks + pid)
    return chunk, tl.load(table + t), tl.load(table + n_tensors + t), tl.load(table + 2 * n_tensors + t)


@triton.jit
def _move_block(src, dst, chunk, n, scale_ptr, COMPUTE: constexpr, OUT: constexpr,
                APPLY_SCALE: constexpr, BLOCK: constexpr):
    """Chunk ``chunk`` of an ``n``-element run: ``dst[i] = round(widen(src[i]) * scale)``."""
    offs = chunk * BLOCK + tl.arange(0, BLOCK)  # int64: chunk comes from an int64 table
    # A full block needs no mask; a mask against a size loaded at run time would stop the
    # compiler from using 128-bit accesses, so only the tail block is masked.
    if (chunk + 1) * BLOCK <= n:
        y = _widen(tl.load(src + offs), COMPUTE)
        if APPLY_SCALE:
            y = y * tl.load(scale_ptr)
        tl.store(dst + offs, _round_to(y, OUT))
    else:
        mask = offs < n
        y = _widen(tl.load(src + offs, mask=mask), COMPUTE)
        if APPLY_SCALE:
            y = y * tl.load(scale_ptr)
        tl.store(dst + offs, _round_to(y, OUT), mask=mask)


@triton.jit
def _flatten_kernel(
    table,
    out_ptr,
    scale_ptr,
    n_tensors,
    n_blocks,
    SRC: constexpr,
    COMPUTE: constexpr,
    OUT: constexpr,
    APPLY_SCALE: constexpr,
    PTR_DIV: constexpr,
    OFF_DIV: constexpr,
    BLOCK: constexpr,
):
    chunk, src_addr, n, dst_off = _entry(table, n_tensors, n_blocks, tl.program_id(0))
    src = src_addr.to(tl.pointer_type(SRC))
    # Alignment facts the host checked, so that loads and stores can be 128-bit wide (the
    # hint goes on the pointer: it does not survive an int-to-pointer cast).
    if PTR_DIV > 1:
        src = tl.multiple_of(src, PTR_DIV)
    if OFF_DIV > 1:
        dst_off = tl.multiple_of(dst_off, OFF_DIV)
    _move_block(src, out_ptr + dst_off, chunk, n, scale_ptr, COMPUTE, OUT, APPLY_SCALE, BLOCK)


@triton.jit
def _unflatten_kernel(
    table,
    flat_ptr,
    n_tensors,
    n_blocks,
    COMPUTE: constexpr,
    OUT: constexpr,
    PTR_DIV: constexpr,
    OFF_DIV: constexpr,
    BLOCK: constexpr,
):
    chunk, dst_addr, n, src_off = _entry(table, n_tensors, n_blocks, tl.program_id(0))
    dst = dst_addr.to(tl.pointer_type(OUT))
    if PTR_DIV > 1:
        dst = tl.multiple_of(dst, PTR_DIV)
    if OFF_DIV > 1:
        src_off = tl.multiple_of(src_off, OFF_DIV)
    # No scale here: scale_ptr is never read (APPLY_SCALE is a compile-time False).
    _move_block(flat_ptr + src_off, dst, chunk, n, flat_ptr, COMPUTE, OUT, False, BLOCK)


def interpreted() -> bool:
    """Whether the kernels were built for the interpreter (``TRITON_INTERPRET=1`` at import)."""
    return isinstance(_flatten_kernel, InterpretedFunction)


_INTERPRETER_PROBLEM: list[str | None] = []  # filled by the first interpreter_problem() call


def interpreter_problem() -> str | None:
    """Why the interpreter cannot be trusted here, or None (checked once, by a tiny launch).

    Triton 3.0's interpreter with numpy >= 2 runs kernels without storing anything
    (triton-lang/triton#4440): every result would be the output's old contents. A flatten
    of three known values is launched once; if they do not come back, the Triton path is
    refused with this message instead of returning garbage.
    """
    if not _INTERPRETER_PROBLEM:
        problem = None
        if interpreted():
            src = torch.tensor([1.0, -2.0, 3.5])
            got = flatten([src], torch.zeros(3), None)
            if not torch.equal(got, src):
                import numpy

                problem = (f"Triton {triton.__version__}'s interpreter failed a self-test under numpy "
                           f"{numpy.__version__} (a flatten of [1, -2, 3.5] returned {got.tolist()}); "
                           "Triton 3.0's interpreter stores nothing with numpy >= 2 "
                           "(triton-lang/triton#4440): install numpy<2 or a newer triton")
        _INTERPRETER_PROBLEM.append(problem)
    return _INTERPRETER_PROBLEM[0]


class _Table:
    """A device-resident pointer table and the alignment facts the launch passes as hints."""

    __slots__ = ("data", "n_tensors", "n_blocks", "ptr_div", "off_div")

    def __init__(self, ptrs: list[int], sizes: list[int], offsets: list[int], device: torch.device):
        blk_tensor: list[int] = []
        blk_chunk: list[int] = []
        for i, n in enumerate(sizes):
            nb = -(-n // BLOCK)
            blk_tensor += [i] * nb
            blk_chunk += range(nb)
        host = torch.tensor(ptrs + sizes + offsets + blk_tensor + blk_chunk, dtype=torch.int64)
        self.data = host.to(device)
        self.n_tensors = len(sizes)
        self.n_blocks = len(blk_tensor)
        # Largest power of two up to 16 dividing every pointer (bytes) / every offset (elements).
        self.ptr_div = _pow2_divisor(ptrs)
        self.off_div = _pow2_divisor(offsets)


def _pow2_divisor(values: list[int]) -> int:
    div = _ALIGN
    for v in values:
        while v % div:
            div //= 2
    return div


def _table(ptrs: list[int], sizes: list[int], offsets: list[int] | None, device: torch.device) -> _Table:
    """The cached table for this layout (``offsets=None``: segments back to back from 0).

    Keyed on every pointer, size and offset: a hit means the same addresses, so the cached
    table is exactly what would be rebuilt. It holds addresses, never the tensors.
    """
    key = (device, tuple(ptrs), tuple(sizes), None if offsets is None else tuple(offsets))

    def make() -> _Table:
        starts = offsets
        if starts is None:
            starts, o = [], 0
            for n in sizes:
                starts.append(o)
                o += n
        return _Table(ptrs, sizes, starts, device)

    return TABLES.get(key, make)


def _vector_div(off_div: int, base: torch.Tensor) -> int:
    """The element-offset multiple to promise for 128-bit access into ``base``, or 1."""
    itemsize = base.element_size()
    if base.data_ptr() % _ALIGN or off_div * itemsize % _ALIGN:
        return 1
    return _ALIGN // itemsize


def _scale_tensor(scale: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # The scale is read from memory in the compute dtype: a float kernel argument would be
    # rounded to fp32 even where the product is fp64. Keyed on the bits: 0.0 == -0.0.
    key = (scale.hex(), dtype, device)
    return _SCALES.get(key, lambda: torch.tensor([scale], dtype=dtype, device=device))


def _check_device(device: torch.device) -> None:
    if interpreted():
        if device.type != "cpu":
            raise RuntimeError(
                f"fdp.kernels (triton): under TRITON_INTERPRET=1 Triton runs on CPU tensors only, got "
                f"a {device} tensor (the interpreter would dereference device pointers on the host)"
            )
    elif device.type != "cuda":
        raise RuntimeError(
            f"fdp.kernels (triton): Triton needs CUDA tensors, got a {device} tensor (set "
            "TRITON_INTERPRET=1 before fdp.kernels is imported to interpret on CPU, or use impl='torch')"
        )


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a launch runs in.

    Triton launches on the current CUDA device, so that is made the tensors' one. The
    interpreter computes with numpy, which warns where a cast overflows to Inf or meets a
    NaN; those are the intended results (torch gives them silently), so numpy is told not
    to warn (``errstate`` is thread-local).
    """
    if device.type == "cuda":
        return torch.cuda.device(device)
    import numpy  # the interpreter's own dependency; only reached when interpreting

    return numpy.errstate(all="ignore")


def _tl_dtype(dtype: torch.dtype, what: str) -> tl.dtype:
    try:
        return _TL_DTYPES[dtype]
    except KeyError:
        raise TypeError(
            f"fdp.kernels (triton): {what} has dtype {dtype}; only float16, bfloat16, float32 "
            "and float64 are supported"
        ) from None


def _compute_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return torch.promote_types(torch.promote_types(a, b), torch.float32)


def flatten(srcs: Sequence[torch.Tensor], out: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Write ``(src.to(c) * scale).to(out.dtype)`` for every source back to back into ``out``.

    Args:
      srcs: tensors of one floating dtype on ``out``'s device, any shape and strides
        (strided ones are made contiguous first: the table holds one pointer per tensor).
      out: a 1-D floating tensor with as many elements as all sources together.
      scale: the factor, or None for a plain copy/cast.

    Returns:
      ``out``.

    Raises:
      RuntimeError: a device Triton cannot run on here. ValueError: mixed dtypes or
        devices, or a size mismatch. TypeError: a non-floating dtype.
    """
    if out.dim() != 1:
        raise ValueError(f"fdp.kernels.flatten: out must be 1-D, got shape {tuple(out.shape)}")
    _check_device(out.device)
    out_tl = _tl_dtype(out.dtype, "out")
    if not srcs:
        if out.numel():
            raise ValueError(f"fdp.kernels.flatten: no sources for an out of {out.numel()} elements")
        return out
    src_dtype = srcs[0].dtype
    src_tl = _tl_dtype(src_dtype, "the sources")
    for t in srcs:
        if t.dtype != src_dtype or t.device != out.device:
            raise ValueError(
                "fdp.kernels.flatten: sources must share one dtype and out's device, got "
                f"{t.dtype} on {t.device} next to {src_dtype}, out on {out.device}"
            )
    # `keep` holds every tensor the table points to (strided sources replaced by contiguous
    # copies) until the launch is issued; after that, the caching allocator orders any
    # reuse of their memory after the kernel on this stream.
    keep = [t if t.is_contiguous() else t.contiguous() for t in srcs]
    sizes = [t.numel() for t in keep]
    total = sum(sizes)
    if total != out.numel():
        raise ValueError(f"fdp.kernels.flatten: out has {out.numel()} elements, the sources {total}")
    if total == 0:
        return out
    dst = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
    compute = _compute_dtype(src_dtype, out.dtype)
    with _LOCK, _on(out.device):
        table = _table([t.data_ptr() for t in keep], sizes, None, out.device)
        scale_t = table.data if scale is None else _scale_tensor(float(scale), compute, out.device)
        _flatten_kernel[(table.n_blocks,)](
            table.data, dst, scale_t, table.n_tensors, table.n_blocks,
            SRC=src_tl, COMPUTE=_TL_DTYPES[compute], OUT=out_tl,
            APPLY_SCALE=scale is not None,
            PTR_DIV=table.ptr_div,
            OFF_DIV=_vector_div(table.off_div, dst),
            BLOCK=BLOCK, **_LAUNCH,
        )
    del keep
    if dst is not out:
        out.copy_(dst)
    return out


def unflatten(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    """Copy consecutive segments of the 1-D ``flat`` into ``outs``, each cast to its dtype.

    One launch per distinct output dtype (one in the usual case: the dtype is a compile-time
    constant of the kernel). Strided outputs are written through a contiguous stand-in.

    Args:
      flat: a 1-D floating tensor with as many elements as all outputs together.
      outs: floating tensors on ``flat``'s device, any shapes, strides and dtypes.

    Raises:
      RuntimeError: a device Triton cannot run on here. ValueError: a device or size
        mismatch. TypeError: a non-floating dtype.
    """
    if flat.dim() != 1:
        raise ValueError(f"fdp.kernels.unflatten: flat must be 1-D, got shape {tuple(flat.shape)}")
    _check_device(flat.device)
    _tl_dtype(flat.dtype, "flat")
    for t in outs:
        if t.device != flat.device:
            raise ValueError(f"fdp.kernels.unflatten: an output is on {t.device}, flat on {flat.device}")
        _tl_dtype(t.dtype, "an output")
    sizes = [t.numel() for t in outs]
    if sum(sizes) != flat.numel():
        raise ValueError(f"fdp.kernels.unflatten: flat has {flat.numel()} elements, the outputs {sum(sizes)}")
    if flat.numel() == 0:
        return
    src = flat if flat.is_contiguous() else flat.contiguous()
    # Per output dtype: destination pointers, sizes and offsets into `flat`. `keep` holds
    # the contiguous stand-ins of strided outputs while the table points at them.
    groups: dict[torch.dtype, tuple[list[int], list[int], list[int]]] = {}
    keep: list[tuple[torch.Tensor, torch.Tensor]] = []
    o = 0
    for t, n in zip(outs, sizes):
        if n:
            dst = t
            if not t.is_contiguous():
                dst = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                keep.append((t, dst))
            ptrs, lens, offs = groups.setdefault(t.dtype, ([], [], []))
            ptrs.append(dst.data_ptr())
            lens.append(n)
            offs.append(o)
        o += n
    single = len(groups) == 1
    with _LOCK, _on(flat.device):
        for dtype, (ptrs, lens, offs) in groups.items():
            # One dtype: the segments are back to back from 0 (a cheaper cache key).
            table = _table(ptrs, lens, None if single else offs, flat.device)
            _unflatten_kernel[(table.n_blocks,)](
                table.data, src, table.n_tensors, table.n_blocks,
                COMPUTE=_TL_DTYPES[_compute_dtype(flat.dtype, dtype)], OUT=_TL_DTYPES[dtype],
                PTR_DIV=table.ptr_div,
                OFF_DIV=_vector_div(table.off_div, src),
                BLOCK=BLOCK, **_LAUNCH,
            )
    for t, dst in keep:
        t.copy_(dst)
