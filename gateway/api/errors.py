"""The OpenAI error shape: `{"error": {"message", "type", "param", "code"}}`, as a JSON body or an SSE event.

Owns: `ApiError` (status + body fields), the constructors for each case the gateway answers, and rendering.
  400 invalid_request_error  malformed JSON, invalid fields (`param` names the field), engine-side rejections;
                             code context_length_exceeded: an output limit beyond the model's context
  401 invalid_request_error  code invalid_api_key (a key that matches none); no key at all: code null
  403 invalid_request_error  code model_not_allowed (the API key may not use the model)
  404 invalid_request_error  code model_not_found
  408 invalid_request_error  code body_read_timeout (the body did not arrive within body_read_timeout_s)
  429 requests | tokens      code rate_limit_exceeded (type: which of the key's limits refused, as OpenAI's)
  413 invalid_request_error  code request_too_large
  503 service_unavailable    code fleet_saturated (admission control; with Retry-After)
  503 service_unavailable    code no_engine_available (shutting_down once the drain deadline passes)
  504 timeout_error          code request_timeout; stream_idle_timeout (an engine silent for too long)
  500 server_error           code internal_error; an engine failing mid-stream is code engine_failure
Must not: know about engines, policies or the dispatcher.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web


class ApiError(Exception):
    """An error the API answers with; raise it anywhere in a handler."""

    def __init__(
        self, status: int, message: str, type: str, param: str | None = None, code: str | None = None
    ) -> None:
        if not message.isascii():  # a lone surrogate a client sent (a model name, a header) cannot be encoded
            message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist or is not served by this gateway.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def request_too_large(limit_bytes: int) -> ApiError:
    return ApiError(
        413,
        f"Request body exceeds the limit of {limit_bytes} bytes.",
        "invalid_request_error",
        None,
        "request_too_large",
    )


def context_exceeded(param: str, value: int, limit_tokens: int) -> ApiError:
    return ApiError(
        400,
        f"Invalid value for '{param}': {value} exceeds the model's context length of {limit_tokens} tokens.",
        "invalid_request_error",
        param,
        "context_length_exceeded",
    )


def body_read_timeout(timeout_s: float) -> ApiError:
    return ApiError(
        408,
        f"The request body did not arrive within {timeout_s:g} s.",
        "invalid_request_error",
        None,
        "body_read_timeout",
    )


def stream_idle(timeout_s: float) -> ApiError:
    return ApiError(
        504,
        f"The engine sent nothing for {timeout_s:g} s; the request was ended.",
        "timeout_error",
        None,
        "stream_idle_timeout",
    )


def no_engine(model: str) -> ApiError:
    return ApiError(
        503,
        f"No engine is available to serve model `{model}`; try again later.",
        "service_unavailable",
        None,
        "no_engine_available",
    )


def fleet_saturated(model: str, reason: str) -> ApiError:
    why = {
        "slo_unattainable": "no engine can serve it within its time-to-first-token target",
        "queue_full": "the gateway's queue for it is full",
        "preempted": "a request of higher priority took its place in the queue",
        "slo_expired": "it waited in the gateway's queue past its time-to-first-token target",
    }.get(reason, reason)
    return ApiError(
        503,
        f"The fleet serving model `{model}` is saturated ({why}); retry after the Retry-After delay.",
        "service_unavailable",
        None,
        "fleet_saturated",
    )


def timed_out(timeout_s: float) -> ApiError:
    return ApiError(
        504, f"The request did not finish within {timeout_s:g} s.", "timeout_error", None, "request_timeout"
    )


def shutting_down() -> ApiError:
    return ApiError(
        503, "The gateway is shutting down; retry the request.", "service_unavailable", None, "shutting_down"
    )


def engine_failure(message: str) -> ApiError:
    return ApiError(
        500, f"The engine failed while generating: {message}", "server_error", None, "engine_failure"
    )


def internal_error() -> ApiError:
    return ApiError(500, "Internal server error.", "server_error", None, "internal_error")


def not_found_route(path: str) -> ApiError:
    return ApiError(404, f"Unknown route {path}.", "invalid_request_error", None, "unknown_url")


def method_not_allowed(method: str, path: str) -> ApiError:
    return ApiError(
        405, f"Method {method} is not allowed on {path}.", "invalid_request_error", None, "method_not_allowed"
    )


def missing_api_key() -> ApiError:
    return ApiError(
        401,
        "You didn't provide an API key. You need to provide your API key in an Authorization header using "
        "Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
        "invalid_request_error",
    )


def invalid_api_key() -> ApiError:
    # Unlike OpenAI's, the message does not echo part of the key: a wrong key may be another service's.
    return ApiError(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")


def model_not_allowed(model: str, key_name: str) -> ApiError:
    return ApiError(
        403,
        f"The API key `{key_name}` is not allowed to use the model `{model}`.",
        "invalid_request_error",
        "model",
        "model_not_allowed",
    )


def rate_limited(message: str, limit_type: str) -> ApiError:
    """429; `limit_type` is "requests" or "tokens", as OpenAI's `type` (headers travel in the response's)."""
    return ApiError(429, message, limit_type, None, "rate_limit_exceeded")


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=err.status, body=orjson.dumps(err.body()), content_type="application/json", headers=headers
    )
