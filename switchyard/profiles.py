"""Simulated engine profiles: a GPU, a model, tensor- and pipeline-parallel degrees, everything derived from
them.

Owns: `Profile` (engine limits, KV capacity derived from memory, performance-model factors, the output-length
distribution), the registry of named profiles, `get_profile` / `known_profiles`, and `build_profile` (any
(gpu, model, tp, pp) shape, None when it does not fit: the planners' search space).
Must not: schedule, time iterations (that is `switchyard.perf_model`) or hold mutable state.

Names: `{gpu}-{model}` at tensor parallelism 1 and `{gpu}x{tp}-{model}` above it (`h100x4-llama3-70b`); with
pipeline parallelism pp > 1, `{gpu}x{tp}p{pp}-{model}` (`h100x2p2-llama3-70b`, `h100x1p4-llama3-70b`). The
registry holds pp = 1 profiles only; pp shapes come from `build_profile`.

Pipeline parallelism (Cascadia §3.2, App. B): a replica is pp stages of tp GPUs each, tp * pp GPUs in all (its
price counts them all). Layers split as evenly as possible: the first `num_layers mod pp` stages hold one
layer more (ceil), the rest floor(num_layers / pp); stage 0 also holds the input embedding, the last stage
the final norm and the LM head (a copy of the embedding when tied). Every stage keeps the activation reserve
of a full iteration (a micro-batch may carry the whole token budget when the batch has fewer sequences than
stages); only the last stage keeps the logits. A stage's KV holds its own layers for every token, so the
replica's KV capacity (in tokens, hence blocks of all layers) is the smallest over stages of free bytes /
(its layers x KV per layer). At pp = 1 every figure is the single-stage formula, unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from switchyard.hardware import BYTES_PER_GB, GPUS, MODELS, GpuSpec, ModelShape

GIB = 1 << 30

# Per-GPU memory outside weights, KV and activations: CUDA context, CUDA graphs, NCCL buffers and allocator
# slack (what vLLM's memory profiler reports as non-torch memory plus graph pools, about 1 GiB in practice).
FIXED_RESERVE_BYTES_PER_GPU = GIB

# Output lengths: a lognormal fitted by maximum likelihood to `num_decode_tokens` of the 30,731 conversations
# in /work/shared/data/sharegpt/sharegpt_8k_filtered_stats_llama2_tokenizer.csv: mean(ln x) = 5.769,
# std(ln x) = 1.001 (median 320 tokens; the sample's mean is 439 tokens, its median 415, its max 1024).
SHAREGPT_OUTPUT_LOG_MEAN = 5.769
SHAREGPT_OUTPUT_LOG_STD = 1.001

# A profile is registered only if its KV cache holds at least this many full-length contexts.
MIN_FULL_CONTEXTS = 4
TENSOR_PARALLEL_DEGREES = (1, 2, 4, 8)
PIPELINE_PARALLEL_DEGREES = (1, 2, 3, 4)


class UnknownProfileError(ValueError):
    """Raised by `get_profile` for a name that is not registered; the message lists the known names."""


def activation_reserve_bytes(model: ModelShape, tensor_parallel: int, max_batched_tokens: int,
                             max_num_seqs: int) -> int:
    """Memory kept free for one iteration's activations, summed over the tensor-parallel group (bytes).

    Per GPU: the fixed reserve, the peak MLP activation (gate and up outputs, 2 * intermediate / tp values per
    token) plus four hidden-size buffers (residual, normed input, attention output, MLP output) for every
    batched token, and float32 logits for every sequence that samples.
    """
    per_token_values = 2 * model.intermediate_size // tensor_parallel + 4 * model.hidden_size
    activations = max_batched_tokens * per_token_values * model.dtype_bytes
    logits = max_num_seqs * model.vocab_size * 4
    return tensor_parallel * (FIXED_RESERVE_BYTES_PER_GPU + activations + logits)


def stage_layers(num_layers: int, pipeline_parallel: int) -> tuple[int, ...]:
    """Layers per pipeline stage: the first `num_layers mod pp` stages get one more (80 / 3: 27, 27, 26)."""
    base, extra = divmod(num_layers, pipeline_parallel)
    return tuple(base + (1 if s < extra else 0) for s in range(pipeline_parallel))


@dataclass(frozen=True, slots=True)
class Profile:
    """One simulated engine configuration; `kv_blocks_total` is derived (and re-derived by `replace`)."""

    name: str
    gpu: GpuSpec
    model: ModelShape
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    block_size: int = 16
    max_num_seqs: int = 256
    max_batched_tokens: int = 2048
    gpu_memory_utilization: float = 0.9
    # Cap on the derived KV capacity (vLLM's `num_gpu_blocks_override`); None = use all memory left over.
    num_gpu_blocks_override: int | None = None
    # Performance model: achieved fraction of peak FLOPs / bandwidth, and fixed CPU-side cost per iteration.
    compute_efficiency: float = 0.55
    memory_efficiency: float = 0.80
    iteration_overhead_s: float = 1.5e-3
    per_seq_overhead_s: float = 8e-6
    # Decode-attention length heterogeneity (CascadeInfer §2.3); see `perf_model.heterogeneity_factor`.
    heterogeneity_alpha: float = 0.3
    heterogeneity_cap: float = 2.1
    # Output-length distribution: lognormal of ln(tokens).
    output_len_log_mean: float = SHAREGPT_OUTPUT_LOG_MEAN
    output_len_log_std: float = SHAREGPT_OUTPUT_LOG_STD
    kv_blocks_total: int = field(init=False)

    def __post_init__(self) -> None:
        tp = self.tensor_parallel
        if tp not in TENSOR_PARALLEL_DEGREES:
            raise ValueError(f"tensor_parallel must be one of {TENSOR_PARALLEL_DEGREES}, got {tp}")
        if self.model.num_kv_heads % tp or self.model.num_attention_heads % tp:
            raise ValueError(f"{self.model.name} heads do not divide over tensor_parallel={tp}")
        pp = self.pipeline_parallel
        if pp not in PIPELINE_PARALLEL_DEGREES or pp > self.model.num_layers:
            raise ValueError(f"pipeline_parallel must be one of {PIPELINE_PARALLEL_DEGREES} "
                             f"(and at most the model's layers), got {pp}")
        if self.block_size <= 0 or self.max_num_seqs <= 0 or self.max_batched_tokens <= 0:
            raise ValueError("block_size, max_num_seqs and max_batched_tokens must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not (0.0 < self.compute_efficiency <= 1.0 and 0.0 < self.memory_efficiency <= 1.0):
            raise ValueError("compute_efficiency and memory_efficiency must be in (0, 1]")
        if self.heterogeneity_alpha < 0.0 or self.heterogeneity_cap < 1.0:
            raise ValueError("heterogeneity_alpha must be >= 0 and heterogeneity_cap >= 1")
        derived = self.derived_kv_blocks()
        override = self.num_gpu_blocks_override
        if override is not None:
            if override <= 0:
                raise ValueError(f"num_gpu_blocks_override must be positive, got {override}")
            derived = override
        if derived <= 0:
            raise ValueError(f"profile {self.name!r}: {self.model.name} does not fit on "
                             f"{self.num_gpus} x {self.gpu.display_name} (no memory left for KV)")
        object.__setattr__(self, "kv_blocks_total", derived)

    @property
    def kv_bytes_per_block(self) -> int:
        return self.block_size * self.model.kv_bytes_per_token

    @property
    def max_context_tokens(self) -> int:
        return self.model.max_context_tokens

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_blocks_total * self.block_size

    @property
    def num_gpus(self) -> int:
        """GPUs one engine of this profile occupies: tp * pp."""
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def hourly_price_usd(self) -> float:
        return self.gpu.hourly_price_usd * self.num_gpus

    def derived_kv_blocks(self) -> int:
        """(tp * memory * utilization - weight bytes - activation reserve) / bytes per block, floored.

        With pp > 1, the same per stage over its own layers and weights, the smallest stage deciding (module
        docstring)."""
        usable = self.tensor_parallel * self.gpu.memory_gb * BYTES_PER_GB * self.gpu_memory_utilization
        if self.pipeline_parallel == 1:
            reserve = activation_reserve_bytes(self.model, self.tensor_parallel, self.max_batched_tokens,
                                               self.max_num_seqs)
            return int((usable - self.model.weight_bytes - reserve) // self.kv_bytes_per_block)
        model, tp = self.model, self.tensor_parallel
        with_logits = activation_reserve_bytes(model, tp, self.max_batched_tokens, self.max_num_seqs)
        without_logits = activation_reserve_bytes(model, tp, self.max_batched_tokens, 0)
        kv_bytes_per_layer_block = self.block_size * 2 * model.kv_dim * model.dtype_bytes
        layers = stage_layers(model.num_layers, self.pipeline_parallel)
        last = len(layers) - 1
        blocks: list[int] = []
        for stage, n in enumerate(layers):
            weights = n * model.params_per_layer
            if stage == 0:
                weights += model.embedding_params
            if stage == last:
                weights += model.embedding_params + model.hidden_size  # LM head (or tied copy), final norm
            reserve = with_logits if stage == last else without_logits
            free = usable - weights * model.dtype_bytes - reserve
            blocks.append(int(free // (n * kv_bytes_per_layer_block)))
        return min(blocks)


def profile_name(gpu: str, model: str, tensor_parallel: int, pipeline_parallel: int = 1) -> str:
    if pipeline_parallel != 1:
        return f"{gpu}x{tensor_parallel}p{pipeline_parallel}-{model}"
    return f"{gpu}-{model}" if tensor_parallel == 1 else f"{gpu}x{tensor_parallel}-{model}"


def _scheduler_limits(gpu: GpuSpec) -> tuple[int, int]:
    """(max_num_seqs, max_batched_tokens) as vLLM V1's OpenAI server defaults them by device.

    GPUs with >= 70 GB other than A100-class get 1024 sequences and 8192 tokens; the rest 256 and 2048.
    """
    if gpu.memory_gb >= 70 and gpu.name not in ("a100", "a800"):
        return 1024, 8192
    return 256, 2048


def build_profile(gpu: GpuSpec, model: ModelShape, tensor_parallel: int = 1, pipeline_parallel: int = 1, *,
                  min_full_contexts: int = MIN_FULL_CONTEXTS,
                  gpu_memory_utilization: float = 0.9) -> Profile | None:
    """The profile of any shape with vLLM's scheduler defaults for the GPU, or None when it is not a valid
    shape (heads do not divide over tp, pp not in `PIPELINE_PARALLEL_DEGREES`) or its KV cache holds fewer
    than `min_full_contexts` contexts of the model's maximum length (the registry's rule at the default of
    4)."""
    max_num_seqs, max_batched_tokens = _scheduler_limits(gpu)
    try:
        name = profile_name(gpu.name, model.name, tensor_parallel, pipeline_parallel)
        profile = Profile(name=name, gpu=gpu, model=model, tensor_parallel=tensor_parallel,
                          pipeline_parallel=pipeline_parallel,
                          max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                          gpu_memory_utilization=gpu_memory_utilization)
    except ValueError:
        return None
    if profile.kv_capacity_tokens < min_full_contexts * model.max_context_tokens:
        return None
    return profile


def _build(gpu: GpuSpec, model: ModelShape, tensor_parallel: int) -> Profile | None:
    return build_profile(gpu, model, tensor_parallel)


def _registry() -> dict[str, Profile]:
    """Every (gpu, model) at the smallest tensor-parallel degree that fits, and at the next larger one."""
    profiles: dict[str, Profile] = {}
    for gpu in GPUS.values():
        for model in MODELS.values():
            fitting = [p for tp in TENSOR_PARALLEL_DEGREES if (p := _build(gpu, model, tp)) is not None]
            for profile in fitting[:2]:
                profiles[profile.name] = profile
    return profiles


_PROFILES: dict[str, Profile] = _registry()


def known_profiles() -> list[str]:
    return sorted(_PROFILES)


_SHAPE = re.compile(r"x(?P<tp>\d+)(?:p(?P<pp>\d+))?")
_SHAPES: dict[str, Profile] = {}


def shape_profile(name: str) -> Profile | None:
    """The profile a `profile_name` spells, of any shape `build_profile` accepts with room for one full
    context (`{gpu}x{tp}p{pp}-{model}`, `{gpu}x{tp}-{model}`, `{gpu}-{model}`), or None. A planner (Cascadia's
    parallelism search) picks shapes beyond the registry's two per (GPU, model); its plans name them so."""
    if name in _SHAPES:
        return _SHAPES[name]
    head, sep, model_name = name.partition("-")
    model = MODELS.get(model_name)
    if not sep or model is None:
        return None
    for gpu_name, gpu in GPUS.items():
        rest = head[len(gpu_name):] if head.startswith(gpu_name) else None
        if rest is None:
            continue
        tp, pp = 1, 1
        if rest:
            shape = _SHAPE.fullmatch(rest)
            if shape is None:
                continue
            tp, pp = int(shape["tp"]), int(shape["pp"] or 1)
        profile = build_profile(gpu, model, tp, pp, min_full_contexts=1)
        if profile is not None and profile.name == name:
            _SHAPES[name] = profile
            return profile
    return None


def get_profile(name: str) -> Profile:
    """A registry profile, else any valid shape (`shape_profile`)."""
    profile = _PROFILES.get(name) or shape_profile(name)
    if profile is None:
        raise UnknownProfileError(
            f"unknown sim profile {name!r}; known profiles: {', '.join(known_profiles())} "
            f"(or any shape GPU[xTP[pPP]]-MODEL that fits, e.g. h100x4p2-llama3-70b)")
    return profile
