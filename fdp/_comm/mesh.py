"""The groups a data-parallel step talks over: one group, or a 2-D ``("replicate", "shard")``
DeviceMesh (HSDP), as a ``Mesh`` of ``fdp.Group`` s."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch.distributed as dist

from .group import Group, resolve


class Mesh(NamedTuple):
    """The groups a (possibly sharded) fused step talks over.

    ``full``: every rank (the mean's denominator, the step status, the plan checks);
    ``shard``: the ranks a bucket is cut over (``full`` for a 1-D group); ``replicate``: the
    ranks holding the same slice (2-D meshes), else None.
    """

    full: Group
    shard: Group
    replicate: Group | None


def resolve_mesh(group: Any) -> Mesh:
    """The ``Mesh`` for a Reducer's ``group=``: a 2-D ``DeviceMesh`` with dims (replicate,
    shard), or anything ``fdp.Group`` accepts (then every rank is in one shard group)."""
    if hasattr(group, "get_group") and hasattr(group, "mesh") and group.ndim == 2:
        names = tuple(group.mesh_dim_names or ("replicate", "shard"))
        if set(names) != {"replicate", "shard"}:
            raise ValueError(
                f"fdp.Reducer: a 2-D DeviceMesh must name its dims ('replicate', 'shard') (HSDP: "
                f"buckets are cut over 'shard' and the slices all-reduced over 'replicate'); got {names}"
            )
        shard = Group.from_mesh(group, "shard")
        replicate = Group.from_mesh(group, "replicate")
        if group.size() == dist.get_world_size():
            full = Group.from_process_group(None, device=shard.device)
        else:  # the mesh is part of a larger job: its ranks as one group (made by torch, cached)
            full = Group.from_mesh(group._flatten(), 0)
        return Mesh(full, shard, replicate)
    full = resolve(group)
    return Mesh(full, full, None)
