"""Profiles and catalogues: shapes derive the published parameter counts, KV capacity derives from memory."""

from __future__ import annotations

import dataclasses
import re

import pytest

from switchyard.hardware import BYTES_PER_GB, GPUS, MODELS
from switchyard.profiles import (
    MIN_FULL_CONTEXTS,
    Profile,
    UnknownProfileError,
    activation_reserve_bytes,
    get_profile,
    known_profiles,
)


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


def test_catalogue_covers_the_eleven_gpus() -> None:
    assert set(GPUS) == {"h100", "a100", "a6000", "h20", "h20e", "h800", "a800", "l40", "rtx4090", "a10",
                         "mi210"}


# ------------------------------------------------------------------ CascadeInfer's 128K models and 141 GB H20


@pytest.mark.parametrize(
    ("model", "published_params", "kv_bytes_per_token"),
    [  # the models' cards: 3.21B, 8.03B, 70.6B; KV = 2 (K and V) x layers x KV heads x head_dim x 2 bytes
        ("llama3.2-3b", 3.21e9, 2 * 28 * 8 * 128 * 2),
        ("llama3.1-8b", 8.03e9, 2 * 32 * 8 * 128 * 2),
        ("llama3.1-70b", 70.6e9, 2 * 80 * 8 * 128 * 2),
    ],
)
def test_cascadeinfer_models_derive_published_sizes(model: str, published_params: float,
                                                    kv_bytes_per_token: int) -> None:
    shape = MODELS[model]
    assert shape.num_params == pytest.approx(published_params, rel=0.01)
    assert shape.kv_bytes_per_token == kv_bytes_per_token
    assert shape.max_context_tokens == 131072 and shape.head_dim == 128
    assert not (shape.qkv_bias or shape.qk_norm)
    assert shape.tie_word_embeddings == (model == "llama3.2-3b")


def test_llama3_2_3b_ties_its_lm_head_and_llama3_1_keeps_llama3s_weights() -> None:
    assert MODELS["llama3.2-3b"].num_params == 3_212_749_824  # no separate 128256 x 3072 LM head
    assert MODELS["llama3.2-3b"].kv_bytes_per_token == 114_688
    for size in ("8b", "70b"):
        assert MODELS[f"llama3.1-{size}"].num_params == MODELS[f"llama3-{size}"].num_params
        assert MODELS[f"llama3.1-{size}"].kv_bytes_per_token == MODELS[f"llama3-{size}"].kv_bytes_per_token


def test_h20_141gb_spec_and_its_profiles() -> None:
    spec = GPUS["h20e"]
    assert (spec.display_name, spec.dense_bf16_tflops, spec.memory_bandwidth_gb_s, spec.memory_gb) == (
        "H20-141GB", 148.0, 4800.0, 141.0)
    assert spec.interconnect_gb_s == GPUS["h20"].interconnect_gb_s == 450.0
    names = set(known_profiles())
    assert {"h20e-llama3.2-3b", "h20e-llama3.1-8b", "h20ex4-llama3.1-70b", "h20ex8-llama3.1-70b"} <= names
    profile = get_profile("h20e-llama3.2-3b")
    assert profile.gpu is spec and profile.max_num_seqs == 1024  # CascadeInfer's batch cap, vLLM's default
    assert profile.kv_capacity_tokens >= MIN_FULL_CONTEXTS * 131072
    # The paper's TP 2 for Llama-3.1-70B holds fewer than four 128K contexts: a shape, not a registry profile.
    assert "h20ex2-llama3.1-70b" not in names
    tp2 = get_profile("h20ex2-llama3.1-70b")
    assert tp2.tensor_parallel == 2 and tp2.max_num_seqs == 1024 and tp2.kv_capacity_tokens >= 131072


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


# ------------------------------------------------------------------------------------ pipeline parallelism


def test_pipeline_profiles_are_named_priced_and_counted_over_tp_times_pp() -> None:
    from switchyard.profiles import build_profile, profile_name  # noqa: PLC0415

    profile = build_profile(GPUS["h100"], MODELS["llama3-70b"], 2, 2)
    assert profile is not None
    assert profile.name == "h100x2p2-llama3-70b" == profile_name("h100", "llama3-70b", 2, 2)
    assert profile_name("h100", "llama3-70b", 4) == "h100x4-llama3-70b"  # pp = 1 names unchanged
    assert profile.num_gpus == 4
    assert profile.hourly_price_usd == pytest.approx(4 * GPUS["h100"].hourly_price_usd)
    assert get_profile("h100x4-llama3-70b").num_gpus == 4
    assert all(get_profile(n).pipeline_parallel == 1 for n in known_profiles())


def test_stage_layers_split_evenly_with_the_remainder_first() -> None:
    from switchyard.profiles import stage_layers  # noqa: PLC0415

    assert stage_layers(80, 3) == (27, 27, 26)
    assert stage_layers(32, 4) == (8, 8, 8, 8)
    assert stage_layers(80, 1) == (80,)


def test_pipeline_kv_follows_the_per_stage_memory_formula() -> None:
    from switchyard.profiles import build_profile  # noqa: PLC0415

    model, gpu = MODELS["llama3-70b"], GPUS["h100"]
    profile = build_profile(gpu, model, 4, 2)
    assert profile is not None
    usable = 4 * 80 * BYTES_PER_GB * 0.9
    per_layer_block = 16 * 2 * model.kv_dim * 2
    first = usable - (40 * model.params_per_layer + model.embedding_params) * 2 - activation_reserve_bytes(
        model, 4, profile.max_batched_tokens, 0)
    last = usable - (40 * model.params_per_layer + model.embedding_params + model.hidden_size) * 2 - (
        activation_reserve_bytes(model, 4, profile.max_batched_tokens, profile.max_num_seqs))
    stage_bytes = 40 * per_layer_block
    assert profile.kv_blocks_total == min(int(first // stage_bytes), int(last // stage_bytes))
    # Weights split over stages: pp2 of tp4 holds far more KV than tp4 alone (one copy of the weights).
    assert profile.kv_capacity_tokens > 2 * get_profile("h100x4-llama3-70b").kv_capacity_tokens


def test_build_profile_returns_none_when_a_shape_does_not_fit() -> None:
    from switchyard.profiles import build_profile  # noqa: PLC0415

    model, gpu = MODELS["llama3-70b"], GPUS["h100"]
    assert build_profile(gpu, model, 1, 1) is None  # 141 GB on 80 GB
    assert build_profile(gpu, model, 1, 2, min_full_contexts=1) is None  # weights fit, no KV room at 0.9
    assert build_profile(gpu, model, 1, 2, min_full_contexts=1, gpu_memory_utilization=0.95) is not None
    assert build_profile(gpu, model, 1, 3, min_full_contexts=1) is not None
    assert build_profile(gpu, model, 3, 1) is None  # tp must divide the heads
    assert build_profile(gpu, model, 1, 5) is None  # pp outside 1..4
    with pytest.raises(ValueError, match="pipeline_parallel"):
        Profile(name="x", gpu=gpu, model=MODELS["llama3-8b"], pipeline_parallel=5)
    # The registry's builder is build_profile at pp = 1 with four full contexts.
    assert build_profile(gpu, model, 4) == get_profile("h100x4-llama3-70b")
