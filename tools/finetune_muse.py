"""Teach the bundled tiny model the Muse chat protocol (docs/muse_chat.md §1-§3) and export it.

    .venv/bin/python tools/finetune_muse.py --steps 4000 --time-limit 120 --no-export  # a new run
    .venv/bin/python tools/finetune_muse.py --steps 4000 --resume --no-export           # continue it
    .venv/bin/python tools/finetune_muse.py --export-only                               # export + evaluate
    # the copy recipe: a wired copy circuit, copy spans and stdlib windows beside the chats
    .venv/bin/python tools/finetune_muse.py --copy-circuit --induction 16 --chats 6 --code-windows 4 \
        --steps 1500 --lr 1e-3 --warmup 20 --no-export

A run is fixed by its first session (--resume takes these from the saved state):

* `--init bundled` (default): start from the shipped chat checkpoint (src/musespark/models/
  musespark-tiny, vocab 4100, the Muse markers already in its tokenizer), copied to
  RUN/init when the run starts, so an export over src/ never changes what the run refers to.
* `--init base`: the conversion that made the first chat model. The base model (the bundled
  checkpoint as tools/train_tiny.py shipped it, vocab 4096; copied to RUN/base) gets the four
  Muse markers as special added tokens `<|start|>`=4096, `<|message|>`=4097, `<|eom|>`=4098,
  `<|eot|>`=4099; `embed_tokens` and `lm_head` grow by four rows (the mean of the old rows +
  seeded noise). EOS = [1, 4099].
* `--copy-circuit`: before step 0, wire a previous-token head into layer 0 and an induction
  head into layer 1 (set_copy_circuit). Without it the model never learned to copy from its
  context; with it the repeated-span loss (`--induction N` spans a step) falls from ln 4091 to
  ~1 nat in ~700 steps, and the answers start quoting the prompt.
* `--tie-space` (applied once, at the start of the session that passes it): the copy circuit
  matches " X" with "X" (tie_space_pairs), so a value the user wrote after a space is continued
  after `name="city">` and a tool result's `"Porto"` after " in".
* `--value-weight W`, `--value-chats N`: the argument values of tool calls weigh W; N short
  tool-call examples a step (the last user message onward) are scored on their values only.
* `--locate-weight W`: a loss (weight W) on the attention of layer 5's last head from each call
  value's `>` to where the user wrote the value (value_sources): the copy circuit continues a
  value, nothing found where one starts, and no head learned it from the token loss alone.
* `--value-call-weight W`: the rest of each short tool-call example's call, from its first value
  on, weighs W too (the tags that say whether an optional parameter such as `unit` follows).
* `--restate-chats N`, `--restate-weight W`, `--locate-restate`: N short tool-result examples a
  step (the last user message onward, then the answer), the values the answer restates weighing
  W; with --locate-weight, the same attention loss from the answer's position before each
  restated value to that value in the tool's result or the call (restate_sources). The answers
  restated 34% of held-out results before these, 68% after ~500 steps with them.
* `--cosine-from S`: the learning-rate schedule (warmup, then cosine to --steps) restarts at
  step S, for a new stage of a run.
* `--data copy` (default): conversations from tools/muse_copy_data.py, whose values can only be
  copied (`--copy-mix F`: a share F of each step's conversations from muse_chat_data);
  `--data chat`: tools/muse_chat_data.py's (`--data-version`), the first chat model's data.

Fine-tuning (fp32, musespark's own model code with autograd, as train_tiny.py): every step
packs `--chats` synthetic conversations (rendered with the engine's own chat renderer and the
bundled chat_template.jinja; loss only on the assistant's raw output after the final
`<|start|>assistant`, through `<|eot|>`) and `--code-windows` 256-token windows of the stdlib
training split (full loss) into one varlen forward.
loss = chat loss (mean over target tokens) + code_weight * code loss (mean over tokens).
AdamW, lr schedule, router-bias balancing and bits/byte come from tools/train_tiny.py.
Data order is a pure function of (seed, step); state (weights, optimizer, step, history, every
session's args) is saved to RUN/state.pt every --save-every steps, at --time-limit, after
--session-steps, and on SIGTERM/SIGINT (after the step under way), and --resume continues it
exactly: the same losses as a run that was never stopped.

Export writes src/musespark/models/musespark-tiny (bf16; residual gates, router weights and
bias fp32), evaluates the shipped weights (stdlib bits/byte, expert load; greedy generation
through musespark's engine on muse_copy_data's held-out tasks, scored with
benchmarks/tool_eval.py's functions, and on muse_chat_data's held-out tool tasks and
conversations) and rewrites the model card with the recipe of every stage.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "benchmarks"))

import muse_chat_data as mcd  # noqa: E402
import muse_copy_data as mcp  # noqa: E402
import tiny_corpus as tc  # noqa: E402
import tool_eval  # noqa: E402
import train_tiny as tt  # noqa: E402

from musespark.engine import chat as chat_render  # noqa: E402
from musespark.layers.attention import AttentionContext  # noqa: E402
from musespark.model.muse_spark import MuseSparkForCausalLM  # noqa: E402

OUT = ROOT / "src" / "musespark" / "models" / "musespark-tiny"
TEMPLATE = ROOT / "tests" / "data" / "muse_chat_template.jinja"
SPECIAL = {"bos_token": tc.BOS, "eos_token": tc.EOS}
BASE_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "README.md",
)
INIT_FILES = (*BASE_FILES, "chat_template.jinja")
NEW_VOCAB = 4100
EOT_ID = 4099
EOS_IDS = (1, EOT_ID)
EVAL_SEED = 1000  # held-out tasks; training uses --seed (0)
BASE_VAL_BPB = 1.800  # the base card's validation bits/byte


# -- conversion -------------------------------------------------------------------------


def slash_escaped_json(value: object) -> str:
    """JSON text of `value` with "/" written as "\\/" (the same JSON string): a recorded model
    output on the card then never reads as a path of the machine that trained it."""
    return json.dumps(value).replace("/", "\\/")


def base_dir(run: Path) -> Path:
    """The pre-chat bundled checkpoint (vocab 4096), copied once from src/ into the run dir."""
    base = run / "base"
    if not (base / "model.safetensors").exists():
        cfg = json.loads((OUT / "config.json").read_text())
        if cfg["text_config"]["vocab_size"] != 4096:
            raise SystemExit(
                f"{base} is missing and {OUT} is already converted; restore the base with "
                "`git show HEAD:src/musespark/models/musespark-tiny/...`"
            )
        base.mkdir(parents=True, exist_ok=True)
        for f in BASE_FILES:
            shutil.copy2(OUT / f, base / f)
    return base


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def init_dir(run: Path, fresh: bool = False) -> Path:
    """The shipped chat checkpoint (vocab 4100, Muse markers included) that an `--init bundled`
    run starts from, copied once from src/ into the run dir: an export that later overwrites
    src/ does not change what --resume (and the card) refer to. `fresh`: a new run, whose
    start must be the checkpoint src/ ships now (a stale copy is refused, not reused)."""
    init = run / "init"
    if (init / "model.safetensors").exists():
        if fresh and _digest(init / "model.safetensors") != _digest(OUT / "model.safetensors"):
            raise SystemExit(
                f"{init} holds another checkpoint than {OUT}; a new run needs a new --run-dir "
                "(or --resume to continue the run that copied it)"
            )
        return init
    cfg = json.loads((OUT / "config.json").read_text())
    if cfg["text_config"]["vocab_size"] != NEW_VOCAB:
        raise SystemExit(f"{OUT} is not a chat checkpoint (vocab {cfg['text_config']['vocab_size']})")
    tmp = run / "init.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in INIT_FILES:
        shutil.copy2(OUT / f, tmp / f)
    tmp.rename(init)  # whole or absent
    return init


def source_dir(run: Path, init: str) -> Path:
    """The checkpoint a run of `init` ("base" or "bundled") starts from (its card included)."""
    return init_dir(run) if init == "bundled" else base_dir(run)


def chat_tokenizer(run: Path, init: str = "base"):
    """The tokenizer with the four Muse markers as special added tokens (ids 4096-4099): the
    base tokenizer grown by them, or (`bundled`) the shipped tokenizer that has them."""
    from tokenizers import Tokenizer

    if init == "bundled":
        tok = Tokenizer.from_file(str(init_dir(run) / "tokenizer.json"))
    else:
        tok = Tokenizer.from_file(str(base_dir(run) / "tokenizer.json"))
        assert tok.get_vocab_size() == 4096
        tok.add_special_tokens(mcd.MUSE_SPECIAL_TOKENS)
    ids = [tok.token_to_id(s) for s in mcd.MUSE_SPECIAL_TOKENS]
    assert ids == [4096, 4097, 4098, 4099], ids
    for i, s in enumerate(tc.SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i
    return tok


def chat_config():
    return dataclasses.replace(tt.model_config(NEW_VOCAB, 0, 1), eos_token_id=EOS_IDS)


def run_config(run: Path, init: str):
    """The architecture trained and exported: train_tiny.py's (grown vocab) for `base`, the
    shipped checkpoint's own config.json for `bundled` (less what only describes the file:
    its dtype and the released form's extra keys, which the export writes anew)."""
    from musespark.checkpoint.loader import load_config

    if init != "bundled":
        return chat_config()
    return dataclasses.replace(load_config(init_dir(run)), checkpoint_dtype=None, extra={})


def _trainable(cfg, state: dict[str, torch.Tensor]) -> MuseSparkForCausalLM:
    """A fresh fp32 model (autograd on) holding `state`; only rotary tables are left to it."""
    model = MuseSparkForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(m.endswith(("inv_freq",)) for m in missing), (missing, unexpected)
    return model


def bundled_model(run: Path) -> MuseSparkForCausalLM:
    """The shipped checkpoint (bf16 on disk; fp32 residual gates and router) as an fp32 model:
    each parameter equals its file tensor widened to fp32."""
    from musespark import load_model

    shipped = load_model(init_dir(run), dtype="float32", backend="torch")
    return _trainable(run_config(run, "bundled"), shipped.state_dict())


def initial_model(run: Path, init: str, seed: int) -> MuseSparkForCausalLM:
    return bundled_model(run) if init == "bundled" else grown_model(run, seed)


def grown_model(run: Path, seed: int) -> MuseSparkForCausalLM:
    """The base weights (fp32) in a model with vocab 4100: old rows copied, 4 new rows =
    mean of the old rows + N(0, (0.1 * per-dim std)^2), seeded."""
    from musespark import load_model

    base = load_model(base_dir(run), dtype="float32", backend="torch")
    state = base.state_dict()
    gen = torch.Generator().manual_seed(seed + 4096)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        old = state[name]
        extra = NEW_VOCAB - old.shape[0]
        new = old.mean(0, keepdim=True) + 0.1 * old.std(0, keepdim=True) * torch.randn(
            extra, old.shape[1], generator=gen
        )
        state[name] = torch.cat([old, new], 0)
    return _trainable(chat_config(), state)


