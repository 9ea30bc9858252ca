"""Exception types fdp raises (all are RuntimeErrors, so broad handlers keep working)."""

from __future__ import annotations


class ReplicaMismatchError(RuntimeError):
    """Ranks disagree about something that must be identical: a tree's leaf count, paths,
    shapes, dtypes, a bucket plan, a collective's fingerprint, or the values of replicas."""


class CollectiveError(RuntimeError):
    """A collective failed or did not finish within the group's timeout (a dead or stuck rank)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be read, or does not match the train state it is loaded into."""
