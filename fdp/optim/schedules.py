"""``fdp.optim.schedules``: learning-rate and weight-decay schedules (see ``_schedules``)."""

from ._schedules import Schedule as Schedule
from ._schedules import constant as constant
from ._schedules import cosine as cosine
from ._schedules import join as join
from ._schedules import linear as linear
from ._schedules import step_decay as step_decay
from ._schedules import warmup_cosine as warmup_cosine

__all__ = ["Schedule", "constant", "cosine", "join", "linear", "step_decay", "warmup_cosine"]
