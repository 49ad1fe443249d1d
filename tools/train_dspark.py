"""Distil a DSpark draft (`docs/speculative.md`) from the bundled musespark-tiny and ship it beside it.

    nice -n 19 .venv/bin/python tools/train_dspark.py data             # target greedy continuations + aux
    nice -n 19 .venv/bin/python tools/train_dspark.py train [--resume]   # defaults = the shipped draft's
    nice -n 19 .venv/bin/python tools/train_dspark.py export           # bf16 checkpoint + evaluation + card
    nice -n 19 .venv/bin/python tools/train_dspark.py check            # the shipped draft vs a new target

Data: code prompts (BOS + 63 tokens at a seeded random offset of a stdlib file, tools/tiny_corpus.py;
train split for training, validation split for evaluation), continued greedily by the target
(musespark's engine, bf16, 192 tokens, EOS ignored). One bf16 target forward over each whole
sequence gives the fp32 stream after `target_layer_ids` (stored in bf16: the draft casts it to
D = bf16 before `fc` anyway).

Training (fp32, 1 thread, seeded, resumable): per sequence, A random anchor positions a in the
generated part; each block is [x_a, mask * (N-1)] at positions a..a+N-1, seeing the context K/V
of positions < a and its own block causally (one packed attention mask). Loss: cross-entropy of
the Markov-head logits (teacher-forced on the previous greedy token) against the target's
greedy tokens x_{a+1..a+N}, position k weighted by decay^k; plus BCE for the confidence head.
Greedy acceptance of a block = the length of the prefix whose argmax equals the labels, which
teacher forcing computes exactly (the Markov input equals the label while drafts are accepted).

Run state lives in runs/dspark/ (git-ignored); the shipped draft is safetensors + JSON.
`data --name NAME` adds a training file, `train --data train,NAME` trains on several.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_corpus as tc  # noqa: E402

from musespark.layers.attention import AttentionContext  # noqa: E402
from musespark.model.dspark import DSparkDraft  # noqa: E402
from musespark.model.dspark_config import DSparkConfig  # noqa: E402
from musespark.model.dspark_layers import attention_scores  # noqa: E402
from musespark.model.dspark_loader import load_draft, save_draft, target_forward_with_aux  # noqa: E402

TARGET = ROOT / "src" / "musespark" / "models" / "musespark-tiny"
OUT = ROOT / "src" / "musespark" / "models" / "musespark-tiny-dspark"
RUN = ROOT / "runs" / "dspark"
PROMPT, GEN, N = 64, 192, 7  # prompt tokens (BOS included), generated tokens, block size
LAYER_IDS = (1, 3, 5)
MASK_ID = 3  # <|end_header_id|>: never appears in code completion


def draft_config(d_vocab: int, layers: int, ffn_mult: float = 4.0) -> DSparkConfig:
    return DSparkConfig(
        target_layer_ids=LAYER_IDS,
        target_hidden_size=256,
        mask_token_id=MASK_ID,
        markov_rank=32,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        sample_from_anchor=True,
        block_size=N,
        vocab_size=4100,
        draft_vocab_size=d_vocab,
        hidden_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        ffn_dim_multiplier=ffn_mult,
        rms_norm_eps=1e-5,
        norm_affine=True,
        post_norm_affine=True,
        residual_dtype="fp32",
        use_rope=True,
        rope_theta=10000.0,
        output_soft_cap_temp=20.0,
        moe_is_enabled=False,
    )


# -- data ------------------------------------------------------------------------------------
def make_prompts(docs: list[tuple[str, str]], count: int, seed: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    rng = random.Random(seed)
    encoded = [e.ids for e in tok.encode_batch([t for _, t in docs], add_special_tokens=False)]
    encoded = [e for e in encoded if len(e) > PROMPT]
    out = []
    for _ in range(count):
        ids = encoded[rng.randrange(len(encoded))]
        off = rng.randrange(len(ids) - PROMPT)
        out.append([0] + ids[off : off + PROMPT - 1])
    return out


@torch.no_grad()
def collect(prompts: list[list[int]], batch: int = 16) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Greedy continuations by the engine, then aux rows by one target pass per sequence.
    -> tokens [n, S] int64, aux [n, S, 3*256] bf16, fraction of generated tokens that equal the
    argmax of this pass's logits (a check that the aux pass is the generating model)."""
    from musespark import LLM, SamplingParams, load_model

    llm = LLM(str(TARGET), max_num_seqs=64, seed=0)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
    )
    del llm
    tokens = torch.tensor([p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)])
    target = load_model(TARGET, dtype=torch.bfloat16)
    S = tokens.shape[1]
    aux = torch.empty(len(tokens), S, 256 * len(LAYER_IDS), dtype=torch.bfloat16)
    agree = total = 0
    for i in range(0, len(tokens), batch):
        chunk = tokens[i : i + batch]
        b = len(chunk)
        y, a = target_forward_with_aux(
            target, chunk.reshape(-1), torch.arange(S).repeat(b), AttentionContext.for_prompts([S] * b), LAYER_IDS
        )
        aux[i : i + b] = a.view(b, S, -1).to(torch.bfloat16)
        pred = target.compute_logits(y.view(b, S, -1)[:, PROMPT - 1 : -1].reshape(-1, y.shape[-1])).argmax(-1)
        agree += int((pred == chunk[:, PROMPT:].reshape(-1)).sum())
        total += pred.numel()
    return tokens, aux, agree / total


