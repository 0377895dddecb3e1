"""GET /v1/plan: the configured CAUCHY plan next to the fleet's combos; a bad plan file is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fake_engines import FakeEngine, ok_script, serving

from gateway.config import ConfigError, build_config, load_plan_document
from launcher.planning_cli import plan


def write_plan(tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    assert plan(["--model", "llama3-8b", "--workload", "in=1000,out=500", "--slo", "ttft=1000,tpot=30",
                 "--goodput-rps", "15", "--gpus", "a100:6", "--json", str(path)]) == 0
    return path


async def test_plan_is_served_with_the_fleet_by_combo(tmp_path: Path) -> None:
    path = write_plan(tmp_path)
    engines = [FakeEngine("e0", ok_script(), combo="1xa100#0"),
               FakeEngine("e1", ok_script(), combo="1xa100#1"), FakeEngine("e2", ok_script())]
    async with serving(*engines, plan_file=str(path)) as client:
        response = await client.get("/v1/plan")
        assert response.status == 200
        body = await response.json()
    assert body["plan"] == json.loads(path.read_text())
    assert body["planned_combos"] == {"1xa100": 2}
    assert body["serving_combos"] == {"1xa100": 2}
    assert sorted(body["fleet"]) == ["", "1xa100#0", "1xa100#1"]
    assert body["fleet"]["1xa100#0"][0]["engine_id"] == "e0" and body["fleet"]["1xa100#0"][0]["serving"]
    assert body["autoscale"] is False


async def test_no_plan_is_a_404_in_openai_shape() -> None:
    async with serving(FakeEngine("e0", ok_script())) as client:
        response = await client.get("/v1/plan")
        assert response.status == 404
        error = (await response.json())["error"]
    assert error["code"] == "not_found" and "--plan" in error["message"]


def test_a_bad_plan_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "switchyard.plan/1", "model": "gpt-9"}')
    with pytest.raises(ConfigError, match="bad.json: plan: unknown model 'gpt-9'"):
        load_plan_document(str(bad))
    with pytest.raises(ConfigError, match="missing.json"):
        load_plan_document(str(tmp_path / "missing.json"))


async def test_with_autoscale_on_the_plan_shows_the_autoscalers_state(tmp_path: Path) -> None:
    path = write_plan(tmp_path)
    engines = [FakeEngine("e0", ok_script(), combo="1xa100#0"),
               FakeEngine("e1", ok_script(), combo="1xa100#1")]
    async with serving(*engines, plan_file=str(path), autoscale={"enabled": True, "step_s": 5}) as client:
        assert (await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]})).status == 200
        body = await (await client.get("/v1/plan")).json()
    scale = body["autoscale"]
    assert scale["actuator"] is None and scale["step_s"] == 5 and scale["actions"] == []
    assert scale["target_combos"] == {"1xa100": 2} and scale["params"]["local_window_s"] == 120
    assert [(c["label"], c["state"]) for c in scale["copies"]] == [("1xa100#0", "serving"),
                                                                  ("1xa100#1", "serving")]


@pytest.mark.parametrize(("config", "reason"), [
    ({"autoscale": {"enabled": True}}, "autoscale needs plan_file"),
    ({"autoscale": {"enabled": True}, "plan_file": "p.json", "workers": 2}, "one-process gateway"),
    ({"autoscale": {"local_window_s": 60, "global_window_s": 30}}, "local_window_s must be <="),
    ({"autoscale": {"ratio": 1.5}}, "autoscale.ratio"),
])
def test_autoscale_config_is_checked(config: dict[str, Any], reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        build_config(cli=config)
