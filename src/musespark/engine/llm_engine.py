"""`LLMEngine`: input processor -> engine core -> output processor; add, step, abort.

    engine = LLMEngine(EngineArgs(model="DIR").create_engine_config())   # or LLMEngine(model="DIR")
    engine.add_request("r1", "def f():", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

One `step()` = `EngineCore.step()` (schedule, one model call, sample, token stops) ->
`OutputProcessor.process_outputs` (text, stop strings, logprobs, n > 1 fan-in) -> the core
finishes the sequences a stop string ended. A request with `n > 1` becomes n sequences
sharing the prompt (prefix caching makes the copies cheap); its `RequestOutput` gathers
them. Not thread-safe: one thread drives an engine (the server's engine thread).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checkpoint.loader import load_config
from ..config import EngineConfig, ModelConfig
from ..errors import InvalidArgumentError
from ..model.muse_spark import MuseSparkForCausalLM
from ..parsers import MuseOutputParser
from ..sampling_params import SamplingParams
from .args import EngineArgs, check_no_conflict
from .core import EngineCore, EngineStats
from .input_processor import InputProcessor, ProcessedPrompt, load_generation_defaults
from .output_processor import OutputProcessor, child_requests
from .outputs import RequestOutput
from .tokenizer import Tokenizer


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        progress: Callable[[int, int], None] | None = None,
        **engine_args: Any,
    ) -> None:
        """Build from an `EngineConfig`, or from loose `EngineArgs` fields. Loose arguments
        next to a config must agree with it (an error names both otherwise)."""
        if config is None:
            try:
                args = EngineArgs(**engine_args)
            except TypeError as exc:
                raise InvalidArgumentError(f"LLMEngine(): {exc}") from None
            config = args.create_engine_config()
        elif not isinstance(config, EngineConfig):
            raise InvalidArgumentError(
                f"LLMEngine(config) takes an EngineConfig, got {type(config).__name__} "
                "(pass model=DIR for a checkpoint directory)",
                param="config",
            )
        else:
            check_no_conflict(config, engine_args)
        if config.parallel.enable_expert_parallel and config.parallel.tensor_parallel_size == 1:
            raise InvalidArgumentError(
                "enable_expert_parallel needs tensor_parallel_size > 1 (the EP group is the TP group)",
                param="enable_expert_parallel",
            )
        self.engine_config = config
        self.model_path: Path = config.model.path
        checkpoint_eos = load_config(self.model_path).eos_token_id
        self.tokenizer = (
            Tokenizer.from_dir(self.model_path, extra_eos_ids=checkpoint_eos)
            if (self.model_path / "tokenizer.json").is_file() and not config.model.skip_tokenizer_init
            else None  # no tokenizer: prompts are token ids and outputs token ids with empty text
        )
        extra_eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        self.core = EngineCore(config, extra_eos_token_ids=extra_eos, progress=progress)
        self.model: MuseSparkForCausalLM = self.core.model
        self.config: ModelConfig = self.model.config
        gc = str(config.model.generation_config)
        defaults = {} if gc == "vllm" else load_generation_defaults(self.model_path if gc == "auto" else Path(gc))
        self.input_processor = InputProcessor(
            self.tokenizer, self.config.vocab_size, config.scheduler.max_model_len, defaults
        )
        if gc not in ("auto", "vllm"):  # vLLM: a generation config given by directory caps max_tokens
            self.input_processor.override_max_tokens = defaults.get("max_tokens")
        self.output_processor = OutputProcessor(self.tokenizer)

    # -- read-only facts --------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.engine_config.scheduler.max_model_len

    @property
    def generation_defaults(self) -> dict[str, Any]:
        return self.input_processor.generation_defaults

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    def get_stats(self) -> EngineStats:
        return self.core.stats()

    # -- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        output_parser: Callable[[], MuseOutputParser] | None = None,
    ) -> None:
        """Queue a request (n sequences for params.n). Raises ValueError before any work.
        `output_parser` makes one output parser per sequence (see `OutputProcessor`)."""
        processed: ProcessedPrompt = self.input_processor.process_prompt(prompt)
        self.input_processor.validate(processed.token_ids, params)
        children = child_requests(request_id, params)
        self.output_processor.add_request(
            request_id,
            processed.text,
            processed.token_ids,
            params,
            [child_id for child_id, _ in children],
            output_parser,
        )
        for child_id, child_params in children:
            self.core.add_request(child_id, processed.token_ids, child_params, processed.cache_salt)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort every sequence of the request and free their blocks at once; the final
        output (finish_reason "abort" for the unfinished ones), or None if unknown."""
        self.core.abort_requests(self.output_processor.unfinished_child_ids(request_id))
        return self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    # -- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        processed = self.output_processor.process_outputs(self.core.step())
        self.core.finish_requests(processed.stop_string_finished)
        return processed.request_outputs
