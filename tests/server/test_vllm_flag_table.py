"""Every row of the vLLM flag table (musespark.server.vllm_flags_table) holds to what the flag
does through the real `serve` argument handling (`build_parser` + `serve_cli.resolve`, which
reads no weights), and through `generate` where the flag is one of its engine flags:

* ours: accepted without a warning, and the value reaches the engine args or the server
  settings (two different values, or on and off, resolve to different settings);
* ignored: accepted, with exactly one warning naming the flag and the row's reason;
* refused: a ValueError naming the flag, and `musespark serve` exits 2 saying so before it
  loads anything (for an on/off flag: only when on; off is accepted silently);
* checked: each sample value has the outcome given here, and the row's text claims it.

The test walks the table itself: a new ignored or refused row is covered as it is; a new
ours or checked row fails until it has sample values below.
"""

from __future__ import annotations

import logging
import re
import shlex

import pytest

from musespark import serve_cli
from musespark.cli import build_parser, main
from musespark.engine.args import EngineArgs, bundled_model_path
from musespark.server.vllm_flags_table import VLLM_SERVE_FLAGS, VllmFlag

MODEL = str(bundled_model_path())

# ours rows taking values: two different valid values, and the flags a value needs beside it.
# "{key}", "{key2}", "{cert}", "{cert2}" are files made per test.
OURS_SAMPLES: dict[str, tuple[str, str, str]] = {
    "--chat-template": ("{{ 'a' }}", "{{ 'b' }}", ""),
    "--default-chat-template-kwargs": ('{"a": 1}', '{"a": 2}', ""),
    "--reasoning-effort-map": ('{"low": "x"}', '{"low": "y"}', ""),
    "--tool-call-parser": ("muse", "musespark1x", ""),
    "--host": ("0.0.0.0", "127.0.0.2", ""),
    "--port": ("8001", "8002", ""),
    "--uvicorn-log-level": ("debug", "warning", ""),
    "--allowed-origins": ('["https://a.example"]', '["https://b.example"]', ""),
    "--api-key": ("a", "b", ""),
    "--ssl-keyfile": ("{key}", "{key2}", "--ssl-certfile {cert}"),
    "--ssl-certfile": ("{cert}", "{cert2}", "--ssl-keyfile {key}"),
    "--model": ("a", "b", ""),
    "--dtype": ("float16", "bfloat16", ""),
    "--seed": ("1", "2", ""),
    "--max-model-len": ("128", "256", ""),
    "--max-logprobs": ("2", "3", ""),
    "--served-model-name": ("a", "b", ""),
    "--generation-config": ("vllm", "auto", ""),
    "--override-generation-config": ('{"temperature": 0.5}', '{"temperature": 0.7}', ""),
    "--reasoning-parser": ("muse", "musespark1x", ""),
    "--pipeline-parallel-size": ("1", "2", ""),
    "--tensor-parallel-size": ("1", "2", ""),
    "--block-size": ("8", "32", ""),
    "--kv-cache-dtype": ("auto", "fp8", ""),
    "--kv-cache-memory-bytes": ("1G", "2G", ""),
    "--max-num-batched-tokens": ("1024", "4096", ""),
    "--max-num-seqs": ("4", "8", ""),
    "--speculative-config": (
        '{"method": "ngram", "num_speculative_tokens": 2}',
        '{"method": "ngram", "num_speculative_tokens": 3}',
        "",
    ),
    "--shutdown-timeout": ("5", "6", ""),
    "--uds": ("a.sock", "b.sock", ""),
    "--root-path": ("/a", "/b", ""),
}
# ours on/off rows: the flags the `on` spelling needs beside it.
OURS_BOOL_COMPANIONS = {"--enable-auto-tool-choice": "--tool-call-parser muse"}
# ours rows that are accepted and change nothing, each with a valid command line: vLLM's
# --tokenizer must name MODEL itself, and no checkpoint code is ever run.
OURS_NO_EFFECT = {
    "--tokenizer": f"{shlex.quote(MODEL)} --tokenizer {shlex.quote(MODEL)}",
    "--trust-remote-code": "--trust-remote-code",
}
# checked rows: (value, outcome) samples; every outcome a row names should have one.
CHECKED_SAMPLES: dict[str, list[tuple[str, str]]] = {
    "--quantization": [("modelopt_fp4", "accepted"), ("modelopt", "accepted"), ("fp8", "ignored")],
    "--distributed-executor-backend": [("mp", "accepted"), ("external_launcher", "accepted"), ("ray", "refused")],
    "--decode-context-parallel-size": [("1", "accepted"), ("2", "refused")],
    "--prefill-context-parallel-size": [("1", "accepted"), ("2", "refused")],
    "--data-parallel-size": [("1", "accepted"), ("2", "refused")],
    "--structured-outputs-config": [
        ('{"backend": "xgrammar"}', "accepted"),
        ('{"backend": "auto"}', "accepted"),
        ('{"backend": "guidance"}', "ignored"),
    ],
}
# A value for a row whose value is never looked at (ignored and refused rows).
ANY_VALUE = {"flag": "", "bool": "", "value": "1", "optional": "", "list": "1", "append": "1"}


