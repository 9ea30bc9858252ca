"""fdp: JAX-style functional data parallelism for PyTorch.

Models are pure functions over (params, buffers) pytrees; gradients come from
``torch.func.grad``; a Reducer packs them into size-capped flat buckets that are all-reduced
asynchronously while the backward still runs. See README.md and docs/.
"""

from . import cost as cost
from . import hooks as hooks
from . import optim as optim
from . import testing as testing
from ._checkpoint.sharded import load_sharded as load_sharded
from ._checkpoint.sharded import save_sharded as save_sharded
from ._checkpoint.single import load as load
from ._checkpoint.single import save as save
from ._comm.agree import any_rank as any_rank
from ._comm.group import Group as Group
from ._comm.group import init as init
from ._errors import CheckpointError as CheckpointError
from ._errors import CollectiveError as CollectiveError
from ._errors import ReplicaMismatchError as ReplicaMismatchError
from ._functional import Apply as Apply
from ._functional import functionalize as functionalize
from ._functional import units as units
from ._fused.engine import StepMemory as StepMemory
from ._fused.state import FusedState as FusedState
from ._fused.step import CompiledStep as CompiledStep
from ._fused.step import FusedStep as FusedStep
from ._plan.bucket import Bucket as Bucket
from ._plan.bucket import BucketPlan as BucketPlan
from ._psum import pmean as pmean
from ._psum import psum as psum
from ._reducer import Pending as Pending
from ._reducer import Reducer as Reducer
from ._replicas import ReplicaCheck as ReplicaCheck
from ._replicas import assert_replicas_equal as assert_replicas_equal
from ._replicas import assert_same_shapes as assert_same_shapes
from ._rng import RngState as RngState
from ._rng import rng_state as rng_state
from ._rng import set_rng_state as set_rng_state
from ._shard import Shard as Shard
from ._sources.deferred import DeferredInit as DeferredInit
from ._sources.deferred import deferred_init as deferred_init
from ._sources.safetensors import SafetensorsParams as SafetensorsParams
from ._sources.safetensors import safetensors_params as safetensors_params
from ._sources.safetensors import save_safetensors as save_safetensors
from ._step.autodiff import local_grad as local_grad
from ._step.autodiff import local_grad_and_value as local_grad_and_value
from ._step.record import BucketTimes as BucketTimes
from ._step.record import StepRecord as StepRecord
from ._step.record import Timeline as Timeline
from ._sync import broadcast as broadcast
from ._sync import sync_buffers as sync_buffers
from ._units.params import ShardedParams as ShardedParams

__version__ = "0.1.0"

__all__ = [
    "Apply",
    "Bucket",
    "BucketPlan",
    "BucketTimes",
    "CheckpointError",
    "CollectiveError",
    "DeferredInit",
    "FusedState",
    "CompiledStep",
    "FusedStep",
    "Group",
    "Pending",
    "Reducer",
    "ReplicaCheck",
    "ReplicaMismatchError",
    "RngState",
    "SafetensorsParams",
    "Shard",
    "ShardedParams",
    "StepMemory",
    "StepRecord",
    "Timeline",
    "any_rank",
    "assert_replicas_equal",
    "assert_same_shapes",
    "broadcast",
    "cost",
    "deferred_init",
    "functionalize",
    "hooks",
    "init",
    "load",
    "load_sharded",
    "local_grad",
    "local_grad_and_value",
    "optim",
    "pmean",
    "psum",
    "rng_state",
    "safetensors_params",
    "save",
    "save_safetensors",
    "save_sharded",
    "set_rng_state",
    "sync_buffers",
    "testing",
    "units",
]
