"""The remote reward (``reward.type=remote``): the HTTP client of a scoring endpoint, and the wire format
that the client and :mod:`aligner.reward.server` (``python -m aligner.serve_rm``) both follow.

Wire format (JSON, UTF-8), ``POST <url>`` (the server answers at ``/score``, and at ``/get_reward`` as
OpenRLHF's ``serve_rm`` does):

    request   {"prompts": [str, ...], "responses": [str, ...],          B samples, decoded text
               "metadata": [{...}, ...],                                optional, per sample (a rule's reference answer)
               "input_ids": [[int, ...], ...]}                          optional, each sample's full token ids (prompt +
                                                                        response, no padding): what a model server scores
    or        {"query": [str, ...], "prompts": [str, ...], "labels": [...]}   OpenRLHF's shape: query = prompt + response,
                                                                        labels[i] becomes metadata[i]["answer"]
    answer    {"rewards": [float, ...]}                                 B finite numbers, in request order
    error     {"error": "..."} with status 400 (malformed), 401 (token), 404, 411, 413 (too large), 500

The client sends ``Authorization: Bearer <token>`` when a token is set (``reward.token`` from a config
file, ``reward.token_file``, else the environment variable ``ALIGNER_RM_TOKEN``; never the command
line), to ``reward.url`` only: redirects are not followed, and a token over plain ``http://`` to a
host that is not this machine is refused unless ``reward.allow_plain_http_token``. Each request has
one deadline (``reward.timeout_s``: connect, send and the whole answer) and its answer a size cap
(``reward.max_response_bytes``).

Failures never become zeros: an answer of the wrong length, with a non-number or a non-finite number,
or that is not JSON counts as a failed try, as do connection errors, timeouts and statuses 5xx, 408
and 429; they are retried ``max_retries`` times with exponential backoff (``backoff_s``, doubling),
then :class:`RemoteRewardError` names the URL, the tries and the last failure. An answer cut short of
its Content-Length is retried too. A 4xx answer (bad request, wrong token, too large), a 3xx and an
oversized answer are not retried: they cannot succeed unchanged.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import ssl
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, Sequence
from urllib.parse import urlsplit

import torch

from aligner.config.roles import plain_http_token_problem, reward_url_problem
from aligner.errors import UserError
from aligner.reward.streaming import StreamedResponses

TOKEN_ENV = "ALIGNER_RM_TOKEN"  # the shared token's environment variable (client and server)
RETRIED_STATUSES = (408, 429)  # 4xx statuses worth retrying (with every 5xx)
DEFAULT_MAX_RESPONSE_BYTES = 8 * 2**20  # an answer's body (B rewards take about 25 bytes each)


def resolve_token(token: str = "", token_file: str = "") -> str:
    """The shared token: `token` (a config file's reward.token), else the first line of `token_file`
    (reward.token_file), else the environment variable ALIGNER_RM_TOKEN, else "" (none sent).
    ValueError when `token_file` cannot be read or is empty."""
    if token:
        return token
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                text = f.readline().strip()
        except OSError as e:
            raise ValueError(f"reward.token_file={token_file!r} cannot be read ({e.strerror}): give a file holding the token") from None
        if not text:
            raise ValueError(f"reward.token_file={token_file!r} is empty: write the token on its first line")
        return text
    return os.environ.get(TOKEN_ENV, "")


class RemoteRewardError(UserError):
    """The remote reward endpoint gave no valid answer: the message names the URL, the tries and the last failure."""


class _Failure(Exception):
    """One failed try: `retry` says whether another try may succeed."""

    def __init__(self, message: str, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


def one_line(text: str, limit: int = 300) -> str:
    """`text` on one line (whitespace runs collapsed), cut to `limit` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def parse_rewards(body: bytes, expected: int) -> list[float]:
    """The rewards of an answer body: a JSON object whose "rewards" is a list of `expected` finite numbers.

    Raises ValueError saying what is wrong (not JSON, no "rewards", wrong length, a non-number or a
    non-finite number and its index)."""
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the answer is not JSON ({e.__class__.__name__}: {one_line(body[:80].decode('utf-8', 'replace'))!r})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("rewards"), list):
        raise ValueError(f'the answer has no "rewards" list (got {one_line(json.dumps(obj)[:120])})')
    rewards = obj["rewards"]
    if len(rewards) != expected:
        raise ValueError(f"the answer has {len(rewards)} rewards for {expected} samples")
    for i, r in enumerate(rewards):
        if isinstance(r, bool) or not isinstance(r, (int, float)):
            raise ValueError(f"reward {i} is {r!r}, not a number")
        if not math.isfinite(r):
            raise ValueError(f"reward {i} is {r!r}, not finite")
    return [float(r) for r in rewards]


