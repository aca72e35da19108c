"""An OpenAI-compatible endpoint over a rollout engine that records every token (docs/agents.md).

``POST /v1/chat/completions``, ``POST /v1/completions`` and ``GET /v1/models`` in OpenAI's wire format
(non-streaming: ``stream: true`` is refused with 400), so an agent written with the ``openai`` client
(or any framework on top of it) trains through aligner by pointing ``base_url`` at :attr:`OpenAIEndpoint.url`.
``GET /health`` answers without a token; ``POST /v1/episodes/{episode_id}/reward`` with ``{"reward": x}`` is
how an agent reports its episode's return (:meth:`OpenAIEndpoint.report_reward`).

Sampling fields: ``temperature`` (default 1; 0 = greedy), ``top_p``, ``max_tokens`` /
``max_completion_tokens`` (default: what fits in the model's context, capped by ``default_max_tokens``),
``stop`` (a string or up to 4; one that is a single token stops the engine at that token, a longer one
cuts the completion after the token that completes it), ``n`` (choices, seeds ``seed + i``), ``seed``,
``top_k`` (an extension, as vLLM's), ``logprobs`` (each sampled token's log-prob; ``top_logprobs``
are not served), ``tools`` (rendered by the tokenizer's chat template when it defines tool calls,
else taught in the system message with Hermes' tags, as :mod:`aligner.envs.tool_env` does).
Tool calls in a completion (Hermes' ``<tool_call>{...}</tool_call>``) come back as the message's
``tool_calls`` with finish_reason ``tool_calls``. Refused with 400: ``stream``, non-zero
``presence_penalty`` / ``frequency_penalty``, ``logit_bias``, ``top_logprobs`` > 0, a
``response_format`` other than text, ``tool_choice`` other than auto / none.

The episode id: the ``X-Episode-Id`` header, else the request's ``user`` field (both given and
different: 400); a call without one gets 400 (``require_episode_id``). Every sampled choice is a
:class:`aligner.rollout.agent.record.CallRecord` of that episode: prompt ids, completion ids,
per-token log-probs, the engine's weight_version.

Token-faithful prompts. A chat call's prompt is the chat template's rendering of its messages. When an
assistant message equals one this endpoint returned in the episode (content and tool calls), the
model's own text stands in for it (so the tool calls render as sampled, not as re-serialized JSON).
When the rendered text starts with an earlier record's prompt text + completion text (special tokens
kept), the prompt is that record's token ids, then its completion's ids as sampled, then the
tokenization of the rest only: the model's tokens are never re-tokenized, and the call continues
that record's segment. When no record's text is a prefix, the call starts a new segment and the
record says why (the first token where the full re-tokenized prompt differs from the latest
record's context). A ``/v1/completions`` prompt given as token ids is matched token for token.

Serving. HTTP requests are handled on threads (:class:`aligner.runtime.http.GuardedHTTPServer`: loopback
unless told, bearer token, bounded body and connections, non-loopback bind without a token refused).
One engine thread runs the engine: it takes every waiting call, groups them by sampling parameters
and runs one ``generate`` per group (the engine batches the group's prompts continuously); calls
arriving meanwhile wait for the next round. :meth:`OpenAIEndpoint.paused` holds the engine between
rounds, e.g. while the trainer swaps weights: calls arriving then wait, and every call is served by
one weight version (or, with an interruptible engine, carries per-token versions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import queue
import random
import threading
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Iterator, Optional
from urllib.parse import unquote

from aligner.config import SamplingConfig
from aligner.envs.tool_env import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    parse_tool_calls,
    template_defines_tool_calls,
    tool_instructions,
)
from aligner.rollout.agent.record import AgentRecorder, CallRecord, build_samples
from aligner.runtime.http import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_REQUEST_BYTES, GuardedHandler, GuardedHTTPServer

log = logging.getLogger("aligner.openai_server")

EPISODE_HEADER = "X-Episode-Id"
MAX_STOP = 4
MAX_EPISODE_ID_CHARS = 256
ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request the endpoint refuses: answered with `status` and an OpenAI-style error body."""

    def __init__(
        self, message: str, status: int = 400, kind: str = "invalid_request_error", param: Optional[str] = None, code: Optional[str] = None
    ):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code


