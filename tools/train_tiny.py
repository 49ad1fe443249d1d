"""Train the bundled tiny Muse Spark model on the Python standard library and export it.

    .venv/bin/python tools/train_tiny.py --steps 1000 --seq-len 256 --batch 4   # train (resumable)
    .venv/bin/python tools/train_tiny.py --steps 1000 --resume                  # continue a run
    .venv/bin/python tools/train_tiny.py --export-only                          # re-export / re-evaluate

Uses musespark's own model code with autograd (nothing from transformers). fp32
training, AdamW with linear warmup + cosine decay, seeded and deterministic data order
(batch `step` is drawn from a generator seeded with (seed, step), so a resumed run sees
the same batches). Router balance is auxiliary-loss-free: forward hooks on every
`layers[i].mlp.gate` capture the routed expert ids, and after each optimizer step
`e_score_correction_bias += rate * sign(mean_load - load_e)`.

Run state (model + optimizer + step + history) is a torch.save file in the run dir
(default runs/tiny/state.pt); the shipped artifact (src/musespark/models/musespark-tiny) is
safetensors + JSON only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_corpus as tc  # noqa: E402

from musespark.config import ModelConfig  # noqa: E402
from musespark.layers.attention import AttentionContext  # noqa: E402
from musespark.model.muse_spark import MuseSparkForCausalLM  # noqa: E402

LN2 = math.log(2.0)


def model_config(vocab_size: int, bos: int, eos: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        mlp_layer_types=("dense", "sparse", "sparse", "sparse", "sparse", "sparse"),
        moe_hidden_size=128,
        moe_intermediate_size=256,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=128,
        rope_theta=10000.0,  # default layer_types / layer_rope_theta (NoPE on full layers)
        bos_token_id=bos,
        eos_token_id=(eos,),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def param_counts(cfg: ModelConfig, model: torch.nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    E, k = cfg.num_local_experts, cfg.num_experts_per_tok
    per_expert = 3 * cfg.moe_hidden_size * cfg.moe_intermediate_size
    inactive = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_sparse(i)) * (E - k) * per_expert
    return total, total - inactive


@torch.no_grad()
def init_weights(model: MuseSparkForCausalLM, seed: int) -> None:
    """Training init: matrices N(0, 1/fan_in) (output projections scaled down by depth),
    zero-centred norm weights 0, final norm 1, residual gates 0, router bias 0."""
    gen = torch.Generator().manual_seed(seed)
    n_layers = model.config.num_hidden_layers
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t is None or name.endswith(("inv_freq", "alpha", "beta")):
            continue
        if name == "norm.weight":
            t.fill_(1.0)
        elif t.ndim == 1:
            t.zero_()
        elif name == "embed_tokens.weight":
            t.copy_(torch.randn(t.shape, generator=gen))
        else:
            std = 1.0 / t.shape[-1] ** 0.5
            if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj", "post_expert_proj.weight")):
                std /= (2 * n_layers) ** 0.5
            if name.endswith("mlp.gate.weight"):
                std *= 0.5
            t.copy_(torch.randn(t.shape, generator=gen) * std)


class LoadRecorder:
    """Forward hooks on each sparse layer's router: records routed expert ids."""

    def __init__(self, model: MuseSparkForCausalLM) -> None:
        self.E = model.config.num_local_experts
        self.layers = [i for i in range(model.config.num_hidden_layers) if model.config.is_sparse(i)]
        self.counts = {i: torch.zeros(self.E, dtype=torch.long) for i in self.layers}
        self.handles = [model.layers[i].mlp.gate.register_forward_hook(self._hook(i)) for i in self.layers]

    def _hook(self, i: int):
        def hook(module, inputs, output):
            ids = output[1].detach().reshape(-1).cpu()
            self.counts[i] += torch.bincount(ids, minlength=self.E)

        return hook

    def reset(self) -> None:
        for c in self.counts.values():
            c.zero_()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def update_router_bias(model: MuseSparkForCausalLM, rec: LoadRecorder, rate: float) -> None:
    for i in rec.layers:
        load = rec.counts[i].float()
        if load.sum() == 0:
            continue
        bias = model.layers[i].mlp.gate.e_score_correction_bias
        bias += rate * torch.sign(load.mean() - load).to(bias.device)


