"""The DSpark draft (docs/speculative.md §7 items 1, 2, 3, 4 at the model level, 6, 8).

Every parameter is randomized (norm weights, gates, Markov tables included). The
engine-level lossless test (scheduler + runner + rejection sampler driving DSparkProposer)
belongs to the engine side (tests of `engine/spec_decode`); here the speculative loop is a
plain one: the target verifies by recomputing the whole sequence.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from musespark.config import ModelConfig
from musespark.engine.spec_decode.dspark import DSparkProposer
from musespark.engine.spec_decode.proposer import Proposal, ProposalRequest, Proposer
from musespark.layers.attention import AttentionContext
from musespark.layers.norm import RMSNorm
from musespark.layers.rotary import apply_rotary, apply_rotary_interleaved, cos_sin, inv_frequencies
from musespark.model import MuseSparkForCausalLM, init_random_weights
from musespark.model.dspark import DSparkDraft
from musespark.model.dspark_config import DSparkConfig, gain_center
from musespark.model.dspark_kv import DraftSeq, PagedDraftKV
from musespark.model.dspark_layers import attention_scores, draft_norm, interleaved_rope, position_mask, residual_gate
from musespark.model.dspark_loader import load_draft, save_draft, target_forward_with_aux

L_T = 4
TCFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=L_T,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    moe_hidden_size=16,
    moe_intermediate_size=24,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=16,
    bos_token_id=1,
    eos_token_id=2,
    mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
    rope_theta=10000.0,
    max_position_embeddings=512,
)
V_D = 48  # reduced draft vocabulary


def d2t_table() -> torch.Tensor:
    """A reduced vocabulary: every target id except 16 scattered ones (ascending), as offsets."""
    keep = sorted(set(range(64)) - set(range(3, 64, 4)))
    return torch.tensor(keep) - torch.arange(V_D)


def make_cfg(**over) -> DSparkConfig:
    base = dict(
        target_layer_ids=(0, 2, 3),
        target_hidden_size=32,
        mask_token_id=5,
        markov_rank=4,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        vocab_size=64,
        draft_vocab_size=V_D,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        ffn_dim_multiplier=1.5,
        rope_theta=1000.0,
        residual_dtype="fp32",
        moe_is_enabled=False,
        output_soft_cap_temp=15.0,
    )
    base.update(over)
    cfg = DSparkConfig(**base)
    cfg.validate()
    return cfg


def random_draft(cfg: DSparkConfig, seed: int = 0) -> DSparkDraft:
    model = DSparkDraft(cfg, L_T)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name == "lm_head.weight":
                p.copy_(noise * 3 / p.shape[-1] ** 0.5)
            elif p.ndim == 2:
                p.copy_(noise / p.shape[-1] ** 0.5)
            elif name.endswith(".gate"):
                p.copy_(noise)
            else:  # norm weights, confidence bias
                p.copy_(1.0 + 0.3 * noise)
        model.markov_head.markov_w1.weight.copy_(torch.randn(model.markov_head.markov_w1.weight.shape, generator=g))
        if cfg.d_vocab == V_D:
            model.d2t.copy_(d2t_table())
    return model.eval()


def random_target(seed: int = 3) -> MuseSparkForCausalLM:
    model = MuseSparkForCausalLM(TCFG)
    init_random_weights(model, seed=seed)
    return model.eval()


# -- 1. building blocks --------------------------------------------------------------------
def test_norms_match_hand_formulas():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 16, generator=g), torch.randn(16, generator=g)
    eps = 1e-5
    inv = 1 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    for center in (0.0, 1.0, 0.25):
        n = draft_norm(16, eps, True, center)
        n.weight.data.copy_(w)
        assert torch.allclose(n(x, torch.float32), x * inv * (w + center), atol=1e-6)
        s = draft_norm(16, eps, True, center, input_scaled=True)
        s.weight.data.copy_(w)
        z = x * (w + center)
        assert torch.allclose(s(x, torch.float32), z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + eps), atol=1e-5)
    assert torch.allclose(draft_norm(16, eps, False)(x, torch.float32), x * inv, atol=1e-6)
    assert draft_norm(16, eps, True)(x.bfloat16(), torch.bfloat16).dtype == torch.bfloat16


def test_gain_centres_and_global_layer_index():
    assert gain_center("one", 7) == 1.0 and gain_center("zero", 7) == 0.0
    assert gain_center("inverse_residual_index", 9) == 1 / 10
    assert gain_center("inverse_residual_index_v2", 9) == gain_center("inverse_residual_index_p1", 9) == 1 / 10
    assert gain_center("inverse_sqrt_residual_index", 11) == 1 / math.sqrt(12)
    with pytest.raises(ValueError, match="inverse_sqrt_layers"):
        gain_center("inverse_sqrt_layers", 3)
    cfg = make_cfg(norm_zero_centered_gamma=True, post_norm_gain_center_type="inverse_residual_index_v2")
    model = DSparkDraft(cfg, L_T)
    for i, layer in enumerate(model.layers):
        ell = L_T + i
        assert layer.post_attn_norm.gain_center == 1 / (2 * ell + 2)
        assert layer.post_ffn_norm.gain_center == 1 / (2 * ell + 3)
        assert layer.pre_ffn_norm.gain_center == layer.self_attn.pre_qkv_proj_norm.gain_center == 1.0
    assert model.norm.gain_center == model.hidden_norm.gain_center == 1.0
    plain = DSparkDraft(make_cfg(), L_T)
    assert plain.layers[0].post_attn_norm.gain_center == 0.0  # not zero-centred: gain = w


def test_gated_residual():
    g = torch.Generator().manual_seed(2)
    add = residual_gate(16)
    add.gate.data.copy_(torch.randn(16, generator=g))
    s, b = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g)
    w = add.gate / 0.3
    beta = torch.sigmoid(w)
    alpha = torch.sqrt(1 - beta**2)
    assert torch.allclose(alpha**2 + beta**2, torch.ones(16), atol=1e-6)
    assert torch.allclose(add(s, b), alpha * s + beta * b, atol=1e-5)
    add.gate.data.fill_(10.0)  # saturated: the clamp holds alpha at sqrt(1e-3)
    assert torch.allclose(add(s, b), math.sqrt(1e-3) * s + torch.sigmoid(torch.tensor(10 / 0.3)) * b, atol=1e-6)


def test_interleaved_rope_formula_and_rotate_half_equivalence():
    g = torch.Generator().manual_seed(3)
    hd, theta = 8, 500.0
    x = torch.randn(6, 3, hd, generator=g)
    pos = torch.tensor([0, 1, 5, 17, 100, 333])
    got = interleaved_rope(x, pos, theta)
    want = torch.empty_like(x)
    for t in range(6):
        for m in range(hd // 2):
            phi = float(pos[t]) * theta ** (-2 * m / hd)
            a, b = x[t, :, 2 * m], x[t, :, 2 * m + 1]
            want[t, :, 2 * m] = a * math.cos(phi) - b * math.sin(phi)
            want[t, :, 2 * m + 1] = b * math.cos(phi) + a * math.sin(phi)
    assert torch.allclose(got, want, atol=1e-5)
    # rows permuted to [even | odd] + rotate-half RoPE = the same rotation, permuted
    perm = torch.cat((torch.arange(0, hd, 2), torch.arange(1, hd, 2)))
    cos, sin = cos_sin(pos, inv_frequencies(theta, hd))
    assert torch.allclose(apply_rotary(x[..., perm], cos, sin), got[..., perm], atol=1e-5)
    k = torch.randn(6, 3, hd, generator=g)
    dots = (interleaved_rope(k, pos, theta) * got).sum(-1)
    dots_half = (apply_rotary(k[..., perm], cos, sin) * apply_rotary(x[..., perm], cos, sin)).sum(-1)
    assert torch.allclose(dots, dots_half, atol=1e-4)


def reference_layer(layer, s, pos, ctx_k, ctx_v, ctx_pos, cfg: DSparkConfig):
    """The layer by hand (§4.3-4.4, fp32): explicit head loop, GQA by h // groups."""

    def rmsn(x, eps=cfg.rms_norm_eps):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def norm(n, x):
        if n.input_scaled:
            return rmsn(x * (n.weight + n.gain_center), n.eps)
        return rmsn(x, n.eps) * (n.weight + n.gain_center if n.weight is not None else 1.0)

    a, nh, nkv, hd = layer.self_attn, cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
    u = norm(a.pre_qkv_proj_norm, s)
    q = rmsn((u @ a.q_proj.weight.T).view(-1, nh, hd))
    k = rmsn((u @ a.k_proj.weight.T).view(-1, nkv, hd))
    v = (u @ a.v_proj.weight.T).view(-1, nkv, hd)
    if cfg.temperature_tuned(layer.ell):
        f = 1 + cfg.attn_temperature_tuning_q_scale_constant * torch.log(
            (pos + 1) / cfg.attn_temperature_tuning_floor_scale
        )
        q = q * f.clamp(min=1)[:, None, None]
    q, k = interleaved_rope(q, pos, cfg.rope_theta), interleaved_rope(k, pos, cfg.rope_theta)
    keys, vals, kpos = torch.cat((ctx_k, k)), torch.cat((ctx_v, v)), torch.cat((ctx_pos, pos))
    o = torch.empty(len(pos), nh, hd)
    for h in range(nh):
        j = h // (nh // nkv)
        scores = q[:, h] @ keys[:, j].T * cfg.q_scale / math.sqrt(hd)
        scores = scores.masked_fill(kpos[None, :] > pos[:, None], float("-inf"))
        o[:, h] = torch.softmax(scores, -1) @ vals[:, j]
    if cfg.use_attn_o_norm:
        o = rmsn(o)
    if cfg.use_attn_o_gate:
        o = o * torch.sigmoid((u @ a.o_gate_proj.weight.T).view(-1, nh, hd))
    b = norm(layer.post_attn_norm, o.reshape(len(pos), -1) @ a.o_proj.weight.T)
    s = layer.add_attn(s, b) if layer.add_attn is not None else s + b
    f = norm(layer.pre_ffn_norm, s)
    ff = layer.feed_forward
    m = (torch.nn.functional.silu(f @ ff.gate_proj.weight.T) * (f @ ff.up_proj.weight.T)) @ ff.down_proj.weight.T
    b = norm(layer.post_ffn_norm, m)
    return layer.add_ffn(s, b) if layer.add_ffn is not None else s + b


