"""The sim's migration ticket: a `MigrationCut` into a `MigrationTicket` and back, via `transfer_params`.

Owns: the sim's `transfer_params` format (`TRANSFER_PARAMS_FORMAT`: the request's token-generator state and
decided output length, so a migrated request continues with exactly the tokens it would have produced
unmigrated and seeded requests can move too), building the ticket for a cut (`ticket_for_cut`), and reading a
ticket back into the cut to resume (`cut_from_ticket`; the request: `base.request_from_ticket`), refusing
(`MigrationRefused`) a ticket of another backend, model or vocabulary or one whose counts disagree. A ticket
without KV (`kv_tokens` 0: the gateway's recompute or re-ticket) may carry more output tokens than its
`transfer_params` were written for: those after the generator state become the cut's `after_cut`, which the
engine replays and checks.
Must not: touch engine state (whether the cut fits an engine is `SimEngine.check_migrated_request`), model the
KV transfer or deliver streams (that is `engine_agent.backends.sim`), read clocks, do I/O or know asyncio.
"""

from __future__ import annotations

import json
from typing import Any

from engine_agent.domain import BackendRequest, MigrationRefused, MigrationTicket, RequestId
from engine_agent.sim.migration import MigrationCut

TRANSFER_PARAMS_FORMAT = "switchyard-sim-migration/1"


def encode_transfer_params(cut: MigrationCut, *, kv_bytes_per_token: int, vocab_size: int) -> bytes:
    """The sim's `transfer_params`: what the target engine needs beyond the ticket's common fields."""
    return json.dumps({
        "format": TRANSFER_PARAMS_FORMAT,
        "lcg_state": cut.lcg_state,
        "output_tokens": cut.num_output,
        "target_output_len": cut.target_len,
        "stop_at_target": cut.stop_at_target,
        "remaining_output_tokens": cut.target_len - cut.num_output,
        "kv_tokens": cut.kv_tokens,
        "kv_bytes": cut.kv_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "vocab_size": vocab_size,
    }, separators=(",", ":")).encode()


def decode_transfer_params(raw: bytes) -> dict[str, Any]:
    """The fields `encode_transfer_params` wrote; `MigrationRefused` when they are not the sim's."""
    try:
        params = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MigrationRefused(f"transfer_params are not the sim's JSON: {exc}") from None
    if not isinstance(params, dict) or params.get("format") != TRANSFER_PARAMS_FORMAT:
        raise MigrationRefused(f"transfer_params are not in the {TRANSFER_PARAMS_FORMAT} format")
    for key in ("lcg_state", "output_tokens", "target_output_len", "vocab_size"):
        if not isinstance(params.get(key), int):
            raise MigrationRefused(f"transfer_params lack an integer {key!r}")
    if not isinstance(params.get("stop_at_target"), bool):
        raise MigrationRefused("transfer_params lack a boolean 'stop_at_target'")
    return params


def ticket_for_cut(
    cut: MigrationCut,
    request: BackendRequest,
    output: tuple[int, ...],
    *,
    source_engine_id: str,
    backend: str,
    model: str,
    target: str,
    kv_bytes_per_token: int,
    vocab_size: int,
    cut_timestamp_s: float,
) -> MigrationTicket:
    """The ticket for `request` cut after `output` (every output token it produced, on every engine)."""
    sampling = request.sampling
    return MigrationTicket(
        request_id=request.request_id,
        source_engine_id=source_engine_id,
        target=target,
        backend=backend,
        model=model,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=output,
        sampling=sampling,
        remaining_tokens=sampling.max_tokens - len(output),
        kv_tokens=cut.kv_tokens,
        kv_bytes=cut.kv_bytes,
        transfer_params=encode_transfer_params(
            cut, kv_bytes_per_token=kv_bytes_per_token, vocab_size=vocab_size
        ),
        slo_ttft_s=request.slo_ttft_s,
        slo_tpot_s=request.slo_tpot_s,
        priority=request.priority,
        target_output_tokens=request.target_output_tokens,
        session_id=request.session_id,
        cut_timestamp_s=cut_timestamp_s,
    )


def cut_from_ticket(
    ticket: MigrationTicket, request_id: RequestId, *, backend: str, model: str, vocab_size: int
) -> MigrationCut:
    """The cut to resume as `request_id` on a `backend` engine serving `model`; else `MigrationRefused`."""
    if ticket.backend != backend:
        raise MigrationRefused(f"ticket of a {ticket.backend!r} backend cannot resume on a sim engine")
    if ticket.model != model:
        raise MigrationRefused(f"ticket for model {ticket.model!r} cannot resume on an engine serving "
                               f"{model!r}")
    params = decode_transfer_params(ticket.transfer_params)
    if params["vocab_size"] != vocab_size:
        raise MigrationRefused(f"ticket from a vocabulary of {params['vocab_size']} tokens; this engine "
                               f"draws from {vocab_size}")
    output = ticket.output_token_ids
    at_cut = params["output_tokens"]
    recompute = ticket.kv_tokens == 0
    if at_cut != len(output) and not (recompute and 0 < at_cut < len(output)):
        raise MigrationRefused(f"ticket has {len(output)} output tokens, its transfer_params {at_cut}"
                               + ("" if recompute else " (only a ticket without KV may carry more)"))
    if recompute and ticket.kv_bytes:
        raise MigrationRefused(f"ticket without KV tokens claims {ticket.kv_bytes} KV bytes")
    if ticket.remaining_tokens != ticket.sampling.max_tokens - len(output):
        raise MigrationRefused(f"ticket's remaining_tokens ({ticket.remaining_tokens}) is not max_tokens "
                               f"({ticket.sampling.max_tokens}) minus its {len(output)} output tokens")
    return MigrationCut(
        request_id=request_id,
        prompt_len=len(ticket.prompt_token_ids),
        num_output=at_cut,
        target_len=params["target_output_len"],
        stop_at_target=params["stop_at_target"],
        lcg_state=params["lcg_state"],
        kv_tokens=ticket.kv_tokens,
        kv_bytes=ticket.kv_bytes,
        after_cut=tuple(output[at_cut:]),
    )