@torch.no_grad()
def set_previous_token_head(model: MuseSparkForCausalLM, layer: int = 0, kv_head: int = 0, channel: int = 0) -> None:
    """Make the query heads that read KV head `kv_head` of `layer` (a RoPE layer) attend to the
    previous position, whatever the tokens (the first half of set_copy_circuit).

    A copy needs two heads in turn: one that writes each token's predecessor into its stream, and
    an induction head that finds where the current token occurred before and reads what followed.
    Neither helps the loss without the other, so training sits on a plateau. Measured on the Zen 4
    (2026-12-07): a 2-layer model of this architecture with this head set by hand formed an
    induction head in ~350 steps of 64 spans over 64 ids, without it not in 400; on the bundled
    model, 280 steps of 48 spans over 128 ids with it set, and 1000 steps of spans without it,
    left the span loss at the uniform one.

    The head needs a query and a key that do not depend on the token: `channel` of every
    embedding row is set to 3x the embeddings' RMS, and the q/k rows of those heads read only
    that channel. q is then one fixed vector u per head and k = R(θ) u pair by pair (θ = the
    layer's rotary frequencies), so q_m·k_n = Σ_i |u_i|² cos((n - m + 1) θ_i): largest at
    n = m - 1. The QK-norm keeps |q| and |k| fixed, so the scores are as sharp as the
    qk_scale_factor allows (measured: ~0.75 of the attention on the previous token)."""
    cfg = model.config
    theta = float(cfg.layer_rope_theta[layer])
    if theta <= 0:
        raise ValueError(f"layer {layer} is a NoPE layer: a previous-token head needs RoPE")
    D = cfg.head_dim
    per_kv = cfg.num_attention_heads // cfg.num_key_value_heads
    emb = model.embed_tokens.weight
    emb[:, channel] = 3.0 * emb.pow(2).mean().sqrt()
    attn = model.layers[layer].self_attn
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    u = torch.randn(D, generator=torch.Generator().manual_seed(4096 + layer))
    u1, u2, c, s = u[: D // 2], u[D // 2 :], inv.cos(), inv.sin()
    k = torch.cat([u1 * c - u2 * s, u1 * s + u2 * c])  # rotate-half layout: pair i is (i, i + D/2)
    qw, kw = attn.q_proj.weight, attn.k_proj.weight
    for h in range(kv_head * per_kv, (kv_head + 1) * per_kv):
        qw[h * D : (h + 1) * D] = 0
        qw[h * D : (h + 1) * D, channel] = u
    kw[kv_head * D : (kv_head + 1) * D] = 0
    kw[kv_head * D : (kv_head + 1) * D, channel] = k


@torch.no_grad()
def set_copy_circuit(model: MuseSparkForCausalLM, first_channel: int = 192) -> None:
    """Wire a copy (induction) circuit into layers 0 and 1 (`--copy-circuit`); training then only
    has to learn what the matched position's token should do to the logits.

    Channels P = [first_channel, first_channel + head_dim) of the stream are reserved for "the
    previous token": every embedding row is zeroed there, and layer 0's attention heads (other
    than the previous-token head) and its dense MLP no longer write there. Layer 0's first KV group
    becomes a previous-token head (set_previous_token_head); its first query head writes its value
    (the previous token's layer-0 value vector, v_prev) into P, the second writes nothing, and
    both output gates are made constant (weights 0: sigmoid 0.5). Every later op on the stream is
    channel-wise (residual gates, norm gains) or reads all of it, so P holds v_prev alone up to
    a per-position scale when layer 1 reads it.

    Layer 1 (a NoPE full-attention layer) KV group 0 becomes the induction head: its key reads only
    P (k = v_prev of the key's position), its query heads read the current token's channels
    through layer 0's own value projection (q ≈ v_cur, corrected for the norm gains and the
    residual gate between the two layers). q·k is then largest where the key's previous token is
    the query's token: on the bundled weights ~0.8-1.0 of the attention lands on the token after
    the earlier occurrence, on spans of 64 or 4091 distinct ids (2026-12-07, Zen 4). Measured
    alongside: gradient descent alone (1000 steps of spans without the previous-token head, 280
    with it set) did not find this circuit, because neither head lowers the loss without the other.

    Wiping P and rewiring these heads costs the pre-trained model some of what it knew (the code
    loss rises); the code windows mixed into fine-tuning win it back."""
    cfg = model.config
    D, H = cfg.head_dim, cfg.hidden_size
    if not 0 < first_channel <= H - D:
        raise ValueError(f"first_channel {first_channel}: P must fit in (0, {H}] and leave channel 0 free")
    if cfg.is_sparse(0) or float(cfg.layer_rope_theta[1]) > 0:
        raise ValueError("the copy circuit needs a dense layer 0 and a NoPE layer 1")
    P = slice(first_channel, first_channel + D)
    model.embed_tokens.weight[:, P] = 0
    set_previous_token_head(model)  # channel 0: the constant the previous-token head reads
    L0, L1 = model.layers[0], model.layers[1]
    a0, a1 = L0.self_attn, L1.self_attn
    per_kv = cfg.num_attention_heads // cfg.num_key_value_heads
    a0.gate_proj.weight[: per_kv * D] = 0
    wo = a0.o_proj.weight  # [H, heads * D]
    wo[P, :] = 0
    wo[:, : per_kv * D] = 0
    wo[P, :D] = 4.0 * torch.eye(D)
    L0.mlp.down_proj.weight[P, :] = 0
    # The current token as layer 1's input norm sees it: layer 0's input (gain n0) scaled by the
    # attention residual gate alpha, then layer 1's gain n1.
    alpha, _ = L0.post_attention_residual_gate.coefficients()
    n0, n1 = 1 + L0.input_layernorm.weight, 1 + L1.input_layernorm.weight
    wq = a0.v_proj.weight[:D] * (n0 / (n1 * alpha))[None, :]
    wq[:, P] = 0
    wq[:, 0] = 0
    for h in range(per_kv):
        a1.q_proj.weight[h * D : (h + 1) * D] = wq
    a1.k_proj.weight[:D] = 0
    a1.k_proj.weight[:D, P] = torch.eye(D)


def space_pairs(tok) -> list[tuple[int, int]]:
    """(id of " X", id of "X") for every ordinary token X that also exists with one leading space."""
    ids = {tok.decode([i], skip_special_tokens=False): i for i in range(INDUCTION_TOKENS[1])}
    return [
        (i, ids[p[1:]])
        for p, i in ids.items()
        if i >= INDUCTION_TOKENS[0] and p.startswith(" ") and p[1:].strip() and p[1:] in ids and not p[1].isspace()
    ]


@torch.no_grad()
def tie_space_pairs(model: MuseSparkForCausalLM, tok, first_channel: int = 192) -> int:
    """Make the copy circuit blind to a leading space (`--tie-space`): returns the pairs tied.

    The byte-level BPE gives a word after a space its own token (" L" in "weather in Ljubljana")
    and the same word after a quote or `>` another ("L" in `name="city">Ljubljana`). The induction
    head matches the current token's layer-0 value against the previous token's (set_copy_circuit),
    so after writing "L" it finds no earlier "L" to continue from, and an answer's " P" finds no
    " P" in the tool's `"Porto"`. This moves the embeddings of each pair (" X", "X") so that their
    component in the row space of layer 0's previous-token value projection (with its norm gain)
    points the same way; the rest of each embedding, the reserved channels and channel 0 are left
    as they are. QK-norm makes the match depend on direction only."""
    cfg = model.config
    D = cfg.head_dim
    L0 = model.layers[0]
    A = L0.self_attn.v_proj.weight[:D] * (1 + L0.input_layernorm.weight)[None, :]  # [D, H]
    A[:, first_channel : first_channel + D] = 0
    A[:, 0] = 0
    basis, _ = torch.linalg.qr(A.T)  # [H, D], orthonormal
    basis[first_channel : first_channel + D] = 0  # zero up to rounding already: make it exact
    basis[0] = 0
    pairs = space_pairs(tok)
    a, b = (torch.tensor(x) for x in zip(*pairs))
    emb = model.embed_tokens.weight
    ea, eb = emb[a], emb[b]
    ra, rb = ea.pow(2).mean(-1, keepdim=True).sqrt(), eb.pow(2).mean(-1, keepdim=True).sqrt()
    pa, pb = ea @ basis, eb @ basis
    mid = (pa / ra + pb / rb) / 2
    emb[a] = ea + (mid * ra - pa) @ basis.T
    emb[b] = eb + (mid * rb - pb) @ basis.T
    return len(pairs)


# -- data --------------------------------------------------------------------------------


def code_streams(run: Path, tok) -> tuple[torch.Tensor, torch.Tensor]:
    """The stdlib train/validation token streams of train_tiny.py (cached in the run dir)."""
    tp, vp = run / "train_ids.npy", run / "val_ids.npy"
    if not (tp.exists() and vp.exists()):
        corpus = tc.load_corpus()
        np.save(tp, np.array(tc.encode_docs(tok, [t for _, t in corpus.train]), dtype=np.uint16))
        np.save(vp, np.array(tc.encode_docs(tok, [t for _, t in corpus.val]), dtype=np.uint16))
    return (torch.from_numpy(np.load(tp).astype(np.int64)), torch.from_numpy(np.load(vp).astype(np.int64)))


def byte_lengths(tok) -> torch.Tensor:
    lens = tc.token_byte_lengths(tok)
    for s in mcd.MUSE_SPECIAL_TOKENS:
        lens[tok.token_to_id(s)] = 0
    return torch.tensor(lens)


def render_prompt(conv: mcd.Conversation, template: str) -> str:
    """The prompt exactly as the engine renders it (InputProcessor.render_chat's path)."""
    kwargs = chat_render.template_kwargs(None, conv.kwargs, tools=conv.tools, add_generation_prompt=True)
    return chat_render.render(template, conv.messages, kwargs, SPECIAL)


def encode_chat(conv: mcd.Conversation, tok, template: str) -> tuple[list[int], int]:
    """(prompt ids + target ids, number of prompt ids). Prompt and target are encoded
    separately, as at inference (the engine encodes the prompt, the model adds the rest)."""
    p = tok.encode(render_prompt(conv, template), add_special_tokens=False).ids
    t = tok.encode(conv.target, add_special_tokens=False).ids
    assert t[-1] == EOT_ID
    return p + t, len(p)


def n_old_chats(step: int, n: int, copy_mix: float) -> int:
    """How many of step `step`'s n conversations come from muse_chat_data under --copy-mix F:
    floor(F*n*(step+1)) - floor(F*n*step), so that every k steps hold F*n*k of them (±1)."""
    return int(copy_mix * n * (step + 1) + 1e-9) - int(copy_mix * n * step + 1e-9)


def chat_batch(
    seed: int,
    step: int,
    n: int,
    tok,
    template: str,
    max_len: int,
    version: int = mcd.DATA_VERSION,
    data: str = "chat",
    copy_mix: float = 0.0,
    convs_out: list[mcd.Conversation] | None = None,
) -> list[tuple[list[int], int]]:
    """The n encoded conversations of `step`, a pure function of (seed, step): `chat` draws
    tools/muse_chat_data.py's stream; `copy` draws tools/muse_copy_data.py's, except
    `n_old_chats` of them from muse_chat_data's. Each stream's indices start at 2n*step (the
    spares replace conversations longer than max_len + 1 tokens). `convs_out` receives the
    conversations kept, in order."""
    n_old = n if data == "chat" else n_old_chats(step, n, copy_mix)
    out: list[tuple[list[int], int]] = []
    for source, count in (("chat", n_old), ("copy", n - n_old)):
        i, end = step * n * 2, len(out) + count
        while len(out) < end:
            conv = mcd.example(seed, i, version) if source == "chat" else mcp.example(seed, i)[0]
            ids, np_ = encode_chat(conv, tok, template)
            i += 1
            if len(ids) <= max_len + 1:
                out.append((ids, np_))
                if convs_out is not None:
                    convs_out.append(conv)
    return out


INDUCTION_TOKENS = (5, 4096)  # ordinary vocabulary ids: the special tokens 0-4 and 4096-4099 left out


def induction_pool(vocab: int = 0) -> torch.Tensor:
    """The ordinary ids copy spans draw from: all of them, or (`vocab` > 0) a fixed seeded subset."""
    lo, hi = INDUCTION_TOKENS
    ids = torch.arange(lo, hi)
    if vocab <= 0 or vocab >= len(ids):
        return ids
    return ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(77))[:vocab]].sort().values


