"""The engine core: scheduler + model runner; token ids in, token ids out.

One `step()` = schedule -> one flat model call -> sample -> update counters and token
stops. It returns, per sequence that got new tokens, an `EngineCoreOutput` of plain lists
(new token ids and, when asked, their logprobs) plus the finish state. No text, no
`RequestOutput`: detokenization, stop strings, logprob objects and `n > 1` fan-in are the
output processor's.

Invariants:
* The core owns the model (loaded here, with its backend chosen once), the runner (tensors:
  weights and KV cache) and the scheduler (requests and the KV cache manager). With
  tensor_parallel_size > 1 it is rank 0 of a `TensorParallelExecutor`: it holds rank 0's
  shard, and the worker ranks run the same model call each step.
* Every request holds a `torch.Generator` when it samples: its own seed if it has one, else
  a seed drawn from the engine's generator (seeded with `ModelSettings.seed`), so unseeded
  sampling is reproducible run to run and no global RNG is touched.
* Work per step is proportional to the tokens computed this step.
* Speculative decoding (`config.speculative`): verification and rollback are the runner's
  and the scheduler's (`spec_decode/rejection.py`, `Scheduler.update`); the `Speculator`
  asks the proposer for the next step's drafts after each step. A step may then return
  several tokens per sequence; they are exactly the tokens one-at-a-time decoding would
  have produced up to the first stop (greedy), or distributed as they would be (sampled).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..config import EngineConfig
from ..errors import InvalidArgumentError
from ..model.load import load_model
from ..sampling_params import SamplingParams
from .model_runner import ModelRunner, TokenLogprobs
from .request import Request
from .scheduler import Scheduler
from .spec_decode.speculator import Speculator, build_proposer
from .thinking_budget import Steering

_SEED_BOUND = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit int


@dataclass
class EngineCoreOutput:
    """What one step did for one sequence: new ids, their logprobs if asked, finish state."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None  # one (chosen, top ids, top logprobs) per new token
    finish_reason: str | None = None  # "stop" | "length"; None while running
    stop_reason: str | int | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0
    # prompt_logprobs computed this step: (position of the first scored prompt token, entries)
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None = None
    scheduled_time: float | None = None  # time.monotonic() when the sequence was first scheduled


