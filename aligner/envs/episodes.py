"""Episodes at the token level (docs/environments.md): the rollout engine's ``turn_end`` callback.

:class:`TokenEpisodes` plays one episode per request of one ``generate`` call of the continuous
scheduler (:data:`aligner.rollout.torch_engine.scheduler.TurnEnd`): when a model turn ends, it decodes the
turn's tokens, steps that request's environment, and returns the observation's tokens for the
engine to feed before the model's next turn, or None when the episode is over. It follows
:func:`aligner.envs.base.run_episode` turn for turn (``max_turns``, the per-call timeout, an
environment that raises, hangs or misbehaves fails its own episode only) and keeps the same
:class:`~aligner.envs.base.Episode` trajectories.

Observation tokens. The chat template decides how a message renders after a model turn: the
observation's text is what the template renders for the conversation with the observation and the
next generation prompt, minus its rendering up to the model's turn. The model's own tokens are kept
as sampled (never re-tokenized); after its stop token come the template's characters that follow
the stop token's text in an assistant turn (SmolLM2's ``\\n`` after ``<|im_end|>``), then the
observation's messages and the next assistant header, tokenized alone without special tokens added.
A template whose rendering of a conversation is not a prefix of its rendering with more messages
fails the episode, naming the template (as :mod:`aligner.data.encode` refuses it for SFT rows).

Environments stepped beside decoding. With ``step_workers`` > 0 each turn end is handed to a pool of
that many threads and the callback returns its Future: the scheduler parks the row until the
environment answers and keeps decoding the others (:mod:`aligner.rollout.torch_engine.scheduler`, "Parked rows"),
so a slow environment (a sandboxed program, a remote tool) holds only its own episode; each thread
has its own :class:`~aligner.envs.base.EnvRunner` for the per-call timeout. The episodes are the same
as with ``step_workers=0`` (every call on the engine's thread, in turn).

Not supported yet: an environment whose ``reset`` returns messages (they would have to enter the
prompt before its generation prompt): such an episode fails with that reason.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, Sequence, Union

from aligner.envs.base import EnvFailure, Environment, EnvRunner, Episode, StepResult, Turn, _add_counts, _messages, _reward, call_env


class TokenEpisodes:
    """The episodes of one generate call, request i playing row i, as the engine's turn_end callback.

    Args:
        env_factory: builds a fresh environment per episode (e.g. ``lambda: make_env(name, spec)``).
        tokenizer: a transformers tokenizer (decode, encode, apply_chat_template).
        rows: (prompt text, metadata) per request, in request order; the prompt text is what the
            environment and the reward function read (the data row's ``prompt``).
        max_turns: the most model turns of an episode (>= 1).
        timeout_s: the wall-clock limit of each environment call, seconds (> 0).
        stop_ids: the engine's stop tokens (a turn that ends with one is cut before it for its text).
        step_workers: 0 (environment steps on the engine's thread, in turn) or the threads that step
            environments while the engine decodes other rows (the callback then returns Futures).
    ``episodes``: the trajectories, filled in as the engine runs. Call :meth:`close` after the
    generate call (it stops the step threads). Raises ValueError for max_turns < 1, timeout_s <= 0 or
    step_workers < 0.
    """

    def __init__(
        self,
        env_factory: Callable[[], Environment],
        tokenizer,
        rows: Sequence[tuple[str, dict]],
        *,
        max_turns: int,
        timeout_s: float,
        stop_ids: Sequence[int],
        step_workers: int = 0,
    ) -> None:
        if max_turns < 1 or not timeout_s > 0 or step_workers < 0:
            raise ValueError(
                f"TokenEpisodes: max_turns={max_turns!r} must be >= 1, timeout_s={timeout_s!r} > 0 and step_workers={step_workers!r} >= 0"
            )
        self.tok, self.max_turns, self.timeout_s = tokenizer, max_turns, timeout_s
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.stop_text: dict[int, str] = {}  # stop id -> its text, decoded once
        self.episodes = [Episode(prompt=p, metadata=dict(m), turns=[Turn("user", p, own=False)]) for p, m in rows]
        self.envs: list[Optional[Environment]] = [None] * len(rows)
        self.closed = [False] * len(rows)
        self.runner = EnvRunner()  # one worker thread for every call (a thread per call costs ~1.5 ms)
        self.pool = ThreadPoolExecutor(step_workers, thread_name_prefix="env-step") if step_workers else None
        self._local = threading.local()  # each step thread's own EnvRunner
        for i, (prompt, metadata) in enumerate(rows):
            try:
                env = env_factory()
            except Exception as e:  # the episode fails, the call goes on
                self._fail(i, EnvFailure(f"building the environment raised {type(e).__name__}: {e}"))
                continue
            self.envs[i] = env
            try:
                first = _messages(call_env(lambda env=env, p=prompt, m=metadata: env.reset(p, m), timeout_s, "reset", self.runner), "reset")
                if first:
                    raise EnvFailure("reset returned messages: the engine's episodes do not support messages before the first turn yet")
            except EnvFailure as e:
                self._fail(i, e)

    def __call__(self, request: int, turn_ids: list[int], room: int) -> Union[Optional[list[int]], Future]:
        """The engine's turn_end: record the turn, step the environment; the observation's ids or None
        (with step_workers, a Future of them, run on a step thread)."""
        if self.pool is not None:
            return self.pool.submit(self._step, request, list(turn_ids), room)
        return self._step(request, turn_ids, room)

    def close(self) -> None:
        """Stop the step threads (a step past its timeout is left running, as call_env says)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False)

    def _runner(self) -> EnvRunner:
        """The calling thread's EnvRunner: the engine thread's, or one per step thread."""
        if self.pool is None:
            return self.runner
        if not hasattr(self._local, "runner"):
            self._local.runner = EnvRunner()
        return self._local.runner

    def _step(self, request: int, turn_ids: list[int], room: int) -> Optional[list[int]]:
        ep, env = self.episodes[request], self.envs[request]
        stopped = bool(turn_ids) and turn_ids[-1] in self.stop_ids
        text = self.tok.decode(turn_ids[:-1] if stopped else turn_ids, skip_special_tokens=True)
        ep.turns.append(Turn("assistant", text, own=True))
        if self.closed[request]:  # failed before this turn: the model's turn is kept, nothing more runs
            return None
        n = len(ep.model_turns)
        try:
            result = call_env(lambda: env.step(text), self.timeout_s, f"step {n}", self._runner())
            if not isinstance(result, StepResult):
                raise EnvFailure(f"step {n} returned {type(result).__name__}, not a StepResult")
            ep.model_turns[-1].reward = _reward(result.reward, f"step {n}")
            _add_counts(ep.counts, result.info, f"step {n}")
            messages = _messages(result.messages, f"step {n}")
            if result.done:
                ep.done = True
                return self._finish(request)
            obs = self._render(ep, messages, turn_ids[-1] if stopped else None) if stopped and n < self.max_turns else None
            if obs is None or len(obs) >= room:  # cut at max_turns, by the budget, or the observation does not fit
                ep.truncated = True
                return self._finish(request)
            ep.turns += messages
            return obs
        except EnvFailure as e:
            self._fail(request, e)
            return None

    def _finish(self, i: int) -> None:
        self.closed[i] = True
        try:
            self.episodes[i].final_reward = _reward(call_env(self.envs[i].finish, self.timeout_s, "finish", self._runner()), "finish")
        except EnvFailure as e:
            self._fail(i, e)
        return None

    def _fail(self, i: int, e: EnvFailure) -> None:
        env, ep = self.envs[i], self.episodes[i]
        self.closed[i] = True
        ep.failed, ep.failure, ep.final_reward = (
            True,
            f"{getattr(env, 'name', '') or type(env).__name__ if env else 'environment'}: {e}",
            0.0,
        )

    def _render(self, ep: Episode, messages: list[Turn], stop_id: int) -> list[int]:
        """The ids that follow the model's stop token: the template's rest of the assistant turn, the
        observation `messages`, and the next generation prompt (see the module docstring)."""
        convo = ep.messages()
        before = self.tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=False)
        after = self.tok.apply_chat_template(
            convo + [{"role": t.role, "content": t.text} for t in messages], tokenize=False, add_generation_prompt=True
        )
        if not after.startswith(before):
            raise EnvFailure(
                "the chat template does not render the conversation as a prefix of the conversation with the observation: "
                "use a prefix-stable template (tokenizer.chat_template)"
            )
        if stop_id not in self.stop_text:
            self.stop_text[stop_id] = self.tok.decode([stop_id], skip_special_tokens=False)
        stop_text = self.stop_text[stop_id]
        at = before.rfind(stop_text) if stop_text else -1
        rest = before[at + len(stop_text) :] if at >= 0 and ep.turns[-1].text in before[:at] else ""
        return list(self.tok.encode(rest + after[len(before) :], add_special_tokens=False))
