"""The tool registry and the calculator (aligner.envs.tools).

The calculator gets arithmetic right exactly and refuses everything that is not arithmetic
(names, attributes, calls, powers, huge values) without evaluating it; a tool's JSON schema is
checked when it is made and every call's arguments are validated against it.
"""

from __future__ import annotations

import builtins
import time

import pytest

from aligner.envs import TOOLS, calculate, get_tool, make_tool, register_tool
from aligner.errors import ToolCallError, ToolSchemaError


@pytest.mark.parametrize(
    "expression,value",
    [
        ("12+39", "51"),
        ("(12 + 39) * 2", "102"),
        ("7/2", "3.5"),
        ("0.1 + 0.2", "0.3"),  # exact: no binary floating-point residue
        ("-3 - -4", "1"),
        ("1/3", "0.333333333333"),
        ("2*(3+4)/7", "2"),
        ("99999999*99999999", "9999999800000001"),  # beyond float's exact integers
        ("1.5e3 + 1", "1501"),
        ("+(8)", "8"),
    ],
)
def test_calculator_right_answers(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression,words",
    [
        ("__import__('os').system('echo pwned')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("2**10", "Pow is not allowed"),
        ("9**9**9**9", "Pow is not allowed"),
        ("7 // 2", "FloorDiv is not allowed"),
        ("7 % 2", "Mod is not allowed"),
        ("'a' + 'b'", "Constant is not allowed"),
        ("True + 1", "Constant is not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("1 if 1 else 2", "IfExp is not allowed"),
        ("1e400", "is not finite"),
        ("1/0", "division by zero"),
        ("(2-2)/(3-3)", "division by zero"),
        ("1000000*" * 6 + "1000000", "beyond 1e30"),
        ("1 +", "is not an arithmetic expression"),
        ("1" * 201, "at most 200 characters"),
    ],
)
def test_calculator_refuses_what_is_not_arithmetic(expression, words, monkeypatch):
    def no_eval(*args, **kwargs):
        raise AssertionError("the calculator called eval/exec")

    monkeypatch.setattr(builtins, "eval", no_eval)
    monkeypatch.setattr(builtins, "exec", no_eval)
    start = time.monotonic()
    with pytest.raises(ToolCallError) as e:
        calculate(expression)
    assert time.monotonic() - start < 1.0  # refused from the syntax tree, never computed
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}}, "required": ["city"]}


@pytest.mark.parametrize(
    "schema,words",
    [
        ({"type": "object", "properties": {"x": {"type": "strin"}}}, "not a valid JSON schema at properties/x/type"),
        ({"type": "object", "required": "city"}, "not a valid JSON schema at required"),
        ({"type": "object", "properties": {"x": {"minimum": "one"}}}, "not a valid JSON schema at properties/x/minimum"),
        ({"type": "array", "items": {"type": "number"}}, '"type": "object"'),
        ({"properties": {"city": {"type": "string"}}}, '"type": "object"'),
        ({"type": "object", "properties": {"not-ident": {"type": "string"}}}, "not Python identifiers"),
    ],
    ids=["unknown-type", "required-not-a-list", "minimum-not-a-number", "array", "no-type", "property-name"],
)
def test_a_bad_schema_is_refused_when_the_tool_is_made(schema, words):
    with pytest.raises(ToolSchemaError) as e:
        make_tool("weather", "the forecast", schema, lambda **kw: "sunny")
    assert str(e.value).startswith("tool 'weather': ") and words in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "arguments,words",
    [
        ({}, "'city' is a required property"),
        ({"city": 3}, "at city: 3 is not of type 'string'"),
        ({"city": "Oslo", "days": 0}, "at days: 0 is less than the minimum of 1"),
        (["Oslo"], "must be a JSON object, got list"),
    ],
)
def test_arguments_failing_the_schema_are_refused_at_the_call(arguments, words):
    calls = []
    tool = make_tool("weather", "the forecast", SCHEMA, lambda city, days=1: calls.append((city, days)) or f"{city}: sunny")
    with pytest.raises(ToolCallError) as e:
        tool.call(arguments)
    assert "weather" in str(e.value) and words in str(e.value), str(e.value)
    assert calls == []  # never ran
    assert tool.call({"city": "Oslo", "days": 2}) == "Oslo: sunny" and calls == [("Oslo", 2)]


def test_the_calculator_tool_validates_then_computes():
    calc = get_tool("calculator")
    assert calc.call({"expression": "12+39"}) == "51"
    for bad, words in [
        ({}, "required"),
        ({"expression": 5}, "not of type 'string'"),
        ({"expression": "1", "x": 1}, "Additional properties"),
    ]:
        with pytest.raises(ToolCallError, match=words):
            calc.call(bad)
    assert calc.spec()["function"]["name"] == "calculator" and calc.spec()["function"]["parameters"]["required"] == ["expression"]


def test_registry_refuses_unknown_and_duplicate_names():
    with pytest.raises(ValueError, match="tool 'abacus' is unknown: valid tools are calculator"):
        get_tool("abacus")
    with pytest.raises(ValueError, match="registered twice"):
        register_tool(make_tool("calculator", "again", {"type": "object"}, calculate))
    assert list(TOOLS) == ["calculator"]
    with pytest.raises(ValueError, match="use letters"):
        make_tool("two words", "x", {"type": "object"}, calculate)