class RemoteReward:
    """Scores (prompt, response) samples on a remote endpoint over HTTP (the wire format above).

    Args:
        url: the endpoint, ``http(s)://host[:port]/path`` (ValueError for a malformed one).
        token: the shared token; "" reads the environment variable ``ALIGNER_RM_TOKEN`` ("" there too: none sent);
            :func:`resolve_token` reads reward.token_file.
        timeout_s: seconds each HTTP request may take in all (connect, send and the whole answer): a deadline
            per request, not per socket read, so a server that drips its answer is cut at it.
        max_retries: further tries after a failed one (0: a single try).
        backoff_s: seconds before the first retry; each later retry waits twice the one before.
        batch_size: samples per request; a larger batch is sent as several requests.
        max_concurrency: requests in flight at once (a thread each).
        max_response_bytes: the largest answer body read; a larger one (declared or sent) is a failed try, not retried.
        allow_plain_http_token: send the token over plain ``http://`` to a host that is not this machine
            (ValueError without it: the token would travel in clear text).
        sleep: the backoff's sleep (tests measure it).

    Redirects are never followed: a 3xx answer is a failed try, not retried, naming the URL and its
    Location, so the token is sent to ``url`` only.

    :meth:`score` blocks; :meth:`submit` returns a Future so the caller overlaps the calls with other work.
    """

    def __init__(
        self,
        url: str,
        token: str = "",
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        batch_size: int = 64,
        max_concurrency: int = 4,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        allow_plain_http_token: bool = False,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        problem = reward_url_problem(url)
        if problem:
            raise ValueError(f"reward.url={url!r} is invalid: {problem}")
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0 or batch_size < 1 or max_concurrency < 1 or max_response_bytes < 1:
            raise ValueError(
                f"RemoteReward: timeout_s={timeout_s} must be > 0, max_retries={max_retries} and backoff_s={backoff_s} >= 0, "
                f"batch_size={batch_size}, max_concurrency={max_concurrency} and max_response_bytes={max_response_bytes} >= 1"
            )
        self.url, self.timeout_s, self.max_retries, self.backoff_s = url, float(timeout_s), int(max_retries), float(backoff_s)
        self.batch_size, self.sleep, self.max_response_bytes = int(batch_size), sleep, int(max_response_bytes)
        self.token = token or resolve_token()
        problem = plain_http_token_problem(url, bool(self.token), allow_plain_http_token)
        if problem:
            raise ValueError(problem)
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="remote-reward")

    # ---- public -------------------------------------------------------------------------
    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        metadata: Optional[Sequence[dict]] = None,
        input_ids: Optional[Sequence[Sequence[int]]] = None,
    ) -> torch.Tensor:
        """Scores [B] float32 of B samples, in order (blocks until every request has answered).

        prompts / responses: decoded text; metadata: per-sample dicts (JSON-serializable); input_ids:
        each sample's full token ids (prompt + response, unpadded), for a model server. Raises
        ValueError for lists of different lengths, :class:`RemoteRewardError` after the retries."""
        return self.submit(prompts, responses, metadata, input_ids).result()

    def submit(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        metadata: Optional[Sequence[dict]] = None,
        input_ids: Optional[Sequence[Sequence[int]]] = None,
    ) -> Future:
        """Send the samples in requests of ``batch_size`` now, on the pool's threads; a Future of
        :meth:`score`'s tensor (its ``result()`` raises :class:`RemoteRewardError` as :meth:`score` does)."""
        n = len(prompts)
        if len(responses) != n or (metadata is not None and len(metadata) != n) or (input_ids is not None and len(input_ids) != n):
            raise ValueError(
                f"RemoteReward: {n} prompts, {len(responses)} responses, {len(metadata) if metadata is not None else '-'} metadata, "
                f"{len(input_ids) if input_ids is not None else '-'} input_ids: give one of each per sample"
            )
        chunks = []
        for lo in range(0, n, self.batch_size):
            body: dict = {"prompts": list(prompts[lo : lo + self.batch_size]), "responses": list(responses[lo : lo + self.batch_size])}
            if metadata is not None:
                body["metadata"] = list(metadata[lo : lo + self.batch_size])
            if input_ids is not None:
                body["input_ids"] = [[int(t) for t in ids] for ids in input_ids[lo : lo + self.batch_size]]
            chunks.append(self._pool.submit(self.post, body, len(body["prompts"])))
        out: Future = Future()

        def gather(_=None) -> None:
            if out.done() or not all(c.done() for c in chunks):
                return
            try:
                out.set_result(torch.tensor([r for c in chunks for r in c.result()], dtype=torch.float32))
            except BaseException as e:  # noqa: BLE001 - the first chunk's error is the Future's
                out.set_exception(e)

        if not chunks:
            out.set_result(torch.zeros(0, dtype=torch.float32))
        for c in chunks:
            c.add_done_callback(gather)
        return out

    def post(self, body: dict, expected: int) -> list[float]:
        """One request with its retries: the `expected` rewards of `body`; RemoteRewardError after the last try."""
        data = json.dumps(body).encode("utf-8")
        t0, tries, last = time.monotonic(), 0, ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.sleep(self.backoff_s * 2 ** (attempt - 1))
            tries += 1
            try:
                return parse_rewards_or_fail(self._send(data), expected)
            except _Failure as f:
                last = str(f)
                if not f.retry:
                    break
        raise RemoteRewardError(
            f"reward.url={self.url}: no valid answer after {tries} {'try' if tries == 1 else 'tries'} in "
            f"{time.monotonic() - t0:.1f} s (reward.max_retries={self.max_retries}, backoff from reward.backoff_s="
            f"{self.backoff_s:g} s doubling): last failure: {last}; check that the server runs there "
            '(python -m aligner.serve_rm) and answers {"rewards": [...]}, or raise reward.timeout_s / reward.max_retries'
        )

    def close(self) -> None:
        """Stop the request threads (requests in flight finish first)."""
        self._pool.shutdown(wait=True)

    # ---- one HTTP request ---------------------------------------------------------------------
    def _send(self, data: bytes) -> bytes:
        """POST `data` to ``url`` within one deadline (``timeout_s``); the answer's body on status 200,
        at most ``max_response_bytes``; else _Failure, retried or not by its cause (a 3xx, a 4xx other
        than 408 / 429 and an oversized answer are not retried)."""
        parts = urlsplit(self.url)
        headers = {"Content-Type": "application/json", "Accept": "application/json", "Content-Length": str(len(data))}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if parts.scheme == "https":
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                parts.hostname, parts.port, timeout=self.timeout_s, context=ssl.create_default_context()
            )
        else:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.timeout_s)
        expired = threading.Event()

        def cut() -> None:  # the deadline: end every blocked read or write of this request
            expired.set()
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = threading.Timer(self.timeout_s, cut)
        timer.daemon = True
        timer.start()
        try:
            conn.request("POST", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), body=data, headers=headers)
            resp = conn.getresponse()
            if 300 <= resp.status < 400:
                raise _Failure(
                    f"HTTP {resp.status}: a redirect to {resp.getheader('Location', '(no Location)')} refused (the token is sent "
                    f"to reward.url only): set reward.url to the endpoint itself",
                    False,
                )
            body = self._read(resp)
            if resp.status != 200:
                retry = resp.status >= 500 or resp.status in RETRIED_STATUSES
                hint = {401: " (set ALIGNER_RM_TOKEN or reward.token_file to the server's token)", 413: " (lower reward.batch_size)"}
                raise _Failure(f"HTTP {resp.status}: {_error_text(body, resp.reason)}{hint.get(resp.status, '')}", retry)
            return body
        except _Failure:
            raise
        except (OSError, http.client.HTTPException, ValueError) as e:  # refused, reset, timed out, cut, truncated, a bad status line
            if expired.is_set() or isinstance(e, (socket.timeout, TimeoutError)):
                raise _Failure(f"no whole answer within reward.timeout_s={self.timeout_s:g} s", True) from None
            if isinstance(e, http.client.IncompleteRead):
                got = len(e.partial)
                raise _Failure(f"the answer was cut short ({got} of {got + (e.expected or 0)} bytes announced)", True) from None
            if isinstance(e, ConnectionRefusedError) or isinstance(e, socket.gaierror):
                raise _Failure(f"cannot connect ({one_line(e)})", True) from None
            raise _Failure(f"the connection failed ({e.__class__.__name__}: {one_line(e)})", True) from None
        finally:
            timer.cancel()
            conn.close()

    def _read(self, resp: http.client.HTTPResponse) -> bytes:
        """The answer's body, at most ``max_response_bytes`` (declared or read): _Failure, not retried, past it."""
        cap = self.max_response_bytes
        declared = resp.getheader("Content-Length")
        if declared is not None and declared.strip().isdigit() and int(declared) > cap:
            raise _Failure(
                f"the answer declares {int(declared)} bytes, over reward.max_response_bytes={cap}: a scoring answer is small", False
            )
        chunks, n = [], 0
        while n <= cap:
            chunk = resp.read(min(65536, cap + 1 - n))
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
        if n > cap:
            raise _Failure(f"the answer is over reward.max_response_bytes={cap} bytes: a scoring answer is small", False)
        if declared is not None and declared.strip().isdigit() and n < int(declared):
            raise http.client.IncompleteRead(b"".join(chunks), int(declared) - n)
        return b"".join(chunks)


