"""tools/finetune_muse.py on the copy data from the shipped model: the start is the shipped
weights exactly and stays what the run began from, the data order is a pure function of
(seed, step), a run stopped and resumed matches one that never stopped, the recorded
commands run the same sessions, and the export's copy evaluation scores what `LLM.chat`
would answer."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import finetune_muse as fm  # noqa: E402

from musespark.checkpoint.names import to_relative  # noqa: E402
from musespark.checkpoint.safetensors_file import SafetensorsFile  # noqa: E402


@pytest.fixture()
def shipped(tmp_path, monkeypatch) -> Path:
    """A copy of the shipped checkpoint standing in for src/'s, so a test may overwrite it."""
    out = tmp_path / "shipped"
    shutil.copytree(fm.OUT, out)
    monkeypatch.setattr(fm, "OUT", out)
    return out


def test_bundled_init_is_the_shipped_file_widened_to_fp32(tmp_path):
    model = fm.bundled_model(tmp_path / "run")
    state = model.state_dict()
    seen = set()
    with SafetensorsFile(fm.OUT / "model.safetensors") as st:
        for disk_name in st.entries:
            name = to_relative(disk_name)
            if name is None:
                continue
            stored = st.read(disk_name, None)
            assert state[name].dtype == torch.float32
            assert torch.equal(state[name], stored.float()), name
            seen.add(name)
    assert {n for n, _ in model.named_parameters()} <= seen
    assert all(p.requires_grad for p in model.parameters())


def test_the_start_is_copied_once_and_a_later_export_does_not_move_it(tmp_path, shipped):
    run = tmp_path / "run"
    init = fm.init_dir(run, fresh=True)
    before = (init / "model.safetensors").read_bytes()
    assert before == (shipped / "model.safetensors").read_bytes()
    # an export overwrites the shipped weights: the run still starts (and resumes) from its copy
    data = bytearray(before)
    data[-1] ^= 1
    (shipped / "model.safetensors").write_bytes(bytes(data))
    assert (fm.init_dir(run) / "model.safetensors").read_bytes() == before
    with pytest.raises(SystemExit, match="new --run-dir"):
        fm.init_dir(run, fresh=True)  # a new run in this directory would not start from src/'s model
    assert fm.chat_tokenizer(run, "bundled").token_to_id("<|eot|>") == fm.EOT_ID


def test_run_args_come_from_the_saved_run_on_resume():
    args = fm.parse_args([])
    fm.resolve_run_args(args, None)
    assert (args.init, args.data, args.copy_mix) == ("bundled", "copy", 0.0)
    args = fm.parse_args(["--resume"])
    fm.resolve_run_args(args, {"steps": 10})  # a state saved before --init/--data existed
    assert (args.init, args.data) == ("base", "chat")
    args = fm.parse_args(["--resume", "--copy-mix", "0.25"])
    fm.resolve_run_args(args, {"init": "bundled", "data": "copy", "copy_mix": 0.25})
    assert args.copy_mix == 0.25
    with pytest.raises(SystemExit, match="--data copy contradicts"):
        fm.resolve_run_args(fm.parse_args(["--resume", "--data", "copy"]), {"steps": 10})


def test_copy_mix_shares_and_the_batch_is_a_pure_function_of_seed_and_step(tmp_path):
    n, mix = 3, 0.3
    olds = [fm.n_old_chats(s, n, mix) for s in range(20)]
    assert all(0 <= k <= n for k in olds) and sum(olds) == int(mix * n * 20 + 1e-9)
    tok = fm.chat_tokenizer(tmp_path / "run", "bundled")
    template = fm.TEMPLATE.read_text()
    a = fm.chat_batch(5, 7, n, tok, template, 1024, data="copy", copy_mix=mix)
    assert a == fm.chat_batch(5, 7, n, tok, template, 1024, data="copy", copy_mix=mix) and len(a) == n
    assert a != fm.chat_batch(5, 8, n, tok, template, 1024, data="copy", copy_mix=mix)
    copy_only = fm.chat_batch(5, 7, n, tok, template, 4000, data="copy")  # none too long: none skipped
    first_copy = fm.encode_chat(fm.mcp.example(5, 7 * n * 2)[0], tok, template)
    assert copy_only[0] == first_copy
    chat = fm.chat_batch(5, 7, n, tok, template, 4000, data="chat")
    assert chat[0] == fm.encode_chat(fm.mcd.example(5, 7 * n * 2), tok, template)


