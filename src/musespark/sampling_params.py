"""SamplingParams: how one request turns logits into tokens, with vLLM's names and defaults.

Field meanings follow vLLM's `SamplingParams`; only the fields this engine honours exist.
Every field is checked in `__post_init__`; a bad value raises `InvalidArgumentError` (a
ValueError) whose message names the argument and the value and whose `.param` is the field
name. `stop` and `stop_token_ids` are normalized to lists.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import InvalidArgumentError

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _bad(name: str, value: Any, want: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{name} must be {want}, got {value!r}", param=name)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (vLLM field names, defaults and meanings)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None  # normalized to list[str]
    stop_token_ids: list[int] | None = None  # normalized to list[int]
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs besides the chosen token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Over 60 lines on purpose: one check per field, in field order, so every rule and
        # its message read in one place.
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731

        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "an int >= 1")
        set_("n", int(self.n))

        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            v = getattr(self, name)
            if not _is_real(v) or not (lo <= v <= hi):
                raise _bad(name, v, f"a float in [{lo}, {hi}]")
            set_(name, float(v))

        rp = self.repetition_penalty
        if not _is_real(rp) or not math.isfinite(rp) or not rp > 0:
            raise _bad("repetition_penalty", rp, "a finite float > 0")
        set_("repetition_penalty", float(rp))

        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or not t >= 0:
            raise _bad("temperature", t, "a finite float >= 0")
        set_("temperature", float(t))

        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise _bad("top_p", self.top_p, "a float in (0, 1]")
        set_("top_p", float(self.top_p))

        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or self.top_k >= 1):
            raise _bad("top_k", self.top_k, "an int: -1 or 0 (disabled) or >= 1")
        set_("top_k", int(self.top_k))

        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise _bad("min_p", self.min_p, "a float in [0, 1]")
        set_("min_p", float(self.min_p))

        if self.seed is not None:
            if not _is_int(self.seed):
                raise _bad("seed", self.seed, "None or an int")
            set_("seed", int(self.seed))

        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stop = list(stop)
        else:
            raise _bad("stop", self.stop, "None, a str or a list of str")
        if any(s == "" for s in stop):
            raise _bad("stop", self.stop, "non-empty strings")
        set_("stop", stop)

        ids = self.stop_token_ids
        if ids is None:
            ids = []
        elif not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "None or a list of ints >= 0")
        set_("stop_token_ids", [int(i) for i in ids])

        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise _bad(name, v, "a bool")

        mt = self.max_tokens
        if mt is not None:
            if not _is_int(mt) or mt < 1:
                raise _bad("max_tokens", mt, "None or an int >= 1")
            set_("max_tokens", int(mt))

        mn = self.min_tokens
        if not _is_int(mn) or mn < 0:
            raise _bad("min_tokens", mn, "an int >= 0")
        if self.max_tokens is not None and mn > self.max_tokens:
            raise _bad("min_tokens", mn, f"<= max_tokens ({self.max_tokens})")
        set_("min_tokens", int(mn))

        lp = self.logprobs
        if lp is not None:
            if not _is_int(lp) or lp < 0:
                raise _bad("logprobs", lp, "None or an int >= 0")
            set_("logprobs", int(lp))

    @property
    def greedy(self) -> bool:
        """True when the request always takes the argmax (temperature ~0 or top_k == 1)."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a mapping; unknown keys are refused (the offline API must not drop them)."""
        if not isinstance(d, Mapping):
            raise InvalidArgumentError(f"SamplingParams.from_dict needs a mapping, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise UnknownArgumentError(f"unknown sampling parameter(s): {', '.join(unknown)}", unknown[0])
        return cls(**d)


class UnknownArgumentError(InvalidArgumentError, TypeError):
    """An unknown keyword: an InvalidArgumentError (our contract) that is also the TypeError
    Python raises for a bad keyword, so either `except` catches it. `.param` is the first
    unknown name."""


def _refuse_unknown_keywords(cls: type) -> None:
    init = cls.__init__
    known = {f.name for f in dataclasses.fields(cls)}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(k for k in kwargs if k not in known)
        if unknown:
            raise UnknownArgumentError(f"unknown sampling parameter(s): {', '.join(unknown)}", unknown[0])
        init(self, *args, **kwargs)

    __init__.__doc__ = init.__doc__
    cls.__init__ = __init__


_refuse_unknown_keywords(SamplingParams)
