"""Decode rescheduling: which running request to move to which engine, as pure functions of a snapshot.

Owns: `star` (STAR's Algorithm 1: `StarParams`, `Migration`, `propose`, `StarRescheduler`) and
`length_stages` (CascadeInfer's stages, refinement, hand-over and bid-ask: `LengthStages`).
Must not: import asyncio, grpc, aiohttp, prometheus or `time`, read clocks or talk to engines; an executor
above this package carries a proposed migration out (cut on the source, pull on the target, stream splice).
"""

from gateway.rescheduling.length_stages import LengthStages, LengthStagesParams, Move, StagesPlanFile
from gateway.rescheduling.star import Migration, StarParams, StarRescheduler, propose

__all__ = ["LengthStages", "LengthStagesParams", "Migration", "Move", "StagesPlanFile", "StarParams",
           "StarRescheduler", "propose"]
