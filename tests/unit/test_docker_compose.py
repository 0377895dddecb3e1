"""docker-compose.yml for GPU hosts: its structure (always, with PyYAML) and `docker compose config` (when the
`docker compose` v2 plugin is on this machine; no Docker engine is needed for `config`).

The file pins agent-N to GPU N and enables it in every profile gpus-M with M > N; gateway-gpus-M lists exactly
the agents of profile gpus-M. These tests hold it to that, parse the gateway's engine list with the gateway's
own config code, and check the Prometheus targets against the services.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import build_config

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
PROMETHEUS = REPO / "deploy" / "prometheus.yml"
MAX_GPUS = 8
AGENT_PORT = 50051
GATEWAY_PORT = 8000
MODEL_PATH = "/models/${SWITCHYARD_MODEL_NAME:-model}"


def load_compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())  # SafeLoader resolves the `<<` merge keys as Compose does
    assert isinstance(doc, dict)
    return doc


def services() -> dict[str, dict[str, Any]]:
    return load_compose()["services"]


def agent_names() -> list[str]:
    return sorted((n for n in services() if re.fullmatch(r"agent-\d+", n)), key=lambda n: int(n[6:]))


def active(profile: str) -> set[str]:
    """The services `docker compose --profile PROFILE` starts (no profiles = always)."""
    return {n for n, s in services().items() if not s.get("profiles") or profile in s["profiles"]}


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    return service["deploy"]["resources"]["reservations"]["devices"]


def gateway_environ(service: dict[str, Any]) -> dict[str, str]:
    env = service["environment"]
    assert isinstance(env, dict), "gateway environment must be a mapping"
    return {k: str(v) for k, v in env.items()}


# ---- structure (always) ----


def test_there_is_one_agent_per_gpu_each_pinned_to_its_own_device() -> None:
    names = agent_names()
    assert names == [f"agent-{i}" for i in range(MAX_GPUS)]
    seen: list[str] = []
    for i, name in enumerate(names):
        (device,) = gpu_devices(services()[name])
        assert device["driver"] == "nvidia"
        assert "gpu" in device["capabilities"]
        assert "count" not in device, "device_ids and count are mutually exclusive"
        assert device["device_ids"] == [str(i)]
        seen.extend(device["device_ids"])
    assert len(seen) == len(set(seen)), f"device ids shared between agents: {seen}"


def test_agents_run_the_vllm_backend_on_the_mounted_model() -> None:
    for name in agent_names():
        agent = services()[name]
        assert agent["command"] == [
            "python", "-m", "engine_agent", "--backend", "vllm", "--model", MODEL_PATH,
            "--host", "0.0.0.0", "--port", str(AGENT_PORT), "--engine-id", name,
            "--nixl-host", name, "--nixl-port", "5600",  # KV migration: peers reach the side channel by name
        ]  # fmt: skip
        (volume,) = agent["volumes"]
        # `${SWITCHYARD_MODEL_DIR:?message}` (required) mounted read-only where --model points.
        mount = re.fullmatch(r"\$\{SWITCHYARD_MODEL_DIR:\?[^}]+\}:(?P<target>.+):ro", volume)
        assert mount is not None, f"model mount {volume!r} is not a required, read-only SWITCHYARD_MODEL_DIR"
        assert mount["target"] == MODEL_PATH
        assert agent["build"]["dockerfile"] == "deploy/Dockerfile.agent"
        assert "VLLM_IMAGE" in agent["build"]["args"]


@pytest.mark.parametrize("gpus", range(1, MAX_GPUS + 1))
def test_profile_gpus_n_starts_n_agents_and_a_gateway_listing_exactly_them(gpus: int) -> None:
    running = active(f"gpus-{gpus}")
    agents = sorted(n for n in running if n.startswith("agent-"))
    gateways = [n for n in running if n.startswith("gateway")]
    assert agents == [f"agent-{i}" for i in range(gpus)]
    assert gateways == [f"gateway-gpus-{gpus}"]
    assert "prometheus" in running

    gateway = services()[gateways[0]]
    assert gateway["command"] == ["python", "-m", "gateway"]
    assert gateway["build"]["dockerfile"] == "deploy/Dockerfile.gateway"
    assert sorted(gateway["depends_on"]) == agents
    config = build_config(environ=gateway_environ(gateway))  # the gateway's own env parsing and validation
    assert config.engines == tuple(f"{a}:{AGENT_PORT}" for a in agents)
    assert (config.host, config.port) == ("0.0.0.0", GATEWAY_PORT)
    assert config.policy.name == "${SWITCHYARD_POLICY:-least_loaded}"  # interpolated by Compose, not here
    assert gateway["ports"] == [f"${{SWITCHYARD_PORT:-{GATEWAY_PORT}}}:{GATEWAY_PORT}"]
    assert gateway["networks"]["default"]["aliases"] == ["gateway"]


def test_every_gateway_variant_belongs_to_exactly_its_own_profile() -> None:
    gateways = sorted(n for n in services() if n.startswith("gateway"))
    assert gateways == sorted(f"gateway-gpus-{m}" for m in range(1, MAX_GPUS + 1))
    for name in gateways:
        assert services()[name]["profiles"] == [name.removeprefix("gateway-")]


def test_prometheus_targets_are_services_of_the_compose_file() -> None:
    prometheus = services()["prometheus"]
    assert "profiles" not in prometheus
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prometheus["volumes"]}
    assert (REPO / mounts["/etc/prometheus/prometheus.yml"]).resolve() == PROMETHEUS

    hosts = {n: GATEWAY_PORT for n in services() if n.startswith("gateway")}
    hosts["gateway"] = GATEWAY_PORT  # the alias every gateway variant carries
    hosts["localhost"] = 9090  # Prometheus itself
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = [
        (job["job_name"], job.get("metrics_path", "/metrics"), target)
        for job in config["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    ]
    assert ("switchyard-gateway", "/metrics", "gateway:8000") in targets
    for job, path, target in targets:
        host, port = target.rsplit(":", 1)
        assert host in hosts, f"{job}: target {target} is no service of docker-compose.yml"
        assert int(port) == hosts[host], f"{job}: {target} is not the port {host} serves HTTP on"
        assert path == "/metrics"


def test_images_and_build_context() -> None:
    agent = (REPO / "deploy" / "Dockerfile.agent").read_text()
    assert re.search(r"^ARG VLLM_IMAGE=\S+", agent, re.M)
    assert re.search(r"^FROM \$\{VLLM_IMAGE\}", agent, re.M)
    assert "[vllm]" in agent
    gateway = (REPO / "deploy" / "Dockerfile.gateway").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", gateway, re.M)
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".venv", ".git", "results", "**/__pycache__"} <= ignored


# ---- docker compose config (when the plugin is installed) ----


def _docker_compose_available() -> str | None:
    """None when `docker compose` works, else why not."""
    if shutil.which("docker") is None:
        return "docker is not on PATH"
    try:
        probe = subprocess.run(
            ["docker", "compose", "version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`docker compose version` failed: {exc}"
    if probe.returncode != 0:
        first_line = (probe.stderr.strip().splitlines() or ["no output"])[0]
        return f"`docker compose version` failed (no compose v2 plugin?): {first_line}"
    return None


def compose_config(tmp_path: Path, profile: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "SWITCHYARD_", "VLLM_IMAGE"))
    }
    environ.update(env)
    empty_env_file = tmp_path / "empty.env"  # keep a developer's .env out of the test
    empty_env_file.write_text("")
    return subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "--env-file", str(empty_env_file), "--profile", profile,
         "config"],
        cwd=REPO, env=environ, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.fixture
def docker_compose() -> None:
    reason = _docker_compose_available()
    if reason is not None:
        pytest.skip(f"docker compose v2 not available: {reason}")


@pytest.mark.usefixtures("docker_compose")
@pytest.mark.parametrize("gpus", [1, 2, MAX_GPUS])
def test_docker_compose_config_renders_the_stack(tmp_path: Path, gpus: int) -> None:
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    result = compose_config(tmp_path, f"gpus-{gpus}", SWITCHYARD_MODEL_DIR=str(model_dir))
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)["services"]
    always = {"prometheus", "grafana"}
    assert set(rendered) == {f"gateway-gpus-{gpus}", *always, *(f"agent-{i}" for i in range(gpus))}
    gateway_env = rendered[f"gateway-gpus-{gpus}"]["environment"]
    assert gateway_env["SWITCHYARD_GATEWAY_POLICY__NAME"] == "least_loaded"
    for i in range(gpus):
        agent = rendered[f"agent-{i}"]
        (device,) = gpu_devices(agent)
        assert device["driver"] == "nvidia"
        assert device["device_ids"] == [str(i)]
        assert "/models/model" in agent["command"]
        (volume,) = agent["volumes"]
        assert (volume["source"], volume["target"]) == (str(model_dir), "/models/model")
        assert volume["read_only"] is True


@pytest.mark.usefixtures("docker_compose")
def test_docker_compose_config_requires_the_model_dir(tmp_path: Path) -> None:
    result = compose_config(tmp_path, "gpus-1")
    assert result.returncode != 0
    assert "SWITCHYARD_MODEL_DIR" in result.stderr