@pytest.mark.parametrize(
    "over",
    [
        {},
        dict(
            use_attn_o_gate=True,
            use_attn_o_norm=True,
            use_residual_gate=True,
            norm_zero_centered_gamma=True,
            post_norm_gain_center_type="inverse_sqrt_residual_index",
            use_ffn_learnable_scales=True,
            attn_temperature_tuning_floor_scale=4.0,
            attn_temperature_tuning_q_scale_constant=0.3,
            attn_temperature_tuning_layers="global",
            use_sqrt_attn_scaling=True,
        ),
        dict(use_attn_o_gate=True, post_norm_affine=False, norm_affine=False),
    ],
)
def test_layer_matches_hand_computation(over):
    cfg = make_cfg(**over)
    model = random_draft(cfg, seed=4)
    g = torch.Generator().manual_seed(5)
    layer = model.layers[1]
    n_ctx, n = 9, 4
    s = torch.randn(n, 32, generator=g)
    pos = torch.arange(n_ctx, n_ctx + n)
    ctx_k = torch.randn(n_ctx, 2, 8, generator=g)
    ctx_v = torch.randn(n_ctx, 2, 8, generator=g)
    ctx_pos = torch.arange(n_ctx)

    def attend(i, q, k, v):
        keys, vals = torch.cat((ctx_k, k)), torch.cat((ctx_v, v))
        return attention_scores(
            q, keys, vals, position_mask(pos, torch.cat((ctx_pos, pos)), None), model.attention_scale()
        )

    with torch.no_grad():
        got = layer(s, pos, attend, torch.float32)
        want = reference_layer(layer, s, pos, ctx_k, ctx_v, ctx_pos, cfg)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_inference_fusions_equal_training_path():
    """Without gradients the layer stacks q|k|v|o_gate and gate|up into one matmul each and
    caches norm gains and the Markov table; the result must equal the autograd path, and
    an in-place weight change must invalidate the caches."""
    cfg = make_cfg(use_attn_o_gate=True, use_residual_gate=True)
    model = random_draft(cfg, seed=21)
    embed, aux = torch.randn(64, 32), torch.randn(25, 96)
    anchors = torch.tensor([7])
    with torch.no_grad():
        fast = monolithic_logits(model, embed, aux, 20, 7, 4)
        y = torch.randn(1, 4, 32)
        toks_fast, _, _ = model.choose(y, anchors)
    slow = monolithic_logits(model, embed, aux, 20, 7, 4)  # grad enabled: module-by-module path
    toks_slow, _, _ = model.choose(y, anchors)
    assert slow.requires_grad and torch.allclose(fast, slow, atol=1e-5)
    assert torch.equal(toks_fast, toks_slow)
    with torch.no_grad():
        model.layers[0].self_attn.k_proj.weight.mul_(-1.0)
        model.layers[0].feed_forward.up_proj.weight.mul_(0.5)
        model.norm.weight.add_(0.3)
        changed = monolithic_logits(model, embed, aux, 20, 7, 4)
    assert torch.allclose(changed, monolithic_logits(model, embed, aux, 20, 7, 4), atol=1e-5)
    assert not torch.allclose(changed, fast)


