"""The roofline iteration-time model: exact formulas, monotonicity, tensor parallelism, heterogeneity."""

from __future__ import annotations

import dataclasses

import pytest

from switchyard.perf_model import (
    BatchShape,
    PerfCoefficients,
    batch_time_s,
    decode_attention_time_s,
    heterogeneity_factor,
    iteration_time_s,
)
from switchyard.profiles import get_profile

H100_8B = PerfCoefficients.from_profile(get_profile("h100-llama3-8b"))


def decode(*contexts: int) -> BatchShape:
    return BatchShape(decode_context_tokens=contexts)


def prefill(tokens: int, prior: int = 0) -> BatchShape:
    return BatchShape(prefill_chunks=((tokens, prior),))


def test_empty_batch_takes_no_time() -> None:
    assert batch_time_s(H100_8B, BatchShape()) == 0.0
    assert iteration_time_s(H100_8B, 0, 0, 0, 0, 0, 0, 0) == 0.0


def test_single_decode_is_weights_plus_kv_over_bandwidth_plus_overhead() -> None:
    profile = get_profile("h100-llama3-8b")
    bytes_per_s = 3350e9 * profile.memory_efficiency
    expected = (profile.iteration_overhead_s + profile.per_seq_overhead_s
                + profile.model.weight_bytes / bytes_per_s
                + 1000 * profile.model.kv_bytes_per_token / bytes_per_s)
    assert batch_time_s(H100_8B, decode(1000)) == pytest.approx(expected, rel=1e-12)


