"""fdp: JAX-style functional data parallelism for PyTorch.

Models are pure functions over (params, buffers) pytrees; gradients come from
``torch.func.grad``; a Reducer packs them into size-capped flat buckets that are all-reduced
asynchronously while the backward still runs. See README.md and docs/.
"""

from . import testing as testing
from ._bucket import Bucket as Bucket
from ._bucket import BucketPlan as BucketPlan
from ._errors import CheckpointError as CheckpointError
from ._errors import CollectiveError as CollectiveError
from ._errors import ReplicaMismatchError as ReplicaMismatchError
from ._functional import Apply as Apply
from ._functional import functionalize as functionalize
from ._group import Group as Group
from ._group import init as init

__version__ = "0.1.0"

__all__ = [
    "Apply",
    "Bucket",
    "BucketPlan",
    "CheckpointError",
    "CollectiveError",
    "Group",
    "ReplicaMismatchError",
    "functionalize",
    "init",
    "testing",
]