def cmd_data(args: argparse.Namespace) -> None:
    """val.pt + train.pt (prompt seeds seed + 1000 / seed); with --name, one more training file
    (prompts seeded by --data-seed)."""
    RUN.mkdir(parents=True, exist_ok=True)
    corpus = tc.load_corpus()
    t0 = time.time()
    jobs = [("val", corpus.val, args.val_seqs, args.seed + 1000), ("train", corpus.train, args.train_seqs, args.seed)]
    if args.name:
        jobs = [(args.name, corpus.train, args.train_seqs, args.data_seed)]
    # export reads the last line of data.log for the card's data time
    with (RUN / "data.log").open("a" if args.name else "w", encoding="utf-8") as log:
        for split, docs, count, seed in jobs:
            tokens, aux, agree = collect(make_prompts(docs, count, seed))
            torch.save({"tokens": tokens, "aux": aux}, RUN / f"{split}.pt")
            line = json.dumps(
                {
                    "split": split,
                    "seqs": len(tokens),
                    "aux_argmax_agreement": round(agree, 4),
                    "minutes": round((time.time() - t0) / 60, 2),  # since the first job began
                }
            )
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()


# -- model ------------------------------------------------------------------------------------
def draft_vocab(tokens: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `size` most frequent target ids of the training data (ascending) -> (d2t [size], t2d [4100], -1 = none)."""
    counts = torch.bincount(tokens.reshape(-1), minlength=4100)
    counts[MASK_ID] = -1
    ids = torch.sort(torch.topk(counts, size).indices).values
    t2d = torch.full((4100,), -1, dtype=torch.long)
    t2d[ids] = torch.arange(size)
    return ids - torch.arange(size), t2d


def init_draft(model: DSparkDraft, target_state: dict[str, torch.Tensor], d2t: torch.Tensor, seed: int) -> None:
    """Random matrices N(0, 1/fan_in), norms 1, Markov w2 0; lm_head and final norm from the
    target's head rows times its output multiplier (a warm start for the base logits)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            else:
                p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        model.markov_head.markov_w1.weight.normal_(0, 1, generator=g)
        model.markov_head.markov_w2.weight.zero_()
        ids = torch.arange(len(d2t)) + d2t
        model.lm_head.weight.copy_(target_state["lm_head.weight"].float()[ids] * 0.1767766952966369)
        model.norm.weight.copy_(target_state["model.language_model.norm.weight"].float())
        model.d2t.copy_(d2t)


def packed_logits(
    model: DSparkDraft, embed: torch.Tensor, tokens: torch.Tensor, aux: torch.Tensor, anchors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Blocks at anchors [B, A] over sequences tokens [B, S] with aux [B, S, F] -> Markov
    logits [B, A, N, V_d] (teacher-forced), labels [B, A, N] (target ids), confidence."""
    B, S = tokens.shape
    A = anchors.shape[1]
    offs = torch.arange(N)
    pos = (anchors[..., None] + offs).reshape(B, A * N)  # [B, Q]
    block = torch.full((B, A, N), MASK_ID, dtype=torch.long)
    block[..., 0] = tokens.gather(1, anchors)
    labels = tokens.gather(1, (anchors[..., None] + offs + 1).reshape(B, -1)).view(B, A, N)
    prev = torch.cat((block[..., :1], labels[..., :-1]), -1)  # Markov input: anchor, then labels
    ctx = model.context_kv(aux, torch.arange(S).expand(B, S))
    a_of = anchors.repeat_interleave(N, 1)  # [B, Q] block start of each query
    ctx_mask = torch.arange(S)[None, None, :] < a_of[..., None]  # [B, Q, S]
    same = torch.arange(A).repeat_interleave(N)
    blk_mask = (same[:, None] == same[None, :]) & (offs.repeat(A)[None, :] <= offs.repeat(A)[:, None])
    mask = torch.cat((ctx_mask, blk_mask.expand(B, -1, -1)), -1)  # [B, Q, S+Q]
    scale = model.attention_scale()

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ck, cv = ctx[layer]
        return attention_scores(q, torch.cat((ck, k), 1), torch.cat((cv, v), 1), mask, scale)

    y = model.block_hidden(block.view(B, -1), pos, embed, attend).view(B, A, N, -1)
    logits = model.markov_logits(model.lm_head(y), prev)
    return logits, labels, model.confidence(y, prev)


def acceptance(logits: torch.Tensor, labels: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Greedy accepted drafts per block [B, A] (first mismatch of argmax vs label)."""
    ok = (logits.argmax(-1) == t2d[labels]).long()
    return ok.cumprod(-1).sum(-1)


def chain(acc: torch.Tensor, start: int) -> list[int]:
    """Walk the speculative loop over per-anchor acceptances acc [positions] (anchor position
    start + j): each step accepts acc[j] drafts and advances acc[j] + 1 positions."""
    out, j = [], 0
    while j < len(acc):
        out.append(int(acc[j]))
        j += int(acc[j]) + 1
    return out


@torch.no_grad()
def evaluate(
    model: DSparkDraft,
    embed: torch.Tensor,
    tokens: torch.Tensor,
    aux: torch.Tensor,
    t2d: torch.Tensor,
    markov: bool = True,
) -> dict:
    """Simulated greedy speculative decoding on held-out sequences, from the first generated
    token (anchor position PROMPT) while a whole block of labels exists."""
    anchors = torch.arange(PROMPT, tokens.shape[1] - N)
    steps: list[int] = []
    saved = model.markov_head.markov_w2.weight.clone()
    if not markov:
        model.markov_head.markov_w2.weight.zero_()
    for i in range(0, len(tokens), 4):
        tk, ax = tokens[i : i + 4], aux[i : i + 4]
        logits, labels, _ = packed_logits(model, embed, tk, ax, anchors.expand(len(tk), -1).contiguous())
        for row in acceptance(logits, labels, t2d):
            steps += chain(row, PROMPT)
    model.markov_head.markov_w2.weight.copy_(saved)
    acc = torch.tensor(steps, dtype=torch.float)
    per_pos = [round(float((acc > k).float().mean()), 4) for k in range(N)]
    return {
        "steps": len(steps),
        "mean_accepted": round(float(acc.mean()), 4),
        "tokens_per_step": round(float(acc.mean()) + 1, 4),
        "accept_rate_by_position": per_pos,
    }


def load_split(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    d = torch.load(RUN / f"{name}.pt", weights_only=True)
    return d["tokens"], d["aux"]


def target_tensors() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(TARGET / "model.safetensors"))


def inverse_vocab(d2t: torch.Tensor) -> torch.Tensor:
    """t2d [4100]: draft id of each target id, -1 outside the draft vocabulary."""
    t2d = torch.full((4100,), -1, dtype=torch.long)
    t2d[torch.arange(len(d2t)) + d2t] = torch.arange(len(d2t))
    return t2d


def cmd_train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    parts = [load_split(name) for name in args.data.split(",")]
    tokens, aux = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    del parts
    vtok, vaux = load_split("val")
    tstate = target_tensors()
    embed = tstate["model.language_model.embed_tokens.weight"].float()
    d2t, _ = draft_vocab(tokens[:, PROMPT:], args.draft_vocab)
    cfg = draft_config(args.draft_vocab, args.layers, args.ffn_mult)
    model = DSparkDraft(cfg, target_num_layers=6)
    init_draft(model, tstate, d2t, args.seed)
    decay, no_wd = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim == 2 and "markov_w1" not in name else no_wd).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_wd, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95)
    )
    step, history, elapsed0 = 0, [], 0.0
    state_path = RUN / "state.pt"
    if args.resume and state_path.exists():
        st = torch.load(state_path, weights_only=True)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, history, elapsed0 = st["step"], json.loads(st["history"]), st["elapsed"]
    t2d = inverse_vocab(model.d2t)  # the checkpoint's vocabulary, whatever data is loaded now
    weights = args.decay ** torch.arange(N, dtype=torch.float)
    t0 = time.time()

    def save() -> None:
        torch.save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "history": json.dumps(history),
                "elapsed": elapsed0 + time.time() - t0,
                "args": json.dumps(vars(args)),
            },
            state_path,
        )

    model.train()
    while step < args.steps:
        if args.max_minutes and (elapsed0 + time.time() - t0) / 60 > args.max_minutes:
            print(json.dumps({"stopped": "max-minutes", "step": step}), flush=True)
            break
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        rows = torch.randint(len(tokens), (args.batch,), generator=g)
        anchors = (
            torch.stack([torch.randperm(tokens.shape[1] - N - PROMPT + 1, generator=g)[: args.anchors] for _ in rows])
            .sort(-1)
            .values
            + PROMPT
            - 1
        )
        lr = (
            args.lr
            * min(1.0, (step + 1) / args.warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps))))
        )
        for group in opt.param_groups:
            group["lr"] = lr
        logits, labels, conf = packed_logits(model, embed, tokens[rows], aux[rows].float(), anchors)
        target = t2d[labels]
        ce = F.cross_entropy(logits.flatten(0, -2), target.clamp(min=0).reshape(-1), reduction="none")
        valid = (target >= 0).float().reshape(-1)
        w = weights.expand_as(target).reshape(-1) * valid
        loss = (ce * w).sum() / w.sum()
        hit = (logits.argmax(-1) == target).float()
        bce = F.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), hit) if conf is not None else 0.0
        opt.zero_grad(set_to_none=True)
        (loss + 0.1 * bce).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == args.steps:
            bce_v = float(bce.detach()) if torch.is_tensor(bce) else bce
            rec = {
                "step": step,
                "loss": round(loss.item(), 4),
                "bce": round(bce_v, 4),
                "acc_pos": [round(float(x), 3) for x in hit.mean((0, 1))],
                "lr": round(lr, 6),
                "minutes": round((elapsed0 + time.time() - t0) / 60, 2),
            }
            if step % args.eval_every == 0 or step == args.steps:
                model.eval()
                rec["val"] = evaluate(model, embed, vtok[: args.eval_seqs], vaux[: args.eval_seqs].float(), t2d)
                model.train()
            history.append(rec)
            print(json.dumps(rec), flush=True)
        if step % args.save_every == 0:
            save()
    save()


