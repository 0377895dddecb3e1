"""Datasets for loadgen: the ``Request`` record, loaders by name, and exact-length prompt synthesis.

Owns: the public surface of ``loadgen.datasets`` (re-exports only).
Must not: hold state or perform I/O at import.
"""

from loadgen.datasets.registry import DATASETS, DatasetSpec, dataset_names, dataset_path, load_dataset
from loadgen.datasets.request import (
    EncodingLike,
    Message,
    Request,
    TokenizerLike,
    count_tokens,
    estimate_tokens,
    text_request,
)
from loadgen.datasets.sessions import SessionSpec, TurnLengths, session_requests
from loadgen.datasets.star_lengths import OUTPUT_LENGTH_DISTRIBUTIONS, LengthDistribution, with_output_lengths
from loadgen.datasets.synth import fill_prompts, synthesize_prompt_text, synthesize_prompt_token_ids
from loadgen.datasets.text import DatasetFormatError, alpaca_prompt
from loadgen.datasets.traces import parse_azure_timestamp_ticks

__all__ = [
    "DATASETS",
    "OUTPUT_LENGTH_DISTRIBUTIONS",
    "DatasetFormatError",
    "DatasetSpec",
    "EncodingLike",
    "LengthDistribution",
    "Message",
    "Request",
    "SessionSpec",
    "TokenizerLike",
    "TurnLengths",
    "alpaca_prompt",
    "count_tokens",
    "dataset_names",
    "dataset_path",
    "estimate_tokens",
    "fill_prompts",
    "load_dataset",
    "parse_azure_timestamp_ticks",
    "session_requests",
    "synthesize_prompt_text",
    "synthesize_prompt_token_ids",
    "text_request",
    "with_output_lengths",
]
