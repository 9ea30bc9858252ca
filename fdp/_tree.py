"""Pytrees in model order.

fdp flattens pytrees with optree under its own namespace, with dicts kept in *insertion*
order (optree sorts dict keys by default, which would scramble a model's registration
order and with it the bucket order). Leaf paths are formatted like JAX's ``keystr``:
``['layers.0.weight']``, ``[0]['mu']``, ``.exp_avg['fc.bias']``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from ._lru import LRU

NAMESPACE = "fdp"

# A global, permanent setting for fdp's own namespace only (other optree users are not
# affected). The context manager is entered once and never left: its per-call form is not
# thread-safe, and simulated ranks run as threads.
_ordered = optree.dict_insertion_ordered(True, namespace=NAMESPACE)
_ordered.__enter__()

TreeDef = optree.PyTreeSpec


# The commonest tree by far is a flat dict of tensors (what functionalize returns), flattened
# several times per step (the reducer, the optimizer's checks). A plain dict whose values are
# all tensors has a structure that depends only on its keys, so that structure is cached by
# key tuple and the leaves are its values: several times cheaper per leaf than optree's
# flatten (``python -m fdp.bench micro``, row "flatten"). Anything else goes to optree.
DICT_SPECS: LRU[tuple, TreeDef] = LRU(64)
_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})


def _tensor_dict(tree: Any) -> tuple[list[Any], TreeDef] | None:
    """(leaves, treedef) of a plain dict of plain tensors from the cache, else None."""
    if type(tree) is not dict or not tree or torch.compiler.is_compiling():
        return None
    values = list(tree.values())
    if not _TENSOR_TYPES.issuperset(map(type, values)):
        return None
    keys = tuple(tree)
    spec = DICT_SPECS.table.get(keys)
    if spec is None:
        leaves_, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
        if len(leaves_) != len(values):  # not all values were leaves after all: no caching
            return leaves_, spec
        DICT_SPECS.put(keys, spec)
    return values, spec


def flatten(tree: Any) -> tuple[list[Any], TreeDef]:
    """Leaves in insertion order and the tree structure."""
    fast = _tensor_dict(tree)
    if fast is not None:
        return fast
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def leaves(tree: Any) -> list[Any]:
    fast = _tensor_dict(tree)
    if fast is not None:
        return fast[0]
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def unflatten(treedef: TreeDef, leaves: Sequence[Any]) -> Any:
    return optree.tree_unflatten(treedef, leaves)


def structure(tree: Any) -> TreeDef:
    return optree.tree_structure(tree, namespace=NAMESPACE)


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def paths(treedef: TreeDef) -> list[str]:
    """Formatted path of every leaf of ``treedef``, in leaf order."""
    return [_format(a) for a in optree.treespec_accessors(treedef)]


def keys(treedef: TreeDef) -> list[Any]:
    """Every leaf's key, in leaf order: what fdp hands a user's callable of ``(path, leaf)``.

    For a dict whose values are all leaves (``fdp.functionalize``'s params) a leaf's key is
    its dict key (``"wte.weight"``); for any other tree it is the tuple of keys from the
    root: dict keys, list and tuple indices, NamedTuple and dataclass field names
    (``("encoder", "layers", 0, "w")``, as JAX's ``tree_map_with_path`` keys without their
    wrappers). A tree that is a single leaf has the key ``()``.
    """
    accessors = optree.treespec_accessors(treedef)
    per_leaf = [tuple(map(_entry_key, a)) for a in accessors]
    if accessors and all(len(a) == 1 and isinstance(a[0], optree.MappingEntry) for a in accessors):
        return [k[0] for k in per_leaf]  # a flat dict (or OrderedDict, defaultdict)
    return per_leaf


def _entry_key(entry: Any) -> Any:
    # A NamedTuple's or dataclass's entry is its field's name (optree keeps the index in
    # ``entry`` and the name in ``field``; a plain attribute entry keeps it in ``name``).
    for attr in ("field", "name"):
        name = getattr(entry, attr, None)
        if isinstance(name, str):
            return name
    return entry.entry


def flatten_with_paths(tree: Any) -> tuple[list[str], list[Any], TreeDef]:
    leaves_, treedef = flatten(tree)
    return paths(treedef), leaves_, treedef


def _format(accessor: optree.PyTreeAccessor) -> str:
    return accessor.codify("") or "<root>"  # e.g. "['a'][0]", "['n'].mu"


def nodes_with(tree: Any, protocol: type) -> list[tuple[str, Any]]:
    """``(path, node)`` of every node of ``tree`` that implements ``protocol`` (a runtime
    checkable ``typing.Protocol`` of ``fdp._protocols``, by which a state type tells
    ``fdp.save``/``fdp.load`` about itself), outermost first."""
    def has(x: Any) -> bool:
        return type(x) is not torch.Tensor and isinstance(x, protocol)

    found, spec = optree.tree_flatten(tree, is_leaf=has, namespace=NAMESPACE)
    return [(p, x) for p, x in zip(paths(spec), found) if has(x)]


def first_difference(expected: TreeDef, got: TreeDef) -> str:
    """Describe where two tree structures first differ (for error messages)."""
    exp_paths, got_paths = paths(expected), paths(got)
    for i, (e, g) in enumerate(zip(exp_paths, got_paths)):
        if e != g:
            return f"leaf {i}: expected path {e}, found {g}"
    if len(exp_paths) != len(got_paths):
        n = min(len(exp_paths), len(got_paths))
        if len(exp_paths) > len(got_paths):
            return f"missing leaf {exp_paths[n]} (expected {len(exp_paths)} leaves, found {len(got_paths)})"
        return f"unexpected extra leaf {got_paths[n]} (expected {len(exp_paths)} leaves, found {len(got_paths)})"
    return f"same leaf paths but different containers: expected {expected}, found {got}"


# Dicts are matched by key: a tree whose dicts hold the same keys in another insertion order
# (``{**decay, **no_decay}`` rebuilt from a params dict) is the same tree to fdp. Sorting
# every dict's keys (optree's default namespace does) gives both trees one canonical order;
# the permutation between them is cached per pair of structures, so a caller who passes the
# same reordered dict every step pays one lookup and one C-level gather.
_ORDERS: LRU[tuple[TreeDef, TreeDef], tuple[int, ...] | None] = LRU(64)


def _sorted_order(treedef: TreeDef) -> tuple[list[int], TreeDef]:
    """Leaf indices of ``treedef`` in sorted-key order, and the sorted-key structure."""
    numbered = optree.tree_unflatten(treedef, list(range(treedef.num_leaves)))
    order, spec = optree.tree_flatten(numbered)  # default namespace: dict keys sorted
    return order, spec


def _permutation(expected: TreeDef, got: TreeDef) -> tuple[int, ...] | None:
    return _ORDERS.get((expected, got), lambda: _permutation_of(expected, got))


def _permutation_of(expected: TreeDef, got: TreeDef) -> tuple[int, ...] | None:
    perm = None
    if expected.num_leaves == got.num_leaves:
        exp_order, exp_spec = _sorted_order(expected)
        got_order, got_spec = _sorted_order(got)
        if exp_spec == got_spec:
            p = [0] * len(exp_order)
            for e, g in zip(exp_order, got_order):
                p[e] = g
            perm = tuple(p)
    return perm


def in_order_of(expected: TreeDef, got: TreeDef, leaves: Sequence[Any], what: str) -> list[Any]:
    """``leaves`` (of a tree shaped ``got``) in the leaf order of ``expected``.

    The two structures may differ only in the insertion order of their dicts' keys; dicts
    are matched by key. Otherwise raises ``ValueError`` starting with ``what``, naming the
    missing and unexpected leaf paths (or the first differing container).
    """
    perm = _permutation(expected, got)
    if perm is None:
        raise ValueError(f"{what}: {describe_difference(expected, got)}")
    if len(perm) < 2:
        return list(leaves)
    return list(operator.itemgetter(*perm)(leaves))


def describe_difference(expected: TreeDef, got: TreeDef) -> str:
    """Which leaf paths one structure has and the other lacks (dicts compared by key)."""
    exp_paths, got_paths = paths(expected), paths(got)
    exp_set, got_set = set(exp_paths), set(got_paths)
    missing = [p for p in exp_paths if p not in got_set]
    extra = [p for p in got_paths if p not in exp_set]
    if not missing and not extra:
        return f"same leaf paths but different containers: expected {expected}, found {got}"
    counts = f"(expected {len(exp_paths)} leaves, found {len(got_paths)})"
    parts = []
    for word, found in (("missing leaf", missing), ("unexpected extra leaf", extra)):
        if found:
            more = f" and {len(found) - 1} more" if len(found) > 1 else ""
            parts.append(f"{word} {found[0]}{more}" + (f" ({', '.join(found[:6])})" if len(found) > 1 else ""))
    return "; ".join(parts) + f" {counts}"


# True while torch.compile traces the calling code (fdp then takes traceable paths): torch's
# own function under fdp's name (no frame of fdp's own around it on every per-step call).
compiling = torch.compiler.is_compiling