@dataclass
class _Call:
    """One call's work for the engine thread: `n` choices of one prompt."""

    prompt_ids: list[int]
    sampling: SamplingConfig
    seeds: list[int]
    budget: int
    future: Future


@dataclass
class _Prompt:
    """A call's prompt: its ids, the text they stand for, and the segment it continues."""

    ids: list[int]
    text: str
    parent: Optional[int]
    break_reason: str


class _Spec:
    """An OpenAI ``tools`` entry as :func:`aligner.envs.tool_env.tool_instructions` reads a Tool."""

    def __init__(self, entry: dict) -> None:
        self.entry = entry

    def spec(self) -> dict:
        return self.entry


class OpenAIEndpoint:
    """The endpoint: an HTTP server and an engine thread over `engine`.

    Args:
        engine: a :class:`aligner.rollout.base.RolloutEngine` (``generate(prompt_ids, sampling, seeds=,
            max_new_tokens=)``, ``stop_ids(sampling)``, ``weight_version``; the TorchEngine).
        tokenizer: the policy's transformers tokenizer (encode, decode, apply_chat_template).
        max_seq_len: the engine's context, tokens (prompt + completion).
        model_name: the name ``/v1/models`` lists and requests must give (``model``).
        host / port / token / max_request_bytes / max_connections / read_timeout_s: the HTTP server's
            bounds (:class:`aligner.runtime.http.GuardedHTTPServer`); port 0 = a free port.
        default_max_tokens: a call's completion budget when it gives none (capped by the room left).
        max_n: the most choices per call. require_episode_id: refuse calls without an episode id.
        request_timeout_s: how long a call waits for the engine before a 503.
        teach_tools: with a chat template that defines no tool calls, write the request's ``tools`` into the
            system message (:func:`aligner.envs.tool_env.tool_instructions`); False for a model that learned
            the tag format without them (conf=tiny_tools' SFT model, as the in-process tool environment
            plays it). Calls in completions are parsed either way.
        base_sampling: the engine sampling fields a request does not set (SamplingConfig; top_k, stop ids).
        recorder: where calls are recorded (a new :class:`AgentRecorder` by default).
    Raises ValueError for a non-loopback host without a token or bad bounds; OSError if the port is taken.
    Call :meth:`start`, then :meth:`close`.
    """

    def __init__(
        self,
        engine,
        tokenizer,
        *,
        max_seq_len: int,
        model_name: str = "aligner-policy",
        host: str = "127.0.0.1",
        port: int = 0,
        token: str = "",
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        read_timeout_s: float = 30.0,
        default_max_tokens: int = 256,
        max_n: int = 16,
        require_episode_id: bool = True,
        request_timeout_s: float = 600.0,
        teach_tools: bool = True,
        base_sampling: Optional[SamplingConfig] = None,
        recorder: Optional[AgentRecorder] = None,
    ) -> None:
        self.engine, self.tok, self.max_seq_len, self.model_name = engine, tokenizer, max_seq_len, model_name
        self.default_max_tokens, self.max_n = default_max_tokens, max_n
        self.require_episode_id, self.request_timeout_s, self.teach_tools = require_episode_id, request_timeout_s, teach_tools
        self.base_sampling = base_sampling or SamplingConfig()
        # True: every call samples with base_sampling's temperature, top_p and top_k whatever it asks
        # (an RL run's behaviour policy; aligner.workers.agent_episodes sets it)
        self.fixed_sampling = False
        self.recorder = recorder or AgentRecorder()
        self.vocab_size = engine.cfg.vocab_size
        self.template = getattr(tokenizer, "chat_template", None) or ""
        self.tool_template = template_defines_tool_calls(self.template)
        self._queue: queue.Queue = queue.Queue()
        self._engine_lock = threading.Lock()
        self._returned: dict[str, dict[str, str]] = {}  # episode -> returned assistant message key -> the model's raw text
        self._rng = random.Random()
        self._stopping = threading.Event()
        self.stats = {"calls": 0, "engine_rounds": 0, "errors": 0}
        self.http = GuardedHTTPServer(
            _Handler,
            host=host,
            port=port,
            token=token,
            max_request_bytes=max_request_bytes,
            max_connections=max_connections,
            read_timeout_s=read_timeout_s,
        )
        self.http.endpoint = self
        self._threads: list[threading.Thread] = []

    # ---- life cycle ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The base URL the openai client takes, ``http://host:port/v1``."""
        host, port = self.http.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> OpenAIEndpoint:
        """Start the HTTP and engine threads; returns self."""
        for target, name in ((self.http.serve_forever, "openai-http"), (self._engine_loop, "openai-engine")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        """Stop serving: the HTTP server shuts down, the engine thread ends after its round."""
        self._stopping.set()
        self._queue.put(None)
        self.http.shutdown()
        self.http.server_close()
        for t in self._threads:
            t.join(timeout=30)

    def __enter__(self) -> OpenAIEndpoint:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the engine between rounds (e.g. while its weights are updated); calls arriving wait."""
        with self._engine_lock:
            yield

    def take_samples(self, episode_id: str) -> list:
        """Remove the episode's records and return its training samples
        (:func:`aligner.rollout.agent.record.build_samples`; [] for an unknown id)."""
        with self.recorder.lock():
            self._returned.pop(episode_id, None)
        return build_samples(self.recorder.pop(episode_id))

    # ---- the engine thread ---------------------------------------------------------------
    def _engine_loop(self) -> None:
        while not self._stopping.is_set():
            first = self._queue.get()
            if first is None:
                return
            calls = [first]
            while True:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._stopping.set()
                    break
                calls.append(more)
            groups: dict[tuple, list[_Call]] = {}
            for c in calls:
                s = c.sampling
                groups.setdefault((s.temperature, s.top_k, s.top_p, tuple(s.stop_token_ids)), []).append(c)
            for group in groups.values():
                self._run_group(group)

    def _run_group(self, group: list[_Call]) -> None:
        prompts, seeds, budgets = [], [], []
        for c in group:
            prompts += [c.prompt_ids] * len(c.seeds)
            seeds += c.seeds
            budgets += [c.budget] * len(c.seeds)
        try:
            with self._engine_lock:
                gens = self.engine.generate(prompts, group[0].sampling, seeds=seeds, max_new_tokens=budgets)
            self.stats["engine_rounds"] += 1
        except Exception as e:  # noqa: BLE001 - every call of the group gets the error
            for c in group:
                c.future.set_exception(e)
            return
        at = 0
        for c in group:
            c.future.set_result(gens[at : at + len(c.seeds)])
            at += len(c.seeds)

    # ---- requests --------------------------------------------------------------------------
    def models(self) -> dict:
        """``GET /v1/models``'s body."""
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "aligner"}]}

    def episode_id(self, body: dict, header: Optional[str]) -> str:
        """The call's episode id (header, else ``user``); RequestError when missing, conflicting or too long."""
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise RequestError('"user" must be a string (it names the episode)', param="user")
        if header and user and header != user:
            raise RequestError(f'the {EPISODE_HEADER} header {header!r} and "user" {user!r} differ: send one episode id', param="user")
        eid = header or user or ""
        if len(eid) > MAX_EPISODE_ID_CHARS:
            raise RequestError(f"the episode id has {len(eid)} characters, over {MAX_EPISODE_ID_CHARS}", param="user")
        if not eid and self.require_episode_id:
            raise RequestError(
                f'no episode id: send the {EPISODE_HEADER} header (default_headers=...) or "user" with every call of an episode',
                param="user",
                code="missing_episode_id",
            )
        return eid or f"anon-{uuid.uuid4().hex}"

    def _sampling(self, body: dict) -> tuple[SamplingConfig, list[str]]:
        """The engine sampling of a request and its multi-token stop strings; RequestError for bad fields."""
        for key in ("presence_penalty", "frequency_penalty"):
            if body.get(key) not in (None, 0, 0.0):
                raise RequestError(f"{key}={body[key]!r} is not supported by this endpoint: leave it unset or 0", param=key)
        if body.get("logit_bias"):
            raise RequestError("logit_bias is not supported by this endpoint", param="logit_bias")
        if body.get("stream"):
            raise RequestError("stream=true is not supported: this endpoint answers whole completions (stream=false)", param="stream")
        if isinstance(body.get("top_logprobs"), int) and body["top_logprobs"] > 0:
            raise RequestError("top_logprobs > 0 is not supported: logprobs=true gives each sampled token's log-prob", param="top_logprobs")
        rf = body.get("response_format")
        if rf not in (None, {"type": "text"}):
            raise RequestError("response_format other than text is not supported", param="response_format")
        t = _number(body, "temperature", 1.0, lo=0.0, hi=2.0)
        p = _number(body, "top_p", 1.0, lo=0.0, hi=1.0)
        if p <= 0:
            raise RequestError(f"top_p={p} is invalid: must be in (0, 1]", param="top_p")
        k = body.get("top_k", self.base_sampling.top_k)
        if k is None or k == -1:
            k = 0
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise RequestError(f"top_k={k!r} is invalid: an integer >= 0 (0 or -1 = off)", param="top_k")
        if self.fixed_sampling:  # training: the run's sampling, whose log-probs the trainer recomputes
            t, p, k = self.base_sampling.temperature, self.base_sampling.top_p, self.base_sampling.top_k
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
            raise RequestError(f'"stop" must be a non-empty string or a list of at most {MAX_STOP}', param="stop")
        stop_ids, strings = list(self.base_sampling.stop_token_ids), []
        for s in stops:
            ids = self.tok.encode(s, add_special_tokens=False)
            if len(ids) == 1:
                stop_ids.append(int(ids[0]))
            else:
                strings.append(s)
        sampling = dataclasses.replace(
            self.base_sampling, temperature=float(t), top_p=float(p), top_k=k, stop_token_ids=sorted(set(stop_ids))
        )
        return sampling, strings

    def _choices(self, body: dict) -> tuple[int, Optional[int]]:
        n = body.get("n", 1)
        if n is None:
            n = 1
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.max_n:
            raise RequestError(f"n={n!r} is invalid: an integer in [1, {self.max_n}]", param="n")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise RequestError(f"seed={seed!r} is invalid: an integer", param="seed")
        return n, seed

    def _budget(self, body: dict, prompt_len: int) -> int:
        room = self.max_seq_len - prompt_len
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        asked = body.get(key)
        if room < 1:
            raise RequestError(
                f"the prompt has {prompt_len} tokens, leaving no room in the model's context of {self.max_seq_len}: shorten the conversation",
                code="context_length_exceeded",
                param="messages",
            )
        if asked is None:
            return min(self.default_max_tokens, room)
        if not isinstance(asked, int) or isinstance(asked, bool) or asked < 1:
            raise RequestError(f"{key}={asked!r} is invalid: an integer >= 1", param=key)
        if asked > room:
            raise RequestError(
                f"{key}={asked} with the {prompt_len}-token prompt exceeds the model's context of {self.max_seq_len}: "
                f"ask for at most {room}",
                code="context_length_exceeded",
                param=key,
            )
        return asked

    def _sample(self, prompt_ids: list[int], sampling: SamplingConfig, n: int, seed: Optional[int], budget: int) -> list:
        """Queue the call for the engine thread and wait for its n Generations."""
        seeds = [(seed + i) if seed is not None else self._rng.randrange(2**62) for i in range(n)]
        fut: Future = Future()
        self._queue.put(_Call(prompt_ids, sampling, seeds, budget, fut))
        try:
            return fut.result(timeout=self.request_timeout_s)
        except FutureTimeout:
            raise RequestError(
                f"the engine did not answer within {self.request_timeout_s:g} s: retry later", status=503, kind="server_error"
            ) from None
        except ValueError as e:  # the engine refuses the input
            raise RequestError(f"the engine cannot serve this request: {e}") from None

    # ---- prompts ---------------------------------------------------------------------------
    def _match(self, eid: str, text: Optional[str], ids: Optional[list[int]]) -> tuple[Optional[int], str]:
        """(the record this prompt continues or None, why not when the episode has records); call with the recorder's lock."""
        recs = self.recorder._records(eid)
        if not recs:
            return None, ""
        for i in range(len(recs) - 1, -1, -1):
            r = recs[i]
            if self.recorder.has_child(eid, i):
                continue
            if text is not None and text.startswith(r.prompt_text + r.completion_text):
                return i, ""
            if ids is not None and ids[: len(r.context_ids)] == r.context_ids:
                return i, ""
        last = recs[-1]
        full = ids if ids is not None else self.tok.encode(text, add_special_tokens=False)
        ctx = last.context_ids
        k = next((j for j, (a, b) in enumerate(zip(full, ctx)) if a != b), min(len(full), len(ctx)))
        what = f"token {k}: {ctx[k] if k < len(ctx) else 'end'} in call {last.call}'s prompt + completion, {full[k] if k < len(full) else 'end'} here"
        return None, f"the prompt does not extend any earlier call's prompt + completion (first difference at {what})"

    def _prompt_from_text(self, eid: str, text: str, special: bool) -> _Prompt:
        parent, why = self._match(eid, text, None)
        if parent is not None:
            r = self.recorder._records(eid)[parent]
            rest = text[len(r.prompt_text) + len(r.completion_text) :]
            ids = r.context_ids + (self.tok.encode(rest, add_special_tokens=False) if rest else [])
            return _Prompt(ids, text, parent, "")
        return _Prompt(list(self.tok.encode(text, add_special_tokens=special)), text, None, why)

    def _render(self, eid: str, messages: Any, tools: Any) -> str:
        """The chat template's rendering of the request's messages (add_generation_prompt=True)."""
        if not isinstance(messages, list) or not messages:
            raise RequestError('"messages" must be a non-empty list', param="messages")
        if tools is not None and (
            not isinstance(tools, list)
            or not all(isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict) for t in tools)
        ):
            raise RequestError('"tools" must be a list of {"type": "function", "function": {...}}', param="tools")
        returned = self._returned.get(eid, {})
        convo: list[dict] = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise RequestError(f"messages[{i}] must be an object with a role in {', '.join(ROLES)}", param=f"messages[{i}]")
            role, content = m["role"], _text(m.get("content"), i)
            if role == "developer":
                role = "system"
            if role == "assistant":
                calls = _tool_calls(m.get("tool_calls"), i)
                raw = returned.get(_message_key(content, calls))
                if raw is not None:  # the model's own text, as sampled
                    convo.append({"role": "assistant", "content": raw})
                elif calls and not self.tool_template:
                    text = "\n".join(TOOL_CALL_OPEN + json.dumps({"name": n, "arguments": a}) + TOOL_CALL_CLOSE for n, a in calls)
                    convo.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
                elif calls:
                    convo.append(
                        {
                            "role": "assistant",
                            "content": content,
                            "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls],
                        }
                    )
                else:
                    convo.append({"role": "assistant", "content": content})
            elif role == "tool" and not self.tool_template:
                wrapped = f"{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}"
                if convo and convo[-1].get("_tool"):  # consecutive results: one user message, as the tool environment sends
                    convo[-1]["content"] += "\n" + wrapped
                else:
                    convo.append({"role": "user", "content": wrapped, "_tool": True})
            else:
                convo.append({"role": role, "content": content})
        for m in convo:
            m.pop("_tool", None)
        kwargs: dict = {}
        if tools:
            if self.tool_template:
                kwargs["tools"] = tools
            elif self.teach_tools:
                teach = tool_instructions([_Spec(t) for t in tools])
                if convo[0]["role"] == "system":
                    convo[0] = {"role": "system", "content": f"{convo[0]['content']}\n\n{teach}"}
                else:
                    convo.insert(0, {"role": "system", "content": teach})
        try:
            return self.tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception as e:  # noqa: BLE001 - a template error is the request's problem
            raise RequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}", param="messages") from None

    # ---- the calls ---------------------------------------------------------------------------
    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model != self.model_name:
            raise RequestError(
                f"the model {model!r} does not exist here: this endpoint serves {self.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )

    def _generate(self, eid: str, prompt: _Prompt, body: dict) -> tuple[list[CallRecord], set]:
        """Sample the call's choices and record them; (the records, the engine's stop ids)."""
        sampling, stop_strings = self._sampling(body)
        n, seed = self._choices(body)
        for i, t in enumerate(prompt.ids):
            if not 0 <= t < self.vocab_size:
                raise RequestError(f"prompt token {i} is {t}, outside the model's vocabulary [0, {self.vocab_size})", param="prompt")
        budget = self._budget(body, len(prompt.ids))
        gens = self._sample(prompt.ids, sampling, n, seed, budget)
        stops = set(self.engine.stop_ids(sampling))
        records = []
        with self.recorder.lock():
            call = self.recorder.next_call(eid)
            for choice, g in enumerate(gens):
                ids, lps, reason = list(g.token_ids), list(g.rollout_log_probs), g.finish_reason
                versions = list(g.token_versions) if g.token_versions is not None else None
                if stop_strings:
                    cut = self._stop_string_cut(ids, stop_strings)
                    if cut is not None:
                        ids, lps, reason = ids[:cut], lps[:cut], "stop"
                        versions = versions[:cut] if versions is not None else None
                rec = CallRecord(
                    episode_id=eid,
                    call=call,
                    choice=choice,
                    prompt_ids=list(prompt.ids),
                    completion_ids=ids,
                    log_probs=lps,
                    weight_version=g.weight_version,
                    token_versions=versions,
                    finish_reason=reason,
                    parent=prompt.parent,
                    break_reason=prompt.break_reason,
                    prompt_text=prompt.text,
                    completion_text=self.tok.decode(ids, skip_special_tokens=False),
                )
                self.recorder.add(rec)
                records.append(rec)
        self.stats["calls"] += 1
        return records, stops

    def _stop_string_cut(self, ids: list[int], strings: list[str]) -> Optional[int]:
        """The length to cut `ids` to: up to the token that completes the first stop string, None if none occurs."""
        for k in range(1, len(ids) + 1):
            text = self.tok.decode(ids[:k], skip_special_tokens=False)
            if any(s in text for s in strings):
                return k
        return None

    def chat(self, body: dict, header_episode: Optional[str]) -> dict:
        """``POST /v1/chat/completions``: the response body; RequestError for a refused request."""
        self._check_model(body)
        eid = self.episode_id(body, header_episode)
        tool_choice = body.get("tool_choice")
        if tool_choice not in (None, "auto", "none"):
            raise RequestError("tool_choice other than auto or none is not supported", param="tool_choice")
        tools = body.get("tools") if tool_choice != "none" else None
        with self.recorder.lock():
            text = self._render(eid, body.get("messages"), tools)
            prompt = self._prompt_from_text(eid, text, special=False)
        records, stops = self._generate(eid, prompt, body)
        choices = []
        with self.recorder.lock():
            returned = self._returned.setdefault(eid, {})
        for rec in records:
            stopped = bool(rec.completion_ids) and rec.completion_ids[-1] in stops
            content_ids = rec.completion_ids[:-1] if stopped else rec.completion_ids
            text = self.tok.decode(content_ids, skip_special_tokens=True)
            calls = parse_tool_calls(text) if tools else []
            good = [c for c in calls if not c.error]
            message: dict = {"role": "assistant", "content": text}
            finish = "length" if rec.finish_reason == "length" else "stop"
            if good and len(good) == len(calls):
                content = _strip_calls(text)
                message = {
                    "role": "assistant",
                    "content": content or None,
                    "tool_calls": [
                        {
                            "id": f"call_{uuid.uuid4().hex[:24]}",
                            "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                        }
                        for c in good
                    ],
                }
                finish = "tool_calls" if rec.finish_reason != "length" else "length"
                key = _message_key(content, [(c.name, c.arguments) for c in good])
            else:
                key = _message_key(text, [])
            # the model's text as the template must render it in a later call (its tool calls as sampled)
            returned[key] = self.tok.decode(content_ids, skip_special_tokens=False)
            choice = {"index": rec.choice, "message": message, "finish_reason": finish, "logprobs": None}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [self._logprob_entry(t, lp) for t, lp in zip(rec.completion_ids, rec.log_probs)]}
            if body.get("return_token_ids"):
                choice["token_ids"] = list(rec.completion_ids)
            choices.append(choice)
        out = self._envelope("chat.completion", choices, records)
        if body.get("return_token_ids"):
            out["prompt_token_ids"] = list(records[0].prompt_ids)
        return out

    def completions(self, body: dict, header_episode: Optional[str]) -> dict:
        """``POST /v1/completions``: the response body; RequestError for a refused request."""
        self._check_model(body)
        eid = self.episode_id(body, header_episode)
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        with self.recorder.lock():
            if isinstance(p, str) and p:
                prompt = self._prompt_from_text(eid, p, special=True)
            elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                parent, why = self._match(eid, None, p)
                prompt = _Prompt(list(p), self.tok.decode(p, skip_special_tokens=False), parent, why)
            else:
                raise RequestError('"prompt" must be one non-empty string or one non-empty list of token ids', param="prompt")
        if body.get("echo"):
            raise RequestError("echo is not supported", param="echo")
        records, _ = self._generate(eid, prompt, body)
        choices = []
        for rec in records:
            choice = {
                "index": rec.choice,
                "text": self.tok.decode(rec.completion_ids, skip_special_tokens=True),
                "finish_reason": rec.finish_reason,
                "logprobs": None,
            }
            if body.get("logprobs") is not None:
                tokens = [self.tok.decode([t], skip_special_tokens=False) for t in rec.completion_ids]
                offsets, at = [], 0
                for t in tokens:
                    offsets.append(at)
                    at += len(t)
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": list(rec.log_probs), "top_logprobs": None, "text_offset": offsets}
            if body.get("return_token_ids"):
                choice["token_ids"] = list(rec.completion_ids)
            choices.append(choice)
        return self._envelope("text_completion", choices, records)

    def report_reward(self, episode_id: str, body: dict) -> dict:
        """``POST /v1/episodes/{episode_id}/reward`` with ``{"reward": float}``: the agent reports its episode's
        return (the last report wins). RequestError for an empty id or a reward that is not a finite number."""
        reward = body.get("reward")
        if not episode_id or len(episode_id) > MAX_EPISODE_ID_CHARS:
            raise RequestError(f"the episode id {episode_id!r} is invalid: 1 to {MAX_EPISODE_ID_CHARS} characters", param="episode_id")
        if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
            raise RequestError(f'"reward" must be a finite number, got {reward!r}', param="reward")
        self.recorder.set_reward(episode_id, float(reward))
        return {"episode_id": episode_id, "reward": float(reward)}

    def _logprob_entry(self, token_id: int, lp: float) -> dict:
        text = self.tok.decode([token_id], skip_special_tokens=False)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")), "top_logprobs": []}

    def _envelope(self, obj: str, choices: list, records: list[CallRecord]) -> dict:
        completion = sum(len(r.completion_ids) for r in records)
        prompt = len(records[0].prompt_ids)
        prefix = "chatcmpl" if obj == "chat.completion" else "cmpl"
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": obj,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
            "system_fingerprint": f"weight_version-{records[0].weight_version}",
        }


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
        raise RequestError(f"{key}={v!r} is invalid: a number in [{lo:g}, {hi:g}]", param=key)
    return float(v)


