"""Output processing is incremental: each step's work is bounded by the new tokens, not by
how long the completion already is (streaming 1,000 tokens with logprobs=5).

Counted per step: tokenizer.decode calls (detokenizer and Logprob.decoded_token) and
Logprob objects built. Before the engine core and the output processor were split, every
step rebuilt the logprob entries of the whole completion: step k built ~6k Logprobs."""

from __future__ import annotations

import json
import random

import pytest

from musespark import LLM, SamplingParams
from musespark.engine.args import bundled_model_path
from musespark.engine.core import EngineCoreOutput
from musespark.engine.output_processor import OutputProcessor
from musespark.engine.outputs import Logprob
from musespark.engine.tokenizer import Tokenizer

NUM_TOKENS = 1000
TOP = 5
# Per step and sequence: the detokenizer decodes twice; each of the TOP + 1 logprob entries
# decodes its token at most once (cached after), and builds one Logprob.
MAX_DECODES_PER_STEP = 2 + TOP + 1
MAX_LOGPROBS_PER_STEP = TOP + 1


class Counter:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, tokenizer: Tokenizer) -> None:
        self.decodes = self.logprobs = 0
        decode = tokenizer.decode

        def counting_decode(*args, **kwargs):
            self.decodes += 1
            return decode(*args, **kwargs)

        monkeypatch.setattr(tokenizer, "decode", counting_decode)
        init = Logprob.__init__

        def counting_init(obj, *args, **kwargs):
            self.logprobs += 1
            init(obj, *args, **kwargs)

        monkeypatch.setattr(Logprob, "__init__", counting_init)

    def take(self) -> tuple[int, int]:
        out = (self.decodes, self.logprobs)
        self.decodes = self.logprobs = 0
        return out


def test_processor_work_per_step_is_constant(monkeypatch):
    tokenizer = Tokenizer.from_dir(bundled_model_path())
    processor = OutputProcessor(tokenizer)
    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    prompt = tokenizer.encode("def fibonacci(n):")
    processor.add_request("r", "def fibonacci(n):", prompt, SamplingParams(logprobs=TOP, max_tokens=NUM_TOKENS), ["r"])
    counter = Counter(monkeypatch, tokenizer)
    first = None
    streamed = ""
    for step in range(NUM_TOKENS):
        token = rng.randrange(vocab)
        top = rng.sample(range(vocab), TOP)
        lp = (-1.0, top, [-0.5 - i for i in range(TOP)])
        last = step == NUM_TOKENS - 1
        (out,) = processor.process_outputs(
            [EngineCoreOutput("r", [token], [lp], finish_reason="length" if last else None)]
        ).request_outputs
        decodes, built = counter.take()
        assert decodes <= MAX_DECODES_PER_STEP, (step, decodes)
        assert built <= MAX_LOGPROBS_PER_STEP, (step, built)
        c = out.outputs[0]
        streamed += c.delta_text
        assert c.delta_token_ids == [token] and len(c.delta_logprobs) == 1
        assert c.delta_logprobs[0] is c.logprobs[-1]
        if first is None:
            first = c
        else:  # the same lists, appended to: no copy, no rebuild
            assert c.logprobs is first.logprobs and c.token_ids is first.token_ids
            assert c.logprobs[0] is first.delta_logprobs[0]
    assert out.finished and len(c.token_ids) == len(c.logprobs) == NUM_TOKENS
    assert streamed == c.text
    assert c.cumulative_logprob == pytest.approx(-1.0 * NUM_TOKENS)
    assert not processor.has_unfinished_requests()


def test_stop_string_is_reported_to_the_core_and_wins():
    tokenizer = Tokenizer.from_dir(bundled_model_path())
    processor = OutputProcessor(tokenizer)
    ids = tokenizer.encode("hello world, and more", add_special_tokens=False)
    processor.add_request("a", None, [ids[0]], SamplingParams(stop=["world"]), ["a"])
    stops = []
    for i, token in enumerate(ids):
        token_stop = i == len(ids) - 1
        done = processor.process_outputs(
            [EngineCoreOutput("a", [token], None, finish_reason="stop" if token_stop else None)]
        )
        stops += done.stop_string_finished
        if done.request_outputs[0].finished:
            break
    c = done.request_outputs[0].outputs[0]
    assert stops == [("a", "world")]
    assert c.finish_reason == "stop" and c.stop_reason == "world" and "world" not in c.text
    assert c.text == tokenizer.decode(ids).split("world")[0]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=NUM_TOKENS + 64)


def test_engine_streaming_work_per_step_is_constant(llm, monkeypatch):
    """End to end through LLMEngine.step: streaming 1,000 tokens with logprobs=5."""
    counter = Counter(monkeypatch, llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP)
    per_step = []
    final = None
    for out in llm.generate_stream("def fibonacci(n):", params):
        per_step.append(counter.take())
        final = out
    c = final.outputs[0]
    assert len(c.token_ids) == len(c.logprobs) == NUM_TOKENS == len(per_step)
    # The first step also tokenizes the prompt; every later one is bounded by a constant.
    worst = max(per_step[1:])
    assert worst[0] <= MAX_DECODES_PER_STEP and worst[1] <= MAX_LOGPROBS_PER_STEP, worst


TRANSCRIPT = (
    " to=self<|message|>Need weather.<|eom|><|start|>assistant to=get_weather<|message|>"
    '<atem:function_calls>\n<atem:invoke name="get_weather">\n'
    '<atem:parameter name="city">Paris</atem:parameter>\n'
    '<atem:parameter name="days">3</atem:parameter>\n</atem:invoke>\n</atem:function_calls>'
)


def test_output_parser_runs_on_each_steps_delta_and_matches_the_whole_text():
    """The output processor feeds each step's delta text to the request's parser: the streamed
    deltas and the final message equal parsing the whole text at once (MUSE_CHAT §7 #2)."""
    from musespark.parsers import MuseOutputParser, tool_schemas_from_openai

    tokenizer = Tokenizer.from_dir(bundled_model_path())
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                },
            },
        }
    ]
    ids = iter(range(1000))

    def make() -> MuseOutputParser:
        return MuseOutputParser(
            reasoning=True,
            tools=True,
            tool_names=tool_schemas_from_openai(tools),
            id_factory=lambda: f"call-{next(ids)}",
        )

    processor = OutputProcessor(tokenizer)
    tokens = tokenizer.encode(TRANSCRIPT, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(tokens), skip_special_tokens=False)
    processor.add_request("r", "p", [1, 2, 3], params, ["r"], output_parser=make)
    reasoning = content = ""
    calls: dict[int, list[str]] = {}
    for i, token in enumerate(tokens):
        last = i == len(tokens) - 1
        (out,) = processor.process_outputs(
            [EngineCoreOutput("r", [token], None, finish_reason="stop" if last else None)]
        ).request_outputs
        d = out.outputs[0].delta_parsed
        reasoning, content = reasoning + d.reasoning, content + d.content
        for t in d.tool_calls:
            calls.setdefault(t.index, [t.name, ""])[1] += t.arguments
    final = out.outputs[0]
    assert final.text == TRANSCRIPT
    want = make().parse(TRANSCRIPT, "stop")
    assert final.parsed.reasoning == want.reasoning == reasoning == "Need weather."
    assert final.parsed.content is None and content == ""
    assert (
        [(c.name, json.loads(c.arguments)) for c in final.parsed.tool_calls]
        == [(name, json.loads(args)) for name, args in calls.values()]
        == [("get_weather", {"city": "Paris", "days": 3})]
    )
    assert final.num_reasoning_tokens > 0
