"""Sampler and SamplingParams: every parameter must change the outcome when it is set."""

from __future__ import annotations

import math

import pytest
import torch

from musespark.layers.sampler import SamplerOutput, SamplingBatch, sample
from musespark.sampling_params import SamplingParams

N_DRAWS = 4000  # rows per distribution test: one batched call, so still fast


def run(
    params: list[SamplingParams],
    logits: torch.Tensor,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    mask: torch.Tensor | None = None,
) -> SamplerOutput:
    B, V = logits.shape
    batch = SamplingBatch.build(
        params,
        prompts or [[] for _ in range(B)],
        outputs or [[] for _ in range(B)],
        V,
        generators or [None] * B,
    )
    return sample(logits, batch, mask)


def draws(p: SamplingParams, probs: list[float], n: int = N_DRAWS, seed: int = 0) -> torch.Tensor:
    """n independent draws (one batch of n identical rows) from the given distribution."""
    torch.manual_seed(seed)
    logits = torch.tensor(probs).log().expand(n, -1).contiguous()
    return run([p] * n, logits).token_ids


PROBS = [0.5, 0.3, 0.1, 0.05, 0.05]


# ---- greedy ---------------------------------------------------------------------------


def test_greedy_equals_argmax():
    torch.manual_seed(1)
    logits = torch.randn(16, 50)
    for p in (SamplingParams(temperature=0.0), SamplingParams(temperature=1e-6), SamplingParams(top_k=1)):
        assert p.greedy
        assert torch.equal(run([p] * 16, logits).token_ids, logits.argmax(-1))
    # Sanity: the same logits sampled at temperature 1 do not always give the argmax.
    torch.manual_seed(2)
    sampled = run([SamplingParams(temperature=1.0)] * 16, logits).token_ids
    assert not torch.equal(sampled, logits.argmax(-1))


# ---- top-k / top-p / min-p / temperature ----------------------------------------------


def test_top_k_limits_to_k_best():
    got = draws(SamplingParams(top_k=2), PROBS)
    assert set(got.tolist()) == {0, 1}
    for disabled in (0, -1):
        assert set(draws(SamplingParams(top_k=disabled), PROBS).tolist()) == {0, 1, 2, 3, 4}


def test_top_p_keeps_smallest_prefix_reaching_p():
    # cumulative: 0.5, 0.8, 0.9, ...; mass *before* each token: 0, 0.5, 0.8, 0.9, 0.95
    assert set(draws(SamplingParams(top_p=0.75), PROBS).tolist()) == {0, 1}
    assert set(draws(SamplingParams(top_p=0.85), PROBS).tolist()) == {0, 1, 2}
    assert set(draws(SamplingParams(top_p=0.5), PROBS).tolist()) == {0}  # 0.5 already reaches p
    assert set(draws(SamplingParams(top_p=0.01), PROBS).tolist()) == {0}  # top token always kept
    assert set(draws(SamplingParams(top_p=1.0), PROBS).tolist()) == {0, 1, 2, 3, 4}


def test_min_p_drops_tokens_below_fraction_of_max():
    # threshold 0.25 * 0.5 = 0.125: tokens 0 (0.5) and 1 (0.3) survive
    assert set(draws(SamplingParams(min_p=0.25), PROBS).tolist()) == {0, 1}
    # threshold 0.15 * 0.5 = 0.075: token 2 (0.1) survives too
    assert set(draws(SamplingParams(min_p=0.15), PROBS).tolist()) == {0, 1, 2}
    assert set(draws(SamplingParams(min_p=0.0), PROBS).tolist()) == {0, 1, 2, 3, 4}


def test_top_k_and_top_p_per_row_in_one_batch():
    torch.manual_seed(3)
    n = 2000
    logits = torch.tensor(PROBS).log().expand(2 * n, -1).contiguous()
    params = [SamplingParams(top_k=1 + (i % 2), temperature=1.0) for i in range(n)]
    params += [SamplingParams(top_p=0.85)] * n
    got = run(params, logits).token_ids
    assert set(got[:n:2].tolist()) == {0}  # top_k=1 rows
    assert set(got[1:n:2].tolist()) == {0, 1}  # top_k=2 rows
    assert set(got[n:].tolist()) == {0, 1, 2}


