"""The sampler: one batched pass from fp32 logits [B, V] to one token per row.

Order (vLLM's v1 sampler): the logit adjustments (allowed_token_ids, bad_words, the
min_tokens stop mask, logit_bias: one additive [B, V] tensor, see `LogitAdjustments`) ->
penalties -> greedy rows take argmax; the other rows divide by temperature, apply top-k,
top-p, min-p, then draw. logit_bias is thus added before the penalties and before the
temperature divides, as vLLM's logit-bias processor is.

Drawing uses the exponential race: with q ~ Exponential(1) per token,
argmax(probs / q) is a sample from probs. A seeded row draws its q (shape [V]) from
its own `torch.Generator`, so its tokens depend only on its seed, its logits and how
many steps the generator has already served — never on the rest of the batch.
Unseeded rows draw from the global RNG.

Reported logprobs are those of the raw logits (log_softmax before the adjustments,
penalties and temperature), as vLLM reports by default (logprobs_mode="raw_logprobs"): a
token forced by logit_bias reports the model's own logprob for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from ..sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters as tensors; build once per step with `build`."""

    temperature: torch.Tensor  # [B] fp32; 1.0 on greedy rows (never divides by ~0)
    top_p: torch.Tensor  # [B] fp32 in (0, 1]
    top_k: torch.Tensor  # [B] int64 in [1, V]; V where disabled
    min_p: torch.Tensor  # [B] fp32 in [0, 1]
    presence_penalty: torch.Tensor  # [B] fp32
    frequency_penalty: torch.Tensor  # [B] fp32
    repetition_penalty: torch.Tensor  # [B] fp32
    greedy: torch.Tensor  # [B] bool
    generators: list[torch.Generator | None]  # [B]; seeded rows only
    num_logprobs: list[int | None]  # [B]; top logprobs each row asked for
    sampled_rows: list[int]  # rows that are not greedy (host-side, no device sync)
    max_top_k: int  # largest top_k over sampled rows (V if any has top-k disabled)
    # Penalty state; None when no row has a penalty (the common case skips the [B, V] work).
    output_counts: torch.Tensor | None  # [B, V] fp32: times each token appears in the output
    seen_mask: torch.Tensor | None  # [B, V] bool: token appears in prompt or output
    # Host-side flags so `sample` skips work no row needs.
    all_greedy: bool
    any_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    need_penalties: bool

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @property
    def max_num_logprobs(self) -> int | None:
        asked = [k for k in self.num_logprobs if k is not None]
        return max(asked) if asked else None

    @classmethod
    def build(  # over 60 lines: one pass mapping each SamplingParams field to its batch tensor, kept together
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        generators: list[torch.Generator | None],
        *,
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """Gather row parameters into tensors. All lists are indexed by batch row.

        `generators[i]` must be a generator on `device` for a seeded row (the engine makes
        it once per request from `params[i].seed` and keeps it across steps), None otherwise.
        """
        B, V = len(params), vocab_size
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == B):
            raise ValueError(
                f"batch lists disagree in length: params={B}, prompts={len(prompt_token_ids)}, "
                f"outputs={len(output_token_ids)}, generators={len(generators)}"
            )
        if B == 0:
            raise ValueError("SamplingBatch.build needs at least one row")

        greedy = [p.greedy for p in params]
        top_k = [V if p.top_k <= 0 else min(p.top_k, V) for p in params]
        need_penalties = any(penalized(p) for p in params)
        sampled = [not g for g in greedy]  # top-k/p and min-p only matter on sampled rows

        output_counts = seen_mask = None
        if need_penalties:
            output_counts = _token_counts(output_token_ids, V, device)
            seen_mask = (_token_counts(prompt_token_ids, V, device) > 0) | (output_counts > 0)

        # The float fields as the rows of one tensor (one small op, not six: each costs 10-30 µs
        # in a decode step whose weights just streamed through the CPU's caches).
        temperature, top_p, min_p, presence, frequency, repetition = torch.tensor(
            [
                [1.0 if g else p.temperature for p, g in zip(params, greedy)],
                [p.top_p for p in params],
                [p.min_p for p in params],
                [p.presence_penalty for p in params],
                [p.frequency_penalty for p in params],
                [p.repetition_penalty for p in params],
            ],
            dtype=torch.float32,
            device=device,
        )
        return cls(
            temperature=temperature,
            top_p=top_p,
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            min_p=min_p,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            generators=list(generators),
            num_logprobs=[p.logprobs for p in params],
            sampled_rows=[i for i, g in enumerate(greedy) if not g],
            max_top_k=max((k for s, k in zip(sampled, top_k) if s), default=V),
            output_counts=output_counts,
            seen_mask=seen_mask,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            need_top_k=any(s and k < V for s, k in zip(sampled, top_k)),
            need_top_p=any(s and p.top_p < 1.0 for s, p in zip(sampled, params)),
            need_min_p=any(s and p.min_p > 0.0 for s, p in zip(sampled, params)),
            need_penalties=need_penalties,
        )


