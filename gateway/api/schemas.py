"""Request bodies of `/v1/chat/completions` and `/v1/completions`: validation and translation to engine
requests.

Owns: the pydantic request models, `parse_chat` / `parse_completion` (bytes -> model, or an `ApiError` whose
`param` names the offending field), and `engine_requests` (one `EngineRequest` per choice, seeds `seed + i`).

Tokenization and chat templates happen in the engine agent, not here: the gateway forwards chat messages,
prompt text or token ids, and gets exact prompt token counts back (`Admitted`) and exact usage (`Finished`). A
fleet may mix models with different tokenizers and the gateway needs none of their files; detokenized text
comes with each delta. For routing the dispatcher only estimates prompt size (`gateway.dispatch.features`).

Field policy, like OpenAI: unknown fields are ignored (forwards compatibility) but known fields of the wrong
type are rejected (strict types: `"1"` is not a number, `1` is not a boolean). Known OpenAI features that
would change the output and that engines do not implement (penalties other than 0, logprobs, tools, json
response formats, logit bias, echo, best_of > 1, suffix) are rejected explicitly rather than silently ignored.
Bounds (each violation a 400 naming the field): n <= `MAX_N` (each choice is one engine request), at most
`MAX_STOP` stop sequences of `MAX_STOP_CHARS` characters each (OpenAI's 4), at most `MAX_MESSAGES` messages
(OpenAI's 2048), token counts and ids within the engines' uint32 fields, `seed + n - 1` within int64 (choice
i samples with `seed + i`). Output limits against the model's context are checked by the handler, which knows
the fleet. The models' JSON schema (served at `/openapi.json`, `gateway.api.openapi`) describes exactly what
the validators accept, `stop` and `prompt` forms included.
Must not: know about engines' transports, policies or HTTP.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from gateway.api.errors import ApiError, bad_request
from gateway.domain import ChatTurn, EngineRequest

MAX_N = 16
MAX_STOP = 4
MAX_STOP_CHARS = 1024
MAX_MESSAGES = 2048
_MAX_UINT32 = 2**32 - 1  # token ids and token counts travel to engines as uint32
_INT64 = 2**63

# What the `mode="before"` validators accept, for the JSON schema (pydantic sees only their output types).
_STOP_SCHEMA = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string", "maxLength": MAX_STOP_CHARS},
            {"type": "array", "items": {"type": "string", "maxLength": MAX_STOP_CHARS}, "maxItems": MAX_STOP},
            {"type": "null"},
        ],
        "default": None,
    }
)
_TOKEN_IDS_SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": _MAX_UINT32},
    "minItems": 1,
}
_PROMPT_SCHEMA = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string", "minLength": 1},
            _TOKEN_IDS_SCHEMA,
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
            {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1, "maxItems": 1},
        ]
    }
)
TokenCount = Annotated[int, Field(ge=1, le=_MAX_UINT32)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: str = Field(json_schema_extra={"const": "text"})
    text: str = ""

    @model_validator(mode="after")
    def _text_only(self) -> TextPart:
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported; only 'text'")
        return self


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Common(_Strict):
    """Fields shared by chat and legacy completions."""

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Annotated[tuple[str, ...], _STOP_SCHEMA] = ()
    max_tokens: TokenCount | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    user: str | None = None
    # vLLM extensions.
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=_MAX_UINT32)
    # Accepted only at their neutral value (engines implement no penalties).
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: object) -> tuple[str, ...]:
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            if len(value) > MAX_STOP:
                raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(value)}")
            if any(len(v) > MAX_STOP_CHARS for v in value):
                raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters")
            return tuple(value)
        raise ValueError(f"must be a string or a list of at most {MAX_STOP} strings")

    @model_validator(mode="after")
    def _common_checks(self) -> _Common:
        if self.stream_options is not None and not self.stream:
            raise _FieldError("stream_options", "stream_options is only allowed when stream is true")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0.0):
                raise _FieldError(name, f"{name} is not supported by this gateway; omit it or send 0")
        if self.logit_bias:
            raise _FieldError("logit_bias", "logit_bias is not supported by this gateway")
        if self.seed is not None and self.seed + self.n - 1 >= _INT64:
            raise _FieldError("seed", "seed + n - 1 must be below 2**63 (choice i samples with seed + i)")
        limit = self.output_limit_tokens()
        if limit is not None and self.min_tokens > limit:
            raise _FieldError(
                "min_tokens", f"min_tokens ({self.min_tokens}) exceeds the token limit ({limit})"
            )
        return self

    def output_limit_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def output_limit_tokens(self) -> int | None:
        # OpenAI: max_completion_tokens supersedes the deprecated max_tokens.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.logprobs or self.top_logprobs:
            raise _FieldError("logprobs", "logprobs are not supported by this gateway")
        if self.tools or self.functions:
            raise _FieldError("tools", "tool calling is not supported by this gateway")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise _FieldError("response_format", 'only response_format {"type": "text"} is supported')
        return self


class CompletionRequest(_Common):
    prompt: Annotated[str | tuple[int, ...], _PROMPT_SCHEMA]
    max_tokens: TokenCount | None = 16  # the legacy endpoint's documented default
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: object) -> str | tuple[int, ...]:
        if isinstance(value, str):
            if not value:
                raise ValueError("prompt must not be empty")
            return value
        if isinstance(value, list) and value:
            if all(isinstance(v, str) for v in value):
                if len(value) != 1:
                    raise ValueError(
                        "a list of several prompts is not supported; send one request per prompt"
                    )
                return cls._prompt(value[0])
            if len(value) == 1 and isinstance(value[0], list):
                return cls._prompt(value[0])  # [[ids]]: one tokenized prompt
            if all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_UINT32 for v in value):
                return tuple(value)
        raise ValueError("must be a non-empty string, a list of one string, or a non-empty list of token ids")

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        if self.echo:
            raise _FieldError("echo", "echo is not supported by this gateway")
        if self.logprobs:
            raise _FieldError("logprobs", "logprobs are not supported by this gateway")
        if self.best_of is not None and self.best_of > 1:
            raise _FieldError("best_of", "best_of > 1 is not supported by this gateway")
        if self.suffix:
            raise _FieldError("suffix", "suffix is not supported by this gateway")
        return self


class _FieldError(ValueError):
    """A model-level check that blames one field (so the OpenAI `param` is precise)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


