"""The reward server: any aligner reward model, or a rule reward, scored over HTTP for
``reward.type=remote`` (the wire format is :mod:`aligner.reward.remote`'s). The command is
``python -m aligner.serve_rm`` (:mod:`aligner.serve_rm`).

Endpoints: ``POST /score`` (and ``POST /get_reward``, OpenRLHF's path) score a batch;
``GET /health`` answers ``{"status": "ok", "scorer": ..., "max_batch": ...}`` without a token.

The doors it opens, and how each is bounded (the HTTP rules are :mod:`aligner.runtime.http`'s, shared
with the agent endpoint):
- it binds 127.0.0.1 unless a host is given, and refuses another address without a token;
- with a token set, a scoring request without ``Authorization: Bearer <token>`` gets 401 (compared
  in constant time);
- a request body over ``max_request_bytes`` (or without Content-Length) gets 413 (411) unread, a
  batch over ``max_batch`` samples gets 413, a sequence over the model's ``max_seq_len`` 400;
- a malformed request (not JSON, wrong fields or types) gets 400 with what is wrong, a scorer that
  fails gets 500 with its error: the handler catches everything, so the server keeps serving;
- a client that stalls mid-request is dropped after ``read_timeout_s``;
- at most ``max_connections`` connections are served at once (one more gets 503).

Requests are served on threads (``ThreadingHTTPServer``); a model scorer runs one batch at a time.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from aligner.reward import rules
from aligner.runtime.http import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_REQUEST_BYTES, GuardedHandler, GuardedHTTPServer

log = logging.getLogger("aligner.serve_rm")

SCORE_PATHS = ("/score", "/get_reward")
DEFAULT_MAX_BATCH = 256  # samples per request
__all__ = [
    "DEFAULT_MAX_BATCH",
    "DEFAULT_MAX_REQUEST_BYTES",
    "ModelScorer",
    "RewardHTTPServer",
    "RuleScorer",
    "ScoreRequest",
    "parse_request",
]


@dataclass
class ScoreRequest:
    """One parsed batch of B samples: prompts, responses (str), metadata (dicts) and, when sent, input_ids."""

    prompts: list[str]
    responses: list[str]
    metadata: list[dict]
    input_ids: Optional[list[list[int]]] = None


class Scorer(Protocol):
    """What the server scores with: ``name`` for /health and the log, ``score`` -> B floats."""

    name: str

    def score(self, req: ScoreRequest) -> list[float]: ...


def _str_list(obj: dict, key: str) -> list[str]:
    v = obj[key]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f'"{key}" must be a list of strings')
    return v


def parse_request(obj: Any, max_batch: int) -> ScoreRequest:
    """The :class:`ScoreRequest` of a decoded JSON body (either shape of :mod:`aligner.reward.remote`).

    Raises ValueError naming the first malformed field, BatchTooLarge for more than `max_batch` samples."""
    if not isinstance(obj, dict):
        raise ValueError(f"the body must be a JSON object, got {type(obj).__name__}")
    if "responses" in obj:
        responses = _str_list(obj, "responses")
        prompts = _str_list(obj, "prompts") if "prompts" in obj else None
        if prompts is None:
            raise ValueError('"prompts" is missing (one per response)')
    elif "query" in obj:  # OpenRLHF: query = prompt + response; labels = reference answers
        queries = _str_list(obj, "query")
        prompts = _str_list(obj, "prompts") if "prompts" in obj else [""] * len(queries)
        if len(prompts) != len(queries):
            raise ValueError(f'{len(queries)} "query" and {len(prompts)} "prompts": give one prompt per query')
        responses = [q[len(p) :] if q.startswith(p) else q for q, p in zip(queries, prompts)]
        prompts = [p if q.startswith(p) else "" for q, p in zip(queries, prompts)]
    else:
        raise ValueError('give "prompts" and "responses" (or OpenRLHF\'s "query")')
    n = len(responses)
    if n > max_batch:
        raise BatchTooLarge(f"{n} samples exceed this server's max_batch={max_batch}: send smaller batches (reward.batch_size)")
    if len(prompts) != n:
        raise ValueError(f'{len(prompts)} "prompts" for {n} "responses": give one of each per sample')
    if "metadata" in obj:
        metadata = obj["metadata"]
        if not isinstance(metadata, list) or len(metadata) != n or not all(isinstance(m, dict) for m in metadata):
            raise ValueError(f'"metadata" must be a list of {n} objects')
    elif "labels" in obj:
        labels = obj["labels"]
        if not isinstance(labels, list) or len(labels) != n:
            raise ValueError(f'"labels" must be a list of {n} values')
        metadata = [{"answer": lab} for lab in labels]
    else:
        metadata = [{} for _ in range(n)]
    input_ids = None
    if obj.get("input_ids") is not None:
        input_ids = obj["input_ids"]
        if (
            not isinstance(input_ids, list)
            or len(input_ids) != n
            or not all(
                isinstance(row, list) and row and all(isinstance(t, int) and not isinstance(t, bool) for t in row) for row in input_ids
            )
        ):
            raise ValueError(f'"input_ids" must be a list of {n} non-empty lists of token ids (ints)')
    return ScoreRequest(prompts, responses, metadata, input_ids)


class BatchTooLarge(ValueError):
    """A request's batch is over the server's max_batch (answered 413)."""


class RuleScorer:
    """A rule reward of :mod:`aligner.reward.rules` (``reward.rule=NAME``); ValueError for an unknown name."""

    def __init__(self, rule: str) -> None:
        rules.get_rule(rule)
        self.rule = rule
        self.name = f"rule:{rule}"

    def score(self, req: ScoreRequest) -> list[float]:
        """B rule scores in [0, 1] (ValueError when the rule cannot score a row, e.g. no reference answer)."""
        return rules.score(self.rule, req.prompts, req.responses, req.metadata).tolist()


class ModelScorer:
    """An aligner reward model, loaded as the reward worker loads it (:class:`~aligner.reward.reward_model.RewardModel`,
    one process, tp = pp = dp = 1, CPU or the current GPU), scoring at the last real token.

    Args:
        init: an HF reward-model dir or an aligner run dir with hf/ inside (``reward.init``).
        micro_batch_size: sequences per forward.
        tokenizer: a tokenizer path for requests without input_ids (``[bos] + prompt + response + [eos]``,
            aligner's convention for plain rows); "" = the tokenizer saved in `init`'s dir, if any.
    """

    def __init__(self, init: str, micro_batch_size: int = 8, tokenizer: str = "") -> None:
        from aligner.config import ModelConfig, OptimConfig, ParallelConfig
        from aligner.parallel.dims import ParallelDims
        from aligner.reward.reward_model import RewardModel
        from aligner.runtime.role import resolve_init

        hf_dir = resolve_init(init)
        if hf_dir is None:
            raise ValueError("reward.init is empty: give the reward model's dir (an RM run's output_dir or an HF dir)")
        self.rm = RewardModel(ModelConfig(), ParallelConfig(), OptimConfig(), ParallelDims(), init=str(hf_dir))
        self.rm.runtime.module.eval()
        self.micro_batch_size = micro_batch_size
        self.vocab_size, self.max_seq_len = self.rm.model_cfg.vocab_size, self.rm.model_cfg.max_seq_len
        self.tok = self._tokenizer(tokenizer or (str(hf_dir) if _has_tokenizer(hf_dir) else ""))
        self.name = f"model:{hf_dir}"
        self._lock = threading.Lock()

    @staticmethod
    def _tokenizer(path: str):
        if not path:
            return None
        from aligner.data.tokenizer import load_tokenizer

        return load_tokenizer(path)

    def _ids(self, req: ScoreRequest) -> list[list[int]]:
        if req.input_ids is not None:
            rows = req.input_ids
        elif self.tok is None:
            raise ValueError('this server has no tokenizer: send "input_ids", or start it with tokenizer=PATH')
        else:
            bos = [self.tok.bos_token_id] if self.tok.bos_token_id is not None else []
            eos = [self.tok.eos_token_id] if self.tok.eos_token_id is not None else []
            rows = [bos + self.tok.encode(p + r, add_special_tokens=False) + eos for p, r in zip(req.prompts, req.responses)]
        for i, row in enumerate(rows):
            if len(row) > self.max_seq_len:
                raise ValueError(f"sample {i} has {len(row)} tokens, over the model's max_seq_len={self.max_seq_len}")
            bad = [t for t in row if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"sample {i} has token id {bad[0]} outside the model's vocabulary [0, {self.vocab_size})")
        return rows

    @torch.no_grad()
    def score(self, req: ScoreRequest) -> list[float]:
        """B scores (fp32, the head at each sequence's last token); ValueError for a sequence the model cannot take."""
        rows = self._ids(req)
        if not rows:
            return []
        t = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        mask = torch.zeros(len(rows), t, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        with self._lock:
            return self.rm.scores({"input_ids": ids, "attention_mask": mask}, self.micro_batch_size).float().tolist()


def _has_tokenizer(path) -> bool:
    return any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


class RewardHTTPServer(GuardedHTTPServer):
    """A threading HTTP server of one :class:`Scorer`, with its bounds (see the module docstring).

    Args:
        scorer: what scores a batch.
        host / port: where to listen (port 0: a free port, read back from ``server_address``).
        token: the shared token ("" = none required; refused for a non-loopback host: ValueError).
        max_batch: samples per request; max_request_bytes: bytes per request body.
        read_timeout_s: seconds a client may take to send its request.
        max_connections: connections served at once.
    """

    def __init__(
        self,
        scorer: Scorer,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str = "",
        max_batch: int = DEFAULT_MAX_BATCH,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        read_timeout_s: float = 30.0,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self.scorer, self.max_batch = scorer, max_batch
        super().__init__(
            _Handler,
            host=host,
            port=port,
            token=token,
            max_request_bytes=max_request_bytes,
            max_connections=max_connections,
            read_timeout_s=read_timeout_s,
        )

    @property
    def url(self) -> str:
        """The scoring URL, ``http://host:port/score``."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/score"


class _Handler(GuardedHandler):
    server: RewardHTTPServer
    server_version = "aligner-serve-rm"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?")[0] != "/health":
            self.reply(404, {"error": f"no such path {self.path!r}: GET /health, POST {' or '.join(SCORE_PATHS)}"})
            return
        s = self.server
        self.reply(200, {"status": "ok", "scorer": s.scorer.name, "max_batch": s.max_batch, "max_request_bytes": s.max_request_bytes})

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        try:
            self._score()
        except (ConnectionError, TimeoutError, OSError) as e:  # the client went away or stalled: nothing to answer
            log.debug("%s: connection dropped: %s", self.address_string(), e)
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - any failure is an error reply, never the server's end
            log.exception("scoring failed")
            try:
                self.reply(500, {"error": f"{type(e).__name__}: {e}"}, close=True)
            except OSError:
                self.close_connection = True

    def _score(self) -> None:
        s = self.server
        if self.path.split("?")[0] not in SCORE_PATHS:
            self.reply(404, {"error": f"no such path {self.path!r}: POST {' or '.join(SCORE_PATHS)}"}, close=True)
            return
        if not self.authorized():
            return
        ok, obj = self.read_json()
        if not ok:
            return
        try:
            req = parse_request(obj, s.max_batch)
        except BatchTooLarge as e:
            self.reply(413, {"error": str(e)})
            return
        except ValueError as e:
            self.reply(400, {"error": str(e)})
            return
        try:
            rewards = s.scorer.score(req)
        except ValueError as e:  # the scorer refuses this input (a rule without its reference, a too-long sequence)
            self.reply(400, {"error": str(e)})
            return
        bad = [i for i, r in enumerate(rewards) if not math.isfinite(r)]
        if len(rewards) != len(req.responses) or bad:
            self.reply(
                500, {"error": f"the scorer returned {len(rewards)} rewards for {len(req.responses)} samples, non-finite at {bad[:5]}"}
            )
            return
        self.reply(200, {"rewards": rewards})
