"""GPU and model catalogues, shared by the simulated engine and the gateway's planners (the ground floor).

Owns: `GpuSpec` (peak dense BF16 compute, memory bandwidth, memory, hourly price, interconnect) for the GPUs
the project knows, and `ModelShape` (the transformer's shape from its Hugging Face config) with the
parameter, weight and KV-cache sizes derived from that shape.
Must not: know about batching, scheduling or profiles (that is `switchyard.profiles`), time anything,
or price a deployment (that is `gateway.planning`).

Units: TFLOPs are 1e12 FLOP/s, GB and GB/s are decimal (1e9 bytes), prices are USD per GPU-hour.
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES_PER_GB = 1e9
BF16_BYTES = 2


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU's datasheet figures (dense, i.e. without 2:4 sparsity)."""

    name: str  # the short key used in profile names ("h100")
    display_name: str
    dense_bf16_tflops: float
    memory_bandwidth_gb_s: float
    memory_gb: float
    hourly_price_usd: float
    # Per-direction GPU-to-GPU bandwidth for tensor-parallel all-reduce, and the latency of one all-reduce.
    interconnect_gb_s: float
    allreduce_latency_s: float


# NVLink figures: NVIDIA quotes total bidirectional NVLink bandwidth; the per-direction figure is half of it.
# PCIe 4.0 x16 carries about 32 GB/s per direction. All-reduce latency: ~10 us over NVLink, ~25 us over PCIe
# (order of magnitude of NCCL's small-message all-reduce latency for 2-8 GPUs).
_NVLINK_LATENCY_S = 10e-6
_PCIE_LATENCY_S = 25e-6
_PCIE4_X16_GB_S = 32.0

