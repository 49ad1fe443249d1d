"""The cpu backend's decode plan (backends/cpu_decode.py, kernels/csrc/blocks/decode_plan.cpp): a pure
decode step of the whole model in one native call must give the step-by-step path's bits, and
must follow the model and the step it was built for."""

import copy
from dataclasses import replace

import pytest
import torch

from musespark.kernels import cpu
from musespark.layers.attention import AttentionContext, KVGroup

needs_ops = pytest.mark.skipif(
    cpu.native_ops() is None,
    reason="the decode plan needs the native kernels (test_cpu_kernels checks they build on x86-64 Linux with AVX2)",
)

BLOCK = 4


def _model(dtype: torch.dtype, seed: int = 0):
    """Random weights (every norm and gate too); layers of every kind the plan indexes: sliding
    and full attention (two KV groups), two rotary bases and NoPE, dense and sparse."""
    from musespark.backends import select_backend
    from musespark.config import ModelConfig
    from musespark.model import MuseSparkForCausalLM, init_random_weights

    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_hidden_size=24,
        moe_intermediate_size=40,
        num_local_experts=6,
        num_experts_per_tok=3,
        sliding_window=5,
        layer_types=("sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"),
        layer_rope_theta=(10000.0, 0.0, 500000.0, 10000.0, 0.0),
        mlp_layer_types=("dense", "sparse", "sparse", "dense", "sparse"),
    )
    model = MuseSparkForCausalLM(cfg)
    init_random_weights(model, seed=seed)
    model = model.to(dtype).eval()
    model.backend = select_backend("cpu", model)
    return model


