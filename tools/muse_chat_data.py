"""Seeded synthetic conversations in the Muse chat wire format (docs/muse_chat.md §1-§3), for
fine-tuning the bundled tiny model (`tools/finetune_muse.py`).

A `Conversation` is what a client sends (OpenAI-style `messages` + `tools`, and the chat
template kwargs `current_date` / `reasoning_strength`) plus `target`: the assistant's raw
output, i.e. the text that follows the rendered generation prompt (`...<|start|>assistant`),
through the final `<|eot|>`:

    tool call    ` to=self<|message|>R<|eom|><|start|>assistant to=NAME<|message|><atem:...><|eot|>`
    answer       ` to=self<|message|>R<|eom|><|start|>assistant to=user<|message|>A<|eot|>`

Kinds: "tool_call" (the user needs an offered tool), "tool_result" (the history ends with the
tool's result; the answer uses it), "plain" (greetings, small questions, "what can you do"),
"no_tool" (the user needs a tool that is not offered: say so). Some conversations have an
earlier history (plain turns or a whole tool round trip) and some a client system message.
User phrasings, entities, tool subsets and results vary; the assistant side is predictable: one
reasoning sentence per (tool, reasoning strength), naming the intent but not the entity, and
one answer pattern per tool that copies the result (a first version with several look-alike
templates per case trapped greedy decoding in the wrong branch).

Entities (cities, file paths) are split by a hash of the value: `held_out(value)` ones never
appear in training conversations (`example(seed, i)`); `tool_tasks(seed, n)` draws held-out
evaluation tasks, half with seen and half with unseen entities. Everything is a pure function
of (seed, index): `random.Random(f"{seed}:{index}:...")` (str seeds hash with SHA-512, so the
same on every run and platform).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

from musespark.apps.demo_tools import DEMO_TOOLS

START, MESSAGE, EOM, EOT = "<|start|>", "<|message|>", "<|eom|>", "<|eot|>"
MUSE_SPECIAL_TOKENS = [START, MESSAGE, EOM, EOT]

# The demo tools' definitions: the model is trained on the schemas `generate --run-tools` offers.
TOOLS: dict[str, dict[str, Any]] = DEMO_TOOLS
TOOL_NAMES = list(TOOLS)
STRENGTHS = ["low", "medium", "high"]
HOLD_OUT_PERCENT = 20

CITIES = [
    "Paris",
    "London",
    "Tokyo",
    "Berlin",
    "Madrid",
    "Rome",
    "Lisbon",
    "Vienna",
    "Prague",
    "Warsaw",
    "Oslo",
    "Stockholm",
    "Helsinki",
    "Copenhagen",
    "Dublin",
    "Amsterdam",
    "Brussels",
    "Zurich",
    "Geneva",
    "Athens",
    "Istanbul",
    "Cairo",
    "Nairobi",
    "Lagos",
    "Cape Town",
    "Dubai",
    "Mumbai",
    "Delhi",
    "Bangkok",
    "Singapore",
    "Jakarta",
    "Manila",
    "Seoul",
    "Beijing",
    "Shanghai",
    "Hong Kong",
    "Sydney",
    "Melbourne",
    "Auckland",
    "Toronto",
    "Vancouver",
    "Montreal",
    "Chicago",
    "Boston",
    "Seattle",
    "Denver",
    "Austin",
    "Miami",
    "New York",
    "Los Angeles",
    "San Francisco",
    "Mexico City",
    "Lima",
    "Bogota",
    "Santiago",
    "Buenos Aires",
    "Sao Paulo",
    "Havana",
    "Reykjavik",
    "Budapest",
    "Krakow",
    "Munich",
    "Hamburg",
    "Milan",
    "Naples",
    "Barcelona",
    "Seville",
    "Porto",
    "Edinburgh",
    "Glasgow",
    "Marseille",
    "Lyon",
    "Kyoto",
    "Osaka",
    "Hanoi",
    "Kathmandu",
    "Tunis",
    "Casablanca",
    "Accra",
    "Addis Ababa",
    "Perth",
    "Calgary",
    "Phoenix",
    "Atlanta",
    "Portland",
    "Quito",
    "Montevideo",
    "Tallinn",
    "Riga",
    "Vilnius",
    "Sofia",
    "Bucharest",
    "Belgrade",
    "Zagreb",
]
DIRS = [
    "",
    "",
    "./",
    "src/",
    "docs/",
    "config/",
    "/etc/",
    "/tmp/",
    "~/",
    "data/",
    "notes/",
    "app/",
    "scripts/",
    "/var/log/",
    "home/user/",
    "projects/demo/",
    "build/",
    "tests/",
]
FILES = [
    "notes.txt",
    "todo.md",
    "README.md",
    "main.py",
    "config.yaml",
    "settings.json",
    "hosts",
    "data.csv",
    "app.log",
    "requirements.txt",
    "setup.cfg",
    "report.txt",
    "index.html",
    "Makefile",
    "schema.sql",
    "utils.py",
    "server.conf",
    "CHANGELOG.md",
    "poem.txt",
    "list.txt",
    "version.txt",
    "greeting.txt",
    "env.sh",
    "users.csv",
    "errors.log",
    "plan.md",
    "recipe.txt",
]
CONDITIONS = [
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
    "humid",
    "hazy",
]
FILE_LINES = [
    "buy milk",
    "call Anna at 5",
    "host=localhost",
    "port=8080",
    "debug=true",
    "version 1.4.2",
    "print('hello')",
    "import os",
    "name,age",
    "alice,31",
    "bob,27",
    "TODO: fix the login bug",
    "Hello, world!",
    "ERROR disk full",
    "INFO server started",
    "SELECT * FROM users;",
    "timeout: 30",
    "retries: 3",
    "- write the report",
    "- review the PR",
    "flour 200g",
    "sugar 50g",
    "The quick brown fox",
    "jumps over the lazy dog",
    "export PATH=$HOME/bin:$PATH",
    '{"debug": false}',
    "pytest>=8",
    "numpy==1.26",
    "meeting on Monday",
    "roses are red",
    "user=admin",
    "level=warning",
]

GREETINGS = [
    ("Hi", "Hello! How can I help you today?"),
    ("Hello!", "Hi there! What can I do for you?"),
    ("hey", "Hey! How can I help?"),
    ("Good morning", "Good morning! How can I help you today?"),
    ("Hi there, how are you?", "I'm doing well, thanks for asking. How can I help you?"),
    ("Thanks!", "You're welcome!"),
    ("Thank you so much", "You're welcome! Let me know if you need anything else."),
    ("Bye", "Goodbye! Have a great day."),
    ("Who are you?", "I'm a helpful AI assistant."),
    ("Are you a robot?", "I'm an AI assistant, here to help with your questions."),
]
FACTS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What is the capital of Spain?", "The capital of Spain is Madrid."),
    ("What color is the sky?", "On a clear day the sky is blue."),
    ("How many days are in a week?", "A week has 7 days."),
    ("How many legs does a spider have?", "A spider has 8 legs."),
    ("Who wrote Hamlet?", "Hamlet was written by William Shakespeare."),
    ("What language is this library written in?", "It is written in Python."),
    ("What is Python?", "Python is a popular high-level programming language."),
    ("What does CPU stand for?", "CPU stands for central processing unit."),
    ("What is the boiling point of water?", "Water boils at 100 degrees Celsius at sea level."),
    ("Name a primary color.", "Red is a primary color."),
    ("What is the largest planet?", "Jupiter is the largest planet in the solar system."),
    ("How many hours are in a day?", "A day has 24 hours."),
    ("Tell me a joke.", "Why do programmers prefer dark mode? Because light attracts bugs."),
    ("Give me a synonym for happy.", "A synonym for happy is cheerful."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("Translate 'hello' to Spanish.", "'Hello' in Spanish is 'hola'."),
    ("What month comes after March?", "April comes after March."),
]
SYSTEM_PROMPTS = [
    "Be terse.",
    "You are a helpful assistant.",
    "Answer briefly and politely.",
    "You are a friendly assistant for a small company.",
    "Keep answers short.",
    "You help users with weather, math and files.",
]
DATE_START = 20089  # days since 1970-01-01 = 2025-01-01


def held_out(value: str) -> bool:
    """A fixed ~20% of entity values that training conversations never use."""
    h = int.from_bytes(hashlib.sha256(value.encode("utf-8")).digest()[:8], "big")
    return h % 100 < HOLD_OUT_PERCENT


ALL_PATHS = sorted({d + f for d in DIRS for f in FILES})
SEEN_CITIES = [c for c in CITIES if not held_out(c)]
UNSEEN_CITIES = [c for c in CITIES if held_out(c)]
SEEN_PATHS = [p for p in ALL_PATHS if not held_out(p)]
UNSEEN_PATHS = [p for p in ALL_PATHS if held_out(p)]


@dataclass
class Conversation:
    kind: str  # tool_call | tool_result | plain | no_tool
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any]  # chat template kwargs (current_date, reasoning_strength)
    target: str  # raw assistant output after the generation prompt, through <|eot|>
    expected: dict[str, Any] = field(default_factory=dict)  # tool_call: name, arguments; tool_result: value
    unseen: bool = False  # uses a held-out entity

    def template_kwargs(self) -> dict[str, Any]:
        return {**self.kwargs, "tools": self.tools, "add_generation_prompt": True}


# -- pieces ------------------------------------------------------------------------------


def atem(name: str, arguments: dict[str, Any]) -> str:
    """docs/muse_chat.md §2.1 ATEM rendering (string values only here)."""
    params = "".join(f'<atem:parameter name="{k}">{v}</atem:parameter>\n' for k, v in arguments.items())
    return f'<atem:function_calls>\n<atem:invoke name="{name}">\n{params}</atem:invoke>\n</atem:function_calls>'


def call_output(reasoning: str, name: str, arguments: dict[str, Any]) -> str:
    return f" to=self{MESSAGE}{reasoning}{EOM}{START}assistant to={name}{MESSAGE}{atem(name, arguments)}{EOT}"


def answer_output(reasoning: str, answer: str) -> str:
    return f" to=self{MESSAGE}{reasoning}{EOM}{START}assistant to=user{MESSAGE}{answer}{EOT}"


def _date(rng: random.Random) -> str:
    import datetime

    return (datetime.date(1970, 1, 1) + datetime.timedelta(days=DATE_START + rng.randrange(0, 730))).isoformat()


def _expression(rng: random.Random) -> str:
    def num() -> str:
        r = rng.random()
        if r < 0.45:
            return str(rng.randint(2, 99))
        if r < 0.85:
            return str(rng.randint(100, 9999))
        return f"{rng.randint(1, 99)}.{rng.randint(1, 9)}"

    ops = ["+", "-", "*", "/"]
    sp = rng.random() < 0.75
    j = (lambda a, o, b: f"{a} {o} {b}") if sp else (lambda a, o, b: f"{a}{o}{b}")
    shape = rng.random()
    if shape < 0.5:
        return j(num(), rng.choice(ops), num())
    if shape < 0.75:
        return j(j(num(), rng.choice(ops), num()), rng.choice(ops), num())
    if shape < 0.9:
        return j(f"({j(num(), rng.choice(ops[:2]), num())})", rng.choice(ops[2:]), num())
    return j(str(rng.randint(2, 12)), "**", str(rng.randint(2, 6)))


def _calc_value(expr: str) -> str:
    v = eval(expr, {"__builtins__": {}}, {})  # noqa: S307 - our own generated arithmetic only
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 1e15:
            return str(int(v))
        return f"{v:.4f}".rstrip("0").rstrip(".")
    return str(v)


WEATHER_Q = [
    "What's the weather in {c}?",
    "What is the weather like in {c} today?",
    "How's the weather in {c}?",
    "Is it raining in {c}?",
    "weather {c}",
    "Tell me the current weather for {c}.",
    "I'm flying to {c} tomorrow. What's the weather like there?",
    "Check the weather in {c} please.",
    "Do I need an umbrella in {c} today?",
    "How warm is it in {c} right now?",
    "Can you look up the weather in {c}?",
    "What's the temperature in {c}?",
]
WEATHER_Q_UNIT = [
    "What's the weather in {c} in {u}?",
    "Temperature in {c} in {U}, please.",
    "How hot is it in {c}? Give it in {u}.",
    "Check the weather in {c} ({u}).",
    "Weather for {c} in {U}?",
    "Can you tell me the temperature in {c} in {u}?",
]
CALC_Q = [
    "What is {e}?",
    "Calculate {e}",
    "Compute {e} for me.",
    "What's {e}?",
    "Please evaluate {e}.",
    "{e} = ?",
    "Can you work out {e}?",
    "How much is {e}?",
    "Use the calculator: {e}",
    "I need the result of {e}.",
    "Quick math: {e}",
    "Solve {e}",
]
FILE_Q = [
    "Show me the contents of {p}.",
    "Read {p}",
    "What's in {p}?",
    "Open the file {p} and tell me what it says.",
    "Can you read {p} for me?",
    "cat {p}",
    "Print the file {p}.",
    "What does {p} contain?",
    "Please read the file at {p}.",
    "Show {p}",
    "I need to see {p}.",
    "Load {p} and show it to me.",
]

# One reasoning per (tool, strength): strength is in the prompt, so the reasoning is predictable
# and greedy decoding never has to pick among look-alike templates. It names the intent, not the
# entity (the arguments are copied from the user's message, not from the reasoning).
CALL_REASONING = {
    "get_weather": {
        "low": "Weather request: call get_weather.",
        "medium": "The user wants the current weather. I'll call get_weather.",
        "high": "The user is asking about the current weather in a city. The get_weather tool can answer "
        "this, so I'll call it with that city.",
    },
    "calculator": {
        "low": "Arithmetic: call calculator.",
        "medium": "The user wants an expression evaluated. I'll call calculator.",
        "high": "The user is asking for the value of an arithmetic expression. To get an exact result I'll "
        "call the calculator tool with that expression.",
    },
    "read_file": {
        "low": "File request: call read_file.",
        "medium": "The user wants to see a file. I'll call read_file.",
        "high": "The user is asking what a file contains. I can't see files directly, so I'll call "
        "read_file with that path.",
    },
}
# Data version 3 (the default): the reasoning opens with the request type, so the first
# reasoning word already decides the tool; the strength only lengthens the sentence.
CALL_REASONING_V3 = {
    "get_weather": {
        "low": "Weather request: call get_weather.",
        "medium": "Weather request: call get_weather with the city.",
        "high": "Weather request: call get_weather with the city the user named. It returns the current conditions.",
    },
    "calculator": {
        "low": "Arithmetic request: call calculator.",
        "medium": "Arithmetic request: call calculator with the expression.",
        "high": "Arithmetic request: call calculator with the expression the user wrote. It returns the exact value.",
    },
    "read_file": {
        "low": "File request: call read_file.",
        "medium": "File request: call read_file with the path.",
        "high": "File request: call read_file with the path the user gave. It returns the file's contents.",
    },
}
MISSING_REASONING_V3 = {
    "get_weather": "Weather request, but no get_weather tool is available, so I can't look it up.",
    "calculator": "Arithmetic request, but no calculator tool is available, so I can't evaluate it exactly.",
    "read_file": "File request, but no read_file tool is available, so I can't open it.",
}
DATA_VERSION = 3
RESULT_REASONING = {
    "get_weather": "get_weather returned the weather. I'll report it.",
    "calculator": "calculator returned the result. I'll report it.",
    "read_file": "read_file returned the file. I'll show it.",
}
MISSING_REASONING = {
    "get_weather": "No get_weather tool is available, so I can't look up the weather.",
    "calculator": "No calculator tool is available, so I can't evaluate this exactly.",
    "read_file": "No read_file tool is available, so I can't open files.",
}


def _offered(
    rng: random.Random, need: str | None = None, exclude: str | None = None, allow_none: bool = True
) -> list[dict[str, Any]] | None:
    names = [n for n in TOOL_NAMES if n != exclude and n != need]
    rng.shuffle(names)
    k = rng.randint(0, len(names))
    chosen = names[:k] + ([need] if need else [])
    rng.shuffle(chosen)
    return [TOOLS[n] for n in chosen] or None


def _pick(rng: random.Random, seen: list[str], unseen: list[str], use_unseen: bool) -> str:
    return rng.choice(unseen if use_unseen else seen)


def _tool_request(rng: random.Random, tool: str, unseen: bool) -> tuple[str, dict[str, Any], str]:
    """(user text, expected arguments, reasoning) for one tool call; reasoning is filled later by strength."""
    if tool == "get_weather":
        c = _pick(rng, SEEN_CITIES, UNSEEN_CITIES, unseen)
        if rng.random() < 0.3:
            u = rng.choice(["celsius", "fahrenheit"])
            q = rng.choice(WEATHER_Q_UNIT).format(c=c, u=u, U=u.capitalize())
            return q, {"city": c, "unit": u}, c
        return rng.choice(WEATHER_Q).format(c=c), {"city": c}, c
    if tool == "calculator":
        e = _expression(rng)
        return rng.choice(CALC_Q).format(e=e), {"expression": e}, e
    p = _pick(rng, SEEN_PATHS, UNSEEN_PATHS, unseen)
    return rng.choice(FILE_Q).format(p=p), {"path": p}, p


def _call_reasoning(rng: random.Random, tool: str, entity: str, strength: str, version: int = DATA_VERSION) -> str:
    return (CALL_REASONING_V3 if version >= 3 else CALL_REASONING)[tool][strength]


def _tool_result(rng: random.Random, tool: str, args: dict[str, Any]) -> tuple[str, str, str, str]:
    """(result string, the value the answer must contain, answer, reasoning). The result varies;
    the answer is one fixed pattern per tool that copies the result's values."""
    if tool == "get_weather":
        c, unit = args["city"], args.get("unit", "celsius")
        t = f"{rng.randint(10, 100)}F" if unit == "fahrenheit" else f"{rng.randint(-15, 38)}C"
        cond = rng.choice(CONDITIONS)
        result = f"{t}, {cond}" if rng.random() < 0.7 else f"temperature: {t}, conditions: {cond}"
        return result, t, f"It's {t} and {cond} in {c} right now.", RESULT_REASONING[tool]
    if tool == "calculator":
        e = args["expression"]
        try:
            v = _calc_value(e)
        except (ZeroDivisionError, OverflowError):
            return (
                "error: division by zero",
                "zero",
                f"{e} can't be evaluated: it divides by zero.",
                "calculator reported an error. I'll explain it.",
            )
        return v, v, f"{e} = {v}", RESULT_REASONING[tool]
    p = args["path"]
    if rng.random() < 0.1:
        err = rng.choice(["error: file not found", "error: permission denied"])
        why = err.split(": ")[1]
        return err, why, f"I couldn't read {p}: {why}.", "read_file reported an error. I'll explain it."
    lines = rng.sample(FILE_LINES, rng.randint(1, 3))
    content = "\n".join(lines)
    return content, lines[0], f"{p} contains:\n{content}", RESULT_REASONING[tool]


