"""Checkpoints of a train state: one file from rank 0, or a folder of every rank's parts.

* ``single.py``: ``fdp.save`` / ``fdp.load``: the whole (replicated) state in one file that
  rank 0 writes atomically, read with ``torch.load(weights_only=True)``.
* ``sharded.py``: ``fdp.save_sharded`` / ``fdp.load_sharded``: every rank writes its own
  parts (``fdp.Shard``s) with no gather, and loads the ranges it asks for, into any world size.
* ``manifest.py``: the sharded format: the folder's files, the JSON manifest, which rank
  writes which piece, the safetensors header of each rank's data file.
* ``leaves.py``: what a checkpoint holds, leaf by leaf: plain values, checksums, the state
  types' own say (``__fdp_unsaveable__``, ``__fdp_per_rank__``, ``__fdp_check_load__``).
* ``files.py``: writing files that survive a crash: atomic replacement, fsync, the errors of
  a full disk.
"""
