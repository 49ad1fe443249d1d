"""Muse channel framing: an incremental state machine over decoded text (MUSE_CHAT §3, §5).

Grammar (the first message lacks `<|start|>assistant`, which the prompt already wrote):
    msg := ["<|start|>assistant"] [ws "to=" RECIPIENT] "<|message|>" BODY END
    END := "<|eom|>" | "<|eot|>" | "<|end_of_text|>" | "<|start|>" | a header | end of text
A header may also follow a body directly: `BODY ws to=RECIPIENT<|message|>` (§4.1, second form).

Invariants:
* Every character is examined a bounded number of times: `Lexer` holds back at most a proper
  prefix of a marker (< 16 chars); `Framer` holds back at most a `to=RECIPIENT` candidate
  (<= MAX_RECIPIENT + 3 chars) and, at the start of a turn, a header of <= MAX_OPEN_HEADER chars.
* Headers, markers and framing are never passed to the sink; everything else is, exactly once.
* `flush()` releases every held-back character: nothing is lost at end of stream (§4.9).
"""

from __future__ import annotations

import re
from typing import Literal, Protocol

Channel = Literal["reasoning", "content", "drop", "tool"]

START, MESSAGE, EOM, EOT, EOS = "<|start|>", "<|message|>", "<|eom|>", "<|eot|>", "<|end_of_text|>"
MARKERS = (START, MESSAGE, EOM, EOT, EOS)
_MAX_MARKER = max(len(m) for m in MARKERS)
MAX_RECIPIENT = 256  # a longer `to=…` run is text, not a header
MAX_OPEN_HEADER = 256  # a turn-start "header" longer than this is unframed text (§4.10)

_OPEN_HEADER_PREFIX = re.compile(r"\s*(?:t|to|to=|to=[^\s<]+\s*)?")
_OPEN_HEADER = re.compile(r"\s*(?:to=([^\s<]+))?\s*")
_RECIPIENT_CHARS = re.compile(r"[^\s<]*")


def channel_of(recipient: str | None) -> Channel:
    """None/self → reasoning; user/commentary → content; developer → dropped; else a tool (§3)."""
    if recipient is None or recipient == "self":
        return "reasoning"
    if recipient in ("user", "commentary"):
        return "content"
    if recipient == "developer":
        return "drop"
    return "tool"


class Lexer:
    """Splits a text stream into ("text", s) and ("marker", m) items.

    Holds back only a trailing proper prefix of a marker. Each marker has a single `<`, at its
    start, so a failed prefix never hides the start of another marker except at that `<`."""

    def __init__(self) -> None:
        self.hold = ""
        self.ops = 0  # characters examined, for the linearity test

    def feed(self, text: str) -> list[tuple[str, str]]:
        s = self.hold + text if self.hold else text
        self.hold = ""
        n = len(s)
        self.ops += n
        out: list[tuple[str, str]] = []
        start = i = 0
        while True:
            j = s.find("<", i)
            if j < 0:
                break
            hit = next((m for m in MARKERS if s.startswith(m, j)), None)
            if hit is not None:
                if j > start:
                    out.append(("text", s[start:j]))
                out.append(("marker", hit))
                start = i = j + len(hit)
                continue
            if n - j < _MAX_MARKER:
                tail = s[j:]
                if any(m.startswith(tail) for m in MARKERS):
                    if j > start:
                        out.append(("text", s[start:j]))
                    self.hold = tail
                    return out
            i = j + 1
        if start < n:
            out.append(("text", s[start:]))
        return out

    def flush(self) -> list[tuple[str, str]]:
        h, self.hold = self.hold, ""
        return [("text", h)] if h else []


class Sink(Protocol):
    def begin(self, channel: Channel, recipient: str | None) -> None: ...
    def text(self, text: str) -> None: ...
    def end(self) -> None: ...


