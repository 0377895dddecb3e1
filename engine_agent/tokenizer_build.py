"""Builds the sim backend's byte-level BPE tokenizer and its Llama-3-style chat template.

Owns: deriving the small training corpus from `shared/data` (Apache-2.0 MT-Bench text only), training the BPE
with the `tokenizers` library, and writing an HF-style directory (`tokenizer.json` + `tokenizer_config.json`).
Must not: run at agent start-up (the built files are committed under `engine_agent/assets/sim_tokenizer/`), or
read any non-commercial source (Alpaca is CC BY-NC and never used).

Reproduce the committed files:
    python -m engine_agent.tokenizer_build --out engine_agent/assets/sim_tokenizer
Re-derive the committed corpus:
    python -m engine_agent.tokenizer_build --derive-corpus /work/shared/data
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
SIM_TOKENIZER_DIR = ASSETS_DIR / "sim_tokenizer"
CORPUS_PATH = ASSETS_DIR / "corpus" / "mt_bench_corpus.txt"

VOCAB_SIZE = 8192
CORPUS_LIMIT_BYTES = 280_000
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|eot_id|>"
# Order fixes the ids: bos=0, end_of_text=1, eot (the chat eos)=2, header markers 3-4, then reserved ids.
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    "<|end_of_text|>",
    EOS_TOKEN,
    "<|start_header_id|>",
    "<|end_header_id|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(11)),
)

# Llama-3 chat format: bos once, then per message a header, the trimmed content and <|eot_id|>.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# Apache-2.0 sources (see shared/data/SOURCES.md): FastChat MT-Bench questions and GPT-4 reference answers,
# RouteLLM's router answers to the same questions.
_QUESTION_FILES = ("mt_bench/fastchat/question.jsonl",)
_ANSWER_FILES = (
    "mt_bench/fastchat/reference_answer/gpt-4.jsonl",
    "mt_bench/routellm/benchmarks/martian.jsonl",
    "mt_bench/routellm/benchmarks/unify.jsonl",
)


def _documents(data_dir: Path) -> Iterator[str]:
    for rel in _QUESTION_FILES:
        rows = [json.loads(line) for line in (data_dir / rel).read_text("utf-8").splitlines() if line.strip()]
        for row in sorted(rows, key=lambda r: int(r["question_id"])):
            yield from row["turns"]
    for rel in _ANSWER_FILES:
        rows = [json.loads(line) for line in (data_dir / rel).read_text("utf-8").splitlines() if line.strip()]
        for row in sorted(rows, key=lambda r: int(r["question_id"])):
            for choice in row["choices"]:
                yield from choice["turns"]


def derive_corpus(data_dir: Path, limit_bytes: int = CORPUS_LIMIT_BYTES) -> str:
    """Deterministic corpus: whole documents in a fixed order, skipping any with a URL, up to the limit."""
    parts: list[str] = []
    size = 0
    for doc in _documents(data_dir):
        text = doc.strip()
        if not text or "http" in text or "www." in text:
            continue
        cost = len(text.encode("utf-8")) + 2
        if size + cost > limit_bytes:
            break
        parts.append(text)
        size += cost
    return "\n\n".join(parts) + "\n"


def train(corpus_text: str, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE on `corpus_text` (newlines and paragraph breaks included)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([corpus_text], trainer=trainer, length=1)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN}:0 $A:0",
                pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer


def tokenizer_config(model_max_length: int = 131072) -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def build(out_dir: Path, corpus_text: str, vocab_size: int = VOCAB_SIZE) -> list[Path]:
    """Write `tokenizer.json` and `tokenizer_config.json` into `out_dir`; returns the written paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train(corpus_text, vocab_size)
    tok_path = out_dir / "tokenizer.json"
    cfg_path = out_dir / "tokenizer_config.json"
    tok_path.write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    cfg_path.write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return [tok_path, cfg_path]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine_agent.tokenizer_build", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--out", type=Path, help="directory to write tokenizer.json and tokenizer_config.json"
    )
    parser.add_argument("--corpus", type=Path, default=CORPUS_PATH, help="training text (default: committed)")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    parser.add_argument(
        "--derive-corpus",
        type=Path,
        metavar="DATA_DIR",
        help="re-derive the committed corpus from shared/data",
    )
    args = parser.parse_args(argv)
    if args.derive_corpus is not None:
        text = derive_corpus(args.derive_corpus)
        args.corpus.parent.mkdir(parents=True, exist_ok=True)
        args.corpus.write_text(text, encoding="utf-8")
        print(f"wrote {args.corpus} ({len(text.encode('utf-8'))} bytes)")
    if args.out is not None:
        for path in build(args.out, args.corpus.read_text(encoding="utf-8"), args.vocab_size):
            print(f"wrote {path}")
    if args.out is None and args.derive_corpus is None:
        parser.error("give --out DIR and/or --derive-corpus DATA_DIR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
