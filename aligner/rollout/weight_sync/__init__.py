"""The weight path: the actor's weights into rollout engines after each update.

- :mod:`.refit`: colocated engines (in the actor's own processes): the export walk from the
  trainer layout (gather TP shards, walk PP stages, HF names), buckets, the timed ``refit`` driver,
  and the engine layout (:func:`~aligner.rollout.weight_sync.refit.rollout_dims`).
- :mod:`.broadcast`: engines in their own worker group (the split placement): one broadcast per
  bucket over a sync group that spans the actor's rank 0 and every engine rank.
- :mod:`.staging`: syncs received while an engine decodes, applied at its next step boundary
  (interruptible generation).

Every path ends in the engine's ``update_weights`` / ``finish_weight_update``
(:class:`~aligner.rollout.base.RolloutEngine`). Nothing is imported here.
"""
