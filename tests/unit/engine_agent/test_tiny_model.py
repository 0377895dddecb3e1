"""The tiny model directory loads in HF transformers (weights, tokenizer, chat template) from local files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine_agent.tiny_model import TinyModelError, build_tiny_model  # noqa: E402
from launcher.cli import main  # noqa: E402

HIDDEN = 64
MAX_POSITION = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    return build_tiny_model(out, hidden_size=HIDDEN, max_position_embeddings=MAX_POSITION, seed=7)


def test_writes_the_model_and_tokenizer_files(model_dir: Path) -> None:
    names = {p.name for p in model_dir.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (8192, 0, 2)
    assert config["hidden_size"] == HIDDEN
    assert config["max_position_embeddings"] == MAX_POSITION
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_config["model_max_length"] == MAX_POSITION


def test_transformers_loads_it_and_runs_a_forward_pass(model_dir: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    assert model.config.hidden_size == HIDDEN
    assert model.config.vocab_size == 8192
    assert model.dtype == torch.bfloat16
    ids = torch.tensor([[0, 100, 200, 300]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert tuple(logits.shape) == (1, 4, 8192)
    assert bool(torch.isfinite(logits).all())


def test_tokenizer_renders_the_chat_template(model_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert tokenizer.eos_token_id == 2
    assert tokenizer.bos_token_id == 0
    assert len(tokenizer) == 8192
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hello!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 0
    assert 2 in ids
    assert tokenizer.decode(ids) == text


def test_the_same_seed_gives_the_same_weights(model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(
        tmp_path / "again", hidden_size=HIDDEN, max_position_embeddings=MAX_POSITION, seed=7
    )
    assert (again / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


def test_refuses_a_non_empty_directory_unless_forced(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    with pytest.raises(TinyModelError, match="not empty"):
        build_tiny_model(tmp_path, hidden_size=HIDDEN, num_layers=1)
    build_tiny_model(tmp_path, hidden_size=HIDDEN, num_layers=1, force=True)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "model-00001-of-00002.safetensors").exists()
    assert (tmp_path / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hidden_size": 100, "num_heads": 8}, "not divisible by 8 heads"),
        ({"num_heads": 4, "num_kv_heads": 3}, "not divisible by 3 kv heads"),
        ({"num_layers": 0}, "layers must be at least 1"),
        ({"hidden_size": 12, "num_heads": 4}, "must be even"),
    ],
)
def test_rejects_impossible_shapes(tmp_path: Path, kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(TinyModelError, match=message):
        build_tiny_model(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


def test_the_cli_builds_once_and_then_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    argv = ["tiny-model", "--out", str(out), "--hidden-size", str(HIDDEN), "--layers", "1"]
    assert main(argv) == 0
    assert "switchyard up --backend vllm --model" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("switchyard tiny-model: error: ") and "not empty" in err
    assert main([*argv, "--force"]) == 0