def induction_batch(seed: int, step: int, n: int, vocab: int = 0) -> list[tuple[list[int], int]]:
    """The n copy spans of `step` (`--induction`), a pure function of (seed, step): each is
    A + B + A with A 16-64 random ordinary tokens and B 0-32 more, scored only on the second A
    after its first token (returned as (ids, n_prompt), as encode_chat's are). `vocab` > 0 draws
    the tokens from a fixed subset of that many ids (induction_pool); in a 2-layer model with the
    previous-token head set, 64 ids formed an induction head in ~350 steps where 128 did not in 400. The bundled model
    never learned to copy from its context: its loss on a repeated random span is the loss on the
    first (ln 4091, no induction heads), and without them it cannot copy a value from the user's
    message. Measured on the Zen 4 (2026-12-07): 600 steps of 16 spans alone, lr 1e-3, left that
    loss at 8.29; with a fixed span length and no gap the loss falls within 400 steps, but
    through a head that attends a fixed distance back, which copies nothing else."""
    g = torch.Generator().manual_seed(1_000_003 * seed + step)
    lo, hi = INDUCTION_TOKENS
    pool = induction_pool(vocab)
    out = []
    for _ in range(n):
        a, b = (int(v) for v in torch.randint(0, 1 << 16, (2,), generator=g))
        span = pool[torch.randint(0, len(pool), (16 + a % 49,), generator=g)].tolist()
        gap = pool[torch.randint(0, len(pool), (b % 33,), generator=g)].tolist()
        out.append((span + gap + span, len(span) + len(gap) + 2))
    return out


def heldout_convs(data: str, n: int) -> list[mcd.Conversation]:
    """Held-out conversations for the training log's held-out chat loss (seed EVAL_SEED + 1)."""
    if data == "chat":
        return mcd.heldout(EVAL_SEED + 1, n)
    kinds = ("tool_call", "tool_result", "plain", "no_tool")
    return [
        mcp.heldout_example(EVAL_SEED + 1, i, kinds[i % 4], None if i % 4 == 2 else mcp.TOOL_NAMES[i % 3])[0]
        for i in range(n)
    ]


COPY_WEIGHT = 1.0  # set by --copy-weight (train): the weight of output tokens copied from the prompt's tail
COPY_TAIL = 64  # prompt tokens (the last user or tool message) whose copies are weighted
_STRUCTURAL: set[int] = set()  # tokens of the fixed framing, never counted as copies


VALUE_WEIGHT = 1.0  # set by --value-weight (train): the weight of a tool call's argument values
VALUE_CALL_WEIGHT = 0.0  # set by --value-call-weight (train): the rest of a --value-chats call
VALUE_MARKS: dict[str, int] = {}  # ids of the ATEM framing around a value, set from the tokenizer


def set_value_marks(tok) -> None:
    """Read the ids value_spans looks for: `parame`, `"`, `>` (`name="city">`) and `</`."""
    enc = tok.encode('<atem:parameter name="city">x</atem:parameter>', add_special_tokens=False)
    want = {"param": "parame", "quote": '"', "gt": ">", "close": "</"}
    for key, piece in want.items():
        if piece not in enc.tokens:
            raise ValueError(f"the tokenizer splits the ATEM parameter tag unexpectedly: {enc.tokens}")
        VALUE_MARKS[key] = enc.ids[enc.tokens.index(piece)]


def value_spans(ids: list[int], n_prompt: int) -> list[tuple[int, int]]:
    """Target indices [a, b) of each argument value the output writes: the value's tokens and the
    `</` that closes it (target i predicts ids[i + 1]). Needs set_value_marks."""
    m, out = VALUE_MARKS, []
    for k in range(max(n_prompt, 10), len(ids) - 1):
        if ids[k] == m["gt"] and ids[k - 1] == m["quote"] and m["param"] in ids[k - 10 : k]:
            end = next((e for e in range(k + 1, len(ids)) if ids[e] == m["close"]), len(ids) - 1)
            out.append((k, end))
    return out


def last_user_start(ids: list[int], n_prompt: int, tok) -> int | None:
    """Index of the `<|start|>` that opens the prompt's last user message (None: there is none)."""
    start, user = tok.token_to_id("<|start|>"), tok.token_to_id("user")
    return max((i for i in range(n_prompt - 1) if ids[i] == start and ids[i + 1] == user), default=None)


def value_sources(ids: list[int], n_prompt: int, tok) -> list[tuple[int, int]]:
    """(k, j) per argument value of the output that the last user message spells out: k the `>`
    before the value (the position whose output is the value's first token), j the user-message
    token where the value starts (the latest one whose text, a leading space dropped, begins
    with the value). The targets of `--locate-weight`."""
    u = last_user_start(ids, n_prompt, tok)
    if u is None:
        return []
    start = tok.token_to_id("<|start|>")
    end = next((i for i in range(u + 2, n_prompt) if ids[i] in (EOT_ID, start)), n_prompt)
    out = []
    for k, close in value_spans(ids, n_prompt):
        value = tok.decode(ids[k + 1 : close])
        js = [j for j in range(u + 3, end) if value and tok.decode(ids[j:end]).lstrip(" ").startswith(value)]
        if js:
            out.append((k, js[-1]))
    return out


LOCATE = {"layer": 5, "head": 3}  # the head --locate-weight teaches to find the value


def locate_loss(q: torch.Tensor, k: torch.Tensor, scale: float, starts: list[int], sources) -> torch.Tensor:
    """Mean of -log p(j | k) over the sources: the LOCATE head's attention from each value's `>`
    to where the user wrote it. q [T, heads, D] and k [T, kv heads, D] as the layer attends
    (normed, rotated), over the packed sequences that begin at `starts`."""
    h = LOCATE["head"]
    kv = h // (q.shape[1] // k.shape[1])
    terms = []
    for s, pairs in zip(starts, sources):
        for qi, kj in pairs:
            scores = (k[s : s + qi + 1, kv] @ q[s + qi, h]) * scale  # causal: keys up to the query
            terms.append(-torch.log_softmax(scores, 0)[kj])
    return torch.stack(terms).mean() if terms else q.sum() * 0.0


def _weights(ids: list[int], n_prompt: int) -> torch.Tensor:
    """Per target token: VALUE_WEIGHT on a tool call's argument values (value_spans), COPY_WEIGHT
    where the output repeats a token of the prompt's tail (a tool result), else 1 (the copy is
    what the model fails to learn)."""
    w = torch.ones(len(ids) - 1)
    if VALUE_WEIGHT != 1.0:
        for a, b in value_spans(ids, n_prompt):
            w[a:b] = VALUE_WEIGHT
    if COPY_WEIGHT == 1.0:
        return w
    tail = set(ids[max(0, n_prompt - COPY_TAIL) : n_prompt]) - _STRUCTURAL
    for i in range(n_prompt - 1, len(ids) - 1):
        if ids[i + 1] in tail and w[i] == 1.0:
            w[i] = COPY_WEIGHT
    return w


def value_batch(seed: int, step: int, n: int, tok, template: str) -> list[tuple[list[int], int, torch.Tensor]]:
    """`--value-chats N`: n short tool-call examples of `step`, (ids, n_prompt, weights). Each is a
    training tool_call conversation of muse_copy_data cut to BOS + its last user message onward
    (the tool definitions dropped), weighted only on the argument values (VALUE_WEIGHT; the
    reasoning and the call around them weigh 0, so the model never learns to call a tool that
    is not offered). ~100 tokens instead of ~900: more values to locate per step. With
    VALUE_CALL_WEIGHT > 0 the rest of the call from the first value on (the later parameters'
    tags, which say whether an optional one such as `unit` follows, and the closing tags) weighs
    that much."""
    out = []
    for j in range(n):
        d = mcp.Drawer(random.Random(f"muse-copy-value:{seed}:{step}:{j}"), mcp.TRAIN)
        ids, n_prompt = encode_chat(mcp.make(d, "tool_call"), tok, template)
        u = last_user_start(ids, n_prompt, tok)  # a tool_call conversation always ends with one
        short, np_ = [ids[0], *ids[u:]], n_prompt - u + 1
        w = torch.zeros(len(short) - 1)
        spans = value_spans(short, np_)
        if VALUE_CALL_WEIGHT and spans:
            w[spans[0][0] :] = VALUE_CALL_WEIGHT
        for a, b in spans:
            w[a:b] = VALUE_WEIGHT
        out.append((short, np_, w))
    return out


