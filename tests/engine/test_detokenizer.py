"""Tokenizer wrapper and IncrementalDetokenizer: UTF-8 safety, stop strings, chat template, BOS."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from musespark.engine.args import bundled_model_path
from musespark.engine.detokenizer import IncrementalDetokenizer
from musespark.engine.tokenizer import Tokenizer

MODEL_DIR = bundled_model_path()
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
ASSISTANT_HEADER = "<|start|>assistant"  # the Muse generation prompt (MUSE_CHAT §2.1)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(MODEL_DIR)


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by ByteLevel vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _byte_ids(tok: Tokenizer, text: str) -> list[int]:
    """One id per UTF-8 byte of `text` (the byte-level alphabet has a token for each byte)."""
    chars = _byte_level_chars()
    ids = [tok.token_to_id(chars[b]) for b in text.encode("utf-8")]
    assert all(i is not None for i in ids)
    return ids  # type: ignore[return-value]


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    return [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


def _detok(tok: Tokenizer, stop: list[str] | None = None, include: bool = False, skip: bool = True):
    prompt = tok.encode("The prompt says:")
    return IncrementalDetokenizer(tok, prompt, stop or [], include, skip)


# --- incremental decoding ---------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_deltas_concatenate_to_full_decode_random_ids(tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(0)
    special = sorted(tok.special_ids)
    for trial in range(30):
        ids = [rng.randrange(len(special), tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        for _ in range(rng.randrange(0, 4)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        detok = _detok(tok, skip=skip)
        deltas = _stream(detok, ids, chunk=rng.randrange(1, 4))
        deltas.append(detok.flush())
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == expected, f"trial {trial}"
        assert detok.output_text == expected


def test_deltas_match_encoded_text_one_token_at_a_time(tok: Tokenizer) -> None:
    text = "héllo wörld ✓ 日本語 🎉 done"
    ids = tok.encode(text, add_special_tokens=False)
    detok = _detok(tok)
    deltas = _stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert detok.flush() == ""


@pytest.mark.parametrize("char", ["日", "🎉", "é"])
def test_split_multibyte_char_is_emitted_only_when_complete(tok: Tokenizer, char: str) -> None:
    ids = _byte_ids(tok, "a" + char + "b")
    detok = _detok(tok)
    deltas = _stream(detok, ids)
    n = len(char.encode("utf-8"))
    assert deltas[0] == "a"
    assert deltas[1:n] == [""] * (n - 1)  # incomplete: nothing yet
    assert deltas[n] == char
    assert deltas[n + 1] == "b"
    assert all("\ufffd" not in d for d in deltas)


def test_flush_renders_an_unfinished_char_like_a_full_decode(tok: Tokenizer) -> None:
    ids = _byte_ids(tok, "x日")[:-1]  # last byte of 日 never arrives
    detok = _detok(tok)
    assert "".join(_stream(detok, ids)) == "x"
    tail = detok.flush()
    assert "x" + tail == tok.decode(ids)
    assert tail.endswith("\ufffd")
    assert detok.finished and detok.stop_reason is None
    assert detok.add_tokens(ids) == ""


def test_trained_byte_level_bpe_multibyte(tmp_path: Path) -> None:
    corpus = ["héllo wörld ✓ 日本語 🎉", "hello world", "日本語 is nice 🎉🎉", "wörld ✓✓"] * 20
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>"],
    )
    backend.train_from_iterator(corpus, trainer)
    tiny = Tokenizer(backend, bos_token="<s>")
    text = "wörld 日本語 ✓ héllo 🎉 本"
    ids = tiny.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tiny, tiny.encode("héllo"), [], False, True)
    deltas = _stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text == tiny.decode(ids)


# --- stop strings -----------------------------------------------------------------------

STOP_TEXT = "Hello world, stop here. More text"


def _spanning_ids(tok: Tokenizer, stop: str) -> list[int]:
    ids = tok.encode(STOP_TEXT, add_special_tokens=False)
    assert all(stop not in tok.decode([i]) for i in ids), "stop string must span tokens"
    return ids


def test_stop_string_spanning_tokens_is_excluded(tok: Tokenizer) -> None:
    ids = _spanning_ids(tok, "stop here")
    detok = _detok(tok, stop=["stop here"])
    deltas = _stream(detok, ids)
    assert detok.finished and detok.stop_reason == "stop here"
    assert detok.output_text == "Hello world, "
    assert "".join(deltas) == "Hello world, "
    assert detok.flush() == ""
    assert detok.add_tokens(ids) == "" and detok.output_text == "Hello world, "


def test_stop_string_deltas_never_leak_a_stop_prefix(tok: Tokenizer) -> None:
    ids = _spanning_ids(tok, "stop here")
    detok = _detok(tok, stop=["stop here"])
    emitted = ""
    for i in ids:
        emitted += detok.add_tokens([i])
        if not detok.finished:
            # Held back: at least len(stop) - 1 characters of the text are not shown yet.
            assert len(detok.output_text) - len(emitted) >= min(8, len(detok.output_text))
        assert "s" not in emitted.replace("Hello world, ", "")


def test_include_stop_str_in_output_keeps_it(tok: Tokenizer) -> None:
    ids = _spanning_ids(tok, "stop here")
    detok = _detok(tok, stop=["stop here"], include=True)
    deltas = _stream(detok, ids)
    assert detok.stop_reason == "stop here"
    assert detok.output_text == "Hello world, stop here"
    assert "".join(deltas) == "Hello world, stop here"


def test_held_back_text_is_released_by_flush(tok: Tokenizer) -> None:
    ids = tok.encode("abcdef ghi", add_special_tokens=False)
    detok = _detok(tok, stop=["zzzzzz"])
    streamed = "".join(_stream(detok, ids))
    assert streamed == "abcdef ghi"[:-5]  # max stop length 6: hold back 5 characters
    assert not detok.finished
    rest = detok.flush()
    assert streamed + rest == "abcdef ghi" == detok.output_text
    assert detok.finished and detok.stop_reason is None


@pytest.mark.parametrize("chunk", [1, 100])
def test_earliest_stop_string_wins(tok: Tokenizer, chunk: int) -> None:
    ids = tok.encode(STOP_TEXT, add_special_tokens=False)
    detok = _detok(tok, stop=["here", "world", "lo w"])
    out = "".join(_stream(detok, ids, chunk))
    assert detok.stop_reason == "lo w"
    assert out == detok.output_text == "Hel"


def test_stop_string_only_matches_output_not_prompt(tok: Tokenizer) -> None:
    prompt = tok.encode("stop here please")
    detok = IncrementalDetokenizer(tok, prompt, ["stop"], False, True)
    ids = tok.encode(" and go on", add_special_tokens=False)
    out = "".join(_stream(detok, ids)) + detok.flush()
    assert out == " and go on" and detok.stop_reason is None


def test_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|eot_id|>hi there<|start_header_id|>", add_special_tokens=False)
    assert {2, 4} <= set(ids) and {2, 4} <= tok.special_ids
    skipped = _detok(tok, skip=True)
    kept = _detok(tok, skip=False)
    assert "".join(_stream(skipped, ids)) + skipped.flush() == "hi there"
    assert "".join(_stream(kept, ids)) + kept.flush() == "<|eot_id|>hi there<|start_header_id|>"


# --- chat template ----------------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
    },
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]


def test_chat_template_with_generation_prompt(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert text.startswith(BOS) and text.count(BOS) == 1
    for header in ("<|start|>system<|message|>", "<|start|>user<|message|>", "<|start|>assistant to=user<|message|>"):
        assert header in text
    for content in ("Be brief.", "Hi\nthere", "Hello!", "What is 2+2?"):
        assert content in text
    assert text.endswith(ASSISTANT_HEADER)


def test_chat_template_without_generation_prompt(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert text.endswith("What is 2+2?<|eot|>")
    assert not text.endswith(ASSISTANT_HEADER)


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ("hello", "messages must be a list"),
        ([{"role": "user", "content": "a"}, "b"], "messages[1] must be a dict"),
        ([{"content": "a"}], "messages[0] is missing the 'role'"),
        # any role reaches the template (as in vLLM); the Muse template refuses one it does not know
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "unknown role robot"),
        ([{"role": "user"}], "messages[0] is missing the 'content'"),
        ([{"role": "user", "content": 3}], "messages[0].content must be"),
        ([{"role": "user", "content": [{"type": "image", "url": "x"}]}], "messages[0].content[0]"),
    ],
)
def test_chat_template_rejects_malformed_messages(tok: Tokenizer, messages, needle: str) -> None:
    with pytest.raises(ValueError) as e:
        tok.apply_chat_template(messages)
    assert needle in str(e.value)


def test_chat_template_raise_exception_helper(tmp_path: Path) -> None:
    backend = tokenizers.Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    t = Tokenizer(backend, chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(ValueError, match="no system role"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_no_chat_template(tmp_path: Path) -> None:
    shutil.copy(MODEL_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    t = Tokenizer.from_dir(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


# --- BOS / EOS / loading ----------------------------------------------------------------


def _dir_with_config(tmp_path: Path, **overrides) -> Path:
    shutil.copy(MODEL_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    shutil.copy(MODEL_DIR / "chat_template.jinja", tmp_path / "chat_template.jinja")
    cfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    cfg.pop("add_bos_token")
    cfg.update(overrides)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_encode_bos_follows_config_false(tok: Tokenizer) -> None:
    ids = tok.encode("hi")
    assert tok.bos_token_id == 0 and 0 not in ids
    chat = tok.encode(tok.apply_chat_template(MESSAGES))
    assert chat[0] == 0 and chat.count(0) == 1
    assert tok.encode_chat(MESSAGES) == chat


def test_encode_adds_bos_exactly_once_when_unspecified(tmp_path: Path) -> None:
    t = Tokenizer.from_dir(_dir_with_config(tmp_path))
    assert t.encode("hi")[0] == 0 and t.encode("hi").count(0) == 1
    assert t.encode("hi", add_special_tokens=False).count(0) == 0
    assert t.encode(BOS + "hi").count(0) == 1
    chat_text = t.apply_chat_template(MESSAGES)
    no_special = t.encode(chat_text, add_special_tokens=False)
    for ids in (t.encode(chat_text), no_special, t.encode_chat(MESSAGES)):
        assert ids[0] == 0 and ids.count(0) == 1


def test_post_processor_bos_is_not_doubled() -> None:
    backend = tokenizers.Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    for add_bos in (True, None):
        t = Tokenizer(backend, bos_token=BOS, eos_token=EOS, add_bos_token=add_bos)
        assert t.encode("hi").count(0) == 1 and t.encode("hi")[0] == 0
        assert t.encode(BOS + "hi").count(0) == 1
    off = Tokenizer(backend, bos_token=BOS, eos_token=EOS, add_bos_token=False)
    assert 0 not in off.encode("hi")


def test_eos_ids_union_and_dict_form(tmp_path: Path) -> None:
    d = _dir_with_config(tmp_path, eos_token={"content": "<|eot_id|>", "special": True})
    t = Tokenizer.from_dir(d, extra_eos_ids=[1])
    assert t.eos_token_ids == {1, 4}
    assert Tokenizer.from_dir(MODEL_DIR).eos_token_ids == {1}  # the tokenizer's own; config.json adds <|eot|>
    assert Tokenizer.from_dir(MODEL_DIR, extra_eos_ids=[4099]).eos_token_ids == {1, 4099}
    assert t.vocab_size == 4100 and t.id_to_token(4) == "<|eot_id|>" and t.id_to_token(4099) == "<|eot|>"


def test_from_dir_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
