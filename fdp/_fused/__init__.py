"""The fused train step (``reducer.grad_and_update``): params, gradients and optimizer state
in the plan's flat buckets, each bucket updated as soon as its collective lands; one engine,
written once over a store that says where params, gradients and state live.

* ``step.py``: ``FusedStep``, the public object, ``CompiledStep`` (``step.compile()``), and
  ``Engines``, the Reducer's bounded cache of engines (one per layout).
* ``engine.py``: ``Engine``, what a step keeps across calls for one layout (step machine,
  store, accumulation, refusal after a failure), and one step's flow: settle, repair, run.
* ``stores.py``: ``Store``, where params, gradients and state live: ``ReplicatedStore``,
  ``SlicedStore`` (``shard=True``), ``UnitStore`` (``shard="params"``); ``Accumulation``.
* ``mode.py``: ``StepMode`` (when buckets are updated, when the status and the verdict come),
  decided once per program; ``Verdict``, what a step tells its engine; ``refused``.
* ``run.py``: ``Run``, one step's per-bucket progress: arrive, transform, update, gather, and
  its verdict.
* ``micro.py``: ``MicroRun``, one micro-batch of ``step.accumulate`` reduce-scattered as it
  goes, its sum kept sliced (``reduce_micro_batches``).
* ``buckets.py``: ``Buckets``, what a run reads about the engine's buckets (spans, decays,
  one-call buckets, casts, owners), and ``BucketViews``.
* ``program.py``: ``Program``, what one optimizer asks: transforms by reach, kernels, keys.
* ``params.py``: ``ParamSets`` (which flat set holds the params) and ``SliceSets`` (a fully
  sharded step's: this rank's slices only, returned as ``fdp.ShardedParams``).
* ``state.py``: ``FusedState`` and ``StateLayout``: the flat state and its per-leaf forms
  (gathered ``to_tree``, this rank's ``Shard``s ``to_shards``).
* ``traced.py``: the step (and ``accumulate``) as graph nodes under torch.compile: the same
  buckets, spans, kernels and state, its collectives functional (``refusal``: what cannot be).
* ``eager.py``: ``eager_only``, the step's entry points kept out of torch.compile.
"""
