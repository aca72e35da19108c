"""The reward server: any aligner reward model, or a rule reward, scored over HTTP for
``reward.type=remote`` (the wire format is :mod:`aligner.reward.remote`'s). The command is
``python -m aligner.serve_rm`` (:mod:`aligner.serve_rm`).

Endpoints: ``POST /score`` (and ``POST /get_reward``, OpenRLHF's path) score a batch;
``GET /health`` answers ``{"status": "ok", "scorer": ..., "max_batch": ...}`` without a token.

The doors it opens, and how each is bounded:
- it binds 127.0.0.1 unless a host is given;
- with a token set, a scoring request without ``Authorization: Bearer <token>`` gets 401 (compared
  in constant time);
- a bind to an address other than loopback without a token is refused (``allow_no_token`` to
  serve a trusted network without one);
- a request body over ``max_request_bytes`` (or without Content-Length) gets 413 (411) unread, a
  Content-Length that is not a decimal count of bytes 400; a batch over ``max_batch`` samples gets
  413 after a scan that counts the samples without building them (:func:`count_samples`), before
  the body is parsed; a sequence over the model's ``max_seq_len`` 400;
- a malformed request (not JSON, wrong fields or types) gets 400 with what is wrong, a scorer that
  fails gets 500 with its error: the handler catches everything, so the server keeps serving;
- every request must arrive whole (request line, headers and body, and the wait for it on a
  kept-alive connection) within ``request_timeout_s``, a deadline per request, not per read: a
  client that sends slowly is dropped at it; a stalled single read is dropped after ``read_timeout_s``;
- at most ``max_connections`` connections are served at once (a thread each); one more is answered
  503 at once and closed.

Requests are served on threads (``ThreadingHTTPServer``); a model scorer runs one batch at a time.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional, Protocol

import torch

from aligner.config.roles import is_loopback
from aligner.reward import rules

log = logging.getLogger("aligner.serve_rm")

SCORE_PATHS = ("/score", "/get_reward")
DEFAULT_MAX_BATCH = 256  # samples per request
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20  # bytes of one request body (16 MiB)
DRAIN_FACTOR = 8  # a refused body up to this many times max_request_bytes is read and dropped before the reply
DEFAULT_MAX_CONNECTIONS = 64  # connections served at once
DEFAULT_REQUEST_TIMEOUT_S = 60.0  # seconds for one whole request to arrive
BATCH_KEYS = ("responses", "prompts", "query")  # the per-sample lists whose length is the batch
_WS = " \t\n\r"


def count_samples(text: str, limit: int) -> int:
    """The longest of the body's top-level lists "responses", "prompts" and "query", counted by a scan
    that decodes one element at a time (nothing of the body is kept) and stops past `limit`; 0 when the
    body is not a JSON object (the parse then says what is wrong). ValueError for malformed JSON met on
    the way, RecursionError for nesting past the interpreter's stack."""
    dec = json.JSONDecoder()
    i = _skip_ws(text, 0)
    if i >= len(text) or text[i] != "{":
        return 0
    longest, i = 0, _skip_ws(text, i + 1)
    if i < len(text) and text[i] == "}":
        return 0
    while True:
        key, i = dec.raw_decode(text, i)
        i = _skip_ws(text, i)
        if i >= len(text) or text[i] != ":":
            raise ValueError(f"expected ':' at char {i}")
        i = _skip_ws(text, i + 1)
        if key in BATCH_KEYS and i < len(text) and text[i] == "[":
            n, i = _skip(text, i, dec, limit)
            longest = max(longest, n)
            if longest > limit:
                return longest
        else:
            _, i = _skip(text, i, dec, None)
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
            continue
        if i < len(text) and text[i] == "}":
            return longest
        raise ValueError(f"expected ',' or '}}' at char {i}")


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _skip(text: str, i: int, dec: json.JSONDecoder, limit) -> tuple[int, int]:
    """(elements, end) of the JSON value at `i`, containers walked element by element; an array stops
    being counted (and is left) past `limit` elements when one is given."""
    if i < len(text) and text[i] in "[{":
        close, n = "]" if text[i] == "[" else "}", 0
        i = _skip_ws(text, i + 1)
        if i < len(text) and text[i] == close:
            return 0, i + 1
        while True:
            if close == "}":
                _, i = dec.raw_decode(text, i)
                i = _skip_ws(text, i)
                if i >= len(text) or text[i] != ":":
                    raise ValueError(f"expected ':' at char {i}")
                i = _skip_ws(text, i + 1)
            _, i = _skip(text, i, dec, None)
            n += 1
            if limit is not None and n > limit:
                return n, i
            i = _skip_ws(text, i)
            if i < len(text) and text[i] == ",":
                i = _skip_ws(text, i + 1)
                continue
            if i < len(text) and text[i] == close:
                return n, i + 1
            raise ValueError(f"expected ',' or '{close}' at char {i}")
    _, end = dec.raw_decode(text, i)
    return 1, end


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