def restate_values(conv: mcd.Conversation) -> list[str]:
    """What a tool_result conversation's answer copies from the turns before it: the result's
    values it must restate (muse_copy_data's `restate`) and the call's string arguments (the
    city, the expression, the path). Empty for every other kind."""
    if conv.kind != "tool_result":
        return []
    restate = conv.expected.get("restate", {})
    values = [*restate.get("all", []), *restate.get("any", [])]
    values += [v for v in conv.expected.get("arguments", {}).values() if isinstance(v, str)]
    return [v for v in dict.fromkeys(values) if v]


def restate_sources(ids: list[int], n_prompt: int, tok, values: list[str]) -> list[tuple[int, int]]:
    """(k, j) per value of `values` that the output writes: k the output position whose next
    token starts the value (its first occurrence; a leading space dropped), j the latest token
    from the last user message on (the question, the call, the tool's result) where it starts.
    Values the output or the prompt does not spell from a token boundary are left out. The
    targets of `--locate-restate`."""
    u = last_user_start(ids, n_prompt, tok)
    if u is None:
        return []
    out = []
    for v in values:
        k = next(
            (k for k in range(n_prompt - 1, len(ids) - 1) if tok.decode(ids[k + 1 :]).lstrip(" ").startswith(v)), None
        )
        js = [j for j in range(u + 3, n_prompt) if tok.decode(ids[j:n_prompt]).lstrip(" ").startswith(v)]
        if k is not None and js:
            out.append((k, js[-1]))
    return out


RESTATE_WEIGHT = 1.0  # set by --restate-weight (train): the weight of a value the answer restates


def restate_spans(ids: list[int], n_prompt: int, tok, values: list[str]) -> list[tuple[int, int]]:
    """Target indices [k, k + m) of each value the output restates: k as restate_sources finds it,
    m the fewest output tokens whose text (a leading space dropped) spells the whole value."""
    out = []
    for k, _ in restate_sources(ids, n_prompt, tok, values):
        text = tok.decode(ids[k + 1 :]).lstrip(" ")
        v = next(v for v in values if text.startswith(v))
        m = next(m for m in range(1, len(ids) - k) if tok.decode(ids[k + 1 : k + 1 + m]).lstrip(" ").startswith(v))
        out.append((k, k + m))
    return out


def restate_batch(
    seed: int, step: int, n: int, tok, template: str
) -> tuple[list[tuple[list[int], int, torch.Tensor]], list[list[str]]]:
    """`--restate-chats N`: n short tool_result examples of `step` ((ids, n_prompt, weights), and
    each one's restate_values). Each is a training tool_result conversation of muse_copy_data cut
    to BOS + its last user message onward (the question, the call, the result, then the answer),
    weighted as the chats are (_weights), and RESTATE_WEIGHT on the tokens of each value the
    answer restates (restate_spans)."""
    items, values = [], []
    for j in range(n):
        d = mcp.Drawer(random.Random(f"muse-copy-restate:{seed}:{step}:{j}"), mcp.TRAIN)
        conv = mcp.make(d, "tool_result")
        ids, n_prompt = encode_chat(conv, tok, template)
        u = last_user_start(ids, n_prompt, tok)  # a tool_result conversation always has one
        short, np_ = [ids[0], *ids[u:]], n_prompt - u + 1
        w, vals = _weights(short, np_), restate_values(conv)
        if RESTATE_WEIGHT != 1.0:
            for a, b in restate_spans(short, np_, tok, vals):
                w[a:b] = RESTATE_WEIGHT
        items.append((short, np_, w))
        values.append(vals)
    return items, values


def packed_loss(
    model,
    chats: list[tuple[list[int], int]],
    code: torch.Tensor | None,
    spans: list[tuple[list[int], int]] | None = None,
    sources: list[list[tuple[int, int]]] | None = None,
):
    """One varlen forward over every sequence. Returns (chat loss, code loss or None), then the
    span loss with copy `spans` (induction_batch), then the locate loss with `sources` (one list
    of value_sources per chat)."""
    inputs, targets, positions, lengths, is_code, weights = [], [], [], [], [], []
    for item in [*chats, *(spans or [])]:
        ids, n_prompt = item[0], item[1]
        x = torch.tensor(ids)
        tgt = x[1:].clone()
        tgt[: n_prompt - 1] = -100  # loss only on the assistant's output tokens
        inputs.append(x[:-1]), targets.append(tgt), lengths.append(len(ids) - 1)
        is_code.append(torch.zeros(len(ids) - 1, dtype=torch.bool))
        weights.append(item[2] if len(item) > 2 else _weights(ids, n_prompt))
    if code is not None:
        for row in code:
            inputs.append(row[:-1]), targets.append(row[1:]), lengths.append(row.numel() - 1)
            is_code.append(torch.ones(row.numel() - 1, dtype=torch.bool))
    for n in lengths:
        positions.append(torch.arange(n))
    seen: dict = {}
    backend = model._active_backend()
    plain = backend.attention

    def capture(attn, q, k, v, pos, ctx):
        if attn.layer == LOCATE["layer"]:
            seen.update(q=q, k=k, scale=attn.scale)
        return plain(attn, q, k, v, pos, ctx)

    if sources is not None:
        backend.attention = capture
    try:
        hidden = model(torch.cat(inputs), torch.cat(positions), AttentionContext.for_prompts(lengths))
    finally:
        if sources is not None:
            backend.attention = plain
    logits = model.compute_logits(hidden)
    tgt, code_mask = torch.cat(targets), torch.cat(is_code)
    n_chat = sum(len(c[0]) - 1 for c in chats)  # chat targets first, then the spans'
    chat_tgt, w = tgt[~code_mask], torch.cat(weights)
    ce = F.cross_entropy(logits[~code_mask], chat_tgt, ignore_index=-100, reduction="none")
    keep = chat_tgt != -100
    chat_loss = (ce[:n_chat] * w[:n_chat])[keep[:n_chat]].sum() / w[:n_chat][keep[:n_chat]].sum().clamp(min=1)
    code_loss = F.cross_entropy(logits[code_mask], tgt[code_mask]) if code is not None else None
    out = [chat_loss, code_loss]
    if spans is not None:
        out.append(ce[n_chat:][keep[n_chat:]].mean())
    if sources is not None:
        starts = [sum(lengths[:i]) for i in range(len(chats))]
        out.append(locate_loss(seen["q"], seen["k"], seen["scale"], starts, sources))
    return tuple(out)


@torch.no_grad()
def chat_eval_loss(model, batch: list[tuple[list[int], int]]) -> float:
    was = model.training
    model.eval()
    model.materialize_constants()  # eval mode reads cached residual-gate coefficients: the weights' own now
    loss, _ = packed_loss(model, batch, None)
    model.train(was)
    return float(loss)


# -- training ----------------------------------------------------------------------------


