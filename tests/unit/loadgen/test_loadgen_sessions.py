"""The `sessions` dataset: a shared system prompt, histories that grow turn by turn, planned arrivals,
ShareGPT or lognormal lengths, and the simulator seeing its prefix sharing."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from loadgen_testkit import FIXTURE_DATA

from loadgen.cli import main
from loadgen.datasets import Request, SessionSpec, TurnLengths, load_dataset, session_requests
from loadgen.datasets.mooncake import FIRST_ID, prompt_ids_of
from loadgen.datasets.sessions import AFTER_REQUEST_ID, MAX_TURN_TOKENS, THINK_TIME_S, TURN
from loadgen.results import read_results
from loadgen.simulate.fleet import PromptIds
from switchyard.prefix import block_keys

VOCAB = 8192


def ids_of(request: Request, vocab_size: int = VOCAB) -> tuple[int, ...]:
    hash_ids = request.metadata["hash_ids"]
    assert isinstance(hash_ids, tuple)
    return prompt_ids_of(hash_ids, request.prompt_tokens, vocab_size)


def by_session(requests: list[Request]) -> dict[str, list[Request]]:
    out: dict[str, list[Request]] = {}
    for request in requests:
        assert request.session_id is not None
        out.setdefault(request.session_id, []).append(request)
    return {sid: sorted(turns, key=lambda r: int(r.metadata[TURN])) for sid, turns in out.items()}  # type: ignore[call-overload]


SPEC = SessionSpec(sessions=5, turns_per_session=4, system_prompt_tokens=1024, think_time_s=2.0,
                   rate_per_s=0.5)


def test_every_session_opens_with_the_same_system_prompt_and_shares_nothing_after_it() -> None:
    requests = session_requests(SPEC, seed=1)
    firsts = [turns[0] for turns in by_session(requests).values()]
    assert len(firsts) == 5
    system = ids_of(firsts[0])[:1024]
    for request in requests:
        assert ids_of(request)[:1024] == system
    # Cache keys (16-token engine blocks) of two first turns agree exactly over the system prompt.
    keys = [block_keys(ids_of(r), 16) for r in firsts]
    for a in keys:
        for b in keys:
            if a is not b:
                assert a[:1024 // 16] == b[:1024 // 16] and a[1024 // 16] != b[1024 // 16]


def test_each_turn_is_the_previous_prompt_plus_its_planned_answer_plus_a_new_user_turn() -> None:
    sessions = by_session(session_requests(SPEC, seed=1))
    for sid, turns in sessions.items():
        assert [r.metadata[TURN] for r in turns] == list(range(len(turns)))
        assert AFTER_REQUEST_ID not in turns[0].metadata
        assert all(r.session_id == sid and r.metadata[THINK_TIME_S] == 2.0 for r in turns)
        for earlier, later in zip(turns, turns[1:], strict=False):
            assert later.metadata[AFTER_REQUEST_ID] == earlier.request_id
            assert earlier.output_tokens is not None
            user = later.prompt_tokens - earlier.prompt_tokens - earlier.output_tokens
            assert 1 <= user <= MAX_TURN_TOKENS
            assert ids_of(later)[:earlier.prompt_tokens] == ids_of(earlier)  # the history, verbatim
            assert later.arrival_s == earlier.arrival_s + 2.0  # type: ignore[operator]
    assert len(set(sessions)) == 5


def test_arrivals_are_sorted_session_starts_follow_the_rate_and_an_infinite_rate_starts_all_at_once() -> None:
    requests = session_requests(SPEC, seed=1)
    times = [r.arrival_s for r in requests]
    assert times == sorted(times)  # type: ignore[type-var]
    starts = sorted(turns[0].arrival_s for turns in by_session(requests).values())  # type: ignore[type-var]
    rng = np.random.default_rng([1, 0x5E55])
    assert starts == pytest.approx(np.concatenate(([0.0], np.cumsum(rng.gamma(1.0, 2.0, 4)))).tolist())
    burst = session_requests(SessionSpec(sessions=3, turns_per_session=2, think_time_s=0.0), seed=1)
    assert [r.arrival_s for r in burst] == [0.0] * 6
    assert [r.metadata[TURN] for r in burst] == [0, 0, 0, 1, 1, 1]  # a turn never precedes its predecessor


def test_the_seed_decides_everything() -> None:
    first, again = session_requests(SPEC, seed=3), session_requests(SPEC, seed=3)
    assert first == again and [r.metadata for r in first] == [r.metadata for r in again]
    other = session_requests(SPEC, seed=4)
    assert [r.prompt_tokens for r in other] != [r.prompt_tokens for r in first]
    # Another seed is fresh content, system prompt included: nothing of one run is cached for the other.
    blocks = [{h for r in run for h in r.metadata["hash_ids"]} for run in (first, other)]  # type: ignore[attr-defined]
    assert blocks[0] and blocks[1] and not blocks[0] & blocks[1]
    # Session s draws from its own stream: more sessions leave the first ones as they were.
    more = session_requests(dataclasses.replace(SPEC, sessions=7), seed=3)
    assert by_session(more)["session-3-0"] == by_session(first)["session-3-0"]


def test_token_ids_stay_inside_the_vocabulary() -> None:
    for request in session_requests(SPEC, seed=0):
        ids = ids_of(request, 64)
        assert len(ids) == request.prompt_tokens
        assert FIRST_ID <= min(ids) and max(ids) < 64


def test_lengths_come_from_sharegpt_when_the_data_root_has_it_else_from_the_lognormals() -> None:
    pools = TurnLengths.from_data_dir(FIXTURE_DATA)
    assert pools.user_tokens is not None and pools.answer_tokens is not None
    assert pools.describe() == {"user": "sharegpt-v3 (40)", "answer": "sarathi-sharegpt (200)"}
    spec = SessionSpec(sessions=6, turns_per_session=3, system_prompt_tokens=0)
    for turns in by_session(session_requests(spec, seed=2, lengths=pools)).values():
        assert turns[0].prompt_tokens in set(pools.user_tokens)
        for earlier, later in zip(turns, turns[1:], strict=False):
            assert earlier.output_tokens in set(pools.answer_tokens)
            assert earlier.output_tokens is not None
            user = later.prompt_tokens - earlier.prompt_tokens - earlier.output_tokens
            assert user in set(pools.user_tokens)
    assert TurnLengths.from_data_dir(None) == TurnLengths() == TurnLengths.from_data_dir(Path("/nonexistent"))
    assert TurnLengths().describe() == {"user": "lognormal", "answer": "lognormal"}
    users, answers = TurnLengths().draw(np.random.default_rng(0), 2000)
    assert users.min() >= 1 and answers.min() >= 1 and max(users.max(), answers.max()) <= MAX_TURN_TOKENS
    assert np.median(users) < np.median(answers)  # medians 62 and 320


def test_a_session_ends_before_a_turn_over_the_token_budget() -> None:
    spec = SessionSpec(sessions=20, turns_per_session=12, system_prompt_tokens=2048, max_session_tokens=4096)
    requests = session_requests(spec, seed=0)
    assert all(r.prompt_tokens + (r.output_tokens or 0) <= 4096 for r in requests)
    counts = [len(turns) for turns in by_session(requests).values()]
    assert len(counts) == 20 and min(counts) >= 1 and max(counts) < 12
    tight = session_requests(SessionSpec(sessions=4, system_prompt_tokens=512, max_session_tokens=514),
                             seed=0)
    assert [(r.prompt_tokens, r.output_tokens) for r in tight] == [(513, 1)] * 4  # first turns cut to fit


@pytest.mark.parametrize(("fields", "needle"), [
    ({"system_prompt_tokens": 2000}, "multiple of the 512"),
    ({"sessions": 0}, "sessions >= 1"),
    ({"turns_per_session": 0}, "turns_per_session >= 1"),
    ({"think_time_s": -1.0}, "think_time_s"),
    ({"think_time_s": math.inf}, "think_time_s"),
    ({"rate_per_s": 0.0}, "rate_per_s"),
    ({"max_session_tokens": 2049}, "no room"),
    ({"sessions": 5000}, "65536 blocks"),
])
def test_bad_parameters_are_refused(fields: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SessionSpec(**fields)  # type: ignore[arg-type]


def test_the_registry_generates_sessions_without_data_and_refuses_their_parameters_elsewhere() -> None:
    requests = load_dataset("sessions", None, num_requests=5, seed=0)
    assert len(requests) == 5 and all(r.arrival_s == 0.0 for r in requests)  # default: all sessions at t = 0
    assert load_dataset("sessions", None, seed=0, sessions=SPEC) == session_requests(SPEC, seed=0)
    with pytest.raises(ValueError, match="session parameters"):
        load_dataset("mooncake-conv", FIXTURE_DATA, sessions=SPEC)


def test_the_simulator_builds_the_prompts_live_replay_builds() -> None:
    request = session_requests(SPEC, seed=0)[-1]
    assert PromptIds().of(request) == ids_of(request, 32_000)  # the simulator's vocabulary


def test_simulated_kv_aware_routing_hits_the_shared_prefixes(tmp_path: Path) -> None:
    out = tmp_path / "sessions.json"
    argv = ["simulate", "--dataset", "sessions", "--data-dir", str(FIXTURE_DATA), "--sessions", "6",
            "--turns-per-session", "3", "--think-time-s", "1", "--rate", "2", "--engines", "h100-llama3-8b:2",
            "--policy", "kv_aware", "--no-plots", "--output", str(out)]
    assert main(argv) == 0
    results = read_results(out)
    assert results.summary["completed"] == 18
    assert results.summary["prefix_hit_rate"] > 0
    assert results.config["sessions"]["system_prompt_tokens"] == 2048
    assert results.config["arrivals"]["timestamps"] is True  # the planned arrivals are replayed
