"""One engine configuration: EngineArgs' flags on every command, the frozen EngineConfig,
loose arguments that contradict a config, typed argument errors, and no global RNG use."""

from __future__ import annotations

import pytest
import torch
from conftest import save_random_checkpoint
from test_engine import CFG

from musespark import LLM, SamplingParams
from musespark.cli import build_parser
from musespark.config import CacheConfig, EngineConfig, ModelSettings, ParallelConfig, SchedulerConfig
from musespark.engine.args import EngineArgs, bundled_model_path
from musespark.engine.llm_engine import LLMEngine
from musespark.errors import InvalidArgumentError

ENGINE_FLAGS = [
    "--dtype",
    "--backend",
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--block-size",
    "--kv-cache-memory",
    "--kv-cache-fraction",
    "--kv-cache-dtype",
    "--enable-prefix-caching",
]


@pytest.mark.parametrize("command", [["generate", "x"], ["serve"], ["bench", "latency"], ["bench", "throughput"]])
def test_every_command_takes_the_engine_flags(command):
    parser = build_parser()
    args = parser.parse_args(command + ["--backend", "cpu", "--max-model-len", "128", "--block-size", "8"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.backend, engine_args.max_model_len, engine_args.block_size) == ("cpu", 128, 8)
    with pytest.raises(SystemExit):
        parser.parse_args(command + ["--backend", "gpu"])
    help_text = parser._subparsers._group_actions[0].choices[command[0]]
    if len(command) > 1 and command[0] == "bench":
        help_text = help_text._subparsers._group_actions[0].choices[command[1]]
    flags = {s for a in help_text._actions for s in a.option_strings}
    assert set(ENGINE_FLAGS) <= flags


def test_command_defaults_are_kept():
    parser = build_parser()
    serve = EngineArgs.from_cli_args(parser.parse_args(["serve"]))
    assert serve == EngineArgs()  # serve: EngineArgs' own defaults
    assert (serve.max_num_seqs, serve.block_size, serve.enable_prefix_caching, serve.seed) == (64, 16, True, 0)
    bench = EngineArgs.from_cli_args(parser.parse_args(["bench", "throughput"]))
    assert (bench.max_num_seqs, bench.enable_prefix_caching, bench.seed) == (256, False, 0)
    gen = parser.parse_args(["generate", "--seed", "5", "x"])
    assert gen.request_seed == 5 and EngineArgs.from_cli_args(gen).seed == 0  # --seed is the request's there
    assert parser.parse_args(["serve", "DIR"]).model == "DIR"


def test_create_engine_config_resolves_the_derived_defaults():
    config = EngineArgs().create_engine_config()
    assert config.model == ModelSettings(
        path=bundled_model_path(),
        dtype="auto",
        backend="auto",
        seed=0,
        generation_config="auto",
        nvfp4_mode="weight-only",
        skip_tokenizer_init=False,
    )
    assert config.scheduler.max_model_len == 4096 and config.scheduler.max_num_batched_tokens == 4096
    assert config.parallel == ParallelConfig(
        tensor_parallel_size=1, pipeline_parallel_size=1, enable_expert_parallel=False
    )
    short = EngineArgs(max_model_len=512).create_engine_config().scheduler
    assert short.max_num_batched_tokens == 2048
    with pytest.raises(InvalidArgumentError) as err:
        EngineArgs(max_model_len=0).create_engine_config()
    assert err.value.param == "max_model_len"
    with pytest.raises(InvalidArgumentError) as err:
        EngineArgs(backend="gpu").create_engine_config()
    assert err.value.param == "backend"


def test_loose_arguments_may_not_contradict_a_config():
    config = EngineArgs(max_model_len=128).create_engine_config()
    with pytest.raises(InvalidArgumentError, match=r"config\.scheduler\.max_model_len=128.*max_model_len=256") as err:
        LLMEngine(config, max_model_len=256)
    assert err.value.param == "max_model_len"
    with pytest.raises(InvalidArgumentError, match="config.model.backend.*backend='torch'"):
        LLMEngine(config, backend="torch")
    with pytest.raises(InvalidArgumentError, match="bogus"):
        LLMEngine(config, bogus=1)
    with pytest.raises(ValueError, match="bogus"):
        LLMEngine(bogus=1)
    with pytest.raises(InvalidArgumentError, match="tensor_parallel_size > 1") as err:
        LLMEngine(EngineArgs(enable_expert_parallel=True).create_engine_config())
    assert err.value.param == "enable_expert_parallel"


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(n=0), "n"),
        (dict(stop=[""]), "stop"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(bogus=1), "bogus"),
    ],
)
def test_sampling_errors_name_their_parameter(kwargs, name):
    with pytest.raises(InvalidArgumentError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == name


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("args_ckpt"), CFG, seed=3)


def test_unseeded_sampling_uses_the_engine_seed_not_the_global_rng(checkpoint):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [7, 8]}]

    def run(seed):
        llm = LLM(model=checkpoint, dtype="float32", max_model_len=64, block_size=4, seed=seed)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    torch.manual_seed(1234)
    state = torch.get_rng_state()
    first = run(0)
    assert torch.equal(torch.get_rng_state(), state), "the engine touched the global RNG"
    torch.manual_seed(99)  # the global RNG has no say
    assert run(0) == first
    assert run(1) != first
    with pytest.raises(InvalidArgumentError, match="unknown argument") as err:
        LLM(model=checkpoint, gpu_memory_utilisation=0.5)
    assert err.value.param == "gpu_memory_utilisation"


def test_engine_defaults_live_in_engine_args_only():
    """The config sections have no defaults, and LLM takes EngineArgs' fields as they are."""
    import dataclasses
    import inspect

    for section in (EngineConfig, ModelSettings, CacheConfig, SchedulerConfig, ParallelConfig):
        defaulted = [
            f.name
            for f in dataclasses.fields(section)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        ]
        assert not defaulted, f"{section.__name__} has its own defaults for {defaulted}"
    params = inspect.signature(LLM.__init__).parameters
    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
    assert not engine_fields & set(params), "LLM restates EngineArgs fields with their own defaults"
    assert params["model"].default is None and params["engine_args"].kind is inspect.Parameter.VAR_KEYWORD
    with pytest.raises(InvalidArgumentError, match=r"unknown argument\(s\) \['bogus', 'max_seqs'\]") as err:
        LLM(max_seqs=8, bogus=1)
    assert err.value.param == "bogus"


def test_llm_passes_its_keywords_to_engine_args():
    llm = LLM(max_model_len=96, max_num_seqs=3, block_size=8, kv_cache_fraction=0.05)
    config = llm.engine.engine_config
    assert (
        config
        == EngineArgs(max_model_len=96, max_num_seqs=3, block_size=8, kv_cache_fraction=0.05).create_engine_config()
    )
    assert (
        config.scheduler.max_num_batched_tokens
        == EngineArgs(max_model_len=96).create_engine_config().scheduler.max_num_batched_tokens
    )
