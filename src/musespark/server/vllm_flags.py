"""`vllm serve` command lines, accepted as they are: the flags of vLLM's `serve` that are not
ours are registered and checked here, from the table in vllm_flags_table.py.

    add_vllm_compat_args(parser)     # registers the flags that are not ours (dest "vllm_...")
    check_vllm_compat(args, log)     # before loading weights: raises ValueError for a refused
                                     # flag, logs one warning line per ignored flag given

A `checked` row's rule is a function of `CHECKS`: given the value, it returns None (fine), or
an "ignored: REASON" / "refused: REASON" disposition. A flag vLLM does not have either still
fails with argparse's usual error.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..cli_parsing import human_readable_int, human_readable_int_or_auto
from .vllm_flags_table import BY_NAME, VLLM_SERVE_FLAGS, VllmFlag

__all__ = [
    "BY_NAME",
    "CHECKS",
    "VLLM_GROUP",
    "VLLM_SERVE_FLAGS",
    "EnableDisable",
    "VllmFlag",
    "add_vllm_compat_args",
    "check_vllm_compat",
    "human_readable_int",
    "human_readable_int_or_auto",
    "parse_override_generation_config",
]


# -- argparse pieces ------------------------------------------------------------------------
class EnableDisable(argparse.Action):
    """A vLLM on/off flag: give the `on` spellings; `--no-X` and `--enable-`/`--disable-`
    opposites are registered as well and store False."""

    def __init__(self, option_strings: Sequence[str], dest: str, default: Any = None, **kwargs: Any) -> None:
        flag = VllmFlag(tuple(option_strings), "bool", "ours")
        on, off = flag.option_strings()
        self.off = frozenset(off)
        super().__init__(on + off, dest, nargs=0, default=default, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, option_string not in self.off)


class _Set(argparse.Action):
    """An extra spelling of an existing on/off flag: stores `const` into its dest."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, self.const)


_DTYPE_ALIASES = {"half": "float16", "float": "float32"}

# The title of the group holding vLLM's flags (`serve --help=vllm` shows it; plain --help hides it).
VLLM_GROUP = "vllm"

_NARGS = {"flag": 0, "optional": "?", "list": "+"}


def add_vllm_compat_args(parser: argparse.ArgumentParser) -> None:
    """Register every vLLM serve flag that is not ours (dest `vllm_*`, default None), the
    vLLM spellings missing from our on/off flags, and vLLM's dtype aliases (`--dtype half`;
    `--max-model-len 32k|auto` is EngineArgs' own syntax). Call after the parser's own flags."""
    known = parser._option_string_actions
    group = parser.add_argument_group(
        VLLM_GROUP, "vLLM flags accepted for compatibility: each is ours, ignored with a warning, or refused"
    )
    for flag in VLLM_SERVE_FLAGS:
        on, off = flag.option_strings()
        if flag.action == "ours":
            if flag.kind == "bool":  # e.g. --disable-prefix-caching for EngineArgs' --enable-prefix-caching
                dest = known[flag.name].dest
                for spelling, value in [(s, True) for s in on] + [(s, False) for s in off]:
                    if spelling not in known:
                        parser.add_argument(spelling, dest=dest, action=_Set, const=value, help=argparse.SUPPRESS)
            else:  # vLLM's short aliases of ours (-tp, -pp)
                action = known[flag.name]
                for spelling in on:
                    if spelling not in known:
                        parser.add_argument(spelling, dest=action.dest, type=action.type, help=argparse.SUPPRESS)
            continue
        kwargs: dict[str, Any] = {"dest": flag.dest, "default": None, "help": flag.disposition}
        if flag.kind not in ("bool", "flag"):
            kwargs["metavar"] = "VALUE"
        if flag.kind == "bool":
            group.add_argument(*on, action=EnableDisable, **kwargs)
        elif flag.kind == "flag":
            group.add_argument(*on, action="store_const", const=True, **kwargs)
        elif flag.kind == "append":
            group.add_argument(*on, action="append", **kwargs)
        else:
            if flag.kind == "optional":
                kwargs["const"] = True
            group.add_argument(*on, nargs=_NARGS.get(flag.kind), **kwargs)
    if "--dtype" in known:
        known["--dtype"].type = lambda v: _DTYPE_ALIASES.get(v, v)


