"""Request validation of chat and completions bodies: what is accepted, what is rejected and which `param` is
blamed."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.api.errors import ApiError
from gateway.api.schemas import ChatCompletionRequest, engine_requests, parse_chat, parse_completion
from gateway.dispatch.features import estimate_prompt_tokens
from gateway.domain import ChatTurn

MSGS = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return parse_chat(orjson.dumps({"model": "m", "messages": MSGS, **fields}))


def chat_error(body: Any) -> ApiError:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    with pytest.raises(ApiError) as info:
        parse_chat(raw)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


def completion_error(body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_completion(orjson.dumps(body))
    assert info.value.status == 400
    return info.value


def test_minimal_chat_defaults() -> None:
    req = chat()
    assert (req.stream, req.n, req.stop, req.max_tokens, req.include_usage) == (False, 1, (), None, False)
    assert req.output_limit_tokens() is None


def test_unknown_fields_are_ignored() -> None:
    assert chat(some_future_field={"x": 1}, metadata={"a": "b"}).model == "m"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"stop": "END"}, ("END",)),
        ({"stop": ["a", "b", "c", "d"]}, ("a", "b", "c", "d")),
        ({"stop": None}, ()),
    ],
)
def test_stop_forms(fields: dict[str, Any], expected: tuple[str, ...]) -> None:
    assert chat(**fields).stop == expected


def test_content_parts_are_joined() -> None:
    req = parse_chat(
        orjson.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    },
                    {"role": "assistant", "content": None},
                ],
            }
        )
    )
    assert [m.text() for m in req.messages] == ["be brief", "ab", ""]


def test_max_completion_tokens_supersedes_max_tokens() -> None:
    assert chat(max_tokens=10, max_completion_tokens=20).output_limit_tokens() == 20
    assert chat(max_tokens=10).output_limit_tokens() == 10


def test_neutral_penalties_are_accepted() -> None:
    assert chat(presence_penalty=0, frequency_penalty=0.0).presence_penalty == 0


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": "2"}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": 2.1}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"stream": 1}, "stream"),
        ({"stream": "true"}, "stream"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop": ["a", 3]}, "stop"),
        ({"seed": "1"}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"user": 5}, "user"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ],
)
def test_chat_field_errors_name_the_param(fields: dict[str, Any], param: str) -> None:
    assert chat_error({"model": "m", "messages": MSGS, **fields}).param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MSGS}, "model"),
        ({"model": "", "messages": MSGS}, "model"),
        ({"model": 3, "messages": MSGS}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"model": "m", "messages": [MSGS[0], {"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[1].content[0]",
        ),
    ],
)
def test_chat_structure_errors_name_the_param(body: dict[str, Any], param: str) -> None:
    assert chat_error(body).param == param


def test_missing_field_message() -> None:
    assert chat_error({"messages": MSGS}).message == "Missing required parameter: 'model'."


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"', b"null"])
def test_malformed_or_non_object_bodies(raw: bytes) -> None:
    err = chat_error(raw)
    assert err.param is None and err.code is None


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("Once", "Once"),
        (["Once"], "Once"),
        ([1, 2, 3], (1, 2, 3)),
        ([[4, 5]], (4, 5)),
    ],
)
def test_completion_prompt_forms(prompt: Any, expected: Any) -> None:
    req = parse_completion(orjson.dumps({"model": "m", "prompt": prompt}))
    assert req.prompt == expected
    assert req.max_tokens == 16  # the legacy endpoint's default


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": 7}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "logprobs": 2}, "logprobs"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "suffix": "end"}, "suffix"),
        ({"prompt": "x", "n": 20}, "n"),
    ],
)
def test_completion_errors_name_the_param(fields: dict[str, Any], param: str) -> None:
    assert completion_error({"model": "m", **fields}).param == param


def test_engine_requests_fan_out_with_seeds_and_ids() -> None:
    req = chat(
        n=3,
        seed=10,
        temperature=0.5,
        top_p=0.9,
        stop=["x"],
        max_completion_tokens=7,
        min_tokens=2,
        ignore_eos=True,
    )
    out = engine_requests(
        req, request_id="r", slo_ttft_s=0.2, slo_tpot_s=None, priority=1, session_id="s"
    )
    assert [(r.request_id, r.seed) for r in out] == [("r-0", 10), ("r-1", 11), ("r-2", 12)]
    first = out[0]
    assert first.messages == (ChatTurn("user", "hi"),)
    assert (first.max_tokens, first.min_tokens, first.temperature, first.top_p) == (7, 2, 0.5, 0.9)
    assert (first.stop, first.ignore_eos, first.slo_ttft_s, first.slo_tpot_s) == (("x",), True, 0.2, None)
    assert (first.priority, first.session_id) == (1, "s")


def test_engine_requests_single_choice_keeps_the_id_and_defaults() -> None:
    (only,) = engine_requests(
        chat(), request_id="r", slo_ttft_s=None, slo_tpot_s=None, priority=0, session_id=""
    )
    assert (only.request_id, only.seed, only.max_tokens, only.temperature, only.top_p) == (
        "r",
        None,
        None,
        1.0,
        1.0,
    )


def test_completion_prompt_reaches_the_engine_request_as_text_or_ids() -> None:
    (text,) = engine_requests(
        parse_completion(b'{"model": "m", "prompt": "abc"}'),
        request_id="r",
        slo_ttft_s=None,
        slo_tpot_s=None,
        priority=0,
        session_id="",
    )
    (ids,) = engine_requests(
        parse_completion(b'{"model": "m", "prompt": [9, 8]}'),
        request_id="r",
        slo_ttft_s=None,
        slo_tpot_s=None,
        priority=0,
        session_id="",
    )
    assert (text.prompt_text, text.prompt_token_ids, text.messages) == ("abc", None, None)
    assert (ids.prompt_text, ids.prompt_token_ids) == (None, (9, 8))


def test_prompt_token_estimate_is_bytes_over_four() -> None:
    (text,) = engine_requests(
        parse_completion(orjson.dumps({"model": "m", "prompt": "é" * 5})),
        request_id="r",
        slo_ttft_s=None,
        slo_tpot_s=None,
        priority=0,
        session_id="",
    )
    assert estimate_prompt_tokens(text) == 3  # 10 UTF-8 bytes -> ceil(10 / 4)
    (msgs,) = engine_requests(
        chat(), request_id="r", slo_ttft_s=None, slo_tpot_s=None, priority=0, session_id=""
    )
    assert estimate_prompt_tokens(msgs) == 3 + 4 + 1  # reply header + per-message overhead + ceil(2 / 4)
