"""The tiny_tools demo's data: the SFT tool conversations are what the tool
environment would produce, they fit the preset's lengths without unknown tokens, and the preset
composes into a PPO run that plays tool episodes with the exact-sum reward."""

from __future__ import annotations

import pytest

from aligner.cli import load_config
from aligner.config import TaskConfig
from aligner.data.task import build_task_tokenizer, sft_records, tool_call_text, tool_demo, tool_response_text
from aligner.data.tokenizer import load_tokenizer
from aligner.envs import EnvSpec, Message, make_env
from aligner.reward.rules import get_rule


def test_the_demonstrated_tool_response_is_the_tool_environments():
    env = make_env("tool", EnvSpec(reward_fn=get_rule("task_accuracy"), tools=("calculator",)))
    env.reset("57+68=", {})
    result = env.step(tool_call_text(57, 68))
    assert result.messages == (Message("user", tool_response_text(57, 68)),) and not result.done
    assert result.info == {"tool_calls": 1, "tool_errors": 0}
    assert env.step("125").done and env.finish() == 1.0


def test_tool_demonstrations_are_a_fraction_of_the_sft_rows_and_always_right():
    cfg = TaskConfig(tool_demo_rate=0.25, num_sft=4000)
    rows = sft_records(cfg)
    tools = [r for r in rows if r["tool"]]
    assert all("messages" in r for r in rows)  # one format for the whole file
    assert 0.22 < len(tools) / len(rows) < 0.28 and all(r["correct"] for r in tools)
    assert sum(not r["correct"] for r in rows) > 0  # the direct answers keep their carry errors
    # without tool demonstrations the task's rows are unchanged (the tiny preset's data)
    plain = sft_records(TaskConfig(num_sft=4000))
    assert all(set(r) == {"prompt", "response", "correct"} for r in plain)
    assert [r["correct"] for r in plain] == [r["correct"] for r in sft_records(TaskConfig(num_sft=4000, tool_demo_rate=0.0))]


def test_tool_conversations_fit_the_presets_lengths_without_unknown_tokens(tmp_path):
    cfg = load_config("sft", ["conf=tiny_tools"])
    tok = load_tokenizer(build_task_tokenizer(cfg.task, str(tmp_path)))
    assert len(tok) <= cfg.model.vocab_size
    convo = tool_demo(99, 99)["messages"]
    ids = tok.encode(tok.apply_chat_template(convo, tokenize=False), add_special_tokens=False)
    prompt = tok.encode(tok.apply_chat_template(convo[:1], tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    assert tok.unk_token_id not in ids
    assert len(ids) <= cfg.data.max_seq_len and len(prompt) <= cfg.data.max_prompt_len
    ppo = load_config("ppo", ["conf=tiny_tools"])
    assert len(prompt) + ppo.rollout.sampling.max_new_tokens <= ppo.model.max_seq_len
    assert len(ids) - len(prompt) <= ppo.rollout.sampling.max_new_tokens  # a whole episode fits the budget


@pytest.mark.parametrize("stage", ["sft", "ppo"])
def test_the_tiny_tools_preset(stage):
    cfg = load_config(stage, ["conf=tiny_tools"])
    assert cfg.task.tool_demo_rate == 0.25 and cfg.data.apply_chat_template
    if stage == "ppo":
        assert (cfg.env.name, cfg.env.tools, cfg.reward.type, cfg.reward.rule) == ("tool", ["calculator"], "rule", "task_accuracy")
        assert cfg.algorithm.advantage == "grpo" and cfg.roles_used() == ("actor", "ref")