# -- start-up checks ------------------------------------------------------------------------
def _check_parallel(flag: VllmFlag, value: Any) -> str | None:
    """Data and context parallelism (-dp, -dcp, -pcp): size 1 is what runs; more is refused.
    Tensor, pipeline and expert parallelism are ours (-tp, -pp, -ep)."""
    kind = "data" if flag.name == "--data-parallel-size" else "context"
    try:
        size = int(value)
    except ValueError:
        return f"refused: takes an integer, got {value!r}"
    if size == 1:
        return None
    return (
        f"refused: {kind} parallelism is not implemented (got {size}; tensor, pipeline and expert "
        "parallelism are: -tp, -pp, -ep)"
    )


def _check_executor_backend(flag: VllmFlag, value: Any) -> str | None:
    if value in ("mp", "external_launcher"):
        return None  # spawned workers; or ranks a launcher started (detected from its environment)
    return f"refused: only mp (local workers) and external_launcher (torchrun) are implemented, got {value!r}"


def _check_quantization(flag: VllmFlag, value: Any) -> str | None:
    if value in ("modelopt_fp4", "modelopt"):
        return None  # an NVFP4 checkpoint: its own quantization config is read (musespark.quant.config)
    return f"ignored: quantization {value!r} is not applied; the checkpoint's weights are used as stored"


def _check_structured_outputs(flag: VllmFlag, value: Any) -> str | None:
    try:
        config = json.loads(value)
    except json.JSONDecodeError:
        config = None
    backend = config.get("backend", "auto") if isinstance(config, dict) else None
    if isinstance(config, dict) and set(config) <= {"backend"} and backend in ("auto", "xgrammar"):
        return None  # our structured outputs use xgrammar
    return "ignored: only the built-in (xgrammar) structured outputs backend exists; settings not applied"


# The rule of every `checked` row: value -> None (fine) or an "ignored: ..." / "refused: ..." disposition.
CHECKS: dict[str, Callable[[VllmFlag, Any], str | None]] = {
    "--distributed-executor-backend": _check_executor_backend,
    "--data-parallel-size": _check_parallel,
    "--decode-context-parallel-size": _check_parallel,
    "--prefill-context-parallel-size": _check_parallel,
    "--quantization": _check_quantization,
    "--structured-outputs-config": _check_structured_outputs,
}


def check_vllm_compat(args: argparse.Namespace, log: logging.Logger | None = None) -> None:
    """Before loading weights: raise ValueError naming the first refused flag given; log one
    warning line per ignored flag given."""
    log = log or logging.getLogger("musespark.server")
    warnings = []
    for flag in VLLM_SERVE_FLAGS:
        if flag.action == "ours":
            continue
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        disposition = CHECKS[flag.name](flag, value) if flag.action == "checked" else flag.disposition
        if disposition is None:
            continue
        action, reason = disposition.split(":", 1)
        if action == "refused":
            if flag.kind == "bool" and value is False:
                continue  # turned off: what we do anyway
            raise ValueError(f"{flag.name}: {reason.strip()}")
        warnings.append(f"vLLM flag {flag.name} ignored: {reason.strip()}")
    for line in warnings:
        log.warning(line)


# vLLM's --override-generation-config keys (generation_config.json names) -> SamplingParams fields.
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def parse_override_generation_config(value: str | None, log: logging.Logger | None = None) -> dict[str, Any]:
    """--override-generation-config JSON (generation_config.json keys) -> SamplingParams
    defaults to lay over the checkpoint's. Bad JSON is a ValueError; keys other than
    temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens get one warning."""
    if value is None:
        return {}
    try:
        data = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--override-generation-config is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("--override-generation-config must be a JSON object")
    unknown = sorted(set(data) - set(_GENERATION_KEYS))
    if unknown:
        (log or logging.getLogger("musespark.server")).warning(
            f"--override-generation-config: key(s) {unknown} ignored (supported: {sorted(_GENERATION_KEYS)})"
        )
    return {_GENERATION_KEYS[k]: v for k, v in data.items() if k in _GENERATION_KEYS and v is not None}
