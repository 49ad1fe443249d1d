"""IncrementalDetokenizer: one request's output ids -> streamed text deltas, with stop strings.

Decoding (the prefix/read-offset technique of TGI and vLLM): `_ids` holds a few prompt
tokens of context followed by the output ids. `[_prefix, _read)` is a window of ids whose
text was already taken; each step decodes `ids[_prefix:]` and `ids[_prefix:_read]` and
the difference is the new text. The offsets advance only when that new text does not end
in U+FFFD, so a character whose UTF-8 bytes span several tokens is taken whole, once its
last byte arrives. The window is one taken chunk plus the new ids: O(window) per step.

Stop strings: matched on the output text only. Invariants:
* `_text_len` counts the decoded output text; `_emitted_len <= _text_len` is how much of it
  has been returned as deltas.
* While not finished and stop strings are excluded from the output, the last
  `max(len(stop)) - 1` characters are held back: they might be the start of a stop string.
* A stop string is searched for only where it could newly end: in `_tail` (the last
  `max(len(stop)) - 1` characters before the new text) plus the new text.
* Once `finished`, further ids are ignored and the text never changes.
"""

from __future__ import annotations

from collections.abc import Sequence

from .tokenizer import Tokenizer

# Prompt tokens kept as decoding context: decoders that strip a leading space (SentencePiece
# "▁") must see what came before the first output token to render it as it will read.
PROMPT_CONTEXT_TOKENS = 5

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Streams one request's output text; see the module docstring for the invariants."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise ValueError(f"stop strings must be non-empty str, got {list(stop)!r}")
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens

        self.finished = False
        self.stop_reason: str | None = None  # the stop string that ended the text, if any

        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)

        max_stop = max((len(s) for s in self.stop), default=0)
        self._tail_len = max(max_stop - 1, 0)
        # Characters held back from emission while not finished.
        self._hold = 0 if include_stop_str_in_output else self._tail_len

        self._parts: list[str] = []  # output text, in pieces; joined lazily
        self._text_len = 0
        self._emitted_len = 0
        self._tail = ""  # last _tail_len characters of the output text

    # --- public -------------------------------------------------------------------------

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Take new output ids; return the text that may be shown now (possibly "")."""
        if self.finished:
            return ""
        self._ids.extend(new_ids)
        return self._advance(self._decode_new(force=False), final=False)

    def flush(self) -> str:
        """Finish for a reason other than a stop string; return all text still held back.

        Bytes of an unfinished character are rendered as U+FFFD, as a full decode would.
        """
        if self.finished:
            return ""
        return self._advance(self._decode_new(force=True), final=True)

    @property
    def output_text(self) -> str:
        """All output text so far (emitted or held back), cut at a matched stop string."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    # --- internals ----------------------------------------------------------------------

    def _decode_new(self, force: bool) -> str:
        """Text of the ids past `_read`; "" while it would end in a partial character."""
        if self._read >= len(self._ids):
            return ""
        window = self._ids[self._prefix :]
        skip = self.skip_special_tokens
        prefix_text = self.tokenizer.decode(window[: self._read - self._prefix], skip)
        full_text = self.tokenizer.decode(window, skip)
        incomplete = full_text.endswith(REPLACEMENT_CHAR)
        if not force and (len(full_text) <= len(prefix_text) or incomplete):
            # Nothing visible yet, or the last character is still incomplete: wait.
            return ""
        new_text = full_text[len(prefix_text) :]
        # Keep the taken chunk as context for the next step; drop ids before it.
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        return new_text

    def _advance(self, new_text: str, final: bool) -> str:
        """Append `new_text`, look for stop strings, and return the emittable delta."""
        base = self._text_len - len(self._tail)  # output offset of search[0]
        search = self._tail + new_text
        if new_text:
            self._parts.append(new_text)
            self._text_len += len(new_text)
            if self._tail_len:
                self._tail = search[-self._tail_len :]

        cut = self._find_stop(search) if new_text and self.stop else None
        if cut is not None:
            pos, stop_str = cut
            end = base + pos + (len(stop_str) if self.include_stop_str_in_output else 0)
            text = self.output_text[:end]
            self._parts, self._text_len = [text], end
            self.stop_reason = stop_str
            self.finished = True
            final = True
        if final:
            self.finished = True
            limit = self._text_len
        else:
            limit = max(self._text_len - self._hold, self._emitted_len)
        if limit == self._emitted_len:
            return ""
        # Invariant: unemitted text lies within `search` (hold <= len(tail)).
        delta = search[self._emitted_len - base : limit - base]
        self._emitted_len = limit
        return delta

    def _find_stop(self, search: str) -> tuple[int, str] | None:
        """Earliest stop string in `search`; ties go to the one listed first."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = search.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best
