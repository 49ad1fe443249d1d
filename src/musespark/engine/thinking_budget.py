"""`thinking_token_budget` on the Muse reasoning channel: after N tokens of reasoning, end the
reasoning message and open the answer (docs/muse_chat.md §2, §3).

A Muse turn is a run of messages `<|start|>assistant to=R<|message|>BODY<|eom|>`; R = `self`
(or a bare `<|message|>` header) is reasoning. The prompt ends with `<|start|>assistant`, so
the first header is already open. `ThinkingBudget` follows the sampled tokens:

* it counts the body tokens of every reasoning message (the budget is for the whole turn);
* once the count reaches the budget inside a reasoning body (or a reasoning body opens with
  the budget spent), the next tokens are forced, one per step: `<|eom|>`, then the answer's
  header `<|start|>assistant to=user<|message|>`; then the model writes the answer freely;
* a token other than the forced one (another constraint won) drops the forcing.

`plan_for(tokenizer)` is None for a tokenizer without the channel markers: the budget then
has nothing to end and is ignored. The state has a grammar's interface (`mask`, `accept`), so
the engine runs it as one (`Steering` chains it with a structured-output grammar).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_RECIPIENT = re.compile(r"to=([^\s<]+)")
ANSWER_HEADER = "<|start|>assistant to=user<|message|>"


@dataclass(frozen=True)
class BudgetPlan:
    """What the budget needs from a tokenizer: the marker ids, the tokens that end a
    reasoning message and open the answer, and a decoder for header text."""

    start: int
    message: int
    ends: frozenset[int]  # <|eom|>, <|eot|>, <|end_of_text|>: a body ends
    forced: tuple[int, ...]  # <|eom|> + the answer's header
    decode: Callable[[list[int]], str]

    def new_state(self, budget: int) -> ThinkingBudget:
        return ThinkingBudget(self, budget)


def plan_for(tokenizer: Any) -> BudgetPlan | None:
    """The plan for a tokenizer with Muse channel markers, else None."""
    if tokenizer is None:
        return None
    ids = {name: tokenizer.token_to_id(name) for name in ("<|start|>", "<|message|>", "<|eom|>", "<|eot|>")}
    if any(v is None for v in ids.values()):
        return None
    ends = {ids["<|eom|>"], ids["<|eot|>"]}
    eot = tokenizer.token_to_id("<|end_of_text|>")
    if eot is not None:
        ends.add(eot)
    header = list(tokenizer.encode(ANSWER_HEADER, add_special_tokens=False))
    return BudgetPlan(
        start=ids["<|start|>"],
        message=ids["<|message|>"],
        ends=frozenset(ends),
        forced=(ids["<|eom|>"], *header),
        decode=lambda t: tokenizer.decode(t, skip_special_tokens=False),
    )


class ThinkingBudget:
    """One sequence's reasoning count and forced tokens (see the module docstring)."""

    def __init__(self, plan: BudgetPlan, budget: int) -> None:
        self.plan, self.budget = plan, budget
        self.used = 0  # reasoning body tokens so far
        self._header: list[int] | None = []  # ids of the open header (None: inside a body)
        self._reasoning = False  # inside a reasoning body
        self._queue: list[int] = []  # tokens still to force

    def mask(self, adjust: Any, row: int) -> None:
        if self._queue:
            adjust.allow_only(row, [self._queue[0]])

    def accept(self, token: int) -> None:
        p = self.plan
        if self._queue:
            if token == self._queue[0]:
                self._queue.pop(0)
                if not self._queue:  # the answer's header is written: its body follows
                    self._header, self._reasoning = None, False
                return
            self._queue = []
        if self._header is not None:
            if token == p.message:
                found = _RECIPIENT.findall(p.decode(self._header))
                self._header, self._reasoning = None, (not found or found[-1] == "self")
                self._check()
            elif token == p.start:
                self._header = []
            else:
                self._header.append(token)
        elif token == p.start:
            self._header, self._reasoning = [], False
        elif token in p.ends:
            self._reasoning = False
        elif self._reasoning:
            self.used += 1
            self._check()

    def _check(self) -> None:
        if self._reasoning and self.used >= self.budget:
            self._queue = list(self.plan.forced)


class Steering:
    """Several per-sequence constraints run as one grammar: each masks, each follows."""

    def __init__(self, parts: Sequence[Any]) -> None:
        self.parts = list(parts)

    def mask(self, adjust: Any, row: int) -> None:
        for part in self.parts:
            part.mask(adjust, row)

    def accept(self, token: int) -> None:
        for part in self.parts:
            part.accept(token)
