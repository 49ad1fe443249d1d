"""The three demo tools the bundled model knows, executed locally: `calculator`, `get_weather`
and `read_file` (their OpenAI definitions are `DEMO_TOOLS`; tools/muse_chat_data.py trains the
model on the same schemas and result formats).

    run_tool("calculator", '{"expression": "4817 * 23"}', root)   -> "110791"
    run_tool("get_weather", '{"city": "Porto"}', root)             -> '{"city": "Porto", "temperature_c": ..., ...}'
    run_tool("read_file", '{"path": "notes/todo.txt"}', root)      -> the file's text

`run_tool` never raises for a bad call: the model's mistakes (an unknown tool, arguments that
are not a JSON object, a bad expression, a path outside `root`) come back as one
`error: ...` line, which is what a tool result should tell the model. Standard library only.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import operator
import os
from pathlib import Path
from typing import Any

# Limits: an expression is short and its numbers stay printable; a file result stays small.
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 1000  # |b| in a ** b
MAX_MAGNITUDE_DIGITS = 100  # |any intermediate value| < 10**100
MAX_FILE_BYTES = 16 * 1024

WEATHER_CONDITIONS = (
    "clear",
    "sunny",
    "cloudy",
    "partly cloudy",
    "overcast",
    "light rain",
    "rain",
    "snow",
    "windy",
    "foggy",
    "thunderstorms",
    "drizzle",
)

DEMO_TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    "calculator": {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 5"}},
                "required": ["expression"],
            },
        },
    },
    "read_file": {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file and return its contents.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "Path of the file"}},
                "required": ["path"],
            },
        },
    },
}


class ToolError(ValueError):
    """A tool call that cannot run; the message is what the model is told (after `error: `)."""


# -- calculator ------------------------------------------------------------------------------

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_SYMBOL = {ast.FloorDiv: "//", ast.Mod: "%", ast.MatMult: "@", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^"}


def _check_size(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("the result is too large")
    if abs(value) >= 10**MAX_MAGNITUDE_DIGITS:
        raise ToolError(f"the result is too large (at least 10**{MAX_MAGNITUDE_DIGITS})")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError(f"the exponent {exponent} is too large (at most {MAX_EXPONENT})")
    # Refuse before computing: |base| ** exponent must stay below 10**MAX_MAGNITUDE_DIGITS.
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) >= MAX_MAGNITUDE_DIGITS:
        raise ToolError(f"the result is too large (at least 10**{MAX_MAGNITUDE_DIGITS})")
    if base == 0 and exponent < 0:
        raise ToolError("division by zero")
    result = base**exponent
    if isinstance(result, complex):
        raise ToolError("a negative number to a fractional power has no real value")
    return result


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        if isinstance(node.op, ast.Div) and right == 0:
            raise ToolError("division by zero")
        return _check_size(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp):
        raise ToolError(f"the operator {_SYMBOL.get(type(node.op), type(node.op).__name__)} is not supported")
    what = {ast.Name: "a name", ast.Call: "a function call", ast.Constant: "a non-number literal"}.get(
        type(node), type(node).__name__
    )
    raise ToolError(f"{what} is not allowed; use numbers, + - * / ** and parentheses")


def format_number(value: int | float) -> str:
    """An integer as its digits; a float with at most 10 significant digits, an integral float
    as an integer ("7.5", "3", "0.3333333333")."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer():
        return str(int(value))
    return f"{value:.10g}"


def calculator(expression: str) -> str:
    """Evaluate arithmetic (numbers, + - * / **, parentheses, unary minus) by walking its
    syntax tree; anything else, or a too large result, is a `ToolError`."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("expression must be a non-empty string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"the expression is {len(expression)} characters long (at most {MAX_EXPRESSION_CHARS})")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        raise ToolError(f"{expression!r} is not an arithmetic expression") from None
    try:
        return format_number(_evaluate(tree))
    except (OverflowError, RecursionError):
        raise ToolError("the result is too large") from None


# -- get_weather -------------------------------------------------------------------------------


def weather_result(city: str, temperature: int, unit: str, conditions: str) -> str:
    """The get_weather result text (JSON) for these values: what the demo tool returns and what
    the training data's tool results look like."""
    key = "temperature_f" if unit == "fahrenheit" else "temperature_c"
    return json.dumps({"city": city, key: temperature, "conditions": conditions})