def _train(run: Path, *extra: str) -> dict:
    args = fm.parse_args(
        [
            "--run-dir",
            str(run),
            "--chats",
            "1",
            "--code-windows",
            "1",
            "--seq-len",
            "32",
            "--val-windows",
            "2",
            "--max-len",
            "700",
        ]
        + ["--steps", "4", "--warmup", "2", "--log-every", "1", "--eval-every", "4", "--threads", "1", *extra]
    )
    fm.train(args)
    return torch.load(run / "state.pt", map_location="cpu", weights_only=False)


def test_a_resumed_run_matches_one_that_never_stopped(tmp_path, monkeypatch):
    # a small token stream in place of the stdlib corpus (its encoding is not what this tests)
    stream = torch.randint(5, 4096, (4000,), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(fm, "code_streams", lambda run, tok: (stream, stream.flip(0)))
    whole = _train(tmp_path / "whole")
    _train(tmp_path / "parts", "--session-steps", "2")
    parts = _train(tmp_path / "parts", "--resume")

    def logged(state):
        return [{k: v for k, v in h.items() if k not in ("elapsed", "tok_s")} for h in state["history"]]

    assert [h["step"] for h in parts["history"]] == [1, 2, 3, 4]
    assert [s["start_step"] for s in parts["sessions"]] == [0, 2]
    assert logged(parts) == logged(whole)  # losses, grad norms, lrs and evaluations, bit for bit
    assert "val_bpb" in whole["history"][-1]
    for name, tensor in whole["model"].items():
        assert torch.equal(tensor, parts["model"][name]), name
    assert fm.session_command(parts["sessions"][1]["args"], True).endswith("--resume --no-export")


def test_recorded_commands_run_the_recorded_sessions():
    argv = ["--copy-mix", "0.2", "--chats", "6", "--steps", "77", "--time-limit", "30", "--copy-circuit"]
    args = fm.parse_args(argv + ["--induction", "8", "--induction-vocab", "64"])
    fm.resolve_run_args(args, None)
    line = fm.session_command(vars(args), False)
    again = fm.parse_args(line.split()[2:])
    for key in fm.CARD_FLAGS + ("time_limit",):
        assert getattr(again, key) == getattr(args, key), key
    assert again.no_export and not again.resume
    # the shipped card's commands predate --init/--data: carried into a new card they say base + chat
    stages = fm.earlier_stages((fm.OUT / "README.md").read_text())
    finetune = [ln for ln in stages.splitlines() if ln.startswith(".venv/bin/python tools/finetune_muse.py")]
    assert finetune and all("--init base --data chat" in ln or "--data" in ln for ln in finetune)
    assert not any("--export-only" in ln for ln in finetune)
    assert stages.startswith("## Pre-training") and "## Results" not in stages


def test_each_copy_stage_gets_its_own_card_heading():
    card = "# musespark-tiny\n\n## Pre-training\n\ntext\n\n## Results\n"
    titles = []
    for _ in range(4):
        titles.append(fm.copy_stage_title(card))
        card = card.replace("\n## Results", f"\n## {titles[-1]} (tools/finetune_muse.py)\n\nsteps\n\n## Results")
    assert titles == [
        "Copy fine-tuning",
        "Copy fine-tuning, continued",
        "Copy fine-tuning, stage 3",
        "Copy fine-tuning, stage 4",
    ]
    assert len(set(titles)) == len(titles) and card.count("\n## Copy fine-tuning") == 4


def test_copy_evaluation_scores_what_llm_chat_answers():
    from musespark import LLM, SamplingParams

    llm = LLM(model=str(fm.OUT), dtype="float32", seed=0)
    result = fm.evaluate_copy(llm, max_tokens=48, limit=1)
    assert (result["tool_tasks"], result["plain_tasks"], result["no_tool_tasks"]) == (1, 1, 1)
    task = fm.tool_eval.limit_tasks(fm.mcp.eval_tasks(fm.EVAL_SEED), 1)[0]
    (reply,) = fm.chat_responses(llm, [(task["messages"], task["tools"], task["chat_template_kwargs"])], 48)
    (out,) = llm.chat(
        task["messages"],
        SamplingParams(temperature=0.0, max_tokens=48),
        tools=task["tools"],
        chat_template_kwargs=task["chat_template_kwargs"],
    )
    parsed = out.outputs[0].parsed
    assert reply == (parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls])
    right, exact = fm.tool_eval.score_call(task, reply[1])
    assert result["right_tool_pct"] == 100.0 * right and result["exact_arguments_pct"] == 100.0 * exact


