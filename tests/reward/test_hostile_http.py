"""The remote reward's client and server against hostile peers (aligner/reward/remote.py,
aligner/reward/server.py). Every hostile peer is a raw socket on 127.0.0.1 whose loop is bounded
(a fixed number of bytes or connections, then it stops by itself), run on a daemon thread.

Client: a redirect to another server (refused, never retried, the token never sent there), an
answer dripped one byte at a time (cut at the request's deadline), an oversized answer (declared
or sent), an answer cut short of its Content-Length (retried, then one line), a token over plain
http to a host that is not this machine (refused unless allowed).
Server: a client that sends its headers or body slowly (dropped at the request's deadline), many
idle connections (capped), a batch over max_batch (refused before the body is parsed), a bad
Content-Length (400), a bind off loopback without a token (refused).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import tracemalloc

import pytest

from aligner.config.roles import RewardRoleConfig
from aligner.errors import ConfigError
from aligner.reward.remote import RemoteReward, RemoteRewardError
from aligner.reward.server import RewardHTTPServer, RuleScorer

MARGIN_S = 2.0  # thread start and teardown on a busy 2-core machine


class RawServer:
    """A listener on 127.0.0.1 that answers each of at most `connections` connections with
    `answer(conn, request_bytes)` on a daemon thread, then stops; records each request's bytes."""

    def __init__(self, answer, connections: int = 4) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(10.0)
        self.answer, self.requests = answer, []
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/score"
        self.thread = threading.Thread(target=self._serve, args=(connections,), daemon=True)
        self.thread.start()

    def _serve(self, connections: int) -> None:
        for _ in range(connections):
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10.0)
                try:
                    req = _read_request(conn)
                    self.requests.append(req)
                    self.answer(conn, req)
                except OSError:
                    pass

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes an accept() that is still waiting (close alone does not, on Linux)
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(timeout=15)


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


@pytest.fixture
def raw_server():
    servers = []

    def start(answer, connections: int = 4) -> RawServer:
        servers.append(RawServer(answer, connections))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


# --- the client ---


