"""Generated and mutated HTTP requests for the gateway, sent through a window of concurrent requests, and the
check of every answer: a 2xx, or a 4xx in OpenAI's error shape; never a 5xx, a broken connection or a hang.

Owns: `generate_cases` (hypothesis draws request bodies from the served OpenAPI document's schemas, then
mutates some: a key dropped, a value replaced by arbitrary JSON, an unknown key, the top level retyped, the
text cut or corrupted; plus arbitrary bytes, routing headers with arbitrary values, other routes and methods,
and a few fixed edge cases: oversized, deeply nested, raw invalid UTF-8 heads), `send_all` (the cases through
at most `window` requests in flight; aiohttp's client, or a raw socket for the cases whose head aiohttp would
refuse to send) and `Report` (outcomes by status and by kind, and each failure with the case that caused it).

Generated requests that would reach an engine ask for at most 4 tokens each (`tame`), so a valid case costs
the sim engines milliseconds; without it one `max_tokens` near the context would run for a minute. The
generation is hypothesis's (deterministic with `derandomize`); the sending is not inside hypothesis's loop,
because 10,000 sequential round trips to engines take minutes where a window of 64 takes seconds, so a
failure is reported with its exact case rather than shrunk. Used by tests/fuzz/test_fuzz_api.py and
benchmarks/fuzz_gateway.py.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

MAX_TEST_TOKENS = 4  # output tokens a generated valid request may ask for
CASES_PER_EXAMPLE = 8  # draws of `case_strategy` (1 or 2 cases each)
INFERENCE_PATHS = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest"}
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/openapi.json")
ROUTING_HEADERS = ("x-request-id", "x-session-id", "x-slo-ttft-ms", "x-slo-tpot-ms", "x-priority",
                   "x-switchyard-policy", "content-type")
COMMON = frozenset({
    "model", "messages", "prompt", "stream", "n", "stop", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "seed", "user", "ignore_eos", "min_tokens",
})
POLICIES = ("round_robin", "least_loaded", "session_affinity", "prism", "no-such-policy")


@dataclass(frozen=True, slots=True)
class Case:
    kind: str  # generated | mutated | bytes | route | edge
    method: str
    path: str
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    raw: bytes | None = None  # the whole request, sent as is over a socket
    # Not HTTP/1.1 (a bad chunk size, two Content-Lengths): aiohttp's parser answers its own plain-text 400
    # before any route or middleware runs, and closes the connection.
    malformed_http: bool = False

    def describe(self) -> str:
        shown = self.raw if self.raw is not None else self.body
        return (f"{self.kind}: {self.method} {self.path} headers={dict(self.headers)} "
                f"body[{len(shown)}]={shown[:300]!r}")


# ---- strategies from the JSON schema --------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def from_schema(schema: Mapping[str, Any], components: Mapping[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid for the subset of JSON schema pydantic emits (refs, anyOf, const/enum, bounds, objects
    with required and optional properties); strings and arrays kept short."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(components[name], components))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, components) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, components) for k in kind])
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 16), 16))
    if kind == "integer":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -math.inf))
        high = schema.get("maximum", schema.get("exclusiveMaximum", math.inf))
        low = None if low == -math.inf else int(low) + (1 if "exclusiveMinimum" in schema else 0)
        high = None if high == math.inf else int(high) - (1 if "exclusiveMaximum" in schema else 0)
        return st.integers(min_value=low, max_value=high)
    if kind == "number":
        return st.floats(
            min_value=schema.get("minimum", schema.get("exclusiveMinimum")),
            max_value=schema.get("maximum", schema.get("exclusiveMaximum")),
            exclude_min="exclusiveMinimum" in schema,
            exclude_max="exclusiveMaximum" in schema,
            allow_nan=False,
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = from_schema(schema.get("items", {}), components)
        low = schema.get("minItems", 0)
        return st.lists(items, min_size=low, max_size=max(low, min(schema.get("maxItems", 3), 3)))
    if kind == "object" and "properties" in schema:
        props = schema["properties"]
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: from_schema(v, components) for k, v in props.items() if k in required},
            optional={k: from_schema(v, components) for k, v in props.items() if k not in required},
        )
    if kind == "object":
        extra = schema.get("additionalProperties", True)
        values = json_values if extra is True else from_schema(extra, components)
        return st.dictionaries(st.text(max_size=8), values, max_size=3)
    return json_values  # {}: anything


def tame(body: Any, chat: bool, context_tokens: int) -> Any:
    """Output limits a valid request could reach the engine with, brought down to `MAX_TEST_TOKENS`; one
    missing or null gets a small value (those beyond the context, or of the wrong type, stay: refused)."""
    if not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if type(value) is int and 1 <= value <= context_tokens:
            body[key] = 1 + value % MAX_TEST_TOKENS
    completion_limit = chat and body.get("max_completion_tokens") is not None
    limit_key = "max_completion_tokens" if completion_limit else "max_tokens"
    if body.get(limit_key) is None:
        body[limit_key] = MAX_TEST_TOKENS
    least = body.get("min_tokens")
    if type(least) is int and least >= 0:
        body["min_tokens"] = least % (MAX_TEST_TOKENS + 1)  # at most the limit, mostly
    return body


# ---- mutations ------------------------------------------------------------------------------------------


def _nodes(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _nodes(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _nodes(v, (*path, i))
    return out


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replace(value[head], rest, new)}
    copy = list(value)
    copy[head] = _replace(copy[head], rest, new)
    return copy


def _drop(value: Any, path: tuple[Any, ...]) -> Any:
    if not path:
        return value
    if len(path) == 1:
        if isinstance(value, dict):
            return {k: v for k, v in value.items() if k != path[0]}
        return [v for i, v in enumerate(value) if i != path[0]]
    head = path[0]
    if isinstance(value, dict):
        return {**value, head: _drop(value[head], path[1:])}
    copy = list(value)
    copy[head] = _drop(copy[head], path[1:])
    return copy


NUMBERS = (b"1e999", b"-1e999", b"NaN", b"Infinity", b"-0", b"1" * 40, b"0.1e-400", b"1.5", b"-3")
TEXT_MUTATIONS = ("truncate", "flip", "insert", "duplicate_key", "big_number", "bad_utf8")
TREE_MUTATIONS = ("drop", "replace", "unknown_key", "retype_top")


@st.composite
def mutated(draw: st.DrawFn, body: Any) -> bytes:
    op = draw(st.sampled_from(TREE_MUTATIONS + TEXT_MUTATIONS))
    nodes = _nodes(body)
    where = nodes[draw(st.integers(0, len(nodes) - 1))]
    if op == "drop":
        return json.dumps(_drop(body, where)).encode()
    if op == "replace":
        return json.dumps(_replace(body, where, draw(json_values))).encode()
    if op == "unknown_key":
        extra = {draw(st.text(max_size=10)): draw(json_values)}
        return json.dumps({**body, **extra} if isinstance(body, dict) else body).encode()
    if op == "retype_top":
        return json.dumps(draw(st.sampled_from([[body], json.dumps(body), 1, None, True, []]))).encode()
    text = json.dumps(body).encode()
    at = draw(st.integers(0, len(text)))
    if op == "truncate":
        return text[:at]
    if op == "flip":
        if not text:
            return text
        at = min(at, len(text) - 1)
        return text[:at] + bytes([text[at] ^ (1 << draw(st.integers(0, 7)))]) + text[at + 1 :]
    if op == "insert":
        return text[:at] + draw(st.binary(min_size=1, max_size=8)) + text[at:]
    if op == "duplicate_key":
        if not text.endswith(b"}"):
            return text
        return text[:-1] + b', "model": ' + json.dumps(draw(json_values)).encode() + b"}"
    if op == "big_number":
        number = draw(st.sampled_from(NUMBERS))
        key = draw(st.sampled_from(["max_tokens", "n", "temperature", "seed", "top_p", "min_tokens"]))
        if not text.endswith(b"}"):
            return number
        return text[:-1] + b", " + json.dumps(key).encode() + b": " + number + b"}"
    # bad_utf8: a string holding bytes that are not UTF-8, or a lone surrogate escape
    bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\\ud800", b"\\udfff\\ud800"]))
    quote = text.find(b'"', at)
    return text if quote < 0 else text[: quote + 1] + bad + text[quote + 1 :]


# ---- cases ----------------------------------------------------------------------------------------------

header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x2FFF, exclude_characters="\x7f"),
                      max_size=24)
any_header = st.one_of(
    header_text,
    st.integers(-(2**70), 2**70).map(str),
    st.floats().map(repr),
    st.sampled_from(POLICIES),
)
plausible_header = {  # what well-behaved clients send, so that routing hints reach engines too
    "x-request-id": st.text("abcdef0123456789-", min_size=1, max_size=32),
    "x-session-id": header_text,
    "x-slo-ttft-ms": st.floats(200, 60_000).map(repr),
    "x-slo-tpot-ms": st.floats(20, 5_000).map(repr),
    "x-priority": st.integers(-10, 10).map(str),
    "x-switchyard-policy": st.sampled_from(POLICIES[:-1]),
    "content-type": st.sampled_from(["application/json", "text/plain", "application/json; charset=utf-8"]),
}
routing_headers = st.lists(  # built once: a strategy built per draw (flatmap) costs more than the draw
    st.one_of([st.tuples(st.just(n), st.one_of(plausible_header[n], any_header)) for n in ROUTING_HEADERS]),
    max_size=3, unique_by=lambda kv: kv[0],
).map(lambda kvs: tuple(sorted(kvs)))


def case_strategy(
    document: Mapping[str, Any], models: Sequence[str], context_tokens: int
) -> st.SearchStrategy[tuple[Case, ...]]:
    """One draw: a generated body and a mutation of it, or arbitrary bytes, or a route and method."""
    components = document["components"]["schemas"]
    served = st.sampled_from(models) if models else st.text(max_size=8)

    def inference(path: str) -> st.SearchStrategy[Case]:
        chat = path == "/v1/chat/completions"
        schema = components[INFERENCE_PATHS[path]]
        # The fields clients send every day: most requests drawn from these alone are valid ones.
        common = {**schema, "properties": {k: v for k, v in schema["properties"].items() if k in COMMON}}
        bodies = st.builds(
            lambda body, model, keep_model: tame(body if keep_model else {**body, "model": model}, chat,
                                                 context_tokens),
            st.one_of(from_schema(schema, components), from_schema(common, components)),
            served,
            st.integers(0, 9).map(lambda i: i == 9),  # mostly a served model, sometimes the generated string
        )
        # A drawn body serves twice (drawing one is most of the generation's cost): as is, and mutated.
        @st.composite
        def pair(draw: st.DrawFn) -> tuple[Case, ...]:
            body = draw(bodies)
            text = _retame(draw(mutated(body)), chat, context_tokens)
            return (
                Case("generated", "POST", path, draw(routing_headers), json.dumps(body).encode()),
                Case("mutated", "POST", path, draw(routing_headers), text),
            )

        raw_bytes = st.builds(
            lambda body, headers: (Case("bytes", "POST", path, headers, body),),
            st.one_of(st.binary(max_size=64), json_values.map(lambda v: json.dumps(v).encode())),
            routing_headers,
        )
        return st.one_of(pair(), pair(), raw_bytes)

    routes = st.builds(
        lambda method, path: (Case("route", method, path),),
        st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
        st.one_of(st.sampled_from(ROUTES), st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E,
                                                                 exclude_characters="#?%"), max_size=12)
                  .map(lambda s: "/" + s)),
    )
    return st.one_of(inference("/v1/chat/completions"), inference("/v1/completions"), routes)


def _retame(text: bytes, chat: bool, context_tokens: int) -> bytes:
    """A mutation may leave a valid request without an output limit: give it a small one again."""
    try:
        body = json.loads(text)
    except ValueError:
        return text
    if isinstance(body, dict) and all(body.get(k) is None for k in ("max_tokens", "max_completion_tokens")):
        return json.dumps(tame(body, chat, context_tokens)).encode()
    return text


def edge_cases(models: Sequence[str], max_body_bytes: int) -> list[Case]:
    model = models[0] if models else "m"
    hello = [{"role": "user", "content": "hi"}]
    chat = json.dumps({"model": model, "max_tokens": 2, "messages": hello}).encode()
    post = "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
    return [
        Case("edge", "POST", "/v1/chat/completions", body=b"x" * (max_body_bytes + 1)),
        Case("edge", "POST", "/v1/chat/completions", body=b"[" * 100_000),
        Case("edge", "POST", "/v1/chat/completions", body=b'{"a":' * 50_000),
        Case("edge", "POST", "/v1/completions",
             body=json.dumps({"model": model, "prompt": "word " * 20_000, "max_tokens": 2}).encode()),
        Case("edge", "POST", "/v1/chat/completions",
             body=json.dumps({"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "a"}]
                              * 2048}).encode()),
        Case("edge", "POST", "/v1/completions",
             body=json.dumps({"model": model, "prompt": [2**32 - 1, 0, 7], "max_tokens": 2}).encode()),
        Case("edge", "POST", "/v1/chat/completions", raw=(
            post + f"Content-Length: {len(chat)}\r\nx-session-id: \xff\xfe\r\n\r\n"
        ).encode("latin-1") + chat),
        Case("edge", "POST", "/v1/chat/completions", raw=(
            post + f"Content-Length: {len(chat)}\r\nx-request-id: \xc3\x28\r\nx-priority: \xff\r\n\r\n"
        ).encode("latin-1") + chat),
        Case("edge", "POST", "/v1/chat/completions", raw=(
            post + "Transfer-Encoding: chunked\r\n\r\n" + f"{len(chat):x}\r\n"
        ).encode() + chat + b"\r\n0\r\n\r\n"),
        Case("edge", "POST", "/v1/chat/completions", raw=(
            post + "Transfer-Encoding: chunked\r\n\r\nzz\r\n").encode(), malformed_http=True),
        Case("edge", "POST", "/v1/chat/completions", raw=(
            post + "Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!").encode(), malformed_http=True),
    ]


def generate_cases(
    document: Mapping[str, Any],
    models: Sequence[str],
    *,
    count: int,
    context_tokens: int,
    max_body_bytes: int,
    seed: int = 0,
) -> list[Case]:
    """At least `count` distinct cases (hypothesis examples of `CASES_PER_EXAMPLE` each, duplicates dropped;
    rounds of seeds `seed`, `seed + 1`, ... until there are enough), then the edge cases. The same arguments
    give the same cases."""
    cases: dict[Case, None] = {}  # insertion-ordered set
    strategy = st.lists(case_strategy(document, models, context_tokens), min_size=CASES_PER_EXAMPLE,
                        max_size=CASES_PER_EXAMPLE, unique=True)

    def collect(batch: list[tuple[Case, ...]]) -> None:
        cases.update(dict.fromkeys(case for group in batch for case in group))

    for round_seed in range(seed, seed + 20):
        if len(cases) >= count:
            break
        # Each run starts with hypothesis's simplest examples, which earlier runs drew too: never a small run.
        examples = max(200, -(-(count - len(cases)) // (CASES_PER_EXAMPLE * 3 // 2)))
        run: Callable[[], None] = settings(
            max_examples=examples, database=None, deadline=None, phases=[Phase.generate],
            suppress_health_check=[
                HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example
            ],
        )(given(strategy)(collect))
        hypothesis_seed(round_seed)(run)()
    if len(cases) < count:
        raise RuntimeError(f"only {len(cases)} distinct cases in 20 runs")
    return [*list(cases)[:count], *edge_cases(models, max_body_bytes)]


# ---- sending and checking -------------------------------------------------------------------------------


@dataclass
class Report:
    sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # "status code param" of each error answer
    shed_by_own_slo: int = 0  # 503 fleet_saturated to a request with its own TTFT target (`check`)
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def outcome(self, case: Case, status: int, problem: str | None, body: bytes = b"") -> None:
        self.sent += 1
        self.statuses[status] += 1
        shed = status == 503 and problem is None
        self.shed_by_own_slo += shed
        outcome = "shed" if shed else f"{status // 100}xx" if status > 0 else problem
        self.kinds[f"{case.kind}:{outcome}"] += 1
        if status >= 400:
            self.errors[_error_key(status, body)] += 1
        if problem is not None:
            self.failures.append(f"{problem} <- {case.describe()}")

    def summary(self) -> dict[str, Any]:
        classes = Counter(f"{s // 100}xx" if s > 0 else "no answer" for s in self.statuses.elements())
        classes["5xx"] -= self.shed_by_own_slo  # counted apart: `shed_by_own_slo`
        classes = +classes  # drop zero counts
        return {
            "cases": self.sent,
            "wall_s": round(self.wall_s, 2),
            "cases_per_s": round(self.sent / self.wall_s, 1) if self.wall_s else None,
            "by_class": {"5xx": 0, **dict(sorted(classes.items()))},
            "shed_by_own_slo": self.shed_by_own_slo,
            "by_status": {str(k): v for k, v in sorted(self.statuses.items())},
            "by_kind": dict(sorted(self.kinds.items())),
            "top_errors": dict(self.errors.most_common(25)),
            "failures": len(self.failures),
            "first_failures": self.failures[:20],
        }


def _error_key(status: int, body: bytes) -> str:
    try:
        err = json.loads(body)["error"]
        return f"{status} {err['code']} {err['param']}"
    except (ValueError, KeyError, TypeError):
        return f"{status} (not JSON)"


def _error_shape(body: bytes) -> str | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return "error body is not JSON"
    err = obj.get("error") if isinstance(obj, dict) else None
    if not (isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
            and all(err.get(k) is None or isinstance(err.get(k), str) for k in ("param", "code"))
            and {"param", "code"} <= err.keys()):
        return f"not OpenAI's error shape: {body[:200]!r}"
    return None


def _shed_by_own_slo(case: Case, body: bytes) -> bool:
    """Admission control's 503 `fleet_saturated` to a request that set its own time-to-first-token target:
    the gateway's designed answer when no engine could meet it (even an idle one, for a target of 1 ms)."""
    return any(k == "x-slo-ttft-ms" for k, _ in case.headers) and b'"code":"fleet_saturated"' in body