_FIELD_NAMES = frozenset(
    name
    for model in (ChatCompletionRequest, CompletionRequest, ChatMessage, TextPart, StreamOptions)
    for name in model.model_fields
)


def _param(loc: tuple[int | str, ...]) -> str | None:
    """`('messages', 0, 'content')` -> `messages[0].content`; pydantic's union-member tags are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELD_NAMES:
            out += f".{part}" if out else part
    return out or None


def _to_api_error(exc: ValidationError) -> ApiError:
    errors = exc.errors(include_url=False)
    # For a union, the member that got furthest explains best (a bad content part beats "not a string").
    err = max(errors, key=lambda e: len(e["loc"]))
    if err["type"] == "json_invalid":
        return bad_request(
            "We could not parse the JSON body of your request: " + err["msg"].removeprefix("Invalid JSON: ")
        )
    if err["type"] == "model_type" and not err["loc"]:
        return bad_request("The request body must be a JSON object.")
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, _FieldError):
        return bad_request(str(cause), cause.param)
    param = _param(err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    alike = [e for e in errors if _param(e["loc"]) == param and e["type"].endswith("_type")]
    if len(alike) > 1 and len(alike) == sum(1 for e in errors if _param(e["loc"]) == param):
        msg = "Input should be " + " or ".join(e["msg"].removeprefix("Input should be ") for e in alike)
    if err["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param)
    return bad_request(f"Invalid value for '{param}': {msg}." if param else msg, param)


def parse_chat(body: bytes) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate_json(body)
    except ValidationError as e:
        raise _to_api_error(e) from None


def parse_completion(body: bytes) -> CompletionRequest:
    try:
        return CompletionRequest.model_validate_json(body)
    except ValidationError as e:
        raise _to_api_error(e) from None


def engine_requests(
    req: ChatCompletionRequest | CompletionRequest,
    *,
    request_id: str,
    slo_ttft_s: float | None,
    slo_tpot_s: float | None,
    priority: int,
    session_id: str,
) -> list[EngineRequest]:
    """One engine request per choice; ids `request_id` (n = 1) or `request_id-i`; seeds `seed + i`."""
    messages: tuple[ChatTurn, ...] | None = None
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    if isinstance(req, ChatCompletionRequest):
        messages = tuple(ChatTurn(m.role, m.text()) for m in req.messages)
    elif isinstance(req.prompt, str):
        prompt_text = req.prompt
    else:
        prompt_ids = req.prompt
    out = []
    for i in range(req.n):
        out.append(
            EngineRequest(
                request_id=request_id if req.n == 1 else f"{request_id}-{i}",
                model=req.model,
                messages=messages,
                prompt_text=prompt_text,
                prompt_token_ids=prompt_ids,
                max_tokens=req.output_limit_tokens(),
                min_tokens=req.min_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                seed=None if req.seed is None else req.seed + i,
                stop=req.stop,
                ignore_eos=req.ignore_eos,
                slo_ttft_s=slo_ttft_s,
                slo_tpot_s=slo_tpot_s,
                priority=priority,
                session_id=session_id,
            )
        )
    return out
