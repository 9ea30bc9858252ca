"""Fully sharded params (ZeRO-3, FSDP2's ``fully_shard``): each rank keeps its slices of every
unit's params; a unit's whole params exist only while it runs.

* ``units.py``: ``Units``, every unit's gathered params and their lifecycle (``UnitState``;
  ``unshard``, ``wait_for_unshard``, ``reshard``; ``alloc_storage``, ``free_storage``), the
  ``UnitsView`` a forward runs through and the ``Gathering`` a step's loss receives; which
  leaf is in which unit (``unit_of_leaves``, ``bucket_groups``).
* ``placeholder.py``: ``Placeholder``, what stands in a unit's param's place while it is not
  gathered.
* ``params.py``: ``ShardedParams``, the params a fully sharded step returns: its slices and
  the ``Units`` that gather them.
"""
