"""Tree comparisons shared by the tests: a failure names the leaves that differ, by path."""

import torch

import fdp


def differing(a, b) -> list[str]:
    """Paths of the leaves of ``a`` and ``b`` that are not bit-identical (with a structure
    mismatch as one entry)."""
    pa, la, _ = fdp._tree.flatten_with_paths(a)
    pb, lb, _ = fdp._tree.flatten_with_paths(b)
    if list(pa) != list(pb):
        return [f"structure: {list(pa)[:4]}... vs {list(pb)[:4]}..."]
    return [p for p, x, y in zip(pa, la, lb)
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                    and torch.equal(x, y)) and not (not isinstance(x, torch.Tensor) and x == y)]


def assert_trees_equal(a, b, what: str) -> None:
    """``a`` and ``b`` have the same structure and bit-identical leaves."""
    bad = differing(a, b)
    assert not bad, f"{what}: {len(bad)} leaves differ: {bad[:6]}"
