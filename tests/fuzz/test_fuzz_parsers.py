"""Property-based tests (hypothesis) of every parser that reads bytes from outside the gateway and loadgen:
an upstream's SSE body (`SseChunkParser`), an upstream's `/metrics` text (`parse_metrics`), and the dataset
and trace loaders (`loadgen.datasets.text` / `traces`).

The property of each: any input gives a result within the documented ranges or the parser's documented error
(`EngineStreamError`; `ValueError`; `DatasetFormatError`), never another exception. Inputs are a mix of
arbitrary bytes and near-valid documents (the right shape with wrong types, odd numbers, cut lines), which
reach far deeper than random bytes do. Seeds are fixed (`derandomize`), nothing is stored between runs.
"""

from __future__ import annotations

import csv
import io
import json
import math
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.domain import Delta, EngineStreamError, Finished
from gateway.engines.openai_upstream import SseChunkParser, parse_metrics
from loadgen.datasets.request import Request
from loadgen.datasets.text import (
    DatasetFormatError,
    load_alpaca,
    load_custom_jsonl,
    load_questions,
    load_sharegpt,
)
from loadgen.datasets.traces import AZURE_COLUMNS, LENGTH_COLUMNS, load_azure_csv, load_length_csv

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=400,
                suppress_health_check=[HealthCheck.too_slow])

# ---- values ---------------------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
# Python's json module also reads NaN, Infinity and -Infinity; loaders must cope with them.
python_json_numbers = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-0", "1" * 30])


def pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    out, start = [], 0
    for point in points:
        out.append(data[start:point])
        start = point
    out.append(data[start:])
    return out


# ---- upstream SSE ---------------------------------------------------------------------------------------


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"  # json: integers beyond 64 bits too


maybe = lambda strategy: st.one_of(strategy, json_values)  # noqa: E731 (a right type, or any value)
choice_like = st.fixed_dictionaries(
    {},
    optional={
        "index": maybe(st.integers(0, 3)),
        "delta": maybe(st.fixed_dictionaries({}, optional={"content": maybe(st.text()), "role": scalars})),
        "text": maybe(st.text()),
        "finish_reason": maybe(st.sampled_from(["stop", "length", "tool_calls", "abort", "error"])),
    },
)
usage_like = st.fixed_dictionaries(
    {},
    optional={
        "prompt_tokens": maybe(st.integers(0, 10**6)),
        "completion_tokens": maybe(st.integers(0, 10**6)),
        "prompt_tokens_details": maybe(st.fixed_dictionaries({}, optional={"cached_tokens": json_values})),
    },
)
chunk_like = st.fixed_dictionaries(
    {},
    optional={
        "choices": maybe(st.lists(maybe(choice_like), max_size=3)),
        "usage": maybe(usage_like),
        "error": json_values,
    },
)
sse_lines = st.one_of(
    chunk_like.map(sse),
    json_values.map(sse),
    st.just(b"data: [DONE]\n\n"),
    st.binary(max_size=40),
    st.sampled_from([b": keep-alive\n", b"event: x\r\n", b"data:\n", b"\r\n", b"data: {\n", b"id: 1\n"]),
)


def parse(body: bytes, cuts: list[int]) -> tuple[list[Delta], SseChunkParser]:
    parser = SseChunkParser("up")
    deltas: list[Delta] = []
    for piece in pieces(body, cuts):
        deltas += parser.feed(piece)
    deltas += parser.end()
    return deltas, parser


def outcome(parser: SseChunkParser) -> Finished | EngineStreamError:
    if parser.error is not None:
        return parser.error
    try:
        return parser.finished()
    except EngineStreamError as e:
        return e


@FUZZ
@given(st.lists(sse_lines, max_size=12).map(b"".join), st.lists(st.integers(0, 2000), max_size=8))
def test_sse_parser_any_body_gives_deltas_and_a_finish_or_its_error(body: bytes, cuts: list[int]) -> None:
    deltas, parser = parse(body, cuts)
    assert all(isinstance(d, Delta) and isinstance(d.text, str) and d.text for d in deltas)
    assert all(d.num_tokens == 1 for d in deltas)
    end = outcome(parser)
    if isinstance(end, Finished):
        assert end.finish_reason in ("stop", "length", "abort", "error")
        assert min(end.prompt_tokens, end.completion_tokens, end.cached_tokens) >= 0


texts = st.text(min_size=1, max_size=8)
valid_chunks = st.one_of(
    texts.map(lambda t: {"choices": [{"index": 0, "delta": {"content": t}}]}),
    texts.map(lambda t: {"choices": [{"index": 0, "text": t}]}),
    st.just({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
)


@FUZZ
@given(
    st.lists(valid_chunks, max_size=10),
    st.sampled_from(["stop", "length"]),
    st.integers(0, 9999),
    st.lists(st.integers(0, 4000), max_size=10),
    st.booleans(),
)
def test_sse_parser_a_valid_stream_parses_the_same_however_it_is_cut(
    chunks: list[dict[str, Any]], reason: Literal["stop", "length"], prompt_tokens: int, cuts: list[int],
    crlf: bool,
) -> None:
    finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}
    usage = {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(chunks)}}
    body = b"".join(sse(c) for c in [*chunks, finish, usage]) + b"data: [DONE]\n\n"
    if crlf:
        body = body.replace(b"\n", b"\r\n")
    expected = [
        c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content")
        for c in chunks
    ]
    whole, whole_parser = parse(body, [])
    split, split_parser = parse(body, cuts)
    assert [d.text for d in whole] == [d.text for d in split] == [t for t in expected if t]
    assert whole_parser.done and split_parser.done
    assert whole_parser.finished() == split_parser.finished() == Finished(reason, prompt_tokens, len(chunks))


