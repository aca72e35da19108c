"""The environment interface, the trajectory of an episode, the registry by name and the
reference episode loop (docs/environments.md).

An environment talks with the policy in turns. :meth:`Environment.reset` starts an episode on
one prompt (and its data row's metadata) and may return first messages to put after the
prompt; then for each of the model's turns :meth:`Environment.step` gets the turn's text and
returns a :class:`StepResult`: the messages to append (a tool's result, a user's reply), the
turn's reward and whether the episode is over. Once the episode ends (done, or cut at
``max_turns``) :meth:`Environment.finish` returns its final reward. One environment object
plays one episode; :func:`make_env` builds a fresh one per episode.

:func:`run_episode` is the reference loop, text in and text out, with the model's
turns from a callable here: it keeps every turn in an :class:`Episode` (role, text, whether the
model wrote it, its reward), enforces ``max_turns`` and a per-call wall-clock timeout, and turns an
environment that raises or hangs into a failed episode with its reason, never an exception, so
the other episodes of a step go on (:func:`run_episodes`). :func:`episode_metrics` summarizes them.

The rollout engine plays the same loop at the token level (:mod:`aligner.envs.episodes`, continuing
each episode from its KV cache) and the PPO trainer trains on the model's turns only.
"""

from __future__ import annotations

import abc
import math
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

RewardFn = Callable[[str, str, dict], float]  # (prompt, response, metadata) -> reward, a rule's signature (aligner.reward.rules)
PolicyTurnFn = Callable[[list[dict]], str]  # the conversation so far as chat messages -> the model's next turn text


@dataclass(frozen=True)
class Message:
    """One chat message: ``role`` is "system", "user", "assistant" or "tool" (as chat templates name them)."""

    role: str
    content: str


@dataclass
class Turn:
    """One turn of an episode's trajectory.

    own: True for the model's own turns (their tokens are trained), False for the
    prompt and the environment's observations (masked out of the loss). reward: the per-turn reward
    the environment gave for this model turn (0.0 for the turns the model did not write)."""

    role: str
    text: str
    own: bool
    reward: float = 0.0


@dataclass
class Episode:
    """The trajectory of one episode and how it ended.

    turns: every turn in order, the prompt first (role "user", own=False). final_reward: from
    :meth:`Environment.finish` (0.0 when the episode failed). done: the environment ended it;
    truncated: it was cut at ``max_turns`` instead; failed: the environment raised, timed out or
    returned something invalid, ``failure`` says which and how (one line). counts: the numeric
    ``info`` values of every step summed (a tool environment's ``tool_calls``, ``tool_errors``).
    """

    prompt: str
    metadata: dict
    turns: list[Turn] = field(default_factory=list)
    final_reward: float = 0.0
    done: bool = False
    truncated: bool = False
    failed: bool = False
    failure: str = ""
    counts: dict[str, float] = field(default_factory=dict)

    def messages(self) -> list[dict]:
        """The conversation as chat messages, ``[{"role": ..., "content": ...}, ...]`` (what apply_chat_template takes)."""
        return [{"role": t.role, "content": t.text} for t in self.turns]

    @property
    def model_turns(self) -> list[Turn]:
        """The turns the model wrote, in order."""
        return [t for t in self.turns if t.own]

    @property
    def total_reward(self) -> float:
        """The per-turn rewards plus the final reward."""
        return sum(t.reward for t in self.turns) + self.final_reward


@dataclass(frozen=True)
class StepResult:
    """What :meth:`Environment.step` returns for one model turn.

    messages: the observation, the messages to append after the turn (none when the episode is over).
    reward: this turn's reward (a float, finite). done: the episode is over. info: numbers about the
    step, summed per episode into :attr:`Episode.counts` (e.g. ``{"tool_calls": 2}``)."""

    messages: tuple[Message, ...] = ()
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, float] = field(default_factory=dict)

    @property
    def observation(self) -> Optional[str]:
        """The observation's text (its messages' contents joined by newlines), None when there is none."""
        return "\n".join(m.content for m in self.messages) if self.messages else None


class Environment(abc.ABC):
    """The interface. Subclasses implement :meth:`reset`, :meth:`step` and :meth:`finish`; one object per episode."""

    name: str = ""

    @abc.abstractmethod
    def reset(self, prompt: str, metadata: dict) -> Sequence[Message]:
        """Start an episode on `prompt` (decoded text) with its data row's `metadata`; returns the
        messages to put after the prompt before the model's first turn (usually none)."""

    @abc.abstractmethod
    def step(self, turn: str) -> StepResult:
        """The model's turn (decoded text, special tokens removed) -> the observation, reward and done."""

    @abc.abstractmethod
    def finish(self) -> float:
        """The episode's final reward, called once when it ends (done, or cut at max_turns)."""