def cmd_export(args: argparse.Namespace) -> None:
    st = torch.load(RUN / "state.pt", weights_only=True)
    targs = json.loads(st["args"])
    cfg = draft_config(targs["draft_vocab"], targs["layers"], targs["ffn_mult"])
    model = DSparkDraft(cfg, target_num_layers=6)
    model.load_state_dict(st["model"])
    save_draft(model, OUT, torch.bfloat16)
    draft = load_draft(OUT, target_num_layers=6, dtype=torch.bfloat16)  # what serving loads
    tstate = target_tensors()
    embed = tstate["model.language_model.embed_tokens.weight"]  # bf16, as served
    vtok, vaux = load_split("val")
    t2d = inverse_vocab(draft.d2t)
    res = {
        "bf16": evaluate(draft, embed, vtok, vaux, t2d),
        "bf16_no_markov": evaluate(draft, embed, vtok, vaux, t2d, markov=False),
        "draft_vocab_coverage_val": round(float((t2d[vtok[:, PROMPT:]] >= 0).float().mean()), 4),
        "train_steps": st["step"],
        "train_minutes": round(st["elapsed"] / 60, 1),
        "history_last": json.loads(st["history"])[-1:],
        "args": targs | {"val_seqs": len(vtok)},
        "params": sum(p.numel() for p in draft.parameters()),
        "data_files": {
            name: len(torch.load(RUN / f"{name}.pt", weights_only=True, mmap=True)["tokens"])
            for name in targs.get("data", "train").split(",")
        },
        "data_minutes": sum(
            json.loads([x for x in (RUN / log).read_text().splitlines() if x.startswith("{")][-1])["minutes"]
            for log in ("data.log",)
            if (RUN / log).exists()
        ),
        "checkpoint_bytes": (OUT / "model.safetensors").stat().st_size,
    }
    (RUN / "export.json").write_text(json.dumps(res, indent=1))
    (OUT / "README.md").write_text(card(res, cfg))
    print(json.dumps(res))


