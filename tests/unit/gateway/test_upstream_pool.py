"""The upstream connection pool's size is configuration (`upstream_max_connections`): it reaches each
upstream client's session, the environment can set it, and a pool of no connections is refused."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, GatewayConfig, build_config
from gateway.engines.openai_upstream import MAX_CONNECTIONS, OpenAIUpstreamClient


async def test_the_limit_reaches_the_session() -> None:
    default, sized = (
        OpenAIUpstreamClient("http://127.0.0.1:9"),
        OpenAIUpstreamClient("http://127.0.0.1:9", max_connections=12_000),
    )
    try:
        assert default._http().connector.limit == MAX_CONNECTIONS
        assert sized._http().connector.limit == 12_000
    finally:
        await default.close()
        await sized.close()


def test_config_default_environment_and_bounds() -> None:
    assert GatewayConfig().upstream_max_connections == MAX_CONNECTIONS
    env = {"SWITCHYARD_GATEWAY_UPSTREAM_MAX_CONNECTIONS": "10064"}
    assert build_config(file_path=None, environ=env, cli={}).upstream_max_connections == 10_064
    with pytest.raises(ConfigError, match="upstream_max_connections"):
        build_config(file_path=None, environ={}, cli={"upstream_max_connections": 0})
