"""The ``torch`` rollout backend: generation with aligner's own Llama modules.

- :mod:`.engine`: :class:`~aligner.rollout.torch_engine.engine.TorchEngine`, the
  :class:`~aligner.rollout.base.RolloutEngine` (weights, layouts, generate()); it builds the
  :class:`~aligner.rollout.torch_engine.shard.ModelShard` its scheduler drives (:mod:`.shard`:
  the model shard, layout and hooks; the schedulers never import the engine).
- :mod:`.scheduler`: the continuous scheduler's plans (pure Python); :mod:`.continuous_batching`
  and :mod:`.static_batching`: the two schedulers' execution, each with its CUDA-graph decode step
  (captured by :mod:`.cuda_graphs`); :mod:`.pipeline_link`: the messages between pipeline stages.
- :mod:`.kv_cache`: the KV caches (slot pool, static batch); :mod:`.sampling`: greedy /
  temperature / top-k / top-p with per-request seeds.
- :mod:`.cpu_kernels` (C sources in ``csrc/``, compiled on the machine that runs them) and
  :mod:`.cpu_tuning` (per-machine choice of GEMM layout and decode attention).

Nothing is imported here: ``import aligner.rollout.torch_engine.scheduler`` loads the scheduler alone.
"""
