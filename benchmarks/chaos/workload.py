"""Seeded requests for the chaos harness: what each request asks, how its client behaves, when it arrives.

Owns: `RequestSpec` and `build_workload`, a pure function of a `WorkloadConfig` (the same config gives the
same list): open-loop Poisson arrivals at `rate_rps`, and per request a prompt, a `max_tokens` and an
OpenAI `seed`, drawn from the request's content index (`index % pool_size`, so a soak can cycle a finite pool
whose references an undisturbed pass computed once), plus a client behaviour (read normally, read slowly, or
close after k content chunks) drawn per request.
Must not: do I/O, read clocks or know aiohttp.

Why the output is a function of the request: the sim engine draws a request's output length and token ids from
`blake2b(engine seed, "seed:<request seed>")` (`engine_agent.sim.engine.SimEngine.add_request`), and every
agent runs with the same engine seed (`--seed`, default 0) and profile; the prompt only changes prefill time
and KV.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

Behaviour = Literal["normal", "slow", "disconnect"]

_WORDS = (
    "switch yard engine token stream batch kernel router policy cache block queue latency decode prefill "
    "request model answer river mountain orange violet window garden letter number signal harbour lantern "
    "quiet rapid gentle brave simple careful ancient modern distant bright"
).split()


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    seed: int
    rate_rps: float
    duration_s: float
    max_tokens_min: int = 16
    max_tokens_max: int = 64
    slow_fraction: float = 0.02
    disconnect_fraction: float = 0.05
    pool_size: int | None = None  # distinct request contents; None: every request its own

    def __post_init__(self) -> None:
        if self.rate_rps <= 0 or self.duration_s <= 0:
            raise ValueError("rate_rps and duration_s must be positive")
        if not 1 <= self.max_tokens_min <= self.max_tokens_max:
            raise ValueError("need 1 <= max_tokens_min <= max_tokens_max")
        if (
            self.slow_fraction < 0
            or self.disconnect_fraction < 0
            or self.slow_fraction + self.disconnect_fraction > 1
        ):
            raise ValueError("slow_fraction and disconnect_fraction must be >= 0 and sum to at most 1")
        if self.pool_size is not None and self.pool_size < 1:
            raise ValueError("pool_size must be at least 1")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    content: int  # content index: requests with the same one ask the same thing (and get the same text)
    seed: int
    prompt: str
    max_tokens: int
    behaviour: Behaviour
    disconnect_after_chunks: int  # content chunks read before closing (behaviour "disconnect"), else 0
    arrival_s: float  # from the start of the pass

    def undisturbed(self) -> RequestSpec:
        """The same request read normally (what a reference pass sends)."""
        return RequestSpec(
            self.index, self.content, self.seed, self.prompt, self.max_tokens, "normal", 0, self.arrival_s
        )


def _content(seed: int, content: int, cfg: WorkloadConfig) -> tuple[int, str, int]:
    """(request seed, prompt, max_tokens) of a content index."""
    rng = random.Random(f"chaos-content:{seed}:{content}")
    words = [rng.choice(_WORDS) for _ in range(rng.randint(8, 40))]
    request_seed = rng.getrandbits(62)
    return request_seed, " ".join(words), rng.randint(cfg.max_tokens_min, cfg.max_tokens_max)


def build_workload(cfg: WorkloadConfig) -> list[RequestSpec]:
    arrivals = random.Random(f"chaos-arrivals:{cfg.seed}")
    behaviours = random.Random(f"chaos-behaviour:{cfg.seed}")
    specs: list[RequestSpec] = []
    t = arrivals.expovariate(cfg.rate_rps)
    index = 0
    while t < cfg.duration_s:
        content = index if cfg.pool_size is None else index % cfg.pool_size
        request_seed, prompt, max_tokens = _content(cfg.seed, content, cfg)
        draw = behaviours.random()
        behaviour: Behaviour = "normal"
        after = 0
        if draw < cfg.disconnect_fraction:
            behaviour = "disconnect"
            after = behaviours.randint(1, max(1, max_tokens // 2))
        elif draw < cfg.disconnect_fraction + cfg.slow_fraction:
            behaviour = "slow"
        specs.append(RequestSpec(index, content, request_seed, prompt, max_tokens, behaviour, after, t))
        index += 1
        t += arrivals.expovariate(cfg.rate_rps)
    return specs
