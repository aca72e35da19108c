"""The tool-calling environment (aligner.envs.tool_env).

Parsing the Hermes tags (well-formed, bad JSON, no name, unclosed, several calls in a turn), the
observation in the two formats (a template that defines tool calls gets ``tool`` messages, any
other the documented ``<tool_response>`` text in a user message), malformed calls answered with an
error the model reads and counted, and whole episodes on the built-in addition task.
"""

from __future__ import annotations

import json

import pytest

from aligner.envs import (
    TOOLS,
    EnvSpec,
    Message,
    ToolCall,
    ToolEnv,
    episode_metrics,
    get_tool,
    make_env,
    make_tool,
    parse_tool_calls,
    run_episode,
    template_defines_tool_calls,
    tool_instructions,
)
from aligner.reward.rules import get_rule
from tests.toolkit.smollm2 import smollm2_chat_template

# the tool part of Qwen2.5's chat template (its system text and its rendering of tool messages)
QWEN25_TEMPLATE_PART = (
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>" }}'
    "{%- elif message.role == \"tool\" %}{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
)


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def tool_env(template="", **kw):
    """The tool environment with the calculator, scored by the built-in task's rule (passed in: envs import no reward code)."""
    spec = EnvSpec(reward_fn=get_rule("task_accuracy"), tools=("calculator",), chat_template=template)
    return ToolEnv(spec, **kw) if kw else make_env("tool", spec)


def test_parse_a_well_formed_call_anywhere_in_the_turn():
    turn = 'Let me add.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+39"}}\n</tool_call>'
    assert parse_tool_calls(turn) == [ToolCall("calculator", {"expression": "12+39"})]
    # arguments given as a JSON string (OpenAI's style) are decoded
    assert parse_tool_calls('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>')[0].arguments == {
        "expression": "1"
    }
    assert parse_tool_calls("51") == [] and parse_tool_calls("a </tool_call> b") == []


@pytest.mark.parametrize(
    "turn,words",
    [
        ("<tool_call>{'name': 'calculator'}</tool_call>", "not JSON"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}</tool_call>', "not JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'needs a "name" string'),
        ('<tool_call>["calculator"]</tool_call>', 'needs a "name" string'),
        ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', '"arguments" of calculator must be a JSON object'),
        ('<tool_call>{"name": "calculator", "arguments": {}}', "without its </tool_call>"),
    ],
    ids=["single-quotes", "unbalanced", "no-name", "not-an-object", "arguments-list", "unclosed"],
)
def test_parse_malformed_calls(turn, words):
    (parsed,) = parse_tool_calls(turn)
    assert words in parsed.error and "<tool_call>" in parsed.error, parsed.error  # the error shows the format


def test_several_calls_in_one_turn_run_in_order_and_answer_in_order():
    env = tool_env()
    env.reset("12+39=", {})
    turn = call("calculator", expression="12+39") + " then " + call("calculator", expression="51*2")
    result = env.step(turn)
    assert not result.done and result.reward == 0.0
    (message,) = result.messages  # no tool format in the template: one user message, one response per call
    assert message == Message("user", "<tool_response>\n51\n</tool_response>\n<tool_response>\n102\n</tool_response>")
    assert result.info == {"tool_calls": 2, "tool_errors": 0}


def test_a_template_that_defines_tool_calls_gets_tool_messages():
    assert template_defines_tool_calls(QWEN25_TEMPLATE_PART)
    env = tool_env(QWEN25_TEMPLATE_PART)
    env.reset("p", {})
    result = env.step(call("calculator", expression="2+3") + call("calculator", expression="2*3"))
    assert [(m.role, m.content) for m in result.messages] == [("tool", "5"), ("tool", "6")]


@pytest.mark.slow  # reads the real model's GGUF (fetched from PyPI once, 93 MB)
def test_smollm2_template_defines_no_tool_format():
    """SmolLM2-135M-Instruct's template (from the PyPI wheel's GGUF) renders every role as <|im_start|>ROLE ...
    <|im_end|> and has no tool syntax."""
    template = smollm2_chat_template()
    assert "<|im_start|>" in template and "message['role']" in template
    assert not template_defines_tool_calls(template)


def test_malformed_calls_are_answered_with_errors_and_counted_never_raised():
    env = tool_env(max_calls_per_turn=3)
    env.reset("p", {})
    turn = (
        call("abacus", expression="1+1")  # unknown tool
        + call("calculator", expr="1+1")  # arguments failing the schema
        + call("calculator", expression="import os")  # the tool's own refusal
        + call("calculator", expression="1+1")  # past max_calls_per_turn
        + "<tool_call>{nope</tool_call>"  # not JSON (and also past the limit: its own error wins)
    )
    result = env.step(turn)
    responses = result.messages[0].content.split("</tool_response>")[:-1]
    assert len(responses) == 5 and all("error: " in r for r in responses), responses
    assert "unknown tool 'abacus': the tools are calculator" in responses[0]
    assert "'expression' is a required property" in responses[1]
    assert "is not an arithmetic expression" in responses[2]
    assert "at most 3 tool calls run per turn" in responses[3]
    assert "not JSON" in responses[4]
    assert result.info == {"tool_calls": 5, "tool_errors": 5} and not result.done


