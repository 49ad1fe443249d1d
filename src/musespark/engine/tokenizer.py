"""Tokenizer: a `tokenizers.Tokenizer` plus the bits of tokenizer_config.json the engine needs.

Reads a Hugging Face tokenizer directory without `transformers`:

* tokenizer.json (required) — the fast tokenizer itself.
* tokenizer_config.json (optional) — bos_token, eos_token (a str or a {"content": ...}
  dict), chat_template, add_bos_token.
* chat_template.jinja (optional) — the chat template; as in transformers it wins over
  tokenizer_config.json's `chat_template` key.

Chat templates render as HF's apply_chat_template renders them (see engine/chat.py).

BOS rule for `encode(text, add_special_tokens=True)` (invariant: the result starts with
exactly one BOS iff BOS is wanted, unless the text itself spells BOS twice):

* BOS is wanted when tokenizer_config.json says `add_bos_token: true`; when it says
  `false` it is not; when it says nothing, BOS is wanted iff a BOS token exists.
* A BOS that tokenizer.json's post-processor puts first is dropped and replaced by this
  rule, so the post-processor and the config never add two.
* A BOS already spelled at the start of the text (as a rendered chat template does)
  counts as the BOS: none is prepended in front of it.

`add_special_tokens=False` applies no BOS rule and no post-processor; it is what the chat
path should use (transformers and vLLM encode rendered chat templates this way).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from ..errors import InvalidArgumentError
from . import chat
from .chat import CHAT_ROLES

# Texts longer than this are encoded without holding the GIL (a server thread tokenizing a
# 1 MiB prompt would otherwise stall the event loop for ~0.3 s).
_GIL_FREE_CHARS = 8192

__all__ = ["CHAT_ROLES", "Tokenizer", "validate_messages"]


def _token_content(value: Any, field: str, path: Path) -> str | None:
    """A special-token entry of tokenizer_config.json: None, a str, or {"content": str}."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{path}: {field} must be a string or a {{'content': str}} dict, got {value!r}")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and return the copies a template sees ("content" a plain str)."""
    return chat.normalize_messages(messages)


class Tokenizer:
    """Encode/decode and chat-template rendering for one model directory."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
        extra_eos_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = self._lookup(bos_token, "bos_token")
        self.eos_token_id = self._lookup(eos_token, "eos_token")

        eos = {int(i) for i in extra_eos_ids}
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self._eos_ids = frozenset(eos)

        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        special |= {i for i in (self.bos_token_id, self.eos_token_id) if i is not None}
        self._special_ids = frozenset(special)

        self._want_bos = (
            bool(add_bos_token) if add_bos_token is not None else self.bos_token_id is not None
        ) and self.bos_token_id is not None
        self._post_processor_adds_bos = self._detect_post_processor_bos()

    @classmethod
    def from_dir(cls, path: str | Path, extra_eos_ids: Iterable[int] | None = None) -> Tokenizer:
        """Load tokenizer.json (required) and tokenizer_config.json (optional) from `path`.

        `extra_eos_ids` are further end-of-sequence ids the caller read elsewhere
        (generation_config.json / config.json `eos_token_id`); they join `eos_token_ids`.
        """
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"tokenizer file not found: {tok_file}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise ValueError(f"cannot read tokenizer file {tok_file}: {e}") from e

        cfg: dict[str, Any] = {}
        cfg_file = root / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"cannot read {cfg_file}: {e}") from e
            if not isinstance(cfg, dict):
                raise ValueError(f"{cfg_file} must hold a JSON object")

        template = cfg.get("chat_template")
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():  # transformers: the .jinja file wins over the config key
            try:
                template = jinja_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"cannot read {jinja_file}: {e}") from e
        if isinstance(template, list):
            # The list form names several templates; the engine renders the default one.
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{cfg_file}: chat_template must be a string")
        add_bos = cfg.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise ValueError(f"{cfg_file}: add_bos_token must be a bool, got {add_bos!r}")

        return cls(
            backend,
            bos_token=_token_content(cfg.get("bos_token"), "bos_token", cfg_file),
            eos_token=_token_content(cfg.get("eos_token"), "eos_token", cfg_file),
            chat_template=template,
            add_bos_token=add_bos,
            extra_eos_ids=extra_eos_ids or (),
        )

    # --- vocabulary -------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> set[int]:
        """The tokenizer's eos id together with the caller's `extra_eos_ids`."""
        return set(self._eos_ids)

    @property
    def special_ids(self) -> set[int]:
        """Ids of special added tokens (and bos/eos); `skip_special_tokens` drops these."""
        return set(self._special_ids)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of `token_id` (byte-level form), None if out of range."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def vocab_encoding(self) -> tuple[list[str], str]:
        """(every id's vocabulary string, in id order; how those strings encode bytes):
        "byte_level" (GPT-2 byte map, a ByteLevel decoder), "byte_fallback" (<0xAB> tokens,
        SentencePiece style) or "raw". What a grammar engine needs to map tokens to bytes."""
        vocab = self._backend.get_vocab(with_added_tokens=True)
        strings = [""] * (max(vocab.values()) + 1 if vocab else 0)
        for text, i in vocab.items():
            strings[i] = text
        decoder = json.loads(self._backend.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder]) if isinstance(d, Mapping)}
        kind = "byte_level" if "ByteLevel" in kinds else "byte_fallback" if "ByteFallback" in kinds else "raw"
        return strings, kind

    # --- encode / decode --------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; see the module docstring for the BOS rule. Text that is not
        valid Unicode (a lone surrogate) is an InvalidArgumentError, not the backend's TypeError."""
        if not isinstance(text, str):
            raise InvalidArgumentError(f"text to encode must be a str, got {type(text).__name__}", param="prompt")
        try:
            if len(text) > _GIL_FREE_CHARS:  # encode_batch releases the GIL; encode holds it throughout
                ids: list[int] = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            else:
                ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidArgumentError(
                    f"text is not valid Unicode ({exc.reason}: {text[exc.start]!r} at index {exc.start})",
                    param="prompt",
                ) from None
            raise
        if not add_special_tokens or self.bos_token_id is None:
            return ids
        if self._post_processor_adds_bos:
            ids = ids[1:]
        if self._want_bos and not (ids and ids[0] == self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 sequences come out as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # --- chat ---------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's Jinja chat template (or `chat_template`), as
        HF's apply_chat_template does: sandboxed, the special tokens, then `kwargs`. Raises
        InvalidArgumentError (a ValueError) naming `messages`, `tools`, ... on bad input or
        a template exception."""
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise ValueError(
                "this model has no chat template (neither chat_template.jinja nor a chat_template "
                "key in tokenizer_config.json)"
            )
        kwargs.update(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
        )
        return chat.render(
            source, messages, kwargs, {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Prompt ids for a chat: the rendered template, BOS only as the template spells it."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs), False)

    # --- internals ----------------------------------------------------------------------

    def _lookup(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{field} {token!r} is not in the tokenizer vocabulary")
        return token_id

    def _detect_post_processor_bos(self) -> bool:
        # True iff tokenizer.json's post-processor puts BOS in front of plain text.
        if self.bos_token_id is None:
            return False
        bare = self._backend.encode("a", add_special_tokens=False).ids
        full = self._backend.encode("a", add_special_tokens=True).ids
        return full[:1] == [self.bos_token_id] and full[1 : 1 + len(bare)] == bare