@dataclass(frozen=True)
class EngineStats:
    """A read-only snapshot of the engine's counters (for /metrics and /health)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks held by requests
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which were found
    num_preemptions: int = 0
    num_steps: int = 0
    # Tokens the latest step computed: prompt tokens prefilled plus tokens generated (vLLM's
    # iteration tokens; read once per step by the server for vllm:iteration_tokens_total).
    last_step_tokens: int = 0
    num_kv_blocks: int = 0  # blocks in the KV cache (vLLM's num_gpu_blocks)
    # Speculative decoding (vLLM's spec_decode counters); num_speculative_tokens 0: off.
    num_speculative_tokens: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        extra_eos_token_ids: Iterable[int] = (),
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.config = config
        settings, sched = config.model, config.scheduler
        self.executor = None
        if config.parallel.world_size > 1:  # tensor parallel: this process is rank 0 of the workers it spawns
            from ..kernels.tp_comm import attach as attach_shared_memory
            from ..parallel.executor import TensorParallelExecutor
            from .parallel_worker import run_worker

            self.executor = TensorParallelExecutor(config, run_worker)
            # one host: the TP ranks sum through shared memory, and the native kernels can run them
            self.executor.parallel = attach_shared_memory(self.executor.parallel)
            self.model = load_model(
                settings.path,
                dtype=settings.dtype,
                progress=progress,
                backend=settings.backend,
                parallel=self.executor.parallel,
                nvfp4_mode=settings.nvfp4_mode,
            )
        else:
            self.model = load_model(
                settings.path,
                dtype=settings.dtype,
                progress=progress,
                backend=settings.backend,
                nvfp4_mode=settings.nvfp4_mode,
            )
        self.eos_token_ids = frozenset(self.model.config.eos_token_id) | frozenset(extra_eos_token_ids)
        # the proposer first: a drafter with K/V of its own is sized into the same KV budget
        proposer = None
        if config.speculative is not None:
            if config.parallel.pipeline_parallel_size > 1:
                raise InvalidArgumentError(
                    "speculative decoding does not support pipeline_parallel_size > 1", param="speculative_config"
                )
            proposer = build_proposer(config.speculative, self.model, settings.path)
        self.runner = ModelRunner(
            self.model,
            config.cache,
            sched.max_model_len,
            sched.max_num_seqs,
            broadcast=None if self.executor is None else self.executor.broadcast,
            draft_kv=None if proposer is None else proposer.kv_spec,
        )
        if self.executor is not None:
            self.executor.start(self.runner.num_blocks)
        self.scheduler = Scheduler(
            sched, config.cache, self.runner.num_blocks, self.runner.group_windows, self.runner.group_lookahead
        )
        self.speculator: Speculator | None = None
        if proposer is not None:
            draft_group = None
            if proposer.kv_spec is not None:  # its group is the last one
                proposer.bind_kv_cache(self.runner.draft_kv_caches, config.cache.block_size)
                draft_group = len(self.runner.group_windows) - 1
            self.speculator = Speculator(
                config.speculative, proposer, self.model.config.vocab_size, sched.max_model_len, draft_group
            )
            self.runner.aux_layers = tuple(proposer.aux_layers)
        self._seeds = torch.Generator()  # CPU: draws one seed per unseeded sampled request
        if settings.seed is None:
            self._seeds.seed()
        else:
            self._seeds.manual_seed(settings.seed)
        self.num_steps = 0
        self.last_step_tokens = 0

    # -- requests -------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> None:
        """Queue one sequence (the prompt is already validated). Requests share cached
        prefix blocks only with requests of the same `cache_salt`."""
        limit = self.config.scheduler.max_model_len
        max_tokens = limit - len(prompt_token_ids) if params.max_tokens is None else params.max_tokens
        seed = params.seed
        if seed is None and not params.greedy:
            seed = int(torch.randint(_SEED_BOUND, (), generator=self._seeds))
        generator = None if seed is None else torch.Generator(device=self.model.device).manual_seed(seed)
        grammar = None
        if params.structured_outputs is not None:
            if params._compiled_grammar is None:
                raise InvalidArgumentError(
                    "structured_outputs must be compiled (InputProcessor.validate) before the engine takes the request",
                    param="structured_outputs",
                )
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            grammar = params._compiled_grammar.new_state(stops or self.eos_token_ids)
        if params.thinking_token_budget is not None and params._thinking_plan is not None:
            budget = params._thinking_plan.new_state(params.thinking_token_budget)
            grammar = budget if grammar is None else Steering([grammar, budget])
        self.scheduler.add(
            Request(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                params=params,
                max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids,
                generator=generator,
                grammar=grammar,
                cache_salt=cache_salt,
            )
        )

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish with reason "abort" and free blocks at once; unknown or finished ids are ignored."""
        for request_id in request_ids:
            self.scheduler.abort(request_id)
            if self.speculator is not None:
                self.speculator.drop(request_id)

    def finish_requests(self, finished: Iterable[tuple[str, str]]) -> None:
        """Finish (request id, stop string) pairs the output processor found; frees their blocks."""
        for request_id, stop in finished:
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.scheduler.finish_request(request, "stop", stop)
                if self.speculator is not None:
                    self.speculator.drop(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step -------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        batch = self.scheduler.schedule()
        if not batch.requests:
            if self.scheduler.has_unfinished() and not self.scheduler.running:
                raise RuntimeError("scheduler made no progress with nothing running (KV cache too small?)")
            return []
        out = self.runner.execute(batch, export_aux=self.speculator is not None and self.speculator.needs_aux(batch))
        self.num_steps += 1
        computed_before = [r.num_computed_tokens for r in batch.requests]
        num_out_before = [len(r.output_token_ids) for r in batch.requests]
        finished = self.scheduler.update(batch, out.sampled, out.verified)
        outputs = []
        step_tokens = 0
        for i, request in enumerate(batch.requests):
            prompt_left = len(request.prompt_token_ids) - computed_before[i]
            step_tokens += max(0, min(batch.num_new[i], prompt_left))
            step_tokens += len(request.output_token_ids) - num_out_before[i]
            if request.request_id in out.verified:  # speculation: the accepted run, cut at a stop
                new = request.output_token_ids[num_out_before[i] :]
                if new:
                    lps = out.verified_logprobs.get(request.request_id)
                    outputs.append(
                        EngineCoreOutput(
                            request_id=request.request_id,
                            new_token_ids=new,
                            new_logprobs=None if lps is None else lps[: len(new)],
                            finish_reason=request.finish_reason,
                            stop_reason=request.stop_reason,
                            num_cached_tokens=request.num_cached_tokens,
                            scheduled_time=request.scheduled_time,
                        )
                    )
                continue
            token = out.sampled.get(request.request_id)
            scored = out.prompt_logprobs.get(request.request_id)
            if token is None and scored is None:  # a prefill chunk that did not reach the end of the prompt
                continue
            lp = out.logprobs.get(request.request_id)
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[] if token is None else [token],
                    new_logprobs=None if lp is None else [lp],
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    prompt_logprobs=scored,
                    scheduled_time=request.scheduled_time,
                )
            )
        self.last_step_tokens = step_tokens
        if self.speculator is not None:
            self.speculator.after_step(batch, out, computed_before, finished)
        return outputs

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv_cache_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_usage=kv.usage(),
            prefix_queries=kv.prefix_queries,
            prefix_hits=kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            last_step_tokens=self.last_step_tokens,
            num_kv_blocks=self.runner.num_blocks,
            **(self.speculator.stats() if self.speculator is not None else {}),
        )