def make_optimizer(model, lr: float, weight_decay: float):
    """train_tiny.py's AdamW: β 0.9/0.95, eps 1e-8, weight decay on matrices only."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


# What a run is (where it starts, what it trains on) is fixed by its first session: --resume
# takes these from the saved state. A state saved before the flags existed is base + chat.
RUN_ARGS = {"init": ("bundled", "base"), "data": ("copy", "chat"), "copy_mix": (0.0, 0.0)}


def resolve_run_args(args, saved: dict | None) -> None:
    """Fill args.init/data/copy_mix: the defaults of a new run, or (`saved`: the state's args)
    the resumed run's own; an explicit flag that contradicts the saved run is refused."""
    for key, (new_default, old_default) in RUN_ARGS.items():
        given = getattr(args, key)
        if saved is None:
            setattr(args, key, new_default if given is None else given)
            continue
        value = saved.get(key, old_default)
        if given is not None and given != value:
            flag = "--" + key.replace("_", "-")
            raise SystemExit(f"{flag} {given} contradicts the run being resumed ({flag} {value})")
        setattr(args, key, value)


STOP = {"signal": None}  # set by SIGTERM / SIGINT: the loop saves and stops after the current step


def _request_stop(signum: int, _frame) -> None:
    STOP["signal"] = signum
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once, unsaved


def train(args) -> None:
    global COPY_WEIGHT, VALUE_WEIGHT, RESTATE_WEIGHT, VALUE_CALL_WEIGHT
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    state_path = run / "state.pt"
    st = torch.load(state_path, map_location="cpu", weights_only=False) if args.resume and state_path.exists() else None
    resolve_run_args(args, st["args"] if st else None)
    if args.init == "bundled":
        init_dir(run, fresh=st is None)
    print(f"init {args.init}, data {args.data}" + (f" (copy-mix {args.copy_mix})" if args.data == "copy" else ""))
    tok = chat_tokenizer(run, args.init)
    template = TEMPLATE.read_text()
    COPY_WEIGHT, VALUE_WEIGHT, RESTATE_WEIGHT = args.copy_weight, args.value_weight, args.restate_weight
    VALUE_CALL_WEIGHT = args.value_call_weight
    set_value_marks(tok)
    # The framing every output repeats (headers, ATEM tags) is not an argument copy.
    framing = (
        '<|start|>assistant to=user<|message|><atem:function_calls>\n<atem:invoke name="x">\n'
        '<atem:parameter name="x"></atem:parameter>\n</atem:invoke>\n</atem:function_calls> to=self'
    )
    _STRUCTURAL.update(tok.encode(framing, add_special_tokens=False).ids)
    model = initial_model(run, args.init, args.seed)
    if st is None and args.copy_circuit:
        set_copy_circuit(model)
    opt = make_optimizer(model, args.lr, args.weight_decay)
    step, history, sessions = 0, [], []
    if st is not None:
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        step, history, sessions = st["step"], st["history"], st["sessions"]
        print(f"resumed from step {step}", flush=True)
        del st
    if args.tie_space:
        print(f"tied {tie_space_pairs(model, tok)} space pairs", flush=True)
    train_stream, val_stream = code_streams(run, tok)
    blen = byte_lengths(tok)
    val_win = tt.eval_windows(val_stream, args.seq_len, args.val_windows)
    eval_chats = [encode_chat(c, tok, template) for c in heldout_convs(args.data, 16)]
    sessions = sessions + [{"start_step": step, "args": vars(args)}]
    elapsed_before = history[-1]["elapsed"] if history else 0.0
    if step == 0:
        bpb, _ = tt.bits_per_byte(model, val_win, blen)
        print(
            f"before: val {bpb:.4f} bits/byte ({args.val_windows} windows), held-out chat loss "
            f"{chat_eval_loss(model, eval_chats):.3f}",
            flush=True,
        )
    model.train()
    rec = tt.LoadRecorder(model)
    t_start = time.time()
    t_last, tok_since = time.time(), 0
    ema = None
    STOP["signal"] = None
    handlers = {s: signal.signal(s, _request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    first_step = step
    while step < args.steps:
        if args.session_steps and step - first_step >= args.session_steps:
            print(f"{args.session_steps} steps done this session; saving and stopping", flush=True)
            break
        if args.time_limit and time.time() - t_start > 60 * args.time_limit:
            print(f"time limit of {args.time_limit} min reached at step {step}; saving and stopping", flush=True)
            break
        if STOP["signal"] is not None:
            print(f"signal {STOP['signal']} at step {step}; saving and stopping", flush=True)
            break
        start = args.cosine_from if args.cosine_from is not None else 0
        lr = tt.lr_at(step - start, args.steps - start, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        convs: list[mcd.Conversation] = []
        chats = chat_batch(
            args.seed, step, args.chats, tok, template, args.max_len, args.data_version, args.data, args.copy_mix, convs
        )
        restated = [restate_values(c) for c in convs]
        if args.value_chats:
            chats += value_batch(args.seed, step, args.value_chats, tok, template)
            restated += [[] for _ in range(args.value_chats)]
        if args.restate_chats:
            more, more_values = restate_batch(args.seed, step, args.restate_chats, tok, template)
            chats, restated = chats + more, restated + more_values
        code = (
            tt.get_batch(train_stream, step, args.code_windows, args.seq_len, args.seed) if args.code_windows else None
        )
        spans = induction_batch(args.seed, step, args.induction, args.induction_vocab) if args.induction else None
        rec.reset()
        sources = None
        if args.locate_weight:
            sources = [
                value_sources(c[0], c[1], tok) + (restate_sources(c[0], c[1], tok, v) if args.locate_restate else [])
                for c, v in zip(chats, restated)
            ]
        chat_loss, code_loss, *extra = packed_loss(model, chats, code, spans, sources)
        span_loss = extra[:1] if spans else []
        loss = chat_loss + (args.code_weight * code_loss if code_loss is not None else 0.0)
        if span_loss:
            loss = loss + args.induction_weight * span_loss[0]
        if sources is not None:
            loss = loss + args.locate_weight * extra[-1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip))
        opt.step()
        tt.update_router_bias(model, rec, args.bias_rate)
        step += 1
        tok_since += sum(len(c[0]) - 1 for c in [*chats, *(spans or [])]) + (
            code.numel() - code.shape[0] if code is not None else 0
        )
        cl = float(chat_loss.detach())
        ema = cl if ema is None else 0.95 * ema + 0.05 * cl
        now = time.time()
        entry = {
            "step": step,
            "chat_loss": cl,
            "code_loss": float(code_loss.detach()) if code_loss is not None else None,
            "span_loss": float(span_loss[0].detach()) if span_loss else None,
            "locate_loss": float(extra[-1].detach()) if sources is not None else None,
            "lr": lr,
            "gnorm": gnorm,
            "elapsed": elapsed_before + now - t_start,
        }
        if step % args.log_every == 0 or step == args.steps:
            tps = tok_since / max(1e-9, now - t_last)
            entry["tok_s"] = tps
            msg = (
                f"step {step}: chat {cl:.3f} (ema {ema:.3f})"
                + (f" code {entry['code_loss']:.3f}" if code_loss is not None else "")
                + (f" span {entry['span_loss']:.3f}" if span_loss else "")
                + (f" locate {entry['locate_loss']:.3f}" if sources is not None else "")
                + f" lr {lr:.2e} "
                f"{tps:.0f} tok/s {entry['elapsed'] / 60:.1f} min"
            )
            if step % args.eval_every == 0 or step == args.steps:
                bpb, _ = tt.bits_per_byte(model, val_win, blen)
                entry.update(val_bpb=bpb, heldout_chat_loss=chat_eval_loss(model, eval_chats))
                loads = min(float((c.float() / c.sum()).min()) for c in rec.counts.values())
                msg += (
                    f" | val {bpb:.4f} bits/byte, held-out chat {entry['heldout_chat_loss']:.3f}, min load {loads:.3f}"
                )
            print(msg, flush=True)
            t_last, tok_since = time.time(), 0
        history.append(entry)
        if step % args.save_every == 0 or step == args.steps:
            tt.save_state(state_path, model, opt, step, history, args, sessions)
    tt.save_state(state_path, model, opt, step, history, args, sessions)
    for s, h in handlers.items():
        signal.signal(s, h)
    rec.remove()
    print(f"training done: {step} steps, this session {time.time() - t_start:.0f} s", flush=True)


# -- evaluation ----------------------------------------------------------------------------


def generate_all(llm, convs: list[mcd.Conversation], max_tokens: int):
    from musespark import SamplingParams
    from musespark.parsers import MuseOutputParser, tool_schemas_from_openai

    proc = llm.engine.input_processor
    prompts = [proc.render_chat(c.messages, tools=c.tools, chat_template_kwargs=c.kwargs) for c in convs]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, skip_special_tokens=False)
    outs = llm.generate(prompts, sp)
    results = []
    for c, o in zip(convs, outs):
        comp = o.outputs[0]
        parsed = MuseOutputParser(reasoning=True, tools=True, tool_names=tool_schemas_from_openai(c.tools)).parse(
            comp.text
        )
        results.append((comp, parsed))
    return results


def score_tool_call(c: mcd.Conversation, parsed) -> tuple[bool, bool]:
    """(right tool + valid arguments: a JSON object holding every required parameter of the
    tool's schema with a value of its type, ... and arguments equal to the expected ones)."""
    if not parsed.tool_calls:
        return False, False
    call = parsed.tool_calls[0]
    if call.name != c.expected["name"]:
        return False, False
    try:
        args = json.loads(call.arguments)
    except ValueError:
        return False, False
    schema = mcd.TOOLS[call.name]["function"]["parameters"]
    types = {"string": str, "integer": int, "number": (int, float), "boolean": bool}
    valid = (
        isinstance(args, dict)
        and all(
            k in args and isinstance(args[k], types.get(schema["properties"][k].get("type"), object))
            for k in schema.get("required", ())
        )
        and all(isinstance(v, types.get(schema["properties"].get(k, {}).get("type"), object)) for k, v in args.items())
    )
    return valid, valid and args == c.expected["arguments"]


def format_ok(c: mcd.Conversation, comp, parsed) -> bool:
    if not (comp.finish_reason == "stop" and comp.token_ids and comp.token_ids[-1] == EOT_ID):
        return False
    if not (parsed.reasoning or "").strip():
        return False
    if c.kind == "tool_call":
        return bool(parsed.tool_calls)
    return not parsed.tool_calls and bool((parsed.content or "").strip())


def chat_responses(llm, convs: list[tuple[list[dict], list[dict] | None, dict]], max_tokens: int) -> list:
    """Greedy replies to every (messages, tools, chat_template_kwargs) in one batch, each
    parsed as `LLM.chat` parses it (the server's Muse parsers): [(content, [(name, arguments
    JSON text)])]. LLM.chat itself takes one tool list for all its conversations."""
    from musespark import SamplingParams
    from musespark.engine.llm import _parse_muse

    proc = llm.engine.input_processor
    prompts = [proc.render_chat(m, tools=t, chat_template_kwargs=k) for m, t, k in convs]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    replies = []
    for (_, tools, _), o in zip(convs, outs):
        _parse_muse([o], proc.tokenizer, tools)
        parsed = o.outputs[0].parsed
        replies.append((parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]))
    return replies


def evaluate_copy(llm, max_tokens: int, limit: int | None = None) -> dict:
    """benchmarks/tool_eval.py's evaluation (its tasks: muse_copy_data.eval_tasks(EVAL_SEED),
    values never in training; its scoring), run in-process: every first turn and every tool
    task's follow-up (the expected call and the tool's result appended) in one greedy batch."""
    tasks = tool_eval.limit_tasks(mcp.eval_tasks(EVAL_SEED), limit)
    tool_tasks = [t for t in tasks if t["kind"] == "tool"]
    convs = [(t["messages"], t["tools"], t["chat_template_kwargs"]) for t in tasks]
    convs += [(t["messages"] + t["followup"], t["tools"], t["chat_template_kwargs"]) for t in tool_tasks]
    t0 = time.time()
    replies = chat_responses(llm, convs, max_tokens)
    first = {t["id"]: r for t, r in zip(tasks, replies)}
    followup = {t["id"]: r[0] for t, r in zip(tool_tasks, replies[len(tasks) :])}
    result = tool_eval.score_responses(tasks, first, followup)
    result["seconds"] = round(time.time() - t0, 1)
    return result


def evaluate_chat(llm, n_tool: int, n_conv: int, max_tokens: int) -> dict:
    t0 = time.time()
    tasks = mcd.tool_tasks(EVAL_SEED, n_tool)
    convs = mcd.heldout(EVAL_SEED, n_conv)
    res_t = generate_all(llm, tasks, max_tokens)
    res_c = generate_all(llm, convs, max_tokens)
    gen_s = time.time() - t0

    def frac(xs):
        return sum(xs) / max(1, len(xs))

    tool = {"n": len(tasks), "valid": [], "exact": [], "by_tool": {}, "seen": [], "unseen": []}
    examples = []
    for c, (comp, parsed) in zip(tasks, res_t):
        valid, exact = score_tool_call(c, parsed)
        tool["valid"].append(valid), tool["exact"].append(exact)
        tool["by_tool"].setdefault(c.expected["name"], []).append(exact)
        if c.expected["name"] != "calculator":
            tool["unseen" if c.unseen else "seen"].append(exact)
        if not exact and len(examples) < 6:
            examples.append({"user": c.messages[-1]["content"], "expected": c.expected, "output": comp.text})
    kinds: dict[str, list[bool]] = {}
    value_hits = []
    for c, (comp, parsed) in zip(convs, res_c):
        kinds.setdefault(c.kind, []).append(format_ok(c, comp, parsed))
        if c.kind == "tool_result":
            value_hits.append(c.expected["value"] in (parsed.content or ""))
    sample = {}
    for c, (comp, parsed) in zip(convs, res_c):
        if c.kind not in sample:
            sample[c.kind] = {
                "user": next(m["content"] for m in reversed(c.messages) if m["role"] == "user"),
                "last": c.messages[-1]["role"],
                "output": comp.text,
                "reasoning": parsed.reasoning,
                "content": parsed.content,
                "tool_calls": [(t.name, t.arguments) for t in parsed.tool_calls],
            }
    first = res_t[0]
    sample["tool_call"] = {
        "user": tasks[0].messages[-1]["content"],
        "output": first[0].text,
        "reasoning": first[1].reasoning,
        "content": first[1].content,
        "tool_calls": [(t.name, t.arguments) for t in first[1].tool_calls],
    }
    return {
        "tool_tasks": len(tasks),
        "tool_exact": frac(tool["exact"]),
        "tool_valid": frac(tool["valid"]),
        "tool_exact_by_tool": {k: [sum(v), len(v)] for k, v in tool["by_tool"].items()},
        "tool_exact_seen_entities": [sum(tool["seen"]), len(tool["seen"])],
        "tool_exact_unseen_entities": [sum(tool["unseen"]), len(tool["unseen"])],
        "format_by_kind": {k: [sum(v), len(v)] for k, v in kinds.items()},
        "format_all": frac([x for v in kinds.values() for x in v]),
        "format_n": sum(len(v) for v in kinds.values()),
        "final_answer_has_value": [sum(value_hits), len(value_hits)],
        "tool_failures": examples,
        "samples": sample,
        "generation_seconds": gen_s,
    }


def export(args) -> None:
    from musespark import LLM, load_model
    from musespark.checkpoint.writer import save_checkpoint

    torch.set_num_threads(args.threads)
    run, out = Path(args.run_dir), Path(args.out)
    st = torch.load(run / "state.pt", map_location="cpu", weights_only=False)
    init = st["sessions"][0]["args"].get("init", "base")
    tok = chat_tokenizer(run, init)
    cfg = run_config(run, init)
    model = MuseSparkForCausalLM(cfg)
    model.load_state_dict(st["model"])
    base_readme = (source_dir(run, init) / "README.md").read_text()
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model.state_dict(), cfg, out, dtype=torch.bfloat16, nested=True)
    tok.save(str(out / "tokenizer.json"))
    tcfg = tc.tokenizer_config(cfg.max_position_embeddings)
    tcfg.pop("chat_template")
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    shutil.copyfile(TEMPLATE, out / "chat_template.jinja")
    gen_cfg = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(EOS_IDS),
        "pad_token_id": 1,
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.95,
        "max_new_tokens": 256,
    }
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    if args.files_only:
        print(f"wrote {out} (files only)")
        return

    shipped = load_model(out, dtype="float32")
    blen = byte_lengths(tok)
    train_stream, val_stream = code_streams(run, tok)
    val_win = tt.eval_windows(val_stream, args.seq_len)
    rec = tt.LoadRecorder(shipped)
    t0 = time.time()
    val_bpb, val_npt = tt.bits_per_byte(shipped, val_win, blen)
    loads = {i: (rec.counts[i].float() / rec.counts[i].sum()).tolist() for i in rec.layers}
    rec.remove()
    print(f"val bits/byte {val_bpb:.4f} ({time.time() - t0:.0f} s)", flush=True)
    del shipped
    llm = LLM(model=str(out), dtype="float32", seed=0)
    chat = evaluate_chat(llm, args.eval_tool_tasks, args.eval_conversations, args.eval_max_tokens)
    print(json.dumps({k: v for k, v in chat.items() if k not in ("samples", "tool_failures")}, indent=1), flush=True)
    copy = evaluate_copy(llm, args.eval_max_tokens, args.eval_copy_limit)
    print(json.dumps(copy), flush=True)
    hist = st["history"]
    last = hist[-50:]
    results = {
        "val_bits_per_byte": val_bpb,
        "val_nats_per_token": val_npt,
        "val_tokens_scored": int(val_win[:, 1:].numel()),
        "val_bytes_scored": int(blen[val_win[:, 1:]].sum()),
        "expert_load": {str(k): v for k, v in loads.items()},
        "min_expert_load": min(min(v) for v in loads.values()),
        "steps": st["step"],
        "chat_loss_last50": sum(h["chat_loss"] for h in last) / len(last),
        "code_loss_last50": sum(h["code_loss"] for h in last if h["code_loss"] is not None) / len(last),
        "wall_minutes": hist[-1]["elapsed"] / 60,
        "chat": chat,
        "copy": copy,
    }
    (run / "results.json").write_text(json.dumps(results, indent=2))
    write_card(out, args, st, results, base_readme, cfg, init)


