"""The DSpark proposer (docs/speculative.md §5): keeps each request's draft context K/V and drafts a
block per step from the target's aux stream.

Where the K/V live (`model/dspark_kv.py`): in the engine, the runner's draft tensors, sized
from the KV budget with the target's (`kv_spec`, `bind_kv_cache`), and each request's
`ProposalRequest.block_table` from the draft's KV group of the block manager, so they are
freed and preempted with the request. Outside an engine (no block table given) the proposer
holds its own pool of `standalone_blocks` blocks of `STANDALONE_BLOCK_SIZE`; a request that
does not fit raises.

Per request and step: (1) forget context positions >= `context_start` (rejected drafts,
preemption), write the K/V of the new aux rows at [context_start, context_start + n); (2) if
drafts are wanted, run the block [anchor, mask, ...] at P0 = number of context positions
= len(token_ids) - 1 (the anchor's own position) and take N drafts from the Markov stage; a
request whose context is still behind its last token (mid-prefill) gets no drafts. Context rows
of all requests go through `fc` in one matmul, and each draft layer
projects them in the same matmul as the blocks' rows (their K/V are stored before that layer's
attention reads the cache); the block pass is batched over requests.
Positions a request was never given rows for (context_start beyond what the proposer holds: a
prefix-cache hit of the target, or the steps between probes of a request backing off, given
`hidden=None`) are masked out of the draft's attention: worse drafts, never wrong ones. Such a
step costs nothing here (no context rows, no block pass). A request needs `drop` when it
finishes or is preempted.

`compute_confidence`: also compute the confidence head's rho per draft (kept in
`last_confidence`; the Proposal has no field for it, and only adaptive verification uses it).

`draft_sample_method`: "greedy" (default; Proposal.probs None) or "probabilistic": draft k is
sampled from softmax(l'_k / temperature) with a generator seeded by (seed, request, position),
and Proposal.probs holds those distributions scattered to the target vocabulary (zero off the
draft vocabulary), which is the q the rejection sampler needs. (ProposalRequest carries no
sampling parameters, so temperature and seed are the proposer's, not the request's.)
"""

from __future__ import annotations

import zlib
from typing import Literal

import torch

from ...model.dspark import DSparkDraft
from ...model.dspark_kv import DraftSeq, PagedDraftKV
from ...model.dspark_loader import load_draft
from .proposer import DraftKVSpec, Proposal, ProposalRequest, Proposer

STANDALONE_BLOCK_SIZE = 16


