"""Start-up checks of the agent's ports: a taken NIXL side-channel port fails at once, naming the flag."""

from __future__ import annotations

import socket

import pytest

from engine_agent.config import AgentConfig, VllmConfig
from engine_agent.server import AgentStartupError, check_port_free, nixl_side_channel_port


def test_side_channel_port_defaults_to_agent_port_plus_1000() -> None:
    assert nixl_side_channel_port(AgentConfig(port=50051)) == 51051
    explicit = AgentConfig(port=50051, vllm=VllmConfig(nixl_side_channel_port=6000))
    assert nixl_side_channel_port(explicit) == 6000


def test_taken_port_is_refused_naming_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(AgentStartupError, match=rf"127\.0\.0\.1:{port}.*--nixl-port"):
            check_port_free("127.0.0.1", port, "the NIXL side channel", "--nixl-port")
    check_port_free("127.0.0.1", port, "the NIXL side channel", "--nixl-port")  # free again