def rows(action: str) -> list[VllmFlag]:
    return [f for f in VLLM_SERVE_FLAGS if f.action == action]


def ids(flags: list[VllmFlag]) -> list[str]:
    return [f.name for f in flags]


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def parser():
    return build_parser()


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.delenv("MUSESPARK_API_KEY", raising=False)
    names = {}
    for name in ("key", "key2", "cert", "cert2"):
        (tmp_path / name).write_text(name)
        names[name] = str(tmp_path / name)
    return names


def resolve(parser, line: str, files: dict[str, str] | None = None) -> tuple[serve_cli.ServeSettings, list[str]]:
    """`musespark serve LINE` resolved as `serve` resolves it; the warnings it logged."""
    for name, path in (files or {}).items():
        line = line.replace("{" + name + "}", path)
    args = parser.parse_args(["serve", *shlex.split(line)])
    log = logging.getLogger(f"test_vllm_flag_table.{id(args)}")
    log.propagate = False
    handler = Collect()
    log.addHandler(handler)
    try:
        return serve_cli.resolve(args, log), handler.lines
    finally:
        log.removeHandler(handler)


def engine_args_of_generate(parser, flags: str) -> EngineArgs:
    return EngineArgs.from_cli_args(parser.parse_args(["generate", "prompt", *shlex.split(flags)]))


def generate_dest(parser, spelling: str) -> str | None:
    """The EngineArgs field `generate`'s spelling sets, if `generate` has it."""
    sub = parser._subparsers._group_actions[0].choices["generate"]
    action = sub._option_string_actions.get(spelling)
    fields = set(EngineArgs.__dataclass_fields__)
    return action.dest if action is not None and action.dest in fields else None


# -- ours ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", rows("ours"), ids=ids(rows("ours")))
def test_ours_rows_reach_the_settings(flag, parser, files):
    if flag.name in OURS_NO_EFFECT:
        _, warnings = resolve(parser, OURS_NO_EFFECT[flag.name], files)
        assert warnings == []
        return
    on, off = flag.option_strings()
    for spelling in on:
        if flag.kind == "bool":
            companions = OURS_BOOL_COMPANIONS.get(flag.name, "")
            first, second = f"{spelling} {companions}", f"{off[0]} {companions}"
        else:
            assert flag.name in OURS_SAMPLES, f"ours row {flag.name}: add two sample values to OURS_SAMPLES"
            a, b, companions = OURS_SAMPLES[flag.name]
            first, second = (f"{spelling} {shlex.quote(v)} {companions}" for v in (a, b))
        settings_a, warnings_a = resolve(parser, first, files)
        settings_b, warnings_b = resolve(parser, second, files)
        assert warnings_a == warnings_b == [], (first, warnings_a, warnings_b)
        assert settings_a != settings_b, f"{spelling}: the value never reaches the engine args or server settings"


