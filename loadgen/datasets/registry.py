"""Dataset names, their files under the data root, and ``load_dataset``: select, order, window and truncate.

Owns: the name -> (file, loader) table, resolution of ``sharegpt:PATH`` / ``jsonl:PATH``, the deterministic
shuffle of untimed datasets, the ``[start_s, start_s + duration_s)`` window of timed ones, ``num_requests``
truncation, and prompt synthesis for token-count-only traces. ``sessions`` is generated, not read
(``loadgen.datasets.sessions``; its lengths come from ShareGPT files under the data root when present).
Must not: decide arrival times (``loadgen.arrivals``), talk to a gateway, or find the data root
(``loadgen.paths``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadgen.datasets.mooncake import load_mooncake
from loadgen.datasets.request import Request, TokenizerLike
from loadgen.datasets.sessions import SessionSpec, TurnLengths, session_requests
from loadgen.datasets.synth import fill_prompts, lognormal_requests
from loadgen.datasets.text import load_alpaca, load_custom_jsonl, load_questions, load_sharegpt
from loadgen.datasets.traces import load_azure_csv, load_length_csv, read_decode_lengths

SHAREGPT_LENGTHS_FILE = "sharegpt/sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
ARXIV_LENGTHS_FILE = "length_stats/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    """A named dataset: its file relative to the data root and which loader reads it."""

    name: str
    relpath: str
    kind: str  # "sharegpt" | "azure" | "lengths" | "questions" | "alpaca" | "mooncake"


DATASETS: tuple[DatasetSpec, ...] = (
    DatasetSpec("sharegpt", "sharegpt/ShareGPT_V3_filtered_500.json", "sharegpt"),
    DatasetSpec("azure-conv", "azure_llm_2023/AzureLLMInferenceTrace_conv.csv", "azure"),
    DatasetSpec("azure-code", "azure_llm_2023/AzureLLMInferenceTrace_code.csv", "azure"),
    DatasetSpec("sarathi-sharegpt", SHAREGPT_LENGTHS_FILE, "lengths"),
    DatasetSpec("arxiv", ARXIV_LENGTHS_FILE, "lengths"),
    DatasetSpec("mt-bench", "mt_bench/fastchat/question.jsonl", "questions"),
    DatasetSpec("spec-bench", "spec_bench/question.jsonl", "questions"),
    DatasetSpec("alpaca", "alpaca/alpaca_5000.json", "alpaca"),
    DatasetSpec("mooncake-conv", "mooncake/conversation_trace.jsonl", "mooncake"),
    DatasetSpec("mooncake-synth", "mooncake/synthetic_trace.jsonl", "mooncake"),
)
PATH_PREFIXES = ("sharegpt:", "jsonl:")
SYNTH_PREFIX = "synth:"
SESSIONS = "sessions"


def dataset_names() -> tuple[str, ...]:
    """Every accepted name; ``sharegpt:PATH`` and ``jsonl:PATH`` take a file path as well, ``synth:`` the
    means of its lognormal lengths."""
    return (tuple(spec.name for spec in DATASETS) + (SESSIONS,) + tuple(p + "PATH" for p in PATH_PREFIXES)
            + (SYNTH_PREFIX + "in=N,out=N[,sigma=S,n=COUNT]",))


def load_dataset(
    name: str,
    data_dir: Path | None,
    *,
    num_requests: int | None = None,
    seed: int = 0,
    start_s: float = 0.0,
    duration_s: float | None = None,
    shuffle: bool = True,
    tokenizer: TokenizerLike | None = None,
    vocab_size: int | None = None,
    exclude_ids: Sequence[int] = (),
    sessions: SessionSpec | None = None,
) -> list[Request]:
    """Load ``name`` and return the requests to replay.

    Timed datasets (Azure, timed JSONL) keep trace order, are cut to arrivals in
    ``[start_s, start_s + duration_s)`` (``arrival_s`` stays relative to the trace's first row) and then to
    the first ``num_requests``.
    Untimed datasets are shuffled with ``seed`` (unless ``shuffle=False``; several files are sorted, e.g.
    sg_90k longest first) and cut to ``num_requests``; a window on them is an error. Token-count-only requests
    get a synthetic prompt of exactly ``prompt_tokens`` tokens: text with ``tokenizer``, else ids with
    ``vocab_size``, else none (the runner synthesises later). ``sessions`` parameterises the ``sessions``
    dataset (default ``SessionSpec()``), a timed one; any other dataset refuses it.
    """
    if sessions is not None and name != SESSIONS:
        raise ValueError(f"session parameters apply to the {SESSIONS!r} dataset, not {name!r}")
    if num_requests is not None and num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if start_s < 0 or (duration_s is not None and duration_s <= 0) or not math.isfinite(start_s):
        raise ValueError(f"window must have start_s >= 0 and duration_s > 0, got {start_s=}, {duration_s=}")
    if name == SESSIONS:
        lengths = TurnLengths.from_data_dir(data_dir)
        requests = session_requests(sessions or SessionSpec(), seed=seed, lengths=lengths)
    else:
        requests = _load_all(name, data_dir, seed=seed, tokenizer=tokenizer)
    timed = bool(requests) and requests[0].arrival_s is not None
    if timed:
        end_s = math.inf if duration_s is None else start_s + duration_s
        requests = [r for r in requests if r.arrival_s is not None and start_s <= r.arrival_s < end_s]
    else:
        if start_s != 0.0 or duration_s is not None:
            raise ValueError(f"dataset {name!r} has no timestamps: start_s/duration_s need a timed trace")
        if shuffle:
            order = np.random.default_rng([seed, 0]).permutation(len(requests))
            requests = [requests[int(i)] for i in order]
    if num_requests is not None:
        if num_requests > len(requests):
            raise ValueError(f"dataset {name!r} has {len(requests)} requests (after windowing), "
                             f"fewer than num_requests={num_requests}")
        requests = requests[:num_requests]
    return fill_prompts(
        requests, seed=seed, tokenizer=tokenizer, vocab_size=vocab_size, exclude_ids=exclude_ids
    )


def dataset_path(name: str, data_dir: Path | None) -> Path:
    """The file that ``name`` reads, checked to exist."""
    for prefix in PATH_PREFIXES:
        if name.startswith(prefix):
            return _user_path(name[len(prefix):], data_dir, name)
    spec = _spec(name)
    if data_dir is None:
        raise ValueError(f"dataset {name!r} needs a data directory (--data-dir or SWITCHYARD_DATA_DIR)")
    path = data_dir / spec.relpath
    if not path.is_file():
        raise FileNotFoundError(f"dataset {name!r}: {path} not found under data directory {data_dir}")
    return path


def _load_all(
    name: str, data_dir: Path | None, *, seed: int, tokenizer: TokenizerLike | None
) -> list[Request]:
    if name.startswith(SYNTH_PREFIX):
        return lognormal_requests(name[len(SYNTH_PREFIX):], seed=seed)
    path = dataset_path(name, data_dir)
    if name.startswith("jsonl:"):
        return load_custom_jsonl(path, name="jsonl", tokenizer=tokenizer)
    kind = "sharegpt" if name.startswith("sharegpt:") else _spec(name).kind
    label = name.split(":", 1)[0]
    if kind == "sharegpt":
        return load_sharegpt(path, name=label, tokenizer=tokenizer, seed=seed,
                             fallback_output_tokens=_sharegpt_lengths(path, data_dir))
    if kind == "azure":
        return load_azure_csv(path, name=label)
    if kind == "lengths":
        return load_length_csv(path, name=label)
    if kind == "mooncake":
        return load_mooncake(path, name=label)
    if kind == "questions":
        return load_questions(path, name=label, tokenizer=tokenizer)
    return load_alpaca(path, name=label, tokenizer=tokenizer)


def _sharegpt_lengths(path: Path, data_dir: Path | None) -> np.ndarray | None:
    """Output lengths for reply-less ShareGPT prompts: the Sarathi ShareGPT CSV under the data root."""
    candidates = ([data_dir / SHAREGPT_LENGTHS_FILE] if data_dir is not None else []) + [
        path.parent / Path(SHAREGPT_LENGTHS_FILE).name]
    for candidate in candidates:
        if candidate.is_file():
            return read_decode_lengths(candidate)
    return None


def _spec(name: str) -> DatasetSpec:
    for spec in DATASETS:
        if spec.name == name:
            return spec
    raise ValueError(f"unknown dataset {name!r}; known: {', '.join(dataset_names())}")


def _user_path(raw: str, data_dir: Path | None, name: str) -> Path:
    if not raw:
        raise ValueError(f"dataset {name!r}: missing PATH after the prefix")
    path = Path(raw).expanduser()
    relative_to_data = [data_dir / path] if data_dir is not None else []
    candidates = [path] if path.is_absolute() else [*relative_to_data, path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"dataset {name!r}: file not found (tried {[str(c) for c in candidates]})")