def _cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _section(md: str, title: str) -> str:
    """A `## title` section of the base card (without its heading), headings demoted one level."""
    lines, out, on = md.splitlines(), [], False
    for ln in lines:
        if ln.startswith("## "):
            on = ln[3:].strip() == title
            continue
        if on:
            out.append("#" + ln if ln.startswith("### ") else ln)
    return "\n".join(out).strip()


# The training flags a session's command line records, in order; a flag its saved args lack
# (a state older than the flag) is left out, except the run's --init and --data (RUN_ARGS'
# values for such a state), which every new first command needs.
CARD_FLAGS = ("init", "data", "copy_mix", "steps", "chats", "code_windows", "code_weight", "max_len", "lr")
CARD_FLAGS += (
    "copy_weight",
    "value_weight",
    "value_chats",
    "value_call_weight",
    "locate_weight",
    "locate_restate",
    "restate_chats",
    "restate_weight",
    "cosine_from",
    "tie_space",
    "induction",
    "induction_weight",
    "induction_vocab",
    "copy_circuit",
    "warmup",
    "bias_rate",
)
CARD_FLAGS += ("seed", "threads", "data_version")


def session_command(sa: dict, resume: bool) -> str:
    """The command line that runs a session with these saved args (vars(args))."""
    sa = {**{k: old for k, (_, old) in RUN_ARGS.items()}, **sa}
    flags = [
        f"--{k.replace('_', '-')}" + ("" if isinstance(sa[k], bool) else f" {sa[k]}")
        for k in CARD_FLAGS
        if sa.get(k) is not None and sa[k] is not False
    ]
    if sa.get("data") == "chat" or not sa.get("copy_mix"):
        flags = [f for f in flags if not f.startswith("--copy-mix")]
    if sa.get("time_limit"):
        flags.append(f"--time-limit {sa['time_limit']:g}")
    if sa.get("session_steps"):
        flags.append(f"--session-steps {sa['session_steps']}")
    return " ".join([".venv/bin/python tools/finetune_muse.py", *flags] + ["--resume"] * resume + ["--no-export"])


def earlier_stages(card: str) -> str:
    """The stages of the card of the checkpoint a `bundled` run starts from: its text from
    `## Pre-training` up to `## Results`, with its fine-tuning commands completed with the
    --init/--data its run used (a state without them: base + chat) and its export line left
    out (this run exports this directory)."""
    lines = card.split("\n")
    start = next(i for i, ln in enumerate(lines) if ln.startswith("## Pre-training"))
    end = next(i for i, ln in enumerate(lines) if ln.startswith("## Results"))
    out = []
    for ln in lines[start:end]:
        if "tools/finetune_muse.py --" in ln:
            if "--export-only" in ln:
                continue
            if " --data " not in ln:
                ln = ln.replace("finetune_muse.py --", "finetune_muse.py --init base --data chat --", 1)
        out.append(ln)
    return "\n".join(out).strip()


def _before_bpb(card: str) -> float | None:
    """The shipped bits/byte that a card records (None when it records none)."""
    m = re.search(r"^\| validation bits/byte on held-out stdlib code.*?\| \*\*([0-9.]+)\*\*", card, re.M)
    return float(m.group(1)) if m else None


TARGETS = (  # (what, tool_eval key, the least share the model must reach, %)
    ("right tool", "right_tool_pct", 95),
    ("exact arguments", "exact_arguments_pct", 85),
    ("answer restates the tool's result", "restate_pct", 75),
    ("plain chat answered without a call", "plain_no_call_pct", 90),
    ("no call and a refusal when the needed tool is not offered", "no_tool_refusal_pct", 80),
)


def _rate(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}%"


def copy_recipe(sessions: list[dict]) -> str:
    """The card's sentence on how the run taught copying: the mechanisms its sessions used."""
    used = lambda k: any(sa.get(k) for sa in sessions)  # noqa: E731
    parts = [
        (
            used("copy_circuit"),
            "a previous-token head and an induction head wired into layers 0 and 1 before step 0 (`--copy-circuit`)",
        ),
        (used("induction"), "repeated spans of random tokens beside the chats (`--induction`)"),
        (used("tie_space"), 'the pairs " X" / "X" tied in that circuit\'s match (`--tie-space`)'),
        (
            any(sa.get("value_weight", 1.0) != 1.0 or sa.get("value_chats") for sa in sessions),
            "the call's argument values weighted up, and short tool-call examples scored on their values only "
            "(`--value-weight`, `--value-chats`)",
        ),
        (
            used("value_call_weight"),
            "the rest of those calls weighted too, so that an optional parameter such as `unit` is written "
            "(`--value-call-weight`)",
        ),
        (
            used("locate_weight"),
            "a loss on the attention of layer 5's last head from each value's `>` to where the user wrote it "
            "(`--locate-weight`)",
        ),
        (
            used("restate_chats"),
            "short tool-result examples beside the chats, the values the answer restates weighted up "
            "(`--restate-chats`, `--restate-weight`)",
        ),
        (
            used("locate_restate"),
            "the same loss from the answer's position before each value it restates to that value in the tool's "
            "result or the call (`--locate-restate`)",
        ),
    ]
    chosen = [text for on, text in parts if on]
    if not chosen:
        return ""
    return (
        "How it learned to copy (the flags in the commands above; `tools/finetune_muse.py` says what each "
        "changed): " + "; ".join(chosen) + "."
    )


# What a copy-trained model of this size gets wrong, seen on the held-out tasks and the demo
# (AMD EPYC, 2026-12-07); the card of every --init bundled export carries it.
KNOWN_LIMITS = """What it cannot do (seen on held-out tasks and in the demo):

- Optional parameters: "in fahrenheit" gets `"unit": "fahrenheit"`, but a capitalised "in
  Fahrenheit" or "in Celsius" still gets a call with the city alone.
- Runs of one token: a value whose digits or letters repeat ("444" for 37 * 12) is copied until
  `max_tokens` (the copy finds the same token again and again). The same happens when a forced
  `tool_choice` leaves it no value to copy ("Hello!" forced to `read_file`).
- Long expressions: where a piece repeats (") - ", "(3 + ") the copy jumps back and loops, and
  a number that starts with a repeated digit loses it ("767627" → "7627"). Most calculator
  misses are these.
- File names with no directory ("Read loul.log") and names unlike its training paths ("Open
  Makefile") often get a wrong path or no call. Real city names made of common tokens
  ("Athens") can come out mangled.
- Its copy circuit makes it more sensitive to rounding than a model without one: an fp8 KV cache
  moves its logits by ~5% of the largest (the pre-copy checkpoint: ~2%), mostly through layer 0's
  previous-token head (`tests/engine/test_fp8_kv_cache.py`)."""


