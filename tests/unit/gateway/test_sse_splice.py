"""Pre-encoded chunk templates (`SplicedEvent`) give the bytes of encoding the whole chunk, for any text.

Seeded random strings over an alphabet of the characters JSON escapes or treats specially (quotes,
backslashes, every control character, `/`, DEL, non-ASCII up to astral planes, `\\u2028`), for both endpoints,
several choice indices, with and without the usage field.
"""

from __future__ import annotations

import functools
import random

import orjson
import pytest

from gateway.api.openai_format import ChatFormat, CompletionFormat, ResponseFormat
from gateway.api.sse import _MARKER, SplicedEvent, encode_event

ALPHABET = (
    [chr(c) for c in range(0x20)]
    + list('"\\/ \x7f') + list("abcXYZ019 ,:{}[]")
    + ["é", "ß", "中", "文", "\u2028", "\u2029", "\ufeff", "\U0001f600", "\U0001d11e", "\ufffd"]
)
SEED = 20_240_601


def random_texts(count: int) -> list[str]:
    rng = random.Random(SEED)
    texts = ["", " ", "Hello", '"', "\\", "\\\"", "\x00", "\n\n", "data: [DONE]\n\n", _MARKER]
    for _ in range(count):
        texts.append("".join(rng.choice(ALPHABET) for _ in range(rng.randrange(1, 24))))
    return texts


FORMATS = [
    pytest.param(ChatFormat("r1", 1_700_000_000, "m", include_usage=True), id="chat-usage"),
    pytest.param(ChatFormat("r-2.x:y", 0, "org/model-7B", include_usage=False), id="chat"),
    pytest.param(CompletionFormat("r1", 1_700_000_000, "m", include_usage=True), id="completions-usage"),
    pytest.param(CompletionFormat("abc", 42, "é-model \"q\"", include_usage=False), id="completions"),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("index", [0, 1, 15])
def test_spliced_content_chunks_equal_plain_encoding(fmt: ResponseFormat, index: int) -> None:
    build = functools.partial(fmt.content, index)
    spliced = SplicedEvent(build)
    for text in random_texts(300):
        assert spliced.encode(text) == encode_event(build(text)), repr(text)


def test_plain_encoding_is_the_openai_chunk() -> None:
    fmt = ChatFormat("r1", 7, "m", include_usage=True)
    frame = SplicedEvent(functools.partial(fmt.content, 0)).encode('a"\\\n')
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert orjson.loads(frame[6:]) == {
        "id": "chatcmpl-r1",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": 'a"\\\n'}, "logprobs": None, "finish_reason": None}],
        "usage": None,
    }


@pytest.mark.parametrize("model", [_MARKER, f"m{_MARKER}"])
def test_a_model_name_holding_the_marker_still_encodes_exactly(model: str) -> None:
    # The model name *is* the marker: its encoding occurs twice, so every event takes the plain path.
    fmt = ChatFormat("r1", 7, model, include_usage=False)
    build = functools.partial(fmt.content, 0)
    spliced = SplicedEvent(build)
    for text in random_texts(20):
        assert spliced.encode(text) == encode_event(build(text))