def _plain_turn(rng: random.Random, tools: list[dict[str, Any]] | None, strength: str) -> tuple[str, str, str]:
    """(user, reasoning, answer) for a turn that needs no tool."""
    r = rng.random()
    if r < 0.35:
        q, a = rng.choice(GREETINGS)
        reasoning = "Small talk; no tool needed. I'll reply politely."
    elif r < 0.8:
        q, a = rng.choice(FACTS)
        reasoning = "A simple question; no tool needed. I'll answer directly."
    else:
        q = rng.choice(
            ["What can you do?", "What tools do you have?", "Which tools can you use?", "How can you help me?"]
        )
        names = [t["function"]["name"] for t in tools or []]
        if names:
            a = "I can help with questions and use these tools: " + ", ".join(names) + "."
            reasoning = "The user asks what I can do. I'll list my tools."
        else:
            a = "I can answer questions and chat, but I have no tools available right now."
            reasoning = "The user asks what I can do. I have no tools."
    return q, reasoning, a


def _no_tool_turn(rng: random.Random, tool: str, version: int = DATA_VERSION) -> tuple[str, str, str]:
    q, args, entity = _tool_request(rng, tool, unseen=False)
    if tool == "get_weather":
        a = f"Sorry, I can't check the weather in {entity}: I don't have a weather tool."
    elif tool == "calculator":
        a = f"Sorry, I can't evaluate {entity} exactly: I don't have a calculator tool."
    else:
        a = f"Sorry, I can't read {entity}: I don't have a file tool."
    return q, (MISSING_REASONING_V3 if version >= 3 else MISSING_REASONING)[tool], a


