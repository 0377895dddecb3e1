"""Disaggregated serving in the request life (CAUCHY): new requests go to prefill (or whole-request) engines,
never to decode engines while another role serves; a prefill engine's ticket resumes on a decode engine of its
combo, else of another combo, else where a migration would; the membership memo follows role changes."""

from __future__ import annotations

from dataclasses import replace

from builders import engine, snapshot

from gateway.cluster.state import ClusterState
from gateway.dispatch.features import RoutingHints
from gateway.dispatch.life import ChoiceLife, Dispatch, Follow, Moment, decode_only
from gateway.domain import ChatTurn, EngineId, EngineReport, EngineRequest, EngineView, MigrationTicket
from gateway.policies.goodput_rr import GoodputRRParams, GoodputRRPolicy
from gateway.policies.least_loaded import LeastLoadedPolicy
from gateway.policies.round_robin import RoundRobinPolicy

REQUEST = EngineRequest(request_id="r1", model="m", messages=(ChatTurn("user", "hi"),), max_tokens=50)
HINTS = RoutingHints(arrival_s=1.0)


def fleet(*views: EngineView) -> Moment:
    return Moment(now_s=1.0, dispatch_seq=0, rand=0.0, snapshot=snapshot(*views))


P0 = engine("p0", role="prefill", combo="1xh800+2xh20#0")
D0 = engine("d0", role="decode", combo="1xh800+2xh20#0")
D0B = engine("d0b", role="decode", combo="1xh800+2xh20#0")
P1 = engine("p1", role="prefill", combo="1xh800+2xh20#1")
D1 = engine("d1", role="decode", combo="1xh800+2xh20#1")
AGG = engine("agg", combo="1xa800#0")


def routed(moment: Moment, policy: object = None, rounds: int = 40) -> set[EngineId]:
    """Every engine a new request was routed to over `rounds` dispatch counters."""
    out: set[EngineId] = set()
    for seq in range(rounds):
        life = ChoiceLife(REQUEST, HINTS)
        decision = life.route(policy or RoundRobinPolicy(), replace(moment, dispatch_seq=seq))
        assert isinstance(decision, Dispatch)
        out.add(decision.engine_id)
    return out


def test_new_requests_skip_decode_engines_while_another_role_serves() -> None:
    assert routed(fleet(P0, D0, D0B, P1, D1, AGG)) == {"p0", "p1", "agg"}
    assert routed(fleet(P0, D0, D0B)) == {"p0"}
    # Once no prefill or whole-request engine serves, decode engines take whole requests (better than none).
    assert routed(fleet(replace(P0, ready=False), D0, D0B)) == {"d0", "d0b"}
    assert routed(fleet(D0, D1)) == {"d0", "d1"}


def handed_off(moment: Moment, source: str = "p0", policy: object = None) -> Follow:
    life = ChoiceLife(REQUEST, HINTS)
    first = life.route(RoundRobinPolicy(), replace(moment, dispatch_seq=0))
    assert isinstance(first, Dispatch)
    life.current = replace(first, engine_id=EngineId(source))  # it went to the engine under test
    life.on_first_event(1.0)
    life.on_token(1.0)
    life.on_migrated(MigrationTicket(request_id="r1", source_engine_id=str(source), target="",
                                     output_tokens=1, kv_tokens=20, kv_bytes=100))
    life.on_closed()
    step = life.follow(policy or LeastLoadedPolicy(), moment)
    assert isinstance(step, Follow) and step.skip_tokens == 0 and not step.recompute
    return step


def test_a_prefill_ticket_resumes_on_a_decode_engine_of_its_combo() -> None:
    busy = replace(D0, inflight_tokens=900)
    step = handed_off(fleet(P0, busy, D0B, P1, D1, AGG))
    # Least loaded would pick d1 or agg fleet-wide; the hand-off stays in the combo (d0b is the idler there).
    assert step.handoff and step.dispatch.engine_id == "d0b"


def test_a_hand_off_falls_back_to_another_combo_then_to_where_a_migration_would() -> None:
    gone = replace(D0, ready=False), replace(D0B, ejected=True)
    step = handed_off(fleet(P0, *gone, P1, D1, AGG))
    assert step.handoff and step.dispatch.engine_id == "d1"
    # No decode engine at all: the policy's pick among the others (a whole-request engine here).
    step = handed_off(fleet(P0, *gone, P1, replace(D1, ready=False), AGG), policy=RoundRobinPolicy())
    assert step.handoff and step.dispatch.engine_id in ("agg", "p1")
    # Nothing else: the source itself resumes it (it decodes what it was to hand off).
    alone = handed_off(fleet(P0, *gone))
    assert alone.handoff and alone.dispatch.engine_id == "p0"


def test_a_ticket_from_any_other_engine_is_a_migration_not_a_hand_off() -> None:
    step = handed_off(fleet(P0, D0, AGG, engine("x")), source="x")
    assert not step.handoff


def report(engine_id: str, role: str, seq: int = 1) -> EngineReport:
    return EngineReport(engine_id=EngineId(engine_id), model="m", profile="h100-llama3-8b", backend="sim",
                        role=role, seq=seq, engine_timestamp_s=0.0, ready=True, draining=False, num_running=0,
                        num_waiting=0, kv_blocks_total=1000, kv_blocks_free=500, kv_blocks_reserved=0,
                        pending_prefill_tokens=0, running_batch_tokens=0)


def test_decode_only_is_memoised_by_membership_and_roles_renew_it() -> None:
    state = ClusterState(stale_after_s=1e9)
    for engine_id in ("a", "b"):
        state.add_engine(EngineId(engine_id), 0.0)
        state.on_connect(EngineId(engine_id))
    state.on_report(EngineId("a"), report("a", "prefill"), 0.1)
    state.on_report(EngineId("b"), report("b", "decode"), 0.1)
    first = state.snapshot(0.2)
    assert decode_only(first, "m") == {"b"} and decode_only(first, "m") is decode_only(first, "m")
    state.on_report(EngineId("b"), report("b", "", seq=2), 0.3)  # the decode engine now serves whole requests
    second = state.snapshot(0.3)
    assert second.membership != first.membership
    assert decode_only(second, "m") == frozenset()


def test_in_place_execution_uses_idle_engines_of_a_disaggregated_combo() -> None:
    opportunistic = GoodputRRPolicy(GoodputRRParams(intra="opportunistic"))
    strict = GoodputRRPolicy(GoodputRRParams(intra="rr"))
    assert opportunistic.in_place and not strict.in_place
    busy_p0 = replace(P0, inflight_requests=3, inflight_tokens=3000)
    # A new request: an idle decode engine may serve it whole (it is the least loaded); a busy one may not.
    assert routed(fleet(busy_p0, D0, replace(D0B, num_running=2)), opportunistic) == {"d0"}
    assert routed(fleet(busy_p0, D0, D0B), strict) == {"p0"}
    # A hand-off: the prefill engine is a candidate too, and keeps it when it is the least loaded ...
    busy = replace(D0, inflight_requests=5, inflight_tokens=5000), replace(D0B, inflight_tokens=800)
    kept = handed_off(fleet(P0, *busy), policy=opportunistic)
    assert kept.handoff and kept.dispatch.engine_id == "p0"
    # ... but not when a decode engine is less loaded, nor under a strict policy.
    loaded = replace(P0, inflight_requests=2, inflight_tokens=3000)
    assert handed_off(fleet(loaded, *busy), policy=opportunistic).dispatch.engine_id == "d0b"
    assert handed_off(fleet(P0, *busy), policy=strict).dispatch.engine_id in ("d0", "d0b")
