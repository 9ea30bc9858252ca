"""fdp.kernels: the Triton path (interpreted on CPU) against the torch path, bit for bit.

conftest.py sets TRITON_INTERPRET=1 before anything imports fdp.kernels, so the Triton
kernels run on CPU tensors here. The interpreter costs about 1 ms per program and 2 ms per
launch, so tensors stay KB-sized and every source fits in a handful of BLOCK-sized programs.
"""

import contextlib
import importlib
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fdp import kernels

_torch = kernels._torch
try:
    _triton = importlib.import_module("fdp.kernels._triton")
except ImportError:  # no triton: the torch-path tests still run
    _triton = None
_interpreter_problem = _triton.interpreter_problem() if _triton is not None and _triton.interpreted() else None
needs_triton = pytest.mark.skipif(
    _triton is None or not _triton.interpreted() or _interpreter_problem is not None,
    reason="runs the Triton kernels in the interpreter (triton installed, TRITON_INTERPRET=1 before import"
    + (f"; here: {_interpreter_problem})" if _interpreter_problem else ")"),
)

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same dtype and shape, NaN in the same places, every other element bit-identical
    (so -0.0 differs from 0.0). NaN payloads may differ: torch itself has several."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    ia, ib = (x.contiguous().view(_INT_VIEW[x.element_size()]) for x in (a, b))
    diff = (ia != ib) & ~nan
    assert not diff.any(), f"{int(diff.sum())} elements differ, first at {diff.nonzero()[0].tolist()}: {a[diff][:4]} vs {b[diff][:4]}"


def compute_dtype(src: torch.dtype, out: torch.dtype) -> torch.dtype:
    return torch.promote_types(torch.promote_types(src, out), torch.float32)


def reference_flatten(srcs, out_dtype, scale):
    """The documented semantics in plain torch: multiply in c, round once to out's dtype."""
    c = compute_dtype(srcs[0].dtype, out_dtype)
    ref = torch.cat([t.to(c).reshape(-1) for t in srcs])
    if scale is not None:
        ref = ref * scale
    return ref.to(out_dtype)


def make_values(shape, dtype, seed, noncontig):
    """Random values with specials mixed in: NaN, +-inf, -0.0, tiny and huge magnitudes."""
    g = torch.Generator().manual_seed(seed)
    full = shape if not noncontig else (*shape[:-2], shape[-1], shape[-2])
    x = torch.randn(full, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-30, 30, full, generator=g).double())
    flat = x.view(-1)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 7e4, 3.4e38, 1 + 2**-8])
    k = min(flat.numel(), int(torch.randint(0, 4, (), generator=g)))
    if k:
        idx = torch.randint(0, flat.numel(), (k,), generator=g)
        flat[idx] = specials[torch.randint(0, len(specials), (k,), generator=g)].double()
    x = x.to(dtype)
    return x.transpose(-1, -2) if noncontig else x


shapes = st.one_of(
    st.just(()),
    st.tuples(st.integers(0, 700)),
    st.tuples(st.integers(0, 30), st.integers(1, 40)),
    st.tuples(st.integers(1, 3), st.integers(1, 9), st.integers(1, 11)),
)
leaves = st.lists(st.tuples(shapes, st.booleans()), min_size=1, max_size=6)
scales = st.one_of(
    st.none(), st.sampled_from([0.5, 1.0, 3.0, 1 / 3, 0.0, -0.0]),
    st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_subnormal=False),
)


@needs_triton
@settings(max_examples=150, deadline=None)
@given(leaves, st.sampled_from(FLOATS), st.sampled_from([None, torch.bfloat16, torch.float16, torch.float32]),
       scales, st.integers(0, 2**31))
@pytest.mark.slow  # (the Triton interpreter over many shapes)
def test_flatten_triton_equals_torch_bit_for_bit(specs, src_dtype, out_dtype, scale, seed):
    out_dtype = out_dtype or src_dtype
    srcs = [make_values(shape, src_dtype, seed + i, nc and len(shape) >= 2) for i, (shape, nc) in enumerate(specs)]
    n = sum(t.numel() for t in srcs)
    got = kernels.flatten(srcs, torch.full((n,), 5.0, dtype=out_dtype), scale=scale, impl="triton")
    want = kernels.flatten(srcs, torch.full((n,), 7.0, dtype=out_dtype), scale=scale, impl="torch")
    assert_bits_equal(got, want)
    assert_bits_equal(got, reference_flatten(srcs, out_dtype, scale))


