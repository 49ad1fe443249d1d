"""Muse chat conversations that can only be solved by copying, for fine-tuning the bundled model
to copy the user's values into tool calls and the tool's values into its answer.

    .venv/bin/python tools/muse_copy_data.py show --seed 0 --n 3            # training texts, as rendered
    .venv/bin/python tools/muse_copy_data.py tasks --out tasks.jsonl        # held-out evaluation tasks

tools/muse_chat_data.py draws its values from closed lists (95 cities, 486 paths), so a model
can memorise them instead of learning to copy. Here every value comes from an open-ended space:

* cities: made-up place names built from syllables ("Velmora", "Port Askeby", "Tranoquel-Ida"),
  and now and then a real city (muse_chat_data.CITIES, of its own split there too);
* expressions: random numbers (1 to 6 digits, decimals, negatives) under + - * / **, with
  parentheses, unary minus and any spacing;
* paths: random relative paths of made-up words ("kelvo/ranst_42/todo-mira.yaml");
* tool results with random values the answer must restate: the temperature and conditions of
  the weather, the calculator's number (computed by musespark.apps.demo_tools.calculator,
  the demo's own tool), lines of made-up words and numbers of a file; now and then an error.

Kinds, as in muse_chat_data: "tool_call" (the user needs an offered tool), "tool_result" (the
history ends with the tool's result), "plain" (no tool needed, tools offered or not; some of
them also copy: "My name is X", "Repeat after me: ..."), "no_tool" (the needed tool is not
offered: say so). Some conversations carry earlier turns (a plain exchange or a whole tool round
trip with other values, so the value to copy is the newest one) and some a system message.
The assistant side is muse_chat_data's: one reasoning sentence per (tool, strength), one answer
pattern per tool.

Splits: a value belongs to the held-out split when every word of it that is not a shared
affix ("Port", "src", ...) hashes into HOLD_OUT_PERCENT (an expression or a file line: the
whole value); training conversations draw only training values, held-out ones only held-out
values, so no held-out value occurs in training. Everything is a pure function of (seed,
index): `random.Random(str)` hashes str seeds with SHA-512, the same on every run and platform.

Rendering goes through the bundled checkpoint's tokenizer and chat template, the path
`InputProcessor.render_chat` (the server, `LLM.chat`) takes: `training_text(conv)` is the prompt
the server renders followed by the target the model must write. Conversations are
`muse_chat_data.Conversation`s, so tools/finetune_muse.py's `encode_chat` takes them as they are.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import muse_chat_data as mcd  # noqa: E402

from musespark.apps.demo_tools import WEATHER_CONDITIONS, ToolError, calculator, weather_result  # noqa: E402

HOLD_OUT_PERCENT = 20
TOOL_NAMES = mcd.TOOL_NAMES
TRAIN, HELDOUT = "train", "heldout"

ONSETS = ["b", "br", "ch", "d", "dr", "f", "g", "gr", "h", "j", "k", "kl", "l", "m", "n", "p", "pr", "qu", "r"]
ONSETS += ["s", "sh", "st", "t", "tr", "v", "w", "z", "", ""]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou", "ia", "y"]
CODAS = ["", "", "", "n", "r", "l", "s", "k", "m", "nd", "rt", "st", "x"]
PLACE_PREFIXES = ["Port", "San", "New", "Lake", "Mount", "Saint", "Upper", "Old", "El", "Fort"]
PLACE_SUFFIXES = ["Hills", "Bay", "Falls", "City", "Springs", "Harbor", "Valley", "Point", "Crossing"]
COMMON_DIRS = ["src", "docs", "config", "data", "notes", "logs", "tests", "app", "scripts", "build", "home"]
EXTENSIONS = ["txt", "md", "yaml", "yml", "json", "py", "csv", "log", "cfg", "toml", "ini", "sh", "conf", "sql"]
SHARED_WORDS = {w.lower() for w in PLACE_PREFIXES + PLACE_SUFFIXES + COMMON_DIRS}

MORE_WEATHER_Q = [
    "What's the weather like in {c}?",
    "Any idea what the weather is doing in {c}?",
    "Is it cold in {c} at the moment?",
    "My sister lives in {c}. How's the weather there?",
]
MORE_CALC_Q = ["What's {e}? Use the calculator.", "{e}", "Work out {e}, please.", "what is {e}"]
MORE_FILE_Q = ["Open {p}", "Open {p} and show me what's in it.", "Could you print {p}?", "read {p} please"]
NAME_Q = ["My name is {n}.", "Hi, I'm {n}!", "Hello, my name is {n}. Nice to meet you."]
REPEAT_Q = ["Repeat after me: {w}", "Say '{w}' back to me.", "Please repeat this exactly: {w}"]


def split_of(word: str) -> str:
    """The split one word (or a whole expression / file line) belongs to, by a fixed hash."""
    h = int.from_bytes(hashlib.sha256(("muse-copy:" + word.lower()).encode("utf-8")).digest()[:8], "big")
    return HELDOUT if h % 100 < HOLD_OUT_PERCENT else TRAIN


def value_words(value: str) -> list[str]:
    """The words of a city or a path that decide its split (shared affixes and extensions aside)."""
    words = [w for w in re.split(r"[^A-Za-z0-9]+", value) if w]
    if "." in value.rsplit("/", 1)[-1]:  # a path's extension is shared by every split
        words = words[:-1]
    return [w for w in words if w.lower() not in SHARED_WORDS and not w.isdigit()]


def in_split(value: str, split: str, whole: bool = False) -> bool:
    """A city or path is in `split` when each of its deciding words is (there is at least one);
    an expression, a file line or a phrase (`whole`) by the hash of the whole value."""
    if whole:
        return split_of(re.sub(r"\s+", "", value)) == split
    words = value_words(value)
    return bool(words) and all(split_of(w) == split for w in words)


class Drawer:
    """Draws values of one split with one rng, and records every value it hands out."""

    def __init__(self, rng: random.Random, split: str) -> None:
        self.rng, self.split = rng, split
        self.values: list[tuple[str, str]] = []  # (kind, value): city, path, expression, line, phrase

    def _draw(self, kind: str, make: Any, whole: bool = False) -> str:
        for _ in range(10_000):
            value = make()
            if in_split(value, self.split, whole):
                self.values.append((kind, value))
                return value
        raise RuntimeError(f"no {kind} of the {self.split} split in 10000 draws")

    def word(self, syllables: tuple[int, int] = (2, 3)) -> str:
        r = self.rng
        return "".join(r.choice(ONSETS) + r.choice(VOWELS) + r.choice(CODAS) for _ in range(r.randint(*syllables)))

    def city(self) -> str:
        r = self.rng

        def make() -> str:
            if r.random() < 0.15:  # a real city, held out in muse_chat_data too when held out here
                return r.choice(mcd.UNSEEN_CITIES if self.split == HELDOUT else mcd.SEEN_CITIES)
            name = self.word().capitalize()
            shape = r.random()
            if shape < 0.15:
                return f"{r.choice(PLACE_PREFIXES)} {name}"
            if shape < 0.25:
                return f"{name} {r.choice(PLACE_SUFFIXES)}"
            if shape < 0.35:
                return f"{name}-{self.word((1, 2)).capitalize()}"
            if shape < 0.45:
                return f"{name} {self.word((1, 2)).capitalize()}"
            return name

        return self._draw("city", make)

    def path(self) -> str:
        r = self.rng

        def part() -> str:
            w = self.word((1, 2))
            shape = r.random()
            if shape < 0.15:
                return f"{w}_{r.randint(0, 99)}"
            if shape < 0.3:
                return f"{w}-{self.word((1, 2))}"
            if shape < 0.38:
                return w.upper() if r.random() < 0.3 else w.capitalize()
            return w

        def make() -> str:
            dirs = [r.choice(COMMON_DIRS) if r.random() < 0.3 else part() for _ in range(r.choice([0, 1, 1, 2, 2, 3]))]
            p = "/".join([*dirs, f"{part()}.{r.choice(EXTENSIONS)}"])
            return "./" + p if r.random() < 0.1 else p

        return self._draw("path", make)

    def number(self) -> str:
        r = self.rng
        shape = r.random()
        if shape < 0.3:
            return str(r.randint(0, 99))
        if shape < 0.75:
            return str(r.randint(100, 999_999))
        return f"{r.randint(0, 9999)}.{r.randint(0, 99):0{r.choice([1, 2])}d}"

    def expression(self) -> str:
        r = self.rng

        def term(depth: int) -> str:
            if depth > 0 and r.random() < 0.25:
                inner = join(term(depth - 1), r.choice("+-*/"), term(depth - 1))
                return ("-" if r.random() < 0.1 else "") + f"({inner})"
            n = self.number()
            return "-" + n if r.random() < 0.08 else n

        def join(a: str, op: str, b: str) -> str:
            style = r.random()
            if style < 0.7:
                return f"{a} {op} {b}"
            if style < 0.9:
                return f"{a}{op}{b}"
            return f"{a} {op}{b}"

        def make() -> str:
            if r.random() < 0.1:
                return join(str(r.randint(2, 30)), "**", str(r.randint(2, 9)))
            out = term(2)
            for _ in range(r.choice([1, 1, 1, 2, 3])):
                out = join(out, r.choice(["+", "-", "*", "/"]), term(1))
            return out

        return self._draw("expression", make, whole=True)

    def line(self) -> str:
        r = self.rng

        def make() -> str:
            shape = r.random()
            w = [self.word((1, 2)) for _ in range(4)]
            if shape < 0.3:
                return f"{w[0]}={r.randint(0, 99999)}"
            if shape < 0.5:
                return f"{w[0]}: {w[1]} {r.randint(1, 999)}"
            if shape < 0.7:
                return f"- {w[0]} the {w[1]} by {r.choice(['Monday', 'Friday', 'noon', 'June'])}"
            if shape < 0.85:
                return f"{w[0].capitalize()} {w[1]} {w[2]}."
            return f"{w[0]},{r.randint(1, 99)},{w[1]}"

        return self._draw("line", make, whole=True)

    def phrase(self) -> str:
        return self._draw("phrase", lambda: " ".join(self.word((1, 3)) for _ in range(self.rng.randint(1, 4))), True)

    def person(self) -> str:
        return self._draw("name", lambda: self.word((2, 3)).capitalize())


# -- one tool round --------------------------------------------------------------------------


def tool_request(d: Drawer, tool: str) -> tuple[str, dict[str, Any]]:
    """(the user's question, the arguments the call must carry)."""
    r = d.rng
    if tool == "get_weather":
        c = d.city()
        if r.random() < 0.25:
            u = r.choice(["celsius", "fahrenheit"])
            return r.choice(mcd.WEATHER_Q_UNIT).format(c=c, u=u, U=u.capitalize()), {"city": c, "unit": u}
        return r.choice(mcd.WEATHER_Q + MORE_WEATHER_Q).format(c=c), {"city": c}
    if tool == "calculator":
        e = d.expression()
        return r.choice(mcd.CALC_Q + MORE_CALC_Q).format(e=e), {"expression": e}
    p = d.path()
    return r.choice(mcd.FILE_Q + MORE_FILE_Q).format(p=p), {"path": p}


def tool_result(d: Drawer, tool: str, args: dict[str, Any]) -> tuple[str, str, dict[str, list[str]]]:
    """(the tool's result text, the answer that restates it, what the answer must restate:
    {"all": every one of these} or {"any": one of these})."""
    r = d.rng
    if tool == "get_weather":
        unit = args.get("unit", "celsius")
        t = r.randint(-5, 110) if unit == "fahrenheit" else r.randint(-30, 45)
        cond = r.choice(WEATHER_CONDITIONS)
        sym = "F" if unit == "fahrenheit" else "C"
        answer = f"It's {t}{sym} and {cond} in {args['city']} right now."
        return weather_result(args["city"], t, unit, cond), answer, {"all": [str(t), cond]}
    if tool == "calculator":
        e = args["expression"]
        try:
            v = calculator(e)
        except ToolError as exc:
            return f"error: {exc}", f"I couldn't evaluate {e}: {exc}.", {"all": [str(exc)]}
        return v, f"{e} = {v}", {"all": [v]}
    p = args["path"]
    if r.random() < 0.08:
        why = r.choice(["no such file", "not a regular file", "not a UTF-8 text file"])
        return f"error: {p}: {why}", f"I couldn't read {p}: {why}.", {"all": [why]}
    lines = [d.line() for _ in range(r.randint(1, 4))]
    content = "\n".join(lines)
    return content, f"{p} contains:\n{content}", {"any": lines}


def call_id(rng: random.Random) -> str:
    return "call_" + "".join(rng.choice("0123456789abcdef") for _ in range(12))


def assistant_call(tool: str, args: dict[str, Any], reasoning: str, cid: str) -> dict[str, Any]:
    call = {"id": cid, "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}
    return {"role": "assistant", "content": None, "reasoning": reasoning, "tool_calls": [call]}


def plain_turn(d: Drawer, tools: list[dict[str, Any]] | None, strength: str) -> tuple[str, str, str]:
    """(user, reasoning, answer) for a turn that needs no tool; a third of them copy a value."""
    r = d.rng
    shape = r.random()
    if shape < 0.17:
        n = d.person()
        return (
            r.choice(NAME_Q).format(n=n),
            "Small talk; no tool needed. I'll reply politely.",
            f"Nice to meet you, {n}!",
        )
    if shape < 0.33:
        w = d.phrase()
        return r.choice(REPEAT_Q).format(w=w), "A request to repeat some words; no tool needed.", w
    return mcd._plain_turn(r, tools, strength)


def no_tool_turn(d: Drawer, tool: str) -> tuple[str, str, str]:
    q, args = tool_request(d, tool)
    if tool == "get_weather":
        a = f"Sorry, I can't check the weather in {args['city']}: I don't have a weather tool."
    elif tool == "calculator":
        a = f"Sorry, I can't evaluate {args['expression']} exactly: I don't have a calculator tool."
    else:
        a = f"Sorry, I can't read {args['path']}: I don't have a file tool."
    return q, mcd.MISSING_REASONING_V3[tool], a


def history(d: Drawer, tools: list[dict[str, Any]] | None, strength: str) -> list[dict[str, Any]]:
    """1-2 earlier complete exchanges: plain, or a tool round trip with an offered tool."""
    out: list[dict[str, Any]] = []
    names = [t["function"]["name"] for t in tools or []]
    for _ in range(d.rng.choice([1, 1, 2])):
        if names and d.rng.random() < 0.5:
            tool = d.rng.choice(names)
            q, args = tool_request(d, tool)
            result, answer, _ = tool_result(d, tool, args)
            cid = call_id(d.rng)
            out += [
                {"role": "user", "content": q},
                assistant_call(tool, args, mcd.CALL_REASONING_V3[tool][strength], cid),
                {"role": "tool", "tool_call_id": cid, "content": result},
                {"role": "assistant", "content": answer, "reasoning": mcd.RESULT_REASONING[tool]},
            ]
        else:
            q, reasoning, a = plain_turn(d, tools, strength)
            out += [{"role": "user", "content": q}, {"role": "assistant", "content": a, "reasoning": reasoning}]
    return out


# -- conversations ---------------------------------------------------------------------------


def make(d: Drawer, kind: str, tool: str | None = None, with_history: bool | None = None) -> mcd.Conversation:
    """One conversation of `kind`; `conv.expected` holds what a scorer needs ("name",
    "arguments", "result", "restate"; "missing_tool" for no_tool)."""
    r = d.rng
    strength = r.choice(mcd.STRENGTHS)
    kwargs = {"current_date": mcd._date(r), "reasoning_strength": strength}
    tool = tool or r.choice(TOOL_NAMES)
    if kind in ("tool_call", "tool_result"):
        tools = mcd._offered(r, need=tool)
    elif kind == "no_tool":
        tools = mcd._offered(r, exclude=tool)
    else:
        tools = mcd._offered(r) if r.random() < 0.6 else None
    msgs: list[dict[str, Any]] = []
    if r.random() < 0.15:
        msgs.append({"role": "system", "content": r.choice(mcd.SYSTEM_PROMPTS)})
    if with_history is None:
        with_history = r.random() < 0.35
    if with_history:
        msgs += history(d, tools, strength)
    expected: dict[str, Any] = {}
    if kind in ("tool_call", "tool_result"):
        q, args = tool_request(d, tool)
        msgs.append({"role": "user", "content": q})
        reasoning = mcd.CALL_REASONING_V3[tool][strength]
        result, answer, restate = tool_result(d, tool, args)
        expected = {"name": tool, "arguments": args, "result": result, "restate": restate}
        if kind == "tool_call":
            target = mcd.call_output(reasoning, tool, args)
        else:
            cid = call_id(r)
            msgs += [
                assistant_call(tool, args, reasoning, cid),
                {"role": "tool", "tool_call_id": cid, "content": result},
            ]
            target = mcd.answer_output(mcd.RESULT_REASONING[tool], answer)
    elif kind == "no_tool":
        q, reasoning, a = no_tool_turn(d, tool)
        msgs.append({"role": "user", "content": q})
        target = mcd.answer_output(reasoning, a)
        expected = {"missing_tool": tool}
    else:
        q, reasoning, a = plain_turn(d, tools, strength)
        msgs.append({"role": "user", "content": q})
        target = mcd.answer_output(reasoning, a)
    return mcd.Conversation(kind, msgs, tools, kwargs, target, expected, unseen=d.split == HELDOUT)


def example(seed: int, index: int) -> tuple[mcd.Conversation, list[tuple[str, str]]]:
    """Training conversation `index` of the stream for `seed`, and every value it uses."""
    d = Drawer(random.Random(f"muse-copy-train:{seed}:{index}"), TRAIN)
    return make(d, mcd._kind(d.rng)), d.values


def heldout_example(seed: int, index: int, kind: str, tool: str | None = None) -> tuple[mcd.Conversation, list]:
    """Held-out conversation `index` of `kind`: only values of the held-out split."""
    d = Drawer(random.Random(f"muse-copy-heldout:{seed}:{kind}:{tool}:{index}"), HELDOUT)
    return make(d, kind, tool), d.values


def eval_tasks(seed: int, n_tool: int = 120, n_plain: int = 30, n_no_tool: int = 30) -> list[dict[str, Any]]:
    """Held-out evaluation tasks as JSON-ready records (the format `tools/muse_copy_data.py
    tasks` writes, one per line, and benchmarks/tool_eval.py reads):

        {"id", "kind": "tool" | "plain" | "no_tool", "messages", "tools", "chat_template_kwargs",
         "expected": {"name", "arguments"} (tool), {"missing_tool"} (no_tool), {} (plain),
         "followup": [assistant call, tool result] (tool: appended to send the result back),
         "restate": {"all": [...]} or {"any": [...]} (tool: what the final answer must contain)}

    Tool tasks cycle through the three tools."""
    out: list[dict[str, Any]] = []
    plan = [("tool", TOOL_NAMES[i % 3]) for i in range(n_tool)]
    plan += [("plain", None)] * n_plain + [("no_tool", TOOL_NAMES[i % 3]) for i in range(n_no_tool)]
    for i, (kind, tool) in enumerate(plan):
        conv, _ = heldout_example(seed, i, {"tool": "tool_call"}.get(kind, kind), tool)
        record: dict[str, Any] = {
            "id": f"{kind}-{i}",
            "kind": kind,
            "messages": conv.messages,
            "tools": conv.tools,
            "chat_template_kwargs": conv.kwargs,
            "expected": {k: conv.expected[k] for k in ("name", "arguments", "missing_tool") if k in conv.expected},
        }
        if kind == "tool":
            cid = f"call_task{i}"
            args, name = conv.expected["arguments"], conv.expected["name"]
            reasoning = mcd.CALL_REASONING_V3[name][conv.kwargs["reasoning_strength"]]
            record["followup"] = [
                assistant_call(name, args, reasoning, cid),
                {"role": "tool", "tool_call_id": cid, "content": conv.expected["result"]},
            ]
            record["restate"] = conv.expected["restate"]
        out.append(record)
    return out


# -- rendering -------------------------------------------------------------------------------

_TOKENIZER: Any = None


def tokenizer() -> Any:
    """The bundled checkpoint's tokenizer (its chat_template.jinja included), loaded once."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from musespark.engine.args import default_model_path
        from musespark.engine.tokenizer import Tokenizer

        _TOKENIZER = Tokenizer.from_dir(default_model_path())
    return _TOKENIZER


def render_prompt(conv: mcd.Conversation) -> str:
    """The prompt as the server renders it for these messages, tools and kwargs (the
    tokenizer's chat template with the kwargs merged by engine.chat.template_kwargs)."""
    from musespark.engine import chat

    kwargs = chat.template_kwargs(None, conv.kwargs, tools=conv.tools, add_generation_prompt=True)
    return tokenizer().apply_chat_template(
        conv.messages, bool(kwargs.pop("add_generation_prompt")), tools=kwargs.pop("tools", None), **kwargs
    )


def training_text(conv: mcd.Conversation) -> str:
    """What the model is trained on: the rendered prompt, then the output it must write."""
    return render_prompt(conv) + conv.target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print training conversations as rendered training text")
    show.add_argument("--seed", type=int, default=0)
    show.add_argument("--n", type=int, default=3)
    tasks = sub.add_parser("tasks", help="write held-out evaluation tasks, one JSON object a line")
    tasks.add_argument("--out", required=True, help="the JSONL file to write ('-': stdout)")
    tasks.add_argument("--seed", type=int, default=1000)
    tasks.add_argument("--n-tool", type=int, default=120)
    tasks.add_argument("--n-plain", type=int, default=30)
    tasks.add_argument("--n-no-tool", type=int, default=30)
    args = p.parse_args(argv)
    if args.command == "show":
        for i in range(args.n):
            conv, values = example(args.seed, i)
            print(f"=== {i} {conv.kind} values={values}\n{training_text(conv)}\n")
        return 0
    lines = [json.dumps(t) for t in eval_tasks(args.seed, args.n_tool, args.n_plain, args.n_no_tool)]
    text = "\n".join(lines) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {len(lines)} tasks to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