class StreamedScores(StreamedResponses):
    """Remote scores requested while an engine generates (``reward.stream``, the default with
    ``reward.type=remote``): the engine's ``on_finish`` callback (:meth:`finished`) queues each response
    as its row ends, and a request goes out on the client's threads as soon as ``chunk`` responses are
    queued, so the endpoint scores the first responses while the engine still decodes the others
    (slime's per-sample reward calls and verl's reward loop do the same). :meth:`attach` sends what is
    left once the engine returns, waits, and writes each Generation's score.

    Args:
        client: the :class:`RemoteReward` that sends (its batch_size, retries, token, concurrency).
        tokenizer: decodes each response as the driver would (special tokens dropped).
        prompt_ids: the B prompts' token ids (each request's input_ids are prompt + response).
        rows: B dicts {"prompt": text, "metadata": dict} in request order.
        chunk: responses per request (>= 1); :func:`stream_chunk` picks it.

    Requests and answers are those of the driver-side path (the same fields, per sample), so the scores
    are equal; only the grouping of samples into requests differs.
    """

    def __init__(self, client: RemoteReward, tokenizer, prompt_ids: Sequence[Sequence[int]], rows: Sequence[dict], chunk: int) -> None:
        if len(prompt_ids) != len(rows):
            raise ValueError(f"StreamedScores: {len(prompt_ids)} prompts and {len(rows)} rows must match")
        super().__init__(chunk)
        self.client, self.tok, self.prompt_ids, self.rows = client, tokenizer, prompt_ids, rows
        self.sent: list[tuple[list[int], Future]] = []

    def _send(self) -> None:
        idx, self.queued = self.queued, []
        texts = [self.tok.decode(self.responses[i], skip_special_tokens=True) for i in idx]
        fut = self.client.submit(
            [self.rows[i]["prompt"] for i in idx],
            texts,
            [self.rows[i].get("metadata", {}) for i in idx],
            [list(self.prompt_ids[i]) + self.responses[i] for i in idx],
        )
        self.sent.append((idx, fut))

    def attach(self, gens: Sequence) -> None:
        """After the engine returned its B Generations: send the responses not sent yet (those not reported
        through on_finish too), wait for every answer, and set ``g.extra["score"]`` (float) and
        ``g.extra["scored_while_generating"]`` (sent before the engine returned) on each; when
        the endpoint gave no valid answer after the retries, ``g.extra["score_error"]`` (the
        :class:`RemoteRewardError` message, raised again by the driver) on each instead."""
        self.queue_unreported(gens)
        scores: dict[int, float] = {}
        try:
            for idx, fut in self.sent:
                scores.update(zip(idx, fut.result().tolist()))
        except RemoteRewardError as e:
            for g in gens:
                g.extra["score_error"] = str(e)
            return
        for i, g in enumerate(gens):
            g.extra["score"], g.extra["scored_while_generating"] = scores[i], i in self.early


def stream_chunk(n: int, batch_size: int, max_concurrency: int) -> int:
    """Responses per streamed request for a share of `n`: about ``max_concurrency`` requests per share
    (each up to ``batch_size``), so the first goes out when the first n / max_concurrency rows ended."""
    return max(1, min(batch_size, -(-n // max_concurrency)))


def parse_rewards_or_fail(body: bytes, expected: int) -> list[float]:
    """:func:`parse_rewards`, its ValueError as a retried failure."""
    try:
        return parse_rewards(body, expected)
    except ValueError as e:
        raise _Failure(f"invalid answer: {e}", True) from None


def _error_text(body: bytes, reason: str) -> str:
    """The server's "error" message of an error answer, else its body's start, else the status reason."""
    try:
        obj = json.loads(body.decode("utf-8"))
        if isinstance(obj, dict) and "error" in obj:
            return one_line(obj["error"])
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    return one_line(body.decode("utf-8", "replace")[:200]) or str(reason)