class Decoder:
    """Sequences decoded together the way the engine's runner steps them: each prompt alone,
    then one row per sequence per step, in a paged cache whose sliding and full layers keep
    separate block tables (two KV groups)."""

    def __init__(self, model, prompts: list[list[int]], steps: int) -> None:
        cfg = model.config
        self.model, self.ids = model, [list(p) for p in prompts]
        per_seq = (max(map(len, prompts)) + steps) // BLOCK + 2
        blocks = len(prompts) * per_seq
        shape = (blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
        self.kv = [
            (torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
            for _ in range(cfg.num_hidden_layers)
        ]
        g = torch.Generator().manual_seed(7)
        self.tables = [torch.randperm(blocks, generator=g).view(len(prompts), per_seq) for _ in range(2)]
        self.layer_group = [0 if layer.self_attn.window else 1 for layer in model.layers]
        self.done = [0] * len(prompts)

    def fork(self) -> "Decoder":
        """A copy at the same point: the same tokens, and caches with the same contents."""
        twin = copy.copy(self)
        twin.ids, twin.done = [list(i) for i in self.ids], list(self.done)
        twin.kv = [(k.clone(), v.clone()) for k, v in self.kv]
        return twin

    def forward(self, seqs: list[int], prompt_rows: list[bool] | None = None, aux_layers: tuple[int, ...] = ()):
        """The model over every uncomputed token of `seqs`; a sequence with several (drafts to
        verify, appended to its ids) attends row by row, as the runner's verification rows do."""
        rows = [list(range(self.done[b], len(self.ids[b]))) for b in seqs]
        qsl = [0]
        for r in rows:
            qsl.append(qsl[-1] + len(r))
        pos = torch.tensor([p for r in rows for p in r])
        groups = []
        for table in self.tables:
            t = table[seqs]
            slots = torch.tensor([int(t[i, p // BLOCK]) * BLOCK + p % BLOCK for i, r in enumerate(rows) for p in r])
            groups.append(KVGroup(slot_mapping=slots, block_tables=t.contiguous()))
        ctx = AttentionContext(
            query_start_loc=qsl,
            seq_lens=[len(self.ids[b]) for b in seqs],
            kv_caches=self.kv,
            groups=groups,
            layer_group=self.layer_group,
            row_wise=[i for i, r in enumerate(rows) if len(r) > 1 and self.done[seqs[i]] > 0],
            prompt_rows=None if prompt_rows is None else torch.tensor(prompt_rows),
        )
        ids = torch.tensor([self.ids[b][p] for b, r in zip(seqs, rows) for p in r])
        with torch.inference_mode():
            out = self.model(ids, pos, ctx, aux_layers)
        for b in seqs:
            self.done[b] = len(self.ids[b])
        return out, qsl

    def step(self, seqs: list[int], prompt_rows: list[bool] | None = None) -> torch.Tensor:
        """The next row of each of `seqs` (all its uncomputed tokens) -> logits of each one's last row."""
        hidden, qsl = self.forward(seqs, prompt_rows)
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden[[q - 1 for q in qsl[1:]]])
        for b, row in zip(seqs, logits):
            self.ids[b].append(int(row.argmax()))
        return logits


def _run(model, plan: bool) -> tuple[list[torch.Tensor], int]:
    """Three sequences: two prompts, then decode steps of both, then a one-token prompt joins
    (a decode-shaped step with a prompt row), then all three. -> every step's logits, builds."""
    backend = model.backend
    backend.plan = replace(backend.plan, whole_step=plan)
    builds = backend.decode_plan.builds
    d = Decoder(model, [list(range(3, 12)), list(range(20, 26)), [40]], steps=16)
    out = [d.step([0]), d.step([1])]
    out += [d.step([0, 1]) for _ in range(6)]  # past the sliding window
    out.append(d.step([0, 1, 2], prompt_rows=[False, False, True]))
    out += [d.step([0, 1, 2]) for _ in range(6)]
    return out, backend.decode_plan.builds - builds


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_plan_gives_the_layer_by_layer_bits(dtype, kernel_path):
    model = _model(dtype)
    plan, builds = _run(model, plan=True)
    layers, no_builds = _run(model, plan=False)
    assert builds == 1 and no_builds == 0  # built at the first decode step, then reused (same caches)
    assert len(plan) == len(layers)
    for i, (a, b) in enumerate(zip(plan, layers)):
        assert torch.equal(a, b), f"step {i}: largest difference {(a - b).abs().max()}"
    # The steps differ from each other (a plan stuck on stale inputs could not pass the above by luck).
    assert not torch.equal(plan[-1], plan[-2])


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_verification_rows_and_drafter_streams_take_the_plan(dtype, kernel_path):
    """Speculative verification: sequences feed their last token and k drafts as rows that attend
    row by row, beside a one-row sequence, and the drafter's streams are exported. The plan runs
    these steps (one native call each) with the layer-by-layer bits: final rows, streams, and
    the K/V a later step reads."""
    model = _model(dtype, seed=2)
    backend = model.backend
    d = Decoder(model, [list(range(3, 12)), list(range(20, 26)), [40, 41]], steps=16)
    for b in range(3):
        d.step([b])
    for _ in range(4):
        d.step([0, 1, 2])
    calls = []
    run = backend.decode_plan.run
    backend.decode_plan.run = lambda *a, **k: calls.append(1) or run(*a, **k)
    whole = backend.plan
    aux = (1, 3)
    for k in (1, 3, 6):  # up to 15 rows: fp32 steps of more rows keep MKL (kFp32FusedMaxRows)
        for b, first in ((0, 5), (2, 50)):  # drafts for sequences 0 and 2; 1 decodes one row
            d.ids[b] += list(range(first, first + k))
        twin = d.fork()
        before = len(calls)
        (y, streams), _ = d.forward([0, 1, 2], aux_layers=aux)
        assert len(calls) == before + 1  # one native call for the whole step
        backend.plan = replace(whole, whole_step=False)
        try:
            (want_y, want_streams), _ = twin.forward([0, 1, 2], aux_layers=aux)
        finally:
            backend.plan = whole
        assert y.shape[0] == 2 * k + 3 and streams.shape == (2 * k + 3, len(aux) * model.config.hidden_size)
        assert torch.equal(y, want_y), f"k={k}: largest difference {(y - want_y).abs().max()}"
        assert torch.equal(streams, want_streams)
        for x in (d, twin):  # every draft accepted, and one more token each
            for b in range(3):
                x.ids[b].append(60 + b)
        got = d.step([0, 1, 2])
        backend.plan = replace(whole, whole_step=False)
        try:
            want = twin.step([0, 1, 2])
        finally:
            backend.plan = whole
        assert torch.equal(got, want)  # the K/V of every row went to the cache alike


@needs_ops
def test_the_plan_gives_the_layer_by_layer_bits_on_nvfp4_weights(tmp_path, kernel_path):
    """Weight-only NVFP4 linears and experts (the bundled model quantized, every linear but the
    head) reach the fused blocks as [codes, scales, global scales]: the plan passes them on."""
    import musespark
    from musespark.cli import main as cli_main
    from musespark.engine.args import bundled_model_path

    dst = tmp_path / "nvfp4"
    assert (
        cli_main(
            [
                "quantize",
                "--format",
                "nvfp4",
                str(bundled_model_path()),
                str(dst),
                "--scope",
                "linear",
                "--calibration-prompts",
                "2",
            ]
        )
        == 0
    )
    model = musespark.load_model(dst, backend="cpu")
    assert model.backend.plan.fused_blocks and type(model.layers[1].mlp.experts.format).__name__ == "Nvfp4Experts"
    plan, builds = _run(model, plan=True)
    layers, _ = _run(model, plan=False)
    assert builds == 1
    for i, (a, b) in enumerate(zip(plan, layers)):
        assert torch.equal(a, b), f"step {i}: largest difference {(a - b).abs().max()}"


@needs_ops
def test_the_plan_is_built_once_and_follows_the_caches_and_a_new_backend(kernel_path):
    """Built at the first decode step and reused while the KV caches are the same tensors;
    rebuilt for new caches. A model's weights are frozen once its backend is chosen: after a
    weight is written in place, a module replaced (a layer's, the final norm), and the backend
    chosen again, the new plan's step equals the step-by-step one."""
    from musespark.backends import select_backend

    model = _model(torch.bfloat16, seed=1)
    backend = model.backend
    d = Decoder(model, [list(range(3, 10))], steps=8)
    d.step([0])
    d.step([0])
    plan = backend.decode_plan
    assert plan.builds == 1
    d.step([0])
    assert plan.builds == 1  # nothing changed
    d.kv = [(k, v) for k, v in d.kv]  # the same caches in new pairs
    d.step([0])
    assert plan.builds == 1

    def check_step() -> None:
        twin = d.fork()
        got = d.step([0])
        whole = model.backend.plan
        model.backend.plan = replace(whole, whole_step=False)
        try:
            want = twin.step([0])
        finally:
            model.backend.plan = whole
        assert torch.equal(got, want)

    d = d.fork()  # new caches, same contents
    check_step()
    assert plan.builds == 2
    check_step()
    assert plan.builds == 2

    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        w = model.layers[2].mlp.experts.down_proj
        w.copy_(torch.randn(w.shape, generator=g).to(w.dtype) * w.float().std())  # in place
        twin = copy.deepcopy(model.layers[3].post_feedforward_layernorm)
        twin.weight.add_(0.5)
        model.layers[3].post_feedforward_layernorm = twin  # a module replaced
        final = copy.deepcopy(model.norm)
        final.weight.mul_(-1.5)
        model.norm = final  # the final norm replaced (the plan holds its gain)
    model.materialize_constants()
    before = d.fork().step([0])
    model.backend = select_backend("cpu", model)
    check_step()
    assert model.backend.decode_plan.builds == 1
    assert not torch.equal(d.fork().step([0]), before)  # the new backend computes the changed model
