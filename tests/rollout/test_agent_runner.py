"""Running agent programs against the endpoint (aligner.rollout.agent.runner): the example calculator
agent (examples/calculator_agent.py, the real `openai` client in its own process) on the bigram engine
of tests/toolkit/agent.py (a 30-nat margin: its chain is sampled at temperature 1 too), and agents that crash, hang, never report or do not exist."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from aligner.rollout.agent.openai_server import OpenAIEndpoint
from aligner.rollout.agent.runner import AgentRunError, run_agents
from tests.toolkit.agent import CALL_HEAD, CALL_TAIL, MAX_SEQ_LEN, SpyEngine, agent_tokenizer, bigram_engine

pytest.importorskip("openai", reason="the openai client is not installed (pip install openai; it is in aligner[test])")

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "calculator_agent.py")
ONE_CALL = (
    "import os, openai; c = openai.OpenAI(default_headers={'X-Episode-Id': os.environ['ALIGNER_EPISODE_ID']}, max_retries=0); "
    "c.chat.completions.create(model=os.environ['ALIGNER_MODEL'], messages=[{'role': 'user', 'content': os.environ['ALIGNER_PROMPT']}], "
    "max_tokens=4, temperature=0)"
)


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    tok = agent_tokenizer(str(tmp_path_factory.mktemp("tok")))
    ep = OpenAIEndpoint(SpyEngine(bigram_engine(tok, margin=30.0)), tok, max_seq_len=MAX_SEQ_LEN, token="run-token", default_max_tokens=16)
    with ep:
        yield ep


def test_the_example_agent_trains_through_the_endpoint(endpoint):
    tasks = [("12+39=", {"answer": "51"}), ("3+4=", {"answer": "7"})]
    before = len(endpoint.engine.calls)
    eps = run_agents(endpoint, [sys.executable, EXAMPLE], tasks, parallel=2, deadline_s=120)
    assert [e.dropped for e in eps] == [False, False], [e.reason for e in eps]
    for e in eps:
        # the bigram model calls the calculator in both of its turns (max 2): the answer is not the sum
        assert e.reward == 0.0 and e.reward_source == "agent" and e.calls == 2
        (s,) = e.samples  # two calls, one chained sample
        g = s.generation
        text = endpoint.tok.decode(g.token_ids, skip_special_tokens=False)
        assert text.count(CALL_HEAD + "12+39" + CALL_TAIL) == 2 and "<tool_response>\n51\n</tool_response>" in text
        assert sum(g.own_mask) == 16 and g.extra["added_tokens"] == len(g.token_ids) - 16
    sampled = [g.token_ids for _, gens, _ in endpoint.engine.calls[before:] for g in gens]
    own = [[t for t, m in zip(e.samples[0].generation.token_ids, e.samples[0].generation.own_mask) if m] for e in eps]
    assert sorted(sum(sampled, [])) == sorted(sum(own, []))  # every sampled token is in a sample, once


def test_failing_agents_are_dropped_and_counted(endpoint):
    seen = []

    def rule(prompt, response, metadata):
        seen.append((prompt, response, metadata))
        return 0.25

    cmds = {
        "crash": [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"],
        "hang": [sys.executable, "-c", "import time; time.sleep(60)"],
        "silent": [sys.executable, "-c", ONE_CALL],
    }
    (crash,) = run_agents(endpoint, cmds["crash"], [("1+1=", {})], max_dropped_frac=1.0)
    assert crash.dropped and crash.reason == "exited with code 3: boom" and crash.samples == []
    (mute,) = run_agents(endpoint, [sys.executable, "-c", "import sys; sys.exit(3)"], [("1+1=", {})], max_dropped_frac=1.0)
    assert mute.reason == "exited with code 3: (no output on stdout or stderr)"
    (hang,) = run_agents(endpoint, cmds["hang"], [("1+1=", {})], deadline_s=2, max_dropped_frac=1.0)
    assert hang.dropped and "deadline of 2 s" in hang.reason and hang.returncode is None
    (silent,) = run_agents(endpoint, cmds["silent"], [("1+1=", {})], max_dropped_frac=1.0)
    assert silent.dropped and silent.reason.startswith("never reported its reward")
    (ruled,) = run_agents(endpoint, cmds["silent"], [("1+1=", {"answer": "2"})], reward_fn=rule)
    assert not ruled.dropped and ruled.reward == 0.25 and ruled.reward_source == "rule"
    assert seen == [("1+1=", CALL_HEAD + "12+", {"answer": "2"})]  # the rule read the final completion's text
    assert endpoint.recorder.episode_ids() == []  # nothing left behind
    with pytest.raises(AgentRunError, match=r"^2 of 2 agent episodes were dropped, over agent.max_dropped_frac=0.5; .*exited with code 3"):
        run_agents(endpoint, cmds["crash"], [("1+1=", {})] * 2)
    with pytest.raises(ValueError, match=r"agent.command='no-such-agent --x' is invalid: the program 'no-such-agent' is not on PATH"):
        run_agents(endpoint, "no-such-agent --x", [("1+1=", {})])


def test_the_agent_sees_its_task(endpoint, tmp_path):
    out = tmp_path / "env.json"
    dump = (
        "import json, os; json.dump({k: os.environ[k] for k in ('OPENAI_BASE_URL', 'OPENAI_API_KEY', 'ALIGNER_EPISODE_ID', "
        f"'ALIGNER_MODEL', 'ALIGNER_PROMPT', 'ALIGNER_METADATA')}}, open({str(out)!r}, 'w'))"
    )
    (e,) = run_agents(endpoint, [sys.executable, "-c", dump], [("9+9=", {"answer": "18"})], max_dropped_frac=1.0)
    got = json.loads(out.read_text())
    assert got == {
        "OPENAI_BASE_URL": endpoint.url,
        "OPENAI_API_KEY": "run-token",
        "ALIGNER_EPISODE_ID": e.episode_id,
        "ALIGNER_MODEL": "aligner-policy",
        "ALIGNER_PROMPT": "9+9=",
        "ALIGNER_METADATA": '{"answer": "18"}',
    }
    assert e.dropped and e.reason == "made no call to the endpoint with its episode id"


def test_the_example_agent_gives_the_in_process_tool_environments_sequences(endpoint):
    """The example agent through the endpoint (tools untaught, as conf=tiny_tools plays them) and the
    in-process tool environment on the engine give the same training sequences, masks and log-probs."""
    import torch

    from aligner.config import SamplingConfig
    from aligner.envs import EnvSpec, TokenEpisodes, make_env

    tok, engine = endpoint.tok, endpoint.engine.engine
    tasks = [("12+39=", {"answer": "51"}), ("3+4=", {"answer": "7"})]
    with OpenAIEndpoint(engine, tok, max_seq_len=MAX_SEQ_LEN, token="t2", default_max_tokens=16, teach_tools=False) as ep:
        agents = run_agents(ep, [sys.executable, EXAMPLE], tasks, parallel=2, deadline_s=120)
    spec = EnvSpec(reward_fn=lambda p, r, m: float(r.strip() == m["answer"]), tools=("calculator",), chat_template=tok.chat_template)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=100)
    episodes = TokenEpisodes(lambda: make_env("tool", spec), tok, tasks, max_turns=2, timeout_s=10, stop_ids=engine.stop_ids(sampling))
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True), add_special_tokens=False
        )
        for p, _ in tasks
    ]
    gens = engine.generate(prompts, sampling, turn_end=episodes)
    for a, p, g in zip(agents, prompts, gens):
        (s,) = a.samples
        assert s.prompt_ids == p
        assert s.generation.token_ids == g.token_ids and s.generation.own_mask == g.own_mask
        torch.testing.assert_close(torch.tensor(s.generation.rollout_log_probs), torch.tensor(g.rollout_log_probs), atol=1e-5, rtol=0)


def test_a_crashing_agents_traceback_is_in_the_reason_and_the_log(endpoint, tmp_path, caplog):
    script = tmp_path / "agent.py"
    script.write_text("import os\n\n\ndef main():\n    return os.environ['NO_SUCH_VARIABLE']\n\n\nmain()\n")
    with caplog.at_level("WARNING", logger="aligner.agent"):
        (e,) = run_agents(endpoint, [sys.executable, str(script)], [("1+1=", {})], max_dropped_frac=1.0)
    assert e.dropped and e.returncode == 1
    # the innermost frame of the agent's own code, not os.py's
    assert e.reason == f"exited with code 1: KeyError: 'NO_SUCH_VARIABLE' (at {script}:5)"
    (rec,) = [r for r in caplog.records if r.name == "aligner.agent"]
    msg = rec.getMessage()
    assert e.episode_id in msg and "Traceback (most recent call last)" in msg and f'File "{script}", line 5, in main' in msg
