"""Text <-> token ids for the engine agent: tokenizer, chat template, incremental detokenizer, stop strings.

Owns: loading an HF-style tokenizer directory (`tokenizer.json` + `tokenizer_config.json`), rendering its
jinja2 chat template in a sandbox, turning streamed token ids into text that never splits a UTF-8 character,
and OpenAI stop string semantics (the stop text is cut, and no prefix of a stop string is emitted and later
retracted).
Must not: know gRPC, backends or time; train tokenizers (that is `engine_agent.tokenizer_build`).

"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.decoders import DecodeStream

SIM_TOKENIZER_DIR = Path(__file__).resolve().parent / "assets" / "sim_tokenizer"



class TokenizerLoadError(ValueError):
    """The tokenizer directory is missing a file or names tokens the vocabulary lacks."""


def _token_text(value: object) -> str | None:
    """HF configs spell special tokens as a string or as an AddedToken dict with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


class Tokenizer:
    """A byte-level BPE (or any `tokenizers` model) with its chat template and special token ids."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        name: str,
        content_sha256: str,
        eos_token: str,
        bos_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self._name = name
        self._sha256 = content_sha256
        eos_id = backend.token_to_id(eos_token)
        if eos_id is None:
            raise TokenizerLoadError(f"eos token {eos_token!r} is not in the vocabulary of {name}")
        self._eos_token = eos_token
        self._eos_id = eos_id
        self._bos_token = bos_token
        self._bos_id = backend.token_to_id(bos_token) if bos_token else None
        self._special_ids = frozenset(
            token_id for token_id, added in backend.get_added_tokens_decoder().items() if added.special
        )
        self._template: jinja2.Template | None = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(chat_template)

    @classmethod
    def load(cls, directory: str | Path, *, name: str | None = None) -> Tokenizer:
        """Load an HF-style dir: `tokenizer.json` and `tokenizer_config.json` (chat_template, eos_token)."""
        root = Path(directory)
        tok_path = root / "tokenizer.json"
        cfg_path = root / "tokenizer_config.json"
        if not tok_path.is_file():
            raise TokenizerLoadError(f"{tok_path} not found")
        raw = tok_path.read_bytes()
        config: dict[str, Any] = {}
        if cfg_path.is_file():
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        template = config.get("chat_template")
        if isinstance(template, list):  # HF allows named templates; "default" is the one applied.
            named = {str(t.get("name")): str(t.get("template")) for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        eos = _token_text(config.get("eos_token"))
        if eos is None:
            raise TokenizerLoadError(f"{cfg_path} does not name an eos_token")
        return cls(
            tokenizers.Tokenizer.from_str(raw.decode("utf-8")),
            name=name or root.name,
            content_sha256=hashlib.sha256(raw).hexdigest(),
            eos_token=eos,
            bos_token=_token_text(config.get("bos_token")),
            chat_template=template if isinstance(template, str) else None,
        )

    @classmethod
    def load_sim(cls) -> Tokenizer:
        """The committed tokenizer the sim backend uses."""
        return cls.load(SIM_TOKENIZER_DIR)

    @property
    def identity(self) -> str:
        """Name plus a content hash prefix, e.g. `sim_tokenizer@sha256:0123456789ab`."""
        return f"{self._name}@sha256:{self._sha256[:12]}"

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_id(self) -> int:
        return self._eos_id

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. a leading bos)."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers` object (for its streaming decoder)."""
        return self._backend

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def render_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The chat template's text; ValueError when there is no template or it rejects the messages."""
        if self._template is None:
            raise ValueError(f"tokenizer {self._name} has no chat template")
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token or "",
                eos_token=self._eos_token,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template rejected the messages: {exc}") from exc

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Render the chat and tokenize it; the template writes bos itself, so no post-processor runs."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt))

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Streams text for streamed ids: emits only complete characters and skips special tokens.

    The tokenizer library's own streaming decoder (`tokenizers.decoders.DecodeStream`) does the work in Rust:
    it decodes a short window from the last emitted boundary, so decoders that depend on context (leading
    spaces, byte fallback) still see it, and holds back text ending in U+FFFD (an unfinished UTF-8 sequence).
    `flush` releases what it holds at the end of a stream; for that this keeps the window's ids (the ids of
    the last emitting step and those fed since), never the whole output.
    """

    __slots__ = ("_tokenizer", "_stream", "_window", "_pending")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._window: list[int] = []  # ids of the step that last released text (the decoder's context)
        self._pending: list[int] = []  # ids fed since, not yet released

    def add(self, token_ids: Sequence[int]) -> str:
        """Append ids; return the newly complete text (possibly empty)."""
        if not token_ids:
            return ""
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        text = self._stream.step(self._tokenizer.backend, ids)
        if text is None:
            self._pending.extend(ids)
            return ""
        self._pending.extend(ids)
        self._window, self._pending = self._pending, []
        return str(text)

    def flush(self) -> str:
        """At the end of the stream: whatever is still held (an unfinished sequence decodes as U+FFFD)."""
        if not self._pending:
            return ""
        base = self._tokenizer.decode(self._window)
        text = self._tokenizer.decode(self._window + self._pending)
        self._stream = DecodeStream(skip_special_tokens=True)
        self._window, self._pending = [], []
        return text[len(base) :] if len(text) > len(base) else ""


class StopMatcher:
    """OpenAI stop strings over streamed text.

    `feed` returns the text that is safe to emit: text before a matched stop string (the stop itself is never
    emitted), and never a suffix that could still grow into a stop string. After a match `matched` holds the
    stop string and everything later is dropped. `flush` releases the held-back tail when the stream ends
    unmatched.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in dict.fromkeys(stops) if s)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.matched: str | None = None

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def feed(self, text: str) -> str:
        if self.matched is not None:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        best_index = -1
        for stop in self._stops:
            index = buf.find(stop)
            if index >= 0 and (best_index < 0 or index < best_index):
                best_index, self.matched = index, stop
        if best_index >= 0:
            self._held = ""
            return buf[:best_index]
        hold = 0
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(stop.startswith(tail) for stop in self._stops):
                hold = k
                break
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.matched is not None else held
