"""API keys: the key file's typed model, and authentication of a presented key in constant time.

Owns: `KeyFileModel` / `KeyEntry` (the file, YAML or JSON like the gateway config: frozen, unknown keys
rejected, names and keys unique, exactly one of `key` or `key_sha256` per entry, absent limits = unlimited),
`ApiKey` (what the gateway keeps of an entry: the name, the SHA-256 digest, the limits; never the key itself),
`KeyTable.authenticate` and `load_key_table` (a file to a table, or a `ConfigError` naming the file and the
bad entry).
Must not: import aiohttp, asyncio or a clock; keep a raw key past parsing, or put one in an error message
(pydantic's input echo is off, and messages name entries by index and name only).

Constant time: the presented key is hashed with SHA-256 and the digest compared with every entry's digest by
`hmac.compare_digest`, with no early exit and no lookup keyed by the raw key. How long it takes depends on the
table's size, not on which entry (if any) matches nor on how many leading bytes agree.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StringConstraints,
    ValidationError,
    model_validator,
)

from gateway.config import ConfigError, read_config_file

# The label of requests that presented no valid key (`/metrics`), so no key may be named so.
UNAUTHENTICATED = "unauthenticated"
MIN_KEY_CHARS = 8
KeyName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")]
ModelName = Annotated[str, StringConstraints(min_length=1)]
Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class _Frozen(BaseModel):
    # hide_input_in_errors: a rejected `key` must not reach a message or a log through pydantic's echo.
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)


class KeyEntry(_Frozen):
    """One key of the file. Lower `priority` runs first (as vLLM's and the agents' priority)."""

    name: KeyName
    key: SecretStr | None = None
    key_sha256: Sha256Hex | None = None  # hex SHA-256 of the key (lower case): the file need not hold the key
    models: Literal["*"] | tuple[ModelName, ...] = "*"
    requests_per_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    tokens_per_min: int | None = Field(None, gt=0)
    max_concurrent_streams: int | None = Field(None, ge=1)
    priority: int = 0
    # Reserved for admin endpoints: the gateway has none today, so this grants nothing yet.
    admin: bool = False

    @model_validator(mode="after")
    def _one_secret(self) -> KeyEntry:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("give exactly one of `key` or `key_sha256`")
        if self.key is not None and len(self.key.get_secret_value()) < MIN_KEY_CHARS:
            raise ValueError(f"key: at least {MIN_KEY_CHARS} characters")
        if self.models != "*" and not self.models:
            raise ValueError('models: list at least one model, or "*" for all')
        if self.name == UNAUTHENTICATED:
            raise ValueError(f"name: {UNAUTHENTICATED!r} is reserved (the metrics label of keyless requests)")
        return self

    def digest(self) -> bytes:
        if self.key is not None:
            return _digest(self.key.get_secret_value())
        assert self.key_sha256 is not None
        return bytes.fromhex(self.key_sha256)


class KeyFileModel(_Frozen):
    keys: tuple[KeyEntry, ...]

    @model_validator(mode="after")
    def _some_key(self) -> KeyFileModel:
        if not self.keys:  # an empty table would refuse everyone; no file at all is the open gateway
            raise ValueError("keys: list at least one key (to run an open gateway, give no key file)")
        return self


@dataclass(frozen=True, slots=True)
class ApiKey:
    """An authenticated key: its name (safe to log and label with), permissions and limits."""

    name: str
    models: frozenset[str] | None  # None = every model
    requests_per_s: float | None = None
    tokens_per_min: int | None = None
    max_concurrent_streams: int | None = None
    priority: int = 0
    admin: bool = False
    digest: bytes = field(default=b"", repr=False, compare=False)

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    @classmethod
    def from_entry(cls, entry: KeyEntry) -> ApiKey:
        return cls(
            name=entry.name,
            models=None if entry.models == "*" else frozenset(entry.models),
            requests_per_s=entry.requests_per_s,
            tokens_per_min=entry.tokens_per_min,
            max_concurrent_streams=entry.max_concurrent_streams,
            priority=entry.priority,
            admin=entry.admin,
            digest=entry.digest(),
        )


def _digest(presented: str) -> bytes:
    return hashlib.sha256(presented.encode("utf-8", "surrogatepass")).digest()


class KeyTable:
    """The configured keys. Build with `KeyTable.parse` or `load_key_table`."""

    def __init__(self, keys: tuple[ApiKey, ...]) -> None:
        names = [k.name for k in keys]
        if len(set(names)) != len(names):
            raise ValueError("key names must be unique")
        if len({k.digest for k in keys}) != len(keys):
            raise ValueError("keys must be unique")
        self._keys = keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[ApiKey]:
        return iter(self._keys)

    def authenticate(self, presented: str) -> ApiKey | None:
        """The key whose secret is `presented`, or None; constant time in which entry matches."""
        digest = _digest(presented)
        found: ApiKey | None = None
        for key in self._keys:  # every entry compared, whatever matched before
            if hmac.compare_digest(key.digest, digest):
                found = key
        return found

    @classmethod
    def parse(cls, raw: Mapping[str, Any], source: str = "key file") -> KeyTable:
        """A table from the file's mapping; `ConfigError` naming `source` and each bad entry."""
        try:
            model = KeyFileModel.model_validate(raw)
        except ValidationError as e:
            raise ConfigError(f"{source}: {_describe(e, raw)}") from None
        entries = model.keys
        names, digests = [e.name for e in entries], [e.digest() for e in entries]
        for field_name, values in (("name", names), ("key", digests)):
            seen: dict[Any, int] = {}
            for i, value in enumerate(values):
                if value in seen:
                    first = seen[value]
                    raise ConfigError(
                        f"{source}: keys.{i} ({entries[i].name!r}): same {field_name} as keys.{first} "
                        f"({entries[first].name!r}); each {field_name} must be unique"
                    )
                seen[value] = i
        return cls(tuple(ApiKey.from_entry(e) for e in entries))


