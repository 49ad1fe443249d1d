"""SamplingParams: how one request turns logits into tokens, with vLLM's names and defaults.

Field meanings follow vLLM's `SamplingParams`; only the fields this engine honours exist.
Every field is checked in `__post_init__`; a bad value raises `InvalidArgumentError` (a
ValueError) whose message names the argument and the value and whose `.param` is the field
name. `stop` and `stop_token_ids` are normalized to lists.

Logit controls (vLLM's names and meanings): `logit_bias` {token id: bias in [-100, 100]} is
added to the logits; `allowed_token_ids` gives every other token -inf; `bad_words` bans the
last token of a word's token sequence whenever the output so far ends with the rest of it
(a one-token word is always banned). Out-of-vocabulary ids are refused by
`InputProcessor.validate`, which also tokenizes `bad_words` (`update_from_tokenizer`).

Structured outputs (`structured_outputs=StructuredOutputsParams(json=SCHEMA)`, vLLM's
names): the output is constrained to a JSON schema, any JSON object, a regular expression,
one of a list of strings, an EBNF/Lark grammar, or (musespark's extension, used for
`tool_choice`) an ATEM call to one of a list of tools. `InputProcessor.validate` compiles the
grammar (a compile error names `structured_outputs`); the sampler masks every token the
grammar does not allow.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
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


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "tool_calls")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's `StructuredOutputsParams`; exactly one kind is set).

    json: a JSON schema (dict or JSON text). json_object: any JSON object. regex: a regular
    expression the whole output matches. choice: the output is exactly one of these strings.
    grammar: an EBNF grammar (xgrammar's dialect, `root ::= ...`) or a Lark grammar.
    tool_calls: musespark's extension for `tool_choice`: a list of OpenAI tool definitions
    (`{"type": "function", "function": {...}}`); the output is one ATEM call to one of them,
    in its tool channel, whose parameters follow the tool's JSON schema.

    disable_any_whitespace: JSON is written compactly (one space after `:` and `,`, no
    newlines). True by default, unlike vLLM: given any whitespace, small models fill JSON
    with newlines until max_tokens (MUSE_CHAT §8). False gives xgrammar's any-whitespace JSON.
    final_message_only: the constraint applies to the final message of a Muse turn (the
    `to=user` answer, or the tool channel for `tool_calls`); the reasoning before it is free.
    The server sets it when `--reasoning-parser` is on; False constrains from the first token.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    tool_calls: list[dict] | None = None
    disable_any_whitespace: bool = True
    final_message_only: bool = False

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        param = "structured_outputs"
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidArgumentError(
                f"{param} needs exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                f"{', '.join(given) if given else 'none'}",
                param=param,
            )
        if self.json is not None and not isinstance(self.json, (str, Mapping)):
            raise _bad(f"{param}.json", self.json, "a JSON schema (an object or its JSON text)")
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            raise _bad(f"{param}.regex", self.regex, "a non-empty string")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            raise _bad(f"{param}.grammar", self.grammar, "a non-empty grammar string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise _bad(f"{param}.choice", self.choice, "a non-empty list of non-empty strings")
            set_("choice", list(self.choice))
        if self.json_object not in (None, True, False):
            raise _bad(f"{param}.json_object", self.json_object, "a bool")
        if self.tool_calls is not None and not (isinstance(self.tool_calls, (list, tuple)) and self.tool_calls):
            raise _bad(f"{param}.tool_calls", self.tool_calls, "a non-empty list of tool definitions")
        for name in ("disable_any_whitespace", "final_message_only"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(f"{param}.{name}", getattr(self, name), "a bool")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


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
    prompt_logprobs: int | None = None  # per prompt token: its logprob and this many top ones
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # non-empty; every other token is banned
    bad_words: list[str] | None = None  # banned words (see the module docstring)
    structured_outputs: StructuredOutputsParams | None = None  # a dict is converted
    # Muse reasoning: after this many tokens of `to=self` messages the message is ended and the
    # answer begins (engine/thinking_budget.py); None: no limit.
    thinking_token_budget: int | None = None
    # Set by `update_from_tokenizer` (vLLM's private field of the same name): the token
    # sequences that `bad_words` ban. A field, so `dataclasses.replace` (n > 1 children) keeps it.
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)
    # Set by `InputProcessor.validate`: `structured_outputs` compiled for this model's
    # tokenizer (musespark.structured.CompiledStructure); n > 1 children share it.
    _compiled_grammar: Any = field(default=None, repr=False, compare=False)
    # Set by `InputProcessor.validate` with thinking_token_budget: the tokenizer's
    # engine.thinking_budget.BudgetPlan (None: the model has no reasoning channel to end).
    _thinking_plan: Any = field(default=None, repr=False, compare=False)

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

        for name in ("logprobs", "prompt_logprobs"):
            lp = getattr(self, name)
            if lp is not None:
                if not _is_int(lp) or lp < 0:
                    raise _bad(name, lp, "None or an int >= 0")
                set_(name, int(lp))

        tb = self.thinking_token_budget
        if tb is not None:
            if not _is_int(tb) or tb < 0:
                raise _bad("thinking_token_budget", tb, "None or an int >= 0")
            set_("thinking_token_budget", int(tb))

        self._check_logit_controls()

    def _check_logit_controls(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731

        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, Mapping):
                raise _bad("logit_bias", bias, "None or a dict {token id: bias}")
            for k, v in bias.items():
                if not _is_int(k) or k < 0:
                    raise _bad("logit_bias", bias, f"a dict with int token ids >= 0 as keys (got key {k!r})")
                if not _is_real(v) or not (-100.0 <= v <= 100.0):
                    raise _bad("logit_bias", bias, f"a dict with biases in [-100, 100] (got {v!r} for {k})")
            set_("logit_bias", {int(k): float(v) for k, v in bias.items()} or None)

        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(i) and i >= 0 for i in ids):
                raise _bad("allowed_token_ids", ids, "None or a non-empty list of ints >= 0")
            set_("allowed_token_ids", [int(i) for i in ids])

        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
                raise _bad("bad_words", words, "None or a list of strings that are not blank")
            set_("bad_words", list(words) or None)

        seqs = self._bad_words_token_ids
        if seqs is not None:
            if not isinstance(seqs, (list, tuple)) or not all(
                isinstance(s, (list, tuple)) and s and all(_is_int(t) and t >= 0 for t in s) for s in seqs
            ):
                raise _bad("bad_words", seqs, "tokenized as non-empty lists of ints >= 0")
            set_("_bad_words_token_ids", [[int(t) for t in s] for s in seqs])

        so = self.structured_outputs
        if isinstance(so, Mapping):
            unknown = sorted(
                str(k) for k in so if k not in {f.name for f in dataclasses.fields(StructuredOutputsParams)}
            )
            if unknown:
                raise InvalidArgumentError(
                    f"structured_outputs has unknown key(s): {', '.join(unknown)}", param="structured_outputs"
                )
            set_("structured_outputs", StructuredOutputsParams(**so))
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            raise _bad("structured_outputs", so, "None, a StructuredOutputsParams or a dict of its fields")

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize `bad_words` into `_bad_words_token_ids` as vLLM does: each word (left-
        stripped) without and then with a leading space, `add_special_tokens=False`; the
        spaced form counts only when it is a different token sequence of the same length
        (a new word token, not the bare word split differently). Idempotent."""
        seqs: list[list[int]] = []
        for word in self.bad_words or ():
            for prefix in ("", " "):
                ids = list(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
                if not ids:
                    raise _bad("bad_words", word, "a word the tokenizer encodes to at least one token")
                if not prefix or (ids[0] != seqs[-1][0] and len(ids) == len(seqs[-1])):
                    seqs.append(ids)
        object.__setattr__(self, "_bad_words_token_ids", seqs or None)

    @property
    def has_logit_controls(self) -> bool:
        """True when the request adds to or masks the logits (logit_bias, allowed_token_ids,
        tokenized bad_words); the sampler builds its bias tensor only for such rows."""
        return bool(self.logit_bias or self.allowed_token_ids or self._bad_words_token_ids)

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