@needs_triton
@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(shapes, st.booleans(), st.sampled_from(FLOATS)), min_size=1, max_size=5),
       st.sampled_from(FLOATS), st.integers(0, 2**31), st.integers(0, 3))
@pytest.mark.slow  # (the Triton interpreter)
def test_unflatten_triton_equals_torch_with_and_without_casts(specs, flat_dtype, seed, lead):
    sizes = [int(torch.Size(shape).numel()) for shape, _, _ in specs]
    # `lead` elements before the flat data: a storage offset, often an unaligned one.
    flat = make_values((lead + sum(sizes),), flat_dtype, seed, False)[lead:]
    outs = {}
    for impl in ("triton", "torch"):
        outs[impl] = [make_values(shape, dtype, 0, nc and len(shape) >= 2).zero_() for shape, nc, dtype in specs]
        assert kernels.unflatten(flat, outs[impl], impl=impl) is outs[impl]
    o = 0
    for (shape, _, dtype), n, got, want in zip(specs, sizes, outs["triton"], outs["torch"]):
        assert_bits_equal(got, want)
        assert_bits_equal(got, flat[o : o + n].view(shape).to(dtype))
        o += n


@needs_triton
@pytest.mark.parametrize("src_dtype", FLOATS)
@pytest.mark.parametrize("out_dtype", FLOATS)
def test_round_trip_every_dtype_pair(src_dtype, out_dtype):
    # Sizes around BLOCK exercise the unmasked full blocks and the masked tail.
    srcs = [make_values(s, src_dtype, i, False) for i, s in enumerate([(_triton.BLOCK + 3,), (2, 5), ()])]
    n = sum(t.numel() for t in srcs)
    flat = kernels.flatten(srcs, torch.empty(n, dtype=out_dtype), impl="triton")
    assert_bits_equal(flat, reference_flatten(srcs, out_dtype, None))
    back = [torch.empty_like(t) for t in srcs]
    kernels.unflatten(flat, back, impl="triton")
    for t, b in zip(srcs, back):
        assert_bits_equal(b, t.to(out_dtype).to(src_dtype))


@needs_triton
def test_bf16_rounds_to_nearest_even_like_torch():
    # Every fp32 bit pattern class around a bf16 rounding boundary: exact ties with an even
    # and an odd kept bit, one ulp either side, the carry into the exponent and into Inf,
    # subnormals, signed zeros, infinities and NaNs (quiet, signalling, negative).
    base = torch.tensor([0x3F800000, 0x3F810000, 0x7F7F0000, 0x00010000, 0x80010000, 0xBF7F0000])
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0xFFFF, 0x0000, 0x0001])
    bits = (base[:, None] | low[None, :]).reshape(-1)
    specials = torch.tensor([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF,
                             0x7F7FFFFF, 0x00000001, 0x007FFFFF])
    # int64 -> int32 keeps the low 32 bits: the fp32 patterns above, sign bit included.
    x = torch.cat([bits, specials]).to(torch.int32).view(torch.float32)
    for scale in (None, 1.0, 0.5):
        got = kernels.flatten([x], torch.empty(x.numel(), dtype=torch.bfloat16), scale=scale, impl="triton")
        assert_bits_equal(got, reference_flatten([x], torch.bfloat16, scale))
        # NaN stays NaN (the rounding bias must not carry a NaN's payload into Inf).
        assert torch.equal(got.isnan(), x.isnan())


@needs_triton
def test_fp64_to_16_bit_rounds_through_fp32_like_torch():
    # A double just above a bf16/fp16 tie that fp64 -> fp32 rounds onto the tie: torch
    # converts double -> float -> half, and so must the kernel.
    x = torch.tensor([1 + 2**-8 + 2**-40, 1 + 2**-11 + 2**-40, 1 - 2**-60, 65520.0 - 2**-30], dtype=torch.float64)
    for dtype in (torch.bfloat16, torch.float16):
        got = kernels.flatten([x], torch.empty(4, dtype=dtype), impl="triton")
        assert_bits_equal(got, x.to(dtype))


