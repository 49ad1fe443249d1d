"""The output processor: core outputs (token ids) -> `RequestOutput`s (text, logprobs, n).

It owns everything about a request that is not computing tokens: one
`IncrementalDetokenizer` per sequence, stop strings (a hit finishes the sequence here and
is reported back so the core frees its blocks), `Logprob` entries, `n > 1` fan-in
(children `rid#0..rid#n-1` of parent `rid`) and the `RequestOutput`s.

Invariants:
* Work per step is O(new tokens) per sequence: new ids are appended to the sequence's
  lists, each new token's `Logprob` entry is built once and appended, the detokenizer
  decodes a bounded window. The only per-step copy is `text` (a string, as vLLM returns).
* A parent is here from `add_request` until all its sequences finished (or it is
  aborted); its sequences' finish reasons are final once set.
* A stop string beats a token stop found in the same step (the text is cut at it).
* A step may bring several ids (speculative decoding): they go through the detokenizer
  one at a time, and the ids (and logprobs) after the one that completed a stop string
  are dropped, exactly as if they had arrived one per step.
* An output parser (`musespark.parsers`, one per sequence, made by the request's factory)
  sees exactly the delta text the client would, so its deltas aggregate to the final
  message; it is fed O(new text) per step and flushed when the sequence finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ..errors import InvalidArgumentError
from ..parsers import MuseOutputParser, ParsedDelta, ParsedMessage, ReasoningTokenCounter, assemble
from ..sampling_params import SamplingParams
from .core import EngineCoreOutput
from .detokenizer import IncrementalDetokenizer
from .model_runner import TokenLogprobs
from .outputs import CompletionOutput, Logprob, RequestOutput
from .tokenizer import Tokenizer


def child_requests(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The sequences the core runs for one request: itself when n == 1, else n children
    `rid#i`; seeded children get seeds seed, seed+1, ... so they differ."""
    if params.n == 1:
        return [(request_id, params)]
    return [
        (f"{request_id}#{i}", params if params.seed is None else replace(params, seed=params.seed + i))
        for i in range(params.n)
    ]


