"""Decode rescheduling: which running request to move to which engine, as pure functions of a snapshot.

Owns: `star` (STAR's Algorithm 1: `StarParams`, `Migration`, `propose`).
Must not: import asyncio, grpc, aiohttp, prometheus or `time`, read clocks or talk to engines; an executor
above this package carries a proposed migration out (cut on the source, pull on the target, stream splice).
"""

from gateway.rescheduling.star import Migration, StarParams, propose

__all__ = ["Migration", "StarParams", "propose"]