# ---- upstream /metrics ----------------------------------------------------------------------------------

metric_names = st.sampled_from([
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
    "vllm:cache_config_info", "other_total",
])
metric_values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["NaN", "+Inf", "-Inf", "1e400", "-1", "0", "abc", ""]),
)
label_values = st.one_of(st.integers(-5, 10**30).map(str), st.text(max_size=6), st.just("¹²"))
metric_lines = st.one_of(
    st.tuples(metric_names, st.dictionaries(st.sampled_from(["num_gpu_blocks", "engine", "x"]), label_values,
                                            max_size=2), metric_values).map(
        lambda t: t[0] + ("{" + ",".join(f'{k}="{json.dumps(v)[1:-1]}"' for k, v in t[1].items()) + "}"
                          if t[1] else "") + " " + t[2]
    ),
    st.sampled_from(["# TYPE vllm:num_requests_running gauge", "# HELP x y", "#", "vllm:x{", "}"]),
    st.text(max_size=30),
)


@FUZZ
@given(st.lists(metric_lines, max_size=10).map("\n".join))
def test_metrics_parser_any_text_gives_sane_counts_or_a_value_error(text: str) -> None:
    try:
        running, waiting, total, free = parse_metrics(text)
    except ValueError:
        return
    assert all(isinstance(v, int) for v in (running, waiting, total, free))
    assert running >= 0 and waiting >= 0 and 0 <= free <= total


# ---- dataset and trace loaders --------------------------------------------------------------------------

csv_cells = st.one_of(
    st.integers(-5, 10**6).map(str),
    st.floats().map(repr),
    st.sampled_from(["inf", "-inf", "nan", "1e400", "", " 7 ", "0x10", "1_000", "٣"]),
    st.sampled_from([
        "2023-11-16 18:15:46.6805900", "2023-11-16 18:15:46", "2023-02-30 00:00:00",
        "9999-12-31 23:59:59.9999999", "0001-01-01 00:00:00.",
    ]),
    st.text(max_size=10),
)


def csv_text(columns: tuple[str, ...]) -> st.SearchStrategy[bytes]:
    header = st.lists(st.sampled_from([*columns, "extra"]), min_size=0, max_size=len(columns) + 1)
    rows = st.lists(st.lists(csv_cells, max_size=len(columns) + 1), max_size=6)

    def render(parts: tuple[list[str], list[list[str]]]) -> bytes:
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(parts[0])
        writer.writerows(parts[1])
        return out.getvalue().encode("utf-8", "surrogatepass")

    return st.tuples(header, rows).map(render)


conversation_like = st.fixed_dictionaries({}, optional={
    "id": json_values,
    "conversations": maybe(st.lists(maybe(st.fixed_dictionaries({}, optional={
        "from": maybe(st.sampled_from(["human", "user", "gpt"])), "value": json_values,
    })), max_size=3)),
})
record_like = st.fixed_dictionaries({}, optional={
    "instruction": maybe(st.text(max_size=10)), "input": json_values, "output": json_values,
    "turns": maybe(st.lists(maybe(st.text(max_size=10)), max_size=2)), "question_id": json_values,
    "prompt": maybe(st.text(max_size=10)), "output_tokens": maybe(st.integers(-3, 10**20)),
    "timestamp": maybe(st.floats()), "request_id": json_values, "session_id": json_values,
})


def json_text(top: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        top.map(lambda v: json.dumps(v).encode()),
        st.lists(record_like | conversation_like, max_size=4).map(lambda v: json.dumps(v).encode()),
        st.tuples(record_like, python_json_numbers).map(
            lambda t: json.dumps({**t[0], "timestamp": "@"}).replace('"@"', t[1]).encode()
        ),
    )


def jsonl_text() -> st.SearchStrategy[bytes]:
    line = st.one_of(json_text(record_like), st.binary(max_size=20), st.just(b""))
    return st.lists(line, max_size=5).map(b"\n".join)


def any_bytes(structured: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return st.one_of(structured, st.binary(max_size=200), structured.map(lambda b: b[: len(b) // 2]))


LOADERS: dict[str, tuple[Callable[[Path], list[Request]], st.SearchStrategy[bytes]]] = {
    "azure_csv": (lambda p: load_azure_csv(p, name="t"), any_bytes(csv_text(AZURE_COLUMNS))),
    "length_csv": (lambda p: load_length_csv(p, name="t"), any_bytes(csv_text(LENGTH_COLUMNS))),
    "sharegpt": (
        lambda p: load_sharegpt(p, name="t", tokenizer=None, fallback_output_tokens=[5, 9], seed=0),
        any_bytes(json_text(st.lists(conversation_like, max_size=4))),
    ),
    "alpaca": (lambda p: load_alpaca(p, name="t", tokenizer=None), any_bytes(json_text(json_values))),
    "questions": (lambda p: load_questions(p, name="t", tokenizer=None), any_bytes(jsonl_text())),
    "custom_jsonl": (lambda p: load_custom_jsonl(p, name="t", tokenizer=None), any_bytes(jsonl_text())),
}


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_loaders_any_file_gives_requests_or_a_dataset_format_error(loader: str, scratch: Path) -> None:
    load, contents = LOADERS[loader]
    path = scratch / f"{loader}.data"

    @FUZZ
    @given(contents)
    def check(data: bytes) -> None:
        path.write_bytes(data)
        try:
            requests = load(path)
        except DatasetFormatError:
            return
        for r in requests:
            assert isinstance(r, Request) and r.prompt_tokens >= 0
            assert r.arrival_s is None or math.isfinite(r.arrival_s)  # < 0: a row earlier than the first
            assert r.output_tokens is None or r.output_tokens >= 0

    check()