@dataclass
class _Sequence:
    index: int
    request_id: str  # the core's id of this sequence
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    parser: MuseOutputParser | None = None
    parsed_deltas: list[ParsedDelta] = field(default_factory=list)
    message: ParsedMessage | None = None  # the deltas assembled, once, when the sequence finishes
    reasoning_counter: ReasoningTokenCounter | None = None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_Sequence]
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # indexed by prompt position
    scheduled_time: float | None = None  # the earliest first-scheduled time of its sequences

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]  # one per parent that advanced, in first-seen order
    stop_string_finished: list[tuple[str, str]]  # (core request id, stop string) for the core to finish


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._seqs: dict[str, tuple[_Parent, _Sequence]] = {}  # core request id -> its parent and sequence
        self._token_text: dict[int, str] = {}  # token id -> decoded text, for Logprob.decoded_token

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_ids: Sequence[str],
        output_parser: Callable[[], MuseOutputParser] | None = None,
    ) -> None:
        """`output_parser` makes one parser per sequence (it needs the text with special
        tokens: pass params with skip_special_tokens=False)."""
        if request_id in self._parents:
            raise InvalidArgumentError(f"request_id {request_id!r} is already in use", param="request_id")
        seqs = []
        for i, child_id in enumerate(child_ids):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    params.stop,
                    params.include_stop_str_in_output,
                    params.skip_special_tokens,
                )
            asked = params.logprobs is not None
            seq = _Sequence(
                i, child_id, detok, logprobs=[] if asked else None, cumulative_logprob=0.0 if asked else None
            )
            if output_parser is not None:
                seq.parser, seq.reasoning_counter = output_parser(), ReasoningTokenCounter()
            seqs.append(seq)
        parent = _Parent(
            request_id,
            prompt,
            prompt_token_ids,
            seqs,
            prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(prompt_token_ids),
        )
        self._parents[request_id] = parent
        for seq in seqs:
            self._seqs[seq.request_id] = (parent, seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def unfinished_child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return [] if parent is None else [s.request_id for s in parent.seqs if s.finish_reason is None]

    # -- one step -------------------------------------------------------------------
    def process_outputs(self, core_outputs: Sequence[EngineCoreOutput]) -> ProcessedOutputs:
        stopped: list[tuple[str, str]] = []
        deltas: dict[str, dict[int, tuple[str, list[int], list | None]]] = {}  # parent -> seq index -> delta
        touched: dict[str, _Parent] = {}
        for out in core_outputs:
            found = self._seqs.get(out.request_id)
            if found is None:  # aborted since the step was scheduled
                continue
            parent, seq = found
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if out.scheduled_time is not None and (
                parent.scheduled_time is None or out.scheduled_time < parent.scheduled_time
            ):
                parent.scheduled_time = out.scheduled_time
            if out.prompt_logprobs is not None and parent.prompt_logprobs is not None:
                first, entries = out.prompt_logprobs  # by position: a recomputed prompt rewrites the same slots
                for j, lp in enumerate(entries):
                    parent.prompt_logprobs[first + j] = self._logprob_entry(parent.prompt_token_ids[first + j], lp)
            if not out.new_token_ids and out.finish_reason is None:
                continue  # a prompt chunk scored, nothing generated yet
            delta = self._advance(seq, out, stopped)
            deltas.setdefault(parent.request_id, {})[seq.index] = delta
            touched[parent.request_id] = parent
        request_outputs = []
        for request_id, parent in touched.items():
            request_outputs.append(self._request_output(parent, deltas[request_id]))
            if parent.finished:
                self._drop(parent)
        return ProcessedOutputs(request_outputs, stopped)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish every unfinished sequence with "abort"; the final output, or None if unknown."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        deltas = {}
        for seq in parent.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
                text = self._flush(seq)
                self._parse(seq, text)
                deltas[seq.index] = (text, [], [] if seq.logprobs is not None else None)
        self._drop(parent)
        return self._request_output(parent, deltas)

    # -- helpers --------------------------------------------------------------------
    def _advance(
        self, seq: _Sequence, out: EngineCoreOutput, stopped: list[tuple[str, str]]
    ) -> tuple[str, list[int], list | None]:
        """Take one sequence's new tokens; return (delta text, delta ids, delta logprobs)."""
        new_ids, new_lps = out.new_token_ids, out.new_logprobs or ()
        text = ""
        if seq.detok is not None:
            if len(new_ids) == 1:
                text = seq.detok.add_tokens(new_ids)
            else:  # speculative decoding: one at a time; ids after a stop string are dropped
                for j, t in enumerate(new_ids):
                    text += seq.detok.add_tokens([t])
                    if seq.detok.finished:
                        new_ids, new_lps = new_ids[: j + 1], new_lps[: j + 1]
                        break
        seq.token_ids.extend(new_ids)
        new_entries = None
        if seq.logprobs is not None:
            new_entries = [self._logprob_entry(t, lp) for t, lp in zip(new_ids, new_lps)]
            seq.logprobs.extend(new_entries)
            seq.cumulative_logprob += sum(lp[0] for lp in new_lps)
        if seq.detok is not None:
            if seq.detok.finished:  # a stop string: it wins over a token stop in the same step
                seq.finish_reason, seq.stop_reason = "stop", seq.detok.stop_reason
                if out.finish_reason is None:
                    stopped.append((seq.request_id, seq.detok.stop_reason))
        if seq.finish_reason is None and out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        if seq.finish_reason is not None:
            text += self._flush(seq)
        elif text:
            seq.text += text
        if seq.reasoning_counter is not None:
            for t in new_ids:
                seq.reasoning_counter.add(self._decode1(t) or "")
        self._parse(seq, text)
        return text, list(new_ids), new_entries

    @staticmethod
    def _parse(seq: _Sequence, text: str) -> None:
        """Feed the step's delta text to the sequence's parser (flushing it at the end)."""
        if seq.parser is None:
            return
        delta = seq.parser.feed(text) if text else ParsedDelta()
        if seq.finish_reason is not None:
            tail = seq.parser.finish(seq.finish_reason)
            delta = ParsedDelta(
                delta.reasoning + tail.reasoning, delta.content + tail.content, delta.tool_calls + tail.tool_calls
            )
            seq.parsed_deltas.append(delta)
            seq.message = assemble(seq.parsed_deltas)
            return
        seq.parsed_deltas.append(delta)

    def _flush(self, seq: _Sequence) -> str:
        """A finished sequence's held-back text; its final text is the detokenizer's."""
        if seq.detok is None:
            return ""
        rest = seq.detok.flush()
        seq.text = seq.detok.output_text
        return rest

    def _logprob_entry(self, token: int, lp: TokenLogprobs) -> dict[int, Logprob]:
        chosen, top_ids, top_lps = lp
        entry = {
            t: Logprob(v, rank=k + 1, decoded_token=self._decode1(t)) for k, (t, v) in enumerate(zip(top_ids, top_lps))
        }
        if token not in entry:
            entry[token] = Logprob(chosen, rank=None, decoded_token=self._decode1(token))
        return entry

    def _decode1(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token)
        if text is None:  # bounded by the vocabulary
            text = self._token_text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def _request_output(self, parent: _Parent, deltas: dict[int, tuple[str, list[int], list | None]]) -> RequestOutput:
        completions = []
        for seq in parent.seqs:
            delta_text, delta_ids, delta_lps = deltas.get(seq.index, ("", [], None))
            if delta_lps is None and seq.logprobs is not None:
                delta_lps = []
            completion = CompletionOutput(
                index=seq.index,
                text=seq.text,
                token_ids=seq.token_ids,
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=seq.logprobs,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                delta_text=delta_text,
                delta_token_ids=delta_ids,
                delta_logprobs=delta_lps,
            )
            if seq.parser is not None:
                completion.delta_parsed = (
                    seq.parsed_deltas[-1] if seq.index in deltas and seq.parsed_deltas else ParsedDelta()
                )
                completion.num_reasoning_tokens = seq.reasoning_counter.count
                completion.parsed = seq.message
            completions.append(completion)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=parent.finished,
            num_cached_tokens=parent.num_cached_tokens,
            prompt_logprobs=parent.prompt_logprobs,
            scheduled_time=parent.scheduled_time,
        )

    def _drop(self, parent: _Parent) -> None:
        del self._parents[parent.request_id]
        for seq in parent.seqs:
            self._seqs.pop(seq.request_id, None)
