"""The discrete-event cluster simulator: the gateway's policies on a simulated fleet, in virtual time.

Owns: the public entry point `simulate(schedule, engines, options, *, progress=None) -> SimResult` and its
types `EngineSpec` / `parse_engines`, `SimOptions`, `SimResult`, `DeciderAssignment` / `DECIDER_ASSIGNMENTS`
(re-exported here; the modules are `spec`, `reports`, `fleet`, `deciders`, `runner`, and for STAR's
rescheduling `predictions`, `migrations` and `balance`).
Must not: implement routing, cluster accounting or engine behaviour of its own: it drives the shipped code.

Semantics
- Engines are `engine_agent.sim.engine.SimEngine` instances (invariant I2), one per engine of each
  `EngineSpec`, ids `{profile}-{i}` (numbered from 0 per profile), reporting the profile's model name, backend
  "sim" and an empty role, as live sim agents do. All use `SimOptions.seed`. Requests target the model of
  the first engine spec.
- Virtual time is the schedule's time line; results are relative to the first arrival. Engines connect
  `report_delay_s` + 1 ms before it. Events, in time order: iteration completions, then arrivals (at equal
  times completions go first), and timeline samples every `record_timeline_s`. Engines interact only through
  arrivals (dispatch, and the snapshot that reads their reports), so instead of one global heap the loop
  takes arrivals and samples as sync points and advances every engine through its completions up to each
  (the same order a heap would give, without a heap operation per iteration).
- An engine iterates back to back while it has work, as the real-time sim backend does: `step(t)` runs at
  the end of the previous iteration (or at the admission that wakes an idle engine) and its tokens and
  finishes are delivered at t + duration. A token's time is its delivery time: TTFT is first token minus
  arrival, `itl_s` the gaps between successive tokens (exact per token), E2E the finish minus arrival.
- Each arrival does what the live dispatcher does, through the same code (invariant I1): it builds
  `RequestFeatures` with `gateway.dispatch.features` (prompt estimate from the request's text or messages
  when it has them, else token ids of its exact length; a fresh `dispatch_seq`; `rand` from
  `random.Random(seed)`; the session record from the cluster state), takes `ClusterState.snapshot(now)`, calls
  the policy from `make_policy(policy, policy_params)`, then `note_dispatch`, and admits the request to the
  engine at once (no network delay on the request path). `note_finish` follows the finish. A policy that
  returns None gives a failed outcome "no engine available ..." (the gateway's 503); a request the engine
  refuses (e.g. prompt + max_tokens over its context) a failed outcome with the engine's message (the 400).
  Before routing, the arrival passes the gateway's admission gate (`SimOptions.admission`, on by default as
  live; `gateway.admission.core`): while the fleet's sequence slots are full it waits in the gateway's queue
  and is routed at the finish that frees a slot, or is shed (a failed outcome "fleet saturated ... (reason)",
  the gateway's 503) when the queue is full or its predicted wait misses its TTFT SLO.
- Requests with a forced output length get max_tokens = that length and ignore_eos; the others (a forced
  length of 0 counts as none) max_tokens = `max_output_tokens_default`, and the engine draws their length
  from its profile's distribution with its seed and the request id, exactly as a live sim agent does.
- What policies see is what they would see live: engine state reaches `ClusterState` only as `EngineReport`s
  built from `SimEngine.stats()` by the agent's translation (`reports.report_from_stats`), sent when the
  stream opens, at once after a significant change (the sim backend's rule: running, waiting or preempted
  counts change, or free KV moves by >= 1% of the cache) and `state_interval_s` after the previous send
  otherwise, and received `report_delay_s` after sending. Interval reports are delivered lazily: just before
  each snapshot the newest report sent by then - `report_delay_s` is handed over with its true receive time,
  which gives the snapshots every-report delivery would give (see `reports`). Between reports, the
  optimistic accounting of `ClusterState` covers what was dispatched.
- Gateway workers (`SimOptions.deciders`, the gateway's `--workers N`; `loadgen.simulate.deciders`): each
  arrival is assigned to one of N deciders (a seeded uniform draw, or a seeded hash of its session id), and
  everything above that is the gateway's (the snapshot, the policy, `rand`, `dispatch_seq`, the session
  record, `note_dispatch`, `note_finish`, `note_latency`) is that decider's own: its `ClusterState` knows only
  its own dispatches between reports. Every decider's state receives every report, at the same time. One
  decider is the single-process gateway, bit for bit.
- LENS (`engine_agent.sim.lens_adapter.SimLens`): every engine runs LENS's online model and reports its state
  vector (what `prism` reads) unless `lens_state` is off; it plans each iteration's token budget when
  `lens_planning` (or the engine spec's `:lens`) says so. Its refits run inline at iteration ends, so runs
  stay deterministic. `slo_ttft_s` / `slo_tpot_s` travel with every request (features and engine), and each
  finish is noted with `ClusterState.note_latency` (TTFT and E2E from the dispatch), as the live dispatcher
  does.
- STAR (`SimOptions.reschedule`, paper 003): engines push prediction rounds every k decode steps
  (`predictions`), each gateway worker runs the live rescheduler (`gateway.rescheduling.star.propose`) every
  `reschedule_interval_s` as a sync point of its own, under the live mover's limits, cuts with
  `SimEngine.migrate_out`, and follows each cut with the request life's splice decisions
  (`ChoiceLife.on_migrated` / `follow`) and the engine's migrated-request admission (`migrations`). A follow
  is a sync point too: when the source's iteration holding the cut's last token is delivered. The
  load-balance figures (migrations, splice stall, preemptions, peak KV, execution-time variance) are
  `balance`'s.
"""

from loadgen.simulate.deciders import DECIDER_ASSIGNMENTS, DeciderAssignment
from loadgen.simulate.runner import simulate
from loadgen.simulate.spec import EngineSpec, Scaling, SimOptions, SimResult, parse_engines

__all__ = [
    "Scaling",
    "DECIDER_ASSIGNMENTS",
    "DeciderAssignment",
    "EngineSpec",
    "SimOptions",
    "SimResult",
    "parse_engines",
    "simulate",
]
