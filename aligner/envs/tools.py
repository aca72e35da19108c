"""The tool registry: Python functions the model may call, each with a name, a description and a
JSON schema of its arguments (docs/environments.md).

A tool's arguments are one JSON object whose properties are the function's keyword arguments, so
its schema must have ``"type": "object"`` and property names that are Python identifiers. The
schema is checked when the tool is registered (:func:`make_tool`: the ``jsonschema`` package's
metaschema check, draft 2020-12 unless the schema names its own ``$schema``; ToolSchemaError on a bad
one) and every call's arguments are validated against it (:meth:`Tool.call`: ToolCallError, whose
message the model reads). :meth:`Tool.spec` is the OpenAI / Hugging Face function spec that chat
templates with tools render (``apply_chat_template(tools=...)``).

Built in: ``calculator`` (:func:`calculate`): + - * / and parentheses over integers and decimals,
evaluated exactly (fractions) from the expression's syntax tree, never by ``eval``.
A new tool registered here also needs its name in ``aligner.config.common.TOOL_NAMES`` (the config,
which sits below this package, checks ``env.tools`` against it; tests/config/test_validation.py asserts the two agree).
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

import jsonschema

from aligner.errors import ToolCallError, ToolSchemaError


@dataclass(frozen=True)
class Tool:
    """A callable tool. fn: called as ``fn(**arguments)``, returns the result as text (str() of
    anything else); it raises ToolCallError for a call the model got wrong (its message is what the
    model reads); any other exception is the tool's own failure (the episode fails, aligner.envs.base)."""

    name: str
    description: str
    parameters: dict  # the JSON schema of the arguments object
    fn: Callable[..., Any]

    def spec(self) -> dict:
        """The function spec chat templates render: ``{"type": "function", "function": {name, description, parameters}}``."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def call(self, arguments: Any) -> str:
        """Validate `arguments` (a dict) against the schema, run the tool, return its result as text.
        Raises ToolCallError naming the tool and the first schema violation, or the tool's own ToolCallError."""
        validate_arguments(self, arguments)
        return str(self.fn(**arguments))


def _validator_class(schema: dict):
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)


def check_schema(name: str, schema: Any) -> None:
    """Check tool `name`'s argument schema: a valid JSON schema (its metaschema), of type object, whose
    property names are Python identifiers. Raises ToolSchemaError (one line: the tool, what is wrong, the fix)."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise ToolSchemaError(
            f'tool {name!r}: its parameters schema must be a JSON object schema with "type": "object" (the arguments are keyword arguments), got {schema!r}'
        )
    try:
        _validator_class(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(map(str, e.absolute_path)) or "the top level"
        raise ToolSchemaError(f"tool {name!r}: its parameters schema is not a valid JSON schema at {where}: {e.message}") from None
    bad = [p for p in schema.get("properties", {}) if not str(p).isidentifier()]
    if bad:
        raise ToolSchemaError(
            f"tool {name!r}: property names {bad} are not Python identifiers: rename them (they become keyword arguments)"
        )


def validate_arguments(tool: Tool, arguments: Any) -> None:
    """Raise ToolCallError (one line, for the model) when `arguments` does not match `tool`'s schema."""
    if not isinstance(arguments, dict):
        raise ToolCallError(f"the arguments of {tool.name} must be a JSON object, got {type(arguments).__name__}")
    try:
        error = jsonschema.exceptions.best_match(_validator_class(tool.parameters)(tool.parameters).iter_errors(arguments))
    except RecursionError:  # arguments nested past the interpreter's stack
        raise ToolCallError(f"the arguments of {tool.name} are nested too deeply: give a flat JSON object") from None
    if error is not None:
        where = "/".join(map(str, error.absolute_path))
        raise ToolCallError(f"the arguments of {tool.name} do not match its schema{f' at {where}' if where else ''}: {error.message}")


def make_tool(name: str, description: str, parameters: dict, fn: Callable[..., Any]) -> Tool:
    """A :class:`Tool`, its schema checked (ToolSchemaError) and its name a non-empty identifier-like string (ValueError)."""
    if not name or not name.replace("-", "_").isidentifier():
        raise ValueError(f"tool name {name!r}: use letters, digits, _ and -")
    check_schema(name, parameters)
    return Tool(name=name, description=description, parameters=parameters, fn=fn)


TOOLS: dict[str, Tool] = {}  # name -> Tool; config.common.TOOL_NAMES lists the same names


def register_tool(tool: Tool) -> Tool:
    """Add `tool` to :data:`TOOLS` (ValueError when its name is taken); returns it."""
    if tool.name in TOOLS:
        raise ValueError(f"tool {tool.name!r} is registered twice: pick another name")
    TOOLS[tool.name] = tool
    return tool


def get_tool(name: str) -> Tool:
    """The registered tool `name`; ValueError listing the valid names otherwise."""
    if name not in TOOLS:
        raise ValueError(f"tool {name!r} is unknown: valid tools are {', '.join(TOOLS)}")
    return TOOLS[name]


MAX_EXPRESSION_CHARS = 200  # bounds the syntax tree's depth and every number's size
MAX_MAGNITUDE = Fraction(10) ** 30  # |value| of every intermediate result
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: integers and decimals, + - * /, unary minus, parentheses.

    Returns the value as text: an integer ("51"), else a decimal to 12 significant digits ("0.3",
    "0.333333333333"). Raises ToolCallError for anything else (names, calls, attributes, ``**``,
    other operators), a syntax error, division by zero, more than MAX_EXPRESSION_CHARS characters or
    an intermediate value beyond 1e30 in size. The expression is parsed with ``ast``; nothing is executed."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolCallError(f"the expression must be text of at most {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolCallError(f"{expression!r} is not an arithmetic expression") from None
    value = _evaluate(tree.body, expression)
    return str(value.numerator) if value.denominator == 1 else format(float(value), ".12g")


def _evaluate(node: ast.AST, expression: str) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ToolCallError(f"{expression!r}: the number {node.value!r} is not finite")
        value = Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value)  # 0.1 -> 1/10 exactly
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, expression), _evaluate(node.right, expression)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ToolCallError(f"{expression!r}: division by zero")
        value = _BINARY[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_evaluate(node.operand, expression))
    else:
        what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
        raise ToolCallError(f"{expression!r}: {what} is not allowed (only numbers, + - * /, and parentheses)")
    if abs(value) > MAX_MAGNITUDE:
        raise ToolCallError(f"{expression!r}: a value beyond 1e30 in size")
    return value


register_tool(
    make_tool(
        "calculator",
        "Evaluate an arithmetic expression: integers and decimals with + - * / and parentheses. Returns the value.",
        {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12 + 39) * 2"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
        calculate,
    )
)