def test_context_path_formula():
    cfg = make_cfg()
    model = random_draft(cfg, seed=6)
    aux = torch.randn(7, 96, generator=torch.Generator().manual_seed(7))
    pos = torch.arange(3, 10)
    with torch.no_grad():
        kv = model.context_kv(aux, pos)
        c = model.hidden_norm(aux @ model.fc.weight.T, torch.float32)
        for layer, (k, v) in zip(model.layers, kv):
            u = layer.self_attn.pre_qkv_proj_norm(c, torch.float32)  # the layer's own pre-norm, after hidden_norm
            kk = (u @ layer.self_attn.k_proj.weight.T).view(7, 2, 8)
            kk = interleaved_rope(kk / torch.sqrt(kk.pow(2).mean(-1, keepdim=True) + 1e-5), pos, cfg.rope_theta)
            assert torch.allclose(k, kk, atol=1e-5)
            assert torch.allclose(v, (u @ layer.self_attn.v_proj.weight.T).view(7, 2, 8), atol=1e-5)


# -- 2./3. cache equivalence and position bookkeeping ----------------------------------------
def monolithic_logits(model: DSparkDraft, embed, aux, p0: int, anchor: int, n: int) -> torch.Tensor:
    """Reference: context K/V of positions [0, p0) computed at once, one causal pass over [ctx; block]."""
    ctx = model.context_kv(aux[:p0], torch.arange(p0))
    pos = torch.arange(p0, p0 + n)
    tokens = torch.tensor([anchor] + [model.config.mask_token_id] * (n - 1))

    def attend(i, q, k, v):
        ck, cv = ctx[i]
        return attention_scores(
            q,
            torch.cat((ck, k)),
            torch.cat((cv, v)),
            position_mask(pos, torch.arange(p0 + n), model.layers[i].window),
            model.attention_scale(),
        )

    return model.lm_head(model.block_hidden(tokens, pos, embed, attend))