def penalized(p: SamplingParams) -> bool:
    """Whether a request's logits get presence, frequency or repetition penalties."""
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _token_counts(token_ids: list[list[int]], V: int, device: torch.device | str) -> torch.Tensor:
    """[B, V] fp32 count of each token id per row."""
    B = len(token_ids)
    counts = torch.zeros(B, V, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(t) for t in token_ids], device=device)
    if int(lengths.sum()) == 0:
        return counts
    ids = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.int64, device=device)
    if int(ids.min()) < 0 or int(ids.max()) >= V:
        raise ValueError(f"token ids must lie in [0, {V}), got min {int(ids.min())} max {int(ids.max())}")
    rows = torch.repeat_interleave(torch.arange(B, device=device), lengths)
    counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
    return counts


class LogitAdjustments:
    """One additive fp32 tensor [B, V] for the batch, added to the logits before penalties.

    The representation is an additive bias, not a boolean mask: 0 = untouched, a finite
    value = logit_bias, -inf = forbidden (allowed_token_ids, bad_words, the min_tokens stop
    mask). It is allocated on the first row that asks and stays None otherwise, so a batch
    where no request asks costs nothing. Every operation is commutative (adds, and -inf
    absorbs), so rows may be filled in any order. Structured output reuses it: a per-row
    boolean "allowed" bitmask [V] goes through `allow_only(row, mask)`, which sets -inf
    wherever the mask is False.
    """

    def __init__(self, batch_size: int, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.batch_size, self.vocab_size, self.device = batch_size, vocab_size, device
        self.tensor: torch.Tensor | None = None

    def _get(self) -> torch.Tensor:
        if self.tensor is None:
            self.tensor = torch.zeros(self.batch_size, self.vocab_size, dtype=torch.float32, device=self.device)
        return self.tensor

    def _ids(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(ids), dtype=torch.int64, device=self.device)

    def forbid(self, row: int, ids: Sequence[int]) -> None:
        """Token ids `ids` get -inf in `row` (ids outside [0, V) are ignored)."""
        ids = [t for t in ids if 0 <= t < self.vocab_size]
        if ids:
            self._get()[row, self._ids(ids)] = float("-inf")

    def allow_only(self, row: int, allowed: Sequence[int] | torch.Tensor) -> None:
        """Every token but `allowed` (token ids, or a bool mask [V] with True = allowed)
        gets -inf in `row`."""
        t = self._get()
        if isinstance(allowed, torch.Tensor) and allowed.dtype == torch.bool:
            keep = allowed.to(t.device)
        else:
            keep = torch.zeros(self.vocab_size, dtype=torch.bool, device=t.device)
            keep[self._ids([i for i in allowed if 0 <= i < self.vocab_size])] = True
        t[row].masked_fill_(~keep, float("-inf"))

    def add_bias(self, row: int, bias: dict[int, float]) -> None:
        """Add bias[token] to `row`'s logit of each token (ids outside [0, V) are ignored)."""
        items = [(t, b) for t, b in bias.items() if 0 <= t < self.vocab_size]
        if items:
            ids, vals = zip(*items)
            self._get()[row].index_add_(0, self._ids(ids), torch.tensor(vals, dtype=torch.float32, device=self.device))

    def add_request(self, row: int, params: SamplingParams, output_token_ids: Sequence[int]) -> None:
        """The request's logit_bias, allowed_token_ids and bad_words (none: no work)."""
        if not params.has_logit_controls:
            return
        if params.allowed_token_ids:
            self.allow_only(row, params.allowed_token_ids)
        if params._bad_words_token_ids:
            self.forbid(row, banned_by_bad_words(params._bad_words_token_ids, output_token_ids))
        if params.logit_bias:
            self.add_bias(row, params.logit_bias)


def banned_by_bad_words(bad_words_token_ids: list[list[int]], output_token_ids: Sequence[int]) -> list[int]:
    """vLLM's rule: a bad word's last token is banned when the output so far ends with the
    word's other tokens (always, for a one-token word; never while the output is shorter
    than those other tokens)."""
    banned = []
    n = len(output_token_ids)
    for seq in bad_words_token_ids:
        prefix = len(seq) - 1
        if prefix > n:
            continue
        if prefix == 0 or list(output_token_ids[n - prefix :]) == seq[:-1]:
            banned.append(seq[-1])
    return banned


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] fp32: chosen token under the raw logits' log_softmax (None: no row asked)
    top_logprobs: torch.Tensor | None  # [B, K] fp32, descending; K = max asked in the batch
    top_token_ids: torch.Tensor | None  # [B, K] int64


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence penalties -> a new [B, V] tensor
    (the input is left as it was)."""
    assert batch.output_counts is not None and batch.seen_mask is not None
    rep = batch.repetition_penalty[:, None]  # [B, 1]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(batch.seen_mask, penalized, logits)
    logits -= batch.frequency_penalty[:, None] * batch.output_counts
    logits -= batch.presence_penalty[:, None] * (batch.output_counts > 0).float()
    return logits


def apply_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask to -inf all but each row's top_k tokens, then the smallest prefix of those
    whose probability sums to >= top_p (the top token always stays). [B, V]."""
    V = logits.shape[-1]
    K = batch.max_top_k
    if K < V:  # every sampled row keeps at most K tokens: rank only those (cheaper than a sort)
        sorted_logits, order = logits.topk(K, dim=-1)  # [B, K], descending
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    if batch.need_top_k:
        rank = torch.arange(K, device=logits.device)[None, :]  # [1, K]
        sorted_logits.masked_fill_(rank >= batch.top_k[:, None], float("-inf"))
    if batch.need_top_p:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [B, K]; 0 at rank 0
        # Rows with top_p == 1 are left alone: rounding could push the cumsum past 1.
        drop = (mass_before >= batch.top_p[:, None]) & (batch.top_p < 1.0)[:, None]
        sorted_logits.masked_fill_(drop, float("-inf"))
    out = torch.full_like(logits, float("-inf"))  # tokens outside the top K stay dropped
    return out.scatter_(-1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask tokens whose probability is below min_p * (the row's top probability). [B, V]."""
    probs = logits.softmax(dim=-1)
    threshold = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row from probs [B, V]; seeded rows use only their own generator."""
    q = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        if len(unseeded) == len(generators):
            q.exponential_()
        else:
            idx = torch.tensor(unseeded, device=probs.device)
            q[idx] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)  # [V] from this row's stream alone
    return (probs / q).argmax(dim=-1)


def adjusted_logits(
    logits: torch.Tensor,
    batch: SamplingBatch,
    min_tokens_mask: torch.Tensor | None = None,
    logit_adjust: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw fp32 logits, logits after the adjustments and penalties) [B, V]; a greedy row's
    token is the argmax of the second (`sample` and speculative verification share this)."""
    raw = logits.float()
    # Every step below makes a new tensor (apply_penalties' first `where` too): x may start as raw.
    x = raw if logit_adjust is None else raw + logit_adjust
    if min_tokens_mask is not None:
        x = x.masked_fill(min_tokens_mask, float("-inf"))
    if batch.need_penalties:  # -inf stays -inf: a banned token is never revived
        x = apply_penalties(x, batch)
    return raw, x


def sampling_probs(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution a sampled row draws from: softmax of the adjusted logits x [B, V]
    after temperature, top-k, top-p and min-p. Greedy rows' entries are meaningless."""
    x = x / batch.temperature[:, None]
    if batch.need_top_k or batch.need_top_p:
        x = apply_top_k_top_p(x, batch)
    if batch.need_min_p:
        x = apply_min_p(x, batch)
    return x.softmax(dim=-1)


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    min_tokens_mask: torch.Tensor | None = None,
    logit_adjust: torch.Tensor | None = None,
) -> SamplerOutput:
    """Pick one token per row. logits: [B, V] fp32 (not modified).
    min_tokens_mask: [B, V] bool, True = token forbidden this step (e.g. EOS before min_tokens).
    logit_adjust: [B, V] fp32 added to the logits first (`LogitAdjustments.tensor`: logit_bias,
    -inf for banned tokens); greedy and sampled rows both see it.
    """
    B, V = logits.shape
    if B != batch.batch_size:
        raise ValueError(f"logits have {B} rows but the batch has {batch.batch_size}")
    raw, x = adjusted_logits(logits, batch, min_tokens_mask, logit_adjust)

    token_ids = x.argmax(dim=-1)  # [B]; final for greedy rows
    if not batch.all_greedy:
        probs = sampling_probs(x, batch)  # [B, V]
        if batch.any_greedy:  # draw only for sampled rows; greedy rows spend no randomness
            rows = batch.sampled_rows
            idx = torch.tensor(rows, device=logits.device)
            token_ids[idx] = _exponential_race(probs[idx], [batch.generators[i] for i in rows])
        else:
            token_ids = _exponential_race(probs, batch.generators)

    # Reported logprobs: the raw model distribution, before penalties/temperature (none when
    # no row asks: a [B, V] logsumexp is a measurable part of a small decode step).
    K = batch.max_num_logprobs
    if K is None:
        return SamplerOutput(token_ids=token_ids, logprobs=None, top_logprobs=None, top_token_ids=None)
    lse = torch.logsumexp(raw, dim=-1, keepdim=True)  # [B, 1]
    chosen = (raw.gather(-1, token_ids[:, None]) - lse).squeeze(-1)  # [B]
    vals, top_ids = raw.topk(min(K, V), dim=-1)  # order of logits == order of logprobs
    return SamplerOutput(token_ids=token_ids, logprobs=chosen, top_logprobs=vals - lse, top_token_ids=top_ids)