GPUS: dict[str, GpuSpec] = {
    # NVIDIA H100 SXM5 80GB datasheet: 989 dense BF16 TFLOPs (1979 sparse), 3.35 TB/s HBM3, NVLink 900 GB/s.
    # Not in CAUCHY Table 1; price: approximate public on-demand cloud list price for one H100 SXM, mid-2025.
    "h100": GpuSpec("h100", "H100-SXM5-80GB", 989.0, 3350.0, 80.0, 2.99, 450.0, _NVLINK_LATENCY_S),
    # NVIDIA A100 SXM4 80GB datasheet: 312 dense BF16 TFLOPs, 2039 GB/s HBM2e, NVLink 600 GB/s.
    # Not in CAUCHY Table 1; price: approximate public on-demand cloud list price for one A100 80GB, mid-2025.
    "a100": GpuSpec("a100", "A100-SXM4-80GB", 312.0, 2039.0, 80.0, 1.79, 300.0, _NVLINK_LATENCY_S),
    # NVIDIA RTX A6000 datasheet: 154.8 dense BF16 tensor TFLOPs (FP32 accumulate), 768 GB/s GDDR6, 48 GB;
    # tensor parallelism over PCIe 4.0 x16 (no NVLink bridge assumed). Not in CAUCHY Table 1; price:
    # approximate public on-demand cloud list price, mid-2025.
    "a6000": GpuSpec("a6000", "RTX-A6000-48GB", 154.8, 768.0, 48.0, 0.80, _PCIE4_X16_GB_S, _PCIE_LATENCY_S),
    # CAUCHY Table 1 (H20-NVL): 148 TFLOPs, 4000 GB/s, 96 GB, $1.50/h. NVLink 900 GB/s (NVIDIA H20 datasheet).
    "h20": GpuSpec("h20", "H20-NVL-96GB", 148.0, 4000.0, 96.0, 1.50, 450.0, _NVLINK_LATENCY_S),
    # The 141 GB H20 (HBM3e), CascadeInfer's H20 testbed GPU ("NVLink-connected H20 GPUs, each with 141 GB of
    # memory", §6; the paper gives no other figure): 141 GB HBM3e at 4.8 TB/s (the H200's memory stack, as
    # reported for this variant; no NVIDIA datasheet of its own), the same compute as the 96 GB H20 (148 dense
    # BF16 TFLOPs) and NVLink 900 GB/s. Key "h20e": no '-' and no 'x', on which profile names split
    # (`profiles.shape_profile` on '-', `static_weighted.gpu_class_weight` on 'x'). Price: no public on-demand
    # price for this variant is known to us; $1.50/h reuses the 96 GB H20's CAUCHY Table 1 price unchanged, a
    # stand-in, not a quote (`--price h20e=USD` overrides it).
    "h20e": GpuSpec("h20e", "H20-141GB", 148.0, 4800.0, 141.0, 1.50, 450.0, _NVLINK_LATENCY_S),
    # CAUCHY Table 1 (H800-SXM): 989 TFLOPs, 3350 GB/s, 80 GB, $2.69/h. NVLink limited to 400 GB/s on H800.
    "h800": GpuSpec("h800", "H800-SXM-80GB", 989.0, 3350.0, 80.0, 2.69, 200.0, _NVLINK_LATENCY_S),
    # CAUCHY Table 1 (A800-PCIe): 312 TFLOPs, 1935 GB/s, 80 GB, $1.19/h; tensor parallelism over PCIe 4.0 x16.
    "a800": GpuSpec("a800", "A800-PCIe-80GB", 312.0, 1935.0, 80.0, 1.19, _PCIE4_X16_GB_S, _PCIE_LATENCY_S),
    # NVIDIA L40 datasheet: 181 dense BF16 tensor TFLOPs (362 sparse), 864 GB/s GDDR6, 48 GB, PCIe 4.0 only.
    # Not in CAUCHY Table 1; price: approximate public on-demand cloud list price, mid-2025.
    "l40": GpuSpec("l40", "L40-48GB", 181.0, 864.0, 48.0, 1.00, _PCIE4_X16_GB_S, _PCIE_LATENCY_S),
    # CAUCHY Table 1 (RTX4090): 165 TFLOPs, 1008 GB/s, 24 GB, $0.69/h. GeForce cards have no peer-to-peer over
    # PCIe, so all-reduce is staged through host memory: ~25 GB/s effective, higher latency.
    "rtx4090": GpuSpec("rtx4090", "RTX-4090-24GB", 165.0, 1008.0, 24.0, 0.69, 25.0, 40e-6),
    # CAUCHY Table 1 (A10): 125 TFLOPs, 600 GB/s, 24 GB, $0.75/h (NVIDIA A10 datasheet: 125 dense BF16 tensor
    # TFLOPs, 600 GB/s GDDR6). No NVLink: tensor parallelism over PCIe 4.0 x16.
    "a10": GpuSpec("a10", "A10-24GB", 125.0, 600.0, 24.0, 0.75, _PCIE4_X16_GB_S, _PCIE_LATENCY_S),
    # CAUCHY Table 1 (MI210): 181 TFLOPs, 1638 GB/s, 64 GB, $1.40/h (AMD Instinct MI210 datasheet: 181 peak
    # BF16 TFLOPs, 1.6 TB/s HBM2e). Its Infinity Fabric bridge (up to 300 GB/s) is not assumed: PCIe 4.0 x16.
    "mi210": GpuSpec("mi210", "MI210-64GB", 181.0, 1638.0, 64.0, 1.40, _PCIE4_X16_GB_S, _PCIE_LATENCY_S),
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder-only transformer's shape (Hugging Face `config.json` field names in comments)."""

    name: str
    num_layers: int  # num_hidden_layers
    hidden_size: int  # hidden_size
    num_attention_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads
    intermediate_size: int  # intermediate_size (gated MLP: gate, up and down projections)
    vocab_size: int  # vocab_size
    max_context_tokens: int  # max_position_embeddings
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has biases on q, k and v
    qk_norm: bool = False  # Qwen3 RMS-normalises q and k per head (2 * head_dim weights per layer, no matmul)
    dtype_bytes: int = BF16_BYTES

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        h = self.hidden_size
        attention = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.qkv_bias:
            attention += self.q_dim + 2 * self.kv_dim
        mlp = 3 * h * self.intermediate_size
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        return attention + mlp + norms

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters: layers, final norm, input embedding and (unless tied) the LM head."""
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.num_layers * self.params_per_layer + self.hidden_size + self.embedding_params + lm_head

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matrix multiply per token (the embedding lookup is a gather)."""
        return self.num_layers * self.params_per_layer + self.embedding_params

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for one token over all layers."""
        return 2 * self.num_layers * self.kv_dim * self.dtype_bytes


MODELS: dict[str, ModelShape] = {
    # meta-llama/Meta-Llama-3-8B config.json (8.03e9 parameters derived).
    "llama3-8b": ModelShape("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    # Qwen/Qwen2.5-14B-Instruct config.json (14.8e9 parameters derived; q/k/v biases).
    "qwen2.5-14b": ModelShape("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, 32768, qkv_bias=True),
    # meta-llama/Meta-Llama-3-70B config.json (70.6e9 parameters derived).
    "llama3-70b": ModelShape("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    # deepseek-ai/DeepSeek-R1-Distill-Qwen-7B config.json: the Qwen2.5-7B architecture (q/k/v biases, untied
    # LM head), max_position_embeddings 131072 (7.62e9 parameters derived, as Qwen2.5-7B's card). STAR (§6)
    # serves it with at most 32K tokens of prompt plus output; its hidden size d = 3584 is STAR's predictor
    # input.
    "deepseek-r1-distill-qwen-7b": ModelShape("deepseek-r1-distill-qwen-7b", 28, 3584, 28, 4, 18944, 152064,
                                              131072, qkv_bias=True),
    # Qwen/Qwen3-14B config.json: head_dim 128 (= 5120 / 40), q/k RMSNorm, no biases, untied LM head,
    # max_position_embeddings 40960 (14.77e9 parameters derived; the card says 14.8B, 13.2B non-embedding).
    "qwen3-14b": ModelShape("qwen3-14b", 40, 5120, 40, 8, 17408, 151936, 40960, qk_norm=True),
    # CascadeInfer's 128K-context Llamas (§6; max_position_embeddings 131072, rope_scaling "llama3"):
    # meta-llama/Llama-3.2-3B config.json: head_dim 128 (= 3072 / 24), tie_word_embeddings true (no separate
    # LM head; 3.21e9 parameters derived).
    "llama3.2-3b": ModelShape("llama3.2-3b", 28, 3072, 24, 8, 8192, 128256, 131072, tie_word_embeddings=True),
    # meta-llama/Llama-3.1-8B config.json: Meta-Llama-3-8B's shape with max_position_embeddings 131072 (8.03e9
    # parameters derived).
    "llama3.1-8b": ModelShape("llama3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072),
    # meta-llama/Llama-3.1-70B config.json: Meta-Llama-3-70B's shape with max_position_embeddings 131072
    # (70.6e9 parameters derived).
    "llama3.1-70b": ModelShape("llama3.1-70b", 80, 8192, 64, 8, 28672, 128256, 131072),
}
