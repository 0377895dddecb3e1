"""Per-request state inside `SimEngine`: `Seq`, its scheduling states and how a migrant's KV arrives.

Owns: the mutable record the engine keeps for each request (`Seq`, slotted because `SimEngine.step` reads it
in its inner loop), the state constants (`WAITING`, `RUNNING`, `DONE`, `INCOMING`) and `MigrationLoad` (how a
migrated request's KV arrives, for `SimEngine.migration_stats`) and the per-request token generator
(`LCG_MUL`, `LCG_INC`, `MASK64`, `draw_token`: `SimEngine.step` inlines the same arithmetic in its loop).
Must not: schedule, time or decide anything (that is `engine_agent.sim.engine` and its migration half in
`engine_agent.sim.migration`); read clocks, sleep, do I/O or know asyncio.
"""

from __future__ import annotations

from engine_agent.domain import RequestId

MASK64 = (1 << 64) - 1
# Knuth's MMIX linear congruential generator; tokens come from its high bits.
LCG_MUL = 6364136223846793005
LCG_INC = 1442695040888963407


def draw_token(rng: int, token_range: int, excluded: tuple[int, ...]) -> tuple[int, int]:
    """(the generator's next state, the token it draws): one of `token_range` ids, skipping the sorted
    `excluded` ids (what `SimEngine.step` does for every non-EOS token)."""
    rng = (rng * LCG_MUL + LCG_INC) & MASK64
    token = (rng >> 33) % token_range
    for skipped in excluded:
        if token < skipped:
            break
        token += 1
    return rng, token


# INCOMING: a migrated request waiting for its KV blocks or for its modelled transfer to finish.
WAITING, RUNNING, DONE, INCOMING = 0, 1, 2, 3


class MigrationLoad:
    """How a migrated request's KV arrives on this engine (for `SimEngine.migration_stats`)."""

    __slots__ = ("kv_tokens", "kv_bytes", "transfer_s", "ready_s", "recomputed")

    def __init__(self, kv_tokens: int, kv_bytes: int, transfer_s: float) -> None:
        self.kv_tokens = kv_tokens
        self.kv_bytes = kv_bytes
        self.transfer_s = transfer_s
        self.ready_s = -1.0  # -1: blocks not allocated yet
        self.recomputed = 0


class Seq:
    """A request inside the engine. `num_tokens` = prompt + generated; `num_computed` of them are in KV."""

    __slots__ = ("request_id", "prompt_len", "target_len", "stop_at_target", "priority", "order", "arrival_s",
                 "state", "num_tokens", "num_computed", "num_output", "num_blocks", "prefill_end",
                 "reserved_blocks", "first_scheduled_s", "first_token_s", "rng", "excluded",
                 "token_range", "migration", "keys", "index_keys", "held", "hashed", "cached_tokens")

    def __init__(self, request_id: RequestId, prompt_len: int, target_len: int, stop_at_target: bool,
                 priority: int, order: int, arrival_s: float, rng: int, excluded: tuple[int, ...],
                 token_range: int) -> None:
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.target_len = target_len
        self.stop_at_target = stop_at_target
        self.priority = priority
        self.order = order
        self.arrival_s = arrival_s
        self.state = WAITING
        self.num_tokens = prompt_len
        self.prefill_end = prompt_len  # in prefill while num_computed < prefill_end
        self.num_computed = self.num_output = self.num_blocks = self.reserved_blocks = 0
        self.first_scheduled_s = self.first_token_s = -1.0  # -1: not yet
        self.rng = rng
        self.excluded = excluded  # sorted token ids never drawn
        self.token_range = token_range
        self.migration: MigrationLoad | None = None  # set on a request resumed by `add_migrated_request`
        # Prefix caching (`engine_agent.sim.prefix_cache`): the chain keys of the prompt's full KV blocks and
        # of its index blocks (empty: caching off, or a migrant), the keys whose cached blocks this request
        # holds, how many prompt blocks it has looked up or registered, and the prompt tokens its first
        # admission found cached (usage's cached_tokens).
        self.keys: list[int] = []
        self.index_keys: list[int] = []
        self.held: list[int] = []
        self.hashed = 0
        self.cached_tokens = 0