def test_top_k_then_top_p_on_the_same_row():
    # top_k=3 keeps 0.5/0.3/0.1, renormalized to 0.56/0.33/0.11; top_p=0.85 then drops token 2
    assert set(draws(SamplingParams(top_k=3, top_p=0.85), PROBS).tolist()) == {0, 1}
    assert set(draws(SamplingParams(top_k=3), PROBS).tolist()) == {0, 1, 2}
    # rows with different k share one top-K pass (K = 4 here)
    torch.manual_seed(7)
    n = 2000
    logits = torch.tensor(PROBS).log().expand(2 * n, -1).contiguous()
    got = run([SamplingParams(top_k=2)] * n + [SamplingParams(top_k=4)] * n, logits).token_ids
    assert set(got[:n].tolist()) == {0, 1} and set(got[n:].tolist()) == {0, 1, 2, 3}


def test_temperature_concentrates_or_spreads_mass():
    def frac_top(t: float) -> float:
        return (draws(SamplingParams(temperature=t), PROBS) == 0).float().mean().item()

    cold, normal, hot = frac_top(0.1), frac_top(1.0), frac_top(10.0)
    assert cold > 0.99
    assert abs(normal - 0.5) < 0.04  # T=1 reproduces the distribution
    assert hot < 0.3  # near-uniform over 5 tokens


def test_sample_frequencies_match_probs():
    got = draws(SamplingParams(), PROBS, n=20000)
    freq = torch.bincount(got, minlength=5).float() / got.numel()
    assert torch.allclose(freq, torch.tensor(PROBS), atol=0.02)


# ---- penalties ------------------------------------------------------------------------

GREEDY = dict(temperature=0.0)


def test_repetition_penalty_on_output_tokens():
    logits = torch.tensor([[2.0, 1.9, -1.0, -3.0]])
    assert run([SamplingParams(**GREEDY)], logits, outputs=[[0]]).token_ids.item() == 0
    p = SamplingParams(repetition_penalty=2.0, **GREEDY)  # 2.0 / 2 = 1.0 < 1.9
    assert run([p], logits, outputs=[[0]]).token_ids.item() == 1


def test_repetition_penalty_on_prompt_tokens():
    logits = torch.tensor([[2.0, 1.9, -1.0, -3.0]])
    p = SamplingParams(repetition_penalty=2.0, **GREEDY)
    assert run([p], logits, prompts=[[0, 3]]).token_ids.item() == 1
    assert run([p], logits, prompts=[[2, 3]]).token_ids.item() == 0  # unseen token untouched


def test_repetition_penalty_multiplies_negative_logits():
    logits = torch.tensor([[-1.0, -1.5, -4.0]])
    p = SamplingParams(repetition_penalty=2.0, **GREEDY)  # -1.0 * 2 = -2.0 < -1.5
    assert run([p], logits, outputs=[[0]]).token_ids.item() == 1
    p = SamplingParams(repetition_penalty=0.5, **GREEDY)  # < 1 rewards: -1.5 * 0.5 = -0.75
    assert run([p], logits, outputs=[[1]]).token_ids.item() == 1


def test_frequency_penalty_scales_with_count():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    p = SamplingParams(frequency_penalty=0.4, **GREEDY)
    assert run([p], logits, outputs=[[0]]).token_ids.item() == 0  # 2.0 - 0.4 = 1.6
    assert run([p], logits, outputs=[[0, 0]]).token_ids.item() == 1  # 2.0 - 0.8 = 1.2
    assert run([p], logits, prompts=[[0, 0, 0]]).token_ids.item() == 0  # prompt not counted


