"""Communication: the ranks fdp talks over and everything it says to them.

* ``group.py``: ``Group`` and ``fdp.init`` (one torch ProcessGroup plus what fdp needs to know).
* ``mesh.py``: ``Mesh``, the groups of a (possibly 2-D, HSDP) data-parallel step.
* ``collectives.py``: every collective fdp issues eagerly, each with a timeout and an error
  that names what failed on which rank.
* ``traced.py``: the collectives of a compiled step, as graph nodes (on gloo, fdp's own
  point-to-point all-gather and reduce-scatter ops).
* ``agree.py``: cross-rank agreement: layout digests, flag counts, active ranks, debug
  fingerprints of each collective.
* ``lifetime.py``: process-lifetime workarounds (gloo at teardown, the exit hook) and the
  malloc setting, each tagged with the torch versions and the upstream issue.

Nothing here knows about buckets, steps or optimizers.
"""
