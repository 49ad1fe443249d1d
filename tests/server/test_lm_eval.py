"""lm-evaluation-harness, unchanged, scores the bundled model through `musespark serve` with
its `local-completions` model (loglikelihood via echo + logprobs, and generation) on two
tiny local tasks (tests/data/lm_eval), and its loglikelihoods equal the offline engine's
prompt_logprobs. The README gives the same command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_server import ServerProcess

from musespark import LLM, SamplingParams
from musespark.engine.args import bundled_model_path

REPO = Path(__file__).resolve().parents[2]
TASKS = "musespark_code_mc,musespark_code_gen"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        tmp_path_factory.mktemp("lmeval") / "server.log", "--reasoning-parser", "none", "--tool-call-parser", "none"
    )
    yield srv
    srv.stop()


@pytest.mark.slow
def test_lm_eval_scores_the_bundled_model(server, tmp_path):
    model_args = (
        f"base_url={server.url}/v1/completions,model=musespark-tiny,tokenizer={bundled_model_path()},"
        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"
    )
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        TASKS,
        "--include_path",
        "tests/data/lm_eval",
        "--batch_size",
        "1",
        "--log_samples",
        "--output_path",
        str(tmp_path),
    ]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(next(tmp_path.rglob("results_*.json")).read_text())["results"]
    assert 0.0 <= results["musespark_code_mc"]["acc,none"] <= 1.0
    assert 0.0 <= results["musespark_code_gen"]["exact_match,none"] <= 1.0

    # Every loglikelihood lm-eval computed equals the offline engine's prompt_logprobs.
    samples = [
        json.loads(line)
        for f in tmp_path.rglob("samples_musespark_code_mc_*.jsonl")
        for line in f.read_text().splitlines()
    ]
    assert len(samples) == 6
    llm = LLM(max_model_len=256)
    tok = llm.get_tokenizer()
    checked = 0
    for sample in samples:
        args = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        for (context, continuation), resp in zip(args, sample["resps"]):
            # lm-eval's pairing: trailing whitespace of the context moves to the continuation.
            n_space = len(context) - len(context.rstrip())
            if n_space:
                context, continuation = context[:-n_space], context[-n_space:] + continuation
            ctx = tok.encode(context, add_special_tokens=False)
            whole = tok.encode(context + continuation, add_special_tokens=False)
            assert whole[: len(ctx)] == ctx
            (out,) = llm.generate([{"prompt_token_ids": whole}], SamplingParams(max_tokens=1, prompt_logprobs=0))
            offline = sum(out.prompt_logprobs[p][whole[p]].logprob for p in range(len(ctx), len(whole)))
            assert float(resp[0][0]) == pytest.approx(offline, abs=2e-3), (context, continuation)
            checked += 1
    assert checked == 18
