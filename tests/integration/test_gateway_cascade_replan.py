"""Re-planning a served cascade live (Cascadia §4.4, footnote 5): two sim pools (llama3-8b, llama3-70b), the
judge stub scoring from the quality profile, windows of 1 s. Shadowed requests run every stage unbilled; a
rate shift re-plans the thresholds off the event loop (GET /v1/cascades, the headers of later requests, the
metrics); a steady workload does not; bad `replan:` blocks are config errors."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from agent_process import Agent, cascade_pools
from scipy import stats
from test_gateway_cascade import ACCEPTED, ESCALATED, MAX_TOKENS, PROFILE, TURN_ONE, WEAK, metric_lines, stub

from gateway.app import HANDLERS_KEY, build_app, running
from gateway.cascade.judge_stub import STUB_COUNTS
from gateway.cascade.plan.bilevel import CascadePlan, PlanRequest
from gateway.cascade.quality import QualityProfile
from gateway.cascade.replanner import Planner
from gateway.config import ConfigError, GatewayConfig, build_config
from gateway.domain import EngineId, EngineRequest
from gateway.engines.grpc_client import GrpcEngineClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODELS = ("llama3-8b", "llama3-70b")


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, Agent]]:
    with cascade_pools(tmp_path_factory.mktemp("gateway-cascade-replan")) as pools:
        yield pools


class CountingClient(GrpcEngineClient):
    """The real gRPC client, counting the requests it sends per model (shadow dispatches included)."""

    def __init__(self, address: str, counts: Counter[str]) -> None:
        super().__init__(address)
        self.counts = counts

    def generate(self, request: EngineRequest) -> Any:
        self.counts[request.model] += 1
        return super().generate(request)


def cascade(judge_url: str, threshold: float, **replan: Any) -> dict[str, Any]:
    return {
        "name": "c",
        "judge": {"kind": "openai", "url": judge_url, "model": "judge"},
        "stages": [{"model": MODELS[0], "threshold": threshold}, {"model": MODELS[1]}],
        "replan": {"gpus": "h100:8", "q_min": 90, "shadow_share": 1.0, **replan},
    }


@contextlib.asynccontextmanager
async def gateway(
    agents: tuple[Agent, Agent], threshold: float, **replan: Any
) -> AsyncIterator[tuple[str, Any, Counter[str], Any]]:
    """The gateway serving cascade `c` with `replan`: (url, the app, engine requests per model, the stub)."""
    counts: Counter[str] = Counter()
    async with stub() as (judge_url, judge_app):
        config = GatewayConfig.model_validate({
            "port": 0,
            "engines": [a.target for a in agents],
            "cascades": [cascade(judge_url, threshold, **replan)],
        })
        clients = {EngineId(a.target): CountingClient(a.target, counts) for a in agents}
        app = build_app(config, engine_clients=clients)
        async with running(config, app=app, ready_engines=2) as url:
            yield url, app, counts, judge_app


async def post(http: aiohttp.ClientSession, url: str, index: int) -> tuple[dict[str, str], dict[str, Any]]:
    payload = {
        "model": "c",
        "messages": [{"role": "user", "content": PROFILE.items[index].questions[0]}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
    }
    async with http.post(f"{url}/v1/chat/completions", json=payload) as resp:
        assert resp.status == 200, await resp.text()
        return dict(resp.headers), await resp.json()


async def view(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/v1/cascades") as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["object"] == "list" and [c["name"] for c in body["data"]] == ["c"]
    return dict(body["data"][0])


async def paced(http: aiohttp.ClientSession, url: str, items: list[int], rate_rps: float) -> None:
    """Send `items` at `rate_rps`, each on its own (not waiting for the one before)."""
    tasks = []
    for index in items:
        tasks.append(asyncio.create_task(post(http, url, index)))
        await asyncio.sleep(1.0 / rate_rps)
    await asyncio.gather(*tasks)


async def until(check: Any, timeout_s: float = 20.0) -> Any:
    async with asyncio.timeout(timeout_s):
        while not (found := await check()):  # noqa: ASYNC110 (polling the gateway's HTTP view)
            await asyncio.sleep(0.05)
    return found


def value(lines: list[str], *labels: str) -> float:
    found = [line for line in lines if all(label in line for label in labels)]
    assert len(found) == 1, (labels, lines)
    return float(found[0].rsplit(" ", 1)[1])


async def test_shadowed_requests_run_every_stage_unbilled(agents: tuple[Agent, Agent]) -> None:
    async with gateway(agents, 90, rate_rps=1, window_s=600) as (url, _, counts, judge_app):
        async with aiohttp.ClientSession() as http:
            # Accepted at stage 0: the client pays for stage 0; the shadow runs llama3-70b and judges it.
            headers, body = await post(http, url, ACCEPTED)
            assert (headers["x-switchyard-cascade-stage"], headers["x-switchyard-cascade-thresholds"]) == (
                "0", "90")
            assert body["usage"]["completion_tokens"] == MAX_TOKENS
            assert len(body["usage"]["cascade"]["stages"]) == 1

            async def recorded(n: int) -> bool:
                return bool((await view(http, url))["replan"]["shadow"]["outcomes"].get("recorded") == n)

            await until(lambda: recorded(1))
            assert counts == {"llama3-8b": 1, "llama3-70b": 1}
            assert judge_app[STUB_COUNTS].rated == 2  # the client's verdict on stage 0, the shadow's on 1

            # Escalated: both stages ran for the client; the shadow only judges the live last stage's answer.
            headers, body = await post(http, url, ESCALATED)
            assert headers["x-switchyard-cascade-stage"] == "1"
            assert body["usage"]["completion_tokens"] == 2 * MAX_TOKENS
            await until(lambda: recorded(2))
            assert counts == {"llama3-8b": 2, "llama3-70b": 2}
            assert judge_app[STUB_COUNTS].rated == 4

            replan = (await view(http, url))["replan"]
            window = replan["window"]
            assert (window["arrivals"], window["shadowed"], window["answered"], window["shadow_rows"]) == (
                2, 2, 2, 2)
            assert replan["windows_closed"] == 0 and replan["replans"] == []
            tokens = await metric_lines(url, "switchyard_cascade_shadow_tokens_total")
            assert value(tokens, 'kind="completion"') == MAX_TOKENS  # one shadow dispatch (llama3-70b)
            assert value(tokens, 'kind="prompt"') > 0 and value(tokens, 'kind="judge"') > 0
            shadows = await metric_lines(url, "switchyard_cascade_shadow_requests_total")
            assert value(shadows, 'outcome="recorded"') == 2
            # The client's bill is its own stages: the engines' counts, nothing of the shadows'.
            requests = await metric_lines(url, "switchyard_requests_total")
            assert value(requests, 'model="c"') == 2


async def test_a_rate_shift_replans_off_the_loop_and_later_requests_use_the_new_thresholds(
    agents: tuple[Agent, Agent],
) -> None:
    # The configured 33.3 is no score level: a plan never picks it. 200 req/s planned, about 4 sent.
    async with gateway(agents, 33.3, rate_rps=200, window_s=1, min_shadow=4, sample_size=1000) as (
        url, app, _, _,
    ):
        replanner = app[HANDLERS_KEY].cascades.replanners["c"]
        solve: Planner = replanner.planner
        threads: list[int] = []

        def planner(request: PlanRequest, profile: QualityProfile) -> CascadePlan:
            threads.append(threading.get_ident())
            return solve(request, profile)

        replanner.planner = planner
        async with aiohttp.ClientSession() as http:
            await paced(http, url, TURN_ONE[:12], 4.0)

            async def replanned() -> dict[str, Any] | None:
                current = await view(http, url)
                return current if any(r["adopted"] for r in current["replan"]["replans"]) else None

            current = await until(replanned)
            record = next(r for r in current["replan"]["replans"] if r["adopted"])
            assert any(reason.startswith("rate ") for reason in record["reasons"]), record
            assert record["old_thresholds"] == [33.3] and record["new_thresholds"] != [33.3]
            assert 0 < sum(record["plan"]["gpus"]) <= 8 and record["plan"]["shapes"]
            assert record["solver_s"] > 0 and record["plan"]["request"]["rate_rps"] == record["rate_rps"]
            assert threads and threading.get_ident() not in threads  # Algorithm 1 ran in a worker thread
            adopted = [r["new_thresholds"] for r in current["replan"]["replans"] if r["adopted"]]
            assert current["thresholds"] == adopted[-1]
            assert current["replan"]["target"] == current["replan"]["replans"][-1]["plan"]

            replans = await metric_lines(url, "switchyard_cascade_replans_total")
            assert value(replans, 'cascade="c"') == len(adopted)
            gauge = await metric_lines(url, "switchyard_cascade_threshold")
            assert value(gauge, 'cascade="c"', 'stage="0"') == current["thresholds"][0]

            # A later request runs under the new threshold: pick an item the two thresholds route apart.
            new = current["thresholds"][0]
            low, high = sorted((33.3, new))
            apart = [i for i in TURN_ONE if low <= WEAK[i].score < high] or TURN_ONE
            headers, body = await post(http, url, apart[0])
            served = float(headers["x-switchyard-cascade-thresholds"])
            assert served != 33.3 and [served] in adopted
            stage = "0" if WEAK[apart[0]].score >= served else "1"
            assert headers["x-switchyard-cascade-stage"] == stage
            assert body["usage"]["cascade"]["answering_stage"] == int(stage)


def stratified(count: int) -> list[int]:
    """Turn-1 items spread evenly over llama3-8b's scores (their score distribution is the profile's)."""
    ranked = sorted(TURN_ONE, key=lambda i: (WEAK[i].score, i))
    return [ranked[(2 * k + 1) * len(ranked) // (2 * count)] for k in range(count)]


async def test_a_steady_workload_is_not_replanned(agents: tuple[Agent, Agent]) -> None:
    items = stratified(16)
    for model in MODELS:  # the items' scores are the profile's, as far as a test can tell
        scores = [PROFILE.scores(model)[i].score for i in items]
        assert stats.ks_2samp(scores, [s.score for s in PROFILE.scores(model)]).pvalue > 0.05
    # Lengths are left out (sample_size above a window's requests): the sim engines answer max_tokens
    # tokens, not the profile's lengths.
    async with gateway(agents, 90, rate_rps=4, window_s=1, alpha=1e-6, min_shadow=8, sample_size=1000) as (
        url, _, _, _,
    ):
        seen: set[str] = set()
        async with aiohttp.ClientSession() as http:

            async def watch() -> None:
                while True:
                    seen.update((await view(http, url))["replan"]["last_tests"])
                    await asyncio.sleep(0.2)

            watcher = asyncio.create_task(watch())
            try:
                await paced(http, url, items, 4.0)
                closed = (await view(http, url))["replan"]["windows_closed"]

                async def two_more() -> bool:
                    return bool((await view(http, url))["replan"]["windows_closed"] >= closed + 2)

                await until(two_more)
            finally:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
            current = await view(http, url)
        replan = current["replan"]
        assert replan["windows_closed"] >= 5
        assert replan["replans"] == [] and current["thresholds"] == [90]
        assert {"rate", "scores:llama3-8b", "scores:llama3-70b"} <= seen  # the rate and complexity tests ran
        assert replan["shadow"]["outcomes"] == {"recorded": len(items)}


@pytest.mark.parametrize(
    ("replan", "message"),
    [
        ({"gpus": "h100:8", "rate_rps": 2}, "cascades.0.replan: a re-plan needs q_min"),
        ({"gpus": "h100", "rate_rps": 2, "q_min": 90}, "cascades.0.replan: gpus 'h100': expected GPU:COUNT"),
        ({"gpus": "tpu:8", "rate_rps": 2, "q_min": 90}, "unknown GPU 'tpu'"),
        ({"gpus": "h100:8", "rate_rps": 0, "q_min": 90}, "cascades.0.replan.rate_rps: Input should be"),
        ({"gpus": "h100:8", "rate_rps": 2, "l_max_s": 1, "shadow_share": 2}, "replan.shadow_share"),
        ({"gpus": "h100:8", "rate_rps": 2, "q_min": 90, "window_s": 0}, "cascades.0.replan.window_s"),
        ({"gpus": "h100:8", "rate_rps": 2, "q_min": 90, "dataset": "gsm8k"}, "cascades.0.replan.dataset"),
        ({"gpus": "h100:8", "rate_rps": 2, "q_min": 90, "window": 5}, "cascades.0.replan.window: Extra"),
    ],
)
def test_bad_replan_blocks_are_config_errors(replan: dict[str, Any], message: str) -> None:
    c = {"name": "c", "judge": {"kind": "profile"}, "replan": replan,
         "stages": [{"model": MODELS[0], "threshold": 90}, {"model": MODELS[1]}]}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        build_config(cli={"cascades": [c]})


def test_replanning_needs_one_process_and_profiled_models(tmp_path: Any) -> None:
    c: dict[str, Any] = {
        "name": "c", "judge": {"kind": "profile"}, "replan": {"gpus": "h100:8", "rate_rps": 2, "q_min": 90},
        "stages": [{"model": MODELS[0], "threshold": 90}, {"model": MODELS[1]}],
    }
    with pytest.raises(ConfigError, match="re-plan in a one-process gateway"):
        build_config(cli={"workers": 2, "cascades": [c]})
    unprofiled = {**c, "stages": [{"model": "mistral-7b", "threshold": 90}, {"model": MODELS[1]}]}
    with pytest.raises(ConfigError, match="cascades.0.replan: no quality profile for model 'mistral-7b'"):
        build_app(build_config(cli={"cascades": [unprofiled]}))
    missing = {**c, "replan": {**c["replan"], "quality_profile": str(tmp_path / "none.json")}}
    with pytest.raises(ConfigError, match="cascades.0.replan: cannot read quality profile"):
        build_app(build_config(cli={"cascades": [missing]}))