def test_presence_penalty_ignores_count():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    p = SamplingParams(presence_penalty=0.6, **GREEDY)
    assert run([p], logits, outputs=[[0]]).token_ids.item() == 1  # 2.0 - 0.6 = 1.4
    p = SamplingParams(presence_penalty=0.4, **GREEDY)
    assert run([p], logits, outputs=[[0, 0, 0]]).token_ids.item() == 0  # 1.6 whatever the count
    p = SamplingParams(presence_penalty=-1.0, **GREEDY)  # negative encourages
    assert run([p], logits, outputs=[[1]]).token_ids.item() == 1
    p = SamplingParams(presence_penalty=2.0, **GREEDY)
    assert run([p], logits, prompts=[[0]]).token_ids.item() == 0  # prompt not counted


def test_penalties_are_per_row():
    logits = torch.tensor([[2.0, 1.5, 0.0]]).expand(2, -1).contiguous()
    params = [SamplingParams(presence_penalty=1.0, **GREEDY), SamplingParams(**GREEDY)]
    assert run(params, logits, outputs=[[0], [0]]).token_ids.tolist() == [1, 0]


# ---- min_tokens mask ------------------------------------------------------------------


def test_min_tokens_mask_blocks_token():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    mask = torch.tensor([[True, False, False, False]])
    assert run([SamplingParams(**GREEDY)], logits).token_ids.item() == 0
    assert run([SamplingParams(**GREEDY)], logits, mask=mask).token_ids.item() == 1
    torch.manual_seed(4)
    n = 2000
    many = run([SamplingParams()] * n, logits.expand(n, -1).contiguous(), mask=mask.expand(n, -1))
    assert 0 not in many.token_ids.tolist()
    assert set(many.token_ids.tolist()) == {1, 2, 3}


# ---- seeds ----------------------------------------------------------------------------


def _seeded_run(seed: int, steps: list[torch.Tensor], row: int, batch_size: int, rng_seed: int) -> list[int]:
    """Tokens of one seeded row over several steps, placed at `row` among random neighbours."""
    torch.manual_seed(rng_seed)
    gen = torch.Generator().manual_seed(seed)
    other_gen = torch.Generator().manual_seed(seed + 1000)
    out = []
    for step_logits in steps:
        logits = torch.randn(batch_size, step_logits.shape[0]) * 3  # neighbours: fresh noise
        logits[row] = step_logits
        params = [SamplingParams(temperature=0.7 + 0.1 * i) for i in range(batch_size)]
        params[row] = SamplingParams(seed=seed, temperature=1.0)
        gens: list[torch.Generator | None] = [None] * batch_size
        gens[row] = gen
        if batch_size > 2:  # another seeded neighbour, and a greedy one
            other = (row + 1) % batch_size
            params[other] = SamplingParams(seed=seed + 1000)
            gens[other] = other_gen
            params[(row + 2) % batch_size] = SamplingParams(temperature=0.0)
        out.append(run(params, logits, generators=gens).token_ids[row].item())
    return out


def test_seed_reproducible_whatever_the_batch():
    torch.manual_seed(5)
    steps = [torch.randn(200) * 0.5 for _ in range(8)]  # flat-ish: draws are really random
    alone = _seeded_run(42, steps, row=0, batch_size=1, rng_seed=0)
    in_batch = _seeded_run(42, steps, row=3, batch_size=6, rng_seed=123)
    in_batch2 = _seeded_run(42, steps, row=1, batch_size=4, rng_seed=999)
    assert alone == in_batch == in_batch2
    other_seed = _seeded_run(43, steps, row=0, batch_size=1, rng_seed=0)
    assert other_seed != alone


def test_unseeded_rows_follow_global_rng():
    logits = torch.zeros(1, 1000)
    a = [(torch.manual_seed(s), run([SamplingParams()], logits).token_ids.item())[1] for s in (1, 1, 2)]
    assert a[0] == a[1] and a[0] != a[2]


