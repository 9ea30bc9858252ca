"""Tree comparisons shared by the tests: a failure names the leaves that differ, by path."""

import torch

import fdp


def differing(a, b) -> list[str]:
    """The leaves of ``a`` and ``b`` that are not the same: tensors of another dtype or other
    bits, plain values that are not equal, or the trees' structures (one entry)."""
    pa, la, _ = fdp._tree.flatten_with_paths(a)
    pb, lb, _ = fdp._tree.flatten_with_paths(b)
    if list(pa) != list(pb):
        return [f"structure: {list(pa)[:4]}... against {list(pb)[:4]}..."]
    out = []
    for p, x, y in zip(pa, la, lb):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape:
                out.append(f"{p} ({x.dtype}{tuple(x.shape)} against {y.dtype}{tuple(y.shape)})")
            elif not torch.equal(x, y):
                gap = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
                out.append(f"{p} (max {gap:.3g})")
        elif type(x) is not type(y) or x != y:
            out.append(f"{p} ({x!r} against {y!r})")
    return out


def assert_trees_equal(a, b, what: str = "trees") -> None:
    """``a`` and ``b`` have the same structure and bit-identical leaves (plain leaves equal)."""
    bad = differing(a, b)
    assert not bad, f"{what}: {len(bad)} leaves differ: {bad[:6]}"
