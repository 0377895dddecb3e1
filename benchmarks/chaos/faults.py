"""Faults on a seeded schedule: kill-and-restart agents, stall one, and the log of what was done when.

Owns: `FaultPlan` (a pure function of the seed and the pass: kill times spaced uniformly in [kill_min_s,
kill_max_s], each with its victim; the stall's start and length; the stalled agent is the last one and is
never a kill victim) and `run_faults`, which executes a plan against the fleet on the monotonic clock:
SIGKILL, `down_s` later a restart on the same port (awaited until SERVING), SIGSTOP, `stall_s` later SIGCONT;
each act logged as a `FaultEvent` with the time it happened. A kill that would leave no agent both up and not
stalled waits until one is (so that "every request failed" is never the schedule's doing).
Must not: send requests or judge streams.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from benchmarks.chaos.fleet import AgentProc


@dataclass(frozen=True, slots=True)
class FaultEvent:
    kind: str  # kill, restarted, stall, resume, restart_failed
    agent: int
    address: str
    t_s: float  # time.monotonic()


@dataclass(frozen=True, slots=True)
class FaultPlan:
    kills: tuple[tuple[float, int], ...]  # (offset from the pass start, agent index)
    stall_agent: int | None
    stall_at_s: float
    stall_s: float
    down_s: float


def plan_faults(
    seed: int,
    duration_s: float,
    n_agents: int,
    *,
    kill_min_s: float,
    kill_max_s: float,
    down_s: float,
    stall_at_s: float | None,
    stall_s: float,
    kills: bool = True,
) -> FaultPlan:
    """Kills until `duration_s` minus the time a restart needs (`down_s` + 5 s); the stall at `stall_at_s`
    (None: no stall) on the last agent; kill victims drawn from the others (all agents when there is no
    stall)."""
    rng = random.Random(f"chaos-faults:{seed}")
    stall_agent = n_agents - 1 if stall_at_s is not None and stall_s > 0 else None
    victims = [i for i in range(n_agents) if i != stall_agent] or list(range(n_agents))
    planned: list[tuple[float, int]] = []
    t = rng.uniform(kill_min_s, kill_max_s)
    while kills and t < duration_s - down_s - 5.0:
        planned.append((round(t, 3), rng.choice(victims)))
        t += rng.uniform(kill_min_s, kill_max_s)
    return FaultPlan(
        tuple(planned), stall_agent, stall_at_s or 0.0, stall_s if stall_agent is not None else 0.0, down_s
    )


@dataclass
class FaultLog:
    events: list[FaultEvent] = field(default_factory=list)

    def note(self, kind: str, agent: AgentProc) -> FaultEvent:
        event = FaultEvent(kind, agent.index, agent.address, time.monotonic())
        self.events.append(event)
        return event


async def _sleep_until(t0: float, offset_s: float) -> None:
    delay = t0 + offset_s - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


def _healthy_others(agents: list[AgentProc], victim: AgentProc) -> int:
    return sum(1 for a in agents if a is not victim and a.up and not a.stopped)


async def _kills(plan: FaultPlan, agents: list[AgentProc], t0: float, log: FaultLog) -> None:
    for offset_s, index in plan.kills:
        await _sleep_until(t0, offset_s)
        victim = agents[index]
        # Polled: the condition is other processes' state (the stall task's SIGSTOP/SIGCONT), not an event.
        while not victim.up or _healthy_others(agents, victim) == 0:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        log.note("kill", victim)
        await victim.kill()
        await asyncio.sleep(plan.down_s)
        try:
            await victim.start()
        except Exception:  # logged and retried once: a fleet that lost an agent for good says so in the log
            log.note("restart_failed", victim)
            await victim.kill()
            await victim.start()
        log.note("restarted", victim)


async def _stall(plan: FaultPlan, agents: list[AgentProc], t0: float, log: FaultLog) -> None:
    if plan.stall_agent is None:
        return
    await _sleep_until(t0, plan.stall_at_s)
    agent = agents[plan.stall_agent]
    agent.stall()
    log.note("stall", agent)
    try:
        await asyncio.sleep(plan.stall_s)
    finally:
        agent.resume()
        log.note("resume", agent)


async def run_faults(plan: FaultPlan, agents: list[AgentProc], t0: float, log: FaultLog) -> None:
    """Execute `plan` from `t0` (a time.monotonic() reading); returns once every fault is undone."""
    async with asyncio.TaskGroup() as group:
        group.create_task(_kills(plan, agents, t0, log))
        group.create_task(_stall(plan, agents, t0, log))