def test_induction_spans_repeat_a_random_run_and_score_only_its_second_copy():
    a = fm.induction_batch(0, 3, 16)
    assert a == fm.induction_batch(0, 3, 16) and a != fm.induction_batch(0, 4, 16)
    lo, hi = fm.INDUCTION_TOKENS
    for ids, n_prompt in a:
        span = ids[n_prompt - 2 :]  # the scored targets are ids[n_prompt:], the copy's 2nd token on
        assert 16 <= len(span) <= 64 and ids[: len(span)] == span
        assert all(lo <= t < hi for t in ids)
    assert len({len(ids) for ids, _ in a}) > 4  # lengths vary


def test_span_loss_is_reported_apart_and_is_the_mean_over_second_copies(tmp_path):
    import torch.nn.functional as F

    from musespark.layers.attention import AttentionContext

    model = fm.bundled_model(tmp_path / "run")
    spans = fm.induction_batch(0, 0, 4)
    chats = [([5, 6, 7, 8, 9], 3)]
    chat_loss, code_loss, span_loss = fm.packed_loss(model, chats, None, spans)
    assert code_loss is None
    assert float(chat_loss) == pytest.approx(float(fm.packed_loss(model, chats, None)[0]), rel=1e-5)
    # each span alone, scored from its second copy's second token on: the same mean
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, n_prompt in spans:
            x = torch.tensor(ids)
            hidden = model(x[:-1], torch.arange(len(ids) - 1), AttentionContext.for_prompts([len(ids) - 1]))
            ce = F.cross_entropy(model.compute_logits(hidden), x[1:], reduction="none")[n_prompt - 1 :]
            total, count = total + float(ce.sum()), count + ce.numel()
    assert float(span_loss) == pytest.approx(total / count, rel=1e-4)


def test_induction_pool_is_a_fixed_subset_and_spans_draw_from_it():
    pool = fm.induction_pool(64)
    lo, hi = fm.INDUCTION_TOKENS
    assert len(pool) == 64 == len(set(pool.tolist())) and torch.equal(pool, fm.induction_pool(64))
    assert int(pool.min()) >= lo and int(pool.max()) < hi
    assert torch.equal(fm.induction_pool(0), torch.arange(lo, hi))
    allowed = set(pool.tolist())
    assert all(set(ids) <= allowed for ids, _ in fm.induction_batch(0, 5, 8, vocab=64))


def _layer_attention(model, layer: int, ids: list[int]) -> torch.Tensor:
    """Attention probabilities [heads, T, T] of `layer` on one sequence, from the q and k the
    backend computes (rebuilt here with the layer's own scale, causal mask and window)."""
    from musespark.layers.attention import AttentionContext

    seen = {}
    backend = model._active_backend()
    plain = backend.attention

    def capture(attn, q, k, v, positions, ctx):
        if attn.layer == layer:
            seen["qk"] = (q.float(), k.float(), attn)
        return plain(attn, q, k, v, positions, ctx)

    backend.attention = capture
    try:
        x = torch.tensor(ids)
        with torch.no_grad():
            model(x, torch.arange(len(ids)), AttentionContext.for_prompts([len(ids)]))
    finally:
        backend.attention = plain
    q, k, attn = seen["qk"]
    T = len(ids)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = torch.einsum("thd,shd->hts", q, k) * attn.scale
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    if attn.window:
        mask &= ~torch.ones(T, T, dtype=torch.bool).tril(-attn.window)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)