def test_large_prefill_is_compute_bound() -> None:
    profile = get_profile("h100-llama3-8b")
    flops_per_s = 989e12 * profile.compute_efficiency
    tokens = 8192
    linear_s = 2 * profile.model.matmul_params * tokens / flops_per_s
    attention_s = 4 * 32 * 4096 * (tokens * (tokens + 1) // 2) / flops_per_s
    expected = profile.iteration_overhead_s + profile.per_seq_overhead_s + linear_s + attention_s
    assert batch_time_s(H100_8B, prefill(tokens)) == pytest.approx(expected, rel=1e-12)


def test_iteration_time_grows_with_batch_size() -> None:
    times = [batch_time_s(H100_8B, decode(*[2048] * n)) for n in (1, 2, 8, 32, 128, 512)]
    assert times == sorted(times)
    assert len(set(times)) == len(times)


def test_iteration_time_grows_with_tokens_and_context() -> None:
    prefills = [batch_time_s(H100_8B, prefill(n)) for n in (1, 64, 512, 2048, 8192)]
    assert prefills == sorted(prefills) and len(set(prefills)) == len(prefills)
    contexts = [batch_time_s(H100_8B, decode(*[ctx] * 64)) for ctx in (16, 512, 2048, 8192)]
    assert contexts == sorted(contexts) and len(set(contexts)) == len(contexts)
    # A later chunk of the same prompt costs more: it attends to the chunks before it.
    assert batch_time_s(H100_8B, prefill(512, prior=4096)) > batch_time_s(H100_8B, prefill(512))


def test_slower_gpu_is_slower() -> None:
    a6000 = PerfCoefficients.from_profile(get_profile("a6000-llama3-8b"))
    for batch in (decode(512), decode(*[2048] * 32), prefill(2048)):
        assert batch_time_s(a6000, batch) > batch_time_s(H100_8B, batch)


def test_tensor_parallel_divides_work_and_adds_all_reduce() -> None:
    tp1 = get_profile("h100-llama3-8b")
    tp2 = get_profile("h100x2-llama3-8b")
    c2 = PerfCoefficients.from_profile(tp2)
    assert c2.allreduce_fixed_s == pytest.approx(2 * 32 * 10e-6)
    assert c2.allreduce_s_per_token == pytest.approx(2 * 32 * (2 * 0.5 * 4096 * 2) / 450e9)
    no_comm = dataclasses.replace(c2, allreduce_fixed_s=0.0, allreduce_s_per_token=0.0)
    batch = prefill(4096)
    comm_s = batch_time_s(c2, batch) - batch_time_s(no_comm, batch)
    assert comm_s == pytest.approx(c2.allreduce_fixed_s + 4096 * c2.allreduce_s_per_token)
    # Work halves, fixed overhead and all-reduce do not: faster than TP1, slower than half of it.
    t1, t2 = batch_time_s(H100_8B, batch), batch_time_s(c2, batch)
    assert t1 / 2 < t2 < t1
    assert PerfCoefficients.from_profile(tp1).allreduce_fixed_s == 0.0


def test_heterogeneity_factor_exact_values() -> None:
    assert heterogeneity_factor(32, 32 * 2048, 2048, 0.3, 2.1) == 1.0
    assert heterogeneity_factor(1, 5000, 5000, 0.3, 2.1) == 1.0
    # Half at 256, half at 3840 tokens: n * max / sum = 32 * 3840 / 65536 = 1.875.
    assert heterogeneity_factor(32, 16 * 256 + 16 * 3840, 3840, 0.3, 2.1) == pytest.approx(1.2625)
    # One long sequence among many short ones saturates at the cap.
    assert heterogeneity_factor(64, 63 * 16 + 8000, 8000, 0.3, 2.1) == 2.1


def test_mixed_decode_batch_is_slower_than_homogeneous_with_equal_total_context() -> None:
    homogeneous = [2048] * 32
    mixed = [256] * 16 + [3840] * 16
    assert sum(mixed) == sum(homogeneous)
    ratio = decode_attention_time_s(H100_8B, mixed) / decode_attention_time_s(H100_8B, homogeneous)
    assert 1.1 <= ratio <= 2.1
    assert ratio == pytest.approx(1.2625)
    assert batch_time_s(H100_8B, decode(*mixed)) > batch_time_s(H100_8B, decode(*homogeneous))


def test_heterogeneity_penalty_never_exceeds_cap_on_the_attention_part() -> None:
    homogeneous = [100] * 100
    extreme = [1] * 99 + [9901]
    ratio = decode_attention_time_s(H100_8B, extreme) / decode_attention_time_s(H100_8B, homogeneous)
    assert ratio == pytest.approx(2.1)


def test_adding_any_sequence_never_makes_a_decode_batch_faster() -> None:
    base = [300, 900, 4000, 50]
    for extra in (1, 300, 4000, 8000):
        assert batch_time_s(H100_8B, decode(*base, extra)) > batch_time_s(H100_8B, decode(*base))


# ------------------------------------------------------------------------------------ pipeline parallelism


def _pp(tp: int, pp: int, model: str = "llama3-70b") -> PerfCoefficients:
    from switchyard.hardware import GPUS, MODELS  # noqa: PLC0415
    from switchyard.profiles import build_profile  # noqa: PLC0415

    profile = build_profile(GPUS["h100"], MODELS[model], tp, pp, min_full_contexts=1)
    assert profile is not None
    return PerfCoefficients.from_profile(profile)


def test_pp1_coefficients_carry_no_pipeline_and_keep_their_times() -> None:
    assert (H100_8B.pipeline_parallel, H100_8B.p2p_fixed_s, H100_8B.p2p_s_per_token) == (1, 0.0, 0.0)
    as_pp1 = dataclasses.replace(_pp(4, 2), pipeline_parallel=1, p2p_fixed_s=0.0, p2p_s_per_token=0.0)
    tp4 = PerfCoefficients.from_profile(get_profile("h100x4-llama3-70b"))
    for batch in (decode(512), decode(*[2048] * 32), prefill(2048)):
        assert batch_time_s(as_pp1, batch) == batch_time_s(tp4, batch)  # bit for bit


def test_pipeline_round_is_a_full_pass_of_one_micro_batch_plus_hand_overs() -> None:
    c = _pp(4, 2)
    assert c.p2p_fixed_s == pytest.approx(10e-6)
    assert c.p2p_s_per_token == pytest.approx(8192 * 2 / 450e9)
    single = dataclasses.replace(c, pipeline_parallel=1, p2p_fixed_s=0.0, p2p_s_per_token=0.0)
    batch = decode(*[1000] * 64)
    expected = batch_time_s(single, decode(*[1000] * 32)) + (c.p2p_fixed_s + 32 * c.p2p_s_per_token)
    assert batch_time_s(c, batch) == pytest.approx(expected, rel=1e-12)
    # Fewer sequences than stages: one micro-batch per sequence.
    lone = batch_time_s(single, decode(1000)) + c.p2p_fixed_s + c.p2p_s_per_token
    assert batch_time_s(c, decode(1000)) == pytest.approx(lone, rel=1e-12)
    assert batch_time_s(c, BatchShape()) == 0.0


def test_pipeline_raises_throughput_not_single_request_speed() -> None:
    batch = decode(*[1000] * 128)
    tp4, tp4pp2 = _pp(4, 1), _pp(4, 2)
    # Same GPUs per stage: a lone sequence is no faster (plus a hand-over), a large batch is.
    assert batch_time_s(tp4pp2, decode(1000)) > batch_time_s(tp4, decode(1000))
    assert batch_time_s(tp4pp2, batch) < batch_time_s(tp4, batch)
    pp4 = _pp(1, 4)
    assert batch_time_s(pp4, decode(1000)) > batch_time_s(tp4, decode(1000))  # tp splits a pass, pp not
