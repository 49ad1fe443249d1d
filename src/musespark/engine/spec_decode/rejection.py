"""Verification of drafted tokens: greedy matching and rejection sampling.

One request's step verified its anchor plus k drafts d_0..d_{k-1}; the target's processed
distribution at row j (after the sampler's adjustments, penalties, temperature, top-k,
top-p, min-p, computed as if d_0..d_{j-1} had been generated: `verify_requests`) is
p_j. The result is the accepted drafts followed by one more token, 1..k+1 tokens.

* Greedy rows (temperature 0): accept d_j while d_j == argmax of row j's processed logits
  (the sampler's own argmax); the first mismatch emits the argmax; all accepted: the
  argmax of row k (the bonus token). Output equals one-at-a-time greedy decoding.
* Sampled rows, deterministic drafts (q one-hot): accept d_j with probability p_j(d_j);
  on rejection draw from p_j with d_j removed, renormalised. With a draft distribution q_j:
  accept with probability min(1, p_j(d_j) / q_j(d_j)); on rejection draw from
  norm(max(p_j - q_j, 0)). All accepted: draw the bonus token from p_k. Each emitted
  token is then distributed exactly as under the target (Leviathan et al. 2023, Chen et
  al. 2023); tests check it by exact enumeration.

Randomness comes only from the request's generator (k uniforms up front, then one
exponential race for the final token), so a seeded request is reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...layers.sampler import LogitAdjustments, SamplingBatch, adjusted_logits, sampling_probs
from ..request import Request


@dataclass
class VerifyResult:
    token_ids: list[int]  # accepted drafts, then the correction or bonus token
    num_accepted: int  # accepted drafts (len(token_ids) - 1)


def acceptance_probs(target: torch.Tensor, draft_ids: list[int], draft_probs: torch.Tensor | None) -> torch.Tensor:
    """Per draft position j: p_j(d_j) (draft_probs None) or min(1, p_j(d_j) / q_j(d_j)). target [>=k, V] -> [k]."""
    k = len(draft_ids)
    rows = torch.arange(k, device=target.device)
    ids = torch.tensor(draft_ids, dtype=torch.int64, device=target.device)
    p = target[rows, ids]
    if draft_probs is None:
        return p
    q = draft_probs[rows, ids.to(draft_probs.device)].to(p.device)
    return torch.where(q > 0, p / q.clamp_min(torch.finfo(q.dtype).tiny), (p > 0).to(p.dtype)).clamp(max=1.0)


def residual(p: torch.Tensor, rejected: int, q: torch.Tensor | None) -> torch.Tensor:
    """The distribution to draw from after rejecting `rejected` at a row with target p [V]:
    norm(max(p - q, 0)), q one-hot on `rejected` when None. A residual with no mass (only
    reachable through rounding, when acceptance was 1 up to it) falls back to p."""
    if q is None:
        r = p.clone()
        r[rejected] = 0.0
    else:
        r = (p - q.to(p.device)).clamp_min(0.0)
    total = r.sum()
    return r / total if float(total) > 0.0 else p


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V] by the exponential race (the sampler's method)."""
    e = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / e).argmax())


def verify_greedy(draft_ids: list[int], target_argmax: list[int]) -> VerifyResult:
    """target_argmax: the argmax of each of the k+1 rows' processed logits."""
    n = 0
    while n < len(draft_ids) and draft_ids[n] == target_argmax[n]:
        n += 1
    return VerifyResult(list(draft_ids[:n]) + [target_argmax[n]], n)


