"""The retry environment (``env.name=retry``): an answer the reward function scores below
``RetryEnv.pass_score`` gets one line of feedback and another turn, up to ``env.max_turns`` turns.

The multi-turn loop of self-correction with outcome feedback (the "try again" environments of
multi-turn RL work such as Kumar et al. 2024, SCoRe): the model's turn is scored by the reward
function (a rule of aligner.reward.rules, passed in by the caller in the :class:`EnvSpec`); a
passing turn ends the episode, a failing one is answered with :data:`FEEDBACK` as the next user
message. The final reward is the score of the last turn; the per-turn rewards are 0, so an episode
that needed more turns is worth the same as one that did not (the token budget and max_turns bound
it). Step info: ``retries`` (feedback messages given).
"""

from __future__ import annotations

from typing import Sequence

from aligner.envs.base import Environment, EnvSpec, Message, StepResult, register_env

FEEDBACK = "Wrong, try again."


@register_env("retry")
class RetryEnv(Environment):
    """Feedback on a failing answer, another turn (see the module docstring). pass_score: the score
    at or above which an answer passes (1.0: a rule's "right")."""

    pass_score = 1.0

    def __init__(self, spec: EnvSpec) -> None:
        self.reward_fn = spec.reward_fn

    def reset(self, prompt: str, metadata: dict) -> Sequence[Message]:
        self.prompt, self.metadata, self.last = prompt, metadata, 0.0
        return ()

    def step(self, turn: str) -> StepResult:
        self.last = float(self.reward_fn(self.prompt, turn, self.metadata))
        if self.last >= self.pass_score:
            return StepResult(done=True)
        return StepResult(messages=(Message("user", FEEDBACK),), info={"retries": 1})

    def finish(self) -> float:
        return self.last