def _stream_problem(body: bytes) -> str | None:
    events = [e for e in body.split(b"\n\n") if e]
    if not events or events[-1] != b"data: [DONE]":
        return "stream does not end with [DONE]"
    for event in events[:-1]:
        if not event.startswith(b"data: "):
            return f"not an SSE data event: {event[:100]!r}"
        chunk = json.loads(event[6:])
        if "error" in chunk:
            return f"error event in a 200 stream: {event[:300]!r}"
    return None


def check(case: Case, status: int, content_type: str, body: bytes) -> str | None:
    """None when the answer is acceptable, else what is wrong with it."""
    if case.malformed_http:
        return None if status == 400 else f"HTTP {status} to malformed HTTP"
    if status == 503 and _shed_by_own_slo(case, body):
        return None
    if status >= 500:
        return f"HTTP {status}: {body[:300]!r}"
    if 400 <= status < 500:
        return None if case.method == "HEAD" else _error_shape(body)  # a HEAD answer has no body
    if status < 200 or status >= 300:
        return f"HTTP {status}"
    if case.method == "HEAD":
        return None
    if case.path in INFERENCE_PATHS and case.method == "POST":
        if content_type.startswith("text/event-stream"):
            return _stream_problem(body)
        try:
            obj = json.loads(body)
        except ValueError:
            return "a 200 completion that is not JSON"
        if obj.get("object") not in ("chat.completion", "text_completion") or not obj.get("choices"):
            return f"not a completion object: {body[:200]!r}"
    return None