def prepare_data(run: Path, vocab_size: int) -> dict:
    """Corpus split, tokenizer and token streams (cached in the run dir)."""
    run.mkdir(parents=True, exist_ok=True)
    meta_path = run / "data.json"
    if meta_path.exists() and (run / "tokenizer.json").exists():
        return json.loads(meta_path.read_text())
    t0 = time.time()
    corpus = tc.load_corpus()
    tok = tc.train_tokenizer([t for _, t in corpus.train], vocab_size)
    tok.save(str(run / "tokenizer.json"))
    train_ids = np.array(tc.encode_docs(tok, [t for _, t in corpus.train]), dtype=np.uint16)
    val_ids = np.array(tc.encode_docs(tok, [t for _, t in corpus.val]), dtype=np.uint16)
    np.save(run / "train_ids.npy", train_ids)
    np.save(run / "val_ids.npy", val_ids)
    meta = corpus.stats()
    meta.update(
        train_tokens=int(train_ids.size),
        val_tokens=int(val_ids.size),
        vocab_size=tok.get_vocab_size(),
        val_file_list=[r for r, _ in corpus.val],
        bos_token_id=tok.token_to_id(tc.BOS),
        eos_token_id=tok.token_to_id(tc.EOS),
        prepare_seconds=round(time.time() - t0, 1),
    )
    meta_path.write_text(json.dumps(meta, indent=2))
    return meta


def get_batch(stream: torch.Tensor, step: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()]).long()