def verify_sampled(
    draft_ids: list[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> VerifyResult:
    """target_probs [k+1, V] fp32 (rows sum to 1); draft_probs [k, V] or None (one-hot drafts)."""
    k = len(draft_ids)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"need k+1={k + 1} target rows, got {target_probs.shape[0]}")
    n = k
    if k:
        accept = acceptance_probs(target_probs, draft_ids, draft_probs)
        u = torch.rand(k, generator=generator, device=target_probs.device)
        ok = (u < accept).tolist()
        n = ok.index(False) if False in ok else k
    if n < k:
        q = None if draft_probs is None else draft_probs[n]
        token = draw(residual(target_probs[n], draft_ids[n], q), generator)
    else:
        token = draw(target_probs[k], generator)
    return VerifyResult(list(draft_ids[:n]) + [token], n)


# -- a step's verification, batched over the requests that had drafts ----------------------
TokenLogprobs = tuple[float, list[int], list[float]]  # as model_runner.TokenLogprobs


def verify_requests(
    logits: torch.Tensor, requests: list[Request], drafts: list[list[int]], draft_probs: list[torch.Tensor | None]
) -> tuple[list[VerifyResult], list[list[TokenLogprobs]]]:
    """logits [sum(k_i + 1), V] fp32: request i's k_i + 1 rows in order (anchor, drafts).

    Row j of a request is processed exactly as the sampler would have processed it had
    d_0..d_{j-1} been generated: penalties, bad words and the min_tokens stop mask see
    them in the output. Returns per request its VerifyResult and, when it asked for
    logprobs, one (chosen, top ids, top logprobs) of the raw logits per emitted token."""
    V = logits.shape[-1]
    params, prompts, outputs = [], [], []
    adjust = LogitAdjustments(logits.shape[0], V, logits.device)
    for r, d in zip(requests, drafts):
        if r.grammar is not None:
            raise ValueError(f"request {r.request_id!r} has a grammar: it must not speculate")
        stop_ids = sorted(set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(r.eos_token_ids)))
        for j in range(len(d) + 1):
            out = list(r.output_token_ids) + list(d[:j])
            row = len(params)
            params.append(r.params)
            prompts.append(r.prompt_token_ids)
            outputs.append(out)
            adjust.add_request(row, r.params, out)
            if len(out) < r.params.min_tokens:
                adjust.forbid(row, stop_ids)
    batch = SamplingBatch.build(params, prompts, outputs, V, [None] * len(params), device=logits.device)
    raw, x = adjusted_logits(logits, batch, logit_adjust=adjust.tensor)
    argmax = x.argmax(dim=-1).tolist()
    probs = None if batch.all_greedy else sampling_probs(x, batch)
    results, logprobs = [], []
    row = 0
    for r, d, q in zip(requests, drafts, draft_probs):
        k = len(d)
        if r.params.greedy:
            res = verify_greedy(d, argmax[row : row + k + 1])
        else:
            res = verify_sampled(d, probs[row : row + k + 1], q, r.generator)
        results.append(res)
        lps: list[TokenLogprobs] = []
        if r.params.logprobs is not None:
            m = len(res.token_ids)
            rows = raw[row : row + m]
            lse = torch.logsumexp(rows, dim=-1, keepdim=True)
            ids = torch.tensor(res.token_ids, dtype=torch.int64, device=rows.device)
            chosen = (rows.gather(-1, ids[:, None]) - lse).squeeze(-1).tolist()
            vals, top = rows.topk(min(r.params.logprobs, V), dim=-1)
            lps = list(zip(chosen, top.tolist(), (vals - lse).tolist()))
        logprobs.append(lps)
        row += k + 1
    return results, logprobs


def verify_step(
    logits: torch.Tensor,
    batch: Any,
    sample_reqs: Sequence[Request],
    sample_plain: Callable[[torch.Tensor, list[Request]], None],
) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
    """One step's sampling when some requests verify drafts. `logits` [rows, V]: each of
    `sample_reqs` in order, with 1 + k rows if `batch` (a ScheduledBatch) gave it k drafts,
    else 1. Requests without drafts go to `sample_plain(their rows, them)` (the runner's
    sampler); the others are verified. Returns (verified tokens, their logprobs if asked)
    by request id."""
    drafts = {
        r.request_id: (d, q)
        for r, d, q in zip(batch.requests, batch.spec_token_ids, batch.spec_probs or [None] * len(batch.requests))
        if d
    }
    plain_rows: list[int] = []
    spec_rows: list[int] = []
    plain: list[Request] = []
    spec: list[Request] = []
    row = 0
    for r in sample_reqs:
        m = 1 + len(drafts[r.request_id][0]) if r.request_id in drafts else 1
        (spec_rows if m > 1 else plain_rows).extend(range(row, row + m))
        (spec if m > 1 else plain).append(r)
        row += m
    if plain:
        sample_plain(logits[torch.tensor(plain_rows, device=logits.device)], plain)
    results, logprobs = verify_requests(
        logits[torch.tensor(spec_rows, device=logits.device)],
        spec,
        [drafts[r.request_id][0] for r in spec],
        [drafts[r.request_id][1] for r in spec],
    )
    verified = {r.request_id: res.token_ids for r, res in zip(spec, results)}
    asked = {r.request_id: lps for r, lps in zip(spec, logprobs) if r.params.logprobs is not None}
    return verified, asked
