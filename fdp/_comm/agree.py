"""Cross-rank agreement: the small collectives that check ranks are about to do the same thing.

Before two ranks exchange data they must agree on its layout; fdp checks that with one
all-gather of a digest (``verify_layout``), and names the first differing leaf and ranks
only when the digests differ. The same file holds the other agreements: a flag counted over
the ranks (``count_ranks``, ``any_rank``) or named by rank (``which_ranks``), the active
ranks of an uneven step (``count_and_check_active``), and debug mode's fingerprint of each
collective before it is issued (``check_collective``).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from .. import _tree
from .._errors import ReplicaMismatchError
from .collectives import all_gather, all_gather_object, all_reduce
from .group import Group, resolve

Meta = tuple[str, tuple[int, ...], str]  # (path, shape, dtype)


# ---------------------------------------------------------------------------- layout checks


def tree_meta(tree: Any) -> tuple[list[Meta], list[Any]]:
    paths, leaves, _ = _tree.flatten_with_paths(tree)
    meta = []
    for p, t in zip(paths, leaves):
        if isinstance(t, torch.Tensor):
            meta.append((p, tuple(t.shape), str(t.dtype).replace("torch.", "")))
        else:
            meta.append((p, (), type(t).__name__))
    return meta, leaves


def digest(meta: Sequence[Any], extra: str = "") -> torch.Tensor:
    h = hashlib.sha256(extra.encode())
    for m in meta:
        h.update(repr(m).encode())
    d = h.digest()
    return torch.tensor(
        [len(meta), int.from_bytes(d[:7], "little"), int.from_bytes(d[7:14], "little")],
        dtype=torch.int64,
    )


def verify_layout(meta: Sequence[Meta], group: Group, what: str, extra: str = "") -> None:
    """Raise ``ReplicaMismatchError`` on every rank unless all ranks have the same layout.

    One tiny all-gather of (leaf count, digest) when they agree; when they do not, a second
    gather of the full metadata so the error can name the first differing leaf and ranks.
    """
    verify_digest(digest(meta, extra), lambda: (list(meta), extra), group, what)


def verify_digest(mine: torch.Tensor, report: Any, group: Group, what: str) -> None:
    if group.process_group is None:
        return
    rows = all_gather(mine.to(group.device), group, f"{what} (layout check)").cpu()
    if bool((rows == rows[0]).all()):
        return
    everyone = all_gather_object(report(), group, f"{what} (layout report)")
    raise ReplicaMismatchError(f"fdp: {what}: " + describe_layouts(everyone) + f" (reported on rank {group.rank})")


def describe_layouts(everyone: list[tuple[list[Meta], str]]) -> str:
    ref, ref_extra = everyone[0]
    problems = []
    for r, (meta, extra) in enumerate(everyone[1:], start=1):
        if len(meta) != len(ref):
            problems.append(f"rank 0 has {len(ref)} leaves but rank {r} has {len(meta)}")
            n = min(len(meta), len(ref))
            longer, who = (ref, 0) if len(ref) > len(meta) else (meta, r)
            if longer[n:]:
                problems[-1] += f" (first extra leaf on rank {who}: {longer[n][0]})"
            continue
        for a, b in zip(ref, meta):
            if a != b:
                if a[0] != b[0]:
                    problems.append(f"leaf {a[0]} on rank 0 is {b[0]} on rank {r}")
                else:
                    problems.append(
                        f"leaf {a[0]} has shape {a[1]} {a[2]} on rank 0 but {b[1]} {b[2]} on rank {r}"
                    )
                break
        else:
            if extra != ref_extra:
                problems.append(f"rank 0 uses {ref_extra} but rank {r} uses {extra}")
    return "ranks disagree (compared with rank 0): " + "; ".join(problems)


def count_ranks(flag: bool, group: Group, what: str = "fdp.count_ranks") -> int:
    """How many ranks passed a true ``flag`` (the same number on every rank)."""
    if group.process_group is None:
        return int(bool(flag))
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=group.device)
    all_reduce(t, group, what)
    return int(t.item())


def which_ranks(flag: bool, group: Group, what: str) -> list[int]:
    """The ranks that passed a true ``flag``, in order (the same list on every rank): who
    failed, for an error that names them. One small all-gather."""
    if group.process_group is None:
        return [0] if flag else []
    rows = all_gather(torch.tensor([1 if flag else 0], dtype=torch.int64, device=group.device), group, what)
    return [r for r, v in enumerate(rows.view(-1).tolist()) if v]


def count_and_check_active(active: bool | None, group: Group, what: str) -> int:
    """Number of active ranks for ``all_reduce(active=...)``, checking that every rank passed it.

    One 2-element all-reduce carries (active, passed); ranks that passed ``active=`` and
    ranks that did not would otherwise issue different collectives and hang until the
    timeout. Raises ``ReplicaMismatchError`` on every rank when they disagree.
    """
    if group.process_group is None:
        return 1 if active is None else int(bool(active))
    t = torch.tensor([1 if active is None or active else 0, 0 if active is None else 1],
                     dtype=torch.int64, device=group.device)
    all_reduce(t, group, what)
    n, passed = (int(v) for v in t.tolist())
    if 0 < passed < group.size:
        mine = "passed active=" if active is not None else "did not pass active="
        raise ReplicaMismatchError(
            f"fdp: {what}: {passed} of {group.size} ranks passed active= and the others did not; "
            f"every rank must pass it, or none (rank {group.rank} {mine})"
        )
    return n


# ---------------------------------------------------------------------------- debug mode

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# Every dtype this torch knows, by code: a peer's code is named even if this process never
# used that dtype (the table used to hold only the dtypes seen locally, so a gloo peer's
# bfloat16 printed as a raw number).
_DTYPE_NAMES: dict[int, str] = {
    zlib.crc32(_dtype_name(d).encode()): _dtype_name(d)
    for d in (getattr(torch, n, None) for n in dir(torch)) if isinstance(d, torch.dtype)
}


def _dtype_code(dtype: torch.dtype) -> int:
    name = _dtype_name(dtype)
    code = zlib.crc32(name.encode())  # the same number in every process
    _DTYPE_NAMES.setdefault(code, name)
    return code


def check_collective(group: Group, step: int, bucket: int, numel: int, dtype: torch.dtype, what: str) -> None:
    """Debug mode: before a bucket collective, check that every rank issues the same one."""
    code = _dtype_code(dtype)
    mine = torch.tensor([step, bucket, numel, code], dtype=torch.int64, device=group.device)
    rows = all_gather(mine, group, f"{what} (debug fingerprint)").cpu()
    if bool((rows == rows[0]).all()):
        return
    shown = "; ".join(
        f"rank {r}: (seq={int(s)}, bucket={int(b)}, numel={int(n)}, dtype={_DTYPE_NAMES.get(int(c), int(c))})"
        for r, (s, b, n, c) in enumerate(rows.tolist())
    )
    raise ReplicaMismatchError(
        f"fdp debug: ranks are about to issue different collectives ({what}): {shown}. "
        f"Without debug mode this would hang or mix data. (seq: fdp's own count of such collectives, not your "
        f"training step; reported on rank {group.rank})"
    )


def any_rank(flag: bool, group: Group | Any = None) -> bool:
    """True on every rank if ``flag`` is true on at least one (one tiny all-reduce).

    The loop condition for uneven inputs: ``while fdp.any_rank(batch is not None): ...``
    ends on the same iteration everywhere, so no rank waits for a collective that the
    others never issue. A collective: every rank calls it.

    Raises:
      CollectiveError: a rank did not join within the group's timeout.

    Example:
      >>> fdp.any_rank(True), fdp.any_rank(False)
      (True, False)
    """
    return count_ranks(bool(flag), resolve(group), "fdp.any_rank") > 0
