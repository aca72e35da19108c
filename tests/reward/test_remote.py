"""The remote reward (``reward.type=remote``): the HTTP client (aligner/reward/remote.py), the server
(aligner/reward/server.py, ``python -m aligner.serve_rm``) and the driver's reward role over them
(aligner/workers/reward.py). Servers run in this process on an ephemeral 127.0.0.1 port; each test
takes well under a second except the one that starts the command."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from aligner.reward import rules
from aligner.reward.remote import RemoteReward, RemoteRewardError, parse_rewards
from aligner.reward.server import ModelScorer, RewardHTTPServer, RuleScorer
from tests.toolkit.models import TINY
from tests.toolkit.paths import REPO
from tests.toolkit.spawn import free_port

PROMPTS = ["What is 2+3?", "Name a colour.", "12 * 3 = ?", "Say nothing.", "Count: 1 2 3", "Last one"]
RESPONSES = ["5", "red, 2 of them", "36 #### 36", "", "1 2 3 4", "x9y8"]


@pytest.fixture
def serve():
    """serve(scorer, **kw) -> a running RewardHTTPServer on 127.0.0.1:<free port>, shut down after the test."""
    servers = []

    def start(scorer, **kw):
        srv = RewardHTTPServer(scorer, host="127.0.0.1", port=0, **kw)
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def post(url: str, body, headers: dict | None = None, raw: bytes | None = None) -> tuple[int, dict]:
    """(status, decoded JSON answer) of one POST (no retries)."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- round trips ----------------------------------------------------------------------------------
def test_rule_server_round_trip_equals_the_local_rule(serve):
    """Scores through client and server equal the rule scored locally, in order, across several concurrent
    requests (batch_size=4 splits 6 samples into 2)."""
    srv = serve(RuleScorer("digit_fraction"))
    client = RemoteReward(srv.url, batch_size=4, max_concurrency=2, max_retries=0)
    got = client.score(PROMPTS, RESPONSES)
    want = rules.score("digit_fraction", PROMPTS, RESPONSES)
    assert got.dtype == torch.float32 and got.shape == (6,)
    torch.testing.assert_close(got, want)
    assert len(set(want.tolist())) > 3  # the rows differ, so an order mix-up would fail
    assert client.score([], []).shape == (0,)
    client.close()


def test_openrlhf_request_shape(serve):
    """OpenRLHF's serve_rm shape, {"query", "prompts", "labels"} -> {"rewards"}: the response is the query
    after its prompt, a label is the row's reference answer; /get_reward answers as /score does."""
    srv = serve(RuleScorer("gsm8k"))
    prompts = ["Q: 2+2?\n", "Q: 10-3?\n", "Q: 6*7?\n"]
    responses = ["so #### 4", "the answer is 8", "#### 42"]
    labels = ["4", "7", "42"]
    status, ans = post(
        srv.url.replace("/score", "/get_reward"),
        {"query": [p + r for p, r in zip(prompts, responses)], "prompts": prompts, "labels": labels},
    )
    assert status == 200 and ans["rewards"] == [1.0, 0.0, 1.0]
    meta = [{"answer": a} for a in labels]
    assert RemoteReward(srv.url).score(prompts, responses, meta).tolist() == rules.score("gsm8k", prompts, responses, meta).tolist()


@pytest.fixture(scope="module")
def tiny_rm_dir(tmp_path_factory):
    """An HF reward-model dir of the tiny Llama: random trunk, random (non-zero) score head."""
    from aligner.config import ModelConfig
    from aligner.model.hf import save_hf
    from aligner.model.llama import build_model

    cfg = ModelConfig(**TINY)
    model = build_model(cfg, kind="score", seed=11)
    with torch.no_grad():
        model.score.weight.normal_(generator=torch.Generator().manual_seed(5))
    return save_hf(model.state_dict(), cfg, tmp_path_factory.mktemp("rm") / "hf", kind="score")