# ---- logprobs -------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(6)
    B, V = 6, 40
    logits = torch.randn(B, V) * 2
    params = [
        SamplingParams(logprobs=3, temperature=0.5, presence_penalty=1.5, repetition_penalty=1.7),
        SamplingParams(logprobs=1, **GREEDY),
        SamplingParams(),
        SamplingParams(logprobs=0, top_k=5, frequency_penalty=-1.0),
        SamplingParams(logprobs=2, min_p=0.3, seed=7),
        SamplingParams(top_p=0.5),
    ]
    gens = [None, None, None, None, torch.Generator().manual_seed(7), None]
    before = logits.clone()
    out = run(params, logits, outputs=[[1, 2, 2]] * B, prompts=[[5]] * B, generators=gens)
    assert torch.equal(logits, before)  # caller's logits untouched
    ref = torch.log_softmax(logits, dim=-1)
    assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, ref.gather(-1, out.token_ids[:, None]).squeeze(-1), atol=1e-5)
    top_vals, top_ids = torch.topk(ref, 3, dim=-1)
    assert out.top_logprobs is not None and out.top_token_ids is not None
    assert out.top_logprobs.shape == (B, 3)
    assert torch.equal(out.top_token_ids, top_ids)
    assert torch.allclose(out.top_logprobs, top_vals, atol=1e-5)


def test_no_top_logprobs_unless_asked():
    out = run([SamplingParams(), SamplingParams(**GREEDY)], torch.randn(2, 10))
    assert out.top_logprobs is None and out.top_token_ids is None
    out = run([SamplingParams(logprobs=0)], torch.randn(1, 10))
    assert out.top_logprobs is not None and out.top_logprobs.shape == (1, 0)


# ---- batch building -------------------------------------------------------------------


def test_build_skips_penalty_state_when_unused_and_checks_ids():
    b = SamplingBatch.build([SamplingParams(top_k=-1)], [[1, 2]], [[3]], 10, [None])
    assert b.output_counts is None and b.top_k.tolist() == [10]
    with pytest.raises(ValueError, match="token ids"):
        SamplingBatch.build([SamplingParams(presence_penalty=1.0)], [[1]], [[10]], 10, [None])
    with pytest.raises(ValueError, match="length"):
        SamplingBatch.build([SamplingParams()], [[1]], [], 10, [None])


# ---- SamplingParams -------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,value",
    [
        ("n", 0),
        ("n", 1.5),
        ("n", True),
        ("temperature", -0.1),
        ("temperature", "hot"),
        ("temperature", math.inf),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("top_p", "x"),
        ("top_k", -2),
        ("top_k", 2.0),
        ("top_k", True),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.1),
        ("presence_penalty", math.nan),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", "1"),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("max_tokens", 3.0),
        ("max_tokens", False),
        ("min_tokens", -1),
        ("min_tokens", 1.0),
        ("logprobs", -1),
        ("logprobs", 2.0),
        ("logprobs", True),
        ("seed", 1.5),
        ("seed", "42"),
        ("seed", True),
        ("stop", 5),
        ("stop", ["ok", 3]),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", 3),
        ("stop_token_ids", [True]),
        ("ignore_eos", 1),
        ("include_stop_str_in_output", "yes"),
        ("skip_special_tokens", None),
    ],
)
def test_sampling_params_rejects_bad_value(name, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{name: value})
    assert name in str(e.value) and repr(value) in str(e.value)


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match="min_tokens.*max_tokens"):
        SamplingParams(min_tokens=20, max_tokens=10)
    assert SamplingParams(min_tokens=20, max_tokens=None).min_tokens == 20


def test_sampling_params_defaults_and_normalization():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None and not p.greedy
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(top_k=-1).top_k == -1
    assert isinstance(SamplingParams(temperature=1).temperature, float)
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-4).greedy
    assert SamplingParams(top_k=1).greedy


def test_from_dict():
    p = SamplingParams.from_dict({"temperature": 0.5, "stop": "x", "max_tokens": 8})
    assert p == SamplingParams(temperature=0.5, stop=["x"], max_tokens=8)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams.from_dict({"temperature": 0.5, "best_of": 2})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({"top_p": 2.0})