def _call_id(rng: random.Random) -> str:
    return "call_" + "".join(rng.choice("0123456789abcdef") for _ in range(12))


def _tool_round(
    rng: random.Random, tool: str, unseen: bool, strength: str, version: int = DATA_VERSION
) -> tuple[list[dict], dict, str, str, str]:
    """History of one tool round trip: user, assistant call, tool result. Also returns the final
    answer's reasoning/answer/value for a tool_result target."""
    q, args, entity = _tool_request(rng, tool, unseen)
    cid = _call_id(rng)
    result, value, answer, r2 = _tool_result(rng, tool, args)
    msgs = [
        {"role": "user", "content": q},
        {
            "role": "assistant",
            "content": None,
            "reasoning": _call_reasoning(rng, tool, entity, strength, version),
            "tool_calls": [{"id": cid, "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}],
        },
        {"role": "tool", "tool_call_id": cid, "content": result},
    ]
    return msgs, args, value, answer, r2


def _history(
    rng: random.Random, tools: list[dict[str, Any]] | None, strength: str, version: int = DATA_VERSION
) -> list[dict[str, Any]]:
    """0-2 earlier complete exchanges (plain, or a tool round trip with an offered tool)."""
    out: list[dict[str, Any]] = []
    for _ in range(rng.choice([1, 1, 2])):
        names = [t["function"]["name"] for t in tools or []]
        if names and rng.random() < 0.4:
            msgs, _, _, answer, r2 = _tool_round(rng, rng.choice(names), False, strength, version)
            out += msgs + [{"role": "assistant", "content": answer, "reasoning": r2}]
        else:
            q, r, a = _plain_turn(rng, tools, strength)
            out += [{"role": "user", "content": q}, {"role": "assistant", "content": a, "reasoning": r}]
    return out


# -- conversations -----------------------------------------------------------------------


def make(
    rng: random.Random,
    kind: str,
    unseen: bool = False,
    tool: str | None = None,
    history: bool | None = None,
    system: bool | None = None,
    version: int = DATA_VERSION,
) -> Conversation:
    strength = rng.choice(STRENGTHS)
    kwargs = {"current_date": _date(rng), "reasoning_strength": strength}
    tool = tool or rng.choice(TOOL_NAMES)
    if kind in ("tool_call", "tool_result"):
        tools = _offered(rng, need=tool)
    elif kind == "no_tool":
        tools = _offered(rng, exclude=tool)
    else:
        tools = _offered(rng) if rng.random() < 0.75 else None
    history = rng.random() < 0.3 if history is None else history
    system = rng.random() < 0.2 if system is None else system
    msgs: list[dict[str, Any]] = []
    if system:
        msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if history:
        msgs += _history(rng, tools, strength, version)
    expected: dict[str, Any] = {}
    if kind == "tool_call":
        q, args, entity = _tool_request(rng, tool, unseen)
        msgs.append({"role": "user", "content": q})
        target = call_output(_call_reasoning(rng, tool, entity, strength, version), tool, args)
        expected = {"name": tool, "arguments": args}
    elif kind == "tool_result":
        round_msgs, args, value, answer, r2 = _tool_round(rng, tool, unseen, strength, version)
        msgs += round_msgs
        target = answer_output(r2, answer)
        expected = {"name": tool, "arguments": args, "value": value}
    elif kind == "no_tool":
        q, r, a = _no_tool_turn(rng, tool, version)
        msgs.append({"role": "user", "content": q})
        target = answer_output(r, a)
        expected = {"missing_tool": tool}
    else:
        q, r, a = _plain_turn(rng, tools, strength)
        msgs.append({"role": "user", "content": q})
        target = answer_output(r, a)
    return Conversation(kind, msgs, tools, kwargs, target, expected, unseen)


KIND_WEIGHTS = [("tool_call", 0.5), ("tool_result", 0.25), ("plain", 0.15), ("no_tool", 0.1)]


def _kind(rng: random.Random) -> str:
    r, acc = rng.random(), 0.0
    for k, w in KIND_WEIGHTS:
        acc += w
        if r < acc:
            return k
    return KIND_WEIGHTS[-1][0]


def example(seed: int, index: int, version: int = DATA_VERSION) -> Conversation:
    """Training conversation `index` of the stream for `seed` (seen entities only). `version`
    2 = the reasoning templates of CALL_REASONING / MISSING_REASONING, 3 = the *_V3 ones
    (the same conversations otherwise: same draws, same order)."""
    rng = random.Random(f"muse-train:{seed}:{index}")
    return make(rng, _kind(rng), version=version)


def heldout(seed: int, n: int) -> list[Conversation]:
    """n held-out conversations of every kind (cycled), half of the tool ones with unseen entities."""
    kinds = [k for k, _ in KIND_WEIGHTS]
    out = []
    for i in range(n):
        rng = random.Random(f"muse-heldout:{seed}:{i}")
        out.append(make(rng, kinds[i % len(kinds)], unseen=(i // len(kinds)) % 2 == 1))
    return out


def tool_tasks(seed: int, n: int) -> list[Conversation]:
    """n held-out first-turn tool-call tasks (kind tool_call): the three tools in turn, and
    seen/unseen entities alternating per tool (calculator expressions are always fresh).
    `expected` = {"name", "arguments"}. Use a seed different from training's."""
    out = []
    for i in range(n):
        rng = random.Random(f"muse-tooltask:{seed}:{i}")
        tool = TOOL_NAMES[i % 3]
        unseen = tool != "calculator" and (i // 3) % 2 == 1
        out.append(make(rng, "tool_call", unseen=unseen, tool=tool))
    return out


if __name__ == "__main__":
    import sys

    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    for i in range(int(sys.argv[2]) if len(sys.argv) > 2 else 4):
        c = example(seed, i)
        print(
            json.dumps(
                {
                    "kind": c.kind,
                    "messages": c.messages,
                    "tools": [t["function"]["name"] for t in c.tools or []],
                    "kwargs": c.kwargs,
                    "target": c.target,
                },
                indent=1,
            )
        )
    print(
        f"cities seen {len(SEEN_CITIES)} unseen {len(UNSEEN_CITIES)}; paths seen {len(SEEN_PATHS)} "
        f"unseen {len(UNSEEN_PATHS)}"
    )