def test_model_server_scores_equal_the_local_reward_model(serve, tiny_rm_dir):
    """A reward model served over HTTP scores the padded batch the driver holds as the reward worker's
    RewardModel does locally: the driver's role sends each row's real tokens (right padding removed)."""
    from aligner.config import ModelConfig, OptimConfig, ParallelConfig
    from aligner.config.roles import RewardRoleConfig
    from aligner.parallel.dims import ParallelDims
    from aligner.reward.reward_model import RewardModel
    from aligner.workers.reward import RemoteRewardRole

    g = torch.Generator().manual_seed(0)
    lengths = [9, 4, 13, 1, 7]
    ids = torch.zeros(len(lengths), 13, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, TINY["vocab_size"], (n,), generator=g)
        mask[i, :n] = 1
    local = RewardModel(ModelConfig(), ParallelConfig(), OptimConfig(), ParallelDims(), init=str(tiny_rm_dir))
    want = local.scores({"input_ids": ids, "attention_mask": mask}, micro_batch_size=2)

    srv = serve(ModelScorer(str(tiny_rm_dir), micro_batch_size=3))
    role = RemoteRewardRole(RewardRoleConfig(type="remote", url=srv.url, batch_size=2, max_retries=0))
    meta = [{"prompt": f"p{i}", "response": f"r{i}", "metadata": {}} for i in range(len(lengths))]
    got = role.scores({"input_ids": ids, "attention_mask": mask}, meta).get(timeout_s=30)
    role.shutdown()
    assert want.std() > 0.1  # a random head: the rows' scores differ
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)

    status, ans = post(srv.url, {"prompts": ["a"], "responses": ["b"], "input_ids": [[1] * (TINY["max_seq_len"] + 1)]})
    assert status == 400 and "max_seq_len" in ans["error"]
    status, ans = post(srv.url, {"prompts": ["a"], "responses": ["b"], "input_ids": [[TINY["vocab_size"]]]})
    assert status == 400 and "vocabulary" in ans["error"]
    status, ans = post(srv.url, {"prompts": ["a"], "responses": ["b"]})
    assert status == 400 and "tokenizer" in ans["error"]  # no tokenizer saved beside the tiny RM, no input_ids sent


# ---- the server's doors -----------------------------------------------------------------------------
def test_token_refused_and_accepted(serve):
    srv = serve(RuleScorer("digit_fraction"), token="s3cret")
    body = {"prompts": ["p"], "responses": ["a1"]}
    assert post(srv.url, body)[0] == 401
    assert post(srv.url, body, {"Authorization": "Bearer wrong"})[0] == 401
    assert post(srv.url, body, {"Authorization": "Bearer s3cret"}) == (200, {"rewards": [0.5]})
    with pytest.raises(RemoteRewardError) as e:  # a 401 is not retried: one try, the hint names the token
        RemoteReward(srv.url, max_retries=3, backoff_s=5.0).score(["p"], ["a1"])
    assert "1 try" in str(e.value) and "HTTP 401" in str(e.value) and "reward.token" in str(e.value)
    assert RemoteReward(srv.url, token="s3cret").score(["p"], ["a1"]).tolist() == [0.5]


def test_token_from_the_environment(serve, monkeypatch):
    srv = serve(RuleScorer("digit_fraction"), token="from-env")
    monkeypatch.setenv("ALIGNER_RM_TOKEN", "from-env")
    assert RemoteReward(srv.url).score(["p"], ["12"]).tolist() == [1.0]


def test_oversize_request_and_batch_are_refused_and_the_server_keeps_serving(serve):
    srv = serve(RuleScorer("digit_fraction"), max_batch=4, max_request_bytes=2000)
    status, ans = post(srv.url, {"prompts": ["p"], "responses": ["x" * 5000]})
    assert status == 413 and "max_request_bytes=2000" in ans["error"]
    status, ans = post(srv.url, {"prompts": ["p"] * 5, "responses": ["1"] * 5})
    assert status == 413 and "max_batch=4" in ans["error"]
    with pytest.raises(RemoteRewardError) as e:  # not retried; the hint says how to fit
        RemoteReward(srv.url, max_retries=2, backoff_s=5.0).score(["p"] * 5, ["1"] * 5)
    assert "HTTP 413" in str(e.value) and "reward.batch_size" in str(e.value)
    assert RemoteReward(srv.url, batch_size=4).score(["p"] * 5, ["1"] * 5).tolist() == [1.0] * 5


