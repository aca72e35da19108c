"""The tool-calling environment (``env.name=tool``, docs/environments.md): the model calls tools in its
turns, each call's result comes back as the next message, and a turn without a tool call is the
final answer.

The tool-call format is Hermes' (the one Qwen2.5's chat template defines and Hugging Face's
tool-use guide uses): a call is a JSON object between tags, anywhere in the model's turn,

    <tool_call>{"name": "calculator", "arguments": {"expression": "12+39"}}</tool_call>

with ``arguments`` a JSON object (a string holding one is accepted too). Several calls in one turn
run in order, at most ``max_calls_per_turn`` (the rest answer with an error), and their results come
back in the same order. How a result comes back depends on the tokenizer's chat template:

- a template that defines tool calls (it contains ``<tool_call>``, as Qwen2.5's and Hermes' do):
  one message of role ``tool`` per call, holding the result; the template renders them (Qwen2.5
  wraps each in ``<tool_response>`` inside a user turn);
- any other template (SmolLM2-135M-Instruct's renders every role as ``<|im_start|>ROLE ...<|im_end|>``
  and defines no tool format; Llama 3.1's JSON calls and Mistral's ``[TOOL_CALLS]`` are not parsed
  here): the same tags, documented to the model by :func:`tool_instructions` (for the system
  message), and one ``user`` message holding ``<tool_response>\\nRESULT\\n</tool_response>`` per call.

A call that cannot run (not JSON, no name, an unknown or disabled tool, arguments failing the
schema, a ToolCallError of the tool) gets ``error: ...`` as its result, which the model reads, and is
counted in ``tool_errors``; it never ends the episode. A tool that raises anything else fails the
episode (aligner.envs.base.run_episode). Rewards: 0.0 per turn; the final reward is the reward
function on the last model turn's text (the answer, or the last call when cut at max_turns).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from aligner.envs.base import Environment, EnvSpec, Message, StepResult, register_env
from aligner.envs.tools import Tool, get_tool
from aligner.errors import ToolCallError

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)
_FIX = f'write {TOOL_CALL_OPEN}{{"name": TOOL, "arguments": {{...}}}}{TOOL_CALL_CLOSE}'


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. error: "" for a well-formed call, else what is wrong with it (for the model)."""

    name: str
    arguments: dict = field(default_factory=dict)
    error: str = ""