def forward_loss(model, x: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    B, L1 = x.shape
    L = L1 - 1
    inp, tgt = x[:, :-1].reshape(-1), x[:, 1:].reshape(-1)
    positions = torch.arange(L).repeat(B)
    hidden = model(inp, positions, AttentionContext.for_prompts([L] * B))
    return F.cross_entropy(model.compute_logits(hidden), tgt, reduction=reduction)


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping [n, seq_len+1] windows (consecutive windows share one token)."""
    n = (stream.numel() - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    return torch.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]).long()


@torch.no_grad()
def bits_per_byte(model, windows: torch.Tensor, byte_len: torch.Tensor, batch: int = 16) -> tuple[float, float]:
    """(bits per byte, nats per token) over every predicted token of the windows.
    bits/byte = total nats / ln 2 / total UTF-8 bytes of the predicted tokens
    (special tokens are scored but stand for 0 bytes)."""
    was_training = model.training
    model.eval()
    model.materialize_constants()  # eval mode reads cached residual-gate coefficients: the weights' own now
    nats, nbytes, ntok = 0.0, 0, 0
    for i in range(0, windows.shape[0], batch):
        x = windows[i : i + batch]
        nats += float(forward_loss(model, x, reduction="sum"))
        nbytes += int(byte_len[x[:, 1:]].sum())
        ntok += x[:, 1:].numel()
    model.train(was_training)
    return nats / LN2 / nbytes, nats / ntok


def unigram_bits_per_byte(
    train_stream: torch.Tensor, windows: torch.Tensor, byte_len: torch.Tensor, vocab: int
) -> tuple[float, float]:
    """Unigram baseline: the training split's token distribution (add-one smoothed)
    scored on the same predicted tokens as `bits_per_byte`."""
    counts = torch.bincount(train_stream.long(), minlength=vocab).double() + 1.0
    logp = torch.log(counts / counts.sum())
    tgt = windows[:, 1:].reshape(-1)
    nats = float(-logp[tgt].sum())
    return nats / LN2 / int(byte_len[tgt].sum()), nats / tgt.numel()


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def save_state(path: Path, model, opt, step: int, history: list, args, sessions: list) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "step": step,
            "history": history,
            "args": vars(args),
            "sessions": sessions,
        },
        tmp,
    )
    tmp.replace(path)


def train(args) -> None:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    run = Path(args.run_dir)
    meta = prepare_data(run, args.vocab_size)
    cfg = model_config(meta["vocab_size"], meta["bos_token_id"], meta["eos_token_id"])
    model = MuseSparkForCausalLM(cfg)
    init_weights(model, args.seed)
    total, active = param_counts(cfg, model)
    print(f"params: total {total:,}  active/token {active:,}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    state_path = run / "state.pt"
    step, history, sessions = 0, [], []
    if args.resume and state_path.exists():
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        step, history = st["step"], st["history"]
        sessions = st.get("sessions") or [{"start_step": 0, "args": st["args"]}]
        print(f"resumed from step {step}", flush=True)
    train_stream = torch.from_numpy(np.load(run / "train_ids.npy").astype(np.int64))
    val_stream = torch.from_numpy(np.load(run / "val_ids.npy").astype(np.int64))
    tok = __import__("tokenizers").Tokenizer.from_file(str(run / "tokenizer.json"))
    byte_len = torch.tensor(tc.token_byte_lengths(tok))
    val_win = eval_windows(val_stream, args.seq_len, args.val_windows)

    sessions = sessions + [{"start_step": step, "args": vars(args)}]
    elapsed_before = history[-1]["elapsed"] if history else 0.0
    model.train()
    rec = LoadRecorder(model)
    from tqdm import tqdm

    bar = tqdm(total=args.steps, initial=step, dynamic_ncols=True, mininterval=2.0)
    tokens_per_step = args.batch * args.seq_len
    t_start = time.time()
    t_last, steps_since = time.time(), 0
    ema = None
    while step < args.steps:
        if args.time_limit and time.time() - t_start > 60 * args.time_limit:
            tqdm.write(f"time limit of {args.time_limit} min reached at step {step}; saving and stopping")
            save_state(state_path, model, opt, step, history, args, sessions)
            break
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        x = get_batch(train_stream, step, args.batch, args.seq_len, args.seed)
        rec.reset()
        loss = forward_loss(model, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip))
        opt.step()
        update_router_bias(model, rec, args.bias_rate)
        step += 1
        steps_since += 1
        lv = float(loss)
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        now = time.time()
        tps = steps_since * tokens_per_step / max(1e-9, now - t_last)
        bar.update(1)
        bar.set_postfix(loss=f"{lv:.3f}", ema=f"{ema:.3f}", tok_s=f"{tps:.0f}", lr=f"{lr:.2e}")
        rec_entry = {
            "step": step,
            "loss": lv,
            "lr": lr,
            "gnorm": gnorm,
            "tok_s": tps,
            "elapsed": elapsed_before + now - t_start,
        }
        if step % args.eval_every == 0 or step == args.steps:
            bpb, npt = bits_per_byte(model, val_win, byte_len)
            loads = {i: (rec.counts[i].float() / rec.counts[i].sum()).min().item() for i in rec.layers}
            rec_entry.update(val_bpb=bpb, val_nats_per_token=npt, min_batch_load=min(loads.values()))
            tqdm.write(
                f"step {step}: train loss {lv:.3f} (ema {ema:.3f}) val {bpb:.4f} bits/byte "
                f"({npt:.3f} nats/tok), min expert load in batch {min(loads.values()):.3f}, "
                f"{tps:.0f} tok/s"
            )
            t_last, steps_since = time.time(), 0
        history.append(rec_entry)
        if step % args.save_every == 0 or step == args.steps:
            save_state(state_path, model, opt, step, history, args, sessions)
    bar.close()
    rec.remove()
    print(f"training done: {step} steps, this session {time.time() - t_start:.0f} s", flush=True)


@torch.no_grad()
def calibrate_bias(model, run: Path, args) -> dict:
    """Optional post-training settle of the router biases: the same sign update as in
    training, on forward-only training-split batches (no weights change)."""
    stream = torch.from_numpy(np.load(run / "train_ids.npy").astype(np.int64))
    model.eval()
    rec = LoadRecorder(model)
    before = None
    for j in range(args.calibrate_bias_steps):
        x = get_batch(stream, 10_000_000 + j, args.batch, args.seq_len, args.seed)
        rec.reset()
        forward_loss(model, x)
        mins = min(float((c.float() / c.sum()).min()) for c in rec.counts.values())
        before = mins if before is None else before
        update_router_bias(model, rec, args.calibrate_bias_rate)
    rec.remove()
    info = {
        "steps": args.calibrate_bias_steps,
        "rate": args.calibrate_bias_rate,
        "batch_min_load_first": before,
        "batch_min_load_last": mins,
    }
    print(f"router bias calibration: {info}", flush=True)
    return info


def export(args) -> None:
    """Write src/musespark/models/musespark-tiny from the run's final state, then evaluate the SHIPPED
    bf16 weights (reloaded with musespark.load_model) and write the model card."""
    from tokenizers import Tokenizer

    from musespark import load_model
    from musespark.checkpoint.writer import save_checkpoint

    torch.set_num_threads(args.threads)
    run, out = Path(args.run_dir), Path(args.out)
    meta = json.loads((run / "data.json").read_text())
    st = torch.load(run / "state.pt", map_location="cpu", weights_only=False)
    cfg = model_config(meta["vocab_size"], meta["bos_token_id"], meta["eos_token_id"])
    model = MuseSparkForCausalLM(cfg)
    model.load_state_dict(st["model"])
    total, active = param_counts(cfg, model)
    calibration = None
    if args.calibrate_bias_steps > 0:
        calibration = calibrate_bias(model, run, args)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model.state_dict(), cfg, out, dtype=torch.bfloat16, nested=True)
    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tc.tokenizer_config(cfg.max_position_embeddings), indent=2))
    gen_cfg = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id[0],
        "pad_token_id": cfg.eos_token_id[0],
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.95,
        "max_new_tokens": 256,
    }
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))

    if args.files_only:
        print(f"wrote {out} (files only, no evaluation / model card)")
        return
    shipped = load_model(out, dtype="float32")
    byte_len = torch.tensor(tc.token_byte_lengths(tok))
    train_stream = torch.from_numpy(np.load(run / "train_ids.npy").astype(np.int64))
    val_stream = torch.from_numpy(np.load(run / "val_ids.npy").astype(np.int64))
    val_win = eval_windows(val_stream, args.seq_len)
    rec = LoadRecorder(shipped)
    t0 = time.time()
    val_bpb, val_npt = bits_per_byte(shipped, val_win, byte_len)
    loads = {i: (rec.counts[i].float() / rec.counts[i].sum()).tolist() for i in rec.layers}
    rec.remove()
    eval_s = time.time() - t0
    # Train bits/byte on as many training tokens as the validation split has (evenly spaced windows).
    all_train = eval_windows(train_stream, args.seq_len)
    idx = torch.linspace(0, all_train.shape[0] - 1, val_win.shape[0]).long()
    train_bpb, train_npt = bits_per_byte(shipped, all_train[idx], byte_len)
    uni_bpb, uni_npt = unigram_bits_per_byte(train_stream, val_win, byte_len, cfg.vocab_size)
    samples = []
    for prompt in ["def fibonacci(n):", "import os\n", "class Stack:"]:
        ids = tok.encode(prompt, add_special_tokens=False).ids
        cont = shipped.greedy_continuation([cfg.bos_token_id] + ids, args.sample_tokens)
        samples.append((prompt, tok.decode(cont, skip_special_tokens=False)))
    hist = st["history"]
    last = hist[-50:]
    train_loss_nats = sum(h["loss"] for h in last) / len(last)
    wall = hist[-1]["elapsed"] if hist else 0.0
    tps = [h["tok_s"] for h in hist if "val_bpb" in h]
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    results = {
        "params_total": total,
        "params_active_per_token": active,
        "val_bits_per_byte": val_bpb,
        "val_nats_per_token": val_npt,
        "train_bits_per_byte": train_bpb,
        "train_nats_per_token": train_npt,
        "unigram_val_bits_per_byte": uni_bpb,
        "unigram_val_nats_per_token": uni_npt,
        "expert_load": {str(k): v for k, v in loads.items()},
        "min_expert_load": min(min(v) for v in loads.values()),
        "steps": st["step"],
        "train_args": st["args"],
        "val_tokens_scored": int(val_win[:, 1:].numel()),
        "val_bytes_scored": int(byte_len[val_win[:, 1:]].sum()),
        "train_loss_last50_nats_per_token": train_loss_nats,
    }
    (run / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "train_args"}, indent=2))
    print(f"eval of val split took {eval_s:.0f} s")
    a = st["args"]
    sessions = st.get("sessions") or [{"start_step": 0, "args": a}]

    def command(sa: dict, resume: bool) -> str:
        return (
            f".venv/bin/python tools/train_tiny.py --steps {sa['steps']} --seq-len {sa['seq_len']} "
            f"--batch {sa['batch']} --lr {sa['lr']} --bias-rate {sa['bias_rate']} --seed {sa['seed']}"
            + (f" --time-limit {sa['time_limit']:g}" if sa.get("time_limit") else "")
            + (" --resume" if resume else "")
            + " --no-export"
        )

    session_ends = [x["start_step"] for x in sessions[1:]] + [st["step"]]
    cmd = "\n".join(
        f"# steps {x['start_step']}-{end}\n" + command(x["args"], x["start_step"] > 0)
        for x, end in zip(sessions, session_ends)
    )
    calib_flag = (
        f" --calibrate-bias-steps {calibration['steps']} --calibrate-bias-rate {calibration['rate']:g}"
        if calibration
        else ""
    )
    cmd += f"\n.venv/bin/python tools/train_tiny.py --export-only{calib_flag}   # writes src/musespark/models/musespark-tiny + this card"
    bias_rates = ", ".join(f"{x['args']['bias_rate']:g} (from step {x['start_step']})" for x in sessions)
    load_rows = "\n".join(
        f"| {i} | " + " | ".join(f"{100 * x:.1f}" for x in v) + f" | {100 * min(v):.1f} |" for i, v in loads.items()
    )
    E = cfg.num_local_experts
    sample_md = "\n\n".join(f"Prompt `{json.dumps(p)}` →\n\n```python\n{p}{c}\n```" for p, c in samples)
    calib_md = ""
    if calibration:
        calib_md = (
            f"After training, the router biases were settled by {calibration['steps']} forward-only "
            f"steps of the same sign update (rate {calibration['rate']:g}) on training-split batches "
            f"(`--calibrate-bias-steps`); min expert share in a batch went from "
            f"{100 * calibration['batch_min_load_first']:.1f}% to {100 * calibration['batch_min_load_last']:.1f}%. "
            "No weights changed.\n\n"
        )
        results["bias_calibration"] = calibration
        (run / "results.json").write_text(json.dumps(results, indent=2))
    readme = (
        f"""# musespark-tiny

A tiny Muse Spark 1x text decoder trained from scratch on the Python standard library,
bundled with `musespark` as its default/demo model. It exercises every feature of the
architecture (dense + sparse MoE layers, GQA, QK-norm, output gate, sliding + full
attention, RoPE + NoPE layers, residual gates, soft-capped logits, router bias).
It writes Python-looking text; it is not a useful code model.

Files: `config.json` (nested released form), `model.safetensors` (bfloat16; residual
gates, router weights and router bias in float32), `tokenizer.json`, `tokenizer_config.json`,
`generation_config.json`. Total size {size / 2**20:.1f} MiB (without this card).
Loads with `musespark.load_model("src/musespark/models/musespark-tiny")` and with
`transformers==5.23.0` `MuseSparkForConditionalGeneration.from_pretrained`.

## Model

| | |
|---|---|
| vocab | {cfg.vocab_size} (byte-level BPE) |
| hidden / layers | {cfg.hidden_size} / {cfg.num_hidden_layers} |
| attention | {cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} KV heads, head_dim {cfg.head_dim} |
| layer_types | {", ".join(cfg.layer_types)} (sliding_window {cfg.sliding_window}) |
| layer_rope_theta | {", ".join(str(t) for t in cfg.layer_rope_theta)} (0 = NoPE) |
| mlp_layer_types | {", ".join(cfg.mlp_layer_types)} |
| dense SwiGLU | intermediate {cfg.intermediate_size} |
| MoE | {E} experts, top-{cfg.num_experts_per_tok}, moe_hidden {cfg.moe_hidden_size}, moe_intermediate {cfg.moe_intermediate_size} |
| max_position_embeddings | {cfg.max_position_embeddings} (trained on {a["seq_len"]}-token windows) |
| bos / eos | {cfg.bos_token_id} `{tc.BOS}` / {cfg.eos_token_id[0]} `{tc.EOS}` |
| parameters | {total:,} total, {active:,} active per token |

## Corpus

The `*.py` files of the CPython {meta["python_version"]} standard library
(the directory `sysconfig.get_paths()["stdlib"]` names), excluding `site-packages` and test directories
({", ".join(sorted(tc.TEST_DIRS))}); {meta["skipped_non_utf8"]} non-UTF-8 files skipped.
A deterministic ~{tc.VALIDATION_PERCENT}% of files is held out for validation
(sha256 of the path relative to the stdlib root, mod 100 < {tc.VALIDATION_PERCENT}).

| split | files | bytes | tokens |
|---|---|---|---|
| train | {meta["train_files"]} | {meta["train_bytes"]:,} | {meta["train_tokens"]:,} |
| validation | {meta["val_files"]} | {meta["val_bytes"]:,} | {meta["val_tokens"]:,} |

Each file is one document: `<|begin_of_text|>` + tokens + `<|end_of_text|>`, concatenated.

## Tokenizer

Byte-level BPE trained with `tokenizers` on the training split only, vocab {cfg.vocab_size},
ByteLevel pre-tokenizer (add_prefix_space=False) and ByteLevel decoder: decoding
round-trips text exactly. Special tokens: {", ".join(f"`{s}`" for s in tc.SPECIAL_TOKENS)}
(ids 0–{len(tc.SPECIAL_TOKENS) - 1}). `tokenizer_config.json` has a minimal Jinja chat template
using the header tokens. No BOS is added automatically; prepend `{tc.BOS}` yourself.

## Training

```
{cmd}
```

`tools/train_tiny.py` uses musespark's own model code with autograd (no transformers):
fp32, AdamW (β 0.9/0.95, weight decay {a["weight_decay"]} on matrices), peak lr {a["lr"]},
{a["warmup"]} warmup steps then cosine to 10%, grad clip {a["clip"]},
batch {a["batch"]} × {a["seq_len"]} tokens, {st["step"]} steps
({st["step"] * a["batch"] * a["seq_len"]:,} tokens, {st["step"] * a["batch"] * a["seq_len"] / meta["train_tokens"]:.2f} epochs),
seed {a["seed"]}, deterministic data order, resumable (`--resume`).
Routers are balanced without an auxiliary loss: after each step every sparse layer's
`e_score_correction_bias` moves by rate × sign(mean load − expert load), rate {bias_rates}
(the first session's 1e-3 let the bias lag the router's learning — min expert load 0.2% of a batch
at step 100 — so the run was resumed with a larger rate).

{calib_md}Wall time: {wall / 60:.1f} min on 2 shared CPU cores (~{sum(tps) / max(1, len(tps)):.0f} tokens/s in training).

## Results

Measured on the shipped bfloat16 weights (loaded in float32). Bits per byte = total
nats / ln 2 / total UTF-8 bytes of the scored tokens, scored in non-overlapping
{a["seq_len"]}-token windows ({results["val_tokens_scored"]:,} validation tokens,
{results["val_bytes_scored"]:,} bytes).

| | bits/byte | nats/token |
|---|---|---|
| validation (held-out files) | **{val_bpb:.3f}** | {val_npt:.3f} |
| train (same number of tokens, evenly spaced) | {train_bpb:.3f} | {train_npt:.3f} |
| unigram baseline on validation (train-split token frequencies) | {uni_bpb:.3f} | {uni_npt:.3f} |

Final training loss (mean of the last 50 steps): {train_loss_nats:.3f} nats/token.

### Expert load on the validation split (% of routed tokens)

| layer | """
        + " | ".join(f"e{e}" for e in range(E))
        + """ | min |
|---|"""
        + "---|" * (E + 1)
        + f"""
{load_rows}

Minimum over all sparse layers: {100 * results["min_expert_load"]:.1f}% (uniform would be {100 / E:.1f}%).

### Greedy samples

Greedy ({args.sample_tokens} new tokens, full recompute with `model.greedy_continuation`,
`{tc.BOS}` prepended):

{sample_md}

## Generation defaults

`generation_config.json`: sampling with temperature 0.7, top_p 0.95, max_new_tokens 256,
eos {cfg.eos_token_id[0]}.
"""
    )
    (out / "README.md").write_text(readme)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"artifact: {out} ({size / 2**20:.2f} MiB with the card)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument(
        "--threads", type=int, default=1, help="1 is fastest on a small shared CPU (2 threads spin against other load)"
    )
    p.add_argument("--time-limit", type=float, default=0.0, help="minutes; stop early (and save) past it")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--val-windows", type=int, default=32, help="windows for periodic validation")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--sample-tokens", type=int, default=48)
    p.add_argument("--run-dir", default=str(ROOT / "runs" / "tiny"))
    p.add_argument("--out", default=str(ROOT / "src" / "musespark" / "models" / "musespark-tiny"))
    p.add_argument("--resume", action="store_true")
    p.add_argument("--no-export", action="store_true")
    p.add_argument("--export-only", action="store_true")
    p.add_argument(
        "--calibrate-bias-steps",
        type=int,
        default=0,
        help="export: forward-only router-bias balancing steps on training batches",
    )
    p.add_argument("--calibrate-bias-rate", type=float, default=2e-3)
    p.add_argument("--files-only", action="store_true", help="export: write the files, skip evaluation and card")
    args = p.parse_args()
    if not args.export_only:
        train(args)
    if not args.no_export:
        export(args)


if __name__ == "__main__":
    main()
