"""Test helper: socket options of this process's own TCP sockets (Linux: /proc/self/fd)."""

from __future__ import annotations

import os
import socket
from typing import Any


def tcp_nodelay_of_socket(*, local: Any = None, peer: Any = None) -> int:
    """TCP_NODELAY of this process's TCP socket with that local or peer address."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue  # not a socket
        with sock:
            try:
                if sock.type != socket.SOCK_STREAM:
                    continue
                if (local is not None and sock.getsockname() == local) or (
                    peer is not None and sock.getpeername() == peer
                ):
                    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            except OSError:
                continue
    raise LookupError(f"no socket with local {local} / peer {peer}")