def _fresh_model(run: Path, seed: int = 3):
    """A model of the shipped architecture with train_tiny's fresh initialisation: no copy
    circuit and no tied pairs, whatever the shipped weights have learned."""
    model = fm.MuseSparkForCausalLM(fm.run_config(run, "bundled"))
    fm.tt.init_weights(model, seed)
    model.eval()
    model.materialize_constants()
    return model


def test_the_copy_circuit_attends_to_the_token_after_the_earlier_occurrence(tmp_path):
    g = torch.Generator().manual_seed(11)
    span = torch.randint(5, 4096, (30,), generator=g).tolist()
    ids = torch.randint(5, 4096, (7,), generator=g).tolist() + span + span
    second = 7 + len(span)  # where the repeat starts

    def masses(model):
        prev = _layer_attention(model, 0, ids)
        ind = _layer_attention(model, 1, ids)
        prev_mass = prev[:2].diagonal(-1, 1, 2).mean()
        ind_mass = torch.stack([ind[:2, second + i, 7 + i + 1] for i in range(len(span) - 1)], 1).mean()
        return float(prev_mass), float(ind_mass)

    model = _fresh_model(tmp_path / "run")
    before = masses(model)
    fm.set_copy_circuit(model)
    model.materialize_constants()
    after = masses(model)
    assert before[0] < 0.2 and before[1] < 0.2  # a freshly initialised model has neither head
    assert after[0] > 0.6 and after[1] > 0.6
    P = slice(192, 256)
    assert float(model.embed_tokens.weight.detach()[:, P].abs().max()) == 0.0


def test_tied_space_pairs_let_the_copy_circuit_match_across_a_leading_space(tmp_path):
    tok = fm.chat_tokenizer(tmp_path / "run", "bundled")
    pairs = fm.space_pairs(tok)
    assert len(pairs) > 500
    for a, b in pairs[:50]:
        assert tok.decode([a]) == " " + tok.decode([b]) and tok.decode([b]).strip()
    g = torch.Generator().manual_seed(5)
    pick = [pairs[int(i)] for i in torch.randperm(len(pairs), generator=g)[:30]]
    noise = torch.randint(5, 4096, (7,), generator=g).tolist()
    ids = noise + [a for a, _ in pick] + [b for _, b in pick]  # " X1 X2 ..." then "X1X2..."
    second = 7 + len(pick)

    def induction_mass(model):
        ind = _layer_attention(model, 1, ids)
        return float(torch.stack([ind[:2, second + i, 7 + i + 1] for i in range(len(pick) - 1)], 1).mean())

    model = _fresh_model(tmp_path / "run")
    fm.set_copy_circuit(model)
    model.materialize_constants()
    untied = induction_mass(model)
    emb_before = model.embed_tokens.weight.detach().clone()
    assert fm.tie_space_pairs(model, tok) == len(pairs)
    model.materialize_constants()
    tied = induction_mass(model)
    assert untied < 0.3 and tied > 0.6, (untied, tied)
    emb = model.embed_tokens.weight.detach()
    moved = (emb != emb_before).any(1).nonzero().flatten().tolist()
    assert set(moved) <= {i for p in pairs for i in p}  # only the paired rows move
    assert torch.equal(emb[:, 192:256], emb_before[:, 192:256]) and torch.equal(emb[:, 0], emb_before[:, 0])