@pytest.mark.parametrize(
    "raw,words",
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"prompts": ["p"]}', '"responses"'),
        (b'{"prompts": "p", "responses": ["r"]}', '"prompts" must be a list of strings'),
        (b'{"prompts": ["p", "q"], "responses": ["r"]}', "give one of each per sample"),
        (b'{"prompts": ["p"], "responses": ["r"], "metadata": [1]}', '"metadata" must be a list of 1 objects'),
        (b'{"prompts": ["p"], "responses": ["r"], "input_ids": [[]]}', '"input_ids"'),
        (b'{"query": ["ab"], "prompts": ["a", "b"]}', "one prompt per query"),
    ],
)
def test_malformed_request_gets_400_and_the_server_keeps_serving(serve, raw, words):
    srv = serve(RuleScorer("digit_fraction"))
    status, ans = post(srv.url, None, raw=raw)
    assert status == 400 and words in ans["error"], ans
    assert post(srv.url, {"prompts": ["p"], "responses": ["7"]}) == (200, {"rewards": [1.0]})


def test_scorer_errors_are_replies_not_crashes(serve):
    """A rule that cannot score a row (gsm8k without its reference) gets 400; an unknown path 404; a body
    without Content-Length 411; then the server still answers."""
    srv = serve(RuleScorer("gsm8k"))
    status, ans = post(srv.url, {"prompts": ["p"], "responses": ["#### 1"]})
    assert status == 400 and "metadata['answer']" in ans["error"]
    assert post(srv.url.replace("/score", "/nope"), {})[0] == 404
    host, port = srv.server_address[:2]
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(200).split(b"\r\n")[0].endswith(b"411 Length Required")
    with urllib.request.urlopen(srv.url.replace("/score", "/health"), timeout=5) as r:
        assert json.loads(r.read())["scorer"] == "rule:gsm8k"
    assert post(srv.url, {"prompts": ["p"], "responses": ["#### 1"], "metadata": [{"answer": "1"}]}) == (200, {"rewards": [1.0]})


def test_binds_localhost_by_default():
    srv = RewardHTTPServer(RuleScorer("digit_fraction"))
    try:
        assert srv.server_address[0] == "127.0.0.1"
    finally:
        srv.server_close()


# ---- failures reach the user as one error, never zeros --------------------------------------------------
def test_server_down_raises_after_the_retries_with_the_url_and_the_backoff():
    url = f"http://127.0.0.1:{free_port()}/score"
    waits = []
    with pytest.raises(RemoteRewardError) as e:
        RemoteReward(url, max_retries=3, backoff_s=0.25, sleep=waits.append).score(["p"], ["r"])
    msg = str(e.value)
    assert waits == [0.25, 0.5, 1.0]  # exponential backoff: backoff_s, then doubling
    assert "\n" not in msg and f"reward.url={url}" in msg and "4 tries" in msg and "cannot connect" in msg, msg

    t0 = time.monotonic()  # the real sleep: 0.05 + 0.1 s between three tries
    with pytest.raises(RemoteRewardError):
        RemoteReward(url, max_retries=2, backoff_s=0.05).score(["p"], ["r"])
    assert 0.15 <= time.monotonic() - t0 < 5.0


