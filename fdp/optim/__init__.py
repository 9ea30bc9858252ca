"""fdp.optim: functional optimizers over torch.optim's own kernels (and optax's Lion),
gradient transforms (clipping, dynamic loss scaling), schedules and parameter groups.

An ``Optimizer`` is ``init(params) -> state`` and ``update(grads, state, params) ->
(new_params, new_state)`` with torch.optim's numbers bit for bit; ``GradientTransform`` s
(clipping, ``loss_scale``, your own) compose in front of one with ``chain``; ``lr`` and
``weight_decay`` may be schedules (``fdp.optim.schedules``); ``mask=`` and ``partition``
give torch's param groups. ``ema(opt, decay)`` also keeps an EMA of the params in the
state (torch's ``AveragedModel``), ``multi_steps(opt, k)`` accumulates k calls' gradients in
it (optax's ``MultiSteps``), ``inject_hyperparams(factory)(...)`` keeps the hyper-parameters
in it (``set_hyperparams`` changes them between steps). ``hyperparams(opt, state)`` reads
the lr (and the rest) an update used; ``state_from_torch`` / ``state_to_torch`` move a state
to and from a torch.optim state dict. See docs/optim.md for the optax and torch.optim correspondences.

Pure by default: ``update`` never modifies its inputs. With ``donate=True`` it updates params
and state in place and returns them (the inputs are consumed, as with JAX's
``donate_argnums``). A schedule is called with the number of updates already applied (0 for
the first). ``update`` raises ``ValueError`` when the grads or the state do not match the
params (naming the leaf) and ``TypeError`` for a state another optimizer made.
"""

from . import schedules as schedules
from ._adafactor import AdafactorState as AdafactorState
from ._adafactor import adafactor as adafactor
from ._adaptive import AdadeltaState as AdadeltaState
from ._adaptive import AdamaxState as AdamaxState
from ._adaptive import NAdamState as NAdamState
from ._adaptive import RAdamState as RAdamState
from ._adaptive import adadelta as adadelta
from ._adaptive import adamax as adamax
from ._adaptive import nadam as nadam
from ._adaptive import radam as radam
from ._base import ChainState as ChainState
from ._base import Form as Form
from ._base import GradientTransform as GradientTransform
from ._base import LeafKernel as LeafKernel
from ._base import Optimizer as Optimizer
from ._base import chain as chain
from ._base import global_scale as global_scale
from ._base import stateless as stateless
from ._ema import EmaState as EmaState
from ._ema import ema as ema
from ._ema import ema_params as ema_params
from ._ema import ema_update as ema_update
from ._hyperparams import Hyperparams as Hyperparams
from ._hyperparams import hyperparams as hyperparams
from ._inject import InjectHyperparamsState as InjectHyperparamsState
from ._inject import inject_hyperparams as inject_hyperparams
from ._inject import set_hyperparams as set_hyperparams
from ._inspect import Inspection as Inspection
from ._inspect import inspect as inspect
from ._lion import LionState as LionState
from ._lion import lion as lion
from ._loss_scale import LossScaleState as LossScaleState
from ._loss_scale import current_loss_scale as current_loss_scale
from ._loss_scale import loss_scale as loss_scale
from ._multi_steps import MultiStepsState as MultiStepsState
from ._multi_steps import multi_steps as multi_steps
from ._muon import MuonState as MuonState
from ._muon import muon as muon
from ._optimizers import AdagradState as AdagradState
from ._optimizers import AdamState as AdamState
from ._optimizers import AdamWState as AdamWState
from ._optimizers import RMSpropState as RMSpropState
from ._optimizers import SGDState as SGDState
from ._optimizers import adagrad as adagrad
from ._optimizers import adam as adam
from ._optimizers import adamw as adamw
from ._optimizers import rmsprop as rmsprop
from ._optimizers import sgd as sgd
from ._torch_state import state_from_torch as state_from_torch
from ._torch_state import state_to_torch as state_to_torch
from ._transforms import ClipState as ClipState
from ._transforms import PartitionState as PartitionState
from ._transforms import clip_by_global_norm as clip_by_global_norm
from ._transforms import clip_by_value as clip_by_value
from ._transforms import frozen as frozen
from ._transforms import global_norm as global_norm
from ._transforms import partition as partition

__all__ = [
    "AdadeltaState",
    "AdafactorState",
    "AdagradState",
    "AdamState",
    "AdamWState",
    "AdamaxState",
    "ChainState",
    "ClipState",
    "EmaState",
    "Form",
    "GradientTransform",
    "Hyperparams",
    "InjectHyperparamsState",
    "Inspection",
    "LeafKernel",
    "LionState",
    "LossScaleState",
    "MultiStepsState",
    "MuonState",
    "NAdamState",
    "Optimizer",
    "PartitionState",
    "RAdamState",
    "RMSpropState",
    "SGDState",
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "chain",
    "clip_by_global_norm",
    "clip_by_value",
    "current_loss_scale",
    "ema",
    "ema_params",
    "ema_update",
    "frozen",
    "global_norm",
    "global_scale",
    "hyperparams",
    "inject_hyperparams",
    "inspect",
    "lion",
    "loss_scale",
    "multi_steps",
    "muon",
    "nadam",
    "partition",
    "radam",
    "rmsprop",
    "schedules",
    "set_hyperparams",
    "sgd",
    "state_from_torch",
    "state_to_torch",
    "stateless",
]
