"""Pytrees in model order.

fdp flattens pytrees with optree under its own namespace, with dicts kept in *insertion*
order (optree sorts dict keys by default, which would scramble a model's registration
order and with it the bucket order). Leaf paths are formatted like JAX's ``keystr``:
``['layers.0.weight']``, ``[0]['mu']``, ``.exp_avg['fc.bias']``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

NAMESPACE = "fdp"

# A global, permanent setting for fdp's own namespace only (other optree users are not
# affected). The context manager is entered once and never left: its per-call form is not
# thread-safe, and simulated ranks run as threads.
_ordered = optree.dict_insertion_ordered(True, namespace=NAMESPACE)
_ordered.__enter__()

TreeDef = optree.PyTreeSpec


def flatten(tree: Any) -> tuple[list[Any], TreeDef]:
    """Leaves in insertion order and the tree structure."""
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def leaves(tree: Any) -> list[Any]:
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


def flatten_with_paths(tree: Any) -> tuple[list[str], list[Any], TreeDef]:
    leaves_, treedef = flatten(tree)
    return paths(treedef), leaves_, treedef


def _format(accessor: optree.PyTreeAccessor) -> str:
    return accessor.codify("") or "<root>"  # e.g. "['a'][0]", "['n'].mu"


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


def compiling() -> bool:
    """True while torch.compile traces the calling code (fdp then takes traceable paths)."""
    return torch.compiler.is_compiling()
