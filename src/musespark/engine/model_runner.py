"""Turns a scheduled batch into one flat model call, then samples.

The runner owns tensors only: the model's weights and the KV cache tensors. It sizes the
cache, reports how many blocks fit (`num_blocks`) and how layers group (`layout`), and
reads each step's block tables from the `ScheduledBatch`; it never holds the KV cache
manager (the scheduler does) and never changes a request.

KV layout and size: `kv_cache.py` (the target's groups, then a drafter's own group when
its proposer declares a `kv_spec`; the runner holds those tensors too, `draft_kv_caches`).

Speculative decoding: a request with k drafts this step feeds its anchor and drafts as one
chunk whose rows attend row by row as decode rows (`AttentionContext.row_wise`: the same
numbers as one-at-a-time decoding) and all k + 1 rows get logits, verified by
`spec_decode.rejection.verify_step`; the runner exports the proposer's aux streams.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import CacheConfig
from ..layers.attention import AttentionContext, KVGroup
from ..layers.sampler import LogitAdjustments, SamplingBatch, penalized, sample
from ..model.muse_spark import MuseSparkForCausalLM
from .block_pool import NULL_BLOCK
from .kv_cache import kv_layout, plan_kv_cache
from .request import Request
from .scheduler import ScheduledBatch
from .spec_decode.proposer import DraftKVSpec
from .spec_decode.rejection import verify_step

# Per sampled request: (chosen token's logprob, top token ids, their logprobs), best first.
TokenLogprobs = tuple[float, list[int], list[float]]
_SCORE_ROWS = 256  # prompt positions scored per logits slice (bounds a [rows, V] fp32 tensor)


@dataclass
class StepInputs:
    """One step's model call as plain lists: what rank 0 broadcasts to tensor-parallel workers."""

    ids: list[int]
    positions: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    groups: list[tuple[list[int], list[list[int]]]]  # per KV group: (slot of each new token, block table per seq)
    sample_rows: list[int]  # rows whose logits sample a token
    scored_rows: list[tuple[int, int]]  # prompt_logprobs: (first row, rows)
    row_wise: list[int] = field(default_factory=list)  # sequences verifying drafts: attention row by row
    prompt_rows: list[int] = field(default_factory=list)  # per sequence: its first rows that are prompt tokens


def _int64(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    """Python ints (a list, or a list of equal-length lists) as an int64 tensor. numpy reads a
    list of ints ~5x faster than torch.tensor (a decode step's block tables: 41 vs 226 us)."""
    return torch.from_numpy(np.array(values, dtype=np.int64)).to(device)


def _int64_parts(parts: list[list[int]], shapes: list[tuple[int, ...]], device: torch.device) -> list[torch.Tensor]:
    """Several int lists as int64 tensors of `shapes`, made from one array: each small torch
    op costs 10-30 µs in a decode step (the weights just streamed through the caches)."""
    flat = torch.from_numpy(
        np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int64, count=sum(len(p) for p in parts))
    ).to(device)
    out, at = [], 0
    for part, shape in zip(parts, shapes):
        out.append(flat[at : at + len(part)].view(shape))
        at += len(part)
    return out


def _greedy(logits: torch.Tensor) -> list[int]:
    """Each row's argmax: the first index of its largest value (a NaN counts as largest), as
    torch.argmax. A CPU tensor goes through numpy's argmax (same rule): ~3 µs against
    torch's ~40 µs for a [1, 32768] row, more with the caches cold from a decode step."""
    if logits.device.type == "cpu":
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def _prompt_mask(inputs: StepInputs, device: torch.device) -> torch.Tensor | None:
    """[T] bool: the rows that are prompt tokens (each sequence's first `prompt_rows[i]` rows);
    None when no row is (a decode step)."""
    if not any(inputs.prompt_rows):
        return None
    mask = torch.zeros(inputs.query_start_loc[-1], dtype=torch.bool)
    for first, n in zip(inputs.query_start_loc, inputs.prompt_rows):
        mask[first : first + n] = True
    return mask.to(device)


def _relay(
    logits: torch.Tensor | None, shape: tuple[int, int], source: int, device: torch.device
) -> torch.Tensor | None:
    """Pipeline parallel: the last stage's first TP rank (`source`) sends its logits to rank
    0; rank 0 gets them back, the sender gets None."""
    import torch.distributed as dist

    if logits is not None and dist.get_rank() == source:
        if source == 0:
            return logits
        dist.send(logits.contiguous(), dst=0)
        return None
    out = torch.empty(shape, dtype=torch.float32, device=device)
    dist.recv(out, src=source)
    return out


