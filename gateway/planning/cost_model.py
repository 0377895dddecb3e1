"""CAUCHY's cost-efficiency model (paper 004, §3.2, Eq. 1-15): tokens per dollar of a GPU combo, pure.

Owns: the model coefficients C1-C4 of a `ModelShape` (Eq. 1, 2, 6, 7, as printed: C3 counts four h x h
attention matrices, i.e. it ignores grouped-query attention's smaller K and V projections, while C4 uses the
KV heads), the phase throughputs (Eq. 5 prefill, Eq. 11 decode), the workload patterns A1 and A2 (Eq. 12-13),
the batch size B the decode side's KV cache holds, and two cost efficiencies of a combo:
- `ce_tokens_per_usd`, Eq. 14-15 as printed: the prefill side's input tokens per dollar plus the decode side's
  output tokens per dollar. It adds two rates, so it is blind to which phase is the bottleneck;
- `balanced`: requests per second of the slower phase at the workload's R_in:R_out (a disaggregated combo
  runs the phases on different GPUs at once; an aggregated one time-shares its GPUs between them), times
  R_in + R_out tokens, per dollar of the whole combo. Timed by the same roofline (Eq. 5, 11), not by a
  measured profile: goodput under an SLO comes from the simulator or from engines.
Must not: solve the allocation (that is `gateway.planning.ilp`), read engines, or do I/O.

Units: FLOP/s from TFLOPs x 1e12, bytes/s from GB/s x 1e9, prices in USD per GPU-hour; tokens per dollar are
tokens per second x 3600 / (USD per hour).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from switchyard.hardware import BYTES_PER_GB, GpuSpec, ModelShape

SECONDS_PER_HOUR = 3600.0
FLOPS_PER_TFLOP = 1e12
DEFAULT_MAX_NUM_SEQS = 256
# The share of GPU memory vLLM may use (its `gpu_memory_utilization` default).
DEFAULT_MEMORY_UTILIZATION = 0.9


class CostModelError(ValueError):
    """An input the model cannot price: a model that does not fit, a non-positive length or price."""


@dataclass(frozen=True, slots=True)
class Coefficients:
    """C1-C4 of Table 2's model (§3.2.1): FLOP and byte counts per token."""

    c1: float  # quadratic attention term, FLOP per token per prompt token (Eq. 1: 4lh)
    c2: float  # linear term, FLOP per token (Eq. 2: 8lh^2 + 6lhi)
    c3: float  # static weight bytes read per decode step (Eq. 6: d(2vh + (4h^2 + 3hi + 2h)l))
    c4: float  # KV-cache bytes per token (Eq. 7: 2dlks)


def coefficients(shape: ModelShape) -> Coefficients:
    layers, h, i, v = shape.num_layers, shape.hidden_size, shape.intermediate_size, shape.vocab_size
    k, s, d = shape.num_kv_heads, shape.head_dim, shape.dtype_bytes
    return Coefficients(
        c1=4 * layers * h,
        c2=8 * layers * h * h + 6 * layers * h * i,
        c3=d * (2 * v * h + (4 * h * h + 3 * h * i + 2 * h) * layers),
        c4=2 * d * layers * k * s,
    )


@dataclass(frozen=True, slots=True)
class Workload:
    """Mean tokens per request: R_in (prompt) and R_out (output)."""

    input_tokens: float
    output_tokens: float

    def __post_init__(self) -> None:
        if not (self.input_tokens > 0 and self.output_tokens > 0):
            raise CostModelError(
                f"token counts must be > 0, got in={self.input_tokens}, out={self.output_tokens}"
            )


