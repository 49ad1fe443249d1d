"""Speculative decoding (ngram or dspark): decode tokens/s at batch 1, with and without.

    python benchmarks/spec_decode.py [--repeats 9] [--max-tokens 256] [--speculative-config JSON]
        [--dtype auto|bfloat16|float32] [--threads N] [--workloads quote,code,novel,novel_greedy,rejected]

Five workloads with the bundled model, each run without speculation and with ngram
(default {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
"prompt_lookup_max": 4}), alternately, `--repeats` times, in one process:

* quote: a Python source file (the first ~900 tokens of the stdlib's bisect.py), then the
  file's first lines again, as when a model is asked to reproduce or edit a given file.
  The bundled model is tiny: it does not copy the file faithfully; its greedy continuation
  falls into repeating itself, which prompt lookup drafts as well. The acceptance reported
  is what that run got.
* code: the first 64 tokens of six stdlib modules, each continued greedily for 128 tokens
  (one after the other; the rate is over all of them): the DSpark target workload.
* novel: a prompt of seeded random token ids (nothing in it to copy), sampled (temperature
  1.0, seed 0): greedy, the tiny model soon repeats itself whatever the prompt, which is
  something to copy again; sampled text rarely recurs, so drafts are few and mostly
  rejected, and the ratio shows what speculation costs when it does not pay. The runs
  then differ token for token (same distribution, other random draws); `same_tokens` is
  reported for the greedy cases only.
* novel_greedy: the same prompt, greedy, for the record: the tiny model's greedy text soon
  repeats itself, so ngram pays there too.
* rejected: five stdlib files quoted (their first ~400 tokens), then each file's first lines
  again, sampled (temperature 1.0, seed 0), 64 tokens each: prompt lookup finds the quoted
  code's n-grams and drafts the file's next tokens, which the sampled continuation does not
  follow, so nearly every draft is rejected (greedy, the tiny model falls into repeating
  itself, which prompt lookup predicts). The ratio there is what speculation costs when its
  drafts keep failing.

Decode tokens/s = (output tokens - 1) / (time from the first output token to the last),
from `LLM.generate_stream`; the figure is the median over the repeats, and the ratio is
ngram / off (`speedup`; `speedup_cpu_time` is the same ratio by the process's CPU time,
steadier when other work shares the machine). Both runs must produce the same tokens
(greedy speculation is lossless); the JSON says so per case. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sysconfig
import time
from pathlib import Path

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def quote_prompt(tokenizer, max_file_tokens: int = 900, name: str = "bisect.py") -> dict:
    source = (Path(sysconfig.get_paths()["stdlib"]) / name).read_text()
    text = tokenizer.decode(tokenizer.encode(source)[:max_file_tokens])
    head = "\n".join(text.split("\n")[:6])
    return {"prompt_token_ids": tokenizer.encode(text + "\n\n\n" + head + "\n")}


CODE_FILES = ("heapq.py", "textwrap.py", "fnmatch.py", "shlex.py", "colorsys.py", "calendar.py")


def code_prompts(tokenizer, length: int = 64) -> list[dict]:
    """The first `length` tokens of a few stdlib modules (code to continue, as in the DSpark
    draft's training data: the held-out prompts there are other files)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [{"prompt_token_ids": tokenizer.encode((stdlib / f).read_text())[:length]} for f in CODE_FILES]


REJECTED_FILES = ("bisect.py", "heapq.py", "fnmatch.py", "shlex.py", "colorsys.py")


def rejected_prompts(tokenizer, max_file_tokens: int = 400) -> list[dict]:
    """Quoted files whose continuation the bundled model does not copy (see the module doc)."""
    return [quote_prompt(tokenizer, max_file_tokens, name) for name in REJECTED_FILES]


def novel_prompt(vocab_size: int, length: int = 64, seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(length)]}