def test_a_good_call_beside_a_bad_one_still_runs():
    env = tool_env()
    env.reset("p", {})
    result = env.step("<tool_call>oops</tool_call>" + call("calculator", expression="40+2"))
    assert "error: the tool call is not JSON" in result.observation and "\n42\n" in result.observation
    assert result.info == {"tool_calls": 2, "tool_errors": 1}


def test_an_episode_on_the_addition_task_with_a_rule_as_final_reward():
    script = iter([call("calculator", expression="12+39"), "<tool_call>{bad", "51"])
    ep = run_episode(tool_env(), "12+39=", {}, lambda messages: next(script), max_turns=4, timeout_s=5)
    assert (ep.done, ep.failed, ep.final_reward) == (True, False, 1.0)
    assert [t.own for t in ep.turns] == [False, True, False, True, False, True]
    assert ep.turns[2].text == "<tool_response>\n51\n</tool_response>"
    assert "without its </tool_call>" in ep.turns[4].text
    m = episode_metrics([ep])
    assert (m["env/tool_calls"], m["env/tool_errors"], m["env/turns"], m["env/tool_call_rate"]) == (2, 1, 3, 1.0)


def test_cut_at_max_turns_scores_the_last_turn():
    ep = run_episode(tool_env(), "12+39=", {}, lambda messages: call("calculator", expression="12+39"), max_turns=2, timeout_s=5)
    assert (ep.done, ep.truncated, ep.final_reward) == (False, True, 0.0)
    assert len(ep.model_turns) == 2


def test_a_tool_that_crashes_fails_the_episode(monkeypatch):
    def broken(expression):
        raise ZeroDivisionError("bug in the tool")

    monkeypatch.setitem(TOOLS, "broken", make_tool("broken", "a buggy tool", get_tool("calculator").parameters, broken))
    env = make_env("tool", EnvSpec(reward_fn=lambda p, r, m: 1.0, tools=("broken",)))
    ep = run_episode(env, "p", {}, lambda messages: call("broken", expression="1"), max_turns=3, timeout_s=5)
    assert ep.failed and "step 1 raised ZeroDivisionError: bug in the tool" in ep.failure and ep.final_reward == 0.0


def test_the_tool_env_needs_known_tools():
    with pytest.raises(ValueError, match=r"needs at least one tool: e.g. env.tools=\[calculator\]"):
        ToolEnv(EnvSpec(reward_fn=lambda p, r, m: 0.0))
    with pytest.raises(ValueError, match="tool 'abacus' is unknown: valid tools are calculator"):
        make_env("tool", EnvSpec(reward_fn=lambda p, r, m: 0.0, tools=("abacus",)))


def test_tool_instructions_teach_the_format_and_list_the_specs():
    text = tool_instructions([get_tool("calculator")])
    assert json.dumps(get_tool("calculator").spec()) in text
    assert "<tool_call>" in text and "</tool_call>" in text and "<tool_response>" in text


@pytest.mark.parametrize("depth", [40, 100_000])
def test_deeply_nested_json_is_answered_with_an_error_never_raised(depth):
    """A call nested past MAX_CALL_DEPTH, or past the interpreter's stack (RecursionError in json),
    whether the call itself or its arguments string, comes back to the model as an error."""
    from aligner.envs.tool_env import MAX_CALL_DEPTH

    nested = "[" * depth + "]" * depth
    turns = [
        f'<tool_call>{{"name": "calculator", "arguments": {{"expression": {nested}}}}}</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": ' + json.dumps('{"expression": "1", "x": ' + nested + "}") + "}</tool_call>",
        "<tool_call>" + nested + "</tool_call>",
    ]
    for turn in turns:
        env = tool_env()
        env.reset("p", {})
        result = env.step(turn)
        (text,) = result.messages[0].content.split("</tool_response>")[:-1]
        assert "error: " in text and ("nested deeper than" in text or "RecursionError" in text), text
        assert result.info == {"tool_calls": 1, "tool_errors": 1} and not result.done
    assert MAX_CALL_DEPTH < 40


def test_deeply_nested_arguments_given_directly_to_a_tool_are_a_call_error():
    from aligner.errors import ToolCallError

    deep: dict = {}
    cur = deep
    for _ in range(50_000):
        cur["a"] = {}
        cur = cur["a"]
    schema = {"type": "object", "properties": {"a": {"$ref": "#"}}}
    tool = make_tool("deep", "d", schema, lambda **kw: "ok")
    with pytest.raises(ToolCallError, match="nested too deeply"):
        tool.call(deep)
