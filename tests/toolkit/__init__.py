"""The test toolkit: what more than one test module needs, written once.

Test modules import from here and never from each other (tests/project/test_toolkit.py checks it).

- :mod:`tests.toolkit.paths`: the repository root and ``../shared`` (skip where it is absent);
- :mod:`tests.toolkit.spawn`: run a function on N gloo ranks (``run_distributed``);
- :mod:`tests.toolkit.ray`: the session-scoped local Ray instance (fixture ``ray_cluster``,
  registered in tests/conftest.py);
- :mod:`tests.toolkit.models`: ``tiny_model_config(**overrides)``, the tiny Llama of the unit tests;
- :mod:`tests.toolkit.overrides`: the small-run ``key=value`` override sets of the end-to-end tests;
- :mod:`tests.toolkit.assertions`: the layout-comparison assertion and its per-layout tolerances;
- :mod:`tests.toolkit.layouts`: tp x pp runs against the single-process model (``run_layout``);
- :mod:`tests.toolkit.training`: seeded batches and ``TrainRuntime`` runs for the dp / ep / checkpoint tests;
- :mod:`tests.toolkit.generation`: the no-cache greedy reference of the rollout engines;
- :mod:`tests.toolkit.roles`: a ragged RL batch, PPO settings and full gradients for the role layout tests;
- :mod:`tests.toolkit.processes`: a driver's Ray worker processes from /proc (the fault-injection runs).
"""