def _prompt_logprobs(logits: torch.Tensor, request: Request, pos: int) -> list[TokenLogprobs]:
    """Logprobs (the raw logits' log_softmax, as for sampled tokens) of prompt tokens
    pos+1 .. pos+m from logits [m, V] at positions pos .. pos+m-1, each with the top
    `prompt_logprobs` tokens."""
    k, m = request.params.prompt_logprobs, logits.shape[0]
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    targets = torch.tensor(request.prompt_token_ids[pos + 1 : pos + 1 + m], device=logits.device)
    chosen = (logits.gather(-1, targets[:, None]) - lse).squeeze(-1).tolist()
    if k:
        vals, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)
        tops, top_ids = (vals - lse).tolist(), ids.tolist()
    else:
        tops, top_ids = [[] for _ in range(m)], [[] for _ in range(m)]
    return list(zip(chosen, top_ids, tops))


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int]  # request id -> new token
    logprobs: dict[str, TokenLogprobs]  # for sampled requests that asked for logprobs
    # For requests that asked for prompt_logprobs and computed prompt positions this step:
    # (position of the first prompt token scored, one TokenLogprobs per scored token).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Speculative decoding: per request that had drafts, its accepted drafts then one more
    # token, and (if asked) their logprobs; `aux` [T, len(aux_layers) * H] fp32 is the
    # step's exported residual streams (None when it exported none), `first_row` each
    # request's first row in it.
    verified: dict[str, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    aux: torch.Tensor | None = None
    first_row: dict[str, int] = field(default_factory=dict)


class ModelRunner:
    """`broadcast`: tensor parallel rank 0 hands each step's `StepInputs` to the workers
    through it (parallel/executor.py); a worker's runner is given rank 0's `num_blocks` and
    only runs `forward`. Each rank's cache holds its own KV heads."""

    def __init__(
        self,
        model: MuseSparkForCausalLM,
        cache: CacheConfig,
        max_model_len: int,
        max_num_seqs: int,
        *,
        num_blocks: int | None = None,
        broadcast: Callable[[StepInputs], None] | None = None,
        draft_kv: DraftKVSpec | None = None,
    ) -> None:
        self.model = model
        self.broadcast = broadcast
        self.aux_layers: tuple[int, ...] = ()  # decoder layers whose output streams a proposer reads
        self.last_aux: torch.Tensor | None = None
        cfg = model.config
        self.layout = kv_layout(cfg)
        self.block_size = cache.block_size
        plan = plan_kv_cache(model, self.layout, cache, max_model_len, max_num_seqs, draft_kv)
        # every KV group of the block manager: the target's, then the draft's (kv_cache.py)
        self.group_windows, self.group_lookahead = plan.group_windows, plan.group_lookahead
        self.num_blocks = num_blocks = num_blocks if num_blocks is not None else plan.num_blocks
        shape = (num_blocks, cache.block_size, plan.kv_heads, cfg.head_dim)
        # Ordinary pages, not musespark.hugepages: a block's first write would fault a whole 2 MiB
        # page inside a step (~7 ms on a lazily backed VM), for no measured gain in the attention
        # (measured at 9cb64fd, 2026-12-03).
        slots = {
            s: (
                torch.zeros(shape, dtype=plan.dtype, device=model.device),
                torch.zeros(shape, dtype=plan.dtype, device=model.device),
            )
            for s in plan.slots
        }
        # The drafter's layers: pair j when the plan shares them, else tensors of their own.
        self.draft_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if draft_kv is not None:
            dshape = (num_blocks, cache.block_size, draft_kv.num_kv_heads, draft_kv.head_dim)
            self.draft_kv_caches = [
                slots[plan.slots[j]]
                if plan.draft_shares_slots
                else (
                    torch.zeros(dshape, dtype=draft_kv.dtype, device=model.device),
                    torch.zeros(dshape, dtype=draft_kv.dtype, device=model.device),
                )
                for j in range(draft_kv.num_layers)
            ]
        # Per layer: its group slot's (K, V); None for another pipeline stage's layer.
        self.kv_caches = [slots.get(s) for s in self.layout.layer_slot]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, export_aux: bool = True) -> ModelRunnerOutput:
        """`export_aux`: export the proposer's `aux_layers` streams this step (False when no
        request's rows feed the proposer; the model may then take a backend's whole-step decode
        path, which exports nothing)."""
        inputs, sample_reqs, scored_reqs = self._inputs(batch)
        if self.broadcast is not None:  # tensor parallel: every rank runs the same model call
            self.broadcast(inputs)
        out = ModelRunnerOutput(sampled={}, logprobs={})
        results: dict[int, list[TokenLogprobs]] = {}

        def score(j: int, lo: int, logits: torch.Tensor) -> None:
            request, first = scored_reqs[j]
            results.setdefault(j, []).extend(_prompt_logprobs(logits, request, first + lo))

        logits = self.forward(inputs, score, self.aux_layers if export_aux else ())
        for j, (request, first) in enumerate(scored_reqs):
            out.prompt_logprobs[request.request_id] = (first + 1, results.get(j, []))
        if self.last_aux is not None:
            out.aux, self.last_aux = self.last_aux, None
            out.first_row = {r.request_id: row for r, row in zip(batch.requests, inputs.query_start_loc)}
        if not sample_reqs:
            return out
        if not any(batch.spec_token_ids):
            self._sample(logits, sample_reqs, out)
            return out
        # Speculation: requests with drafts verify their k + 1 rows; the others sample one row.
        out.verified, out.verified_logprobs = verify_step(
            logits, batch, sample_reqs, lambda rows, requests: self._sample(rows, requests, out)
        )
        return out

    def _inputs(self, batch: ScheduledBatch) -> tuple[StepInputs, list[Request], list[tuple[Request, int]]]:
        """The step's model inputs as plain lists, the requests that sample (in sample-row
        order) and those that score prompt tokens (with the first scored position - 1)."""
        bs = self.block_size
        inputs = StepInputs(
            ids=[],
            positions=[],
            query_start_loc=[0],
            seq_lens=[],
            groups=[([], []) for _ in self.layout.group_windows],
            sample_rows=[],
            scored_rows=[],
        )
        sample_reqs: list[Request] = []
        scored_reqs: list[tuple[Request, int]] = []
        qsl = inputs.query_start_loc
        spec = batch.spec_token_ids or [()] * len(batch.requests)
        for request, n, req_tables, drafts in zip(batch.requests, batch.num_new, batch.block_tables, spec):
            start = request.num_computed_tokens
            end = start + n
            inputs.ids.extend(request.token_ids[start:end])
            if drafts:  # the anchor (the last token) is in the line above; the drafts follow it
                inputs.ids.extend(drafts)
                inputs.row_wise.append(len(inputs.seq_lens))
            inputs.positions.extend(range(start, end))
            inputs.prompt_rows.append(max(0, min(end, len(request.prompt_token_ids)) - start))
            qsl.append(qsl[-1] + n)
            inputs.seq_lens.append(end)
            # the target's groups only (a drafter's group, last, is the proposer's)
            for (slots, tables), table in zip(inputs.groups, req_tables[: len(inputs.groups)]):
                # Flat cache slot of each new position (the scheduler allocated its block).
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
                tables.append(table)
            if end == request.num_tokens + len(drafts):  # the last known token is computed: sample the next
                # (speculation: every draft's row and the anchor's verify/sample too)
                inputs.sample_rows.extend(range(qsl[-1] - 1 - len(drafts), qsl[-1]))
                sample_reqs.append(request)
            # Prompt logprobs: the logits at position p score prompt token p + 1.
            last_scored = min(end, len(request.prompt_token_ids) - 1)
            if request.params.prompt_logprobs is not None and last_scored > start:
                inputs.scored_rows.append((qsl[-2], last_scored - start))
                scored_reqs.append((request, start))
        return inputs, sample_reqs, scored_reqs

    @torch.inference_mode()
    def forward(
        self,
        inputs: StepInputs,
        score: Callable[[int, int, torch.Tensor], None] | None = None,
        aux_layers: tuple[int, ...] = (),
    ) -> torch.Tensor | None:
        """One model call and its logits: [len(sample_rows), V] fp32 (None if no row samples);
        prompt-scoring logits go to `score(j, offset, logits)` slice by slice (bounding a
        [rows, V] tensor). Every rank of a tensor-parallel model runs this with the same
        inputs (the collectives inside must match); only rank 0 passes `score` and
        `aux_layers` (the streams to keep in `last_aux`)."""
        device = self.model.device
        # ids, positions, then each KV group's slots and block table (rows padded to one width).
        parts, shapes = [inputs.ids, inputs.positions], [(len(inputs.ids),), (len(inputs.positions),)]
        for slots, tables in inputs.groups:
            width = max(len(t) for t in tables)
            parts += [slots, [b for t in tables for b in (*t, *[NULL_BLOCK] * (width - len(t)))]]
            shapes += [(len(slots),), (len(tables), width)]
        ids, positions, *flat = _int64_parts(parts, shapes, device)
        kv_groups = [KVGroup(slot_mapping=flat[i], block_tables=flat[i + 1]) for i in range(0, len(flat), 2)]
        ctx = AttentionContext(
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            kv_caches=self.kv_caches,
            groups=kv_groups,
            layer_group=self.layout.layer_group,
            row_wise=inputs.row_wise,
            prompt_rows=_prompt_mask(inputs, device),
            max_position=max(inputs.positions, default=None),
        )
        if aux_layers:  # a proposer reads these streams (rank 0 only; no collective involved)
            hidden, self.last_aux = self.model(ids, positions, ctx, aux_layers=aux_layers)
        else:
            hidden = self.model(ids, positions, ctx)
        par = self.model.parallel
        # Pipeline parallel: the last stage computes the logits and its first TP rank sends
        # them to rank 0 (the first stage's), which samples; other ranks compute nothing more.
        last = par.is_last_stage
        relay = par.pp_size > 1 and (par.rank == 0 or (last and par.tp_rank == 0))
        source = par.stage_rank(par.pp_size - 1) - par.tp_rank

        def logits_of(rows: torch.Tensor | slice, n: int) -> torch.Tensor | None:
            out = (
                self.model.compute_logits(
                    hidden[rows] if isinstance(rows, slice) else hidden.index_select(0, rows)
                ).float()
                if last
                else None
            )
            if relay:
                out = _relay(out, (n, self.model.config.vocab_size), source, device)
            return out if par.rank == 0 or par.pp_size == 1 else None

        for j, (row, n) in enumerate(inputs.scored_rows):
            for lo in range(0, n, _SCORE_ROWS):
                m = min(_SCORE_ROWS, n - lo)
                logits = logits_of(slice(row + lo, row + lo + m), m)
                if score is not None:
                    score(j, lo, logits)
        if not inputs.sample_rows:
            return None
        rows, n = inputs.sample_rows, len(inputs.sample_rows)
        consecutive = rows[-1] - rows[0] == n - 1 and all(b - a == 1 for a, b in zip(rows, rows[1:]))
        return logits_of(slice(rows[0], rows[0] + n) if consecutive else _int64(rows, device), n)

    def _sample(self, logits: torch.Tensor, requests: list[Request], out: ModelRunnerOutput) -> None:
        V = logits.shape[-1]
        params = [r.params for r in requests]
        # One additive [B, V] tensor for the whole batch (None unless some row asks): each
        # request's logit_bias / allowed_token_ids / bad_words, its grammar's mask, and -inf
        # on the stop ids of rows still short of min_tokens.
        adjust = LogitAdjustments(len(requests), V, logits.device)
        for i, r in enumerate(requests):
            adjust.add_request(i, r.params, r.output_token_ids)
            if r.grammar is not None:
                r.grammar.mask(adjust, i)
            if len(r.output_token_ids) < r.params.min_tokens:
                stop_ids = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(r.eos_token_ids))
                adjust.forbid(i, sorted(stop_ids))
        if adjust.tensor is None and all(p.greedy and p.logprobs is None and not penalized(p) for p in params):
            # Plain greedy rows: `sample` would take the argmax of the logits as they are; its
            # batch tensors cost ~0.2 ms of a decode step on a CPU.
            for r, token in zip(requests, _greedy(logits)):
                out.sampled[r.request_id] = token
            return
        batch = SamplingBatch.build(
            params,
            [r.prompt_token_ids for r in requests],
            [r.output_token_ids for r in requests],
            V,
            [r.generator for r in requests],
            device=logits.device,
        )
        result = sample(logits, batch, logit_adjust=adjust.tensor)
        tokens = result.token_ids.tolist()
        asked = result.logprobs is not None  # then every logprob field is set (sampler.sample)
        chosen = result.logprobs.tolist() if asked else []
        top_ids = result.top_token_ids.tolist() if asked else []
        top_lp = result.top_logprobs.tolist() if asked else []
        for i, r in enumerate(requests):
            out.sampled[r.request_id] = tokens[i]
            if r.params.logprobs is not None:
                k = r.params.logprobs
                out.logprobs[r.request_id] = (chosen[i], top_ids[i][:k], top_lp[i][:k])