def _text(content: Any, i: int) -> str:
    """A message's content as text (a string, None, or a list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise RequestError(
        f"messages[{i}].content must be a string or a list of text parts (images and audio are not supported)", param=f"messages[{i}]"
    )


def _tool_calls(calls: Any, i: int) -> list[tuple[str, Any]]:
    """An assistant message's tool calls as (name, arguments object) pairs."""
    if not calls:
        return []
    out = []
    for c in calls if isinstance(calls, list) else [None]:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(
                f"messages[{i}].tool_calls must be a list of {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
                param=f"messages[{i}]",
            )
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        out.append((fn["name"], args))
    return out


def _message_key(content: str, calls: list[tuple[str, Any]]) -> str:
    """What identifies an assistant message the endpoint returned when the agent sends it back."""
    return json.dumps([content.strip(), [[n, a] for n, a in calls]], sort_keys=True)


def _strip_calls(text: str) -> str:
    """`text` without its ``<tool_call>...</tool_call>`` blocks, stripped."""
    out, at = [], 0
    while True:
        i = text.find(TOOL_CALL_OPEN, at)
        if i < 0:
            out.append(text[at:])
            break
        j = text.find(TOOL_CALL_CLOSE, i)
        out.append(text[at:i])
        if j < 0:
            break
        at = j + len(TOOL_CALL_CLOSE)
    return "".join(out).strip()