def get_weather(city: str, unit: str = "celsius") -> str:
    """Fake weather, the same for a city name every time (seeded by the name, case and
    surrounding spaces ignored): -10..35 C, or that converted to F."""
    if not isinstance(city, str) or not city.strip():
        raise ToolError("city must be a non-empty string")
    if unit not in ("celsius", "fahrenheit"):
        raise ToolError(f"unit must be 'celsius' or 'fahrenheit', got {unit!r}")
    digest = hashlib.sha256(city.strip().lower().encode("utf-8")).digest()
    celsius = digest[0] % 46 - 10
    conditions = WEATHER_CONDITIONS[digest[1] % len(WEATHER_CONDITIONS)]
    temperature = round(celsius * 9 / 5 + 32) if unit == "fahrenheit" else celsius
    return weather_result(city.strip(), temperature, unit, conditions)


# -- read_file -----------------------------------------------------------------------------------


def read_file(path: str, root: str | os.PathLike[str], max_bytes: int = MAX_FILE_BYTES) -> str:
    """The text of the file at `path`, relative to `root`. Refused: absolute and home paths,
    any path (`..` or a symlink on the way) that resolves outside `root`, files over
    `max_bytes`, non-UTF-8 files."""
    if not isinstance(path, str) or not path.strip():
        raise ToolError("path must be a non-empty string")
    if "\x00" in path:
        raise ToolError("path contains a NUL character")
    if os.path.isabs(path) or path.startswith("~"):
        raise ToolError(f"{path}: only paths relative to the tool directory are allowed")
    base = Path(os.path.realpath(root))
    target = Path(os.path.realpath(base / path))  # every symlink and `..` resolved
    if target != base and base not in target.parents:
        raise ToolError(f"{path}: outside the tool directory")
    if not target.exists():
        raise ToolError(f"{path}: no such file")
    if not target.is_file():
        raise ToolError(f"{path}: not a regular file")
    # Open the resolved path without following a link swapped in since, then check the size
    # of what was opened (not of what the name pointed to before).
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(target, flags)
    except OSError as exc:
        raise ToolError(f"{path}: {exc.strerror or 'cannot open'}") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise ToolError(f"{path}: the file is {size} bytes (at most {max_bytes})")
        data = f.read(max_bytes + 1)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"{path}: not a UTF-8 text file") from None


# -- dispatch ------------------------------------------------------------------------------------


def run_tool(name: str, arguments: str | dict[str, Any], root: str | os.PathLike[str]) -> str:
    """Run one call of a demo tool; `arguments` as the tool-call parser gives them (a JSON
    object's text) or already parsed. Every failure is returned as `error: ...`, never raised."""
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
        if not isinstance(args, dict):
            raise ToolError("the arguments must be a JSON object")
        params = DEMO_TOOLS[name]["function"]["parameters"] if name in DEMO_TOOLS else None
        if params is None:
            raise ToolError(f"unknown tool {name!r}; the demo tools are {', '.join(DEMO_TOOLS)}")
        unknown = sorted(set(args) - set(params["properties"]))
        if unknown:
            raise ToolError(f"{name} takes no argument {unknown[0]!r}")
        missing = [k for k in params["required"] if k not in args]
        if missing:
            raise ToolError(f"{name} needs the argument {missing[0]!r}")
        if name == "calculator":
            return calculator(args["expression"])
        if name == "get_weather":
            return get_weather(args["city"], args.get("unit", "celsius"))
        return read_file(args["path"], root)
    except json.JSONDecodeError as exc:
        return f"error: the arguments are not valid JSON ({exc.msg})"
    except ToolError as exc:
        return f"error: {exc}"