@dataclass(frozen=True, slots=True)
class Side:
    """`count` GPUs of one type serving a phase (or both phases, in an aggregated combo) as one instance."""

    gpu: GpuSpec
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1:
            raise CostModelError(f"a side needs >= 1 GPU, got {self.count}")
        if not self.gpu.hourly_price_usd > 0:
            raise CostModelError(f"{self.gpu.name}: price must be > 0, got {self.gpu.hourly_price_usd}")

    @property
    def usd_per_hour(self) -> float:
        return self.count * self.gpu.hourly_price_usd

    @property
    def flops(self) -> float:
        return self.count * self.gpu.dense_bf16_tflops * FLOPS_PER_TFLOP

    @property
    def bytes_per_s(self) -> float:
        return self.count * self.gpu.memory_bandwidth_gb_s * BYTES_PER_GB

    @property
    def label(self) -> str:
        return f"{self.count}x{self.gpu.name}"


def with_prices(gpus: Mapping[str, GpuSpec], prices: Mapping[str, float]) -> dict[str, GpuSpec]:
    """The catalogue with some hourly prices replaced (`--price GPU=USD`); unknown names raise, listing the
    known ones."""
    unknown = sorted(set(prices) - set(gpus))
    if unknown:
        raise CostModelError(f"unknown GPU {', '.join(unknown)}; known: {', '.join(sorted(gpus))}")
    bad = {name: p for name, p in prices.items() if not (p > 0 and math.isfinite(p))}
    if bad:
        raise CostModelError(f"prices must be > 0: {', '.join(f'{n}={p}' for n, p in sorted(bad.items()))}")
    return {name: dataclasses.replace(gpu, hourly_price_usd=prices.get(name, gpu.hourly_price_usd))
            for name, gpu in gpus.items()}


def kv_tokens(shape: ModelShape, side: Side, memory_utilization: float = DEFAULT_MEMORY_UTILIZATION) -> float:
    """Tokens of KV cache the side holds: its usable memory less the weights, over the KV bytes per token."""
    usable = side.count * side.gpu.memory_gb * BYTES_PER_GB * memory_utilization
    return max(usable - shape.weight_bytes, 0.0) / coefficients(shape).c4


def batch_size(shape: ModelShape, side: Side, workload: Workload, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
               memory_utilization: float = DEFAULT_MEMORY_UTILIZATION) -> int:
    """B = min(max_num_seqs, KV tokens / (R_in + R_out)): the requests a side decodes at once.
    `CostModelError` when not one request fits."""
    per_request = workload.input_tokens + workload.output_tokens
    fits = math.floor(kv_tokens(shape, side, memory_utilization) / per_request)
    if fits < 1:
        raise CostModelError(f"{shape.name} with {workload.input_tokens:g}+{workload.output_tokens:g} tokens "
                             f"per request does not fit on {side.label}")
    return min(max_num_seqs, fits)


def prefill_tokens_per_s(c: Coefficients, side: Side, workload: Workload) -> float:
    """Eq. 5: S_prefill = GPU_n * GPU_f / (C1 R_in + C2)."""
    return side.flops * a1(c, workload)


def decode_tokens_per_s(c: Coefficients, side: Side, workload: Workload, batch: int) -> float:
    """Eq. 11: S_decode = GPU_n * GPU_b / (C4 R_out / 2 + C4 R_in + C3 / B)."""
    return side.bytes_per_s * a2(c, workload, batch)


def a1(c: Coefficients, workload: Workload) -> float:
    """Eq. 12: the prefill workload pattern, 1 / (C1 R_in + C2)."""
    return 1.0 / (c.c1 * workload.input_tokens + c.c2)


def a2(c: Coefficients, workload: Workload, batch: int) -> float:
    """Eq. 13: the decode workload pattern, 1 / (C4 R_out / 2 + C4 R_in + C3 / B)."""
    return 1.0 / (c.c4 * workload.output_tokens / 2 + c.c4 * workload.input_tokens + c.c3 / batch)