class DSparkProposer(Proposer):
    # A probe is a block pass of the draft (about two target decode steps of the bundled model
    # on one CPU thread) plus a context row and a verified row: probing every 64 steps keeps a
    # request whose drafts keep failing within a few percent of plain decoding.
    probe_interval = 64

    def __init__(
        self,
        draft: DSparkDraft,
        target: torch.nn.Module,
        num_speculative_tokens: int,
        draft_sample_method: Literal["greedy", "probabilistic"] = "greedy",
        temperature: float = 1.0,
        seed: int = 0,
        compute_confidence: bool = False,
        standalone_blocks: int = 256,
    ) -> None:
        cfg, tcfg = draft.config, target.config
        if cfg.target_hidden_size != tcfg.hidden_size or cfg.hidden_size != tcfg.hidden_size:
            raise ValueError(
                f"draft hidden sizes (target_hidden_size {cfg.target_hidden_size}, hidden_size "
                f"{cfg.hidden_size}) must equal the target's hidden_size {tcfg.hidden_size}"
            )
        if max(cfg.target_layer_ids) >= tcfg.num_hidden_layers:
            raise ValueError(
                f"draft target_layer_ids {list(cfg.target_layer_ids)} exceed the target's "
                f"{tcfg.num_hidden_layers} layers"
            )
        if cfg.vocab_size < tcfg.vocab_size:
            raise ValueError(f"draft vocab_size {cfg.vocab_size} must cover the target vocabulary {tcfg.vocab_size}")
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if draft_sample_method not in ("greedy", "probabilistic"):
            raise ValueError(f"draft_sample_method must be 'greedy' or 'probabilistic', got {draft_sample_method!r}")
        self.draft, self.target = draft, target
        self.num_speculative_tokens = num_speculative_tokens
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.method, self.temperature, self.seed = draft_sample_method, temperature, seed
        self.compute_confidence = compute_confidence
        self.aux_layers = tuple(cfg.target_layer_ids)
        self.target_vocab = tcfg.vocab_size
        nq = num_speculative_tokens if cfg.sample_from_anchor else num_speculative_tokens + 1
        self.kv_spec = DraftKVSpec(cfg.num_hidden_layers, cfg.kv_heads, cfg.head_dim, draft.dtype, lookahead=nq)
        self.kv: PagedDraftKV | None = None  # the engine's draft tensors, once bound
        self._seqs: dict[str, DraftSeq] = {}
        self._standalone_blocks = standalone_blocks
        self._own: tuple[PagedDraftKV, list[int], dict[str, list[int]]] | None = None  # (kv, free ids, tables)
        self.last_confidence: dict[str, list[float]] = {}  # per request, with compute_confidence and the head

    @classmethod
    def load(cls, path: str, target: torch.nn.Module, num_speculative_tokens: int, **options: object) -> DSparkProposer:
        """Load the draft at `path` in the target's dtype, on its device."""
        draft = load_draft(path, target.config.num_hidden_layers, target.dtype, target.device)
        return cls(draft, target, num_speculative_tokens, **options)  # type: ignore[arg-type]

    def bind_kv_cache(self, caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> None:
        """Use the engine's draft K/V tensors (per draft layer, `kv_spec`'s geometry); every
        request then comes with its block table."""
        if len(caches) != self.kv_spec.num_layers:
            raise ValueError(f"caches: need {self.kv_spec.num_layers} draft layers, got {len(caches)}")
        self.kv, self._own = PagedDraftKV(caches, block_size), None

    def drop(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        self.last_confidence.pop(request_id, None)
        if self._own is not None:
            self._own[1].extend(self._own[2].pop(request_id, []))

    def _table(self, r: ProposalRequest, end: int) -> tuple[PagedDraftKV, list[int]]:
        """The request's cache and block table, reaching position `end` - 1."""
        if r.block_table is not None:
            if self.kv is None:
                raise ValueError("ProposalRequest.block_table given, but no KV cache is bound (bind_kv_cache)")
            return self.kv, r.block_table
        if self.kv is not None:
            raise ValueError(f"request {r.request_id}: block_table is required once an engine KV cache is bound")
        if self._own is None:
            own = PagedDraftKV.allocate(
                self.draft, self._standalone_blocks, STANDALONE_BLOCK_SIZE, self.draft.fc.weight.device
            )
            self._own = (own, list(range(self._standalone_blocks)), {})
        kv, free, tables = self._own
        table = tables.setdefault(r.request_id, [])
        need = -(-end // kv.block_size) - len(table)
        if need > len(free):
            raise RuntimeError(f"standalone draft KV pool exhausted ({self._standalone_blocks} blocks)")
        table.extend(free[:need] if need > 0 else [])
        del free[: max(need, 0)]
        return kv, table

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        draft, device = self.draft, self.draft.fc.weight.device
        N = self.num_speculative_tokens
        nq = self.kv_spec.lookahead
        seqs = [self._seqs.setdefault(r.request_id, DraftSeq()) for r in requests]
        # (1) forget positions >= context_start, hold the new rows' positions
        for r, seq in zip(requests, seqs):
            seq.advance(r.context_start, 0 if r.hidden is None else r.hidden.shape[0])
            if r.num_tokens > 0 and seq.length >= len(r.token_ids):
                raise ValueError(
                    f"request {r.request_id}: context covers {seq.length} positions but only "
                    f"{len(r.token_ids)} tokens exist (no anchor)"
                )
        # requests that want drafts and whose context reaches their last token (the anchor);
        # a context still behind it (a prefill chunk) drafts nothing
        want = [i for i, r in enumerate(requests) if r.num_tokens > 0 and seqs[i].length == len(r.token_ids) - 1]
        wanted = set(want)
        tables = [
            self._table(r, seq.length + (nq if i in wanted else 0)) for i, (r, seq) in enumerate(zip(requests, seqs))
        ]
        # context rows of all requests: one fc + hidden_norm; their K/V are computed in the
        # block pass's own projections (or alone when nobody wants drafts)
        given = [i for i, r in enumerate(requests) if r.hidden is not None and r.hidden.shape[0]]
        context = None
        if given:
            c = draft.context_features(torch.cat([requests[i].hidden for i in given]).to(device))
            spans = [range(requests[i].context_start, seqs[i].length) for i in given]
            pos = torch.tensor([p for span in spans for p in span], device=device)
            kv = tables[given[0]][0]
            slots = torch.tensor(
                [s for i, span in zip(given, spans) for s in kv.slots(tables[i][1], span)], device=device
            )

            def store(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
                kv.store(layer, slots, k, v)

            context = (c, pos, store)
        out = [Proposal([]) for _ in requests]
        if not want:
            if context is not None:
                for layer, (k, v) in enumerate(draft.context_kv_of(context[0], context[1])):
                    context[2](layer, k, v)
            return out
        # (2) block pass, batched over the requests that want drafts
        starts = [seqs[i].length for i in want]
        anchor_t = torch.tensor([int(requests[i].token_ids[p0]) for i, p0 in zip(want, starts)], device=device)
        positions = torch.tensor(starts, device=device)[:, None] + torch.arange(nq, device=device)  # [B, nq]
        tokens = torch.full_like(positions, draft.config.mask_token_id)
        tokens[:, 0] = anchor_t
        embed = self.target.embed_tokens.weight
        kv = tables[want[0]][0]
        attend = kv.attend(
            draft,
            [tables[i][1] for i in want],
            [seqs[i] for i in want],
            positions,
            getattr(self.target, "backend", None),
        )
        y = draft.block_hidden(tokens, positions, embed, attend, context)
        y = y[:, nq - N :]  # row k predicts position P0 + k + 1
        sample = None if self.method == "greedy" else self._sampler([requests[i] for i in want], starts)
        drafts, logits, conf = draft.choose(y, anchor_t, sample, self.compute_confidence)
        for j, i in enumerate(want):
            k = min(requests[i].num_tokens, N)
            probs = None
            if self.method == "probabilistic":
                probs = torch.zeros(k, self.target_vocab, device=device)
                ids = torch.arange(draft.d2t.shape[0], device=device) + draft.d2t
                probs[:, ids] = torch.softmax(logits[j, :k] / self.temperature, -1)
            out[i] = Proposal(drafts[j, :k].tolist(), probs)
            if conf is not None:
                self.last_confidence[requests[i].request_id] = conf[j, :k].tolist()
        return out

    def _sampler(self, requests: list[ProposalRequest], starts: list[int]):
        """sample(l' [B, V_d], k) -> draft ids [B]: one seeded generator per (request, position)."""

        def sample(logits: torch.Tensor, k: int) -> torch.Tensor:
            probs = torch.softmax(logits / self.temperature, -1)
            picks = []
            for b, r in enumerate(requests):
                key = zlib.crc32(f"{self.seed}:{r.request_id}:{starts[b] + k + 1}".encode())
                gen = torch.Generator(device=probs.device).manual_seed(key)
                picks.append(torch.multinomial(probs[b], 1, generator=gen))
            return torch.cat(picks)

        return sample
