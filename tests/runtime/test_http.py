"""The hardened HTTP server (aligner.runtime.http), and the agent endpoint and the reward server built on it, over raw sockets:
loopback by default, a non-loopback bind without a token refused, the bearer token, bounded bodies and
connections, stalled clients dropped."""

from __future__ import annotations

import http.client
import json
import socket
import time
from types import SimpleNamespace

import pytest

from aligner import serve_rm
from aligner.reward.server import RewardHTTPServer, RuleScorer
from aligner.rollout.agent.openai_server import OpenAIEndpoint
from aligner.runtime.http import GuardedHandler, GuardedHTTPServer, check_bind, is_loopback


class Echo(GuardedHandler):
    def do_POST(self):  # noqa: N802
        if not self.authorized():
            return
        ok, body = self.read_json()
        if ok:
            self.reply(200, {"echo": body})


@pytest.fixture()
def server():
    import threading

    s = GuardedHTTPServer(Echo, token="tok", max_request_bytes=1000, max_connections=2, read_timeout_s=1.0)
    t = threading.Thread(target=s.serve_forever, daemon=True)
    t.start()
    yield s
    s.shutdown()
    s.server_close()


def post(server, body: bytes, headers: dict):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    conn.putrequest("POST", "/x")
    for k, v in headers.items():
        conn.putheader(k, v)
    conn.endheaders(body)
    r = conn.getresponse()
    out = r.status, json.loads(r.read() or b"null")
    conn.close()
    return out


def test_loopback_rules():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("10.0.0.1") and not is_loopback("example.com")
    check_bind("127.0.0.1", "")
    check_bind("0.0.0.0", "secret")
    with pytest.raises(ValueError, match=r"host='0.0.0.0' is not a loopback address and no token is set"):
        check_bind("0.0.0.0", "")


def test_servers_refuse_a_public_bind_without_a_token():
    with pytest.raises(ValueError, match="not a loopback address"):
        GuardedHTTPServer(Echo, host="0.0.0.0")
    engine = SimpleNamespace(cfg=SimpleNamespace(vocab_size=10))
    tok = SimpleNamespace(chat_template="")
    with pytest.raises(ValueError, match="not a loopback address"):
        OpenAIEndpoint(engine, tok, max_seq_len=8, host="0.0.0.0")
    with pytest.raises(ValueError, match="no token is set"):  # the reward server's own message names its token sources
        RewardHTTPServer(RuleScorer("task_accuracy"), host="0.0.0.0")
    assert serve_rm.main(["reward.type=rule", "host=0.0.0.0", "port=0"]) == 2  # one line, exit 2, before serving
    ep = OpenAIEndpoint(engine, tok, max_seq_len=8)  # the default: loopback
    assert ep.http.server_address[0] == "127.0.0.1"
    ep.http.server_close()


def test_token_size_and_json_bounds(server):
    good = {"Authorization": "Bearer tok", "Content-Type": "application/json"}
    body = json.dumps({"a": 1}).encode()
    assert post(server, body, {**good, "Content-Length": str(len(body))}) == (200, {"echo": {"a": 1}})
    assert post(server, body, {"Content-Length": str(len(body))})[0] == 401
    assert post(server, body, {"Authorization": "Bearer tok2", "Content-Length": str(len(body))})[0] == 401
    assert post(server, body, good)[0] == 411  # no Content-Length
    big = b"[" + b"1," * 600 + b"1]"
    status, err = post(server, big, {**good, "Content-Length": str(len(big))})
    assert status == 413 and "max_request_bytes=1000" in err["error"]
    assert post(server, b"{nope", {**good, "Content-Length": "5"})[0] == 400


def test_connections_are_bounded_and_stalled_clients_dropped(server):
    held = [socket.create_connection(server.server_address[:2]) for _ in range(2)]  # both slots, idle
    time.sleep(0.2)
    extra = socket.create_connection(server.server_address[:2])
    extra.settimeout(5)
    reply = extra.recv(4096)
    assert reply.startswith(b"HTTP/1.1 503") and b"max_connections=2" in reply
    extra.close()
    # the idle ones are dropped after read_timeout_s (1 s): the server closes them, freeing their slots
    for s in held:
        s.settimeout(5)
        assert s.recv(4096) == b""
        s.close()
    time.sleep(0.2)
    body = b"{}"
    assert post(server, body, {"Authorization": "Bearer tok", "Content-Length": "2"}) == (200, {"echo": {}})
