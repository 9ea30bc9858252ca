"""Plans: the static layout of a pytree's leaves in size-capped flat buckets.

* ``bucket.py``: ``BucketPlan`` and ``Bucket`` (DDP's assignment, ``assign``, the one copy
  of it; leaf checks; flatten, unflatten and views).
* ``buffers.py``: ``BucketBuffers``, the one owner of a Reducer's flat gradient buffers.

A plan never imports the step that runs over it.
"""
