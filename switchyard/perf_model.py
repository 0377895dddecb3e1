"""The simulated GPU's iteration time: a roofline over one continuous-batching iteration.

Owns: the pure formulas that turn a batch's shape (tokens, context lengths) into seconds, the per-profile
coefficients they need (`PerfCoefficients`), and the length-heterogeneity factor for decode attention.
Must not: schedule, hold request state, read clocks or draw random numbers.

The model (every term in seconds; work is split evenly over the tensor-parallel group of `tp` GPUs):

    time = overhead + linear + prefill_attention + heterogeneity * decode_attention + all_reduce

    overhead           = iteration_overhead_s + per_seq_overhead_s * num_seqs                (CPU side)
    linear             = max(2 * matmul_params * num_tokens / F,  weight_bytes / B)
                         (every weight is read once per iteration; GEMM FLOPs scale with the batched tokens)
    prefill_attention  = max(4 * L * q_dim * pairs / F,  kv_bytes_per_token * (prior + prefill_tokens) / B)
                         pairs = sum over chunks of c * p + c * (c + 1) / 2  (c new tokens after p computed
                         ones, causal); prior = sum of p (cached context read; the new tokens are written)
    decode_attention   = max(4 * L * q_dim * S / F,  kv_bytes_per_token * S / B),  S = sum of decode contexts
    all_reduce         = 2 * L * (latency + 2 * (tp - 1) / tp * num_tokens * hidden * dtype_bytes / link)
                         (two ring all-reduces per layer, attention and MLP outputs; 0 when tp == 1)
    F = tp * peak FLOP/s * compute_efficiency,  B = tp * bandwidth * memory_efficiency

Pipeline parallelism (pp > 1 stages of tp GPUs; Cascadia App. B): the batch is split into m = min(pp, seqs)
micro-batches kept in flight (at most one per stage), so every stage is busy and each sequence gets one token
per round trip of its micro-batch through all stages. A micro-batch of 1/m of the batch passes stage s in its
share of the full-model time (its layers' weights, FLOPs and all-reduces), so the round trip is the whole
model's time for 1/m of the batch plus one activation hand-over per stage boundary:

    time(pp) = time(batch / m) + (pp - 1) * (p2p_latency + num_tokens / m * hidden * dtype_bytes / link)

where batch / m divides every count and sum of the batch (sequences, tokens, attention pairs, contexts; the
longest context stays) and time(...) is the single-pass formula above on tp GPUs. Each step of the engine is
then one round (one token per sequence), so pp gives data-parallel-like throughput (m smaller batches at once)
at the latency of one full pass, and more KV room (weights split over stages; `switchyard.profiles`). The
hand-over uses the GPU's `interconnect_gb_s` and, as its latency, `allreduce_latency_s` (one send, the same
order as a small all-reduce). The CPU overhead is paid once per micro-batch pass. At pp = 1 the result is the
single-pass formula, bit for bit.

The counts may be floats (means): the planner's analytic stage model (`gateway/cascade/plan/stage_latency.py`)
times a steady-state mean batch with the same formula the simulated GPU steps with.

Linear layers and attention are separate kernels, so each gets its own roofline and the two add up; this makes
an iteration's "attention part" a term of its own, which the heterogeneity factor multiplies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from switchyard.profiles import Profile


def heterogeneity_factor(num_seqs: float, context_sum_tokens: float, context_max_tokens: float, alpha: float,
                         cap: float) -> float:
    """Slowdown of decode attention for a batch of mixed context lengths, relative to a homogeneous batch.

    Attention kernels tile each sequence and wait on the longest one (CascadeInfer §2.3), so the effective
    work is a blend of the useful tokens sum(len) and the padded-to-max tokens n * max(len):

        effective = (1 - alpha) * sum(len) + alpha * n * max(len)
        factor    = min(effective / sum(len), cap) = min(1 + alpha * (n * max / sum - 1), cap)

    It is 1 for equal lengths and grows with dispersion; CascadeInfer measures 1.1-2.1x, hence alpha = 0.3
    (a half short, half long batch gives about 1.3) and cap = 2.1.
    """
    if num_seqs <= 1 or context_sum_tokens <= 0:
        return 1.0
    factor = 1.0 + alpha * (num_seqs * context_max_tokens / context_sum_tokens - 1.0)
    return cap if factor > cap else factor


@dataclass(frozen=True, slots=True)
class PerfCoefficients:
    """A profile's performance model reduced to per-unit costs (seconds per FLOP, per byte, per token)."""

    overhead_s: float
    per_seq_overhead_s: float
    s_per_flop: float
    s_per_byte: float
    linear_flops_per_token: float
    weight_bytes: float
    attention_flops_per_pair: float
    kv_bytes_per_token: float
    allreduce_fixed_s: float  # 2 * L * latency
    allreduce_s_per_token: float  # 2 * L * 2 * (tp - 1) / tp * hidden * dtype_bytes / link bytes/s
    heterogeneity_alpha: float
    heterogeneity_cap: float
    # Pipeline parallelism (module docstring): stages, and the hand-over cost per stage boundary.
    pipeline_parallel: int = 1
    p2p_fixed_s: float = 0.0  # latency of one activation send between stages
    p2p_s_per_token: float = 0.0  # hidden * dtype_bytes / link bytes/s

    @classmethod
    def from_profile(cls, profile: Profile) -> Self:
        model, gpu, tp = profile.model, profile.gpu, profile.tensor_parallel
        flops_per_s = tp * gpu.dense_bf16_tflops * 1e12 * profile.compute_efficiency
        bytes_per_s = tp * gpu.memory_bandwidth_gb_s * 1e9 * profile.memory_efficiency
        if tp > 1:
            allreduce_fixed_s = 2 * model.num_layers * gpu.allreduce_latency_s
            ring_bytes_per_token = 2.0 * (tp - 1) / tp * model.hidden_size * model.dtype_bytes
            link_bytes_per_s = gpu.interconnect_gb_s * 1e9
            allreduce_s_per_token = 2 * model.num_layers * ring_bytes_per_token / link_bytes_per_s
        else:
            allreduce_fixed_s = allreduce_s_per_token = 0.0
        pp = profile.pipeline_parallel
        if pp > 1:
            p2p_fixed_s = gpu.allreduce_latency_s
            p2p_s_per_token = model.hidden_size * model.dtype_bytes / (gpu.interconnect_gb_s * 1e9)
        else:
            p2p_fixed_s = p2p_s_per_token = 0.0
        return cls(
            overhead_s=profile.iteration_overhead_s,
            per_seq_overhead_s=profile.per_seq_overhead_s,
            s_per_flop=1.0 / flops_per_s,
            s_per_byte=1.0 / bytes_per_s,
            linear_flops_per_token=2.0 * model.matmul_params,
            weight_bytes=float(model.weight_bytes),
            attention_flops_per_pair=4.0 * model.num_layers * model.q_dim,
            kv_bytes_per_token=float(model.kv_bytes_per_token),
            allreduce_fixed_s=allreduce_fixed_s,
            allreduce_s_per_token=allreduce_s_per_token,
            heterogeneity_alpha=profile.heterogeneity_alpha,
            heterogeneity_cap=profile.heterogeneity_cap,
            pipeline_parallel=pp,
            p2p_fixed_s=p2p_fixed_s,
            p2p_s_per_token=p2p_s_per_token,
        )