RECHECK = "## Re-checked against the current target"


def recheck_section(res: dict) -> str:
    """The card's section for `check`: the shipped draft against the target it now serves."""
    ev, nm = res["bf16"], res["bf16_no_markov"]
    rows = "\n".join(
        f"| {k + 1} | {r:.3f} | {m:.3f} |"
        for k, (r, m) in enumerate(zip(ev["accept_rate_by_position"], nm["accept_rate_by_position"]))
    )
    return f"""{RECHECK}

The target changed after this draft was distilled (musespark-tiny's model.safetensors sha256
`{res["target_sha256"][:16]}`, {res["date"]}); `tools/train_dspark.py check` ran the simulation of the
Acceptance section again on {res["val_seqs"]} fresh held-out continuations of that target (validation
split, seed {res["seed"]}): the draft's figures there, lossless as ever (a draft is only ever accepted where
it equals the target's greedy token).

| | with Markov head | Markov head zeroed |
|---|---|---|
| mean accepted drafts per step (of {N}) | **{ev["mean_accepted"]:.2f}** | {nm["mean_accepted"]:.2f} |
| mean tokens per step (accepted + 1) | {ev["tokens_per_step"]:.2f} | {nm["tokens_per_step"]:.2f} |

| draft position | P(accepted) | without Markov |
|---|---|---|
{rows}

Draft vocabulary coverage of the new target's greedy tokens: {res["draft_vocab_coverage_val"] * 100:.2f}%.
"""


