"""STAR's MLP predictor (§4.2, Eq. 2) in numpy: forward, hand-written backward, L1 loss and AdamW.

Owns: `MLP` (ŷ = w_L φ(... φ(W_1 h + b_1) ...) + b_L with ReLU φ, any number of hidden layers; Eq. 2 is three
hidden layers of 2048 / 512 / 64 at d = 3584), its He initialisation, its exact gradients, `l1_loss` (mean
absolute error and its subgradient), `AdamW` (decoupled weight decay, on weights only) and
`parameter_count`.
Must not: read files, know hidden-state shards, splits or early stopping (that is
`engine_agent.star.training`), or depend on torch: numpy only, float32 by default (float64 for gradient
checks).

Biases. Eq. 2 writes no biases; ours has one per layer (the output bias starts at the targets' median, the L1
optimum of a constant), which adds m_1 + m_2 + m_3 + 1 = 2,625 parameters to Eq. 2's 8,421,440 at d = 3584.
Layout: weights are stored (fan_in, fan_out), so a layer is `x @ W + b` for a batch of row vectors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.floating]


def parameter_count(input_size: int, widths: Sequence[int], *, biases: bool = True) -> int:
    """Weights (and biases) of an MLP with these hidden widths and one output."""
    sizes = [input_size, *widths, 1]
    weights = sum(a * b for a, b in zip(sizes[:-1], sizes[1:], strict=True))
    return weights + (sum(sizes[1:]) if biases else 0)


@dataclass(slots=True)
class Forward:
    """What `MLP.forward` keeps for `MLP.backward`: each layer's input (post-activation of the previous)."""

    inputs: list[Array]
    output: Array  # (n,)


class MLP:
    """`len(widths)` hidden ReLU layers and a linear scalar output."""

    __slots__ = ("weights", "biases")

    def __init__(self, weights: list[Array], biases: list[Array]) -> None:
        if len(weights) != len(biases) or not weights:
            raise ValueError("an MLP needs one bias per weight matrix, and at least one layer")
        for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
            if w.ndim != 2 or b.shape != (w.shape[1],):
                raise ValueError(f"layer {i}: weight {w.shape} and bias {b.shape} do not fit")
            if i and weights[i - 1].shape[1] != w.shape[0]:
                previous = weights[i - 1].shape[1]
                raise ValueError(f"layer {i}: input {w.shape[0]} != previous output {previous}")
        if weights[-1].shape[1] != 1:
            raise ValueError(f"the last layer must have one output, it has {weights[-1].shape[1]}")
        self.weights = weights
        self.biases = biases

    @classmethod
    def initialise(
        cls,
        input_size: int,
        widths: Sequence[int],
        rng: np.random.Generator,
        *,
        output_bias: float = 0.0,
        dtype: type[np.floating] = np.float32,
    ) -> MLP:
        """He-normal hidden layers (std sqrt(2 / fan_in)), a small output layer (std 1 / fan_in), zero
        hidden biases and `output_bias` on the output."""
        if input_size < 1 or any(w < 1 for w in widths):
            raise ValueError(f"sizes must be positive: input {input_size}, widths {list(widths)}")
        sizes = [input_size, *widths, 1]
        weights: list[Array] = []
        biases: list[Array] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            last = i == len(sizes) - 2
            std = 1.0 / fan_in if last else math.sqrt(2.0 / fan_in)
            weights.append((rng.standard_normal((fan_in, fan_out)) * std).astype(dtype))
            biases.append(np.full(fan_out, output_bias if last else 0.0, dtype=dtype))
        return cls(weights, biases)

    @property
    def input_size(self) -> int:
        return int(self.weights[0].shape[0])

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(int(w.shape[1]) for w in self.weights[:-1])

    @property
    def dtype(self) -> np.dtype[np.floating]:
        return self.weights[0].dtype

    @property
    def parameters(self) -> list[Array]:
        """Weights then biases, in layer order (the order of `backward`'s gradients)."""
        return [*self.weights, *self.biases]

    def copy(self) -> MLP:
        return MLP([w.copy() for w in self.weights], [b.copy() for b in self.biases])

    def predict(self, x: Array) -> Array:
        """ŷ for a batch (n, input_size), in the network's dtype, without keeping activations."""
        h = np.asarray(x, dtype=self.dtype)
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            h = h @ w
            h += b
            if i < last:
                np.maximum(h, 0, out=h)
        return h[:, 0]

    def forward(self, x: Array) -> Forward:
        h = np.asarray(x, dtype=self.dtype)
        inputs: list[Array] = []
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            inputs.append(h)
            h = h @ w
            h += b
            if i < last:
                np.maximum(h, 0, out=h)
        return Forward(inputs=inputs, output=h[:, 0])

    def backward(self, forward: Forward, grad_output: Array) -> list[Array]:
        """Gradients of a loss with d loss / d ŷ = `grad_output` (n,), in `parameters` order.

        ReLU's derivative is taken as 0 at 0 (where the layer's output, the next layer's input, is 0).
        """
        grad = np.asarray(grad_output, dtype=self.dtype)[:, None]
        n_layers = len(self.weights)
        grad_w: list[Array] = [np.empty(0)] * n_layers
        grad_b: list[Array] = [np.empty(0)] * n_layers
        for i in range(n_layers - 1, -1, -1):
            layer_input = forward.inputs[i]
            grad_w[i] = layer_input.T @ grad
            grad_b[i] = grad.sum(axis=0)
            if i:
                grad = grad @ self.weights[i].T
                grad *= layer_input > 0  # the ReLU of the previous layer
        return [*grad_w, *grad_b]