def test_value_spans_are_the_call_arguments_and_value_chats_weigh_only_them(tmp_path, monkeypatch):
    tok = fm.chat_tokenizer(tmp_path / "run", "bundled")
    template = fm.TEMPLATE.read_text()
    fm.set_value_marks(tok)
    for i, tool in enumerate(fm.mcp.TOOL_NAMES * 2):
        conv = fm.mcp.heldout_example(3, i, "tool_call", tool)[0]
        ids, n_prompt = fm.encode_chat(conv, tok, template)
        got = [tok.decode(ids[a + 1 : b + 1]) for a, b in fm.value_spans(ids, n_prompt)]
        want = [str(v) + "</" for v in conv.expected["arguments"].values()]
        assert got == want
    batch = fm.value_batch(0, 3, 4, tok, template)
    again, other = fm.value_batch(0, 3, 4, tok, template), fm.value_batch(0, 4, 4, tok, template)
    assert [b[:2] for b in batch] == [b[:2] for b in again] != [b[:2] for b in other]
    assert all(torch.equal(x[2], y[2]) for x, y in zip(batch, again))
    for ids, n_prompt, w in batch:
        prompt = tok.decode(ids[:n_prompt], skip_special_tokens=False)
        assert prompt.count("<|start|>") == 2 and "<|start|>user<|message|>" in prompt  # no tool definitions
        spans = fm.value_spans(ids, n_prompt)
        assert spans and all(float(w[a:b].min()) == fm.VALUE_WEIGHT for a, b in spans)
        assert float(w.sum()) == fm.VALUE_WEIGHT * sum(b - a for a, b in spans)
    monkeypatch.setattr(fm, "VALUE_CALL_WEIGHT", 0.25)
    for (ids, n_prompt, w), (_, _, w_call) in zip(batch, fm.value_batch(0, 3, 4, tok, template)):
        spans = fm.value_spans(ids, n_prompt)
        first = spans[0][0]
        assert float(w_call[:first].abs().sum()) == 0.0  # the reasoning and the tool's name still weigh 0
        rest = torch.ones(len(ids) - 1, dtype=torch.bool)
        rest[:first] = False
        for a, b in spans:
            rest[a:b] = False
            assert torch.equal(w_call[a:b], w[a:b])
        assert rest.any() and bool((w_call[rest] == 0.25).all())
        # the tags after the first value (a second parameter's, the closing ones) are among them
        assert "</atem:invoke>" in tok.decode([t for t, r in zip(ids[1:], rest.tolist()) if r])


def test_value_sources_point_at_the_value_in_the_last_user_message(tmp_path):
    tok = fm.chat_tokenizer(tmp_path / "run", "bundled")
    template = fm.TEMPLATE.read_text()
    fm.set_value_marks(tok)
    found = 0
    for i, tool in enumerate(fm.mcp.TOOL_NAMES * 3):
        conv = fm.mcp.heldout_example(4, i, "tool_call", tool)[0]
        ids, n_prompt = fm.encode_chat(conv, tok, template)
        user = conv.messages[-1]["content"]
        args = [str(v) for v in conv.expected["arguments"].values()]
        for (k, j), value in zip(fm.value_sources(ids, n_prompt, tok), args):
            assert ids[k + 1 : k + 2] == tok.encode(value, add_special_tokens=False).ids[:1]  # k: just before it
            assert j < n_prompt and tok.decode(ids[j:n_prompt]).lstrip(" ").startswith(value)
            assert value in user
            found += 1
    assert found >= 9


def test_restate_sources_point_from_the_answer_to_the_value_in_the_tool_result(tmp_path):
    tok = fm.chat_tokenizer(tmp_path / "run", "bundled")
    template = fm.TEMPLATE.read_text()
    checked = 0
    for i, tool in enumerate(fm.mcp.TOOL_NAMES * 4):
        conv = fm.mcp.heldout_example(5, i, "tool_result", tool)[0]
        ids, n_prompt = fm.encode_chat(conv, tok, template)
        answer = tok.decode(ids[n_prompt:])
        restate = conv.expected["restate"]
        must = restate.get("all", []) + [line for line in restate.get("any", []) if line in answer]
        values = fm.restate_values(conv)
        by_value = {}
        for k, j in fm.restate_sources(ids, n_prompt, tok, values):
            value = next(v for v in values if tok.decode(ids[k + 1 :]).lstrip(" ").startswith(v))
            by_value[value] = (k, j)
        for value in must:
            k, j = by_value[value]  # every value the answer must restate has a source
            assert k >= n_prompt - 1 and j < n_prompt
            tail = tok.decode(ids[j:n_prompt])
            assert tail.lstrip(" ").startswith(value)
            assert "atem:parameter" not in tail  # after the call: in the tool's result
            checked += 1
    assert checked >= 12


