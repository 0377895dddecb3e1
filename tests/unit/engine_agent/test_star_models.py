"""STAR's models in the sim catalogue: DeepSeek-R1-Distill-Qwen-7B and Qwen3-14B shapes, their profiles, and
synthetic hidden states of the model's width (STAR's predictor reads d = 3584)."""

from __future__ import annotations

import numpy as np
import pytest

from engine_agent.backends.sim import SimBackend
from engine_agent.sim.hidden_states import SyntheticHiddenStates
from switchyard.clock import MonotonicClock
from switchyard.hardware import MODELS
from switchyard.profiles import MIN_FULL_CONTEXTS, get_profile, known_profiles

DISTILL = "deepseek-r1-distill-qwen-7b"
QWEN3 = "qwen3-14b"


@pytest.mark.parametrize(
    ("model", "hidden", "params", "kv_bytes_per_token", "max_context"),
    [
        # Qwen2.5-7B's published count (the distill keeps its shape); Qwen3-14B: 14.8B on its card (q/k norms
        # included).
        (DISTILL, 3584, 7_615_616_512, 2 * 28 * 4 * 128 * 2, 131072),
        (QWEN3, 5120, 14_768_307_200, 2 * 40 * 8 * 128 * 2, 40960),
    ],
)
def test_star_model_shapes(model: str, hidden: int, params: int, kv_bytes_per_token: int,
                           max_context: int) -> None:
    shape = MODELS[model]
    assert shape.hidden_size == hidden and shape.head_dim == 128
    assert shape.num_params == params
    assert shape.kv_bytes_per_token == kv_bytes_per_token
    assert shape.max_context_tokens == max_context
    assert (shape.qkv_bias, shape.qk_norm) == ((True, False) if model == DISTILL else (False, True))


def test_star_profiles_are_registered_where_the_model_fits() -> None:
    names = set(known_profiles())
    expected = {f"{gpu}-{model}" for gpu in ("h100", "h800") for model in (DISTILL, QWEN3)}
    expected |= {f"rtx4090x4-{DISTILL}", f"rtx4090x4-{QWEN3}"}  # the paper's 4090D needs W8A8 at TP 1
    assert expected <= names
    assert f"rtx4090-{DISTILL}" not in names and f"rtx4090x2-{DISTILL}" not in names
    assert f"rtx4090x8-{DISTILL}" not in names  # 28 heads do not split over 8 GPUs
    for name in expected:
        profile = get_profile(name)
        assert profile.model.hidden_size == (3584 if DISTILL in name else 5120)
        assert profile.kv_capacity_tokens >= MIN_FULL_CONTEXTS * profile.max_context_tokens


def test_hidden_states_have_the_model_width() -> None:
    profile = get_profile(f"h800-{DISTILL}")
    backend = SimBackend(profile, clock=MonotonicClock(), engine_id="star-0", vocab_size=1000, eos_token_id=2,
                         hidden_state_interval=20)
    assert backend.static.hidden_size == 3584
    vectors = SyntheticHiddenStates(profile.model.hidden_size, profile.model.name, seed=0).vectors(
        ["a", "b"], [36, 920], [10, 2000], [1500, 30000])
    assert vectors.shape == (2, 3584) and vectors.dtype == np.float32 and np.isfinite(vectors).all()