def parse_tool_calls(turn: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` of `turn`, in order, malformed ones with their ``error``;
    an opening tag left unclosed adds one malformed call. [] when the turn calls no tool."""
    calls = [_parse_call(m.group(1)) for m in _CALL.finditer(turn)]
    if TOOL_CALL_OPEN in _CALL.sub("", turn):
        calls.append(ToolCall("", error=f"a {TOOL_CALL_OPEN} without its {TOOL_CALL_CLOSE}: {_FIX}"))
    return calls


MAX_CALL_DEPTH = 32  # nesting of a call's JSON (objects and arrays) accepted; deeper is answered with an error


def _json(text: str) -> tuple[Any, str]:
    """(the JSON value of `text`, "") or (None, what is wrong, for the model): any failure of the parser
    (bad JSON, a number or nesting the parser refuses, RecursionError on deep nesting) and nesting deeper
    than MAX_CALL_DEPTH, so that the schema check and the tool never walk an unbounded structure."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg}, char {e.pos})"
    except (ValueError, RecursionError) as e:  # e.g. an integer of too many digits, nesting past the interpreter's stack
        return None, f"not JSON this parser accepts ({type(e).__name__})"
    depth, stack = 0, [(obj, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            depth = max(depth, d)
            if depth > MAX_CALL_DEPTH:
                return None, f"nested deeper than {MAX_CALL_DEPTH} levels"
            stack.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
    return obj, ""


def _parse_call(body: str) -> ToolCall:
    obj, problem = _json(body)
    if problem:
        return ToolCall("", error=f"the tool call is {problem}: {_FIX}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", error=f'the tool call needs a "name" string: {_FIX}')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        parsed, problem = _json(arguments)
        if not problem:
            arguments = parsed
        elif not problem.startswith("not JSON ("):  # a string that is JSON, but one refused: say so
            return ToolCall(obj["name"], error=f'the "arguments" of {obj["name"]} are {problem}: {_FIX}')
    if not isinstance(arguments, dict):
        return ToolCall(obj["name"], error=f'the "arguments" of {obj["name"]} must be a JSON object: {_FIX}')
    return ToolCall(obj["name"], arguments)


def template_defines_tool_calls(chat_template: str) -> bool:
    """True when the chat template defines the Hermes tool-call format (it contains ``<tool_call>``)."""
    return TOOL_CALL_OPEN in (chat_template or "")


def tool_instructions(tools: Sequence[Tool]) -> str:
    """System-message text that teaches the tag format and lists `tools` (their JSON specs), for a chat
    template that defines no tool format (Hermes' wording, shortened)."""
    specs = "\n".join(json.dumps(t.spec()) for t in tools)
    return (
        "You may call functions to help with the request. Their signatures, as JSON:\n"
        f"<tools>\n{specs}\n</tools>\n"
        f'To call one, write {TOOL_CALL_OPEN}{{"name": <function-name>, "arguments": <args-json-object>}}{TOOL_CALL_CLOSE}; '
        f"its result comes back as {TOOL_RESPONSE_OPEN}...{TOOL_RESPONSE_CLOSE}. Give your final answer without a tool call."
    )


@register_env("tool")
class ToolEnv(Environment):
    """Tool calling: each model turn's calls are run and answered; a turn without a call ends the episode.

    Built from an :class:`EnvSpec` with at least one tool (ValueError otherwise, or for an unknown tool).
    max_calls_per_turn: the calls run per turn (the rest are answered with an error). Step info:
    ``tool_calls`` (calls made, malformed included), ``tool_errors`` (calls answered with an error)."""

    def __init__(self, spec: EnvSpec, max_calls_per_turn: int = 4) -> None:
        if not spec.tools:
            raise ValueError("env.name=tool needs at least one tool: e.g. env.tools=[calculator]")
        self.tools = {name: get_tool(name) for name in spec.tools}
        self.reward_fn = spec.reward_fn
        self.tool_messages = template_defines_tool_calls(spec.chat_template)
        self.max_calls_per_turn = max_calls_per_turn

    def reset(self, prompt: str, metadata: dict) -> Sequence[Message]:
        self.prompt, self.metadata, self.last_turn = prompt, metadata, ""
        return ()

    def step(self, turn: str) -> StepResult:
        self.last_turn = turn
        calls = parse_tool_calls(turn)
        if not calls:
            return StepResult(done=True)
        results = [self._run(call, i) for i, call in enumerate(calls)]
        errors = sum(not ok for ok, _ in results)
        return StepResult(messages=self._observation([text for _, text in results]), info={"tool_calls": len(calls), "tool_errors": errors})

    def finish(self) -> float:
        return float(self.reward_fn(self.prompt, self.last_turn, self.metadata))

    def _run(self, call: ToolCall, index: int) -> tuple[bool, str]:
        """(ran, result text) of one call; errors the model made come back as ``error: ...``."""
        if call.error:
            return False, f"error: {call.error}"
        if index >= self.max_calls_per_turn:
            return False, f"error: at most {self.max_calls_per_turn} tool calls run per turn; this one did not"
        if call.name not in self.tools:
            return False, f"error: unknown tool {call.name!r}: the tools are {', '.join(self.tools)}"
        try:
            return True, self.tools[call.name].call(call.arguments)
        except ToolCallError as e:
            return False, f"error: {e}"

    def _observation(self, results: list[str]) -> tuple[Message, ...]:
        if self.tool_messages:
            return tuple(Message("tool", r) for r in results)
        return (Message("user", "\n".join(f"{TOOL_RESPONSE_OPEN}\n{r}\n{TOOL_RESPONSE_CLOSE}" for r in results)),)