def iteration_time_s(c: PerfCoefficients, num_prefill_seqs: float, num_prefill_tokens: float,
                     prefill_attention_pairs: float, prefill_prior_tokens: float, num_decode_seqs: float,
                     decode_context_sum_tokens: float, decode_context_max_tokens: float) -> float:
    """Seconds one iteration takes (formulas in the module docstring); 0.0 for an empty batch.

    A decode sequence computes one token; its context is the tokens it attends to, itself included. With
    pipeline parallelism, one round of the batch's micro-batches through every stage (one token per sequence).
    """
    if c.pipeline_parallel == 1:
        return _pass_time_s(c, num_prefill_seqs, num_prefill_tokens, prefill_attention_pairs,
                            prefill_prior_tokens, num_decode_seqs, decode_context_sum_tokens,
                            decode_context_max_tokens)
    num_seqs = num_prefill_seqs + num_decode_seqs
    if num_seqs <= 0:
        return 0.0
    pp = c.pipeline_parallel
    m = float(pp) if num_seqs >= pp else max(float(num_seqs), 1.0)
    pass_s = _pass_time_s(c, num_prefill_seqs / m, num_prefill_tokens / m, prefill_attention_pairs / m,
                          prefill_prior_tokens / m, num_decode_seqs / m, decode_context_sum_tokens / m,
                          decode_context_max_tokens)
    micro_tokens = (num_prefill_tokens + num_decode_seqs) / m
    return pass_s + (pp - 1) * (c.p2p_fixed_s + c.p2p_s_per_token * micro_tokens)


