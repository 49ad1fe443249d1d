"""The engine core: add requests, step until done, abort at any time.

One `step()` = schedule -> one flat model call -> sample -> update counters ->
detokenize -> check stops. A request with `n > 1` becomes n child sequences sharing the
prompt (prefix caching makes the copies cheap); its `RequestOutput` gathers them.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from ..checkpoint.loader import load_config
from ..config import CacheConfig, SchedulerConfig
from ..model.load import load_model
from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer
from .model_runner import ModelRunner
from .outputs import CompletionOutput, Logprob, RequestOutput
from .request import Request
from .scheduler import Scheduler
from .tokenizer import Tokenizer

DEFAULT_MODEL_ENV = "MUSESPARK_MODEL"
_REPO_MODEL = Path(__file__).resolve().parents[3] / "models" / "musespark-tiny"


def default_model_path() -> Path:
    """The bundled model (or $MUSESPARK_MODEL)."""
    env = os.environ.get(DEFAULT_MODEL_ENV)
    path = Path(env) if env else _REPO_MODEL
    if not (path / "config.json").is_file():
        raise ValueError(f"no model given and the default model {str(path)!r} is missing; pass model=DIR "
                         f"(or set {DEFAULT_MODEL_ENV})")
    return path


@dataclass
class _Child:
    index: int
    request: Request
    detok: IncrementalDetokenizer | None
    text: str = ""
    delta_text: str = ""
    delta_ids: list[int] = field(default_factory=list)


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.request.is_finished for c in self.children)


class LLMEngine:
    def __init__(
        self,
        model: str | Path | None = None,
        dtype: str | torch.dtype = "auto",
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        seed: int | None = 0,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        path = Path(model) if model is not None else default_model_path()
        cfg = load_config(path)
        if scheduler is None:
            limit = max_model_len or min(cfg.max_position_embeddings, 4096)
            scheduler = SchedulerConfig(max_model_len=limit, max_num_seqs=max_num_seqs,
                                        max_num_batched_tokens=max_num_batched_tokens or max(2048, min(limit, 8192)))
        self.scheduler_config = scheduler
        self.cache_config = cache or CacheConfig()
        if seed is not None:
            torch.manual_seed(seed)
        self.model_path = path
        self.model = load_model(path, dtype=dtype, progress=progress)
        self.config = self.model.config
        self.tokenizer = Tokenizer.from_dir(path, extra_eos_ids=set(cfg.eos_token_id)) \
            if (path / "tokenizer.json").is_file() else None
        self.eos_token_ids = frozenset(cfg.eos_token_id) | (
            frozenset(self.tokenizer.eos_token_ids) if self.tokenizer else frozenset())
        self.runner = ModelRunner(self.model, self.cache_config, scheduler.max_model_len, scheduler.max_num_seqs)
        self.scheduler = Scheduler(scheduler, self.runner.kv)
        self.generation_defaults = _generation_defaults(path)
        self._groups: dict[str, _Group] = {}
        self._arrival = itertools.count()
        self.num_steps = 0

    # -- requests ---------------------------------------------------------------
    def tokenize_prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
        """A prompt is a string or {"prompt_token_ids": [...]} (or {"prompt": str})."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: give prompts as {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(f"prompt has unknown key(s) {sorted(unknown)}")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of ints")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
        raise ValueError(f"prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        limit = self.scheduler_config.max_model_len
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if len(prompt_token_ids) >= limit:
            raise ValueError(f"prompt is {len(prompt_token_ids)} tokens; max_model_len={limit} leaves no room "
                             "to generate (the prompt must be shorter than max_model_len)")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids must lie in [0, {self.config.vocab_size}), got {bad[0]}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> None:
        """Queue a request (n children for params.n). Raises ValueError before any work."""
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        self.validate(ids, params)
        limit = self.scheduler_config.max_model_len
        max_tokens = limit - len(ids) if params.max_tokens is None else params.max_tokens
        children = []
        for i in range(params.n):
            child_params = params if params.seed is None or params.n == 1 else replace(params, seed=params.seed + i)
            generator = None
            if child_params.seed is not None:
                generator = torch.Generator(device=self.model.device).manual_seed(child_params.seed)
            req = Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}", prompt_token_ids=ids,
                params=child_params, arrival=next(self._arrival), max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids, generator=generator, user_data=(request_id, i))
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.include_stop_str_in_output,
                                               params.skip_special_tokens)
            children.append(_Child(i, req, detok))
        self._groups[request_id] = _Group(request_id, text, ids, children)
        for child in children:
            self.scheduler.add(child.request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort every sequence of the request and free their blocks at once."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for child in group.children:
            self.scheduler.abort(child.request.request_id)
            self._flush(child)
        return self._output(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # -- one step -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        for group in self._groups.values():
            for child in group.children:
                child.delta_text, child.delta_ids = "", []
        batch = self.scheduler.schedule()
        if not batch.requests:
            if self.scheduler.has_unfinished() and not self.scheduler.running:
                raise RuntimeError("scheduler made no progress with nothing running (KV cache too small?)")
            return []
        out = self.runner.execute(batch)
        self.num_steps += 1
        finished = {r.request_id for r in self.scheduler.update(batch, out.sampled)}
        touched: dict[str, _Group] = {}
        for request in batch.requests:
            token = out.sampled.get(request.request_id)
            if token is None:
                continue
            group_id, index = request.user_data
            group = self._groups[group_id]
            child = group.children[index]
            group.num_cached_tokens = max(group.num_cached_tokens, request.num_cached_tokens)
            self._record_logprobs(request, token, out.logprobs.get(request.request_id))
            child.delta_ids.append(token)
            if child.detok is not None:
                child.delta_text += child.detok.add_tokens([token])
                if child.detok.finished and request.request_id not in finished:
                    self.scheduler.finish_request(request, "stop", child.detok.stop_reason)
                    finished.add(request.request_id)
                elif child.detok.finished:  # both a stop string and a token stop: the string wins
                    request.finish("stop", child.detok.stop_reason)
            if request.request_id in finished:
                self._flush(child)
            touched[group_id] = group
        outputs = []
        for group_id, group in touched.items():
            outputs.append(self._output(group))
            if group.finished:
                del self._groups[group_id]
        return outputs

    # -- helpers ------------------------------------------------------------------
    def _flush(self, child: _Child) -> None:
        if child.detok is not None:
            child.delta_text += child.detok.flush()
            child.text = child.detok.output_text

    def _record_logprobs(self, request: Request, token: int, lp: tuple[float, dict[int, float]] | None) -> None:
        if lp is None:
            return
        chosen, top = lp
        request.cumulative_logprob += chosen
        request.logprobs.append((chosen, top))

    def _output(self, group: _Group) -> RequestOutput:
        completions = []
        for child in group.children:
            r = child.request
            if child.detok is not None:
                child.text = child.detok.output_text if r.is_finished else child.text + child.delta_text
            logprobs = None
            if r.params.logprobs is not None:
                logprobs = []
                for token, (chosen, top) in zip(r.output_token_ids, r.logprobs):
                    entry = {t: Logprob(v, rank=k + 1, decoded_token=self._decode1(t)) for k, (t, v) in enumerate(top.items())}
                    if token not in entry:
                        entry[token] = Logprob(chosen, rank=None, decoded_token=self._decode1(token))
                    logprobs.append(entry)
            completions.append(CompletionOutput(
                index=child.index, text=child.text, token_ids=list(r.output_token_ids),
                cumulative_logprob=r.cumulative_logprob if r.params.logprobs is not None else None,
                logprobs=logprobs, finish_reason=r.finish_reason, stop_reason=r.stop_reason,
                delta_text=child.delta_text, delta_token_ids=list(child.delta_ids)))
        return RequestOutput(request_id=group.request_id, prompt=group.prompt,
                             prompt_token_ids=list(group.prompt_token_ids), outputs=completions,
                             finished=group.finished, num_cached_tokens=group.num_cached_tokens)

    def _decode1(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token], skip_special_tokens=False)


def _generation_defaults(path: Path) -> dict[str, Any]:
    """Sampling defaults from the checkpoint's generation_config.json (vLLM's behaviour)."""
    import json

    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError:
        return {}
    keys = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
    return {ours: data[theirs] for theirs, ours in keys.items() if theirs in data and data[theirs] is not None}
