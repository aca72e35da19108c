"""A hardened stdlib HTTP server for aligner's local endpoints (the OpenAI-compatible agent endpoint,
:mod:`aligner.rollout.agent.openai_server`).

The doors such an endpoint opens, and how each is bounded (the reward server's rules,
:mod:`aligner.reward.server`, written once here):
- it binds 127.0.0.1 unless a host is given, and refuses to bind any other address without a token
  (:func:`check_bind`: ValueError naming the host and the fix);
- with a token set, a request without ``Authorization: Bearer <token>`` gets 401 (compared in constant
  time, ``hmac.compare_digest``);
- a body over ``max_request_bytes`` gets 413, one without Content-Length 411, both unread (a refused
  body up to ``DRAIN_FACTOR`` times the limit is read and dropped first, so the client reads the reply
  instead of a connection reset);
- at most ``max_connections`` connections are served at once; one more is answered 503 and closed;
- a client that stalls mid-request, or holds an idle keep-alive connection, is dropped after
  ``read_timeout_s``;
- the handler's own failures become a 500 reply, never the server's end.

Requests are served on threads (``ThreadingHTTPServer``, daemon threads).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

log = logging.getLogger("aligner.http")

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20  # bytes of one request body (16 MiB)
DEFAULT_MAX_CONNECTIONS = 128  # connections served at once
DRAIN_FACTOR = 8  # a refused body up to this many times max_request_bytes is read and dropped before the reply


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1); False for anything else,
    ``0.0.0.0`` and ``""`` (every interface) included."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str, field: str = "host") -> None:
    """Refuse to serve a non-loopback address without a token.

    Raises ValueError naming `field`, the host and the fix when `host` is not loopback
    (:func:`is_loopback`) and `token` is empty."""
    if not is_loopback(host) and not token:
        raise ValueError(
            f"{field}={host!r} is not a loopback address and no token is set: anyone who can reach it could use it; "
            "set a token, or bind 127.0.0.1"
        )


class GuardedHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server with the module's bounds; `handler` is a :class:`GuardedHandler` subclass.

    Args:
        host / port: where to listen (port 0: a free port, read back from ``server_address``).
        token: the bearer token every guarded request must carry ("" = none; refused for a non-loopback host).
        max_request_bytes: bytes per request body (>= 1).
        max_connections: connections served at once (>= 1).
        read_timeout_s: seconds a client may take to send a request (or keep an idle connection).
    Raises ValueError for a non-loopback host without a token or a bound below 1; OSError when the
    address cannot be bound."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(
        self,
        handler: type,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str = "",
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        read_timeout_s: float = 30.0,
    ) -> None:
        check_bind(host, token)
        if max_request_bytes < 1 or max_connections < 1 or not read_timeout_s > 0:
            raise ValueError(
                f"max_request_bytes={max_request_bytes}, max_connections={max_connections} must be >= 1 and "
                f"read_timeout_s={read_timeout_s} > 0"
            )
        self.token, self.max_request_bytes, self.read_timeout_s = token, max_request_bytes, read_timeout_s
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__((host, port), handler)

    def process_request(self, request, client_address) -> None:
        """Serve the connection on a thread, or answer 503 and close it when max_connections are busy."""
        if not self._slots.acquire(blocking=False):
            error = self.RequestHandlerClass.error_body(
                503, f"over this server's max_connections={self.max_connections}: retry later", "server_error"
            )
            body = json.dumps(error).encode()
            head = f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            try:
                request.sendall(head.encode() + body)
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


class GuardedHandler(BaseHTTPRequestHandler):
    """The request handler of a :class:`GuardedHTTPServer`: replies, the token check and the bounded body.

    Subclasses implement ``do_GET`` / ``do_POST`` and may override :meth:`error_body` (the JSON of an
    error reply)."""

    server: GuardedHTTPServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        self.timeout = self.server.read_timeout_s  # a stalled client is dropped (socket timeout)
        super().setup()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - BaseHTTPRequestHandler's signature
        log.debug("%s %s", self.address_string(), format % args)

    @classmethod
    def error_body(cls, status: int, message: str, kind: str = "") -> dict:
        """The JSON object of an error reply (default ``{"error": message}``)."""
        return {"error": message}

    def reply(self, status: int, obj: dict, close: bool = False) -> None:
        """Send `obj` as JSON with `status`; close the connection after it when `close`."""
        body = json.dumps(obj, allow_nan=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def reply_error(self, status: int, message: str, kind: str = "", close: bool = False) -> None:
        """An error reply: :meth:`error_body` with `status`."""
        self.reply(status, self.error_body(status, message, kind), close=close)

    def discard(self, n_bytes: Optional[int], limit: int) -> None:
        """Read and drop a refused body of `n_bytes` (in 64 KiB pieces, nothing kept) when it is at most
        `limit` bytes, so that the client, still sending, reads the error reply instead of a reset."""
        if n_bytes is None or n_bytes > limit:
            return
        while n_bytes > 0:
            got = self.rfile.read(min(n_bytes, 65536))
            if not got:
                return
            n_bytes -= len(got)

    def _content_length(self) -> Optional[int]:
        length = self.headers.get("Content-Length")
        return int(length) if length is not None and length.strip().isdigit() else None

    def authorized(self) -> bool:
        """True when the server has no token or the request carries ``Authorization: Bearer <token>``;
        else replies 401 (the body read and dropped within bounds) and returns False."""
        token = self.server.token
        if not token:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode("utf-8"), f"Bearer {token}".encode()):
            return True
        self.discard(self._content_length(), self.server.max_request_bytes)
        self.reply_error(401, "missing or wrong token: send 'Authorization: Bearer <token>'", "authentication_error", close=True)
        return False

    def read_json(self) -> tuple[bool, Any]:
        """(True, the decoded JSON body), or (False, None) after replying 411 (no Content-Length), 413 (a
        body over max_request_bytes) or 400 (not UTF-8 JSON). Call :meth:`authorized` first."""
        n_bytes, limit = self._content_length(), self.server.max_request_bytes
        if n_bytes is None:
            self.reply_error(411, "a Content-Length header (bytes) is required", "invalid_request_error", close=True)
            return False, None
        if n_bytes > limit:
            self.discard(n_bytes, DRAIN_FACTOR * limit)
            self.reply_error(
                413, f"the body has {n_bytes} bytes, over this server's max_request_bytes={limit}", "invalid_request_error", close=True
            )
            return False, None
        raw = self.rfile.read(n_bytes)
        try:
            return True, json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self.reply_error(400, f"the body is not JSON: {e}", "invalid_request_error")
            return False, None
