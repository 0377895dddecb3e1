"""The deployment's link security, run for real without Docker: `deploy/make-link-secrets.sh` makes the files,
a sim agent starts with the environment docker-compose.yml (token) or docker-compose.yml plus
deploy/compose.tls.yml (token and mutual TLS) gives it, the compose file's own healthcheck command probes it,
and the gateway's client, configured from the gateway service's environment, reaches it.

What stays unverified here: Compose itself (secret mounts at /run/secrets, the override merge); the merge is
approximated below the way Compose documents it (environment maps merge, secrets add up, healthcheck keys are
replaced one by one).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from agent_process import Agent

from gateway.config import EngineLinkConfig, build_config
from gateway.engines.grpc_link import load_engine_link
from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="deploy/make-link-secrets.sh needs openssl"),
]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "make-link-secrets.sh"
AGENT_PORT = "127.0.0.1:50051"


def load(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict)
    return doc


BASE = load(REPO / "docker-compose.yml")
TLS = load(REPO / "deploy" / "compose.tls.yml")


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The script's files, and /run/secrets as Compose would fill it: one file per secret name."""
    made = tmp_path_factory.mktemp("secrets")
    subprocess.run(["sh", str(SCRIPT), "--tls", str(made)], check=True, capture_output=True, timeout=60)
    run_secrets = made / "run-secrets"
    run_secrets.mkdir()
    for doc in (BASE, TLS):
        for name, spec in doc["secrets"].items():
            default = re.fullmatch(r"\$\{[A-Z_]+:-\./deploy/secrets/(?P<file>[\w.-]+)\}", spec["file"])
            assert default is not None, f"secret {name}: {spec['file']} is no ${{VAR:-./deploy/secrets/FILE}}"
            (run_secrets / name).symlink_to(made / default["file"])
    return run_secrets


def in_container(value: str, run_secrets: Path) -> str:
    return value.replace("/run/secrets/", f"{run_secrets}/")


def merged(service: str, *docs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"environment": {}, "secrets": [], "healthcheck": {}}
    for doc in docs:
        spec = doc["services"][service]
        out["environment"].update(spec.get("environment", {}))
        out["secrets"] += [s for s in spec.get("secrets", []) if s not in out["secrets"]]
        out["healthcheck"].update(spec.get("healthcheck", {}))
    return out


def healthcheck(service: dict[str, Any], agent: Agent, run_secrets: Path) -> subprocess.CompletedProcess[str]:
    cmd, python, flag, code = service["healthcheck"]["test"]
    assert (cmd, python, flag) == ("CMD", "python", "-c")
    code = in_container(code, run_secrets).replace(AGENT_PORT, agent.target)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)


def start_agent(tmp: Path, service: dict[str, Any], run_secrets: Path, **kwargs: Any) -> Agent:
    for secret in service["secrets"]:
        assert (run_secrets / secret).exists(), f"{secret} is used but not defined"
    env = dict(os.environ)
    env.update({k: in_container(str(v), run_secrets) for k, v in service["environment"].items()})
    return Agent.start(tmp, env=env, **kwargs)


def gateway_model(agent: Agent, config: EngineLinkConfig) -> str:
    """GetInfo through the channel credentials, options and metadata the gateway's client would use."""
    link = load_engine_link(config)
    channel = (
        grpc.insecure_channel(agent.target)
        if link.credentials is None
        else grpc.secure_channel(agent.target, link.credentials, options=list(link.channel_options))
    )
    with channel:
        info = pb_grpc.EngineAgentStub(channel).GetInfo(
            pb.GetInfoRequest(), metadata=link.metadata, timeout=10
        )
    return str(info.identity.model)


@pytest.fixture
def gateway_env(secrets: Path) -> Iterator[Any]:
    def env(*docs: dict[str, Any]) -> dict[str, str]:
        service = merged("gateway-gpus-4", *docs)
        for secret in service["secrets"]:
            assert (secrets / secret).exists(), f"{secret} is used but not defined"
        return {k: in_container(str(v), secrets) for k, v in service["environment"].items()}

    yield env


def test_script_keeps_what_exists_and_protects_keys(secrets: Path, tmp_path: Path) -> None:
    made = (secrets / "agent_link_token").resolve().parent
    token = (made / "agent-link-token").read_text()
    assert re.fullmatch(r"[0-9a-f]{64}\n", token)
    for name in ("agent-link-token", "agent.key", "gateway.key", "link-ca.key"):
        assert (made / name).stat().st_mode & 0o077 == 0, name
    again = subprocess.run(["sh", str(SCRIPT), str(made)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "kept" in again.stdout
    assert (made / "agent-link-token").read_text() == token
    tls_again = subprocess.run(["sh", str(SCRIPT), "--tls", str(made)], capture_output=True, text=True)
    assert tls_again.returncode == 1 and "exists" in tls_again.stderr


def test_compose_token_link(secrets: Path, tmp_path: Path, gateway_env: Any) -> None:
    service = merged("agent-2", BASE)
    agent = start_agent(tmp_path, service, secrets)
    try:
        assert healthcheck(service, agent, secrets).returncode == 0  # Check needs no token
        config = build_config(environ=gateway_env(BASE))
        assert config.engine_link.auth_token_file is not None and not config.engine_link.tls
        assert gateway_model(agent, config.engine_link)
        with pytest.raises(grpc.RpcError, match="UNAUTHENTICATED"):
            gateway_model(agent, config.engine_link.model_copy(update={"auth_token_file": None}))
        assert "bearer token required" in agent.log()
    finally:
        assert agent.terminate() == 0, agent.log()


def test_compose_mutual_tls_link(secrets: Path, tmp_path: Path, gateway_env: Any) -> None:
    service = merged("agent-3", BASE, TLS)
    probe = grpc.ssl_channel_credentials(
        *((secrets / n).read_bytes() for n in ("agent_link_ca", "agent_link_key", "agent_link_cert"))
    )
    agent = start_agent(tmp_path, service, secrets, credentials=probe)
    try:
        tls_check = healthcheck(service, agent, secrets)
        assert tls_check.returncode == 0, tls_check.stderr
        plain_check = healthcheck(merged("agent-3", BASE), agent, secrets)
        assert plain_check.returncode != 0  # the plaintext probe cannot reach a TLS agent
        config = build_config(environ=gateway_env(BASE, TLS))
        link = config.engine_link
        assert link.tls and link.tls_cert_file and link.auth_token_file
        # The gateway dials agent-3:50051; here it dials the loopback address, expecting the service's name.
        assert gateway_model(agent, link.model_copy(update={"tls_server_name": "agent-3"}))
        assert "mutual TLS" in agent.log() and "bearer token required" in agent.log()
    finally:
        assert agent.terminate() == 0, agent.log()


def test_every_agent_and_gateway_of_the_base_file_gets_the_link() -> None:
    for name in BASE["services"]:
        if name.startswith(("agent-", "gateway-")):
            assert "agent_link_token" in BASE["services"][name]["secrets"], name
            assert name in TLS["services"], f"deploy/compose.tls.yml leaves {name} out"
    assert set(TLS["services"]) <= set(BASE["services"])
