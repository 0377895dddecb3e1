"""What the dispatcher tells a policy about a request: the prompt-size estimate and the `RequestFeatures`
build.

Owns: `RoutingHints` (what the API layer read from headers), `estimate_prompt_tokens`, `prefix_keys_of` (a
prompt's index-block keys, for KV-cache-aware policies), `build_features`.
The gateway never tokenizes (the engine agent owns its tokenizer and reports exact counts); for routing it
estimates ceil(UTF-8 bytes / 4) per text, plus a few tokens of chat-template overhead per message.
Must not: read clocks or randomness itself (both come in as arguments), do I/O, or import aiohttp.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gateway.domain import EngineId, EngineRequest, RequestFeatures
from switchyard.prefix import index_keys

BYTES_PER_TOKEN = 4
CHAT_TOKENS_PER_MESSAGE = 4  # role header and separators of a typical chat template
CHAT_TOKENS_PER_REPLY = 3  # the assistant turn header the template appends
# Output budget assumed for routing when the client sets no limit (the engine then stops at EOS or context
# end).
UNBOUNDED_OUTPUT_TOKENS_ESTIMATE = 1024


@dataclass(frozen=True, slots=True)
class RoutingHints:
    """Per-request routing inputs from the API layer (headers, arrival time)."""

    arrival_s: float
    session_id: str = ""
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    priority: int = 0
    policy_name: str | None = None  # None = the configured policy
    # Engines this choice must not go to (a cascade stage run again after it failed mid-stream there).
    avoid: frozenset[EngineId] = frozenset()


def _text_tokens(text: str) -> int:
    return -(-len(text.encode("utf-8")) // BYTES_PER_TOKEN)


def estimate_prompt_tokens(request: EngineRequest) -> int:
    """Prompt size for routing: exact for token ids, ceil(bytes / 4) for text, plus chat overhead."""
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    if request.prompt_text is not None:
        return _text_tokens(request.prompt_text)
    if request.messages is not None:
        return CHAT_TOKENS_PER_REPLY + sum(
            CHAT_TOKENS_PER_MESSAGE + _text_tokens(m.content) for m in request.messages
        )
    return 0


def prefix_keys_of(request: EngineRequest) -> tuple[int, ...]:
    """The prompt's indexed-block keys (`switchyard.prefix.index_keys`), for a request given as token ids;
    () for text and chat prompts, which this gateway does not tokenize (their prefixes are not matched)."""
    ids = request.prompt_token_ids
    if not ids:
        return ()
    return tuple(index_keys(ids))


def build_features(
    request: EngineRequest,
    hints: RoutingHints,
    *,
    prompt_tokens: int,
    now_s: float,
    dispatch_seq: int,
    rand: float,
    session_engine: EngineId | None,
    session_last_used_s: float,
    exclude: frozenset[EngineId],
    resumed_tokens: int = 0,
    prefix_keys: tuple[int, ...] = (),
    prefix_hits: Mapping[EngineId, int] | None = None,
) -> RequestFeatures:
    return RequestFeatures(
        request_id=request.request_id,
        model=request.model,
        prompt_tokens=prompt_tokens,
        max_tokens=request.max_tokens or UNBOUNDED_OUTPUT_TOKENS_ESTIMATE,
        now_s=now_s,
        dispatch_seq=dispatch_seq,
        rand=rand,
        session_id=hints.session_id,
        session_engine=session_engine,
        session_last_used_s=session_last_used_s,
        slo_ttft_s=hints.slo_ttft_s,
        slo_tpot_s=hints.slo_tpot_s,
        priority=hints.priority,
        exclude=exclude,
        resumed_tokens=resumed_tokens,
        prefix_keys=prefix_keys,
        prefix_hits=prefix_hits if prefix_hits is not None else {},
    )