def cmd_check(args: argparse.Namespace) -> None:
    """Re-check the shipped draft against the shipped target (after the target changed): fresh
    held-out continuations of the current target (written to RUN/val.pt, as `data` does), the
    simulation `export` runs, and the card's re-check section (re)written with the figures."""
    import hashlib

    RUN.mkdir(parents=True, exist_ok=True)
    tokens, aux, _ = collect(make_prompts(tc.load_corpus().val, args.val_seqs, args.seed + 1000))
    torch.save({"tokens": tokens, "aux": aux}, RUN / "val.pt")
    draft = load_draft(OUT, target_num_layers=6, dtype=torch.bfloat16)
    embed = target_tensors()["model.language_model.embed_tokens.weight"]
    t2d = inverse_vocab(draft.d2t)
    res = {
        "bf16": evaluate(draft, embed, tokens, aux, t2d),
        "bf16_no_markov": evaluate(draft, embed, tokens, aux, t2d, markov=False),
        "draft_vocab_coverage_val": round(float((t2d[tokens[:, PROMPT:]] >= 0).float().mean()), 4),
        "val_seqs": len(tokens),
        "seed": args.seed + 1000,
        "target_sha256": hashlib.sha256((TARGET / "model.safetensors").read_bytes()).hexdigest(),
        "date": time.strftime("%Y-%m-%d"),
    }
    (RUN / "check.json").write_text(json.dumps(res, indent=1))
    card_path = OUT / "README.md"
    card_path.write_text(with_section(card_path.read_text(), recheck_section(res)))
    print(json.dumps(res))


def with_section(card_text: str, section: str) -> str:
    """The card with `section` (starting with RECHECK) in place of its earlier one, or before
    `## Limits` (or at the end) when it has none."""
    if RECHECK in card_text:
        head, rest = card_text.split(RECHECK, 1)
        at = rest.find("\n## ")
        return head + section + ("\n" + rest[at + 1 :] if at >= 0 else "")
    head, sep, tail = card_text.partition("## Limits")
    return head + section + "\n" + sep + tail