@needs_triton
def test_unaligned_views_and_strided_out():
    base = torch.randn(3 * _triton.BLOCK + 11)
    srcs = [base[1 : 1 + _triton.BLOCK + 1], base[_triton.BLOCK + 5 :: 3], base[7:9].view(2, 1)]
    n = sum(t.numel() for t in srcs)
    out = torch.zeros(2 * n + 1, dtype=torch.bfloat16)[1::2]  # strided 1-D out
    kernels.flatten(srcs, out, scale=0.25, impl="triton")
    assert_bits_equal(out, reference_flatten(srcs, torch.bfloat16, 0.25))
    flat = torch.randn(n + 1)[1:]
    outs = [torch.empty(s.shape, dtype=torch.float16) for s in srcs]
    kernels.unflatten(flat, outs, impl="triton")
    assert_bits_equal(torch.cat([o.reshape(-1) for o in outs]), flat.to(torch.float16))


@needs_triton
def test_pointer_tables_are_cached_per_layout_and_rebuilt_when_a_pointer_moves():
    _triton.TABLES.clear()
    a, b = torch.randn(10), torch.randn(3, 4)
    out = torch.empty(22)
    kernels.flatten([a, b], out, impl="triton")
    kernels.flatten([a, b], out, scale=2.0, impl="triton")
    assert len(_triton.TABLES) == 1  # same pointers and sizes: one table
    c = torch.randn(10)  # same layout, another address
    kernels.flatten([c, b], out, scale=2.0, impl="triton")
    assert len(_triton.TABLES) == 2
    assert torch.equal(out, torch.cat([c, b.reshape(-1)]) * 2)
    for _ in range(_triton.TABLE_CACHE_SIZE + 5):
        kernels.flatten([torch.randn(3)], torch.empty(3), impl="triton")
    assert len(_triton.TABLES) <= _triton.TABLE_CACHE_SIZE


@pytest.mark.slow  # (the Triton interpreter)
@needs_triton
def test_concurrent_launches_from_threads_are_serialised():
    # Simulated ranks are threads; the interpreter patches triton.language per launch, so
    # unguarded concurrent launches fail. Every thread must still get its own right answer.
    results, errors = {}, []
    barrier = threading.Barrier(4)

    def rank(r):
        try:
            g = torch.Generator().manual_seed(r)
            srcs = [torch.randn(n, generator=g) for n in (257, 15, 1, 100, 33, 7)]
            barrier.wait()
            for i in range(8):
                out = kernels.flatten(srcs, torch.empty(413, dtype=torch.bfloat16), scale=r + i, impl="triton")
                back = [torch.empty_like(t) for t in srcs]
                kernels.unflatten(out, back, impl="triton")
                results[r, i] = (out, back, srcs)
        except BaseException as e:  # collected and re-raised on the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 32
    for (r, i), (out, back, srcs) in results.items():
        assert_bits_equal(out, reference_flatten(srcs, torch.bfloat16, r + i))
        assert_bits_equal(torch.cat([b.reshape(-1) for b in back]), out.float())


@needs_triton
def test_clear_errors_on_bad_use(monkeypatch):
    x = torch.randn(4)
    with pytest.raises(ValueError, match="out has 5 elements, the sources 4"):
        kernels.flatten([x], torch.empty(5), impl="triton")
    with pytest.raises(ValueError, match="share one dtype"):
        kernels.flatten([x, x.double()], torch.empty(8), impl="triton")
    with pytest.raises(TypeError, match="int64"):
        kernels.flatten([x.long()], torch.empty(4), impl="triton")
    with pytest.raises(ValueError, match="1-D"):
        kernels.flatten([x], torch.empty(2, 2), impl="triton")
    with pytest.raises(ValueError, match="flat has 4 elements, the outputs 3"):
        kernels.unflatten(x, [torch.empty(3)], impl="triton")
    # The interpreter runs on CPU tensors only; it would dereference device pointers.
    with pytest.raises(RuntimeError, match="CPU tensors only"):
        kernels.select(torch.device("cuda"), "triton")
    # Without the interpreter, Triton needs CUDA tensors: CPU tensors get a clear error
    # both from the dispatcher and from the kernel module itself.
    monkeypatch.setattr(_triton, "interpreted", lambda: False)
    with pytest.raises(RuntimeError, match="Triton needs CUDA tensors"):
        kernels.select(torch.device("cpu"), "triton")
    with pytest.raises(RuntimeError, match="Triton needs CUDA tensors"):
        _triton.flatten([x], torch.empty(4), None)
    with pytest.raises(RuntimeError, match="Triton needs CUDA tensors"):
        _triton.unflatten(x, [torch.empty(4)])
    with pytest.raises(ValueError, match="impl must be"):
        kernels.select(torch.device("cpu"), "cuda")


