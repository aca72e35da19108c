"""Run operations: what surrounds a stage trainer's steps, the same for every stage.

- :mod:`~aligner.run_ops.run_dir`: the run directory (``output_dir``): refuse a previous run's files
  unless ``resume=true`` / ``overwrite=true``, refuse resuming another stage's run, the run's lock.
- :mod:`~aligner.run_ops.checkpointing`: checkpoint management: atomic, checksummed checkpoints under
  ``output_dir/checkpoints``, their verification, the latest intact one, pruning of the run's own old ones.
- :mod:`~aligner.run_ops.preemption`: the driver's SIGTERM handler (save at the step boundary, exit 143).
- :mod:`~aligner.run_ops.supervisor`: the parent process of a command-line run, which reports a driver
  that died or was preempted.

The stage trainers (:mod:`aligner.trainers`) and the training loop use these; nothing here knows a
stage's phases, worker groups or Ray. docs/reliability.md describes the guarantees.
"""