class _Garbage(BaseHTTPRequestHandler):
    """Answers every POST with the class's (status, body); counts the requests."""

    answer: tuple[int, bytes] = (200, b"")
    count = 0

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        type(self).count += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        status, body = self.answer
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize(
    "status,body,words",
    [
        (200, b'{"rewards": [0.5]}', "1 rewards for 2 samples"),
        (200, b'{"rewards": [0.5, NaN]}', "reward 1 is nan, not finite"),
        (200, b'{"rewards": [0.5, "high"]}', "reward 1 is 'high', not a number"),
        (200, b"<html>busy</html>", "not JSON"),
        (200, b'{"scores": [1, 2]}', 'no "rewards" list'),
        (503, b'{"error": "model loading"}', "HTTP 503: model loading"),
    ],
)
def test_garbage_answers_are_retried_then_one_clear_error(status, body, words):
    handler = type("Handler", (_Garbage,), {"answer": (status, body), "count": 0})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/score"
    try:
        with pytest.raises(RemoteRewardError) as e:
            RemoteReward(url, max_retries=2, backoff_s=0.0).score(["p", "q"], ["r", "s"])
    finally:
        srv.shutdown()
        srv.server_close()
    assert handler.count == 3  # 1 + max_retries requests reached the server
    msg = str(e.value)
    assert "\n" not in msg and url in msg and "3 tries" in msg and words in msg, msg


def test_timeout_is_a_retried_failure():
    """A server that accepts but never answers: each try ends after timeout_s."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/score"
        t0 = time.monotonic()
        with pytest.raises(RemoteRewardError) as e:
            RemoteReward(url, timeout_s=0.2, max_retries=1, backoff_s=0.0).score(["p"], ["r"])
        assert 0.4 <= time.monotonic() - t0 < 5.0
    assert "within reward.timeout_s=0.2 s" in str(e.value) and "2 tries" in str(e.value)


def test_parse_rewards_accepts_ints_and_refuses_bools():
    assert parse_rewards(b'{"rewards": [1, -2.5, 0]}', 3) == [1.0, -2.5, 0.0]
    with pytest.raises(ValueError, match="not a number"):
        parse_rewards(b'{"rewards": [true]}', 1)
    with pytest.raises(ValueError, match="not finite"):
        parse_rewards(b'{"rewards": [Infinity]}', 1)


def test_client_refuses_a_malformed_url_and_mismatched_lists():
    with pytest.raises(ValueError, match="reward.url='ftp://x/score' is invalid"):
        RemoteReward("ftp://x/score")
    with pytest.raises(ValueError, match="give one of each per sample"):
        RemoteReward("http://127.0.0.1:1/score").score(["p", "q"], ["r"])


# ---- the command --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args,words",
    [
        (["bogus=1"], "'bogus=1' is not a key=value setting"),
        (["port=70000"], "port=70000 is invalid"),
        (["max_batch=x"], "max_batch='x' is invalid"),
        (["reward.type=remote"], "serves model or rule"),
        ([], "reward.init is empty"),
        (["reward.type=rule", "reward.rule=nope"], "reward.rule='nope' is unknown"),
    ],
)
def test_serve_rm_bad_setting_is_one_line_exit_2(args, words, capsys):
    from aligner import serve_rm

    code = serve_rm.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("aligner serve_rm: error: ") and words in err[0], err


def test_serve_rm_command_serves_and_stops_on_sigterm():
    """`python -m aligner.serve_rm reward.type=rule ... port=0 token=...`: prints its URL, answers /health and
    /score (with the token), and exits 0 on SIGTERM."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "ALIGNER_RM_TOKEN": "tok"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "aligner.serve_rm", "reward.type=rule", "reward.rule=digit_fraction", "port=0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving rule:digit_fraction at http://127.0.0.1:") and "token required" in line, line + proc.stderr.read()
        url = line.split(" at ")[1].split()[0]
        with urllib.request.urlopen(url.replace("/score", "/health"), timeout=5) as r:
            assert json.loads(r.read())["status"] == "ok"
        assert post(url, {"prompts": ["p"], "responses": ["1a"]})[0] == 401
        assert RemoteReward(url, token="tok").score(["p", "q"], ["1a", "22"]).tolist() == [0.5, 1.0]
    finally:
        proc.terminate()
        code = proc.wait(timeout=20)
    assert code == 0, proc.stderr.read()


