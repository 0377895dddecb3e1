"""Synthetic final-layer hidden states for the sim backend's hidden-state tap (a stand-in for STAR §5.3).

Owns: `SyntheticHiddenStates`, which turns the decoding requests of one engine step (prompt tokens, output
tokens so far, output tokens left) into float32 vectors of the model's hidden size that carry a learnable,
noisy signal about the remaining output length, and `HiddenStateNoise`, its documented signal-to-noise.
Must not: know asyncio, clocks or engines (the sim backend calls it on tap steps, off the event loop), or be
taken for a real model's states: nothing here comes from a transformer.

Construction. For a request with r output tokens left, g produced and p prompt tokens:
- belief: the "model" does not know r exactly; it sees r' = r * exp(b), with b ~ N(0, belief_log_std^2) drawn
  once per request (persistent);
- features f in R^33: Gaussian RBFs of log1p(r') at 16 centres over [0, 9] (width 0.6), of log1p(g) at 8
  centres (width 1.2) and of log1p(p) at 6 centres over [0, 9.5] (width 1.5), plus log1p(r')/9, log1p(g)/9
  and log1p(p)/9;
- signal s = (f - mu) A, with A a fixed Gaussian 33 x hidden_size projection seeded by the model name (every
  engine of one model shares it, as real hidden states would, so a predictor trained on one engine serves
  all), mu the mean of f and A scaled so that s has unit variance per coordinate, both over a reference
  population (ShareGPT-like lognormal output lengths, a uniform position within them, lognormal prompts);
- noise n = persistent_std * e_req + step_std * e_step, where e_req and e_step are unit-variance Gaussian
  vectors: rows, with a random sign, of a fixed bank of 512 vectors seeded by the model name. e_req is chosen
  by a hash of the request id (persistent for the request's life, also across engines of one model while the
  id is kept), e_step is drawn afresh for every sample (the bank keeps a tap cheap: no per-tap Gaussian draws
  of n x hidden_size values);
- v = tanh(gain * (s + n)).

Signal-to-noise, per coordinate before the tanh: var(s) / var(n) = 1 / (persistent_std^2 + step_std^2) =
1.0 (0 dB) with the defaults (0.6, 0.8). Over thousands of coordinates a linear read-out recovers the
features well; what bounds a length predictor is the belief noise: the best possible R^2 of log remaining
length is about 1 - belief_log_std^2 / Var(log1p r) = 1 - 0.09 / 2.2 ~ 0.96 for ShareGPT-like lengths (ridge
regression on sim vectors reaches ~0.9 on held-out requests).

Cost: one (n x 33) @ (33 x hidden_size) product, two row gathers, a tanh; at 256 requests x 4096 a few ms
(see tests/unit/engine_agent/test_sim_hidden_states.py, which prints it). Construction (the projection, its
calibration and the bank: 512 x hidden_size float32, 8 MiB at 4096) takes some tens of ms, once per engine.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

BANK_ROWS = 512
_R_CENTRES = np.linspace(0.0, 9.0, 16)
_G_CENTRES = np.linspace(0.0, 9.0, 8)
_P_CENTRES = np.linspace(0.0, 9.5, 6)
_R_WIDTH, _G_WIDTH, _P_WIDTH = 0.6, 1.2, 1.5
NUM_FEATURES = len(_R_CENTRES) + len(_G_CENTRES) + len(_P_CENTRES) + 3

# Reference population for the centring and scaling of the signal (fixed, so A does not depend on traffic).
_REFERENCE_SAMPLES = 4096
_REFERENCE_OUTPUT_LOG_MEAN, _REFERENCE_OUTPUT_LOG_STD = 5.769, 1.001  # ShareGPT fit (see sim.profiles)
_REFERENCE_PROMPT_LOG_MEAN, _REFERENCE_PROMPT_LOG_STD = 6.0, 1.2


@dataclass(frozen=True, slots=True)
class HiddenStateNoise:
    """How much of a synthetic hidden state is noise (see the module docstring)."""

    persistent_std: float = 0.6  # per-request noise, constant over the request's life
    step_std: float = 0.8  # fresh noise at every tap
    belief_log_std: float = 0.3  # per-request error of the remaining length the vector encodes (log space)
    gain: float = 0.7  # pre-tanh scale

    @property
    def snr(self) -> float:
        """Per-coordinate signal variance over noise variance, before the tanh."""
        return 1.0 / (self.persistent_std**2 + self.step_std**2)


def _features(remaining: npt.NDArray[np.float64], generated: npt.NDArray[np.float64],
              prompt: npt.NDArray[np.float64]) -> npt.NDArray[np.float32]:
    ur = np.log1p(remaining)[:, None]
    ug = np.log1p(generated)[:, None]
    up = np.log1p(prompt)[:, None]
    parts = (
        np.exp(-0.5 * ((ur - _R_CENTRES) / _R_WIDTH) ** 2),
        np.exp(-0.5 * ((ug - _G_CENTRES) / _G_WIDTH) ** 2),
        np.exp(-0.5 * ((up - _P_CENTRES) / _P_WIDTH) ** 2),
        ur / 9.0,
        ug / 9.0,
        up / 9.0,
    )
    features: npt.NDArray[np.float32] = np.concatenate(parts, axis=1).astype(np.float32)
    return features


def _model_seed(model_name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"hidden:{model_name}".encode(), digest_size=8).digest(), "little")


class SyntheticHiddenStates:
    """Vectors for one model; call `vectors` for one tap at a time (it keeps a small per-request cache)."""

    __slots__ = ("_hidden_size", "_model", "_noise", "_projection", "_offset", "_bank", "_rng", "_requests")

    def __init__(self, hidden_size: int, model_name: str, *, noise: HiddenStateNoise | None = None,
                 seed: int = 0) -> None:
        if hidden_size <= 0:
            raise ValueError(f"hidden_size must be positive, got {hidden_size}")
        self._hidden_size = hidden_size
        self._model = model_name
        self._noise = noise or HiddenStateNoise()
        rng = np.random.default_rng(_model_seed(model_name))
        projection = rng.standard_normal((NUM_FEATURES, hidden_size)).astype(np.float32)
        total = np.clip(np.round(rng.lognormal(_REFERENCE_OUTPUT_LOG_MEAN, _REFERENCE_OUTPUT_LOG_STD,
                                               _REFERENCE_SAMPLES)), 2, 8192)
        generated = np.floor(rng.random(_REFERENCE_SAMPLES) * (total - 1)) + 1
        prompt = np.clip(np.round(rng.lognormal(_REFERENCE_PROMPT_LOG_MEAN, _REFERENCE_PROMPT_LOG_STD,
                                                _REFERENCE_SAMPLES)), 1, 8192)
        reference = _features(total - generated, generated, prompt).astype(np.float64)
        covariance = np.cov(reference, rowvar=False)
        a64 = projection.astype(np.float64)
        # Mean over coordinates of the signal's variance: trace(Cov(f) A A^T) / hidden_size.
        variance = float(np.trace(covariance @ (a64 @ a64.T))) / hidden_size
        projection *= np.float32(1.0 / math.sqrt(variance))
        self._projection = projection
        self._offset = -(reference.mean(axis=0).astype(np.float32) @ projection)
        bank_rng = np.random.default_rng([_model_seed(model_name), 1])
        self._bank = bank_rng.standard_normal((BANK_ROWS, hidden_size), dtype=np.float32)
        self._rng = np.random.default_rng([seed, _model_seed(model_name)])
        self._requests: dict[str, tuple[int, float, float]] = {}

    def _request_constants(self, request_id: str) -> tuple[int, float, float]:
        """(bank row of the persistent noise, its sign times persistent_std, belief factor exp(b))."""
        digest = hashlib.blake2b(f"{self._model}:{request_id}".encode(), digest_size=16).digest()
        h1 = int.from_bytes(digest[:8], "little")
        h2 = int.from_bytes(digest[8:], "little")
        u1 = ((h2 >> 11) + 1) / 2.0**53  # (0, 1]
        u2 = (h1 >> 11) / 2.0**53
        gaussian = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
        sign = 1.0 if h1 & 1 else -1.0
        belief = math.exp(self._noise.belief_log_std * gaussian)
        return (h1 >> 1) % BANK_ROWS, sign * self._noise.persistent_std, belief

    def vectors(self, request_ids: Sequence[str], prompt_tokens: Sequence[int], generated: Sequence[int],
                remaining: Sequence[int]) -> npt.NDArray[np.float32]:
        """One float32 row of `hidden_size` per request (rows in the order given)."""
        n = len(request_ids)
        if not n:
            return np.zeros((0, self._hidden_size), dtype=np.float32)
        known = self._requests
        constants = [known.get(rid) or self._request_constants(rid) for rid in request_ids]
        self._requests = dict(zip(request_ids, constants, strict=True))  # forget requests that left
        rows = np.fromiter((c[0] for c in constants), dtype=np.intp, count=n)
        persistent_scale = np.fromiter((c[1] for c in constants), dtype=np.float32, count=n)
        belief = np.fromiter((c[2] for c in constants), dtype=np.float64, count=n)
        features = _features(np.asarray(remaining, dtype=np.float64) * belief,
                             np.asarray(generated, dtype=np.float64),
                             np.asarray(prompt_tokens, dtype=np.float64))
        out = features @ self._projection
        out += self._offset
        bank = self._bank
        noise = bank[rows]
        noise *= persistent_scale[:, None]
        out += noise
        step_rows = self._rng.integers(0, BANK_ROWS, n)
        step_scale = self._rng.choice(np.array([-1.0, 1.0], dtype=np.float32), n) * np.float32(
            self._noise.step_std)
        noise = bank[step_rows]
        noise *= step_scale[:, None]
        out += noise
        out *= np.float32(self._noise.gain)
        np.tanh(out, out=out)
        return out
