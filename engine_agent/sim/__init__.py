"""The simulated GPU engine: hardware and model catalogues, profiles, the performance model and `SimEngine`.

Owns: the one engine model (invariant I2) that the sim backend drives in real time and the discrete-event
simulator drives in virtual time.
Must not: import asyncio, grpc or the backends' drivers; read clocks; do I/O.
"""

from engine_agent.sim.engine import IterationBatch, IterationRecord, SimEngine, StepResult
from switchyard.hardware import GPUS, MODELS, GpuSpec, ModelShape
from switchyard.perf_model import (
    BatchShape,
    PerfCoefficients,
    batch_time_s,
    decode_attention_time_s,
    heterogeneity_factor,
    iteration_time_s,
)
from switchyard.profiles import Profile, UnknownProfileError, get_profile, known_profiles

__all__ = [
    "GPUS",
    "MODELS",
    "BatchShape",
    "GpuSpec",
    "IterationBatch",
    "IterationRecord",
    "ModelShape",
    "PerfCoefficients",
    "Profile",
    "SimEngine",
    "StepResult",
    "UnknownProfileError",
    "batch_time_s",
    "decode_attention_time_s",
    "get_profile",
    "heterogeneity_factor",
    "iteration_time_s",
    "known_profiles",
]
