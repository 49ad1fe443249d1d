"""How the `musespark` command line is read: vLLM's spellings, value syntax and help.

    parser = MuseParser(prog="musespark")       # sub-parsers are MuseParsers too
    args = parser.parse_args(argv)

Invariants:
* A flag name is normalised before argparse sees it, as `vllm serve` does: underscores in the
  name become dashes (`--max_model_len=64` is `--max-model-len=64`), and a dotted flag
  (`--structured-outputs-config.backend xgrammar`, `--x.y=V`, `--x.a.b V`) becomes one JSON
  object for `--x`, merged into a JSON object given for `--x` itself. A dotted value is read
  as JSON, else as a human-readable integer (`80k`), else kept as a string. Field names after
  the dot are kept as written. Normalising twice changes nothing.
* `--help=KEYWORD` is `--help` showing: `all` (every flag, the vLLM ones too), the flags of
  the group whose title is KEYWORD, or the flags whose names contain KEYWORD.
* A parser with `hidden_groups` leaves those groups out of its plain `--help` and says how
  to see them; errors print a one-line usage (`usage=` set on the parser), never the full
  flag list.
* An unknown argument is reported by the innermost parser that saw it (`generate --bogus`
  gets `generate`'s usage).
* `human_readable_int` and `human_readable_int_or_auto` are the value parsers every command
  shares (one parser per syntax).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")


def human_readable_int(value: str) -> int:
    """vLLM's integer syntax: 2048, 25.6k (k m g t: powers of 1000), 4G (K M G T: of 1024)."""
    value = value.strip()
    m = _HUMAN.fullmatch(value)
    if m is None:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not an integer (vLLM's syntax: 2048, 32k, 1.5m, 4K, 1G)"
            ) from None
    number, suffix = m.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"{value!r}: no decimals with a binary suffix ({suffix})")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


def human_readable_int_or_auto(value: str) -> int | None:
    """As human_readable_int; 'auto' and -1 mean "derive it" (None)."""
    return None if value.strip().lower() in ("auto", "-1") else human_readable_int(value)


# -- argv normalisation -----------------------------------------------------------------------
_DOTTED = re.compile(r"--([A-Za-z][\w-]*)\.([\w.-]+)")


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _dotted_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return human_readable_int(text)
    except (ValueError, argparse.ArgumentTypeError):
        return text


def normalize_argv(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """(the argv argparse should see, the `--help=KEYWORD` keyword or None); see the module
    docstring. Arguments after a bare `--` are left alone."""
    out: list[str] = []
    keyword: str | None = None
    dotted: dict[str, dict[str, Any]] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            out.extend(args[i - 1 :])
            break
        if not arg.startswith("--") or arg == "--":
            out.append(arg)
            continue
        name, eq, value = arg.partition("=")
        if name.startswith("--help") and eq:
            keyword = value.strip().lower().replace("_", "-")
            out.append("--help")
            continue
        m = _DOTTED.fullmatch(name)
        if m is None:
            out.append("--" + name[2:].replace("_", "-") + eq + value)
            continue
        flag, path = "--" + m.group(1).replace("_", "-"), m.group(2).split(".")
        if not eq:
            if i >= len(args):
                out.append(arg)  # no value: argparse reports the unknown flag
                continue
            value = args[i]
            i += 1
        nested: Any = _dotted_value(value)
        for key in reversed(path):
            nested = {key: nested}
        _merge(dotted.setdefault(flag, {}), nested)
    for flag, update in dotted.items():
        _place_dotted(out, flag, update)
    return out, keyword


def _place_dotted(out: list[str], flag: str, update: dict[str, Any]) -> None:
    """Merge `update` into the JSON object given for `flag` (its last occurrence), or append
    `flag JSON` when the flag is not given as an object."""
    for j in range(len(out) - 1, -1, -1):
        arg = out[j]
        if arg == flag and j + 1 < len(out):
            at, text = j + 1, out[j + 1]
        elif arg.startswith(flag + "="):
            at, text = j, arg[len(flag) + 1 :]
        else:
            continue
        try:
            base = json.loads(text)
        except json.JSONDecodeError:
            break
        if not isinstance(base, dict):
            break
        _merge(base, update)
        out[at] = json.dumps(base) if at == j + 1 else f"{flag}={json.dumps(base)}"
        return
    out.extend([flag, json.dumps(update)])


# -- the parser -------------------------------------------------------------------------------
class MuseParser(argparse.ArgumentParser):
    """An ArgumentParser reading vLLM's spellings (module docstring). `hidden_groups`: titles
    of argument groups its plain `--help` leaves out."""

    help_keyword: str | None = None  # set by the last `--help=KEYWORD` parsed (one process, one parse)

    def __init__(self, *args: Any, hidden_groups: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hidden_groups = tuple(hidden_groups)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv, keyword = normalize_argv(sys.argv[1:] if args is None else args)
        if keyword is not None or self._subparsers_present():
            # The outermost parser sees `--help=KEYWORD` (or its absence) first; the sub-parser it
            # hands the normalised argv to finds no keyword there and must not clear it.
            MuseParser.help_keyword = keyword
        ns, extras = super().parse_known_args(argv, namespace)
        if extras and not self._subparsers_present():
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras

    def _subparsers_present(self) -> bool:
        return any(isinstance(a, argparse._SubParsersAction) for a in self._actions)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def format_help(self) -> str:
        keyword = MuseParser.help_keyword
        if keyword is None or self._subparsers_present():
            if not self.hidden_groups:
                return super().format_help()
            shown = [g for g in self._action_groups if g.title not in self.hidden_groups]
            saved, self._action_groups = self._action_groups, shown
            try:
                text = super().format_help()
            finally:
                self._action_groups = saved
            hidden = ", ".join(f"--help={g.lower()}" for g in self.hidden_groups)
            return text + f"\nMore flags: --help=all (every flag), {hidden}, or --help=WORD (flags naming WORD).\n"
        if keyword == "all":
            return super().format_help()
        formatter = self._get_formatter()
        for group in self._action_groups:
            if group.title and group.title.lower() == keyword:
                formatter.start_section(group.title)
                formatter.add_arguments(group._group_actions)
                formatter.end_section()
                return formatter.format_help()
        matched = [
            a
            for g in self._action_groups
            for a in g._group_actions
            if a.help != argparse.SUPPRESS and any(keyword in s.lower() for s in a.option_strings)
        ]
        if not matched:
            return f"No group or flag matching {keyword!r}; --help lists the groups, --help=all every flag.\n"
        formatter.start_section(f"flags matching {keyword!r}")
        formatter.add_arguments(matched)
        formatter.end_section()
        return formatter.format_help()
