"""Remote reward calls that overlap generation (``reward.stream``): the engine reports
each request as it ends (``on_finish``), its worker sends finished responses to the endpoint while the
other rows still decode (:class:`aligner.reward.remote.StreamedScores`), and the batch comes back scored.

- the scheduler and both engine schedulers call on_finish once per request with its final tokens,
  the continuous one as each row ends;
- streamed scores equal the driver's scores of the same samples, the endpoint sees the same fields,
  and its first request arrives before the engine returns;
- an endpoint that is down gives the driver one RemoteRewardError naming the URL;
- end to end (Ray, PPO on the built-in task): the workers stream, the step's scores equal a run that
  scores on the driver (``reward.stream=false``).
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from aligner.config import SamplingConfig
from aligner.reward.remote import RemoteReward, RemoteRewardError, StreamedScores, stream_chunk
from aligner.reward.server import RewardHTTPServer, RuleScorer
from aligner.rollout.torch_engine.engine import TorchEngine
from aligner.rollout.torch_engine.scheduler import SlotScheduler
from aligner.tracking import read_metrics
from aligner.trainers.batching import streamed_scores
from tests.toolkit.engine import engine_model
from tests.toolkit.overrides import PPO_RULE, SMALL

PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10], [3, 3], [4, 6, 2], [9], [11, 12], [2, 2, 2]]


class Tok:
    """Decodes each id to a digit (ids divisible by 3) or a letter, so the digit_fraction rule's scores vary."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i % 10) if i % 3 == 0 else chr(97 + i % 26) for i in ids)


class Recording(RuleScorer):
    """A rule scorer that records each request's arrival time and samples."""

    def __init__(self, rule: str) -> None:
        super().__init__(rule)
        self.requests: list[tuple[float, list[str], list]] = []
        self.lock = threading.Lock()

    def score(self, req):
        with self.lock:
            self.requests.append((time.monotonic(), list(req.responses), [list(x) for x in (req.input_ids or [])]))
        return super().score(req)


@pytest.fixture
def server():
    scorer = Recording("digit_fraction")
    srv = RewardHTTPServer(scorer, host="127.0.0.1", port=0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield srv, scorer
    srv.shutdown()
    srv.server_close()


def test_scheduler_reports_each_request_once_as_its_row_ends():
    """on_finish gets every request once, with its final tokens; a short budget ends (and is reported)
    before the long ones admitted with it, and requests are reported while others are still queued."""
    finished: list[tuple[int, list[int], int]] = []
    budgets = [6, 2, 6, 1, 6]
    sched = SlotScheduler([[1, 2]] * 5, budgets, capacity=2, micro_batches=1, stop_ids=())
    sched.on_finish = lambda i, toks: finished.append((i, list(toks), len(sched.pending)))
    while not sched.done():
        plan = sched.plan(0)
        sched.apply(0, [7] * plan.n, [-1.0] * plan.n)
    assert sorted(i for i, _, _ in finished) == [0, 1, 2, 3, 4]
    assert all(toks == sched.outputs[i][0] and len(toks) == budgets[i] for i, toks, _ in finished)
    order = [i for i, _, _ in finished]
    assert order.index(1) < order.index(0)  # budget 2 ends before budget 6, admitted in the same step
    assert finished[0][2] > 0  # the first report came while requests still waited for a slot


@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_engine_reports_every_request_with_the_returned_tokens(scheduler):
    """TorchEngine.generate(on_finish=): one call per request with the tokens of the Generation it
    returns; the continuous scheduler reports the 2-token request first, the static one when its batch ends."""
    eng = TorchEngine(engine_model(), max_batch_size=2, scheduler=scheduler)
    got: list[tuple[int, list[int]]] = []
    s = SamplingConfig(temperature=1.0, max_new_tokens=8)
    gens = eng.generate(PROMPTS[:4], s, seeds=[1, 2, 3, 4], max_new_tokens=[8, 2, 8, 8], on_finish=lambda i, t: got.append((i, list(t))))
    assert sorted(i for i, _ in got) == [0, 1, 2, 3]
    assert all(t == gens[i].token_ids for i, t in got)
    order = [i for i, _ in got]
    assert order[0] == (1 if scheduler == "continuous" else 0)
    # the same call without the callback gives the same tokens (the callback observes only)
    again = eng.generate(PROMPTS[:4], s, seeds=[1, 2, 3, 4], max_new_tokens=[8, 2, 8, 8])
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]