@dataclass(frozen=True)
class EnvSpec:
    """What an environment is built from. reward_fn: the final reward, (prompt, response, metadata) ->
    float, e.g. a rule of aligner.reward.rules passed in by the caller (envs sit below the reward
    package and import nothing of it). tools: names in aligner.envs.tools.TOOLS. chat_template: the
    tokenizer's Jinja template ("" = none), which decides the tool-call message format (aligner.envs.tool_env)."""

    reward_fn: RewardFn
    tools: tuple[str, ...] = ()
    chat_template: str = ""


ENVIRONMENTS: dict[str, Callable[[EnvSpec], Environment]] = {}  # name -> factory; config.common.ENV_NAMES lists the same names


def register_env(name: str) -> Callable:
    """Class decorator: register an Environment subclass (built as ``cls(spec)``) under `name`; ValueError if taken."""

    def add(cls):
        if name in ENVIRONMENTS:
            raise ValueError(f"environment {name!r} is registered twice: pick another name")
        cls.name = name
        ENVIRONMENTS[name] = cls
        return cls

    return add


def get_env(name: str) -> Callable[[EnvSpec], Environment]:
    """The factory of environment `name`; ValueError listing the valid names otherwise."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"env.name={name!r} is unknown: valid environments are {', '.join(ENVIRONMENTS)}")
    return ENVIRONMENTS[name]


def make_env(name: str, spec: EnvSpec) -> Environment:
    """A fresh environment `name` built from `spec` (ValueError for an unknown name or a bad spec)."""
    return get_env(name)(spec)


@register_env("single_turn")
class SingleTurnEnv(Environment):
    """One model turn, scored by the reward function: today's single-turn rollout as an environment."""

    def __init__(self, spec: EnvSpec) -> None:
        self.reward_fn = spec.reward_fn

    def reset(self, prompt: str, metadata: dict) -> Sequence[Message]:
        self.prompt, self.metadata, self.response = prompt, metadata, ""
        return ()

    def step(self, turn: str) -> StepResult:
        self.response = turn
        return StepResult(done=True)

    def finish(self) -> float:
        return float(self.reward_fn(self.prompt, self.response, self.metadata))


class EnvFailure(Exception):
    """An environment call raised, timed out or returned something invalid (caught by :func:`run_episode`)."""