@needs_triton
def test_auto_dispatch_keeps_cpu_tensors_on_torch(monkeypatch):
    monkeypatch.delenv("FDP_KERNELS", raising=False)
    assert kernels.select(torch.device("cpu")) == "torch"
    monkeypatch.setenv("FDP_KERNELS", "triton")
    assert kernels.select(torch.device("cpu")) == "triton"
    assert kernels.triton_available(torch.device("cpu"))


@needs_triton
def test_signed_zero_scales_are_not_confused():
    x = torch.tensor([-1.5, 2.0])
    for scale in (0.0, -0.0, 0.0):
        got = kernels.flatten([x], torch.empty(2), scale=scale, impl="triton")
        assert_bits_equal(got, x * scale)


@contextlib.contextmanager
def tiny_torch_limits(serial):
    """The torch path's CPU plan with limits small enough for KB-sized leaves to cross them:
    groups, chunks, runs and pieces all occur. ``serial`` is the group cap: 64 as with
    several threads, 150 (the chunk) as with one."""
    limits = _torch._Limits(small=40, serial=serial, min_group=3, chunk=150)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_torch, "_CPU", limits)
        mp.setattr(_torch, "_CPU_1_THREAD", limits)
        mp.setattr(_torch, "_CHUNK", 150)
        mp.setattr(_torch, "_SCRATCH", threading.local())
        _torch._PLANS.clear()
        try:
            yield
        finally:
            _torch._PLANS.clear()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([(), (0,), (1,), (3,), (7, 3), (2, 9), (41,), (63,), (200,), (5, 70)]),
                          st.booleans()), min_size=1, max_size=30),
       st.sampled_from(FLOATS), st.sampled_from([None, torch.bfloat16, torch.float16, torch.float32, torch.float64]),
       st.sampled_from([None, 0.5, 1 / 3, -3.0]), st.integers(0, 2**31), st.sampled_from([64, 150]))
def test_torch_path_plans_match_the_reference(specs, src_dtype, out_dtype, scale, seed, serial):
    out_dtype = out_dtype or src_dtype
    srcs = [make_values(shape, src_dtype, seed + i, nc and len(shape) >= 2) for i, (shape, nc) in enumerate(specs)]
    n = sum(t.numel() for t in srcs)
    with tiny_torch_limits(serial):
        got = kernels.flatten(srcs, torch.full((n,), 5.0, dtype=out_dtype), scale=scale, impl="torch")
        assert_bits_equal(got, reference_flatten(srcs, out_dtype, scale))
        # The same layout again reuses the cached plan (and the per-thread scratch).
        again = kernels.flatten(srcs, torch.full((n,), 6.0, dtype=out_dtype), scale=scale, impl="torch")
        assert_bits_equal(again, got)


def test_torch_path_checks_sizes():
    with pytest.raises(ValueError, match="out has 5 elements, the sources 4"):
        kernels.flatten([torch.randn(4)], torch.empty(5), impl="torch")
    with pytest.raises(ValueError, match="flat has 4 elements, the outputs 3"):
        kernels.unflatten(torch.randn(4), [torch.empty(3)], impl="torch")


@needs_triton
def test_an_interpreter_that_stores_nothing_is_refused(monkeypatch):
    # Triton 3.0's interpreter under numpy >= 2 launches kernels that store nothing; fdp's
    # one-time self-test must catch that and refuse the Triton path by name, not return the
    # output's old contents. Simulate it with a flatten that writes nothing.
    monkeypatch.setattr(_triton, "_INTERPRETER_PROBLEM", [])
    monkeypatch.setattr(_triton, "flatten", lambda srcs, out, scale: out)
    assert "self-test" in _triton.interpreter_problem()
    assert not kernels.triton_available(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="numpy<2 or a newer triton"):
        kernels.flatten([torch.ones(2)], torch.empty(2), impl="triton")
