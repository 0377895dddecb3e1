"""The OpenAI error shape: `{"error": {"message", "type", "param", "code"}}`, as a JSON body or an SSE event.

Owns: `ApiError` (status + body fields), the constructors for each case the gateway answers, and rendering.
  400 invalid_request_error  malformed JSON, invalid fields (`param` names the field), engine-side rejections
  404 invalid_request_error  code model_not_found
  413 invalid_request_error  code request_too_large
  503 service_unavailable    code no_engine_available (shutting_down once the drain deadline passes)
  504 timeout_error          code request_timeout
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


def no_engine(model: str) -> ApiError:
    return ApiError(
        503,
        f"No engine is available to serve model `{model}`; try again later.",
        "service_unavailable",
        None,
        "no_engine_available",
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


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=err.status, body=orjson.dumps(err.body()), content_type="application/json", headers=headers
    )