class EnvRunner:
    """Runs environment calls on one daemon worker thread, each with a wall-clock limit.

    Starting a thread per call costs about 1.5 ms on a busy CPU (measured 2026-11-26 on a 2-core Xeon,
    beside a generating engine): a batch of episodes pays it twice a turn. The runner keeps one
    worker thread and hands it each call; a call that runs past its limit leaves its thread behind
    (Python cannot stop a thread: it is a daemon, so it does not keep the process alive) and the
    runner starts a fresh one for the next calls. Not for concurrent callers: one runner per
    episode loop."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._start()

    def _start(self) -> None:
        self._queue = queue.SimpleQueue()
        threading.Thread(target=self._serve, args=(self._queue,), name="env-runner", daemon=True).start()

    @staticmethod
    def _serve(calls: queue.SimpleQueue) -> None:
        while True:
            fn, box, done = calls.get()
            try:
                box["value"] = fn()
            except BaseException as e:  # reported to the caller
                box["error"] = e
            done.set()

    def call(self, fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
        """``fn()`` on the worker thread, as :func:`call_env` (the same errors)."""
        box: dict[str, Any] = {}
        done = threading.Event()
        self._queue.put((fn, box, done))
        if not done.wait(timeout_s):
            self._start()  # the old thread is stuck in fn: the next calls get a fresh one
            raise EnvFailure(f"{what} timed out after {timeout_s:g} s")
        return _unbox(box, what)


def call_env(fn: Callable[[], Any], timeout_s: float, what: str, runner: Optional[EnvRunner] = None) -> Any:
    """``fn()`` with a wall-clock limit of `timeout_s` seconds; raises :class:`EnvFailure` naming `what`
    when it raises or runs past the limit.

    The call runs in a daemon thread (`runner`'s, or one started for it): Python cannot stop a
    thread, so a call past its limit is left running in the background (its environment object is
    never used again) and does not keep the process alive at exit. An environment that runs
    untrusted code must bound it itself, in a subprocess (as aligner.reward.sandbox does for code tests)."""
    if runner is not None:
        return runner.call(fn, timeout_s, what)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # reported to the caller below
            box["error"] = e

    thread = threading.Thread(target=target, name=f"env-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise EnvFailure(f"{what} timed out after {timeout_s:g} s")
    return _unbox(box, what)


def _unbox(box: dict[str, Any], what: str) -> Any:
    if "error" in box:
        e = box["error"]
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise EnvFailure(f"{what} raised {type(e).__name__}: {first}" if first else f"{what} raised {type(e).__name__}")
    return box["value"]


def _messages(value: Any, what: str) -> list[Turn]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, Message) for m in value):
        raise EnvFailure(f"{what} returned {type(value).__name__}, not a sequence of Message")
    return [Turn(m.role, m.content, own=False) for m in value]


def _reward(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EnvFailure(f"{what} gave the reward {value!r}: a finite number is needed")
    return float(value)


def _add_counts(counts: dict[str, float], info: Any, what: str) -> None:
    if not isinstance(info, Mapping) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in info.values()):
        raise EnvFailure(f"{what} gave the info {info!r}: a mapping of names to numbers is needed")
    for key, value in info.items():
        counts[key] = counts.get(key, 0) + value


def run_episode(
    env: Environment, prompt: str, metadata: dict, policy_turn_fn: PolicyTurnFn, *, max_turns: int, timeout_s: float
) -> Episode:
    """Play one episode: reset, then up to `max_turns` model turns each followed by ``env.step``, then ``env.finish``.

    policy_turn_fn: the model; it gets the conversation so far (:meth:`Episode.messages`) and returns
    its next turn's text; its own exceptions propagate (they are the engine's, not the environment's).
    max_turns: the most model turns (>= 1); an episode not done after them is ``truncated`` and the
    observation of its last step is dropped (the model would never read it). timeout_s: the wall-clock
    limit of each environment call (reset, each step, finish), seconds.

    Returns the :class:`Episode`; an environment call that raises, times out or returns a bad value
    ends it with ``failed=True``, the reason in ``failure`` and ``final_reward=0.0``.
    Raises ValueError for max_turns < 1 or timeout_s <= 0.
    """
    if max_turns < 1 or not timeout_s > 0:
        raise ValueError(f"run_episode: max_turns={max_turns!r} must be >= 1 and timeout_s={timeout_s!r} > 0")
    episode = Episode(prompt=prompt, metadata=dict(metadata), turns=[Turn("user", prompt, own=False)])
    try:
        episode.turns += _messages(call_env(lambda: env.reset(prompt, metadata), timeout_s, "reset"), "reset")
        for i in range(max_turns):
            text = policy_turn_fn(episode.messages())
            turn = Turn("assistant", text, own=True)
            episode.turns.append(turn)
            result = call_env(lambda text=text: env.step(text), timeout_s, f"step {i + 1}")
            if not isinstance(result, StepResult):
                raise EnvFailure(f"step {i + 1} returned {type(result).__name__}, not a StepResult")
            turn.reward = _reward(result.reward, f"step {i + 1}")
            _add_counts(episode.counts, result.info, f"step {i + 1}")
            if result.done:
                episode.done = True
                break
            if i + 1 < max_turns:
                episode.turns += _messages(result.messages, f"step {i + 1}")
        episode.truncated = not episode.done
        episode.final_reward = _reward(call_env(env.finish, timeout_s, "finish"), "finish")
    except EnvFailure as e:
        episode.failed, episode.failure = True, f"{env.name or type(env).__name__}: {e}"
        episode.final_reward = 0.0
    return episode


def run_episodes(
    env_factory: Callable[[], Environment],
    rows: Sequence[tuple[str, dict]],
    policy_turn_fn: PolicyTurnFn,
    *,
    max_turns: int,
    timeout_s: float,
) -> list[Episode]:
    """One episode per (prompt, metadata) row, each with a fresh environment from `env_factory`, in order.

    A failing environment (raising, hanging, or failing to be built) fails its own episode only; the
    others run. Returns the episodes in the rows' order. Raises what :func:`run_episode` raises."""
    episodes = []
    for prompt, metadata in rows:
        try:
            env = env_factory()
        except Exception as e:  # the episode fails, the step goes on
            episodes.append(
                Episode(
                    prompt,
                    dict(metadata),
                    [Turn("user", prompt, own=False)],
                    failed=True,
                    failure=f"building the environment raised {type(e).__name__}: {e}",
                )
            )
            continue
        episodes.append(run_episode(env, prompt, metadata, policy_turn_fn, max_turns=max_turns, timeout_s=timeout_s))
    return episodes


def episode_metrics(episodes: Sequence[Episode], prefix: str = "env/") -> dict[str, float]:
    """Metrics of a batch of episodes, names under `prefix`, per episode where not said otherwise:

    episodes (the count); failed and truncated (fractions); turns (model turns, mean); tool_call_rate
    (the fraction with at least one tool call); final_reward_mean (over the episodes that did not
    fail; absent when all failed); and every key of :attr:`Episode.counts`, averaged over the episodes
    (``tool_calls``, ``tool_errors``, ``retries``). Empty batch: episodes 0 and the rest 0.0."""
    n = len(episodes)
    per = 1 / n if n else 0.0
    out: dict[str, float] = {
        "episodes": float(n),
        "failed": sum(e.failed for e in episodes) * per,
        "truncated": sum(e.truncated for e in episodes) * per,
        "turns": sum(len(e.model_turns) for e in episodes) * per,
        "tool_call_rate": sum(e.counts.get("tool_calls", 0) > 0 for e in episodes) * per,
    }
    ok = [e.final_reward for e in episodes if not e.failed]
    if ok:
        out["final_reward_mean"] = sum(ok) / len(ok)
    for key in sorted({k for e in episodes for k in e.counts}):
        out[key] = sum(float(e.counts.get(key, 0)) for e in episodes) * per
    return {f"{prefix}{k}": v for k, v in out.items()}