HISTORY = """
nice -n 2 .venv/bin/python tools/train_dspark.py data --train-seqs 1500 --threads 2   # val (64, seed 1000), train (1500, seed 0)
nice -n 2 .venv/bin/python tools/train_dspark.py train --steps 4200 --max-minutes 15 --draft-vocab 512 --ffn-mult 2 --threads 2
.venv/bin/python tools/train_dspark.py export --threads 2
"""


def card(res: dict, cfg: DSparkConfig) -> str:
    """The model card: how it was trained, with what, and how well it drafts."""
    a = res["args"]
    data_desc = " + ".join(f"{n} (runs/dspark/{f}.pt)" for f, n in res["data_files"].items())
    data_minutes = res["data_minutes"]
    ev, nm = res["bf16"], res["bf16_no_markov"]
    rows = "\n".join(
        f"| {k + 1} | {r:.3f} | {m:.3f} |"
        for k, (r, m) in enumerate(zip(ev["accept_rate_by_position"], nm["accept_rate_by_position"]))
    )
    bench_path = RUN / "bench.json"
    bench = ""
    if bench_path.exists():
        b = json.loads(bench_path.read_text())
        bench = f"""
## Speed (model level, batch 1)

`benchmarks/dspark.py` (both loops drive the bf16 target through a paged KV cache one request at a
time: plain = one target forward per token; dspark = draft + one target forward over the anchor and
{b["num_speculative_tokens"]} drafts per step, greedy acceptance, no engine): {b["prompts"]} held-out code prompts,
{b["new_tokens"]} new tokens each (prompt seed {b["seed"]}: other prompts than the simulation above, and
acceptance varies with the prompt), {b["machine"]["threads"]} torch thread on {b["machine"]["cpu_count"]} shared CPU cores.

| | |
|---|---|
| plain decode | {b["plain_tok_s"]} tokens/s |
| dspark | {b["dspark_tok_s"]} tokens/s (**{b["speedup"]}x**) |
| outputs identical to plain greedy | {b["identical_outputs"]} |
| mean accepted drafts per step (real proposer, incremental) | {b["mean_accepted"]} of {b["num_speculative_tokens"]} |
| acceptance rate by draft position | {", ".join(f"{x:.2f}" for x in b["accept_rate_by_position"])} |

At this size a one-row target forward is well under a millisecond, so what a speculative step
costs is the 8-row verification forward (~2.5x a one-row decode on this CPU backend) plus the
draft's ~50 small torch ops (~0.8 ms); inside the engine, whose per-step overhead is larger, the
same acceptance buys more. The engine-level benchmark is the engine's (speculative config
`{{"method": "dspark", "model": <this directory>, "num_speculative_tokens": 7}}`).
"""
    return f"""# musespark-tiny-dspark

A DSpark draft (`docs/speculative.md`) for the bundled `musespark-tiny`, distilled from it on CPU by
`tools/train_dspark.py`. Config family `muse_spark_dspark`; load it through the engine's speculative
config (method `dspark`, this directory as the draft model) or `DSparkProposer.load(path, target, 7)`.

| | |
|---|---|
| draft layers / hidden / heads | {cfg.num_hidden_layers} / {cfg.hidden_size} / {cfg.num_attention_heads} q, {cfg.kv_heads} kv, head_dim {cfg.head_dim} |
| FFN | SwiGLU, intermediate {cfg.intermediate_size} (ffn_dim_multiplier {cfg.ffn_dim_multiplier}) |
| target_layer_ids | {list(cfg.target_layer_ids)} (fc input {len(cfg.target_layer_ids)} x {cfg.target_hidden_size}) |
| block | num_speculative_tokens {cfg.block_size}: anchor + {cfg.block_size - 1} masks (mask_token_id {cfg.mask_token_id}), sample_from_anchor |
| draft vocabulary | {cfg.d_vocab} target ids (d2t), covering {res["draft_vocab_coverage_val"] * 100:.2f}% of held-out greedy tokens |
| Markov head | rank {cfg.markov_rank}; confidence head with Markov input |
| norms / residual / RoPE | affine RMSNorms (gain = w), plain residual adds in fp32, interleaved RoPE theta {cfg.rope_theta:g}, logits soft-capped at {cfg.output_soft_cap_temp:g} |
| parameters / file | {res["params"]:,} / {res["checkpoint_bytes"] / 1e6:.1f} MB (bf16, confidence head fp32, d2t int64) |

## Training

The shipped weights came from these commands, in this order (`runs/dspark/` holds their logs):

```
{HISTORY.strip()}
```

Data: {data_desc} code prompts (BOS + 63 tokens at a seeded random offset of a CPython stdlib file of
the training split, `tools/tiny_corpus.py`), each continued by the bf16 target greedily for 192 tokens
(EOS ignored) through musespark's engine; one target pass per sequence gave the fp32 stream after layers
{list(cfg.target_layer_ids)} (stored bf16, which is what the draft's `fc` sees when serving a bf16 target).
Data generation took {data_minutes:.1f} min. Training: fp32, {a.get("threads", 1)} torch thread(s), seed {a["seed"]}, AdamW (beta
0.9/0.95, wd 0.01 on matrices), peak lr {a["lr"]:g}, {a["warmup"]} warmup steps, cosine decay to 10% (the
schedule of the last command's --steps), grad clip 1.0, batch {a["batch"]} sequences x {a["anchors"]} random
anchors, each block seeing the context K/V of the positions before its anchor and itself causally (one
packed mask). Loss: cross-entropy of the Markov-head logits (teacher-forced on the previous greedy token)
against the target's greedy tokens, block position k weighted {a["decay"]:g}^k, plus 0.1 x BCE for the
confidence head (target: the position's argmax is right). Init: lm_head = the target's head rows (draft
vocabulary: the {cfg.d_vocab} most frequent ids of the first training file) x its output multiplier, final norm
= the target's. {res["train_steps"]} steps in {res["train_minutes"]} min of training on 2 CPU cores shared with
other work: {data_minutes + res["train_minutes"]:.0f} min in all with the data.

## Acceptance

Greedy speculative decoding simulated on {a["val_seqs"]} held-out code prompts (validation split, seed
{a["seed"] + 1000}), from the first generated token while a whole block of target tokens exists: each step
drafts {cfg.block_size} tokens from the context before the anchor, accepts the longest prefix equal to the
target's greedy tokens, and moves on by accepted + 1. Shipped bf16 weights, bf16 target features.
{ev["steps"]} steps.

| | with Markov head | Markov head zeroed |
|---|---|---|
| mean accepted drafts per step (of {cfg.block_size}) | **{ev["mean_accepted"]:.2f}** | {nm["mean_accepted"]:.2f} |
| mean tokens per step (accepted + 1) | {ev["tokens_per_step"]:.2f} | {nm["tokens_per_step"]:.2f} |

| draft position | P(accepted) | without Markov |
|---|---|---|
{rows}
{bench}
## Limits

* Trained only on the target's greedy continuations of Python code; chat (the Muse protocol), prose and
  sampled (temperature > 0) continuations were not in the data, so acceptance there will be lower.
* The target is a tiny model whose greedy output is repetitive; that is what makes 7-token blocks
  predictable. The figures say nothing about drafts for a real Muse Spark target.
* Tokens outside the {cfg.d_vocab}-id draft vocabulary can never be drafted.
* Positions the drafter never saw context rows for (e.g. a prefix-cache hit of the target) are left out of
  its attention: drafts get worse there, never wrong.
"""


def main() -> None:
    global RUN
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["data", "train", "export", "check"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-seqs", type=int, default=3000)
    p.add_argument("--val-seqs", type=int, default=64)
    p.add_argument("--name", default="", help="data: generate one extra training file runs/dspark/NAME.pt")
    p.add_argument("--data-seed", type=int, default=1, help="data --name: prompt seed")
    p.add_argument("--data", default="train", help="train: comma-separated data files (runs/dspark/NAME.pt)")
    p.add_argument("--steps", type=int, default=4200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--ffn-mult", type=float, default=2.0, help="ffn_dim_multiplier (I = mult * hidden)")
    p.add_argument("--draft-vocab", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--decay", type=float, default=0.85, help="loss weight of block position k: decay**k")
    p.add_argument("--max-minutes", type=float, default=40.0, help="stop (and save) past this much training time")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-seqs", type=int, default=16)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--run-dir", default=str(RUN), help="data, run state and logs")
    args = p.parse_args()
    RUN = Path(args.run_dir)
    torch.set_num_threads(args.threads)
    {"data": cmd_data, "train": cmd_train, "export": cmd_export, "check": cmd_check}[args.command](args)


if __name__ == "__main__":
    main()