def decode_run(llm, prompt: dict | list[dict], params) -> tuple[float, float, list[int]]:
    """(decode tokens/s by wall clock, by this process's CPU time, output ids) of one
    streamed request (the CPU-time figure is steadier on a shared machine); for a list of
    prompts, one after the other, the rates over all of them and every output id."""
    if isinstance(prompt, list):
        runs = [decode_run(llm, p, params) for p in prompt]
        n = [len(ids) - 1 for _, _, ids in runs]
        wall = sum(k / r for k, (r, _, _) in zip(n, runs))
        cpu = sum(k / c for k, (_, c, _) in zip(n, runs))
        return sum(n) / wall, sum(n) / cpu, [t for _, _, ids in runs for t in ids]
    first = last = None
    ids: list[int] = []
    for out in llm.generate_stream(prompt, params):
        now = (time.perf_counter(), time.process_time())
        if first is None:
            first = now
        last = now
        ids = out.outputs[0].token_ids
    wall, cpu = last[0] - first[0], last[1] - first[1]
    n = len(ids) - 1
    return n / wall if wall > 0 else float("nan"), n / cpu if cpu > 0 else float("nan"), list(ids)


def acceptance(llm, before) -> dict:
    s = llm.engine.get_stats()
    drafts = s.spec_num_drafts - before.spec_num_drafts
    draft_tokens = s.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = s.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC))
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default="auto", help="the model's compute dtype (auto: the checkpoint's)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--workloads",
        default="quote,code,novel,novel_greedy,rejected",
        help="comma-separated, from quote, code, novel, novel_greedy, rejected",
    )
    args = p.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from musespark import LLM, SamplingParams
    from musespark.bench.common import print_json

    torch.manual_seed(0)
    common = dict(max_model_len=2048, enable_prefix_caching=False, backend=args.backend, dtype=args.dtype)
    off = LLM(**common)
    spec = LLM(speculative_config=args.speculative_config, **common)
    tok = off.get_tokenizer()
    method = spec.engine.engine_config.speculative.method
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
    code_params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    novel = novel_prompt(off.engine.config.vocab_size)
    workloads = {
        "quote": (quote_prompt(tok), greedy),
        "code": (code_prompts(tok), code_params),
        "novel": (novel, sampled),
        "novel_greedy": (novel, greedy),
        "rejected": (rejected_prompts(tok), SamplingParams(temperature=1.0, seed=0, max_tokens=64, ignore_eos=True)),
    }
    chosen = args.workloads.split(",")
    unknown = sorted(set(chosen) - set(workloads))
    if unknown:
        p.error(f"--workloads: unknown {unknown}; expected names from {sorted(workloads)}")
    workloads = {name: workloads[name] for name in chosen}
    result: dict = {
        "benchmark": "spec_decode",
        "backend": type(off.engine.model.backend).__name__,
        "speculative_config": spec.engine.engine_config.speculative.to_dict(),
        "batch_size": 1,
        "dtype": str(off.engine.model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
    }
    for name, (prompt, params) in workloads.items():
        for llm in (off, spec):  # warm-up
            decode_run(llm, prompt, params)
        before = spec.engine.get_stats()
        rates: dict[str, list[float]] = {"off": [], "ngram": [], "off_cpu": [], "ngram_cpu": []}
        same = True
        for _ in range(args.repeats):
            r_off, c_off, ids_off = decode_run(off, prompt, params)
            r_spec, c_spec, ids_spec = decode_run(spec, prompt, params)
            rates["off"].append(r_off)
            rates["ngram"].append(r_spec)
            rates["off_cpu"].append(c_off)
            rates["ngram_cpu"].append(c_spec)
            same &= ids_off == ids_spec
        a, b = statistics.median(rates["off"]), statistics.median(rates["ngram"])
        ca, cb = statistics.median(rates["off_cpu"]), statistics.median(rates["ngram_cpu"])
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in (prompt if isinstance(prompt, list) else [prompt]))
        result[name] = {
            "prompt_tokens": prompt_tokens,
            "off_decode_tok_s": round(a, 1),
            "ngram_decode_tok_s": round(b, 1),
            "speedup": round(b / a, 3),
            "speedup_cpu_time": round(cb / ca, 3),
            "temperature": params.temperature,
            "same_tokens": same if params.greedy else None,
            **acceptance(spec, before),
            "text_head": tok.decode(ids_off[:24]),
        }
        print(
            f"{name}: off {a:.1f} tok/s, {method} {b:.1f} tok/s, x{b / a:.2f}, "
            f"(CPU time x{cb / ca:.2f}), mean acceptance length {result[name]['mean_acceptance_length']}"
        )
    print_json(result)


if __name__ == "__main__":
    main()
