"""Profiles and catalogues: shapes derive the published parameter counts, KV capacity derives from memory."""

from __future__ import annotations

import dataclasses
import re

import pytest

from switchyard.profiles import (
    MIN_FULL_CONTEXTS,
    Profile,
    UnknownProfileError,
    activation_reserve_bytes,
    get_profile,
    known_profiles,
)
from switchyard.hardware import BYTES_PER_GB, GPUS, MODELS


@pytest.mark.parametrize(
    ("model", "params", "kv_bytes_per_token"),
    [
        # Parameter counts as published on the models' cards (exact), derived here from config shapes.
        ("llama3-8b", 8_030_261_248, 2 * 32 * 8 * 128 * 2),
        ("qwen2.5-14b", 14_770_033_664, 2 * 48 * 8 * 128 * 2),
        ("llama3-70b", 70_553_706_496, 2 * 80 * 8 * 128 * 2),
    ],
)
def test_model_shape_derives_params_and_kv_size(model: str, params: int, kv_bytes_per_token: int) -> None:
    shape = MODELS[model]
    assert shape.num_params == params
    assert shape.weight_bytes == 2 * params
    assert shape.kv_bytes_per_token == kv_bytes_per_token


@pytest.mark.parametrize(
    ("gpu", "tflops", "bandwidth_gb_s", "memory_gb", "price_usd"),
    [  # CAUCHY Table 1 rows
        ("h800", 989.0, 3350.0, 80.0, 2.69),
        ("rtx4090", 165.0, 1008.0, 24.0, 0.69),
        ("a800", 312.0, 1935.0, 80.0, 1.19),
        ("h20", 148.0, 4000.0, 96.0, 1.50),
        ("a10", 125.0, 600.0, 24.0, 0.75),
        ("mi210", 181.0, 1638.0, 64.0, 1.40),
    ],
)
def test_gpu_specs_follow_cauchy_table_1(gpu: str, tflops: float, bandwidth_gb_s: float, memory_gb: float,
                                         price_usd: float) -> None:
    spec = GPUS[gpu]
    assert (spec.dense_bf16_tflops, spec.memory_bandwidth_gb_s, spec.memory_gb, spec.hourly_price_usd) == (
        tflops, bandwidth_gb_s, memory_gb, price_usd)


def test_catalogue_covers_the_ten_gpus() -> None:
    assert set(GPUS) == {"h100", "a100", "a6000", "h20", "h800", "a800", "l40", "rtx4090", "a10", "mi210"}


def test_kv_blocks_follow_the_memory_formula() -> None:
    profile = get_profile("h100-llama3-8b")
    model = MODELS["llama3-8b"]
    reserve = activation_reserve_bytes(model, 1, profile.max_batched_tokens, profile.max_num_seqs)
    usable = 80 * BYTES_PER_GB * 0.9
    expected = int((usable - model.weight_bytes - reserve) // (16 * model.kv_bytes_per_token))
    assert profile.kv_blocks_total == expected
    assert profile.kv_capacity_tokens == expected * 16


def test_kv_capacity_orders_by_memory_and_tensor_parallelism() -> None:
    h100 = get_profile("h100-llama3-8b").kv_blocks_total
    a6000 = get_profile("a6000-llama3-8b").kv_blocks_total
    a6000x2 = get_profile("a6000x2-llama3-8b").kv_blocks_total
    assert h100 > a6000
    # Two GPUs hold one copy of the (sharded) weights, so TP2 more than doubles the KV room.
    assert a6000x2 > 2 * a6000


def test_registry_holds_required_profiles_and_not_unfitting_ones() -> None:
    names = set(known_profiles())
    assert {"h100-llama3-8b", "a6000-llama3-8b", "a6000x2-llama3-8b", "h100x4-llama3-70b",
            "h100-qwen2.5-14b"} <= names
    assert "h100-llama3-70b" not in names  # 141 GB of weights on one 80 GB GPU
    assert "h100x2-llama3-70b" not in names  # fits the weights but leaves no KV room
    assert "rtx4090-llama3-8b" not in names  # fewer than four full contexts of KV on 24 GB
    assert known_profiles() == sorted(names)


def test_every_registered_profile_is_consistent() -> None:
    pattern = re.compile(r"^(?P<gpu>[a-z0-9]+?)(x(?P<tp>[248]))?-(?P<model>.+)$")
    for name in known_profiles():
        profile = get_profile(name)
        match = pattern.match(name)
        assert match is not None, name
        assert profile.name == name
        assert profile.gpu.name == match["gpu"]
        assert profile.model.name == match["model"]
        assert profile.tensor_parallel == int(match["tp"] or 1)
        assert profile.kv_capacity_tokens >= MIN_FULL_CONTEXTS * profile.max_context_tokens


def test_unknown_profile_error_lists_known_names() -> None:
    with pytest.raises(UnknownProfileError) as info:
        get_profile("tpu-llama3-8b")
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "tpu-llama3-8b" in message
    for name in known_profiles():
        assert name in message


def test_replace_rederives_kv_capacity_and_honours_override() -> None:
    profile = get_profile("h100-llama3-8b")
    assert dataclasses.replace(profile, gpu_memory_utilization=0.5).kv_blocks_total < profile.kv_blocks_total
    assert dataclasses.replace(profile, num_gpu_blocks_override=10).kv_blocks_total == 10


def test_invalid_profiles_are_rejected() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        Profile(name="x", gpu=GPUS["h100"], model=MODELS["llama3-70b"])
    with pytest.raises(ValueError, match="tensor_parallel"):
        Profile(name="x", gpu=GPUS["h100"], model=MODELS["llama3-8b"], tensor_parallel=3)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        Profile(name="x", gpu=GPUS["h100"], model=MODELS["llama3-8b"], gpu_memory_utilization=1.5)
