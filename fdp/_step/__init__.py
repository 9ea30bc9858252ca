"""One data-parallel step over a bucket plan: leaf gradients in, reduced flat buckets out.

* ``machine.py``: ``StepMachine`` (per plan: leaf hooks, the step status) and ``Step`` (per
  call: receive, fill, launch, wait, finish, drain), started from a frozen ``StepSpec``.
* ``autodiff.py``: how this rank's gradients are computed (the ``autograd`` and
  ``functorch`` engines).
* ``config.py``: ``StepConfig``, what a Reducer was built with.
* ``record.py``: what a step reports (``StepRecord``, ``Timeline``, ``BucketTimes``).
* ``traced.py``: the bucketed all-reduce as graph nodes, under ``torch.compile``.

The step imports neither the Reducer nor the fused step.
"""
