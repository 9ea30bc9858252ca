"""Exception types fdp raises (all are RuntimeErrors, so broad handlers keep working)."""

from __future__ import annotations


class ReplicaMismatchError(RuntimeError):
    """Ranks disagree about something that must be identical: a tree's leaf count, paths,
    shapes, dtypes, a bucket plan, a collective's fingerprint, or the values of replicas.

    Raised on every rank, naming the leaf (or what differs) and the ranks.

    Example:
      >>> issubclass(fdp.ReplicaMismatchError, RuntimeError)
      True
    """


class CollectiveError(RuntimeError):
    """A collective failed or did not finish within the group's timeout (a dead or stuck rank).

    The message names the collective (e.g. ``all-reduce of bucket 1 of 3 (step 41)``), the
    rank, the group's size and its timeout. The other ranks of a failed Reducer step raise it
    for that step too, and the next call starts a fresh step.
    """


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read, or does not match the train state it is
    loaded into (see ``fdp.save`` and ``fdp.load``; ``fdp.rng_state`` and ``fdp.set_rng_state``
    raise it too). Raised on every rank."""