def l1_loss(prediction: Array, target: Array) -> tuple[float, Array]:
    """Mean absolute error and its subgradient with respect to `prediction` (sign / n; 0 at a tie)."""
    diff = prediction - target
    n = max(diff.shape[0], 1)
    return float(np.abs(diff).mean()) if diff.size else 0.0, (np.sign(diff) / n).astype(prediction.dtype)


class AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter), applied to weights, not biases."""

    __slots__ = ("lr", "beta1", "beta2", "eps", "weight_decay", "_m", "_v", "_t", "_decayed")

    def __init__(
        self,
        mlp: MLP,
        *,
        lr: float,
        weight_decay: float = 1e-2,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
    ) -> None:
        if lr <= 0 or weight_decay < 0 or not (0 <= beta1 < 1 and 0 <= beta2 < 1) or eps <= 0:
            raise ValueError(f"bad AdamW settings: lr={lr}, weight_decay={weight_decay}, betas=({beta1}, "
                             f"{beta2}), eps={eps}")
        self.lr, self.weight_decay, self.beta1, self.beta2, self.eps = lr, weight_decay, beta1, beta2, eps
        params = mlp.parameters
        self._m = [np.zeros_like(p) for p in params]
        self._v = [np.zeros_like(p) for p in params]
        self._t = 0
        self._decayed = [True] * len(mlp.weights) + [False] * len(mlp.biases)

    def step(self, mlp: MLP, grads: Sequence[Array]) -> None:
        """Update `mlp`'s parameters in place."""
        params = mlp.parameters
        if len(grads) != len(params):
            raise ValueError(f"{len(grads)} gradients for {len(params)} parameters")
        self._t += 1
        correction1 = 1.0 - self.beta1**self._t
        correction2 = 1.0 - self.beta2**self._t
        step_size = self.lr / correction1
        for p, g, m, v, decayed in zip(params, grads, self._m, self._v, self._decayed, strict=True):
            if decayed and self.weight_decay:
                p *= 1.0 - self.lr * self.weight_decay
            m *= self.beta1
            m += (1.0 - self.beta1) * g
            v *= self.beta2
            v += (1.0 - self.beta2) * (g * g)
            p -= step_size * m / (np.sqrt(v / correction2) + self.eps)