async def _send_raw(host: str, port: int, case: Case, timeout_s: float) -> tuple[int, str, bytes]:
    assert case.raw is not None
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(case.raw)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2) if lines and lines[0] else []
    if len(parts) < 2 or not parts[1].isdigit():
        raise ConnectionError(f"no HTTP answer: {data[:200]!r}")
    content_type = next((ln.split(b":", 1)[1].strip().decode("latin-1") for ln in lines[1:]
                         if ln.lower().startswith(b"content-type:")), "")
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    return int(parts[1]), content_type, body


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return out


async def send_all(
    base_url: str, cases: Sequence[Case], *, window: int = 64, timeout_s: float = 60.0
) -> Report:
    """Every case, at most `window` in flight; each answer checked (`check`). A connection error is a crash,
    no complete answer within `timeout_s` a hang."""
    report = Report()
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    loop = asyncio.get_running_loop()
    started = loop.time()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=window, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        queue = iter(cases)

        async def worker() -> None:
            for case in queue:
                try:
                    if case.raw is not None:
                        status, content_type, body = await _send_raw(host, int(port), case, timeout_s)
                    else:
                        # A file-like body for the big ones (aiohttp warns about big raw bytes).
                        data = io.BytesIO(case.body) if len(case.body) > 1 << 20 else case.body or None
                        async with session.request(
                            case.method, base_url + case.path, data=data,
                            headers=dict(case.headers), skip_auto_headers=("Content-Type",),
                        ) as resp:
                            status, content_type, body = resp.status, resp.content_type, await resp.read()
                except TimeoutError:
                    report.outcome(case, 0, "hang")
                    continue
                except (aiohttp.ClientError, ConnectionError) as e:
                    report.outcome(case, 0, f"crash ({e!r:.120})")
                    continue
                report.outcome(case, status, check(case, status, content_type, body), body)

        await asyncio.gather(*(worker() for _ in range(window)))
    report.wall_s = loop.time() - started
    return report