def test_streamed_scores_equal_the_drivers_and_overlap_generation(server):
    """Responses go out in chunks as rows end (one engine slot: requests end one after another), the
    endpoint receives the same responses and input_ids as the driver path sends, the first request
    arrives before generate returns, and the attached scores equal RemoteReward.score on the batch."""
    srv, scorer = server
    client = RemoteReward(srv.url, batch_size=64, max_concurrency=4, max_retries=0)
    eng = TorchEngine(engine_model(), max_batch_size=1)
    rows = [{"prompt": f"p{i}", "metadata": {}} for i in range(len(PROMPTS))]
    chunk = stream_chunk(len(PROMPTS), 64, 4)
    assert chunk == 2
    streamed = StreamedScores(client, Tok(), PROMPTS, rows, chunk)
    s = SamplingConfig(temperature=1.0, max_new_tokens=24)
    gens = eng.generate(PROMPTS, s, seeds=list(range(8)), on_finish=streamed.finished)
    returned = time.monotonic()
    streamed.attach(gens)
    assert streamed.early == set(range(8)) and len(scorer.requests) == 4
    assert all(g.extra["scored_while_generating"] for g in gens)
    assert min(t for t, _, _ in scorer.requests) < returned  # scoring began while the engine decoded
    responses = [Tok().decode(g.token_ids) for g in gens]
    sent = {r: ids for _, rs, idss in scorer.requests for r, ids in zip(rs, idss)}
    assert sent == {r: p + g.token_ids for r, p, g in zip(responses, PROMPTS, gens)}
    want = client.score([r["prompt"] for r in rows], responses, [{}] * 8, [p + g.token_ids for p, g in zip(PROMPTS, gens)])
    assert len(set(want.tolist())) > 2  # the rows differ, so an order mix-up would fail
    assert torch.equal(streamed_scores(gens), want)
    client.close()


def test_responses_not_reported_are_sent_after_the_engine_returns(server):
    """A rank whose engine did not run the scheduler (no on_finish calls) still scores every row at attach."""
    srv, scorer = server
    client = RemoteReward(srv.url, max_retries=0)
    gens = TorchEngine(engine_model()).generate(PROMPTS[:3], SamplingConfig(temperature=0.0, max_new_tokens=5))
    streamed = StreamedScores(client, Tok(), PROMPTS[:3], [{"prompt": "p"}] * 3, chunk=1)
    streamed.attach(gens)
    assert not streamed.early and len(scorer.requests) == 1
    assert not any(g.extra["scored_while_generating"] for g in gens)
    assert streamed_scores(gens).shape == (3,)
    client.close()


def test_an_endpoint_that_is_down_is_one_error_naming_the_url():
    """No valid answer after the retries: each Generation carries the error and the driver raises it
    (a RemoteRewardError, one line with the URL), never a silent zero."""
    from aligner.runtime.ports import free_port

    url = f"http://127.0.0.1:{free_port()}/score"
    client = RemoteReward(url, max_retries=1, backoff_s=0.0, timeout_s=2.0)
    gens = TorchEngine(engine_model()).generate(PROMPTS[:2], SamplingConfig(temperature=0.0, max_new_tokens=3))
    streamed = StreamedScores(client, Tok(), PROMPTS[:2], [{"prompt": "p"}] * 2, chunk=1)
    for i, g in enumerate(gens):
        streamed.finished(i, g.token_ids)
    streamed.attach(gens)
    assert all("score" not in g.extra for g in gens)
    with pytest.raises(RemoteRewardError, match=r"reward.url=http://127\.0\.0\.1:\d+/score: no valid answer after 2 tries"):
        streamed_scores(gens)
    client.close()


