"""Agent episodes on a worker's engine (aligner.workers.agent_episodes), Ray-free: the example calculator
agent (examples/calculator_agent.py, the real `openai` client in its own process) against the endpoint the
worker starts over the bigram engine of tests/toolkit/agent.py, whose model calls the calculator in every
turn. The Generations are what the trainer assembles: the engine's sampled tokens, the agent's additions
masked, the agent's own prompt, an Episode with its reward and counts; crashing agents are placeholders."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from aligner.cli import load_config
from aligner.config import SamplingConfig
from aligner.workers.agent_episodes import agent_command, generate_agent_episodes
from tests.toolkit.agent import CALL_HEAD, CALL_TAIL, MAX_SEQ_LEN, SpyEngine, agent_tokenizer, bigram_engine

pytest.importorskip("openai", reason="the openai client is not installed (pip install openai; it is in aligner[test])")

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "calculator_agent.py")


def _cfg(command: str, *more: str):
    return load_config(
        "ppo", ["conf=tiny_agent", f"agent.command={command}", f"model.max_seq_len={MAX_SEQ_LEN}", "agent.parallel=2", *more]
    )


@pytest.fixture(scope="module")
def engine_tok(tmp_path_factory):
    tok = agent_tokenizer(str(tmp_path_factory.mktemp("tok")))
    return SpyEngine(bigram_engine(tok, margin=30.0)), tok


def test_the_example_agents_episodes_are_the_engines_tokens(engine_tok):
    engine, tok = engine_tok
    rows = [("12+39=", {"answer": "51"}), ("3+4=", {"answer": "7"})]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=16)
    before = len(engine.calls)
    gens = generate_agent_episodes(engine, _cfg(f"{sys.executable} {EXAMPLE}"), tok, [[1], [1]], sampling, None, rows)
    calls = engine.calls[before:]
    prompts = {tuple(p) for ps, _, _ in calls for p in ps}
    sampled = sorted(t for _, gs, _ in calls for g in gs for t in g.token_ids)
    assert len(gens) == 2
    for g, (prompt, _) in zip(gens, rows):
        assert "dropped" not in g.extra
        # the agent's own first prompt (the template's rendering of its messages), which the engine read
        assert tuple(g.extra["prompt_ids"]) in prompts and tok.decode(g.extra["prompt_ids"]).count(prompt) == 1
        ep = g.extra["episode"]
        assert ep.final_reward == 0.0 and not ep.failed  # the bigram model calls the calculator in both turns: no answer
        assert len(ep.model_turns) == 2 and ep.counts["tool_calls"] == 2.0 and ep.counts["agent_calls"] == 2.0
        assert ep.counts["agent_segments_left_out"] == 0.0
        assert ep.model_turns[0].text == CALL_HEAD + "12+39" + CALL_TAIL
        assert "<tool_response>\n51\n</tool_response>" in ep.turns[2].text and not ep.turns[2].own
        own = [t for t, m in zip(g.token_ids, g.own_mask) if m]
        assert len(own) == 16 and len(g.rollout_log_probs) == len(g.token_ids)
        assert all(lp == 0.0 for lp, m in zip(g.rollout_log_probs, g.own_mask) if not m)
    # every token the engine sampled is one own token of one episode, and nothing else is
    assert sampled == sorted(t for g in gens for t, m in zip(g.token_ids, g.own_mask) if m)


CRASH_ONE = """
import os, sys, openai
e = os.environ["ALIGNER_EPISODE_ID"]
if e.endswith("-1"):
    print("boom")
    sys.exit(3)
c = openai.OpenAI(default_headers={"X-Episode-Id": e}, max_retries=0)
c.chat.completions.create(model=os.environ["ALIGNER_MODEL"], messages=[{"role": "user", "content": os.environ["ALIGNER_PROMPT"]}])
c.post(f"/episodes/{e}/reward", body={"reward": 1.0}, cast_to=object)
"""


def test_crashing_agents_are_placeholders_and_too_many_carry_the_error(engine_tok, tmp_path):
    engine, tok = engine_tok
    script = tmp_path / "crash_one.py"
    script.write_text(CRASH_ONE)
    rows = [("1+1=", {"answer": "2"}), ("2+2=", {"answer": "4"})]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=16)
    cfg = _cfg(f"{sys.executable} {script}", "agent.max_dropped_frac=0.5")
    kept, dropped = generate_agent_episodes(engine, cfg, tok, [[1], [1]], sampling, None, rows)
    assert "dropped" not in kept.extra and kept.extra["episode"].final_reward == 1.0 and sum(kept.own_mask) > 0
    assert dropped.extra["dropped"] == "exited with code 3: boom" and "agent_error" not in dropped.extra
    assert dropped.own_mask == [False] and len(dropped.token_ids) == 1 and dropped.extra["episode"].failed
    cfg = _cfg(f"{sys.executable} {script}", "agent.max_dropped_frac=0.4")  # 1 of 2 is over 0.4
    gens = generate_agent_episodes(engine, cfg, tok, [[1], [1]], sampling, None, rows)
    assert all(g.extra["agent_error"].startswith("1 of 2 agent episodes were dropped, over agent.max_dropped_frac=0.4") for g in gens)
    assert all("dropped" in g.extra for g in gens)


def test_a_python_command_runs_with_the_runs_interpreter():
    assert agent_command("python examples/calculator_agent.py --x 'a b'") == [sys.executable, "examples/calculator_agent.py", "--x", "a b"]
    assert agent_command("/bin/echo hi") == ["/bin/echo", "hi"]