def copy_stage_title(base_md: str) -> str:
    """The card heading of a copy run that starts from the checkpoint whose card is `base_md`:
    "Copy fine-tuning" first, then "..., continued", then "..., stage N" (N counts them all)."""
    before = base_md.count("\n## Copy fine-tuning")
    if before == 0:
        return "Copy fine-tuning"
    if before == 1:
        return "Copy fine-tuning, continued"
    return f"Copy fine-tuning, stage {before + 1}"


def write_card(out: Path, args, st: dict, r: dict, base_md: str, cfg, init: str = "base") -> None:
    """The model card: architecture, the recipe (every stage's commands, this run's sessions
    included, its data and wall time), and the held-out scores of the exported weights."""
    ch, cp = r["chat"], r["copy"]
    sessions = st["sessions"]
    total_params = sum(p.numel() for p in MuseSparkForCausalLM(cfg).parameters())
    ends = [x["start_step"] for x in sessions[1:]] + [st["step"]]
    cmd = "\n".join(
        f"# steps {x['start_step']}-{e}\n" + session_command(x["args"], x["start_step"] > 0)
        for x, e in zip(sessions, ends)
    )
    cmd += "\n.venv/bin/python tools/finetune_muse.py --export-only   # writes this directory + this card"
    a = {**{k: old for k, (_, old) in RUN_ARGS.items()}, **sessions[-1]["args"]}
    E = cfg.num_local_experts
    loads = r["expert_load"]
    load_rows = "\n".join(
        f"| {i} | " + " | ".join(f"{100 * x:.1f}" for x in v) + f" | {100 * min(v):.1f} |" for i, v in loads.items()
    )
    fb = ch["format_by_kind"]

    def pct(pair):
        return f"{pair[0]}/{pair[1]} ({100 * pair[0] / max(1, pair[1]):.0f}%)"

    by_tool = ", ".join(f"`{k}` {pct(v)}" for k, v in ch["tool_exact_by_tool"].items())
    tps = [h["tok_s"] for h in st["history"] if "tok_s" in h]
    samples = "\n\n".join(
        f"`{kind}` — last user message: {json.dumps(s['user'])}"
        + (" (then the tool's result)" if s.get("last") == "tool" else "")
        + f"\n\n```\n{s['output']}\n```\n\n"
        f"parsed: reasoning {json.dumps(s['reasoning'])}, content {json.dumps(s['content'])}, "
        f"tool_calls {json.dumps(s['tool_calls'])}"
        for kind, s in ch["samples"].items()
    )
    failures = (
        "\n".join(
            f"- {json.dumps(f['user'])} expected `{f['expected']['name']}` "
            f"{json.dumps(f['expected']['arguments'])}, got `{slash_escaped_json(f['output'][:300])}`"
            for f in ch["tool_failures"]
        )
        or "- none"
    )
    kw = {k: round(100 * w) for k, w in mcd.KIND_WEIGHTS}
    missed = [what for what, key, least in TARGETS if cp[key] is None or cp[key] < least]
    status = (
        "**Status** on held-out tasks whose values never occur in training (below): "
        + ", ".join(f"{what} {_rate(cp[key])} (target ≥ {least}%)" for what, key, least in TARGETS)
        + (". Not met: " + ", ".join(missed) + "." if missed else ". Every target is met.")
        + "\n\n"
        + (KNOWN_LIMITS + "\n\n" if init == "bundled" else "")
    )
    copy_by_tool = ", ".join(f"`{k}` {pct(v)}" for k, v in cp["exact_arguments_by_tool"].items())
    before_bpb = BASE_VAL_BPB if init == "base" else _before_bpb(base_md)
    before = "" if before_bpb is None else f" (before fine-tuning: {before_bpb:.3f})"
    # a copy run that starts from a copy-trained checkpoint continues it: same data, new optimizer
    continued = init == "bundled" and "\n## Copy fine-tuning" in base_md
    if init == "bundled":
        title = copy_stage_title(base_md)
        start = (
            f"Starts from the bundled checkpoint the stages above made (vocab {cfg.vocab_size}, the Muse "
            "markers already in its tokenizer), as it was when this run began (copied to the run directory)"
            + (", with a new optimizer state and step count." if continued else ".")
        )
    else:
        title = "Chat fine-tuning"
        start = (
            "Conversion: the four markers were added to the tokenizer as special tokens; `embed_tokens` and\n"
            "`lm_head` grew by four rows (old rows copied; new rows = mean of the old rows + seeded noise of 0.1 ×\n"
            "the per-dimension std)."
        )
    if a["data"] == "copy" and continued:
        data = "Data: the stage above's seeded conversations from `tools/muse_copy_data.py`, with its held-out values."
    elif a["data"] == "copy":
        data = (
            "Data: seeded conversations from `tools/muse_copy_data.py` that can only be solved by copying:\n"
            "made-up place names, random numbers and expressions, random paths of made-up words, and tool\n"
            "results with random values (weather, the demo calculator's own result, lines of a file) that the\n"
            "answer must restate; earlier turns with other values; a tool that is not offered → say so.\n"
            f"Kinds: first-turn tool call ({kw['tool_call']}%), answer from a tool result ({kw['tool_result']}%),\n"
            f"plain chat ({kw['plain']}%, a third of it copying a name or a phrase), a needed tool that is not\n"
            f"offered ({kw['no_tool']}%). Rendered by musespark's own chat renderer (`musespark.engine.chat`)\n"
            "with this `chat_template.jinja`; the assistant side is `tools/muse_chat_data.py`'s (reasoning\n"
            f"sentence per tool and strength, one answer pattern per tool). A value whose words hash into\n"
            f"{mcp.HOLD_OUT_PERCENT}% is held out: no held-out value occurs in training (tests/protocol/test_copy_data.py)."
            + (
                f" A share {a['copy_mix']} of each step's conversations comes from `tools/muse_chat_data.py`."
                if a["copy_mix"]
                else ""
            )
        )
    else:
        data = f"""Data: seeded synthetic conversations from `tools/muse_chat_data.py`
(OpenAI `messages` + `tools`), rendered by musespark's own chat renderer (`musespark.engine.chat`,
the path the server takes) with this `chat_template.jinja`, a varied fixed `current_date` and
`reasoning_strength` low/medium/high. Tools: `get_weather(city, unit?)`, `calculator(expression)`,
`read_file(path)`; each conversation offers a random subset in random order (sometimes none).
Kinds: first-turn tool call ({kw["tool_call"]}%), answer from a tool result ({kw["tool_result"]}%), plain
chat ({kw["plain"]}%), a needed tool that is not offered → say so ({kw["no_tool"]}%); 30% have earlier turns
(plain or a whole tool round trip) and 20% a client system message. User phrasings vary; the
assistant's reasoning is one fixed sentence per (tool, reasoning strength) naming the intent, and
answers follow one pattern per tool that copies the tool result's values. {100 - mcd.HOLD_OUT_PERCENT}% of cities and file paths are used in
training; the other {mcd.HOLD_OUT_PERCENT}% (by a hash of the value) are held out for evaluation."""
    if a["data"] == "copy" and (how := copy_recipe([x["args"] for x in st["sessions"]])):
        data += "\n\n" + how
    finetune = f"""## {title} (tools/finetune_muse.py)

```
{cmd}
```

{start}

{data}

Each step packs {a["chats"]} conversations (loss only on the assistant's output after the final
`<|start|>assistant`, through `<|eot|>`) and {a["code_windows"]} stdlib training windows of
{a["seq_len"]} tokens (full loss, weight {a["code_weight"]}) into one varlen forward: fp32,
AdamW (β 0.9/0.95, weight decay {a["weight_decay"]} on matrices), peak lr {a["lr"]}, {a["warmup"]}
warmup steps then cosine to 10%, grad clip {a["clip"]}, {st["step"]} steps, router-bias balancing
as in pre-training (rate {a["bias_rate"]}). Data order is a pure function of (seed, step).
Final losses (mean of the last 50 steps): chat {r["chat_loss_last50"]:.3f}, code {r["code_loss_last50"]:.3f} nats/token.

Wall time: {r["wall_minutes"]:.1f} min in {len(sessions)} session(s) with {a["threads"]} torch thread(s) on a 2-core CPU shared with other work ({_cpu_model()}), ~{sum(tps) / max(1, len(tps)):.0f} tokens/s."""
    if init == "bundled":
        stages = earlier_stages(base_md) + "\n\n" + finetune
    else:
        stages = f"""## Pre-training (tools/train_tiny.py)

### Corpus

{_section(base_md, "Corpus")}

### Training

{_section(base_md, "Training")}

{finetune}"""
    readme = (
        f"""# musespark-tiny

A tiny Muse Spark 1x text decoder, bundled with `musespark` as its default/demo model. It was
pre-trained from scratch on the Python standard library (`tools/train_tiny.py`) and then
fine-tuned (`tools/finetune_muse.py`) to speak the Muse chat protocol: reasoning to `self`,
answers to `user`, tool calls in ATEM to a tool recipient, turns ended by `<|eot|>`
(docs/muse_chat.md §1-§3). It exercises every feature of the architecture (dense + sparse MoE
layers, GQA, QK-norm, output gate, sliding + full attention, RoPE + NoPE layers, residual
gates, soft-capped logits, router bias). It is a demo, not a useful assistant: it knows three
synthetic tools, copies the values a question or a tool's result gives it (not every time: the
scores below), and writes Python-looking text.

Files: `config.json` (nested released form), `model.safetensors` (bfloat16; residual gates,
router weights and router bias in float32), `tokenizer.json`, `tokenizer_config.json`,
`chat_template.jinja` (the Muse template, byte-identical to `tests/data/muse_chat_template.jinja`),
`generation_config.json`. Loads with `musespark.load_model("src/musespark/models/musespark-tiny")`
and with `transformers==5.23.0` `MuseSparkForConditionalGeneration.from_pretrained`.

## Model

| | |
|---|---|
| vocab | {cfg.vocab_size} (byte-level BPE 4096 + 4 Muse markers) |
| hidden / layers | {cfg.hidden_size} / {cfg.num_hidden_layers} |
| attention | {cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} KV heads, head_dim {cfg.head_dim} |
| layer_types | {", ".join(cfg.layer_types)} (sliding_window {cfg.sliding_window}) |
| layer_rope_theta | {", ".join(str(t) for t in cfg.layer_rope_theta)} (0 = NoPE) |
| mlp_layer_types | {", ".join(cfg.mlp_layer_types)} |
| dense SwiGLU | intermediate {cfg.intermediate_size} |
| MoE | {E} experts, top-{cfg.num_experts_per_tok}, moe_hidden {cfg.moe_hidden_size}, moe_intermediate {cfg.moe_intermediate_size} |
| max_position_embeddings | {cfg.max_position_embeddings} (pre-trained on 256-token windows, fine-tuned on chats up to {a["max_len"]} tokens) |
| bos / eos | 0 `<|begin_of_text|>` / 1 `<|end_of_text|>` and {EOT_ID} `<|eot|>` |
| parameters | {total_params:,} total |

## Tokenizer and chat format

Byte-level BPE trained with `tokenizers` on the pre-training split, vocab 4096, ByteLevel
pre-tokenizer (add_prefix_space=False) and ByteLevel decoder (decoding round-trips text exactly).
Special tokens: `<|begin_of_text|>`, `<|end_of_text|>`, `<|start_header_id|>`, `<|end_header_id|>`,
`<|eot_id|>` (ids 0–4, from pre-training) and the Muse markers `<|start|>` 4096, `<|message|>` 4097,
`<|eom|>` 4098, `<|eot|>` 4099 (added for chat; each one token). EOS ids are `[1, 4099]` in
`config.json` and `generation_config.json`; `<|eom|>` (end of one message, the turn goes on) is not
a stop token. No BOS is added automatically: the chat template writes `<|begin_of_text|>`; for raw
completion prepend it yourself.

`chat_template.jinja` renders docs/muse_chat.md §2.1-2.2: a system block (default or the client's) with
`Reasoning strength: X.` (kwarg `reasoning_strength`, default `high`), the tool definitions and
`# Valid recipients`, then `<|start|>ROLE<|message|>...<|eot|>` messages, and the generation prompt
`<|start|>assistant`. The model then writes e.g.

```
 to=self<|message|>The user wants the weather in Paris. I'll call get_weather.<|eom|><|start|>assistant to=get_weather<|message|><atem:function_calls>
<atem:invoke name="get_weather">
<atem:parameter name="city">Paris</atem:parameter>
</atem:invoke>
</atem:function_calls><|eot|>
```

Serve it with `--reasoning-parser muse --enable-auto-tool-choice --tool-call-parser muse` to get
OpenAI `reasoning`, `content` and `tool_calls`.

{stages}

## Results

{status}Measured on the shipped bfloat16 weights computed in float32 (the dtype it was trained in:
`LLM(..., dtype="float32")`, or `musespark serve --dtype float32`, which gives the same replies),
greedy (temperature 0), in-process through musespark's `LLM` (prompts rendered by
`InputProcessor.render_chat`, the path the server takes). Computed in bfloat16, the server's
default for this checkpoint, a few replies differ: `benchmarks/tool_eval.py` measures that.

Copy tasks: `tools/muse_copy_data.py` `eval_tasks({EVAL_SEED})`, whose values never occur in training,
scored by `benchmarks/tool_eval.py`'s functions (that script runs the same tasks through
`musespark serve` and the `openai` client); replies parsed as `LLM.chat` parses them, up to
{args.eval_max_tokens} tokens.

| | |
|---|---|
| tool tasks ({cp["tool_tasks"]}): the first call names the right tool | **{_rate(cp["right_tool_pct"])}** |
| tool tasks: its arguments, JSON-parsed, equal the expected (an expression may differ in whitespace) | **{_rate(cp["exact_arguments_pct"])}** |
| exact arguments by tool | {copy_by_tool} |
| the expected call and the tool's result sent back: the answer restates the result's key value | **{_rate(cp["restate_pct"])}** |
| plain chat ({cp["plain_tasks"]}): an answer with no call | **{_rate(cp["plain_no_call_pct"])}** |
| the needed tool not offered ({cp["no_tool_tasks"]}): no call, and the answer says it cannot | **{_rate(cp["no_tool_refusal_pct"])}** |

Earlier chat tasks (`tools/muse_chat_data.py`): generation through musespark's engine (`LLM(...).generate` on prompts from `InputProcessor.render_chat`, up to
{args.eval_max_tokens} tokens, `skip_special_tokens=False`), parsed with
`MuseOutputParser(reasoning=True, tools=True, tool_names=tool_schemas_from_openai(tools))`, on
held-out conversations (seed {EVAL_SEED}; training uses seed {a["seed"]}).

| | |
|---|---|
| tool tasks ({ch["tool_tasks"]} first-turn calls): right tool, arguments valid JSON and equal to the expected | **{100 * ch["tool_exact"]:.0f}%** |
| tool tasks: right tool + valid arguments (JSON object with every required parameter, of its schema type) | {100 * ch["tool_valid"]:.0f}% |
| tool tasks by tool (exact) | {by_tool} |
| tool tasks, `get_weather`/`read_file` with entities seen in training / held out | {pct(ch["tool_exact_seen_entities"])} / {pct(ch["tool_exact_unseen_entities"])} |
| format ({ch["format_n"]} held-out conversations of every kind): non-empty reasoning, ends with `<|eot|>`, a tool call or a non-empty answer as the kind expects | **{100 * ch["format_all"]:.0f}%** |
| format by kind | {", ".join(f"{k} {pct(v)}" for k, v in fb.items())} |
| answer after a tool result contains the result's value | {pct(ch["final_answer_has_value"])} |
| validation bits/byte on held-out stdlib code{before} | **{r["val_bits_per_byte"]:.3f}** ({r["val_nats_per_token"]:.3f} nats/token; {r["val_tokens_scored"]:,} tokens, {r["val_bytes_scored"]:,} bytes) |

Bits per byte as in train_tiny.py: total nats / ln 2 / total UTF-8 bytes, non-overlapping
{a["seq_len"]}-token windows of the validation split.

Tool-task failures (first {len(ch["tool_failures"])}):

{failures}

### Expert load on the validation split (% of routed tokens)

| layer | """
        + " | ".join(f"e{e}" for e in range(E))
        + """ | min |
|---|"""
        + "---|" * (E + 1)
        + f"""
{load_rows}

Minimum over all sparse layers: {100 * r["min_expert_load"]:.1f}% (uniform would be {100 / E:.1f}%).

### Greedy samples (held-out conversations)

{samples}

## Generation defaults

`generation_config.json`: sampling with temperature 0.7, top_p 0.95, max_new_tokens 256,
eos [1, {EOT_ID}].
"""
    )
    (out / "README.md").write_text(readme)
    print(f"wrote {out / 'README.md'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--init",
        choices=("base", "bundled"),
        default=None,
        help="start from: base = the pre-chat checkpoint grown by the Muse markers (runs/muse/base); "
        "bundled = the shipped chat checkpoint (default for a new run; --resume: the run's own)",
    )
    p.add_argument(
        "--data",
        choices=("copy", "chat"),
        default=None,
        help="conversations: copy = tools/muse_copy_data.py, chat = tools/muse_chat_data.py "
        "(default for a new run: copy; --resume: the run's own)",
    )
    p.add_argument(
        "--copy-mix",
        type=float,
        default=None,
        help="with --data copy: the share of each step's conversations drawn from muse_chat_data (default 0)",
    )
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--chats", type=int, default=3, help="conversations per step")
    p.add_argument("--code-windows", type=int, default=2, help="stdlib windows per step")
    p.add_argument("--code-weight", type=float, default=1.0)
    p.add_argument(
        "--induction", type=int, default=0, help="copy spans per step (A + B + A of random tokens, scored on the 2nd A)"
    )
    p.add_argument("--induction-weight", type=float, default=1.0)
    p.add_argument("--induction-vocab", type=int, default=0, help="copy spans draw from this many ids (0: all)")
    p.add_argument(
        "--copy-circuit",
        action="store_true",
        help="a new run: wire a previous-token head (layer 0) and an induction head (layer 1) before step 0",
    )
    p.add_argument("--seq-len", type=int, default=256, help="code window length")
    p.add_argument("--max-len", type=int, default=1536, help="longest conversation (tokens); longer ones are skipped")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--copy-weight",
        type=float,
        default=1.0,
        help="loss weight of output tokens that repeat the prompt's last message (argument values)",
    )
    p.add_argument(
        "--value-weight",
        type=float,
        default=1.0,
        help="loss weight of a tool call's argument values (and the short --value-chats examples)",
    )
    p.add_argument(
        "--value-chats",
        type=int,
        default=0,
        help="short tool-call examples per step (the last user message onward), scored on the values only",
    )
    p.add_argument(
        "--value-call-weight",
        type=float,
        default=0.0,
        help="weight of a --value-chats call's other tokens from its first value on (0: values only)",
    )
    p.add_argument(
        "--locate-weight",
        type=float,
        default=0.0,
        help="weight of the loss that teaches layer 5's last head to attend from a value's `>` to where the user wrote it",
    )
    p.add_argument(
        "--locate-restate",
        action="store_true",
        help="with --locate-weight: also from the answer's position before each restated value to that value "
        "in the tool's result or the call",
    )
    p.add_argument(
        "--restate-chats",
        type=int,
        default=0,
        help="short tool-result examples per step (the last user message onward, then the answer)",
    )
    p.add_argument(
        "--restate-weight",
        type=float,
        default=1.0,
        help="loss weight of the values a --restate-chats answer restates (the temperature, the result, ...)",
    )
    p.add_argument(
        "--cosine-from",
        type=int,
        default=None,
        help="restart the learning-rate schedule (warmup, then cosine to --steps) at this step",
    )
    p.add_argument(
        "--tie-space",
        action="store_true",
        help="at the start of this session: tie ' X' and 'X' in the copy circuit's match (tie_space_pairs)",
    )
    p.add_argument(
        "--data-version",
        type=int,
        default=mcd.DATA_VERSION,
        help="reasoning templates of tools/muse_chat_data.py (2 or 3)",
    )
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--time-limit", type=float, default=0.0, help="minutes; stop early (and save) past it")
    p.add_argument("--session-steps", type=int, default=0, help="stop (and save) after this many steps")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--val-windows", type=int, default=32)
    p.add_argument("--save-every", type=int, default=25, help="steps between checkpoints (~1-2 min)")
    p.add_argument("--eval-tool-tasks", type=int, default=100)
    p.add_argument("--eval-conversations", type=int, default=100)
    p.add_argument("--eval-max-tokens", type=int, default=200)
    p.add_argument(
        "--eval-copy-limit", type=int, default=None, help="export: at most N held-out copy tool tasks (default all)"
    )
    p.add_argument("--run-dir", default=str(ROOT / "runs" / "muse"))
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--resume", action="store_true")
    p.add_argument("--no-export", action="store_true")
    p.add_argument("--export-only", action="store_true")
    p.add_argument("--files-only", action="store_true", help="export: write the files, skip evaluation and card")
    args = p.parse_args(argv)
    if args.copy_mix is not None and not 0.0 <= args.copy_mix <= 1.0:
        p.error("--copy-mix must be within [0, 1]")
    return args


def main() -> None:
    args = parse_args()
    if not args.export_only:
        train(args)
    if not args.no_export:
        export(args)


if __name__ == "__main__":
    main()
