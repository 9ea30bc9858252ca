"""The fused train step (``reducer.grad_and_update``): params, gradients and optimizer state
in the plan's flat buckets, each bucket updated as soon as its all-reduce lands.

* ``step.py``: ``FusedStep``, the public object, and the Reducer's bounded cache of cores.
* ``core.py``: ``FusedCore``, what a step keeps across calls for one layout (plan, step
  machine, param sets).
* ``run.py``: ``Run``, one step's per-bucket progress (arrive, transform, update, gather).
* ``state.py``: ``FusedState`` (with its layout) and its per-leaf forms: whole (gathered)
  or this rank's ``fdp.Shard``s (for sharded checkpoints).
* ``spans.py``: where each key's and each leaf's elements are in one rank's state.
* ``shard.py``: sharding (``shard=True``): the slices of each bucket, the reduce-scatter,
  the replica all-reduces of a 2-D mesh, the all-gather.
"""
