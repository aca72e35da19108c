"""The small-run ``key=value`` override sets of the end-to-end tests (stage CLIs and in-process trainers).

FAST: the built-in task's held-out evaluation cut to one 32-row batch, no progress bar.
SMALL: a few-step run of any stage on ``conf=tiny`` (200 examples per split, batch 8, no
    evaluation); PPO_RULE on top of it starts PPO from random weights with the rule reward, so a
    PPO run needs no SFT or RM checkpoint.
"""

from __future__ import annotations

FAST = ["trainer.progress=false", "task.num_eval=32", "trainer.eval_batch_size=32"]

SMALL = [
    "conf=tiny",
    "task.num_sft=200",
    "task.num_pairs=200",
    "task.num_rl=200",
    "task.num_eval=16",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=8",
    "trainer.eval_every=0",
    "trainer.progress=false",
]

PPO_RULE = ["actor.init=", "reward.init=", "critic.init=", "reward.type=rule", "reward.rule=digit_fraction"]
