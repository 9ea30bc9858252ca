"""Slices of the flat buckets over the ranks of a shard group (ZeRO): the geometry (which
elements of each bucket a rank holds, and the spans of each key in them) and what sharded
steps exchange (reduce-scatter, all-gather, replica all-reduces, straddling leaves, whole
leaves to their owners).

* ``geometry.py``: ``Slices``, ``Spans`` (``Span``, ``Placed``, ``pieces``).
* ``exchange.py``: ``Scatter``, ``Replicas``, ``Straddles``, ``Owners``.
"""