def _pass_time_s(c: PerfCoefficients, num_prefill_seqs: float, num_prefill_tokens: float,
                 prefill_attention_pairs: float, prefill_prior_tokens: float, num_decode_seqs: float,
                 decode_context_sum_tokens: float, decode_context_max_tokens: float) -> float:
    """One pass of a batch through the whole model on tp GPUs (the pp = 1 formula)."""
    num_seqs = num_prefill_seqs + num_decode_seqs
    if num_seqs == 0:
        return 0.0
    num_tokens = num_prefill_tokens + num_decode_seqs
    s_per_flop, s_per_byte = c.s_per_flop, c.s_per_byte
    linear_compute_s = c.linear_flops_per_token * num_tokens * s_per_flop
    linear_memory_s = c.weight_bytes * s_per_byte
    time_s = c.overhead_s + c.per_seq_overhead_s * num_seqs
    time_s += linear_compute_s if linear_compute_s > linear_memory_s else linear_memory_s
    if num_prefill_seqs:
        compute_s = c.attention_flops_per_pair * prefill_attention_pairs * s_per_flop
        memory_s = c.kv_bytes_per_token * (prefill_prior_tokens + num_prefill_tokens) * s_per_byte
        time_s += compute_s if compute_s > memory_s else memory_s
    if num_decode_seqs:
        compute_s = c.attention_flops_per_pair * decode_context_sum_tokens * s_per_flop
        memory_s = c.kv_bytes_per_token * decode_context_sum_tokens * s_per_byte
        attention_s = compute_s if compute_s > memory_s else memory_s
        time_s += attention_s * heterogeneity_factor(num_decode_seqs, decode_context_sum_tokens,
                                                     decode_context_max_tokens, c.heterogeneity_alpha,
                                                     c.heterogeneity_cap)
    if c.allreduce_fixed_s:
        time_s += c.allreduce_fixed_s + c.allreduce_s_per_token * num_tokens
    return time_s


def decode_attention_time_s(c: PerfCoefficients, context_tokens: list[int]) -> float:
    """The attention part alone of a decode batch with these contexts, heterogeneity included (seconds)."""
    if not context_tokens:
        return 0.0
    total = sum(context_tokens)
    compute_s = c.attention_flops_per_pair * total * c.s_per_flop
    memory_s = c.kv_bytes_per_token * total * c.s_per_byte
    return max(compute_s, memory_s) * heterogeneity_factor(
        len(context_tokens), total, max(context_tokens), c.heterogeneity_alpha, c.heterogeneity_cap)


@dataclass(frozen=True, slots=True)
class BatchShape:
    """A batch given sequence by sequence, for callers outside the engine's hot path (tests, benchmarks)."""

    prefill_chunks: tuple[tuple[int, int], ...] = ()  # (new tokens, tokens already computed) per sequence
    decode_context_tokens: tuple[int, ...] = ()  # context per decode sequence, the new token included


def batch_time_s(c: PerfCoefficients, batch: BatchShape) -> float:
    """`iteration_time_s` for a batch given sequence by sequence."""
    pairs = sum(n * p + n * (n + 1) // 2 for n, p in batch.prefill_chunks)
    decode = batch.decode_context_tokens
    return iteration_time_s(
        c,
        num_prefill_seqs=len(batch.prefill_chunks),
        num_prefill_tokens=sum(n for n, _ in batch.prefill_chunks),
        prefill_attention_pairs=pairs,
        prefill_prior_tokens=sum(p for _, p in batch.prefill_chunks),
        num_decode_seqs=len(decode),
        decode_context_sum_tokens=sum(decode),
        decode_context_max_tokens=max(decode, default=0),
    )
