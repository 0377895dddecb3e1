"""Simulated engine profiles: a GPU, a model and a tensor-parallel degree, with everything derived from them.

Owns: `Profile` (engine limits, KV capacity derived from memory, performance-model factors, the output-length
distribution), the registry of named profiles and `get_profile` / `known_profiles`.
Must not: schedule, time iterations (that is `switchyard.perf_model`) or hold mutable state.

Names: `{gpu}-{model}` at tensor parallelism 1 and `{gpu}x{tp}-{model}` above it (`h100x4-llama3-70b`).
"""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class Profile:
    """One simulated engine configuration; `kv_blocks_total` is derived (and re-derived by `replace`)."""

    name: str
    gpu: GpuSpec
    model: ModelShape
    tensor_parallel: int = 1
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
                             f"{self.tensor_parallel} x {self.gpu.display_name} (no memory left for KV)")
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
    def hourly_price_usd(self) -> float:
        return self.gpu.hourly_price_usd * self.tensor_parallel

    def derived_kv_blocks(self) -> int:
        """(tp * memory * utilization - weight bytes - activation reserve) / bytes per block, floored."""
        usable = self.tensor_parallel * self.gpu.memory_gb * BYTES_PER_GB * self.gpu_memory_utilization
        reserve = activation_reserve_bytes(self.model, self.tensor_parallel, self.max_batched_tokens,
                                           self.max_num_seqs)
        return int((usable - self.model.weight_bytes - reserve) // self.kv_bytes_per_block)


def profile_name(gpu: str, model: str, tensor_parallel: int) -> str:
    return f"{gpu}-{model}" if tensor_parallel == 1 else f"{gpu}x{tensor_parallel}-{model}"


def _scheduler_limits(gpu: GpuSpec) -> tuple[int, int]:
    """(max_num_seqs, max_batched_tokens) as vLLM V1's OpenAI server defaults them by device.

    GPUs with >= 70 GB other than A100-class get 1024 sequences and 8192 tokens; the rest 256 and 2048.
    """
    if gpu.memory_gb >= 70 and gpu.name not in ("a100", "a800"):
        return 1024, 8192
    return 256, 2048


def _build(gpu: GpuSpec, model: ModelShape, tensor_parallel: int) -> Profile | None:
    max_num_seqs, max_batched_tokens = _scheduler_limits(gpu)
    try:
        profile = Profile(name=profile_name(gpu.name, model.name, tensor_parallel), gpu=gpu, model=model,
                          tensor_parallel=tensor_parallel, max_num_seqs=max_num_seqs,
                          max_batched_tokens=max_batched_tokens)
    except ValueError:
        return None
    if profile.kv_capacity_tokens < MIN_FULL_CONTEXTS * model.max_context_tokens:
        return None
    return profile


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


def get_profile(name: str) -> Profile:
    try:
        return _PROFILES[name]
    except KeyError:
        raise UnknownProfileError(
            f"unknown sim profile {name!r}; known profiles: {', '.join(known_profiles())}") from None