def test_restate_chats_are_the_last_user_message_onward_and_deterministic(tmp_path, monkeypatch):
    tok = fm.chat_tokenizer(tmp_path / "run", "bundled")
    template = fm.TEMPLATE.read_text()
    items, values = fm.restate_batch(0, 3, 4, tok, template)
    monkeypatch.setattr(fm, "RESTATE_WEIGHT", 7.0)
    again = fm.restate_batch(0, 3, 4, tok, template)
    assert [x[0] for x in items] == [x[0] for x in again[0]] and values == again[1]
    spans = 0
    for (ids, n_prompt, w), (_, _, w7), vals in zip(items, again[0], values):
        for a, b in fm.restate_spans(ids, n_prompt, tok, vals):
            # the fewest output tokens that spell a whole value, weighted up
            assert any(tok.decode(ids[a + 1 : b + 1]).lstrip(" ").startswith(v) for v in vals)
            assert not any(tok.decode(ids[a + 1 : b]).lstrip(" ").startswith(v) for v in vals)
            assert (w7[a:b] == 7.0).all() and (w[a:b] != 7.0).all()
            spans += 1
    assert spans >= 4
    user, start = tok.token_to_id("user"), tok.token_to_id("<|start|>")
    for (ids, n_prompt, w), vals in zip(items, values):
        assert [i for i in range(len(ids) - 1) if ids[i] == start and ids[i + 1] == user] == [1]
        assert "have access to a set of tools" not in tok.decode(ids[:n_prompt])  # the definitions cut off
        assert w.shape == (len(ids) - 1,) and vals
        assert any(v in tok.decode(ids[n_prompt:]) for v in vals)


def test_the_locate_loss_is_the_heads_attention_on_each_value_start(tmp_path):
    tok = fm.chat_tokenizer(tmp_path / "run", "bundled")
    template = fm.TEMPLATE.read_text()
    fm.set_value_marks(tok)
    chats = [c[:2] for c in fm.value_batch(0, 1, 3, tok, template)]
    sources = [fm.value_sources(ids, n, tok) for ids, n in chats]
    model = fm.bundled_model(tmp_path / "run")
    model.eval()
    model.materialize_constants()
    with torch.no_grad():
        packed = fm.packed_loss(model, chats, None, None, sources)[-1]
    # each chat on its own, through the test's own rebuild of the layer's attention
    logs = []
    for (ids, _), pairs in zip(chats, sources):
        att = _layer_attention(model, fm.LOCATE["layer"], ids[:-1])[fm.LOCATE["head"]]
        logs += [-torch.log(att[k, j]) for k, j in pairs]
    assert len(logs) >= 3
    assert float(packed) == pytest.approx(float(torch.stack(logs).mean()), rel=1e-4)
    backend = model._active_backend()
    assert "attention" not in vars(backend) or vars(backend)["attention"].__func__ is type(backend).attention


def test_the_card_names_the_copy_mechanisms_the_sessions_used():
    assert fm.copy_recipe([{"copy_circuit": False, "induction": 0}]) == ""
    first = {"copy_circuit": True, "induction": 16}
    later = {"tie_space": True, "value_weight": 5.0, "value_chats": 16, "locate_weight": 0.5}
    only_first = fm.copy_recipe([first])
    assert "`--copy-circuit`" in only_first and "`--induction`" in only_first and "`--tie-space`" not in only_first
    both = fm.copy_recipe([first, later])
    for flag in ("--copy-circuit", "--induction", "--tie-space", "--value-weight", "--locate-weight"):
        assert f"`{flag}`" in both