class PagedCache:
    """One request's draft context in a paged cache, its blocks in shuffled order."""

    def __init__(self, model: DSparkDraft, num_blocks: int = 64, block_size: int = 4) -> None:
        self.kv = PagedDraftKV.allocate(model, num_blocks, block_size, "cpu")
        self.table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(num_blocks)).tolist()
        self.seq = DraftSeq()

    def fill(self, value: float | None = None, std: float = 1.0) -> None:
        for k, v in self.kv.caches:
            for t in (k, v):
                t.fill_(value) if value is not None else t.normal_(0, std)

    def write(self, start: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        n = kv[0][0].shape[0]
        self.seq.advance(start, n)
        slots = torch.tensor(self.kv.slots(self.table, range(start, start + n)))
        for layer, (k, v) in enumerate(kv):
            self.kv.store(layer, slots, k, v)

    def attend(self, model: DSparkDraft, positions: torch.Tensor):
        return self.kv.attend(model, [self.table], [self.seq], positions)


def test_incremental_cache_equals_monolithic_over_many_steps():
    torch.manual_seed(8)
    cfg = make_cfg(global_attn_cfg=(6, 0))  # layer 0 (global 4) sliding window 6, layer 1 full
    model = random_draft(cfg, seed=9)
    embed = torch.randn(64, 32)
    total, N = 200, 5
    aux = torch.randn(total, 96)
    cache = PagedCache(model)
    cache.fill(float("nan"))  # an unwritten slot read anywhere would poison the output
    p0 = 11
    with torch.no_grad():
        cache.write(0, model.context_kv(aux[:p0], torch.arange(p0)))  # prefill
        steps = 0
        while p0 + N + 1 < total:
            anchor = int(torch.randint(64, ()))
            pos = torch.arange(p0, p0 + N)[None]
            tokens = torch.tensor([[anchor] + [cfg.mask_token_id] * (N - 1)])
            got = model.lm_head(model.block_hidden(tokens, pos, embed, cache.attend(model, pos)))[0]
            want = monolithic_logits(model, embed, aux, p0, anchor, N)
            assert torch.allclose(got, want, atol=1e-4), (steps, (got - want).abs().max())
            assert cache.seq.length == p0  # the block starts right after the last context position
            # target verifies anchor + N drafts (N+1 rows, written speculatively), then k are accepted
            k = int(torch.randint(0, N + 1, ()))
            cache.write(
                p0,
                [
                    (kk + 100.0, vv - 100.0)
                    for kk, vv in model.context_kv(aux[p0 : p0 + N + 1] * 3, torch.arange(p0, p0 + N + 1))
                ],
            )  # junk rows
            cache.write(p0, model.context_kv(aux[p0 : p0 + k + 1], torch.arange(p0, p0 + k + 1)))  # the valid rows
            p0 += k + 1
            steps += 1
    assert steps > 30


def test_window_and_no_window_caches_differ():
    """The window is really applied (guards the test above against a vacuous rule)."""
    cfg_w, cfg_f = make_cfg(global_attn_cfg=(3,)), make_cfg()
    a, b = random_draft(cfg_w, seed=1), random_draft(cfg_f, seed=1)
    embed, aux = torch.randn(64, 32), torch.randn(30, 96)
    with torch.no_grad():
        assert not torch.allclose(
            monolithic_logits(a, embed, aux, 20, 7, 4), monolithic_logits(b, embed, aux, 20, 7, 4)
        )


class SpyDraft:
    """Records the block positions and anchors the proposer asks for."""

    def __init__(self, draft: DSparkDraft) -> None:
        self.calls: list[tuple[list[list[int]], list[int]]] = []
        original = draft.block_hidden

        def spy(tokens, positions, embed, attend, context=None):
            self.calls.append((positions.tolist(), tokens[:, 0].tolist()))
            return original(tokens, positions, embed, attend, context)

        draft.block_hidden = spy


def test_proposer_positions_and_rollback():
    target = random_target()
    draft = random_draft(make_cfg(), seed=10)
    prop = DSparkProposer(draft, target, num_speculative_tokens=4)
    spy = SpyDraft(draft)
    assert prop.aux_layers == (0, 2, 3)
    ids = torch.randint(3, 64, (30,), generator=torch.Generator().manual_seed(11)).tolist()
    with torch.no_grad():
        _, aux = target_forward_with_aux(
            target, torch.tensor(ids), torch.arange(30), AttentionContext.for_prompts([30]), prop.aux_layers
        )
    # prefill of 20 tokens, anchor ids[20] at position 20
    out = prop.propose([ProposalRequest("r", ids[:21], 0, aux[:20], 4)])
    assert spy.calls[-1] == ([[20, 21, 22, 23]], [ids[20]])
    assert len(out[0].token_ids) == 4 and out[0].probs is None
    # verification accepted 2 drafts: rows 20..22 valid, anchor at 23
    out = prop.propose([ProposalRequest("r", ids[:24], 20, aux[20:23], 2)])
    assert spy.calls[-1] == ([[23, 24, 25, 26]], [ids[23]]) and len(out[0].token_ids) == 2
    # a rollback (preemption) to position 10, then the same positions again: drafts equal a fresh request's
    a = prop.propose([ProposalRequest("r", ids[:26], 10, aux[10:25], 4)])
    b = prop.propose([ProposalRequest("fresh", ids[:26], 0, aux[:25], 4)])
    assert a[0].token_ids == b[0].token_ids
    assert prop.propose([ProposalRequest("s", ids[:10], 0, aux[:5], 0)])[0].token_ids == []  # prefill chunk
    prop.propose([ProposalRequest("s", ids[:10], 7, aux[7:9], 3)])  # positions 5, 6 never given: a gap
    assert spy.calls[-1] == ([[9, 10, 11, 12]], [ids[9]])
    assert prop._seqs["s"].gaps == [(5, 7)] and prop._seqs["s"].known(9).tolist() == [0, 1, 2, 3, 4, 7, 8]
    prop.propose([ProposalRequest("s", ids[:10], 5, aux[5:9], 3)])  # filled later: no gap
    assert not prop._seqs["s"].gaps
    with pytest.raises(ValueError, match="no anchor"):
        prop.propose([ProposalRequest("s", ids[:10], 5, aux[5:10], 3)])
    prop.drop("r")
    prop.drop("fresh")
    assert set(prop._seqs) == {"s"}


def test_withheld_rows_are_a_gap_like_a_prefix_hit():
    """Steps whose rows the engine withholds (hidden=None: a request backing off between probes)
    compute no context row and no block; their positions become one gap, and the probe after
    them drafts exactly what a request whose positions were skipped in one jump drafts."""
    target = random_target()
    draft = random_draft(make_cfg(), seed=10)
    ids = torch.randint(3, 64, (30,), generator=torch.Generator().manual_seed(11)).tolist()
    with torch.no_grad():
        _, aux = target_forward_with_aux(
            target, torch.tensor(ids), torch.arange(30), AttentionContext.for_prompts([30]), (0, 2, 3)
        )
    rows, blocks = [], SpyDraft(draft).calls
    features = draft.context_features

    def counted(x):
        rows.append(x.shape[0])
        return features(x)

    draft.context_features = counted
    backing_off, jumped = DSparkProposer(draft, target, 4), DSparkProposer(draft, target, 4)
    for prop in (backing_off, jumped):
        prop.propose([ProposalRequest("r", ids[:21], 0, aux[:20], 4)])  # prefill, then a draft at 20
    rows.clear()
    blocks.clear()
    for p in range(20, 26):  # decode steps computing position p, rows withheld, no drafts
        assert backing_off.propose([ProposalRequest("r", ids[: p + 2], p, None, 0)])[0].token_ids == []
    assert rows == [] and blocks == []  # nothing computed
    assert backing_off._seqs["r"].gaps == [(20, 25)]  # one range, however many steps
    # the step before the probe hands its row over (position 26), the probe drafts at 27
    a = backing_off.propose([ProposalRequest("r", ids[:28], 26, aux[26:27], 1)])
    b = jumped.propose([ProposalRequest("r", ids[:28], 26, aux[26:27], 1)])
    assert rows == [1, 1] and len(a[0].token_ids) == 1 and a[0].token_ids == b[0].token_ids
    assert backing_off._seqs["r"].gaps == jumped._seqs["r"].gaps == [(20, 26)]


def test_gap_positions_are_never_attended():
    """A request first seen at context_start > 0 (a target prefix-cache hit): its drafts equal
    the monolithic reference over the known positions only."""
    model = random_draft(make_cfg(), seed=20)
    embed, aux = torch.randn(64, 32), torch.randn(40, 96)
    cache = PagedCache(model)
    cache.fill(std=100.0)  # junk where nothing was written (finite: masked weights are 0, 0 * nan is not)
    with torch.no_grad():
        cache.write(12, model.context_kv(aux[12:30], torch.arange(12, 30)))
        pos = torch.arange(30, 34)
        tokens = torch.tensor([9, 5, 5, 5])
        got = model.lm_head(model.block_hidden(tokens[None], pos[None], embed, cache.attend(model, pos[None])))
        ctx = model.context_kv(aux[12:30], torch.arange(12, 30))

        def attend(i, q, k, v):
            ck, cv = ctx[i]
            return attention_scores(
                q,
                torch.cat((ck, k)),
                torch.cat((cv, v)),
                position_mask(pos, torch.cat((torch.arange(12, 30), pos)), None),
                model.attention_scale(),
            )

        want = model.lm_head(model.block_hidden(tokens, pos, embed, attend))
    assert torch.allclose(got[0], want, atol=1e-5)


# -- 4. lossless greedy with a plain speculative loop ------------------------------------------
def speculative_greedy(
    target, proposer: Proposer, prompt: list[int], max_new: int, n: int
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding, verified by recomputing the target over the whole sequence.
    -> (generated tokens, accepted drafts per step)."""
    layers = proposer.aux_layers

    def run(ids):
        with torch.no_grad():
            y, aux = target_forward_with_aux(
                target, torch.tensor(ids), torch.arange(len(ids)), AttentionContext.for_prompts([len(ids)]), layers
            )
            return target.compute_logits(y).argmax(-1).tolist(), aux

    pred, aux = run(prompt)
    seq = prompt + [pred[-1]]
    start, rows, accepted = 0, aux, []
    while len(seq) - len(prompt) < max_new:
        p0 = len(seq) - 1
        drafts = proposer.propose([ProposalRequest("r", list(seq), start, rows, n)])[0].token_ids
        pred, aux = run(seq + drafts)  # target verifies anchor + drafts at p0 .. p0+n
        k = 0
        while k < len(drafts) and drafts[k] == pred[p0 + k]:
            k += 1
        accepted.append(k)
        seq += drafts[:k] + [pred[p0 + k]]
        start, rows = p0, aux[p0 : p0 + k + 1]
    proposer.drop("r")
    return seq[len(prompt) : len(prompt) + max_new], accepted


class OracleProposer(Proposer):
    """Drafts the target's own greedy continuation (or, adversarially, anything else)."""

    def __init__(self, target, prompt, n, adversarial=False):
        self.future = prompt + target.greedy_continuation(prompt, 60)
        self.adversarial = adversarial

    def propose(self, requests):
        r = requests[0]
        nxt = self.future[len(r.token_ids) : len(r.token_ids) + r.num_tokens]
        return [Proposal([(t + 1) % 64 if self.adversarial else t for t in nxt])]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_speculative_greedy_is_lossless(n):
    target = random_target(seed=12)
    prompt = torch.randint(3, 64, (9,), generator=torch.Generator().manual_seed(n)).tolist()
    want = target.greedy_continuation(prompt, 24)
    draft = random_draft(make_cfg(), seed=13 + n)
    got, accepted = speculative_greedy(target, DSparkProposer(draft, target, n), prompt, 24, n)
    assert got == want
    assert all(0 <= k <= n for k in accepted)


def test_oracle_and_adversarial_drafts():
    target = random_target(seed=14)
    prompt = [5, 9, 33, 2, 17, 40]
    n = 4
    want = target.greedy_continuation(prompt, 20)
    got, accepted = speculative_greedy(target, OracleProposer(target, prompt, n), prompt, 20, n)
    assert got == want and all(k == n for k in accepted)
    got, accepted = speculative_greedy(target, OracleProposer(target, prompt, n, adversarial=True), prompt, 20, n)
    assert got == want and set(accepted) == {0}


# -- 6. Markov stage ------------------------------------------------------------------------------
def test_markov_stage():
    cfg = make_cfg()
    model = random_draft(cfg, seed=15)
    y = torch.randn(3, 6, 32, generator=torch.Generator().manual_seed(16))
    anchors = torch.tensor([4, 17, 63])
    with torch.no_grad():
        toks, logits, conf = model.choose(y, anchors, with_confidence=True)
        assert logits is None  # greedy: argmax without the monotone cap
        # loop == teacher-forced vectorised computation on the chosen tokens
        prev = torch.cat((anchors[:, None], toks[:, :-1]), 1)
        tf = model.markov_logits(model.lm_head(y), prev)
        assert torch.equal(toks, (torch.arange(V_D) + d2t_table())[tf.argmax(-1)])
        assert torch.allclose(model.confidence(y, prev), conf, atol=1e-6)
        # a sampler sees the capped logits l' of the loop, equal to the teacher-forced ones
        seen = []
        toks_s, logits, _ = model.choose(y, anchors, lambda lk, k: seen.append(lk) or lk.argmax(-1))
        assert torch.equal(toks_s, toks) and len(seen) == 6
        assert torch.allclose(tf, logits, atol=1e-5)
        # d2t: target id = draft id + d2t[draft id], in the reduced vocabulary's set
        keep = torch.arange(V_D) + d2t_table()
        assert torch.equal(toks, keep[logits.argmax(-1)])
        assert not bool((toks % 4 == 3).any())  # the ids left out of the draft vocabulary
        # the Markov bias matters, and without it the choice is the plain argmax of the base logits
        model.markov_head.markov_w2.weight.zero_()
        toks0, _, _ = model.choose(y, anchors)
        assert torch.equal(toks0, keep[model.lm_head(y).argmax(-1)])
        assert not torch.equal(toks0, toks)
    # capped logits: tau * tanh(mu * l / tau)
    base = model.lm_head(y[:, 0])
    assert torch.allclose(model.markov_logits(base, anchors), 15.0 * torch.tanh(base / 15.0), atol=1e-5)


def test_probabilistic_drafts_and_scatter():
    target = random_target()
    draft = random_draft(make_cfg(), seed=17)
    prop = DSparkProposer(draft, target, 5, draft_sample_method="probabilistic", temperature=1.0, seed=3)
    ids = torch.randint(3, 64, (12,), generator=torch.Generator().manual_seed(18)).tolist()
    with torch.no_grad():
        _, aux = target_forward_with_aux(
            target, torch.tensor(ids), torch.arange(12), AttentionContext.for_prompts([12]), prop.aux_layers
        )
    a = prop.propose([ProposalRequest("x", ids, 0, aux[:11], 5)])[0]
    assert a.probs is not None and a.probs.shape == (5, 64) and a.probs.dtype == torch.float32
    assert torch.allclose(a.probs.sum(-1), torch.ones(5), atol=1e-5)
    assert float(a.probs[:, 3::4].abs().sum()) == 0.0  # mass only on ids in the draft vocabulary
    assert all(float(a.probs[k, t]) > 0 for k, t in enumerate(a.token_ids))
    b = prop.propose([ProposalRequest("x", ids, 0, aux[:11], 5)])[0]  # same request, same positions
    assert a.token_ids == b.token_ids
    with pytest.raises(ValueError, match="draft_sample_method"):
        DSparkProposer(draft, target, 5, draft_sample_method="beam")


# -- 8. config and loader ---------------------------------------------------------------------------
def test_config_parsing():
    cfg = make_cfg()
    d = cfg.to_dict()
    assert DSparkConfig.from_dict(json.loads(json.dumps(d))) == cfg
    with pytest.raises(ValueError, match="bogus_key"):
        DSparkConfig.from_dict(d | {"bogus_key": 1})
    for key in ("target_layer_ids", "markov_rank", "mask_token_id", "enable_confidence_head", "target_hidden_size"):
        with pytest.raises(ValueError, match=key):
            DSparkConfig.from_dict({k: v for k, v in d.items() if k != key})
    with pytest.raises(ValueError, match="confidence_head_with_markov"):
        DSparkConfig.from_dict({k: v for k, v in d.items() if k != "confidence_head_with_markov"})
    with pytest.raises(ValueError, match="MoE"):
        DSparkDraft(DSparkConfig.from_dict(d | {"moe": {}}), L_T)  # defaults: every layer MoE
    with pytest.raises(ValueError, match="use_qk_norm"):
        DSparkConfig.from_dict(d | {"use_qk_norm": False})
    alias = {k: v for k, v in d.items() if k != "mask_token_id"} | {"dflash_config": {"mask_token_id": 9}}
    assert DSparkConfig.from_dict(alias).mask_token_id == 9
    assert DSparkConfig.from_dict(d | {"draft_position_mode": "nope"}).use_rope is False
    assert DSparkConfig.from_dict(d | {"global_attn_cfg": "[4, 0]"}).global_attn_cfg == (4, 0)
    assert DSparkConfig.from_dict(d | {"global_attn_cfg": "all"}).global_attn_cfg is None
    with pytest.raises(ValueError, match="positional mode"):
        DSparkDraft(dataclasses.replace(cfg, every_n_layers_nope=2), L_T)


def test_loader_roundtrip_and_errors(tmp_path):
    cfg = make_cfg()
    model = random_draft(cfg, seed=19)
    path = save_draft(model, tmp_path / "d", dtype=torch.float32)
    loaded = load_draft(path, L_T, dtype=torch.float32)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert loaded.d2t.dtype == torch.long and loaded.confidence_head.proj.weight.dtype == torch.float32
    assert load_draft(path, L_T, dtype=torch.bfloat16).confidence_head.proj.weight.dtype == torch.float32
    tensors = load_file(str(path / "model.safetensors"))

    def variant(name: str, tensors: dict) -> object:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((path / "config.json").read_text())
        save_file(tensors, str(d / "model.safetensors"))
        return d

    prefixed = {(k if k.startswith(("lm_head", "d2t")) else "model." + k): v for k, v in tensors.items()}
    extra = prefixed | {"model.embed_tokens.weight": torch.randn(64, 32), "t2d": torch.zeros(64, dtype=torch.long)}
    again = load_draft(variant("prefixed", extra), L_T, dtype=torch.float32)  # embed_tokens, t2d ignored
    assert torch.equal(again.fc.weight, model.fc.weight)
    for missing in ("lm_head.weight", "d2t"):
        with pytest.raises(ValueError, match=missing):
            load_draft(variant("no_" + missing, {k: v for k, v in tensors.items() if k != missing}), L_T)
    with pytest.raises(ValueError, match="unexpected"):
        load_draft(variant("extra", tensors | {"layers.0.bogus.weight": torch.zeros(3)}), L_T)
    with pytest.raises(ValueError, match="shape"):
        load_draft(variant("shape", tensors | {"fc.weight": torch.zeros(32, 95)}), L_T)
    alias = {("encoder.fc.weight" if k == "fc.weight" else k): v for k, v in tensors.items()}
    assert torch.equal(load_draft(variant("alias", alias), L_T, dtype=torch.float32).fc.weight, model.fc.weight)
    with pytest.raises(ValueError, match="d2t"):
        load_draft(variant("bad_d2t", tensors | {"d2t": torch.full((V_D,), 100, dtype=torch.long)}), L_T)


def test_bf16_draft_and_dflash_layout(tmp_path):
    """The served dtype (bf16 weights, D = bf16, fp32 residual) tracks fp32; the DFlash layout
    (sample_from_anchor false) runs 1+N queries and drafts from the masks."""
    cfg = make_cfg()
    path = save_draft(random_draft(cfg, seed=22), tmp_path / "d", dtype=torch.float32)
    g = torch.Generator().manual_seed(24)
    embed, aux = torch.randn(64, 32, generator=g), torch.randn(30, 96, generator=g)
    with torch.no_grad():
        a = monolithic_logits(load_draft(path, L_T, dtype=torch.float32), embed, aux, 20, 7, 4)
        b16 = load_draft(path, L_T, dtype=torch.bfloat16)
        b = monolithic_logits(b16, embed.bfloat16(), aux, 20, 7, 4)
    assert b.dtype == torch.bfloat16 and PagedDraftKV.allocate(b16, 2, 4, "cpu").caches[0][0].dtype == torch.bfloat16
    assert float(torch.nn.functional.cosine_similarity(a, b.float(), dim=-1).min()) > 0.98
    target = random_target()
    draft = random_draft(make_cfg(sample_from_anchor=False), seed=23)
    spy = SpyDraft(draft)
    prop = DSparkProposer(draft, target, num_speculative_tokens=4)
    ids = list(range(6, 30))
    assert prop.propose([ProposalRequest("d", ids, 0, torch.randn(20, 96), 4)])[0].token_ids == []  # mid-prefill
    assert spy.calls == []
    out = prop.propose([ProposalRequest("d", ids[:21], 20, torch.randn(0, 96), 4)])
    assert spy.calls[-1] == ([[20, 21, 22, 23, 24]], [ids[20]]) and len(out[0].token_ids) == 4


def test_target_aux_stream_is_the_input_of_the_next_layer():
    """§6: aux for layer i = the fp32 stream after decoder layer i, ascending (the seam with the target)."""
    target = random_target(seed=25)
    ids = torch.randint(3, 64, (11,), generator=torch.Generator().manual_seed(26))
    pos, ctx = torch.arange(11), AttentionContext.for_prompts([11])
    with torch.no_grad():
        y, aux = target_forward_with_aux(target, ids, pos, ctx, (0, 2, 3))
        s, streams = target.backend.embed(target, ids), []
        for layer in target.layers:
            s = layer.forward(s, pos, ctx, {}, target.backend, torch.float32)
            streams.append(s.clone())
    assert aux.dtype == torch.float32 and aux.shape == (11, 96)
    assert torch.equal(aux, torch.cat([streams[0], streams[2], streams[3]], -1))
    assert torch.allclose(y, target(ids, pos, ctx), atol=0)


def test_proposer_batched_merged_pass_equals_monolithic():
    """Two requests in one propose call over many steps with random accept counts (context rows
    projected inside the block pass, one request sometimes only updating its context): every
    draft equals the monolithic reference's greedy Markov choice."""
    target = random_target(seed=27)
    cfg = make_cfg(global_attn_cfg=(9, 0))
    draft = random_draft(cfg, seed=28)
    N = 4
    prop = DSparkProposer(draft, target, N)
    g = torch.Generator().manual_seed(29)
    total = 120
    seqs = {r: torch.randint(3, 64, (total,), generator=g).tolist() for r in "ab"}
    auxs = {r: torch.randn(total, 96, generator=g) for r in "ab"}
    embed = target.embed_tokens.weight
    p0 = {"a": 10, "b": 23}
    start = {"a": 0, "b": 0}
    checked = 0
    with torch.no_grad():
        for step in range(25):
            reqs = []
            for r in "ab":
                want = 0 if (r == "b" and step % 5 == 3) else N
                reqs.append(ProposalRequest(r, seqs[r][: p0[r] + 1], start[r], auxs[r][start[r] : p0[r]], want))
            outs = prop.propose(reqs)
            for r, req, out in zip("ab", reqs, outs):
                if req.num_tokens:
                    y = None
                    ctx = draft.context_kv(auxs[r][: p0[r]], torch.arange(p0[r]))
                    pos = torch.arange(p0[r], p0[r] + N)
                    tokens = torch.tensor([seqs[r][p0[r]]] + [cfg.mask_token_id] * (N - 1))

                    def attend(i, q, k, v, ctx=ctx, pos=pos, n=p0[r]):
                        ck, cv = ctx[i]
                        m = position_mask(pos, torch.arange(n + N), draft.layers[i].window)
                        return attention_scores(q, torch.cat((ck, k)), torch.cat((cv, v)), m, draft.attention_scale())

                    y = draft.block_hidden(tokens, pos, embed, attend)
                    want_toks, _, _ = draft.choose(y[None], torch.tensor([seqs[r][p0[r]]]))
                    assert out.token_ids == want_toks[0].tolist(), (step, r)
                    checked += 1
                k = int(torch.randint(0, N + 1, (), generator=g))
                start[r], p0[r] = p0[r], p0[r] + k + 1  # next call: rows [old p0, new p0) are valid
    assert checked > 40


def test_bundled_draft_loads_and_is_lossless():
    """The shipped draft (models/musespark-tiny-dspark) with the bundled target: a short greedy
    speculative run equals plain greedy decoding and accepts drafts."""
    from pathlib import Path

    import musespark

    models = Path(musespark.__file__).parent / "models"
    target = musespark.load_model(models / "musespark-tiny", dtype="float32", backend="torch")
    prop = DSparkProposer.load(str(models / "musespark-tiny-dspark"), target, 7)
    assert prop.aux_layers == (1, 3, 5) and prop.draft.dtype == torch.float32
    prompt = [0, 1649, 2117, 12, 2061, 17, 261, 2069, 275, 2057, 12, 2061, 17, 158]
    got, accepted = speculative_greedy(target, prop, prompt, 24, 7)
    assert got == target.greedy_continuation(prompt, 24)
    assert sum(accepted) > 0


def test_layers_interleaved_rotation_rotates_adjacent_pairs():
    """layers.rotary.apply_rotary_interleaved (the draft's RoPE): pair (x_2m, x_2m+1) turned by
    frequency m's angle; equal to rotate-half on the same values with the halves de-interleaved."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2, 8, generator=g)
    pos = torch.tensor([0, 1, 7, 30, 511])
    cos, sin = cos_sin(pos, inv_frequencies(10000.0, 8))
    got = apply_rotary_interleaved(x, cos, sin)
    ang = pos[:, None].float() * inv_frequencies(10000.0, 8)[None, :]  # [5, 4]
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    assert torch.allclose(got[..., 0::2], a * c - b * s, atol=1e-6)
    assert torch.allclose(got[..., 1::2], b * c + a * s, atol=1e-6)
    want = apply_rotary(torch.cat((a, b), -1), cos, sin)  # the same pairs in rotate-half order
    assert torch.allclose(torch.cat((got[..., 0::2], got[..., 1::2]), -1), want, atol=1e-6)
    assert torch.equal(got[0], x[0])  # position 0: no rotation


def test_weightless_rms_norm_option():
    """layers.norm.RMSNorm(affine=False): no weight, no gain; input_scaled needs a weight."""
    n = RMSNorm(8, 1e-5, gain_center=0.0, affine=False)
    x = torch.randn(3, 8)
    assert n.weight is None and n.gain() is None and "weight" not in n.state_dict()
    assert torch.allclose(n(x, torch.float32), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5), atol=1e-6)
    with pytest.raises(ValueError, match="input_scaled"):
        RMSNorm(8, 1e-5, input_scaled=True, affine=False)