def test_a_redirect_is_refused_not_retried_and_the_token_goes_nowhere_else(raw_server):
    elsewhere = raw_server(lambda conn, req: conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 16\r\n\r\n{"rewards": [1]}'))
    location = elsewhere.url.encode()
    redirector = raw_server(
        lambda conn, req: conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: " + location + b"\r\nContent-Length: 0\r\n\r\n")
    )
    client = RemoteReward(redirector.url, token="s3cret-token", max_retries=3, backoff_s=0.0)
    with pytest.raises(RemoteRewardError) as e:
        client.score(["p"], ["r"])
    msg = str(e.value)
    assert "\n" not in msg and "HTTP 302" in msg and elsewhere.url in msg and redirector.url in msg and "1 try" in msg, msg
    assert len(redirector.requests) == 1 and b"Bearer s3cret-token" in redirector.requests[0]
    assert elsewhere.requests == []  # never contacted: the token stayed with reward.url


def test_a_dripped_answer_is_cut_at_the_request_deadline(raw_server):
    def drip(conn, req):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        for _ in range(40):  # 40 bytes over 8 s, each within the per-read timeout
            conn.sendall(b" ")
            time.sleep(0.2)

    srv = raw_server(drip, connections=1)
    t0 = time.monotonic()
    with pytest.raises(RemoteRewardError) as e:
        RemoteReward(srv.url, timeout_s=1.0, max_retries=0).score(["p"], ["r"])
    assert time.monotonic() - t0 < 1.0 + MARGIN_S
    assert "no whole answer within reward.timeout_s=1 s" in str(e.value)


def test_dripped_headers_are_cut_at_the_request_deadline(raw_server):
    def drip(conn, req):
        for b in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 40:
            conn.sendall(bytes([b]))
            time.sleep(0.2)

    srv = raw_server(drip, connections=1)
    t0 = time.monotonic()
    with pytest.raises(RemoteRewardError, match="within reward.timeout_s=1 s"):
        RemoteReward(srv.url, timeout_s=1.0, max_retries=0).score(["p"], ["r"])
    assert time.monotonic() - t0 < 1.0 + MARGIN_S


def test_an_oversized_answer_is_refused_declared_or_sent(raw_server):
    declared = raw_server(lambda conn, req: conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 67108864\r\n\r\n" + b" " * 4096), 1)
    with pytest.raises(RemoteRewardError) as e:
        RemoteReward(declared.url, max_retries=2, backoff_s=0.0, max_response_bytes=65536).score(["p"], ["r"])
    assert "declares 67108864 bytes, over reward.max_response_bytes=65536" in str(e.value) and "1 try" in str(e.value)

    def flood(conn, req):  # no Content-Length: the body runs to the end of the connection
        conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
        for _ in range(64):  # 4 MiB at most
            conn.sendall(b" " * 65536)

    sent = raw_server(flood, 1)
    tracemalloc.start()
    try:
        with pytest.raises(RemoteRewardError) as e:
            RemoteReward(sent.url, max_retries=0, max_response_bytes=65536).score(["p"], ["r"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "over reward.max_response_bytes=65536 bytes" in str(e.value)
    assert peak < 2 << 20  # read up to the cap, not the whole answer


def test_an_answer_cut_short_is_retried_then_one_line(raw_server):
    srv = raw_server(lambda conn, req: conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b" " * 400), 3)
    with pytest.raises(RemoteRewardError) as e:
        RemoteReward(srv.url, max_retries=2, backoff_s=0.0).score(["p"], ["r"])
    msg = str(e.value)
    assert len(srv.requests) == 3 and "3 tries" in msg and "cut short (400 of 100000 bytes announced)" in msg and "\n" not in msg


@pytest.mark.parametrize("url", ["http://10.1.2.3:5000/score", "http://rm.example.com/score", "http://[2001:db8::1]:80/score"])
def test_a_token_over_plain_http_off_this_machine_is_refused_unless_allowed(url, monkeypatch):
    monkeypatch.delenv("ALIGNER_RM_TOKEN", raising=False)
    with pytest.raises(ValueError, match="clear text .* reward.allow_plain_http_token=true"):
        RemoteReward(url, token="t")
    RemoteReward(url, token="t", allow_plain_http_token=True).close()
    RemoteReward(url.replace("http://", "https://"), token="t").close()
    RemoteReward(url).close()  # no token: nothing to leak
    cfg = RewardRoleConfig(type="remote", url=url, token="t")
    with pytest.raises(ConfigError, match="reward.url.*allow_plain_http_token"):
        cfg.validate("reward")
    monkeypatch.setenv("ALIGNER_RM_TOKEN", "t")
    with pytest.raises(ConfigError, match="reward.url"):
        RewardRoleConfig(type="remote", url=url).validate("reward")
    RewardRoleConfig(type="remote", url=url, allow_plain_http_token=True).validate("reward")


@pytest.mark.parametrize("url", ["http://127.0.0.1:5000/score", "http://localhost:5000/score", "http://[::1]:5000/score"])
def test_a_token_over_plain_http_to_this_machine_is_accepted(url):
    RemoteReward(url, token="t").close()
    RewardRoleConfig(type="remote", url=url, token="t").validate("reward")


def test_the_token_file_is_read_and_an_unreadable_one_refused(tmp_path, raw_server):
    from aligner.reward.remote import resolve_token

    f = tmp_path / "rm.token"
    f.write_text("from-a-file\nsecond line ignored\n")
    assert resolve_token("", str(f)) == "from-a-file"
    with pytest.raises(ValueError, match="cannot be read"):
        resolve_token("", str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_token("", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="reward.token_file"):
        RewardRoleConfig(type="remote", url="http://127.0.0.1:1/score", token_file=str(tmp_path / "missing")).validate("reward")


# --- the server ---


@pytest.fixture
def server():
    started = []

    def start(**kw) -> RewardHTTPServer:
        srv = RewardHTTPServer(RuleScorer("digit_fraction"), host="127.0.0.1", port=0, **kw)
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.shutdown()
        srv.server_close()


def _exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            out += chunk
        return out


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0


def _drip(port: int, data: bytes, step_s: float, give_up_s: float) -> tuple[float, bytes]:
    """Send `data` one byte every `step_s` (each read on the server well within any per-read timeout)
    until the server answers or closes, or `give_up_s` pass: (seconds until then, its answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.settimeout(step_s)
        t0 = time.monotonic()
        for b in data:
            try:
                s.sendall(bytes([b]))
                got = s.recv(65536)  # waits step_s: b"" (closed) or an answer ends the exchange
                return time.monotonic() - t0, got
            except TimeoutError:
                pass
            except OSError:
                return time.monotonic() - t0, b""
            if time.monotonic() - t0 > give_up_s:
                break
        return time.monotonic() - t0, b"still open"


def test_a_slow_sender_is_dropped_at_the_request_deadline(server):
    srv = server(request_timeout_s=1.0, read_timeout_s=30.0)
    port = srv.server_address[1]
    body = json.dumps({"prompts": ["p"] * 20, "responses": ["1"] * 20}).encode()
    head = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    for data in (head + body, b"POST /score HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200):  # a slow body, slow headers
        took, got = _drip(port, data, 0.1, 1.0 + 2 * MARGIN_S)
        assert got != b"still open" and took < 1.0 + MARGIN_S and _status(got) == 0, (took, got[:80])
    ok = _exchange(port, head.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n") + body)
    assert _status(ok) == 200  # the server goes on


def test_connections_are_capped(server):
    srv = server(max_connections=4, request_timeout_s=30.0)
    port = srv.server_address[1]
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
    try:
        time.sleep(0.5)
        assert threading.active_count() - before <= 4 + 1  # handler threads: at most the cap
        refused = 0
        for s in idle[4:]:
            s.settimeout(MARGIN_S)
            try:
                got = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                got = b""
            refused += _status(got) == 503
        assert refused == 16
    finally:
        for s in idle:
            s.close()
    time.sleep(0.3)
    body = json.dumps({"prompts": ["p"], "responses": ["1"]}).encode()
    ok = _exchange(port, b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    assert _status(ok) == 200  # the slots are free again


def test_max_batch_is_checked_before_the_body_is_parsed(server, monkeypatch):
    srv = server(max_batch=4)
    port = srv.server_address[1]
    body = json.dumps({"metadata": [{}] * 3, "prompts": ["p" * 100] * 20000, "responses": ["1" * 100] * 20000}).encode()  # 4 MiB
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(json, "loads", lambda text, *a, **kw: parsed.append(len(text)) or real_loads(text, *a, **kw))
    answer = _exchange(port, b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    assert _status(answer) == 413 and b"max_batch=4" in answer
    assert parsed == []  # refused by the count, the body never parsed
    small = json.dumps({"prompts": ["p"] * 4, "responses": ["1"] * 4}).encode()
    answer = _exchange(port, b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(small), small))
    assert _status(answer) == 200 and parsed == [len(small)]


def test_the_sample_count_matches_the_parse():
    from aligner.reward.server import count_samples

    for obj, want in [
        ({"prompts": ["a", "b"], "responses": ["c", "d"]}, 2),
        ({"metadata": [{"x": [1, {"y": 2}]}], "query": ["q"] * 7, "labels": [1] * 7}, 7),
        ({"responses": []}, 0),
        ({"responses": "not a list"}, 0),
        ([1, 2, 3], 0),
    ]:
        assert count_samples(json.dumps(obj), 100) == want
    assert count_samples(json.dumps({"responses": ["x"] * 1000}), 10) == 11  # stops past the limit
    with pytest.raises(ValueError):
        count_samples('{"responses": ["a", }', 10)


@pytest.mark.parametrize("value", [b"abc", b"-5", b"1e3", b"12, 13", b"99999999999999999999999"])
def test_a_bad_content_length_gets_400(server, value):
    srv = server()
    answer = _exchange(srv.server_address[1], b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: " + value + b"\r\n\r\n{}")
    assert _status(answer) in (400, 413) and b"Content-Length" in answer
    if value in (b"abc", b"-5", b"1e3", b"12, 13"):
        assert _status(answer) == 400


def test_a_bind_off_loopback_needs_a_token():
    with pytest.raises(ValueError, match="0.0.0.0.*token"):
        RewardHTTPServer(RuleScorer("digit_fraction"), host="0.0.0.0", port=0)
    RewardHTTPServer(RuleScorer("digit_fraction"), host="0.0.0.0", port=0, token="t").server_close()
    RewardHTTPServer(RuleScorer("digit_fraction"), host="0.0.0.0", port=0, allow_no_token=True).server_close()
    RewardHTTPServer(RuleScorer("digit_fraction"), host="127.0.0.1", port=0).server_close()