class _Handler(GuardedHandler):
    server: GuardedHTTPServer
    server_version = "aligner-openai"

    @classmethod
    def error_body(cls, status: int, message: str, kind: str = "", param: Optional[str] = None, code: Optional[str] = None) -> dict:
        return {
            "error": {
                "message": message,
                "type": kind or ("invalid_request_error" if status < 500 else "server_error"),
                "param": param,
                "code": code,
            }
        }

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?")[0]
        if path == "/health":
            self.reply(200, {"status": "ok", "model": self.server.endpoint.model_name})
            return
        if not self.authorized():
            return
        if path in ("/v1/models", "/models"):
            self.reply(200, self.server.endpoint.models())
            return
        self.reply_error(404, f"no such path {self.path!r}: GET /v1/models, POST /v1/chat/completions or /v1/completions", close=True)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        try:
            self._post()
        except (ConnectionError, TimeoutError, OSError) as e:  # the client went away or stalled: nothing to answer
            log.debug("%s: connection dropped: %s", self.address_string(), e)
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - any failure is an error reply, never the server's end
            log.exception("the endpoint failed")
            self.server.endpoint.stats["errors"] += 1
            try:
                self.reply_error(500, f"{type(e).__name__}: {e}", "server_error", close=True)
            except OSError:
                self.close_connection = True

    def _post(self) -> None:
        ep: OpenAIEndpoint = self.server.endpoint
        path = self.path.split("?")[0]
        handlers = {"/v1/chat/completions": ep.chat, "/v1/completions": ep.completions}
        if not self.authorized():
            return
        if path.startswith("/v1/episodes/") and path.endswith("/reward"):
            handlers[path] = lambda body, _header: ep.report_reward(unquote(path[len("/v1/episodes/") : -len("/reward")]), body)
        if path not in handlers:
            self.discard(self._content_length(), self.server.max_request_bytes)
            self.reply_error(404, f"no such path {self.path!r}: POST /v1/chat/completions or /v1/completions", close=True)
            return
        ok, body = self.read_json()
        if not ok:
            return
        if not isinstance(body, dict):
            self.reply_error(400, f"the body must be a JSON object, got {type(body).__name__}")
            return
        try:
            out = handlers[path](body, self.headers.get(EPISODE_HEADER))
        except RequestError as e:
            self.reply(e.status, self.error_body(e.status, str(e), e.kind, e.param, e.code))
            return
        self.reply(200, out)