@pytest.mark.parametrize("flag", rows("ours"), ids=ids(rows("ours")))
def test_ours_engine_rows_reach_generate_engine_args(flag, parser, files):
    on, off = flag.option_strings()
    for spelling in on:
        dest = generate_dest(parser, spelling)
        if dest is None:
            continue  # not one of generate's engine flags (a server flag, or generate's own --seed)
        if flag.kind == "bool":
            second = next((s for s in off if generate_dest(parser, s) == dest), "")
            a, b = engine_args_of_generate(parser, spelling), engine_args_of_generate(parser, second)
        else:
            va, vb, _ = OURS_SAMPLES[flag.name]
            a, b = (engine_args_of_generate(parser, f"{spelling} {shlex.quote(v)}") for v in (va, vb))
        assert getattr(a, dest) != getattr(b, dest), f"generate {spelling}: the value never reaches EngineArgs.{dest}"


# -- ignored --------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", rows("ignored"), ids=ids(rows("ignored")))
def test_ignored_rows_warn_once_naming_the_flag(flag, parser):
    on, _ = flag.option_strings()
    for spelling in on:
        _, warnings = resolve(parser, f"{spelling} {ANY_VALUE[flag.kind]}")
        assert warnings == [f"vLLM flag {flag.name} ignored: {flag.reason}"], (spelling, warnings)


# -- refused --------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", rows("refused"), ids=ids(rows("refused")))
def test_refused_rows_fail_naming_the_flag(flag, parser, capsys):
    on, off = flag.option_strings()
    for spelling in on:
        line = f"{spelling} {ANY_VALUE[flag.kind]}"
        with pytest.raises(ValueError) as err:
            resolve(parser, line)
        assert str(err.value) == f"{flag.name}: {flag.reason}", (spelling, str(err.value))
        # Before any weights: a missing model directory would otherwise be the error.
        assert main(["serve", "/nonexistent/model", *shlex.split(line)]) == 2
        assert f"error: {flag.name}: {flag.reason}" in capsys.readouterr().err
    for spelling in off:  # an on/off flag turned off asks for what happens anyway
        _, warnings = resolve(parser, spelling)
        assert warnings == [], (spelling, warnings)


# -- checked --------------------------------------------------------------------------------------


def test_every_checked_row_has_samples():
    assert set(CHECKED_SAMPLES) == set(ids(rows("checked"))), "checked rows and CHECKED_SAMPLES differ"


@pytest.mark.parametrize("flag", rows("checked"), ids=ids(rows("checked")))
def test_checked_rows_do_what_they_say(flag, parser, capsys):
    assert flag.name in CHECKED_SAMPLES, f"checked row {flag.name}: add (value, outcome) samples"
    clauses = flag.reason.split(";")
    for value, outcome in CHECKED_SAMPLES[flag.name]:
        # The row claims this outcome, in the first clause naming the value when one does.
        naming = [c for c in clauses if re.search(rf"(?<![\w-]){re.escape(value)}(?![\w-])", c)]
        assert outcome in flag.reason and all(outcome in c for c in naming[:1]), (flag.reason, value, outcome)
        for spelling in flag.option_strings()[0]:
            line = f"{spelling} {shlex.quote(value)}"
            if outcome == "refused":
                with pytest.raises(ValueError, match=f"^{re.escape(flag.name)}"):
                    resolve(parser, line)
                assert main(["serve", "/nonexistent/model", *shlex.split(line)]) == 2
                assert f"error: {flag.name}" in capsys.readouterr().err
                continue
            _, warnings = resolve(parser, line)
            if outcome == "accepted":
                assert warnings == [], (line, warnings)
            else:
                assert len(warnings) == 1 and warnings[0].startswith(f"vLLM flag {flag.name} ignored: "), warnings
