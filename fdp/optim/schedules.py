"""Learning-rate and weight-decay schedules: functions of the number of updates applied.

Pass one as ``lr=`` or ``weight_decay=`` of an ``fdp.optim`` optimizer. A schedule is called
with the step count ``t`` (0 for the first update, as ``LambdaLR`` sees it): with an int it
returns a float, ``scheduler.get_last_lr()`` after ``t`` calls of ``scheduler.step()``
(``step_decay`` bit for bit, StepLR's running product; ``linear`` and ``cosine`` the closed
form of ``LinearLR`` and ``CosineAnnealingLR``, which their chainable steps match within
1e-12 relative); with a tensor (the optimizer's step counter under ``torch.compile``) a
float64 tensor from the same formula, so a compiled step never recompiles. Any ``lambda t:
...`` made of arithmetic works the same way.
"""

from ._schedules import Schedule as Schedule
from ._schedules import constant as constant
from ._schedules import cosine as cosine
from ._schedules import join as join
from ._schedules import linear as linear
from ._schedules import step_decay as step_decay
from ._schedules import warmup_cosine as warmup_cosine

__all__ = ["Schedule", "constant", "cosine", "join", "linear", "step_decay", "warmup_cosine"]