class Framer:
    """Turns the lexer's items into begin/text/end calls on a sink, one message at a time.

    States: "header" (collecting header text until `<|message|>`) or "body". A header opened by
    `<|start|>` is strict (anything up to `<|message|>`, dropped). A header at the start of the
    turn or after `<|eom|>`/`<|eot|>` is open: if its text stops looking like `ws to=X ws`, it was
    no header at all and becomes a content body (unframed output, §4.10)."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.lexer = Lexer()
        self.ops = 0
        self.in_body = False
        self.channel: Channel | None = None
        self.messages = 0  # bodies begun so far
        self._strict = False
        self._open_hdr = ""  # open header text (bounded by MAX_OPEN_HEADER)
        self._strict_hdr: list[str] = []  # strict header pieces (joined once, at `<|message|>`)
        self._cand = ""  # held `t` / `to` / `to=` / `to=X…` at the end of the body
        self._boundary = True  # the last body character was whitespace, or the body is empty

    # -- driving -------------------------------------------------------------------------
    def feed(self, text: str) -> None:
        for kind, val in self.lexer.feed(text):
            self._item(kind, val)

    def flush(self) -> None:
        for kind, val in self.lexer.flush():
            self._item(kind, val)
        if self.in_body:
            self._release_cand()
            self._end_body()
        self._reset_header(strict=False)

    @property
    def total_ops(self) -> int:
        return self.ops + self.lexer.ops

    # -- items ---------------------------------------------------------------------------
    def _item(self, kind: str, val: str) -> None:
        if not self.in_body:
            if kind == "text":
                self._header_text(val)
            elif val == MESSAGE:
                recipient, role_ok = self._parse_header()
                self._reset_header(strict=False)
                self._begin(channel_of(recipient) if role_ok else "drop", recipient)
            else:
                self._reset_header(strict=val == START)
            return
        if kind == "text":
            self._body_text(val)
        elif val == MESSAGE:  # a header right after the body (§4.1): `… to=X<|message|>`
            recipient = None
            if len(self._cand) > 3:
                recipient, self._cand = self._cand[3:], ""
            self._release_cand()
            self._end_body()
            self._begin(channel_of(recipient), recipient)
        else:
            self._release_cand()
            self._end_body()
            self._reset_header(strict=val == START)

    # -- headers -------------------------------------------------------------------------
    def _reset_header(self, strict: bool) -> None:
        self._strict = strict
        self._open_hdr = ""
        self._strict_hdr = []

    def _header_text(self, text: str) -> None:
        if self._strict:
            self._strict_hdr.append(text)
            self.ops += len(text)
            return
        h = self._open_hdr + text
        self.ops += len(h)
        if len(h) <= MAX_OPEN_HEADER and _OPEN_HEADER_PREFIX.fullmatch(h):
            self._open_hdr = h
            return
        self._reset_header(strict=False)  # not a header: unframed text is content
        self._begin("content", None)
        self._body_text(h)

    def _parse_header(self) -> tuple[str | None, bool]:
        """(recipient, whether the role is assistant) of the header just closed by `<|message|>`."""
        if not self._strict:
            m = _OPEN_HEADER.fullmatch(self._open_hdr)
            return (m.group(1) if m else None), True
        words = "".join(self._strict_hdr).split()
        if words and words[0] != "assistant" and not words[0].startswith("to="):
            return None, False  # another role's message: dropped
        tos = [w[3:] for w in words if w.startswith("to=") and len(w) > 3]
        return (tos[-1] if tos else None), True

    # -- bodies --------------------------------------------------------------------------
    def _begin(self, channel: Channel, recipient: str | None) -> None:
        self.in_body, self.channel = True, channel
        self.messages += 1
        self._cand, self._boundary = "", True
        self.sink.begin(channel, recipient)

    def _end_body(self) -> None:
        self.in_body = False
        self.sink.end()

    def _emit(self, text: str) -> None:
        if text:
            self._boundary = text[-1].isspace()
            self.sink.text(text)

    def _release_cand(self) -> None:
        c, self._cand = self._cand, ""
        self._emit(c)

    def _body_text(self, text: str) -> None:
        if self._cand:
            text = self._extend_cand(text)
            if not text:
                return
        k = self._cand_start(text)
        if k is None:
            self._emit(text)
        else:
            self._emit(text[:k])
            self._cand = text[k:]

    def _extend_cand(self, text: str) -> str:
        """Grow the held candidate with `text`; return the part of `text` left after it resolves."""
        c, i, n = self._cand, 0, len(text)
        while len(c) < 3 and i < n and text[i] == "to="[len(c)]:
            c += text[i]
            i += 1
        self.ops += i + 1
        if len(c) < 3:
            if i == n:
                self._cand = c
                return ""
            self._cand = c
            self._release_cand()
            return text[i:]
        j = _RECIPIENT_CHARS.match(text, i).end()
        self.ops += j - i
        c += text[i:j]
        self._cand = c
        if j == n and len(c) - 3 <= MAX_RECIPIENT:
            return ""
        self._release_cand()
        return text[j:]

    def _cand_start(self, text: str) -> int | None:
        """Start of a trailing `t`/`to`/`to=X` that begins at a word boundary, else None."""
        n = len(text)
        lim = max(-1, n - (MAX_RECIPIENT + 4))
        p = n - 1
        while p > lim and not (text[p].isspace() or text[p] == "<"):
            p -= 1
        self.ops += n - p
        if p == lim and lim >= 0:
            return None  # word longer than any recipient
        if p >= 0 and text[p] == "<":
            return None
        if p < 0 and not self._boundary:
            return None
        word = text[p + 1 :]
        if word in ("t", "to") or (word.startswith("to=") and len(word) - 3 <= MAX_RECIPIENT):
            return p + 1
        return None
