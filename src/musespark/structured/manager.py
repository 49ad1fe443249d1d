"""Structured outputs at run time: compile once per constraint (cached, off the engine loop),
then one `GrammarState` per sequence that masks the logits and follows the sampled tokens.

    manager = StructuredOutputManager(tokenizer, vocab_size)        # one per engine
    compiled = manager.compile(params.structured_outputs)          # InputProcessor.validate
    state = compiled.new_state(stop_ids)                           # EngineCore.add_request
    state.mask(adjust, row)      # before sampling (model runner)
    state.accept(token)          # after sampling (Request.append_token)

Where the grammar applies. Without `final_message_only` it constrains the output from its
first token (vLLM's behaviour). With it, a Muse turn is followed token by token:

    FREE       reasoning (or any non-final message): no constraint but the turn may not end
               (EOS ids are banned: the constrained answer is still owed). A header that
               closes (`<|message|>`) on a final recipient (`user`; a tool for tool_calls)
               switches to GRAMMAR on that recipient's body grammar. `<|start|>` switches to
               GRAMMAR on the header+body grammar ("assistant to=R<|message|>" BODY).
               `<|eom|>` switches to START.
    START      only `<|start|>` is allowed (the answer's header follows).
    GRAMMAR    xgrammar's mask; once the grammar is complete only stop ids are allowed.

Special tokens are never allowed inside a grammar (a JSON string cannot hold `<|eom|>`),
except `<|message|>` while a header is being written and the stop ids at the end. A model
whose tokenizer lacks `<|start|>`, `<|message|>` and `<|eom|>` has no channels to follow:
its grammar applies from the first token.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..layers.sampler import LogitAdjustments
from ..sampling_params import StructuredOutputsParams
from . import grammars as g

MARKERS = {"start": "<|start|>", "message": "<|message|>", "eom": "<|eom|>"}
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CACHE_SIZE = 256


@dataclass(frozen=True)
class CompiledStructure:
    """A constraint compiled for one tokenizer. `first` applies from the first token;
    `answer` after the model's `<|start|>` and `bodies[recipient]` after a final header
    (those two only with final_message_only on a model with channel markers)."""

    spec: StructuredOutputsParams
    manager: StructuredOutputManager
    first: Any = None  # xgrammar.CompiledGrammar
    answer: Any = None
    bodies: dict[str, Any] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # recipient as written -> key of bodies

    @property
    def follows_channels(self) -> bool:
        return self.first is None

    def new_state(self, stop_ids: Iterable[int]) -> GrammarState:
        """A fresh state for one sequence; `stop_ids` end it once the grammar is complete."""
        return GrammarState(self.manager, self, sorted(set(stop_ids)))


def _spec_key(spec: StructuredOutputsParams) -> str:
    return json.dumps(asdict(spec), sort_keys=True, default=str)


class StructuredOutputManager:
    """Compiles constraints for one tokenizer; thread-safe (the server compiles in worker
    threads while the engine thread steps)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.markers = {k: tokenizer.token_to_id(v) for k, v in MARKERS.items()}
        self.has_channels = all(i is not None for i in self.markers.values())
        self.special_ids = sorted(i for i in tokenizer.special_ids if 0 <= i < vocab_size)
        self._compiler: Any = None
        self._cache: OrderedDict[str, CompiledStructure] = OrderedDict()
        self._lock = threading.Lock()

    # -- compiling ---------------------------------------------------------------------------
    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = g.xgr()
                strings, kind = self.tokenizer.vocab_encoding()
                vocab_type = {
                    "byte_level": xgr.VocabType.BYTE_LEVEL,
                    "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
                    "raw": xgr.VocabType.RAW,
                }[kind]
                strings = strings[: self.vocab_size]
                info = xgr.TokenizerInfo(
                    strings, vocab_type, vocab_size=self.vocab_size, stop_token_ids=sorted(self.tokenizer.eos_token_ids)
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> CompiledStructure:
        """Compile `spec` (cached by its fields). Raises InvalidArgumentError naming the field."""
        key = _spec_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> CompiledStructure:
        compiler = self._get_compiler()
        compact = spec.disable_any_whitespace
        aliases: dict[str, str] = {}
        if spec.tool_calls is not None:
            bodies = {}
            for fn in g.tool_functions(spec.tool_calls, "tools"):
                name = fn["name"]
                bodies[name] = g.atem_body(fn, compact)
                aliases.update({name: name, f"{name}.{name}": name})
        else:
            bodies = {"user": g.body_grammar(spec)}
            aliases["user"] = "user"
        try:
            if spec.final_message_only and self.has_channels:
                return CompiledStructure(
                    spec,
                    self,
                    answer=compiler.compile_grammar(g.with_header("assistant to=", bodies)),
                    bodies={r: compiler.compile_grammar(b) for r, b in bodies.items()},
                    aliases=aliases,
                )
            first = g.with_header(" to=", bodies) if spec.tool_calls is not None else bodies["user"]
            return CompiledStructure(spec, self, first=compiler.compile_grammar(first))
        except InvalidArgumentError:
            raise
        except Exception as exc:  # a grammar that parsed but does not compile
            raise InvalidArgumentError(
                f"structured_outputs: the grammar engine cannot compile it: {g._reason(exc)}",
                param="structured_outputs",
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


FREE, START, GRAMMAR, DONE = "free", "start", "grammar", "done"


class GrammarState:
    """One sequence's place in its constraint (see the module docstring)."""

    def __init__(self, manager: StructuredOutputManager, compiled: CompiledStructure, stop_ids: list[int]) -> None:
        self.manager, self.compiled, self.stop_ids = manager, compiled, stop_ids
        self._matcher: Any = None
        self._in_header = False  # GRAMMAR: the header ("... to=R<|message|>") is not written yet
        self._header: list[int] = []  # FREE: ids of the header being written
        self._header_open = True  # FREE: the prompt ends with "<|start|>assistant"
        self.phase = FREE
        if not compiled.follows_channels:
            self._enter(compiled.first, in_header=compiled.spec.tool_calls is not None)

    def _enter(self, grammar: Any, in_header: bool) -> None:
        self._matcher = g.xgr().GrammarMatcher(grammar, override_stop_tokens=self.stop_ids)
        self._in_header = in_header
        self.phase = GRAMMAR

    @property
    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()

    # -- before sampling -------------------------------------------------------------------------
    def mask(self, adjust: LogitAdjustments, row: int) -> None:
        if self.phase == FREE:
            adjust.forbid(row, self.stop_ids)
        elif self.phase == START:
            adjust.allow_only(row, [self.manager.markers["start"]])
        elif self.phase == GRAMMAR:
            adjust.allow_only(row, self._grammar_mask())

    def _grammar_mask(self) -> torch.Tensor:
        """Bool [V]: what the matcher allows, special tokens out (see the module docstring)."""
        xgr = g.xgr()
        V = self.manager.vocab_size
        bitmask = xgr.allocate_token_bitmask(1, V)
        self._matcher.fill_next_token_bitmask(bitmask)
        allowed = unpack_bitmask(bitmask[0], V)
        keep = set(self.stop_ids)
        if self._in_header:
            keep.add(self.manager.markers["message"])
        banned = [i for i in self.manager.special_ids if i not in keep]
        if banned:
            allowed[banned] = False
        return allowed

    # -- after sampling -----------------------------------------------------------------------
    def accept(self, token: int) -> None:
        m = self.manager.markers
        if self.phase == GRAMMAR:
            if not self._matcher.accept_token(token):
                # Only a token outside the mask gets here (another constraint forced it):
                # stop constraining rather than fail the request.
                self.phase = DONE
                return
            if token == m["message"]:
                self._in_header = False
            if self._matcher.is_terminated():
                self.phase = DONE
        elif self.phase == START:  # only <|start|> was allowed
            if token == m["start"]:
                self._enter(self.compiled.answer, in_header=True)
            else:
                self.phase = FREE
        elif self.phase == FREE:
            self._free(token)

    def _free(self, token: int) -> None:
        m = self.manager.markers
        if token == m["start"]:
            self._enter(self.compiled.answer, in_header=True)
        elif token == m["eom"]:
            self._header_open = False
            self.phase = START
        elif token == m["message"] and self._header_open:
            found = _RECIPIENT.findall(self.manager.decode(self._header))
            key = self.compiled.aliases.get(found[-1]) if found else None
            self._header, self._header_open = [], False
            if key is not None:
                self._enter(self.compiled.bodies[key], in_header=False)
        elif self._header_open:
            self._header.append(token)


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask [ceil(V/32)] (bit j of word w = token 32*w + j) -> bool [V]."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (words.to(torch.int32)[:, None] >> shifts) & 1  # [W, 32]
    return bits.reshape(-1)[:vocab_size].bool()