@dataclass(frozen=True, slots=True)
class ComboCost:
    """One combo priced for one model and workload. `prefill is None`: aggregated (`decode` serves both)."""

    prefill: Side | None
    decode: Side
    batch: int  # B on the decode side
    prefill_tokens_per_s: float  # S_prefill of the side that prefills
    decode_tokens_per_s: float  # S_decode of the side that decodes
    usd_per_hour: float
    ce_tokens_per_usd: float  # Eq. 14-15
    balanced_requests_per_s: float
    balanced_tokens_per_usd: float

    @property
    def aggregated(self) -> bool:
        return self.prefill is None


def price_combo(shape: ModelShape, workload: Workload, decode: Side, prefill: Side | None = None, *,
                max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                memory_utilization: float = DEFAULT_MEMORY_UTILIZATION) -> ComboCost:
    """Eq. 14-15 and the balanced CE of a combo: `prefill` GPUs then `decode` GPUs, or one aggregated pool
    (`prefill` None). The prefill side must hold the weights too (`CostModelError` otherwise)."""
    c = coefficients(shape)
    batch = batch_size(shape, decode, workload, max_num_seqs, memory_utilization)
    pre = prefill or decode
    if prefill is not None:
        batch_size(shape, prefill, workload, max_num_seqs, memory_utilization)  # the weights must fit there
    s_pre = prefill_tokens_per_s(c, pre, workload)
    s_dec = decode_tokens_per_s(c, decode, workload, batch)
    # Eq. 14: each phase's tokens per second over its own GPUs' price (aggregated: both over the one pool).
    ce = (s_pre / pre.usd_per_hour + s_dec / decode.usd_per_hour) * SECONDS_PER_HOUR
    prefill_rps, decode_rps = s_pre / workload.input_tokens, s_dec / workload.output_tokens
    if prefill is None:  # one pool time-shares the phases: a request costs both phases' time
        rps = 1.0 / (1.0 / prefill_rps + 1.0 / decode_rps)
        usd = decode.usd_per_hour
    else:  # two pools run at once: the slower bounds the combo
        rps = min(prefill_rps, decode_rps)
        usd = prefill.usd_per_hour + decode.usd_per_hour
    tokens_per_usd = rps * (workload.input_tokens + workload.output_tokens) * SECONDS_PER_HOUR / usd
    return ComboCost(prefill, decode, batch, s_pre, s_dec, usd, ce, rps, tokens_per_usd)


@dataclass(frozen=True, slots=True)
class GpuEfficiency:
    """Table 1's derived columns for one GPU."""

    name: str
    tflops_per_bandwidth: float  # TFLOPs / (GB/s)
    tflop_per_usd: float  # TFLOP per dollar: TFLOPs x 3600 / price
    gb_per_usd: float  # GB moved per dollar: GB/s x 3600 / price
    recommended: str  # "prefill" | "aggregated" | "decode", by TFLOPs/BW (§1, Table 1)


# Table 1's "recommended deployment" by TFLOPs per GB/s: H800 0.30 and A10 0.21 prefill, RTX4090 and A800 0.16
# aggregated, MI210 0.11 and H20 0.04 decode. The table gives no rule; these thresholds reproduce its six
# rows. (Table 1 prints 0.21 for the RTX4090, but its own 165 TFLOPs / 1008 GB/s is 0.16, and its TFLOP/$
# column, 861K, follows from 165.)
_PREFILL_ABOVE = 0.18
_DECODE_BELOW = 0.13


def gpu_efficiency(gpu: GpuSpec) -> GpuEfficiency:
    ratio = gpu.dense_bf16_tflops / gpu.memory_bandwidth_gb_s
    role = "prefill" if ratio > _PREFILL_ABOVE else ("decode" if ratio < _DECODE_BELOW else "aggregated")
    return GpuEfficiency(
        name=gpu.name,
        tflops_per_bandwidth=ratio,
        tflop_per_usd=gpu.dense_bf16_tflops * SECONDS_PER_HOUR / gpu.hourly_price_usd,
        gb_per_usd=gpu.memory_bandwidth_gb_s * SECONDS_PER_HOUR / gpu.hourly_price_usd,
        recommended=role,
    )