# ---- the driver: PPO's inference phase -----------------------------------------------------------------
class _Blocking:
    """A rule scorer that says when a request has arrived and holds its answer until released."""

    name = "rule:digit_fraction (held)"

    def __init__(self) -> None:
        self.started, self.released = threading.Event(), threading.Event()

    def score(self, req):
        self.started.set()
        assert self.released.wait(10), "the driver never released the scorer"
        return rules.score("digit_fraction", req.prompts, req.responses).tolist()


class _ActorCall:
    """The actor's old-log-prob call, running as a Ray call does from the moment it is issued: its work (a
    thread) needs the remote request in flight, then lets the scorer answer; get() returns its result."""

    def __init__(self, scorer: _Blocking, shape) -> None:
        self.shape, self.overlapped = shape, False

        def work():
            self.overlapped = scorer.started.wait(10)
            scorer.released.set()

        self.thread = threading.Thread(target=work, daemon=True)
        self.thread.start()

    def get(self, timeout_s=None):
        self.thread.join()
        assert self.overlapped, "the remote reward was not in flight while the actor's call ran"
        return torch.zeros(self.shape)


def test_ppo_inference_overlaps_the_remote_reward_with_the_actor(serve, monkeypatch, tmp_path):
    """PPOTrainer.infer with reward.type=remote: the HTTP requests are in flight while the actor's old-log-prob
    call runs (neither finishes without the other), and the batch's scores are the rule's on the responses."""
    from aligner.cli import load_config
    from aligner.protocol import RolloutBatch, build_sequences
    from aligner.trainers.ppo import PPOTrainer
    from aligner.workers.reward import RemoteRewardRole

    monkeypatch.chdir(tmp_path)  # the presets' relative *.init paths find no earlier run's checkpoints
    scorer = _Blocking()
    srv = serve(scorer)
    cfg = load_config(
        "ppo",
        [
            "reward.type=remote",
            f"reward.url={srv.url}",
            "reward.batch_size=2",
            "algorithm.recompute_old_log_probs=true",
            "actor.init=",
            "critic.init=",
        ],
    )
    seq = build_sequences([[1, 5, 6], [1, 7], [1, 3]], [[8, 9, 2], [4, 2], [2]], pad_id=0)
    responses = ["12", "a1", "xyz"]
    meta = [{"prompt": "p", "response": r, "metadata": {}, "finish_reason": "stop"} for r in responses]
    batch = RolloutBatch(**seq, group_ids=torch.tensor([0, 0, 1]), rollout_log_probs=torch.zeros_like(seq["response_mask"]), meta=meta)

    trainer = PPOTrainer(cfg, tokenizer=None, train_prompts=[{"prompt_ids": [1]}], eval_prompts=[])
    actor = type("Actor", (), {"log_probs": lambda self, inputs, temp: _ActorCall(scorer, batch.response_mask.shape)})()
    trainer.groups = {"actor": actor}
    trainer.remote_reward = RemoteRewardRole(cfg.reward)
    try:
        trainer.infer(batch)
    finally:
        trainer.remote_reward.shutdown()
    assert batch.scores.tolist() == [1.0, 0.5, 0.0]
    assert torch.equal(batch.old_log_probs, torch.zeros_like(batch.response_mask))


def test_the_shared_token_is_not_written_to_config_yaml():
    """A run's output_dir/config.yaml (aligner.config.config_yaml) holds no credential: reward.token
    is written as <redacted>, and an unset token stays empty."""
    from aligner.cli import load_config
    from aligner.config import config_yaml

    cfg = load_config("ppo", ["reward.type=remote", "reward.url=http://127.0.0.1:1/score"])
    cfg.reward.token = "s3cret-value"  # as a config file gives it (the command line refuses it: tests/reward/test_tokens.py)
    text = config_yaml(cfg)
    assert "s3cret-value" not in text and "token: <redacted>" in text
    assert cfg.reward.token == "s3cret-value"  # the run itself still sends it
    assert "<redacted>" not in config_yaml(load_config("ppo", ["reward.type=remote", "reward.url=http://127.0.0.1:1/score"]))