def test_without_streamed_scores_the_driver_scores():
    """Generations without scores (a trtllm engine, prompt learning) leave the batch unscored."""
    from aligner.rollout.base import Generation

    assert streamed_scores([Generation([1], [0.0], "stop", 0)]) is None
    assert streamed_scores([]) is None


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.usefixtures("ray_cluster")
def test_ppo_streams_remote_scores_from_the_engines(tmp_path, server):
    """PPO through Ray with reward.type=remote and reward.stream (the default): the actor's engine sends
    small requests as its rows end (4 per step of 16 samples, at most 4 samples each) between the
    driver's two evaluations (one request of the 16 held-out responses each), and each step's
    score_mean is the rule's mean over the responses the endpoint received for that step (the driver
    path, ``reward.stream=false``, is tested in test_remote.py)."""
    from aligner.ppo import main as ppo_main
    from aligner.reward import rules

    srv, scorer = server
    out = tmp_path / "run"
    overrides = [
        *SMALL,
        *PPO_RULE,
        "reward.type=remote",
        f"reward.url={srv.url}",
        "trainer.max_steps=2",
        "trainer.rollout_batch_size=8",
        "trainer.n_samples_per_prompt=2",
        "trainer.mini_batch_size=16",
        "rollout.sampling.max_new_tokens=16",
        f"output_dir={out}",
    ]
    assert ppo_main(overrides) == 0
    steps = [m for m in read_metrics(out / "metrics.jsonl") if "score_mean" in m]
    assert len(steps) == 2
    evals, streamed = [scorer.requests[0], scorer.requests[-1]], scorer.requests[1:-1]
    assert all(len(r) == 16 for _, r, _ in evals)
    assert len(streamed) == 8 and all(1 <= len(r) <= 4 for _, r, _ in streamed)
    for k, m in enumerate(steps):
        responses = [r for _, rs, _ in streamed[4 * k : 4 * k + 4] for r in rs]
        assert len(responses) == 16
        want = rules.score("digit_fraction", [""] * 16, responses).mean().item()
        assert m["score_mean"] == pytest.approx(want, abs=1e-6)
        assert m["reward/scored_while_generating"] == 1.0  # chunks of 4 of a share of 16: every one sent as its row ended


class LocalJudge:
    """A reward-group worker handle stand-in: ``call.remote("judge_scores", ((batch,), {}))`` judges the
    batch with a local Judge and returns an ObjectRef (needs Ray)."""

    def __init__(self, judge, calls: list) -> None:
        outer = self

        class _Call:
            def remote(self, method, packed):
                import ray

                (batch,), _ = packed
                calls.append((method, len(batch["prompt"])))
                return ray.put(outer.judge.scores(batch["prompt"], batch["response"]))

        self.judge, self.call = judge, _Call()


@pytest.mark.usefixtures("ray_cluster")
def test_streamed_judge_verdicts_equal_the_whole_batch_judged_at_once():
    """StreamedJudge sends chunks to the judges round-robin as rows end; the verdicts equal one
    Judge.scores call on the whole batch (the judge's own engine generates every judgement greedily);
    a failing judge call marks every Generation with judge_error."""
    from aligner.reward.judge import Judge
    from aligner.workers.reward import StreamedJudge

    judge = Judge(TorchEngine(engine_model(seed=2)), Tok(), "{prompt}={response}", max_new_tokens=3, max_score=9, max_seq_len=48)
    # a character per token, the rubric's delimiter tags one token each (the engine's context is 48 tokens)
    tags = {"<prompt>": 91, "</prompt>": 92, "<response>": 93, "</response>": 94}
    judge.tok.encode = lambda text, add_special_tokens=False: [
        tags[part] if part in tags else 1 + (ord(c) % 90)
        for part in re.split(r"(</?(?:prompt|response)>)", text)
        for c in (part if part not in tags else "_")
    ]
    judge.tok.apply_chat_template = lambda msgs, tokenize=False, add_generation_prompt=True: msgs[0]["content"]
    calls: list = []
    judges = [LocalJudge(judge, calls), LocalJudge(judge, calls)]
    rows = [{"prompt": f"q{i}"} for i in range(6)]
    streamed = StreamedJudge(judges, Tok(), rows, chunk=2, first=1)
    gens = TorchEngine(engine_model(), max_batch_size=1).generate(
        PROMPTS[:6], SamplingConfig(temperature=1.0, max_new_tokens=6), seeds=list(range(6)), on_finish=streamed.finished
    )
    streamed.attach(gens)
    assert calls == [("judge_scores", 2)] * 3 and [r for _, r, _ in streamed.sent] == [1, 0, 1]
    want = judge.scores([r["prompt"] for r in rows], [Tok().decode(g.token_ids) for g in gens])
    assert streamed_scores(gens).tolist() == want["scores"].tolist()
    assert [g.extra["judge_unparsed"] for g in gens] == want["unparsed"].tolist()

    class Broken:
        class call:
            @staticmethod
            def remote(method, packed):
                import ray

                @ray.remote
                def fail():
                    raise ValueError("judgement 0 is 99 tokens")

                return fail.remote()

    failing = StreamedJudge([Broken()], Tok(), rows[:2], chunk=2)
    gens = TorchEngine(engine_model()).generate(PROMPTS[:2], SamplingConfig(temperature=0.0, max_new_tokens=3))
    failing.attach(gens)
    assert all("judgement 0 is 99 tokens" in g.extra["judge_error"] and "reward rank 0" in g.extra["judge_error"] for g in gens)
