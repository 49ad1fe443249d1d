"""Corpus and tokenizer for the bundled tiny model (`src/musespark/models/musespark-tiny`).

Corpus: the `*.py` files of the Python standard library of the interpreter running
this code (`sysconfig.get_paths()["stdlib"]`), without `site-packages` and without
test directories (`test`, `tests`, `idle_test`, ...: they are ~60% of the bytes and
mostly repetitive fixtures; leaving them out keeps tokenizing and an epoch short).
Files that are not valid UTF-8 are skipped.

Split: a deterministic ~5% of FILES is held out for validation, chosen by a hash
of the file's path relative to the stdlib root (`is_validation`).

Tokenizer: byte-level BPE (the `tokenizers` library), trained on the training split.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
SPECIAL_TOKENS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
VALIDATION_PERCENT = 5
TEST_DIRS = {"test", "tests", "idle_test", "idlelib_test", "unittest_test"}

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_validation(rel: str) -> bool:
    """Deterministic ~5% hold-out of files, by a hash of the relative path."""
    h = int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big")
    return h % 100 < VALIDATION_PERCENT


@dataclass
class Corpus:
    root: Path
    python_version: str
    train: list[tuple[str, str]]  # (relative path, text)
    val: list[tuple[str, str]]
    skipped: list[str]  # not UTF-8

    def stats(self) -> dict:
        def nbytes(docs):
            return sum(len(t.encode("utf-8")) for _, t in docs)

        return {
            "python_version": self.python_version,
            "stdlib": str(self.root),
            "train_files": len(self.train),
            "val_files": len(self.val),
            "train_bytes": nbytes(self.train),
            "val_bytes": nbytes(self.val),
            "skipped_non_utf8": len(self.skipped),
        }


def list_files(root: Path | None = None) -> list[str]:
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        parts = [] if rel_dir == "." else rel_dir.split(os.sep)
        dirnames[:] = sorted(d for d in dirnames if d != "site-packages" and d not in TEST_DIRS and d != "__pycache__")
        if any(p in TEST_DIRS or p == "site-packages" for p in parts):
            continue
        for name in sorted(filenames):
            if name.endswith(".py"):
                out.append("/".join(parts + [name]))
    return sorted(out)


def load_corpus(root: Path | None = None) -> Corpus:
    root = root or stdlib_root()
    train, val, skipped = [], [], []
    for rel in list_files(root):
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        (val if is_validation(rel) else train).append((rel, text))
    return Corpus(root, sys.version.split()[0], train, val, skipped)


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_byte_lengths(tok) -> list[int]:
    """UTF-8 bytes each token id stands for (0 for special tokens)."""
    dec = _byte_decoder()
    special = set(SPECIAL_TOKENS)
    out = [0] * tok.get_vocab_size()
    for piece, i in tok.get_vocab().items():
        out[i] = 0 if piece in special else sum(1 for ch in piece if ch in dec)
    return out


def encode_docs(tok, texts: list[str]) -> list[int]:
    """One stream: BOS + tokens + EOS for every document."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    out: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out.append(bos)
        out.extend(enc.ids)
        out.append(eos)
    return out