def _describe(exc: ValidationError, raw: Mapping[str, Any]) -> str:
    """Each error as `path (name): message`, the entry named when it has a readable name; no input values."""
    entries = raw.get("keys") if isinstance(raw, Mapping) else None
    lines = []
    for err in exc.errors(include_url=False, include_input=False):
        loc = err["loc"]
        path = ".".join(str(p) for p in loc) or "<root>"
        if len(loc) >= 2 and loc[0] == "keys" and isinstance(loc[1], int) and isinstance(entries, list):
            entry = entries[loc[1]] if loc[1] < len(entries) else None
            name = entry.get("name") if isinstance(entry, Mapping) else None
            if isinstance(name, str) and name:
                path += f" ({name[:64]!r})"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{path}: {msg}" if loc else msg)
    return "; ".join(lines)


def load_key_table(path: str | Path) -> KeyTable:
    """The table in a `.json`, `.yaml` or `.yml` key file (the config file's reader and formats)."""
    source = f"API key file {path}"
    try:
        raw = read_config_file(path)
    except ConfigError as e:
        cause = e.__cause__
        if cause is None or isinstance(cause, OSError | ImportError):
            raise
        # A parser's message quotes the offending line, which may hold a key: keep only where it is.
        raise ConfigError(f"{source}: cannot parse it{_where(cause)}") from None
    return KeyTable.parse(raw, source=source)


def _where(parse_error: BaseException) -> str:
    line = getattr(parse_error, "lineno", None)  # json.JSONDecodeError
    column = getattr(parse_error, "colno", None)
    mark = getattr(parse_error, "problem_mark", None)  # yaml.MarkedYAMLError
    if mark is not None:
        line, column = mark.line + 1, mark.column + 1
    return f" (line {line}, column {column})" if line is not None else ""