class Deadlines:
    """One watchdog thread for every request's deadline: :meth:`add` a key with its time and what to call
    then, :meth:`remove` it when done; expired keys are called within ``tick_s``."""

    def __init__(self, tick_s: float = 0.05) -> None:
        self.tick_s = tick_s
        self._items: dict[int, tuple[float, Any]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serve-rm-deadlines", daemon=True)
        self._thread.start()

    def add(self, key: int, at: float, fn) -> None:
        with self._lock:
            self._items[key] = (at, fn)

    def remove(self, key: int) -> None:
        with self._lock:
            self._items.pop(key, None)

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            with self._lock:
                due = [k for k, (at, _) in self._items.items() if at <= now]
                fns = [self._items.pop(k)[1] for k in due]
            for fn in fns:
                fn()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


class RewardHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server of one :class:`Scorer`, with its bounds (see the module docstring).

    Args:
        scorer: what scores a batch.
        host / port: where to listen (port 0: a free port, read back from ``server_address``).
        token: the shared token ("" = none required; then `host` must be loopback unless allow_no_token).
        max_batch: samples per request; max_request_bytes: bytes per request body.
        read_timeout_s: seconds one read of the request may stall.
        request_timeout_s: seconds a whole request may take to arrive (a deadline per request).
        max_connections: connections served at once (a thread each); more get 503.
        allow_no_token: serve a host other than loopback without a token.

    ValueError for a bind off loopback without a token (unless allowed) or a bad bound.
    """

    daemon_threads = True
    request_queue_size = 64

    def __init__(
        self,
        scorer: Scorer,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str = "",
        max_batch: int = DEFAULT_MAX_BATCH,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        read_timeout_s: float = 30.0,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        allow_no_token: bool = False,
    ) -> None:
        if not token and not allow_no_token and not is_loopback(host):
            raise ValueError(
                f"host={host} serves every machine that can reach this one, and no token is set: set ALIGNER_RM_TOKEN "
                "(or token_file=PATH), or allow_no_token=1 on a network you trust"
            )
        if request_timeout_s <= 0 or read_timeout_s <= 0 or max_connections < 1:
            raise ValueError(
                f"request_timeout_s={request_timeout_s} and read_timeout_s={read_timeout_s} must be > 0, max_connections={max_connections} >= 1"
            )
        self.scorer, self.token, self.max_batch, self.max_request_bytes = scorer, token, max_batch, max_request_bytes
        self.read_timeout_s, self.request_timeout_s = read_timeout_s, request_timeout_s
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__((host, port), _Handler)
        self.deadlines = Deadlines()

    def server_close(self) -> None:
        super().server_close()
        self.deadlines.close()

    def process_request(self, request, client_address) -> None:
        """A thread for the connection when one of ``max_connections`` slots is free; else 503 and close, at once."""
        if not self._slots.acquire(blocking=False):
            body = json.dumps({"error": f"this server serves {self.max_connections} connections at once: retry later"}).encode()
            try:
                request.settimeout(0.5)
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    @property
    def url(self) -> str:
        """The scoring URL, ``http://host:port/score``."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/score"


class _Handler(BaseHTTPRequestHandler):
    server: RewardHTTPServer
    protocol_version = "HTTP/1.1"
    server_version = "aligner-serve-rm"

    def setup(self) -> None:
        self.timeout = self.server.read_timeout_s  # a stalled read is dropped (socket timeout)
        super().setup()

    def handle_one_request(self) -> None:
        """One request, which must arrive whole within the server's request_timeout_s (the wait for it
        included): at the deadline the connection is shut, ending any read still blocked."""
        expired = threading.Event()

        def cut() -> None:
            expired.set()
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        self.server.deadlines.add(id(self), time.monotonic() + self.server.request_timeout_s, cut)
        try:
            super().handle_one_request()
        finally:
            self.server.deadlines.remove(id(self))
            if expired.is_set():
                self.close_connection = True

    def _arrived(self) -> None:
        """The request is read: its deadline no longer applies (scoring may take longer)."""
        self.server.deadlines.remove(id(self))

    def _reply(self, status: int, obj: dict, close: bool = False) -> None:
        body = json.dumps(obj, allow_nan=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def _discard(self, n_bytes: Optional[int], limit: int) -> None:
        """Read and drop a refused body of `n_bytes` (in 64 KiB pieces, nothing kept) when it is at most
        `limit` bytes, so that the client, still sending, reads the error reply instead of a reset."""
        if n_bytes is None or n_bytes > limit:
            return
        while n_bytes > 0:
            got = self.rfile.read(min(n_bytes, 65536))
            if not got:
                return
            n_bytes -= len(got)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?")[0] != "/health":
            self._reply(404, {"error": f"no such path {self.path!r}: GET /health, POST {' or '.join(SCORE_PATHS)}"})
            return
        s = self.server
        self._reply(200, {"status": "ok", "scorer": s.scorer.name, "max_batch": s.max_batch, "max_request_bytes": s.max_request_bytes})

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        try:
            self._score()
        except (ConnectionError, TimeoutError, OSError) as e:  # the client went away or stalled: nothing to answer
            log.debug("%s: connection dropped: %s", self.address_string(), e)
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - any failure is an error reply, never the server's end
            log.exception("scoring failed")
            try:
                self._reply(500, {"error": f"{type(e).__name__}: {e}"}, close=True)
            except OSError:
                self.close_connection = True

    def _score(self) -> None:
        s = self.server
        if self.path.split("?")[0] not in SCORE_PATHS:
            self._reply(404, {"error": f"no such path {self.path!r}: POST {' or '.join(SCORE_PATHS)}"}, close=True)
            return
        length = self.headers.get("Content-Length")
        n_bytes = int(length) if length is not None and length.strip().isdigit() else None
        if length is not None and n_bytes is None:
            self._arrived()
            self._reply(400, {"error": f"Content-Length {length[:40]!r} is not a count of bytes (a decimal integer)"}, close=True)
            return
        if s.token:
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode("utf-8"), f"Bearer {s.token}".encode()):
                self._discard(n_bytes, s.max_request_bytes)
                self._reply(401, {"error": "missing or wrong token: send 'Authorization: Bearer <token>' (reward.token)"}, close=True)
                return
        if n_bytes is None:
            self._reply(411, {"error": "a Content-Length header (bytes) is required"}, close=True)
            return
        if n_bytes > s.max_request_bytes:
            self._discard(n_bytes, DRAIN_FACTOR * s.max_request_bytes)
            self._reply(
                413,
                {
                    "error": f"the body has {n_bytes} bytes, over this server's max_request_bytes={s.max_request_bytes}: send smaller batches"
                },
                close=True,
            )
            return
        raw = self.rfile.read(n_bytes)
        if len(raw) < n_bytes:  # the client closed (or the deadline shut the connection) before the whole body
            self.close_connection = True
            return
        self._arrived()
        try:
            text = raw.decode("utf-8")
            del raw
            n = count_samples(text, s.max_batch)  # before the parse: a huge batch is never built
            if n > s.max_batch:
                raise BatchTooLarge(
                    f"more than {s.max_batch} samples exceed this server's max_batch={s.max_batch}: send smaller batches (reward.batch_size)"
                )
            req = parse_request(json.loads(text), s.max_batch)
        except BatchTooLarge as e:
            self._reply(413, {"error": str(e)})
            return
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self._reply(400, {"error": f"the body is not JSON: {e}"})
            return
        except RecursionError:
            self._reply(400, {"error": "the body is nested too deeply"})
            return
        except ValueError as e:
            self._reply(400, {"error": str(e)})
            return
        try:
            rewards = s.scorer.score(req)
        except ValueError as e:  # the scorer refuses this input (a rule without its reference, a too-long sequence)
            self._reply(400, {"error": str(e)})
            return
        bad = [i for i, r in enumerate(rewards) if not math.isfinite(r)]
        if len(rewards) != len(req.responses) or bad:
            self._reply(
                500, {"error": f"the scorer returned {len(rewards)} rewards for {len(req.responses)} samples, non-finite at {bad[:5]}"}
            )
            return
        self._reply(200, {"rewards": rewards})
